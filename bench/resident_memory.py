"""Resident memory of every service process while users' facts are added and answered (issue 18, "Bounded
memory"): is each process flat after the first round, and does each KV tier stay within its budget?

The app runs as `inferscale serve` ships it (local Ray on 127.0.0.1, one replica of each deployment, the packaged
SmolLM2, a disk tier, vLLM's KV cache sized from the machine) with a redis-server and a Mooncake Store
(mooncake_master + one segment of --segment-gib) on free loopback ports as the cluster KV tier. U users get F
LoCoMo facts each, added through gRPC in rounds of R facts (every user gets R/U more facts a round, so every user
grows), and after each round A of the users are answered (k facts injected, a question not asked before).
After each round it records:
  - the RSS of EVERY process of the service (Ray's workers by their process title: EngineReplica, EncoderPool,
    Retrieval, Gateway, Serve's controller and proxy; vLLM's EngineCore; mooncake_master and the segment's
    mooncake_client; redis-server; Ray's own gcs_server, raylet and agents; this driver);
  - every KV tier's bytes against its budget: the engine replica's resident KV (ResidentKV, bytes / budget), the
    worker store's device / host / disk tiers (bytes / budgets; the disk tier has none), the disk tier's files
    (du), the cluster tier (objects put by the encoder pool; the segment's size is its budget).
Targets: each process within 20% of its RSS after the first round; each tier within its budget.

    python bench/resident_memory.py --dtype bfloat16                # 100 users x 100 facts, rounds of 500
    python bench/resident_memory.py --quick                         # the fixture data, 4 users x 10 facts
A run stops adding rounds at --deadline-min (default 60) and says how many facts it reached; nothing is
extrapolated.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# bench/service.py (imported where used) sets vLLM's environment on import; the /proc helpers here need none.
FIXTURE = REPO / "tests" / "fixtures" / "locomo_mini.json"

APP = "inferscale"
FLAT = 1.2  # issue 18: each process within 20% of its value after the first 500 facts
# Process title (Ray sets `ray::<actor>`; vLLM `VLLM::EngineCore`) or executable -> the row's name.
ROLES = (("ServeReplica:inferscale:EngineReplica", "EngineReplica"), ("VLLM::EngineCore", "vLLM EngineCore"),
         ("ServeReplica:inferscale:EncoderPool", "EncoderPool"), ("ServeReplica:inferscale:Retrieval", "Retrieval"),
         ("ServeReplica:inferscale:Gateway", "Gateway"), ("ray::ServeController", "Serve controller"),
         ("ray::ProxyActor", "Serve proxy"), ("mooncake_master", "mooncake_master"),
         ("mooncake_client", "mooncake_client (segment)"), ("redis-server", "redis-server"),
         ("gcs_server", "Ray gcs_server"), ("raylet", "Ray raylet"), ("ray::DashboardAgent", "Ray dashboard agent"),
         ("ray::RuntimeEnvAgent", "Ray runtime-env agent"), ("dashboard/dashboard.py", "Ray dashboard"),
         ("log_monitor.py", "Ray log monitor"), ("monitor.py", "Ray monitor"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the fixture data, 4 users x 10 facts, rounds of 20")
    ap.add_argument("--data", type=Path, default=None, help="LoCoMo JSON (default ../shared/data/locomo_dev.json)")
    ap.add_argument("--users", type=int, default=None, help="users (default 100)")
    ap.add_argument("--facts-per-user", type=int, default=None, help="facts each user ends with (default 100)")
    ap.add_argument("--round-facts", type=int, default=None, help="facts added per round (default 500)")
    ap.add_argument("--answers-per-round", type=int, default=None, help="users answered after each round (default 20)")
    ap.add_argument("--k", type=int, default=10, help="facts injected per answer")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="serve's default: float32")
    ap.add_argument("--segment-gib", type=float, default=1.0, help="the Mooncake segment (the cluster tier's budget)")
    ap.add_argument("--threads", type=int, default=8, help="concurrent AddFacts calls")
    ap.add_argument("--deadline-min", type=float, default=None, help="no new round after this (default 60; quick 10)")
    ap.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/resident_memory_<dtype>.json)")
    args = ap.parse_args(argv)
    args.users = args.users or (4 if args.quick else 100)
    args.facts_per_user = args.facts_per_user or (10 if args.quick else 100)
    args.round_facts = args.round_facts or (20 if args.quick else 500)
    args.answers_per_round = args.answers_per_round or (2 if args.quick else 20)
    args.deadline_min = args.deadline_min or (10.0 if args.quick else 60.0)
    args.out = args.out or REPO / "bench" / "results" / f"resident_memory_{args.dtype}.json"
    if args.data is None:
        from bench.eval.locomo import default_data_path

        args.data = FIXTURE if args.quick else default_data_path()
    problems = []
    if args.data is None or not Path(args.data).is_file():
        problems.append("LoCoMo data not found: pass --data PATH (or --quick for the repository's fixture)")
    if min(args.users, args.facts_per_user, args.round_facts, args.answers_per_round, args.k) < 1:
        problems.append("--users, --facts-per-user, --round-facts, --answers-per-round and --k must be >= 1")
    elif args.round_facts % args.users:
        problems.append(f"--round-facts {args.round_facts} must be a multiple of --users {args.users} "
                        "(every user gets the same number of facts a round)")
    elif args.facts_per_user % (args.round_facts // args.users):
        problems.append("--facts-per-user must be a multiple of --round-facts / --users")
    if args.answers_per_round > args.users:
        problems.append("--answers-per-round cannot exceed --users")
    if args.segment_gib <= 0:
        problems.append("--segment-gib must be > 0")
    if problems:
        ap.error("; ".join(problems))
    return args


# ------------------------------------------------------------------------------------------ processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and parentheses
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def role(pid: int, root: int) -> str | None:
    """The row a process belongs to, from its title or command line (None: not a service process)."""
    if pid == root:
        return "driver (this bench)"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for needle, name in ROLES:
        if needle in cmd:
            return name
    return None


def process_rss(root: int | None = None) -> dict[str, int]:
    """RSS per role over every descendant of `root` (default: this process); several processes of one role add
    up (their count is in the name when there is more than one)."""
    root = root or os.getpid()
    by_role: dict[str, list[int]] = {}
    for pid in descendants(root):
        name = role(pid, root)
        rss = rss_bytes(pid) if name else None
        if name and rss is not None:
            by_role.setdefault(name, []).append(rss)
    return {(n if len(v) == 1 else f"{n} (x{len(v)})"): sum(v) for n, v in by_role.items()}


def du_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
    return total


# ------------------------------------------------------------------------------------------ the service
@contextlib.contextmanager
def service(args, workdir: Path):
    """`inferscale serve`'s app (services/cli.py serve_cmd: its deployments, a disk tier, the KV cache sized from
    the machine) with a Redis registry and a Mooncake cluster tier on loopback. Yields (cfg, secret, mooncake)."""
    from cold_user import loopback_service

    from inferscale_core.vllm_env import serving_kv_cache_gib, vllm_cpu_env

    with loopback_service(args.dtype, workdir, env=vllm_cpu_env(serving_kv_cache_gib()),
                          segment_bytes=int(args.segment_gib * (1 << 30)), kv_dir=str(workdir / "kv")) as up:
        yield up


def tiers(args, cfg, n_facts: int) -> dict:
    """Every KV tier's bytes and budget (None: no budget) from the engine replica's and encoder pool's stats."""
    from cold_user import engine_stats, handle

    st = engine_stats("svc-probe")
    worker = st["engine"]["worker"]  # the engine worker's store (inferscale_core/connector_worker.py stats)
    cluster = handle("EncoderPool").cluster_stats.remote().result(timeout_s=60) or {}
    return {"resident_kv": {"bytes": st["resident"]["bytes"], "budget": st["resident"]["budget_bytes"],
                            "facts": st["resident"]["facts"]},
            "worker_device": {"bytes": worker.get("resident_bytes_device", 0),
                              "budget": worker.get("device_budget_bytes")},
            "worker_host": {"bytes": worker.get("resident_bytes_host", 0), "budget": None},
            "worker_disk": {"bytes": worker.get("resident_bytes_disk", 0), "budget": None},
            "disk_files": {"bytes": du_bytes(Path(cfg.kv_dir)), "budget": None},
            "cluster_puts": {"objects": cluster.get("puts", 0), "put_failures": cluster.get("put_failures", 0),
                             "budget": int(args.segment_gib * (1 << 30))},
            "counters": {k: st[k] for k in ("facts_from_cluster", "facts_from_disk", "facts_encoded",
                                            "facts_recomputed", "facts_evicted", "users_evicted") if k in st},
            "worker_facts": worker.get("num_facts"), "worker_users": worker.get("num_users"), "facts_added": n_facts}


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    from cold_user import Door
    from service import cpu_description, cpu_line, load_average, make_users

    t_run = time.monotonic()
    deadline = t_run + args.deadline_min * 60
    cpu = cpu_description()
    users = make_users(args.data, args.users, args.facts_per_user, "mem")
    per_user = args.round_facts // args.users
    n_rounds = args.facts_per_user // per_user
    result = {"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()}, "rounds": [],
              "load_start": load_average()}
    print(f"# {cpu_line(cpu)}; load {result['load_start']}; {args.users} users x {args.facts_per_user} facts in "
          f"{n_rounds} rounds of {args.round_facts}, {args.answers_per_round} answers (k={args.k}) a round", flush=True)
    questions = {u.user_id: iter(u.questions * 50) for u in users}
    with tempfile.TemporaryDirectory() as tmp, service(args, Path(tmp)) as (cfg, secret, mooncake):
        door = Door(cfg.grpc_port, secret)
        result["before"] = {"rss": process_rss(), "tiers": tiers(args, cfg, 0)}
        n = 0
        with ThreadPoolExecutor(args.threads) as pool:
            for r in range(n_rounds):
                if r and time.monotonic() > deadline:
                    print(f"# deadline: stopped after {r} rounds ({n} facts)", flush=True)
                    break
                t0 = time.monotonic()
                lo, hi = r * per_user, (r + 1) * per_user
                list(pool.map(lambda u: door.add(u.user_id, u.facts[lo:hi]), users))
                n += per_user * len(users)
                add_s = time.monotonic() - t0
                t1 = time.monotonic()
                answered = [users[(r * args.answers_per_round + i) % len(users)]
                            for i in range(args.answers_per_round)]
                answers = list(pool.map(lambda u: door.answer(u.user_id, next(questions[u.user_id]),
                                                              k=min(args.k, hi), max_tokens=args.max_tokens),
                                        answered))
                answer_s = time.monotonic() - t1
                row = {"facts": n, "add_s": round(add_s, 1), "answer_s": round(answer_s, 1),
                       "answer_facts": sum(a["facts"] for a in answers), "load": load_average(),
                       "rss": process_rss(), "tiers": tiers(args, cfg, n)}
                result["rounds"].append(row)
                big = sorted(row["rss"].items(), key=lambda kv: -kv[1])[:4]
                print(f"round {r + 1}: {n} facts, add {add_s:.0f} s, answer {answer_s:.0f} s, load {row['load']}; "
                      + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in big), flush=True)
    result["wall_s"] = round(time.monotonic() - t_run)
    result["verdicts"] = verdicts(result)
    print(markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"written: {args.out}")
    return 0


