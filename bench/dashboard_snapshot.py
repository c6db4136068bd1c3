"""A picture of the Grafana dashboard (charts/inferscale/files/grafana-dashboard.json) drawn from a real run.

Grafana does not run on these machines, so this draws the dashboard's own panels with matplotlib: every panel's
PromQL expressions are evaluated here (the few forms the dashboard uses: sum / max [by (labels)] of a gauge or of
rate(counter[w]), and histogram_quantile(q, sum by (le) (rate(histogram_bucket[w])))) over a series of scrapes of
the running service's Prometheus endpoint (Ray's metrics agent, what the chart's PodMonitor scrapes).

1. Starts the application as `inferscale serve` runs it (local Ray on 127.0.0.1 with a known metrics export port,
   Serve's proxies on 127.0.0.1, one replica of each deployment, the packaged SmolLM2-135M, a redis-server on a
   free loopback port), or uses --scrapes to redraw a saved run.
2. Sends load through the gRPC front door for --duration seconds: --users users with their own facts, each
   asking questions one after another (KV injection, and prompt injection every third request), plus halfway a
   burst of BURST concurrent long answers (users of their own) to show the queues and KV-cache use move.
3. Scrapes the metrics endpoint every --period seconds while the load runs and for a while after; keeps the
   series the dashboard reads (bench/results/dashboard_scrapes.json) and draws docs/dashboard.png.

Usage:
  python bench/dashboard_snapshot.py                      # ~4 min on a 2-core machine
  python bench/dashboard_snapshot.py --scrapes bench/results/dashboard_scrapes.json   # redraw only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DASHBOARD = REPO / "charts" / "inferscale" / "files" / "grafana-dashboard.json"
RATE_INTERVAL_S = 30.0  # what $__rate_interval stands for here (Grafana: 4 x the scrape interval at least)

# ------------------------------------------------------------------------------------------ PromQL, the subset
_SEL = r"(?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<matchers>[^}]*)\})?"
_RATE = rf"rate\({_SEL}\[(?P<window>[^\]]+)\]\)"
_AGG = r"(?P<agg>sum|max)(?:\s+by\s+\((?P<by>[^)]*)\))?"
FORMS = [
    ("quantile", re.compile(rf"^histogram_quantile\((?P<q>[0-9.]+),\s*sum by \(le\) \({_RATE}\)\)$")),
    ("rate", re.compile(rf"^{_AGG}\s*\({_RATE}\)$")),
    ("gauge", re.compile(rf"^{_AGG}\s*\({_SEL}\)$")),
]


def parse_expr(expr: str) -> dict:
    """One of the dashboard's PromQL forms -> {"form", "metric", "matchers", "by", "agg", "q", "window"};
    ValueError for anything else (tests/packaging/test_chart.py checks every panel parses)."""
    for form, rx in FORMS:
        m = rx.match(expr.strip())
        if m:
            d = m.groupdict()
            matchers = dict(re.findall(r'(\w+)="([^"]*)"', d.get("matchers") or ""))
            by = tuple(x.strip() for x in (d.get("by") or "").split(",") if x.strip())
            return {"form": form, "metric": d["metric"], "matchers": matchers, "by": by, "agg": d.get("agg", "sum"),
                    "q": float(d["q"]) if d.get("q") else None, "window": d.get("window")}
    raise ValueError(f"not a PromQL form this renderer evaluates: {expr}")


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every metric name the dashboard's panels read (histograms by their _bucket series)."""
    return {parse_expr(t["expr"])["metric"] for p in dashboard["panels"] for t in p["targets"]}


