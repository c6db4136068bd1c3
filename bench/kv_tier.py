"""The cluster KV tier's write and read paths on a local Mooncake Store (loopback TCP, no model), old against new in
one run. Writes, as the encoder pool stores k facts (`ClusterStore.put_many`):

- old: each object packed into a Python bytes object (three `tobytes` copies and a join), then `put_batch` (which
  stages the batch in the client's transfer buffer) in batches of 3/4 of that buffer: put_many before zero-copy
  writes;
- new: `put_many`: each object packed once into the client's registered write buffer, sent from there with
  `batch_put_from`.

Reads, as the connector's worker reads a request's k facts into its fact store:

- old: `get_batch` (each object copied into a Python bytes object), `unpack` (views of those bytes), then
  `FactStore.put` (the store's copy): what the worker did before zero-copy reads;
- new: `ClusterStore.read` with the worker's `keep`: `batch_get_replica_desc` (the objects' sizes), then
  `batch_get_into` into the client's registered read buffer, `unpack` (views of it), `FactStore.put` (the one
  copy).

Facts have SmolLM2-135M's shape (30 layers, 3 KV heads, dim 64), `--tokens` each (25 by default, a LoCoMo fact's
size) in bf16 (what the service serves) and fp32. Old and new alternate in every repeat, so the machine's load
falls on both alike; each write round goes to users of its own, removed after it (off the clock) but the last.

    python bench/kv_tier.py --k 50 --repeats 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from inferscale_core.cluster_store import BUFFER_SHARE, FORMAT, MAGIC, ClusterConfig, ClusterStore, pack, unpack
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


def old_pack(fingerprint: str, user_id: str, kv_id: str, fact: EncodedFact) -> bytes:
    """cluster_store.pack until zero-copy writes: the object built by `tobytes` copies and a join."""
    k, v = fact.k_pre.detach().cpu().contiguous(), fact.v.detach().cpu().contiguous()
    head = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "user_id": user_id, "kv_id": kv_id,
                       "dtype": str(k.dtype).removeprefix("torch."), "shape": list(k.shape)}).encode()
    ids = fact.token_ids.detach().cpu().to(torch.int64).contiguous()
    return b"".join((MAGIC, struct.pack("<I", len(head)), head, ids.numpy().tobytes(),
                     k.view(torch.uint8).numpy().tobytes(), v.view(torch.uint8).numpy().tobytes()))


def old_put(tier: ClusterStore, client, user: str, items: list[tuple[str, EncodedFact]]) -> None:
    """ClusterStore.put_many until zero-copy writes: the keys not stored yet, their objects as bytes, `put_batch` in
    batches of 3/4 of the client's transfer buffer (a larger batch fails whole there)."""
    keys = [tier.key(user, kv) for kv, _ in items]
    todo = [i for i, e in enumerate(client.batch_is_exist(keys)) if e != 1]
    values = {i: old_pack(tier.fingerprint, user, *items[i]) for i in todo}
    for batch in tier._batches(todo, lambda i: len(values[i]), int(tier.config.buffer_bytes * BUFFER_SHARE)):
        assert client.put_batch([keys[i] for i in batch], [values[i] for i in batch], tier._replicate()) == 0


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
            facts = [(f"f{i}@v1", fact(dtype, a.tokens, i)) for i in range(a.k)]
            assert old_pack(tier.fingerprint, "u", "f@v1", facts[0][1]) == pack(tier.fingerprint, "u", "f@v1",
                                                                              facts[0][1])  # one format
            put_old, put_new, old, new = [], [], [], []
            for r in range(a.repeats):
                users = {"old": f"bench-{dtype}-w{r}-old", "new": f"bench-{dtype}-w{r}-new"}
                t = time.perf_counter()
                old_put(tier, client, users["old"], facts)
                put_old.append(time.perf_counter() - t)
                t = time.perf_counter()
                assert all(tier.put_many(users["new"], facts))
                put_new.append(time.perf_counter() - t)
                if r < a.repeats - 1:  # off the clock: the segment holds the last round only
                    for u in users.values():
                        assert all(client.remove(tier.key(u, kv)) == 0 for kv, _ in facts)
            for name in ("old", "new"):  # what either path wrote, the reader reads back exact
                got = tier.get_many(users[name], [kv for kv, _ in facts])
                for g, (_, f) in zip(got, facts):
                    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                               for x, y in ((g.k_pre, f.k_pre), (g.v, f.v)))
            user, ids = users["new"], [kv for kv, _ in facts]
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
            rows.append((str(dtype).split(".")[1], mb, ms(put_old), ms(put_new),
                         statistics.median(put_new) / statistics.median(put_old), tier.write_buffer.registrations,
                         ms(old), ms(new), statistics.median(new) / statistics.median(old),
                         tier.read_buffer.registrations))
            tier.close()
    load = os.getloadavg()[0]
    print(f"cluster KV tier, local Mooncake (TCP loopback), k={a.k} facts of {a.tokens} tokens, SmolLM2-135M "
          f"shape, median of {a.repeats}, load average {load:.1f}; lscpu flags: {' '.join(keep)}")
    print("| dtype | KV (MB) | old write: bytes + put_batch (ms) | new write: registered buffer + batch_put_from (ms) "
          "| new / old | write buffer registrations | old read: get_batch + unpack + put (ms) | new read: "
          "batch_get_into registered buffer + unpack + put (ms) | new / old | read buffer registrations |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]} | {r[6]} | {r[7]} | {r[8]:.2f} "
              f"| {r[9]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