def verdicts(result: dict) -> dict:
    """Per process: max RSS over the rounds / RSS after the first round (target <= 1.2); per tier: the most bytes
    seen against its budget."""
    rounds = result["rounds"]
    out = {"processes": {}, "tiers": {}}
    if not rounds:
        return out
    first = rounds[0]["rss"]
    for name, base in first.items():
        peak = max(r["rss"].get(name, 0) for r in rounds)
        last = rounds[-1]["rss"].get(name, 0)
        ratio = peak / base if base else None
        out["processes"][name] = {"first": base, "peak": peak, "last": last, "peak_over_first": ratio,
                                  "met": ratio is not None and ratio <= FLAT}
    for tier in ("resident_kv", "worker_device", "worker_host", "worker_disk", "disk_files"):
        peak = max(r["tiers"][tier]["bytes"] for r in rounds)
        budget = rounds[-1]["tiers"][tier]["budget"]
        out["tiers"][tier] = {"peak": peak, "budget": budget, "met": None if budget is None else peak <= budget}
    return out


def markdown(result: dict) -> str:
    from service import cpu_line

    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    rounds = result["rounds"]
    if not rounds:
        return "no round completed"
    names = sorted(rounds[0]["rss"], key=lambda n: -rounds[-1]["rss"].get(n, 0))
    lines = [f"CPU: {cpu_line(result['cpu'])}; load average at start {result['load_start']}, "
             f"during the rounds {min(r['load'] for r in rounds)}-{max(r['load'] for r in rounds)}; "
             f"wall {result['wall_s']} s", "",
             "RSS (MiB) after each round:", "",
             "| facts | add s | answer s | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    lines.append("| before | | | " + " | ".join(mib(result["before"]["rss"].get(n, 0)) for n in names) + " |")
    for r in rounds:
        lines.append(f"| {r['facts']} | {r['add_s']} | {r['answer_s']} | "
                     + " | ".join(mib(r["rss"].get(n, 0)) for n in names) + " |")
    v = result["verdicts"]
    lines += ["", "| process | RSS after round 1 (MiB) | peak | last | peak / round 1 | target <= 1.2 |",
              "|---|---|---|---|---|---|"]
    for n in names:
        p = v["processes"].get(n)
        if p:
            ratio = p["peak_over_first"]
            verdict = "met" if p["met"] else (f"**missed** by {ratio - FLAT:.2f}" if ratio else "n/a")
            lines.append(f"| {n} | {mib(p['first'])} | {mib(p['peak'])} | {mib(p['last'])} | "
                         f"{ratio:.2f} | {verdict} |")
    lines += ["", "KV tiers after each round (MiB; budget in brackets, - = no budget):", "",
              "| facts | resident KV (facts) | worker device | worker host | worker disk | disk files | cluster "
              "objects put (failed) | facts read from cluster / encoded / recomputed |", "|---|---|---|---|---|---|---|---|"]
    bud = lambda t: "-" if t["budget"] is None else mib(t["budget"])  # noqa: E731
    for r in rounds:
        t = r["tiers"]
        c = t["counters"]
        lines.append(f"| {r['facts']} | {mib(t['resident_kv']['bytes'])} [{bud(t['resident_kv'])}] "
                     f"({t['resident_kv']['facts']}) | {mib(t['worker_device']['bytes'])} [{bud(t['worker_device'])}] | "
                     f"{mib(t['worker_host']['bytes'])} [{bud(t['worker_host'])}] | {mib(t['worker_disk']['bytes'])} "
                     f"[-] | {mib(t['disk_files']['bytes'])} [-] | {t['cluster_puts']['objects']} "
                     f"({t['cluster_puts']['put_failures']}) [segment {mib(t['cluster_puts']['budget'])}] | "
                     f"{c.get('facts_from_cluster')} / {c.get('facts_encoded')} / {c.get('facts_recomputed')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
