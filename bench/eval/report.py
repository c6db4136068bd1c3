"""Benchmark report: the results dict as JSON, Markdown tables and PNG plots.

Plots are drawn with matplotlib's Agg canvas directly (no pyplot), so no display or global backend
state is involved."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .locomo import CATEGORY_NAMES

PREFIX = "locomo"


def write_report(results: dict, out_dir: str | Path) -> list[Path]:
    """Write <out>/locomo_results.json, locomo_results.md and three PNG plots; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{PREFIX}_results.json", out / f"{PREFIX}_results.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    paths[1].write_text(markdown(results))
    paths.append(_plot_latency(results, out / f"{PREFIX}_latency_vs_k.png"))
    paths.append(_plot_throughput(results, out / f"{PREFIX}_throughput_vs_users.png"))
    paths.append(_plot_accuracy(results, out / f"{PREFIX}_accuracy_vs_k.png"))
    return paths


def _json_default(obj):
    if isinstance(obj, (tuple, set)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-serializable: {type(obj).__name__}")


# ---- Markdown

def _setup_line(results: dict) -> str:
    m, t, b = results.get("machine") or {}, results.get("timing") or {}, results.get("backend")
    if not m and not t:
        return ""
    backend = ", ".join(f"{k} {v}" for k, v in b.items()) if isinstance(b, dict) else (b or "")
    load = t.get("loadavg_start")
    flags = f", flags {' '.join(m['cpu_flags'])}" if m.get("cpu_flags") else ""
    return (f"Machine: {m.get('device', '?')} ({m.get('cpu_model', '')}{flags}); backend: {backend}; "
            f"wall {_f(t.get('wall_s'), 0)} s, accuracy phase {_f(t.get('s_per_question'), 2)} s per question "
            f"({t.get('requests_per_question', '?')} requests); load average at start "
            f"{_f(load[0] if load else None, 1)}, at end {_f((t.get('loadavg_end') or [None])[0], 1)}.\n")

def _f(x, digits=3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ms(x) -> str:
    return "–" if x is None else f"{1000 * x:.1f}"


def _ci(b: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    if not b:
        return "–"
    return (f"{b['mean_diff'] * scale:+.{digits}f} [{b['lo'] * scale:+.{digits}f}, "
            f"{b['hi'] * scale:+.{digits}f}]")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _w(w) -> str:
    return "–" if w is None else str(w)


def markdown(results: dict) -> str:
    cfg, ds = results["config"], results["dataset"]
    judged = any(a["judge"] for a in results["accuracy"])
    judge_name = cfg.get("judge_model") or ("custom" if judged else "none")
    parts = [
        "# LoCoMo: KV injection (kv) vs prompt injection (pi)\n",
        f"Data `{ds['path']}`: conversations {', '.join(ds['conversations'])}; {ds['n_facts']} facts; "
        f"{ds['n_questions']} answerable questions ("
        + ", ".join(f"{name} {n}" for name, n in ds["per_category"].items()) + ").  ",
        f"Model `{cfg.get('model') or 'engine default'}`; judge `{judge_name}`; "
        f"k = {list(cfg['k'])}, w = {list(cfg['w'])} ({cfg.get('window_kind', 'turns')} windows, facts added "
        f"one {cfg.get('add_as', 'conversation')} per call); "
        f"bootstrap {cfg['bootstrap_resamples']} resamples, seed {cfg['seed']}.\n",
        "F1 is LoCoMo's token F1 (per-category rules, stemmed); w does not apply to pi.\n",
        _setup_line(results),
        "## Accuracy\n",
    ]
    cats = [str(c) for c in (1, 2, 3, 4)]
    header = ["mode", "k", "w", "n", "F1"] + [f"F1 {CATEGORY_NAMES[int(c)]}" for c in cats]
    header += (["judge acc", "unparsed"] if judged else []) + ["evidence recall"]
    rows = []
    for a in results["accuracy"]:
        row = [a["mode"], a["k"], _w(a["w"]), a["n"], _f(a["f1"]["overall"]["mean"])]
        row += [_f(a["f1"].get(c, {}).get("mean")) for c in cats]
        if judged:
            j = a["judge"] or {}
            row += [_f(j.get("overall", {}).get("mean")), j.get("overall", {}).get("missing", "–")]
        rows.append(row + [_f(a["evidence_recall"])])
    parts.append(_table(header, rows))

    parts.append("\n## KV minus PI (paired by question, mean [95% bootstrap CI])\n")
    header = ["k", "w", "n", "ΔF1"] + (["Δjudge acc"] if judged else []) + ["ΔTTFT ms", "Δq→first token ms",
                                                                           "Δtotal ms"]
    rows = []
    for c in results["comparisons"]:
        row = [c["k"], c["w"], c["n"], _ci(c["f1"])] + ([_ci(c["judge"])] if judged else [])
        rows.append(row + [_ci(c["ttft_s"], 1000, 1), _ci(c["q2ft_s"], 1000, 1), _ci(c["total_s"], 1000, 1)])
    parts.append(_table(header, rows))
    if results["comparisons"]:
        parts.append("\nΔF1 by category:\n\n")
        rows = [[c["k"], c["w"]] + [_ci(c["f1_by_category"].get(cat)) for cat in cats] for c in results["comparisons"]]
        parts.append(_table(["k", "w"] + [CATEGORY_NAMES[int(c)] for c in cats], rows))

    parts.append("\n## Latency, one request at a time (ms; mean / p50 / p95)\n")
    rows = []
    for lat in results["latency"]:
        t, q, tot = lat["ttft_s"], lat["q2ft_s"], lat["total_s"]
        inj = (lat.get("inject_s") or {}).get("mean")
        rows.append([lat["mode"], lat["k"], _w(lat["w"]), t["n"], _f((lat.get("prompt_len") or {}).get("mean"), 0),
                     _f((lat.get("cached_tokens") or {}).get("mean"), 0),
                     f"{_ms(t['mean'])} / {_ms(t['p50'])} / {_ms(t['p95'])}",
                     f"{_ms(q['mean'])} / {_ms(q['p50'])} / {_ms(q['p95'])}",
                     f"{_ms(tot['mean'])} / {_ms(tot['p50'])} / {_ms(tot['p95'])}", _ms(inj)])
    parts.append(_table(["mode", "k", "w", "n", "prompt tokens", "not prefilled", "engine TTFT",
                         "question→first token", "question→full answer", "injection"], rows))

    if results.get("throughput"):
        parts.append("\n## Throughput (N users, all requests arriving at once, prefix cache emptied first)\n")
        rows = [[t["users"], t["mode"], t["k"], _w(t["w"]), t["requests"], _f(t["req_per_s"], 2),
                 _f(t.get("output_tokens_per_s"), 1), _ms((t.get("ttft_s") or {}).get("p50")),
                 _ms(t["latency_s"]["p50"]), _ms(t["latency_s"]["p95"]), _f(t.get("loadavg"), 1)]
                for t in results["throughput"]]
        parts.append(_table(["users", "mode", "k", "w", "requests", "req/s", "output tok/s", "TTFT p50 ms",
                             "latency p50 ms", "latency p95 ms", "load avg"], rows))

    if results.get("encode"):
        parts.append("\n## Adding facts (encode once)\n")
        rows = []
        for e in results["encode"]:
            b = e.get("bytes") or {}
            rows.append([e["sample_id"], e["w"], e["n_facts"], _f(e["add_facts_s"], 1),
                         _ms(e["add_facts_s"] / e["n_facts"]) if e["n_facts"] else "–",
                         _mib(b.get("kv")), _mib(b.get("index")), _mib(b.get("map")), _f(e.get("loadavg"), 1)])
        parts.append(_table(["conversation", "w", "facts", "seconds", "ms per fact", "KV MiB", "index MiB",
                             "map MiB", "load avg"], rows))
    return "\n".join(parts)


def _mib(x) -> str:
    return "–" if x is None else f"{x / 2**20:.2f}"


# ---- Plots

def _figure(ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _series(rows: list[dict], mode: str, w, value) -> tuple[list, list]:
    pts = sorted((r["k"], value(r)) for r in rows if r["mode"] == mode and r["w"] == w and value(r) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _labels(rows: list[dict]) -> list[tuple[str, object, str]]:
    """(mode, w, label) for each line: pi once, kv once per w."""
    ws = sorted({r["w"] for r in rows if r["mode"] == "kv"})
    out = [("pi", None, "prompt injection")] if any(r["mode"] == "pi" for r in rows) else []
    return out + [("kv", w, f"KV injection, w={w}") for w in ws]


def _plot_latency(results: dict, path: Path) -> Path:
    fig, (ax1, ax2) = _figure(2)
    rows = results["latency"]
    for ax, key, title in ((ax1, "ttft_s", "time to first token"), (ax2, "q2ft_s", "question → first token")):
        for i, (mode, w, label) in enumerate(_labels(rows)):
            color = f"C{i}"
            ks, p50 = _series(rows, mode, w, lambda r: _scaled(r[key]["p50"]))
            ax.plot(ks, p50, marker="o", color=color, linestyle="--" if mode == "pi" else "-", label=f"{label} p50")
            ks, p95 = _series(rows, mode, w, lambda r: _scaled(r[key]["p95"]))
            ax.plot(ks, p95, marker="^", color=color, linestyle=":", alpha=0.6)
        ax.set(title=f"{title} (p50; p95 dotted)", xlabel="k (facts retrieved)", ylabel="ms",
               xticks=sorted({r["k"] for r in rows}))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _scaled(x):
    return None if x is None else 1000 * x


def _plot_throughput(results: dict, path: Path) -> Path:
    fig, (ax,) = _figure(1)
    rows = results.get("throughput") or []
    for i, mode in enumerate(m for m in ("pi", "kv") if any(r["mode"] == m for r in rows)):
        pts = sorted((r["users"], r["req_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                label="prompt injection" if mode == "pi" else "KV injection")
    ax.set(title="throughput vs concurrent users", xlabel="concurrent users", ylabel="requests / s",
           xticks=sorted({r["users"] for r in rows}))
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no throughput phase", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=110)
    return path


def _plot_accuracy(results: dict, path: Path) -> Path:
    rows = results["accuracy"]
    judged = any(r["judge"] for r in rows)
    fig, axes = _figure(2 if judged else 1)
    panels = [("F1", lambda r: r["f1"]["overall"]["mean"])]
    if judged:
        panels.append(("judge accuracy", lambda r: (r["judge"] or {}).get("overall", {}).get("mean")))
    for ax, (name, value) in zip(axes, panels):
        for i, (mode, w, label) in enumerate(_labels(rows)):
            ks, ys = _series(rows, mode, w, value)
            ax.plot(ks, ys, marker="o", color=f"C{i}", linestyle="--" if mode == "pi" else "-", label=label)
        ax.set(title=f"{name} vs k", xlabel="k (facts retrieved)", ylabel=name, xticks=sorted({r["k"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path
