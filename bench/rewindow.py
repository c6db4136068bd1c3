"""What deleting (or changing) a fact costs for the facts encoded behind it (issue 21, neighbour windows).

A fact is encoded behind the w facts its user stored before it (inferscale_core/defaults.py), so a neighbour's
text shapes the fact's KV. When a neighbour is deleted, the gateway takes its line out of every stored window
and re-encodes those facts (`GatewayCore._rewindow`). This measures, on one LoCoMo conversation (facts in the
service's order, the shipped window):
  imprint    how far a fact's KV moves when one neighbour leaves its window (relative L2 over the fact's K and
             V, all layers), against the same fact with no window at all and against fp32 batch noise: if
             the deleted text left no trace, re-encoding would be pointless
  re-encode  the encoder time per affected fact (SmolLM2, fp32, CPU), and how many facts a delete affects
  registry   the gateway's pass over the user's facts that finds them (registry-only GatewayCore, a real
             redis-server), for users of --users-facts facts

    python bench/rewindow.py --sample-id conv-26 --facts 60 --users-facts 100,1000 --out bench/results/rewindow.md
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rel(a, b) -> float:
    return float(((a - b).norm() / b.norm()).item())


def imprint(sample_id: str, n_facts: int, data: str) -> dict:
    import torch

    from bench.eval.locomo import load_locomo, session_facts
    from inferscale_core.defaults import NEIGHBOUR_WINDOW, default_windows
    from inferscale_core.memory import Memory

    conv = next(c for c in load_locomo(data) if c.sample_id == sample_id)
    order = [f for s in sorted({f.session for f in conv.facts}) for f in session_facts(conv, s)][:n_facts]
    texts = [f.render() for f in order]
    windows = default_windows(texts)
    mem = Memory()
    enc = lambda text, win: mem.encoder.encode(mem.template.fact_ids(text), mem.context(win))  # noqa: E731
    rows = {"drop newest": [], "drop oldest": [], "no window": [], "fp32 batch noise": []}
    seconds = []
    for text, win in zip(texts, windows):
        if len(win) < NEIGHBOUR_WINDOW:
            continue
        full = enc(text, win)
        kv = torch.cat([full.k_pre.flatten(), full.v.flatten()])
        t0 = time.perf_counter()
        newest = enc(text, win[:-1])
        seconds.append(time.perf_counter() - t0)
        for name, other in (("drop newest", newest), ("drop oldest", enc(text, win[1:])),
                            ("no window", enc(text, ()))):
            rows[name].append(_rel(torch.cat([other.k_pre.flatten(), other.v.flatten()]), kv))
        # the same input in a batch beside another fact: how much fp32 moves without any change of input
        batched = mem.encoder.encode_batch([(mem.template.fact_ids(text), mem.context(win)),
                                            (mem.template.fact_ids(texts[0]), mem.context(()))], progress=False)[0]
        rows["fp32 batch noise"].append(_rel(torch.cat([batched.k_pre.flatten(), batched.v.flatten()]), kv))
    return {"facts": len(seconds), "rows": {k: (statistics.median(v), min(v), max(v)) for k, v in rows.items()},
            "reencode_s": (statistics.median(seconds), min(seconds), max(seconds))}


def registry_pass(users_facts: list[int]) -> list[dict]:
    from bench.local_redis import local_redis_server
    from inferscale_server.auth import Authenticator
    from inferscale_server.gateway import GatewayCore
    from inferscale_server.limits import Limits
    from inferscale_server.registry import NewFact, RedisRegistry

    out = []
    with local_redis_server() as url:
        for n in users_facts:
            reg = RedisRegistry(url, prefix=f"rw{uuid.uuid4().hex[:6]}:")
            core = GatewayCore(reg, backends=None, limits=Limits(max_facts_per_user=n + 1),
                               auth=Authenticator.insecure())

            async def run():
                ids = []
                for i in range(n):  # one call per fact: each behind the facts stored before it
                    ids += [r.fact_id for r in await core.store_new("u", [NewFact(f"fact number {i} of user u")])]
                t0 = time.perf_counter()
                await core.delete_fact("u", ids[n // 2])
                return time.perf_counter() - t0, ids

            took, ids = asyncio.run(run())
            changed = sum(reg.get("u", f).version == 2 for f in ids if f != ids[n // 2])
            out.append({"facts": n, "delete_s": took, "rewindowed": changed})
            reg.close()
    return out


def main(argv=None) -> int:
    from bench.eval.locomo import default_data_path
    from bench.eval.serving import machine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(default_data_path() or ""))
    p.add_argument("--sample-id", default="conv-26")
    p.add_argument("--facts", type=int, default=60, help="the conversation's first N facts (service order)")
    p.add_argument("--users-facts", default="100,1000", help="facts per user for the registry pass")
    p.add_argument("--out", default=None, help="Markdown report (default: print only)")
    a = p.parse_args(argv)
    m, load0 = machine(), os.getloadavg()
    imp = imprint(a.sample_id, a.facts, a.data)
    reg = registry_pass([int(x) for x in a.users_facts.split(",")])
    lines = [f"# What a neighbour's delete costs (`python bench/rewindow.py --sample-id {a.sample_id} --facts "
             f"{a.facts} --users-facts {a.users_facts}`)\n",
             f"Machine: {m['device']} ({m['cpu_model']}); lscpu flags {' '.join(m['cpu_flags'])}; load "
             f"{load0[0]:.1f} at start, "
             f"{os.getloadavg()[0]:.1f} at end.\n",
             f"KV imprint of one neighbour, {imp['facts']} facts of {a.sample_id} with a full window (relative L2 "
             "of the fact's K and V, all layers; median [min, max]):\n",
             "| change to the window | relative KV change |", "|---|---|"]
    lines += [f"| {k} | {v[0]:.4f} [{v[1]:.4f}, {v[2]:.4f}] |" for k, v in imp["rows"].items()]
    r = imp["reencode_s"]
    lines += ["", f"Re-encoding one affected fact (fp32, CPU): median {r[0] * 1000:.0f} ms "
              f"[{r[1] * 1000:.0f}, {r[2] * 1000:.0f}].\n",
              "Registry pass of one DeleteMemory (registry-only gateway, redis-server on loopback):\n",
              "| facts of the user | delete incl. re-windowing, ms | facts re-windowed |", "|---|---|---|"]
    lines += [f"| {x['facts']} | {x['delete_s'] * 1000:.1f} | {x['rewindowed']} |" for x in reg]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
