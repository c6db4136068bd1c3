"""The cluster KV tier's read path on a local Mooncake Store (loopback TCP, no model), as the connector's worker
reads a request's k facts into its fact store, old against new in one run:

- old: `get_batch` (each object copied into a Python bytes object), `unpack` (views of those bytes), then
  `FactStore.put` (the store's copy): what the worker did before zero-copy reads;
- new: `ClusterStore.read` with the worker's `keep`: `batch_get_replica_desc` (the objects' sizes), then
  `batch_get_into` into the client's registered read buffer, `unpack` (views of it), `FactStore.put` (the one
  copy).

Also the write path (put_many). Facts have SmolLM2-135M's shape (30 layers, 3 KV heads, dim 64), `--tokens` each
(25 by default, a LoCoMo fact's size) in bf16 (what the service serves) and fp32. Old and new alternate in every
repeat, so the machine's load falls on both alike.

    python bench/kv_tier.py --k 50 --repeats 30
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from inferscale_core.cluster_store import ClusterConfig, ClusterStore, unpack
from inferscale_core.store import FactStore
from inferscale_core.types import EncodedFact
from inferscale_server.local_mooncake import local_mooncake

LAYERS, HEADS, DIM = 30, 3, 64


def fact(dtype, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return EncodedFact(torch.randint(0, 49152, (tokens,), generator=g),
                       torch.randn(LAYERS, tokens, HEADS, DIM, generator=g).to(dtype),
                       torch.randn(LAYERS, tokens, HEADS, DIM, generator=g).to(dtype))


def ms(xs):
    return f"{statistics.median(xs) * 1000:.1f}"


def old_read(tier: ClusterStore, client, store: FactStore, user: str, ids: list[str]) -> None:
    """The worker's read before zero-copy (ClusterStore.read until this change): Python bytes, unpacked, checked
    and put. `get_batch` reads only what fits the client's transfer buffer (fp32 k=50 is 58 MB): the objects
    that exist but were not read are read again, as the old read did."""
    keys = [tier.key(user, i) for i in ids]
    values = client.get_batch(keys)
    empty = [i for i, v in enumerate(values) if not v]
    again = [i for i, e in zip(empty, client.batch_is_exist([keys[i] for i in empty]) if empty else []) if e == 1]
    while again:
        got = client.get_batch([keys[i] for i in again])
        for i, v in zip(again, got):
            if v:
                values[i] = v
        assert any(got), "nothing read"
        again = [i for i, v in zip(again, got) if not v]
    for kv, data in zip(ids, values):
        head, f = unpack(data)
        assert (head["fingerprint"], head["user_id"], head["kv_id"]) == (tier.fingerprint, user, kv)
        store.put(user, kv, f)


def new_read(tier: ClusterStore, store: FactStore, user: str, ids: list[str]) -> None:
    """The worker's read now (connector_worker._fetch's keep, without the dtype check)."""
    def keep(kv, f):
        store.put(user, kv, f)
        return f.nbytes

    assert all(tier.read(user, ids, keep).facts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--tokens", type=int, default=25)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    keep = [f for f in flags.split() if f.startswith(("avx512", "amx", "avx2"))]
    rows = []
    # A read lease of 5 s (the tests run 0.5 s): on a loaded machine a 58 MB read can outlast a short one, and
    # then both paths read again; this measures the read, not that.
    with local_mooncake(segment_bytes=3 << 30, lease_ms=5000) as m:
        for dtype in (torch.bfloat16, torch.float32):
            tier = ClusterStore(ClusterConfig.from_dict(m.config), "f" * 16)
            assert tier.wait_available(60)
            client = tier._store()
            user = f"bench-{dtype}"
            facts = [(f"f{i}@v1", fact(dtype, a.tokens, i)) for i in range(a.k)]
            puts, old, new = [], [], []
            for r in range(a.repeats):
                batch = [(f"r{r}-{kv}", f) for kv, f in facts]
                t = time.perf_counter()
                assert all(tier.put_many(user, batch))
                puts.append(time.perf_counter() - t)
            ids = [f"r{a.repeats - 1}-{kv}" for kv, _ in facts]  # the newest: earlier rounds may be evicted
            stores = {name: FactStore(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype)
                      for name in ("old", "new")}
            for _ in range(a.repeats):
                t = time.perf_counter()
                old_read(tier, client, stores["old"], user, ids)
                old.append(time.perf_counter() - t)
                t = time.perf_counter()
                new_read(tier, stores["new"], user, ids)
                new.append(time.perf_counter() - t)
            for kv in ids:  # both read the same bytes
                x, y = stores["old"].get(user, kv), stores["new"].get(user, kv)
                assert torch.equal(x.k_pre.view(torch.uint8), y.k_pre.view(torch.uint8))
            mb = sum(f.nbytes for _, f in facts) / 1e6
            rows.append((str(dtype).split(".")[1], mb, ms(puts), ms(old), ms(new),
                         statistics.median(new) / statistics.median(old), tier.read_buffer.registrations))
            tier.close()
    print(f"cluster KV tier, local Mooncake (TCP loopback), k={a.k} facts of {a.tokens} tokens, SmolLM2-135M "
          f"shape, read into a FactStore, median of {a.repeats}; lscpu flags: {' '.join(keep)}")
    print("| dtype | KV read (MB) | put_many (ms) | old read: get_batch + unpack + put (ms) | "
          "new read: batch_get_into registered buffer + unpack + put (ms) | new / old | read buffer registrations |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.2f} | {r[6]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
