"""Pool per-conversation LoCoMo reports (bench/locomo.py's locomo_results.md) into one KV−PI ΔF1 per (k, w),
and say for each conversation whether its interval includes 0.

`bench/locomo.py --merge` gives the exact pooled bootstrap, but it needs every run's locomo_results.json (the
per-question records, not committed: they hold LoCoMo's text). This works from the committed Markdown alone:
the pooled mean is the question-weighted mean of the conversations' means, its standard error combines each
conversation's (half its 95% interval / 1.96), stratified by conversation, normal approximation. On the runs
where both exist it reproduces the merged bootstrap interval to within 0.001 (BENCHMARKS.md).

    python bench/pool_reports.py bench/results/accuracy-recompute32/conv-*
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

_ROW = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| ([+-]?\d+\.\d+) \[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\]", re.M)


def read_report(path: Path) -> dict[tuple[int, int], dict]:
    """{(k, w): {"n", "mean", "lo", "hi", "below", "above"}} from a report's "KV minus PI" table. `below` is
    read from the printed sign, so an upper end printed as -0.000 counts as below 0."""
    text = path.read_text(encoding="utf-8")
    if "## KV minus PI" not in text:
        raise ValueError(f"{path}: no 'KV minus PI' table (not a bench/locomo.py report?)")
    rows = {}
    for k, w, n, mean, lo, hi in _ROW.findall(text.split("## KV minus PI", 1)[1].split("\n## ", 1)[0]):
        rows[(int(k), int(w))] = {"n": int(n), "mean": float(mean), "lo": float(lo), "hi": float(hi),
                                  "below": hi.startswith("-"), "above": lo.startswith("+") and float(lo) > 0}
    if not rows:
        raise ValueError(f"{path}: the 'KV minus PI' table has no ΔF1 rows")
    return rows


def pool(reports: dict[str, dict[tuple[int, int], dict]]) -> list[dict]:
    """One row per (k, w) present in every report."""
    keys = set.intersection(*(set(r) for r in reports.values()))
    out = []
    for key in sorted(keys):
        parts = {name: r[key] for name, r in reports.items()}
        n = sum(p["n"] for p in parts.values())
        mean = sum(p["n"] * p["mean"] for p in parts.values()) / n
        se = math.sqrt(sum((p["n"] / n) ** 2 * ((p["hi"] - p["lo"]) / (2 * 1.96)) ** 2 for p in parts.values()))
        below = sorted(c for c, p in parts.items() if p["below"])
        above = sorted(c for c, p in parts.items() if p["above"])
        out.append({"k": key[0], "w": key[1], "n": n, "mean": mean, "lo": mean - 1.96 * se, "hi": mean + 1.96 * se,
                    "conversations": len(parts), "include_0": len(parts) - len(below) - len(above),
                    "below": below, "above": above})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| k | w | n | ΔF1 pooled [95% CI] | conversations whose CI includes 0 | below 0 | above 0 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['w']} | {r['n']} | {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] | "
                     f"{r['include_0']} of {r['conversations']} | {', '.join(r['below']) or '–'} | "
                     f"{', '.join(r['above']) or '–'} |")
    return "\n".join(lines) + "\n"


def per_conversation(reports: dict[str, dict[tuple[int, int], dict]]) -> str:
    """Each conversation's own ΔF1 [95% CI] per (k, w), one row per conversation."""
    keys = sorted(set.intersection(*(set(r) for r in reports.values())))
    lines = ["| conversation | n | " + " | ".join(f"k={k} w={w}" for k, w in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for name in sorted(reports):
        cells = []
        for key in keys:
            r = reports[name][key]
            mark = " (below 0)" if r["below"] else " (above 0)" if r["above"] else ""
            cells.append(f"{r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]{mark}")
        lines.append(f"| {name} | {reports[name][keys[0]]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="folders (or files) of bench/locomo.py reports, one "
                                                       "conversation set each")
    ap.add_argument("--conversations", action="store_true", help="also print each conversation's own row")
    a = ap.parse_args(argv)
    reports = {}
    for run in a.runs:
        path = run / "locomo_results.md" if run.is_dir() else run
        if not path.is_file():
            raise SystemExit(f"{path} not found: pass folders written by bench/locomo.py --out")
        name = run.name if run.is_dir() else run.parent.name
        if name in reports:
            raise SystemExit(f"two reports are named {name!r}: pass one folder per conversation")
        try:
            reports[name] = read_report(path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    rows = pool(reports)
    print(markdown(rows), end="")
    if a.conversations:
        print("\n" + per_conversation(reports), end="")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
