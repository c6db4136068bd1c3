"""The registry on one Redis and on a 3-master Redis Cluster, same run (issue 32): bytes Redis stores per fact
(INFO memory, summed over the masters) and throughput of writes and of the answer path's reads.

  bytes     --users x --facts-per-user facts created the way the gateway creates them (one fact per call,
            behind the user's NEIGHBOUR_WINDOW latest facts as its window, a 384-float MiniLM embedding,
            LoCoMo-like texts), used_memory before and after; then the same facts' text updated once (a
            history entry each). Split: text, window, embedding (what the values hold) and Redis's overhead
            (hash fields, keys, the per-user sets, the bucket's sequence and placement).
  adds/s    create() of one fact, --threads client threads, --ops calls in all
  reads/s   the answer path's registry reads: user_version (retrieval's sync check) + find_many of k=5 ids
            (the engine replica's check of the retrieved facts), --threads threads

Both servers are local (127.0.0.1), started and stopped here; the client is this process (redis-py), so the
ratio cluster / single is what one client host sees, not the cluster's capacity (which adds masters).

    python bench/registry.py --users 50 --facts-per-user 200 --out bench/results/registry.md
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("Caroline went to the LGBTQ support group on Sunday and felt accepted there; Melanie painted a sunset "
         "by the lake with her kids last summer, and they plan to go camping again in the mountains in June with "
         "the dog, bring the new tent and a camera").split()
EMBEDDING_DIM = 384  # all-MiniLM-L6-v2


def fact_text(rng: random.Random) -> str:
    """~110 characters, the length of a LoCoMo development fact (bench/eval/locomo.py facts: 60-160)."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(14, 22))).capitalize() + "."


def embedding(rng: random.Random):
    import numpy as np

    v = np.asarray([rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIM)], dtype=np.float32)
    return v / np.linalg.norm(v)


def used_memory(clients) -> int:
    return sum(int(c.info("memory")["used_memory"]) for c in clients)


def master_clients(url: str, cluster: bool):
    import redis

    if not cluster:
        return [redis.Redis.from_url(url)]
    rc = redis.RedisCluster.from_url(url)
    nodes = [redis.Redis(host=n.host, port=n.port) for n in rc.get_primaries()]
    rc.close()
    return nodes


def fill(reg, users: list[str], per_user: int, rng: random.Random) -> dict:
    """Facts created as the gateway creates them (windows from the user's latest facts); returns the bytes of
    text, window and embedding written."""
    from inferscale_core.defaults import NEIGHBOUR_WINDOW, default_windows
    from inferscale_server.registry import NewFact

    text_b = window_b = emb_b = 0
    for u in users:
        for _ in range(per_user):
            text = fact_text(rng)
            stored = [r.text for r in reg.latest(u, NEIGHBOUR_WINDOW)]
            (window,) = default_windows([text], [()], stored=stored)
            emb = embedding(rng)
            reg.create(u, [NewFact(text, window=window, embedding=emb)])
            text_b += len(text.encode())
            window_b += sum(len(line.encode()) for line in window)
            emb_b += emb.nbytes
    return {"text": text_b, "window": window_b, "embedding": emb_b}


def timed(fn, ops: int, threads: int) -> float:
    """Calls of fn(i) per second, `ops` calls on `threads` threads."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(ops)))
    return ops / (time.perf_counter() - t0)


def measure(name: str, url: str, cluster: bool, args) -> dict:
    from inferscale_server.registry import NewFact, RedisRegistry

    rng = random.Random(7)
    clients = master_clients(url, cluster)
    reg = RedisRegistry(url, prefix=f"bench{uuid.uuid4().hex[:6]}:")
    users = [f"user-{i:04d}" for i in range(args.users)]
    before = used_memory(clients)
    written = fill(reg, users, args.facts_per_user, rng)
    after_create = used_memory(clients)
    n = args.users * args.facts_per_user
    for u in users:  # one text change each: a history entry per fact
        for rec in reg.list(u)[0]:
            reg.update(u, rec.fact_id, text=rec.text + " (updated)", embedding=embedding(rng))  # as retrieval re-embeds
    after_update = used_memory(clients)
    per_fact = (after_create - before) / n
    payload = sum(written.values()) / n
    row = {"backend": name, "facts": n, "bytes_per_fact": per_fact,
           "text": written["text"] / n, "window": written["window"] / n, "embedding": written["embedding"] / n,
           "overhead": per_fact - payload, "history_per_update": (after_update - after_create) / n}

    ids = {u: [r.fact_id for r in reg.list(u, limit=5)[0]] for u in users}
    add_users = [f"adder-{i:03d}" for i in range(args.threads * 4)]
    row["adds_per_s"] = timed(lambda i: reg.create(add_users[i % len(add_users)],
                                                   [NewFact(fact_text(random.Random(i)), embedding=embedding(
                                                       random.Random(i)))]), args.ops, args.threads)

    def answer_read(i: int) -> None:
        u = users[i % len(users)]
        reg.user_version(u)
        assert len(reg.find_many(u, ids[u])) == 5

    row["reads_per_s"] = timed(answer_read, args.ops, args.threads)
    reg.close()
    for c in clients:
        c.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--facts-per-user", type=int, default=200)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--ops", type=int, default=4000, help="calls per throughput measurement")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    if min(args.users, args.facts_per_user, args.threads, args.ops) < 1 or args.facts_per_user < 5:
        ap.error("--users, --threads, --ops must be >= 1 and --facts-per-user >= 5")

    from bench.local_redis import local_redis_cluster, local_redis_server
    from bench.service import cpu_description, cpu_line

    rows = []
    with local_redis_server() as url:
        rows.append(measure("1 Redis", url, False, args))
    with local_redis_cluster(masters=3) as url:
        rows.append(measure("3-master cluster", url, True, args))
    single, cluster = rows
    lines = [f"# Registry: one Redis vs a 3-master Redis Cluster ({time.strftime('%Y-%m-%d')})", "",
             f"CPU: {cpu_line(cpu_description())}. CPU times; both servers and the client on this machine (loopback).",
             f"Command: `python bench/registry.py --users {args.users} --facts-per-user {args.facts_per_user} "
             f"--threads {args.threads} --ops {args.ops}`", "",
             "| backend | facts | bytes/fact | text | window | embedding | Redis overhead | +history/update | "
             "adds/s | answer reads/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['facts']:,} | {r['bytes_per_fact']:,.0f} | {r['text']:,.0f} | "
                     f"{r['window']:,.0f} | {r['embedding']:,.0f} | {r['overhead']:,.0f} | "
                     f"{r['history_per_update']:,.0f} | {r['adds_per_s']:,.0f} | {r['reads_per_s']:,.0f} |")
    lines += ["", f"cluster / single: adds {cluster['adds_per_s'] / single['adds_per_s']:.2f}x, answer reads "
                  f"{cluster['reads_per_s'] / single['reads_per_s']:.2f}x, bytes per fact "
                  f"{cluster['bytes_per_fact'] / single['bytes_per_fact']:.2f}x"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
