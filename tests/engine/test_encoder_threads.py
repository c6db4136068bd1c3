"""The encoder is shared by threads: the encoder pool runs its batches and the instruction prefix (asked for by
an engine replica that starts) on asyncio's thread pool, Memory's adds run in threads beside the engine. Forward
hooks are per module, not per call, so two captures at once used to fill each other's key lists: an error when
the shapes differed, a fact stored with another batch's KV when they did not. Each encode must give the same
bits as alone."""
import threading

import torch
from support.tiny_models import tiny_model

from inferscale_core.encoder import PreRopeEncoder, capture_pre_rope

ROUNDS = 12  # bounded: each round is two encodes per thread


def test_concurrent_encodes_give_the_bits_of_sequential_ones(smollm2):
    _, tok = smollm2
    encoder = PreRopeEncoder(tiny_model("llama"), tok)
    # Two batches of the same width (the silent case) and one of another width (the loud one).
    jobs = [[(f"Fact {i} of batch {b}: the user likes tea.", [f"Earlier turn {b}."]) for i in range(4)]
            for b in range(2)] + [[("A much longer fact " + "about biscuits " * 20, [])]]
    expected = [encoder.encode_batch(job, progress=False) for job in jobs]
    errors, mismatches = [], []
    start = threading.Barrier(len(jobs))

    def run(j):
        start.wait()
        for _ in range(ROUNDS):
            try:
                got = encoder.encode_batch(jobs[j], progress=False)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(repr(e))
                continue
            if any(not torch.equal(g.k_pre, e.k_pre) or not torch.equal(g.v, e.v) for g, e in zip(got, expected[j])):
                mismatches.append(j)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and mismatches == []


@torch.no_grad()
def test_a_capture_records_only_its_own_thread(smollm2):
    _, tok = smollm2
    model = tiny_model("llama")
    ids = torch.tensor(tok("Alice has a cat.", add_special_tokens=False)["input_ids"])[None]
    other = threading.Thread(target=lambda: model.model(input_ids=torch.zeros(1, 3, dtype=torch.long)))
    with capture_pre_rope(model) as (keys, _):
        model.model(input_ids=ids)
        mine = [k.clone() for k in keys]
        other.start()  # an unrelated forward in another thread (a generation, say) while the capture is open
        other.join(timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(keys, mine))
    assert keys[0].shape[1] == ids.shape[1]


ARENAS_SCRIPT = r"""
import ctypes, tempfile, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
start = threading.Barrier(8)
def work():
    start.wait()
    blocks = [libc.malloc(4096) for _ in range(200)]  # small blocks: from the thread's arena, not mmap
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
with tempfile.NamedTemporaryFile() as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp)); libc.fclose(ctypes.c_void_p(fp))
    print(open(f.name).read().count("<heap nr="))
"""


def fresh_python(code: str, env: dict, drop: tuple[str, ...]) -> str:
    """Runs `code` in a new interpreter whose environment is this one's without the variables starting with `drop`,
    plus `env` (what the encoder pool's process starts with: glibc and libgomp read them only then); its stdout and
    stderr together."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def test_the_encoder_pools_process_starts_with_few_malloc_arenas():
    """glibc gives every allocating thread an arena of its own, which keeps freed memory (the encoder pool's
    threads: ~230 MB of RSS, BENCHMARKS.md). The pool's Ray worker gets services/app.py's ENCODER_ENV in its
    environment from the start (a runtime_env), which is when glibc reads it: 8 threads then share 2 arenas."""
    from inferscale_server.app import ENCODER_ENV, ServiceConfig, deployment_options

    def arenas(env: dict) -> int:
        return int(fresh_python(ARENAS_SCRIPT, env, ("MALLOC_",)).strip().splitlines()[-1])

    assert arenas({}) > 4  # 8 threads: their own arenas (the test has teeth)
    assert arenas(ENCODER_ENV) <= int(ENCODER_ENV["MALLOC_ARENA_MAX"]) == 2
    options = deployment_options(ServiceConfig())["EncoderPool"]["ray_actor_options"]
    assert options["runtime_env"] == {"env_vars": ENCODER_ENV}


def test_the_encoder_pools_openmp_threads_spin_briefly_at_a_barrier():
    """torch's OpenMP runtime (libgomp in torch's wheels) reads GOMP_SPINCOUNT from services/app.py's ENCODER_ENV
    when the process starts: the pool's threads spin 1,000 iterations at a barrier, then sleep, instead of the
    default 300,000 that burned a core the engine or the light work needed (bench/omp_wait.py). If torch ever
    ships another runtime, or libgomp stops reading the variable, this fails and the setting needs its new name."""
    from inferscale_server.app import ENCODER_ENV

    def spincount(env: dict) -> str:
        out = fresh_python("import torch; torch.ones(64, 64) @ torch.ones(64, 64)",
                           {**env, "OMP_DISPLAY_ENV": "verbose"}, ("GOMP_", "OMP_"))
        shown = [line.split("=", 1)[1].strip(" '") for line in out.splitlines() if "GOMP_SPINCOUNT" in line]
        assert len(shown) == 1, out[-2000:]  # the runtime torch loaded is libgomp and displayed its settings
        return shown[0]

    assert spincount({}) == "300000"  # the default the setting replaces (the test has teeth)
    assert spincount(ENCODER_ENV) == ENCODER_ENV["GOMP_SPINCOUNT"] == "1000"