def _window_s(window: str) -> float:
    if window == "$__rate_interval":
        return RATE_INTERVAL_S
    m = re.fullmatch(r"(\d+)([smh])", window)
    if not m:
        raise ValueError(f"window {window!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def _select(scrape: dict, metric: str, matchers: dict) -> list[tuple[dict, float]]:
    return [(lb, v) for name, lb, v in scrape["samples"]
            if name == metric and all(lb.get(k) == want for k, want in matchers.items())]


def _groups(rows: list[tuple[dict, float]], by: tuple[str, ...], agg: str) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for lb, v in rows:
        key = tuple(lb.get(b, "") for b in by)
        out[key] = v if key not in out else (out[key] + v if agg == "sum" else max(out[key], v))
    return out


def _per_series_rate(scrapes: list[dict], i: int, metric: str, matchers: dict, window_s: float) -> list:
    """(labels, per-second increase over the window ending at scrape i) per series; counter resets count from 0."""
    t = scrapes[i]["t"]
    j = next((k for k in range(i, -1, -1) if t - scrapes[k]["t"] >= window_s), None)
    if j is None:
        return []
    span = t - scrapes[j]["t"]
    before = {json.dumps(lb, sort_keys=True): v for lb, v in _select(scrapes[j], metric, matchers)}
    out = []
    for lb, v in _select(scrapes[i], metric, matchers):
        prev = before.get(json.dumps(lb, sort_keys=True), 0.0)
        out.append((lb, (v - prev if v >= prev else v) / span))
    return out


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket rates {le: rate} (linear within a bucket)."""
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total <= 0:
        return None
    rank, prev_le, prev_c = q * total, 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return les[-2] if len(les) > 1 else None


def evaluate(expr: str, scrapes: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
    """The expression at every scrape: {group labels: [(t, value)]}."""
    p = parse_expr(expr)
    out: dict[tuple, list] = {}
    for i, s in enumerate(scrapes):
        if p["form"] == "gauge":
            values = _groups(_select(s, p["metric"], p["matchers"]), p["by"], p["agg"])
        elif p["form"] == "rate":
            values = _groups(_per_series_rate(scrapes, i, p["metric"], p["matchers"], _window_s(p["window"])),
                             p["by"], p["agg"])
        else:
            rows = _per_series_rate(scrapes, i, p["metric"], p["matchers"], _window_s(p["window"]))
            buckets: dict[float, float] = {}
            for lb, v in rows:
                le = float(lb["le"])
                buckets[le] = buckets.get(le, 0.0) + v
            value = _quantile(p["q"], buckets)
            values = {(): value} if value is not None else {}
        for key, v in values.items():
            out.setdefault(key, []).append((s["t"], v))
    return out


def legend(fmt: str, by: tuple[str, ...], key: tuple) -> str:
    labels = dict(zip(by, key))
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or ",".join(key)


def render(dashboard: dict, scrapes: list[dict], meta: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(15, 4.2 * rows), squeeze=False)
    t0 = scrapes[0]["t"]
    for ax, panel in zip(axes.flat, panels):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        scale = 1000.0 if unit == "s" else 100.0 if unit == "percentunit" else 1.0
        drawn = 0
        for target in panel["targets"]:
            p = parse_expr(target["expr"])
            for key, pts in sorted(evaluate(target["expr"], scrapes).items()):
                ax.plot([t - t0 for t, _ in pts], [v * scale for _, v in pts], marker=".", markersize=3,
                        label=legend(target.get("legendFormat", ""), p["by"], key))
                drawn += 1
        ax.set_title(panel["title"], fontsize=11)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel({"s": "ms", "percentunit": "% of the KV cache", "reqps": "requests / s"}.get(unit, "per second"
                                                                                                  if "rate(" in str(panel["targets"]) else ""))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no samples in this run", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']} dashboard (charts/inferscale/files/grafana-dashboard.json), its panels "
                 f"drawn by bench/dashboard_snapshot.py from {len(scrapes)} Prometheus scrapes of a real run\n"
                 f"{meta.get('what', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    print(f"# wrote {png}")


# ------------------------------------------------------------------------------------------ the run
def scrape(url: str, keep: set[str]) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=30).read().decode()  # noqa: S310 - a loopback URL built here
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in keep:
                out.append([s.name, {k: v for k, v in s.labels.items() if k in KEEP_LABELS}, s.value])
    return out


KEEP_LABELS = {"le", "deployment", "code", "source", "ReplicaId", "rpc", "mode", "model_name", "engine", "tier"}


@contextlib.contextmanager
def service(workdir: Path):
    """The app as `inferscale serve` starts it, on a local Ray bound to 127.0.0.1 with a known metrics port."""
    import ray
    from ray import serve

    from bench.local_redis import local_redis_server
    from inferscale_core.vllm_env import vllm_cpu_env
    from inferscale_server.app import ServiceConfig, serve_start_env, single_node_deployments, start_service
    from inferscale_server.local_processes import free_port

    secret = secrets.token_urlsafe(48).encode()
    (workdir / "jwt").write_bytes(secret)
    metrics_port = free_port()
    with local_redis_server() as redis_url:
        cfg = ServiceConfig(registry_url=redis_url, kv_dir=str(workdir / "kv"), max_model_len=2048,
                            http_port=free_port(), grpc_port=free_port(), deployments=single_node_deployments(),
                            auth={"hs256_secret_file": str(workdir / "jwt")})
        env = {**vllm_cpu_env(), **serve_start_env("127.0.0.1")}
        os.environ.update(env)
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="ERROR", _node_ip_address="127.0.0.1", _metrics_export_port=metrics_port,
                 runtime_env={"env_vars": env})
        try:
            t0 = time.monotonic()
            start_service(cfg, host="127.0.0.1")
            print(f"# service up in {time.monotonic() - t0:.0f} s", flush=True)
            yield cfg, secret, f"http://127.0.0.1:{metrics_port}/metrics"
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


FACTS = ["{n} grows tomatoes on the balcony.", "{n} plays the cello on Sundays.", "{n} drives a green van.",
         "{n} has two daughters, Mia and Lou.", "{n} is allergic to peanuts.", "{n} moved to Bergen in 2021.",
         "{n} works as a nurse at night.", "{n} runs a half marathon every spring.", "{n} collects old maps.",
         "{n} learned Japanese at university.", "{n} owns a grey cat called Pixel.", "{n} dislikes cilantro."]
QUESTIONS = ["What does {n} grow?", "Which instrument does {n} play?", "What does {n} drive?",
             "What is {n} allergic to?", "Where did {n} move?", "What is the name of {n}'s cat?"]
NAMES = ["Ines", "Tariq", "Mele", "Joon", "Ada", "Bo"]
BURST = 8  # concurrent long answers halfway through the run


def load(cfg, secret: bytes, users: int, duration_s: float, stop: threading.Event) -> dict:
    """Each user asks its questions one after another until the time is up (bounded in count and time);
    halfway, a burst of concurrent long answers. Returns counts by status."""
    import grpc

    from inferscale_client import MemoryClient
    from inferscale_server.auth import SCOPE_ADMIN, USER_SCOPES, mint

    token = mint(secret, "dashboard-admin", (*USER_SCOPES, SCOPE_ADMIN))
    target = f"127.0.0.1:{cfg.grpc_port}"
    counts: dict[str, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def count(code: str) -> None:
        with lock:
            counts[code] = counts.get(code, 0) + 1

    def ask(c, uid: str, name: str, i: int, max_tokens: int) -> None:
        try:
            for _ in c.answer(uid, QUESTIONS[i % len(QUESTIONS)].format(n=name), k=5, max_tokens=max_tokens,
                              mode="prompt" if i % 3 == 2 else "inject"):
                pass
            count("OK")
        except grpc.RpcError as e:
            count(e.code().name)

    def user(u: int) -> None:
        name, uid = NAMES[u % len(NAMES)], f"dash-user-{u}"
        with MemoryClient(target, token=token, timeout_s=300, retry=False) as c:
            c.add_facts(uid, [f.format(n=name) for f in FACTS])
            for i in range(10_000):
                if time.monotonic() > end or stop.is_set():
                    return
                ask(c, uid, name, i, 16)

    def burst() -> None:
        """BURST users of their own (a user's answers run one at a time), one long answer each, all at once."""
        with MemoryClient(target, token=token, timeout_s=300, retry=False) as c:
            for b in range(BURST):
                c.add_facts(f"dash-burst-{b}", [f.format(n=NAMES[b % len(NAMES)]) for f in FACTS[:4]])
            time.sleep(max(0.0, end - duration_s / 2 - time.monotonic()))
            threads = [threading.Thread(target=ask, args=(c, f"dash-burst-{b}", NAMES[b % len(NAMES)], b, 96))
                       for b in range(BURST)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)] + [threading.Thread(target=burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 400)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=Path, default=None, help="redraw from saved scrapes (no run)")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    ap.add_argument("--tail", type=float, default=40.0, help="seconds scraped after the load")
    ap.add_argument("--period", type=float, default=5.0, help="seconds between scrapes")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dashboard_scrapes.json")
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "dashboard.png")
    args = ap.parse_args(argv)
    if not (1 <= args.users <= 16 and 10 <= args.duration <= 1800 and 1 <= args.period <= 60):
        ap.error("--users in 1..16, --duration in 10..1800 s, --period in 1..60 s")
    dashboard = json.loads(DASHBOARD.read_text())
    if args.scrapes:
        saved = json.loads(args.scrapes.read_text())
        render(dashboard, saved["scrapes"], saved["meta"], args.png)
        return 0
    import tempfile

    from inferscale_core.vllm_env import set_vllm_cpu_env

    set_vllm_cpu_env()
    keep = dashboard_metrics(dashboard)
    scrapes: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, service(Path(tmp)) as (cfg, secret, url):
        stop = threading.Event()
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(load(cfg, secret, args.users, args.duration, stop)))
        runner.start()
        deadline = time.time() + args.duration + 600  # bounded even if the load overruns
        tail_end = None
        while time.time() < deadline and (tail_end is None or time.time() < tail_end):
            try:
                scrapes.append({"t": time.time(), "samples": scrape(url, keep)})
            except OSError as e:
                print(f"# scrape failed: {e}", flush=True)
            if tail_end is None and not runner.is_alive():
                tail_end = time.time() + args.tail  # the load is over: the panels settle
            time.sleep(args.period)
        stop.set()
        runner.join(60)
    with open("/proc/loadavg") as f:
        load_avg = f.read().split()[0]
    flags = [fl for fl in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
             if fl in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")]
    meta = {"what": f"CPU run on this machine ({os.cpu_count()} cores, flags {' '.join(flags)}, load {load_avg}): "
                    f"SmolLM2-135M on vllm-cpu, {args.users} users + a burst of {BURST} long answers, gRPC; "
                    f"calls by status {json.dumps(result, sort_keys=True)}",
            "period_s": args.period, "duration_s": args.duration}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "scrapes": scrapes}) + "\n")
    print(f"# {len(scrapes)} scrapes -> {args.out}; calls {result}")
    missing = sorted(keep - {name for s in scrapes for name, _, _ in s["samples"]})
    if missing:
        print(f"# WARNING: the run exported none of {missing}")
    render(dashboard, scrapes, meta, args.png)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
