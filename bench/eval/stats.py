"""Statistics for the benchmark: latency summaries, a paired bootstrap, per-category aggregation."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Sequence

import numpy as np


def summarize(values: Iterable[float]) -> dict:
    """n, mean, p50 and p95 (linear interpolation between order statistics); None values when empty."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p95": None}
    return {"n": int(arr.size), "mean": float(arr.mean()),
            "p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95))}


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, n_resamples: int = 10_000, seed: int = 0,
                     confidence: float = 0.95) -> dict:
    """Percentile bootstrap interval of mean(a - b) over paired items (a[i] and b[i] are the same item).

    Items are resampled with replacement as pairs, so per-item difficulty cancels out. Deterministic
    for a given seed."""
    a_arr, b_arr = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a_arr.shape != b_arr.shape or a_arr.ndim != 1:
        raise ValueError(f"paired samples must be 1-D and of equal length, got {a_arr.shape} and {b_arr.shape}")
    if a_arr.size == 0:
        raise ValueError("paired bootstrap needs at least one pair")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diff = a_arr - b_arr
    n = diff.size
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    chunk = max(1, 2_000_000 // n)  # bound the index matrix to ~16 MB
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        means[start:stop] = diff[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return {"n": int(n), "mean_diff": float(diff.mean()), "lo": float(lo), "hi": float(hi),
            "confidence": confidence, "n_resamples": n_resamples, "seed": seed}


def by_category(records: Iterable[dict], value: Callable[[dict], float | None]) -> dict:
    """Mean of value(record) overall and per LoCoMo category: {"overall": {n, mean}, "1": {n, mean}, ...}.

    "overall" is the mean over all records (micro average), as LoCoMo and Mem0 report it. Records whose
    value is None (e.g. an unparseable judge reply) are left out and counted under "missing"."""
    groups: dict[str, list[float]] = defaultdict(list)
    missing: dict[str, int] = defaultdict(int)
    for r in records:
        v = value(r)
        for key in ("overall", str(r["category"])):
            if v is None:
                missing[key] += 1
            else:
                groups[key].append(float(v))
    out = {}
    for key in ["overall"] + sorted(k for k in set(groups) | set(missing) if k != "overall"):
        vals = groups.get(key, [])
        out[key] = {"n": len(vals), "mean": float(np.mean(vals)) if vals else None, "missing": missing.get(key, 0)}
    return out


def group_by(records: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Records grouped by the values of the given keys, groups in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups
