"""Two sets of bench/locomo.py runs over the same questions under two settings (for example `--serving-order
stored` against the shipped `relevance`), paired question by question: for each mode (kv, pi) and k, the mean
token F1 of each setting and the paired bootstrap 95% interval of B minus A, per conversation and pooled over
every question both sets answered. So a setting can be compared on each mode's own F1, not only through the KV-PI
gap each run reports.

Reads each run's locomo_results.json (the per-question records stay on the machine that ran them: they hold
LoCoMo's text). A folder is one run, or holds one run per conversation (conv-*/); a setting may take several
folders, comma-separated (a question in several: the last folder's record).

    python bench/compare_runs.py bench/results/accuracy-memory-recompute1 bench/results/accuracy-stored-order --k 5
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.eval.stats import paired_bootstrap


def accuracy_records(folders: str | Path) -> dict[tuple[str, str, int], dict]:
    """(qid, mode, k) -> record, over the runs in the comma-separated `folders` (each one run or conv-*/ runs)."""
    files = []
    for folder in (Path(x) for x in str(folders).split(",") if x):
        files += sorted(folder.glob("conv-*/locomo_results.json")) or [folder / "locomo_results.json"]
    out = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: no locomo_results.json (run bench/locomo.py into {f.parent})")
        for r in json.loads(f.read_text())["records"]:
            if r["phase"] == "accuracy":
                out[(r["qid"], r["mode"], int(r["k"]))] = r
    return out


def compare(a: dict, b: dict, k: int, mode: str, resamples: int, seed: int) -> list[dict]:
    """Rows per conversation, then "pooled": n, mean F1 of A and B, B - A with its interval."""
    both = sorted(key for key in a.keys() & b.keys() if key[1] == mode and key[2] == k)
    groups: dict[str, list] = {}
    for key in both:
        groups.setdefault(a[key]["sample_id"], []).append(key)
    rows = []
    for name, keys in [*sorted(groups.items()), ("pooled", both)]:
        fa, fb = [a[x]["f1"] for x in keys], [b[x]["f1"] for x in keys]
        diff = paired_bootstrap(fb, fa, n_resamples=resamples, seed=seed)
        rows.append({"conversation": name, "n": len(keys), "a": sum(fa) / len(fa), "b": sum(fb) / len(fb),
                     "diff": diff["mean_diff"], "lo": diff["lo"], "hi": diff["hi"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="runs of setting A (the baseline): folders, comma-separated")
    ap.add_argument("b", help="runs of setting B: folders, comma-separated")
    ap.add_argument("--k", type=int, action="append", help="k to compare (repeatable; default: every k in both)")
    ap.add_argument("--bootstrap", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        a, b = accuracy_records(args.a), accuracy_records(args.b)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ks = args.k or sorted({key[2] for key in a} & {key[2] for key in b})
    if not ks:
        print("error: the two sets share no k", file=sys.stderr)
        return 2
    print(f"A = {args.a}, B = {args.b}; token F1, B - A paired by question, bootstrap 95% ({args.bootstrap})\n")
    for k in ks:
        for mode in ("kv", "pi"):
            rows = compare(a, b, k, mode, args.bootstrap, args.seed)
            if rows[-1]["n"] == 0:
                continue
            print(f"k={k}, {mode}\n\n| conversation | n | F1 A | F1 B | B - A |\n|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['conversation']} | {r['n']} | {r['a']:.3f} | {r['b']:.3f} | "
                      f"{r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] |")
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
