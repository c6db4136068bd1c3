"""The benchmark scripts run end to end in their small modes and write the JSON they promise.

Speed is not asserted (KV faster than PI is the benchmark's question, not a test's); what is asserted is that
every number is there, positive, labelled with the device it came from, and that bytes per fact follow the
formula 2·L·c·h·d·b for the model's shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
LOCOMO = REPO / "tests" / "fixtures" / "locomo_mini.json"  # synthetic, LoCoMo's format


def run_script(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def test_encode_quick_cpu(tmp_path):
    from transformers import AutoConfig

    from inferscale_core.model_spec import ModelSpec
    from inferscale_core.models import default_model_path

    out = tmp_path / "encode.json"
    proc = run_script(["bench/encode.py", "--quick", "--limit", "3", "--device", "cpu", "--batch-size", "2",
                       "--data", str(LOCOMO), "--out", str(out)])
    assert "CPU" in proc.stdout and "| w (turns) |" in proc.stdout  # device named, table printed

    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["device_description"].startswith("CPU")
    assert res["num_facts"] == 3 and res["dtype"] == "float32"
    assert [r["w"] for r in res["rows"]] == [0, 5]

    spec = ModelSpec.from_config(AutoConfig.from_pretrained(default_model_path()))
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # float32
    assert res["model"]["kv_bytes_per_token"] == per_token
    for r in res["rows"]:
        assert r["facts"] == 3 and r["seconds"] > 0
        assert r["facts_per_s"] > 0 and r["tokens_per_s"] > 0
        assert r["kv_bytes_formula_ok"] is True
        # Mean bytes per fact = formula per token x mean fact tokens (the fact's tokens only, any w).
        assert r["kv_bytes_per_fact"] == pytest.approx(per_token * r["mean_fact_tokens"])
        assert r["kv_bytes_total"] == round(per_token * r["mean_fact_tokens"] * r["facts"])
        assert r["index_bytes_per_fact"] == res["embedder"]["dim"] * 4
        assert r["total_bytes_per_fact"] == r["kv_bytes_per_fact"] + r["index_bytes_per_fact"]
    w0, w5 = res["rows"]
    assert w5["mean_context_tokens"] > w0["mean_context_tokens"] == res["prefix_tokens"]
    assert w0["kv_bytes_per_fact"] == w5["kv_bytes_per_fact"]  # the window is context, never stored


def test_ttft_quick_measures_every_condition(tmp_path):
    """bench/ttft.py (the headline TTFT numbers) on 40 facts of the synthetic fixture, nothing recomputed: every
    condition is measured, the KV requests really injected their whole memory, the floor request got it from the
    prefix cache instead, and the query-only prompt carries no memory."""
    out = tmp_path / "ttft.json"
    # float32, one question per k, 24 facts: what is checked is that every condition runs and injects what it
    # should, not a speed (bfloat16, 3 questions, 40 facts: 158 s in a full run on a 2-core AMD without native bf16;
    # this, ~50 s there)
    proc = run_script(["bench/ttft.py", "--quick", "--max-facts", "24", "--questions", "1", "--dtype", "float32",
                       "--sample-id", "syn-1", "--dates", "--recompute-tokens", "0", "--recompute-facts", "0", "--data", str(LOCOMO),
                       "--json", str(out)], timeout=300)
    assert "TTFT(PI,k=20)/TTFT(KV,k=20)" in proc.stdout and "CPU only" in proc.stdout
    res = json.loads(out.read_text())
    assert res["user"] == "syn-1" and res["dates"] is True and res["num_facts"] == 24
    assert [r["k"] for r in res["rows"]] == [5, 20]
    for r in res["rows"]:
        for kind in ("kv", "pi", "kv_floor", "query_only"):
            assert r[f"{kind}_ttft_ms"] > 0 and r[f"{kind}_q2ft_ms"] >= r[f"{kind}_ttft_ms"]
        assert r["kv_cached"] == r["memory_tokens"]  # the whole memory injected, nothing of it prefilled
        assert r["injection_ms"] > 0
        assert r["kv_floor_cached"] >= r["memory_tokens"] // 32 * 32  # the memory's blocks: prefix-cache hits
        assert r["query_only_cached"] < r["memory_tokens"]  # no memory in that prompt
    kv = [x for x in res["raw"] if x["mode"] == "kv"]
    assert kv and all(x["num_cached_tokens"] == x["memory_len"] for x in kv)


def test_encode_rejects_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, "bench/encode.py", "--windows", "0,x", "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--windows must be comma-separated integers" in proc.stderr
    proc = subprocess.run([sys.executable, "bench/encode.py", "--data", str(tmp_path / "missing.json"),
                           "--out", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode != 0 and "LoCoMo data file not found" in proc.stderr


@pytest.mark.parametrize("script", ["locomo", "ttft", "encode", "position", "equivalence"])
def test_benchmark_without_data_says_where_to_get_it(script, tmp_path):
    """A user's clone has no ../shared: every LoCoMo benchmark ends with one line naming the source and --data."""
    missing = tmp_path / "locomo10.json"
    out = [] if script == "ttft" else ["--out", str(tmp_path)]  # nothing may be written
    proc = subprocess.run([sys.executable, f"bench/{script}.py", "--data", str(missing), *out], cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert last.startswith(f"LoCoMo data file not found at {missing}") and "snap-research/locomo" in last
    assert last.endswith("pass --data PATH") and "Traceback" not in proc.stderr


def test_gpu_script_tiny_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_script(["bench/gpu.py", "--device", "cpu", "--tiny", "--k", "5,10", "--repeats", "2",
                       "--index-sizes", "1000,5000", "--out", str(out)])
    assert "say nothing about a GPU" in proc.stdout

    res = json.loads(out.read_text())
    assert res["device_type"] == "cpu" and res["device_label"] == "CPU"
    m = res["model"]
    assert m["random_weights"] is True and m["shape"] == "tiny-llama3" and m["rope_type"] == "llama3"
    assert m["kv_bytes_per_token"] == 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 2  # bf16

    assert [r["k"] for r in res["ttft"]] == [5, 10]
    for r in res["ttft"]:
        assert r["device"] == "CPU"
        assert r["memory_tokens"] == 30 * r["k"] and r["query_tokens"] == 30
        assert r["memory_kv_bytes"] == m["kv_bytes_per_token"] * r["memory_tokens"]
        assert r["pi_ttft_ms"] > 0 and r["kv_ttft_ms"] > 0 and r["kv_compose_ms"] > 0
        assert r["pi"]["runs"] == 2

    for r in res["bandwidth"]:
        assert r["device"] == "CPU"
        assert r["kv_bytes"] == m["kv_bytes_per_token"] * 30 * r["k"]
        for key in ("compose_GBps", "compose_inject_GBps", "d2d_copy_GBps"):
            assert r[key] > 0
        assert r["h2d_pinned_GBps"] is None  # no pinned memory without CUDA; reported as missing, not made up

    assert {(r["facts"], r["batch"]) for r in res["index"]} == {(1000, 1), (1000, 64), (5000, 1), (5000, 64)}
    for r in res["index"]:
        assert r["device"] == "CPU" and r["latency_ms"] > 0 and r["per_query_us"] > 0


def test_gpu_script_refuses_full_model_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "on CPU add --tiny" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_script_tiny_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    run_script(["bench/gpu.py", "--device", "cuda", "--tiny", "--k", "5", "--repeats", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["device_label"].startswith("GPU")
    assert all(r["h2d_pinned_GBps"] > 0 for r in res["bandwidth"])


def test_cold_user_rejects_bad_arguments(tmp_path):
    """bench/cold_user.py (a service run, minutes: not run here) checks its arguments before starting anything."""
    proc = subprocess.run([sys.executable, "bench/cold_user.py", "--quick", "--ks", "5,80", "--facts", "10",
                           "--out", str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ks must be in 1..64" in proc.stderr and "--facts 10 is below the largest k" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_resident_memory_rejects_bad_arguments(tmp_path):
    """bench/resident_memory.py (a service run of an hour: not run here) checks its arguments before starting."""
    proc = subprocess.run([sys.executable, "bench/resident_memory.py", "--quick", "--users", "3", "--round-facts", "20",
                           "--out", str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--round-facts 20 must be a multiple of --users 3" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_resident_memory_finds_the_service_processes_by_role():
    """The bench's RSS rows come from /proc: every descendant of the driver, named by its process title or binary.
    A real redis-server (one of the service's processes) started here must appear under its role, with its RSS."""
    sys.path.insert(0, str(REPO / "bench"))
    env_before = dict(os.environ)
    from resident_memory import process_rss, rss_bytes

    assert dict(os.environ) == env_before  # importing the bench sets no vLLM environment in the test process

    from bench.local_redis import RedisServerMissing, local_redis_server

    try:
        with local_redis_server():
            rows = process_rss()
    except RedisServerMissing as e:
        pytest.skip(str(e))
    assert rows["redis-server"] > 1 << 20  # a live process's resident set, in bytes
    assert rows["driver (this bench)"] > 1 << 20 and rss_bytes(os.getpid()) > 1 << 20
    assert "redis-server" not in process_rss()  # stopped: gone from the next sample


def test_service_table_has_one_row_per_cell_on_the_issue_grid():
    """bench/service.py's table on issue 30's grid (--users 1,100 --ks 50; HTTP at both N, the default) has one row
    per door, N, mode and k (issue 30 saw each N=1 row twice). A run is an hour of a loaded service: the table code
    alone runs here, on the lines the load client writes (one per request, one per cell) and the engine replay's
    records for the gRPC cells, as main() passes them."""
    env_before = dict(os.environ)
    try:
        import bench.service as service
    finally:  # its import sets vLLM's environment for the process it benchmarks in, not for this one
        os.environ.clear()
        os.environ.update(env_before)
    args = service.parse_args(["--data", str(LOCOMO), "--users", "1,100", "--ks", "50", "--facts-per-user", "50"])
    users = service.make_users(args.data, max(args.user_counts), args.facts_per_user, "u")
    cells = service.make_cells(args, users, {u.user_id: "token" for u in users})
    answer = {"status": "OK", "t_first_s": 0.2, "t_total_s": 0.5, "ttft_ms": 100.0, "prompt_tokens": 1000,
              "prefilled_tokens": 30, "timings_ms": {"retrieval": 20.0}}
    lines, engine = [], {"records": [], "walls": {}}
    for c in cells:
        requests = [{"type": "request", "cell": c.id, "user_id": p["user_id"], "i": i, **answer}
                    for p in c.plan for i in range(len(p["questions"]))]
        lines += requests + [{"type": "cell", "cell": c.id, "wall_s": 10.0}]
        if c.door == "grpc":
            replay = f"engine-n{c.users}-{c.mode}-k{c.k}"
            engine["records"] += [{**r, "cell": replay} for r in requests]
            engine["walls"][replay] = 5.0
    rows = service.table_rows(lines, engine, cells)
    meta = {"command": "python bench/service.py --users 1,100 --ks 50", "cpu_line": "a CPU", "load": {"start": 0.0},
            "service": "own app", "model": "SmolLM2", "dtype": "float32", "max_tokens": 8, "users_desc": "100 users",
            "requests_n1": args.requests_n1, "requests_per_user": args.requests_per_user, "wall_s": 1.0}
    md = service.markdown({"meta": meta, "rows": rows, "ratios": service.ratios(rows, args), "checks": []})
    table = [line.split(" | ") for line in md.splitlines() if line.startswith(("| grpc |", "| http |", "| engine |"))]
    keys = [(cols[0].strip("| "), int(cols[1]), cols[2], int(cols[3])) for cols in table]
    want = {(door, n, mode, 50) for door in ("grpc", "http", "engine") for n in (1, 100) for mode in ("inject", "prompt")}
    assert sorted(keys) == sorted(want), keys  # each cell once: no row printed twice, none missing
    n1 = [cols for cols in table if cols[1] == "1"]
    assert len(n1) == 6 and all(cols[4] == str(args.requests_n1) for cols in n1)  # N=1: its own requests, once


def test_service_first_chunk_limit_is_one_users_at_n1_even_in_a_run_of_n1_alone():
    """Issue 30's "first chunk at N=1 at most 1.5x the engine TTFT at every k": a run of --users 1 alone (as for
    k=5,50,200) is held to 1.5, not to the 2.0 of the largest N; a run of one larger N to 2.0."""
    env_before = dict(os.environ)
    try:
        import bench.service as service
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    row = {"first_chunk_ms_p50": 170.0, "engine_ttft_ms_p50": 100.0, "req_per_s": 1.0, "failures": {}}

    def limits(users: str) -> set:
        args = service.parse_args(["--data", str(LOCOMO), "--users", users, "--ks", "5"])
        rows = [{**row, "door": d, "users": u, "mode": m, "k": 5} for d in ("grpc", "engine")
                for u in args.user_counts for m in ("inject", "prompt")]
        return {(t["users"], t["limit"], t["met"]) for t in service.ratios(rows, args)
                if t["target"] == "first chunk / engine TTFT (final chunk)" and t["door"] == "grpc"}

    assert limits("1") == {(1, 1.5, False)}  # 1.7x: over one user's 1.5
    assert limits("25") == {(25, 2.0, True)}
    assert limits("1,25") == {(1, 1.5, False), (25, 2.0, True)}
