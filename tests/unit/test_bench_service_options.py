"""bench/service.py's registry and replica options (issue 32's service benchmark: `--registry cluster`,
`--retrieval-replicas`), without the service: a run is minutes of Ray and vLLM, and what these options decide (the
servers started, the URL and deployments the app is given, what the report says) is settled before the app starts.
The app on the cluster end to end is tests/service/test_bench_service.py's quick run (`--registry cluster`)."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCOMO = REPO / "tests" / "fixtures" / "locomo_mini.json"  # synthetic, LoCoMo's format


def import_service():
    """bench/service.py as a module; its import sets vLLM's environment for the process it benchmarks in, not for
    the tests' process, so the environment is put back."""
    env_before = dict(os.environ)
    try:
        import bench.service as service
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    return service


def test_service_registry_cluster_is_three_masters_the_apps_registry_writes_to(tmp_path):
    """`bench/service.py --registry cluster` (issue 32's benchmark): a Redis Cluster of 3 masters on loopback, the
    app's ServiceConfig given one node's URL (as `inferscale serve --redis-url`), the keys each master holds counted
    for the report; the registry the app's deployments open from that URL (open_registry of cfg.registry_url,
    services/app.py) runs in cluster mode and spreads users over every master; the servers are gone afterwards. A
    run is minutes of Ray and vLLM: the functions main() calls for the registry run here, in about a second."""
    import redis

    from inferscale_server.registry import NewFact, open_registry

    service = import_service()
    args = service.parse_args(["--data", str(LOCOMO), "--registry", "cluster", "--users", "1", "--ks", "5"])
    secret = tmp_path / "jwt-secret"
    secret.write_text("not used: nothing is served")
    with service.registry_servers(args.registry) as run:
        assert run.kind == "cluster" and len(run.ports) == 3
        cfg = service.service_config(args, tmp_path, run.url, {}, secret)
        assert cfg.registry_url == run.url and int(run.url.rsplit(":", 1)[1].split("/")[0]) in run.ports
        for port in run.ports:  # three masters of one cluster, every slot served
            with redis.Redis(host="127.0.0.1", port=port) as node:
                info = node.cluster("info")
                assert info["cluster_state"] == "ok" and int(info["cluster_size"]) == 3, info
                assert node.info("replication")["role"] == "master"
        assert run.count_keys() == [0, 0, 0]
        registry = open_registry(cfg.registry_url)
        try:
            for i in range(30):  # users hash to buckets, buckets to slots: 30 users reach every master
                registry.create(f"bench-user-{i}", [NewFact(f"fact {i} of a bench user")])
            assert registry.cluster is True  # detected from the one node's URL
        finally:
            registry.close()
        run.keys = run.count_keys()
        assert len(run.keys) == 3 and all(k > 0 for k in run.keys), run.keys
        desc = run.describe()
        assert desc.startswith("Redis Cluster of 3 masters") and run.url in desc
        assert "keys when the service stopped: " + " + ".join(map(str, run.keys)) in desc
        meta = {"command": "python bench/service.py --registry cluster", "cpu_line": "a CPU", "load": {"start": 0.0},
                "service": "own app", "registry": {"kind": run.kind, "desc": desc}, "model": "SmolLM2",
                "dtype": "float32", "max_tokens": 8, "users_desc": "1 user", "requests_n1": 2, "requests_per_user": 1,
                "wall_s": 1.0}
        report = service.markdown({"meta": meta, "rows": [], "ratios": [], "checks": []})
        assert f"\nRegistry: {desc}.\n" in report  # the report's header says which registry ran
    for port in run.ports:  # stopped on exit: nothing listens there any more
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_service_retrieval_replicas_are_fixed_like_the_engine_replicas():
    """`--retrieval-replicas N` (issue 32 measures the retrieval hop with 2): Retrieval runs exactly N replicas, the
    other deployments keep --max-replicas, and the report says so; without it Retrieval autoscales as before. Bad
    counts and options our own app needs given with --target are refused before anything starts."""
    service = import_service()
    base = ["--data", str(LOCOMO), "--users", "1", "--ks", "5"]
    args = service.parse_args([*base, "--retrieval-replicas", "2", "--max-replicas", "3"])
    deps = service.deployments(args)
    assert (deps["Retrieval"].min_replicas, deps["Retrieval"].max_replicas) == (2, 2)
    assert all((deps[n].min_replicas, deps[n].max_replicas) == (1, 3) for n in ("Gateway", "EncoderPool"))
    assert (deps["EngineReplica"].min_replicas, deps["EngineReplica"].max_replicas) == (1, 1)
    assert "Retrieval 2, Gateway/EncoderPool 1..3" in service.replicas_desc(args)
    default = service.deployments(service.parse_args([*base, "--max-replicas", "3"]))
    assert (default["Retrieval"].min_replicas, default["Retrieval"].max_replicas) == (1, 3)
    for bad in (["--retrieval-replicas", "0"], ["--engine-replicas", "0"],
                ["--target", "127.0.0.1:9000,8000", "--token", "t", "--registry", "cluster"],
                ["--target", "127.0.0.1:9000,8000", "--token", "t", "--retrieval-replicas", "2"]):
        with pytest.raises(SystemExit):
            service.parse_args([*base, *bad])


def test_service_registry_redis_is_one_server_and_embedded_none():
    """The default `--registry redis`: one redis-server on loopback, the app given its URL (not a cluster), its keys
    counted the same way; `--registry embedded` starts nothing and gives the app no URL (the Ray-actor registry)."""
    from inferscale_server.registry import NewFact, open_registry

    service = import_service()
    with service.registry_servers("redis") as run:
        assert run.kind == "redis" and len(run.ports) == 1 and f"127.0.0.1:{run.ports[0]}/" in run.url
        assert run.count_keys() == [0]
        registry = open_registry(run.url)
        try:
            registry.create("bench-user", [NewFact("a fact of a bench user")])
            assert registry.cluster is False
        finally:
            registry.close()
        run.keys = run.count_keys()
        assert run.keys[0] > 0 and run.describe().startswith(f"one redis-server on loopback ports {run.ports[0]}")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", run.ports[0]), timeout=2).close()
    with service.registry_servers("embedded") as run:
        assert (run.url, run.ports, run.describe()) == (None, (), "embedded (Ray actor)")


def test_service_ratios_without_the_engine_phase_are_not_computable_rather_than_an_error():
    """`--skip-engine` (the registry comparison needs only the service's side): the targets that divide by the
    engine level have no limit and are written as not computable (met None); main() used to fail on them with a
    TypeError after the whole run, before it wrote the results."""
    service = import_service()
    args = service.parse_args(["--data", str(LOCOMO), "--users", "1,25", "--ks", "5", "--skip-engine"])
    row = {"first_chunk_ms_p50": 170.0, "engine_ttft_ms_p50": 100.0, "req_per_s": 2.0, "failures": {}}
    rows = [{**row, "door": "grpc", "users": n, "mode": m, "k": 5} for n in (1, 25) for m in ("inject", "prompt")]
    out = {t["target"]: t for t in service.ratios(rows, args) if t["users"] in (25, "all")}
    kv_pi = out["service KV/PI req/s vs engine-level KV/PI x 0.9"]
    assert (kv_pi["value"], kv_pi["limit"], kv_pi["met"], kv_pi["margin"]) == (1.0, None, None, None)
    assert out["service req/s / engine-level req/s"]["met"] is None
    assert out["first chunk / engine TTFT (final chunk)"]["met"] is True  # 1.7 <= 2.0: computed without the engine


def test_kv_requests_whose_memory_was_computed_after_all_are_counted():
    """A KV request whose load failed is answered with its memory prefilled (correct, slow): the cell counts them,
    so a slow tail says why (seen: one 1,108-token recompute in a 13 s step). Prompt injection prefills by design."""
    service = import_service()

    def rec(prefilled: int) -> dict:
        return {"status": "OK", "t_first_s": 0.2, "t_total_s": 0.5, "ttft_ms": 150.0, "prompt_tokens": 1000,
                "prefilled_tokens": prefilled, "timings_ms": {}}

    recs = [rec(20), rec(30), rec(990), {"status": "RESOURCE_EXHAUSTED"}]
    assert service.summarize("c", "grpc", 25, "inject", 50, recs, 2.0)["recomputed"] == 1
    assert service.summarize("c", "grpc", 25, "prompt", 50, [rec(990)] * 3, 2.0)["recomputed"] == 0


def test_the_single_user_cells_have_a_user_of_their_own_when_larger_n_run_too():
    """N=1's user asks 10 questions per cell back to back (prompt injection's long prefills included) and leaves the
    cells in debt for the engine at the per-caller work budget; reused at N=100 it was refused while the others
    asked. It is an extra user now, in no larger N; alone (--users 1) the run keeps one user."""
    service = import_service()
    args = service.parse_args(["--data", str(LOCOMO), "--users", "1,4", "--ks", "5", "--modes", "inject"])
    assert service.users_needed(args) == 5
    users = service.make_users(LOCOMO, 5, 3, "t")
    tokens = {u.user_id: "tok" for u in users}
    cells = {c.id: [p["user_id"] for p in c.plan] for c in service.make_cells(args, users, tokens)}
    assert cells["grpc-n1-inject-k5"] == [users[4].user_id]
    assert cells["grpc-n4-inject-k5"] == [u.user_id for u in users[:4]]
    alone = service.parse_args(["--data", str(LOCOMO), "--users", "1", "--ks", "5"])
    assert service.users_needed(alone) == 1 and service.single_user(alone, users[:1]) is users[0]


def test_the_noisy_neighbour_benchmark_builds_its_app_from_the_service_benchmarks_own_settings(tmp_path):
    """bench/noisy_neighbour.py starts its app through bench/service.py's own_service; its hand-built settings fell
    behind when --retrieval-replicas was added, and the benchmark died at its start (AttributeError). It takes
    them from bench/service.py's parser now, so the app's config is made whatever options are added later."""
    service = import_service()
    import bench.noisy_neighbour as noisy

    args = noisy.app_args("float32")
    cfg = service.service_config(args, tmp_path, "redis://127.0.0.1:1/0", {}, tmp_path / "secret")
    assert cfg.dtype == "float32" and cfg.registry_url == "redis://127.0.0.1:1/0"
    assert cfg.deployments["EngineReplica"].max_replicas == 1 and not args.cluster_tier


def test_serve_defaults_start_the_benchmarked_app_without_the_shipped_request_path_and_control_loop():
    """--serve-defaults (bench/service.py, bench/noisy_neighbour.py) is the before of a before/after: the Ray that
    serves the app gets `inferscale serve`'s environment less SERVE_REQUEST_PATH_ENV and SERVE_CONTROL_LOOP_ENV
    (Serve's own defaults are what those variables say when unset); without it, all of it."""
    service = import_service()
    import bench.noisy_neighbour as noisy
    from inferscale_server.app import SERVE_CONTROL_LOOP_ENV, SERVE_REQUEST_PATH_ENV, SERVE_START_ENV

    tuned = {**SERVE_REQUEST_PATH_ENV, **SERVE_CONTROL_LOOP_ENV}
    shipped = service.service_env(noisy.app_args("float32"))
    before = service.service_env(noisy.app_args("float32", serve_defaults=True))
    assert SERVE_REQUEST_PATH_ENV and SERVE_CONTROL_LOOP_ENV and shipped.items() >= SERVE_START_ENV.items()
    assert not tuned.keys() & before.keys()
    assert before == {k: v for k, v in shipped.items() if k not in tuned}
    assert service.parse_args(["--quick", "--serve-defaults"]).serve_defaults


def test_limit_overrides_reach_the_benchmarked_apps_config_and_a_bad_one_is_refused(tmp_path):
    """--limit NAME=VALUE (bench/service.py, bench/noisy_neighbour.py): a Limits field for the app under test, in
    its own type; a name that is not a number field of Limits stops the benchmark before anything starts."""
    service = import_service()
    import bench.noisy_neighbour as noisy

    args = noisy.app_args("float32", limits=["gateway_work_units_per_s_per_caller=16", "max_k=50"])
    cfg = service.service_config(args, tmp_path, "redis://127.0.0.1:1/0", {}, tmp_path / "secret")
    assert cfg.limits == {"gateway_work_units_per_s_per_caller": 16.0, "max_k": 50}
    assert isinstance(cfg.limits["max_k"], int)
    assert service.service_config(noisy.app_args("float32"), tmp_path, None, {}, tmp_path / "s").limits == {}
    for bad in ("max_k", "no_such_limit=1", "max_k=fifty"):
        with pytest.raises(SystemExit, match="--limit NAME=VALUE"):
            service.limit_overrides([bad])


def test_engine_args_reach_the_benchmarked_apps_engine_and_a_bad_name_is_refused(tmp_path):
    """--engine-arg NAME=VALUE (bench/service.py, bench/noisy_neighbour.py): a vLLM EngineArgs field for the app's
    engine replicas (ServiceConfig.engine_overrides, which the engine-level phase uses too), VALUE read as JSON or
    else kept as text; a name EngineArgs does not have stops the benchmark before anything starts."""
    service = import_service()
    import bench.noisy_neighbour as noisy

    args = noisy.app_args("float32", engine_args=["long_prefill_token_threshold=64", "scheduling_policy=priority"])
    cfg = service.service_config(args, tmp_path, "redis://127.0.0.1:1/0", {}, tmp_path / "secret")
    assert cfg.engine_overrides == {"long_prefill_token_threshold": 64, "scheduling_policy": "priority"}
    assert service.service_config(noisy.app_args("float32"), tmp_path, None, {}, tmp_path / "s").engine_overrides == {}
    for bad in ("long_prefill_token_threshold", "no_such_arg=1"):
        with pytest.raises(SystemExit, match="--engine-arg NAME=VALUE"):
            service.engine_arg_overrides([bad])


def test_the_report_counts_users_served_by_more_than_one_engine_replica():
    """Cold loads of users whose facts had been warm (run (15)): a request served away from the user's home replica
    reads them cold there. The report says how many users two replicas hold, after the adds and after the load,
    with each replica's cold-read count."""
    service = import_service()
    spread = {"after_adds": {"r1": {"users": ["a", "b"], "facts_from_cluster": 0},
                             "r2": {"users": ["c"], "facts_from_cluster": 0}},
              "after_load": {"r1": {"users": ["a", "b", "c"], "facts_from_cluster": 50},
                             "r2": {"users": ["a", "c"], "facts_from_cluster": 150}}}
    assert [service.users_on_several(v) for v in spread.values()] == [0, 2]
    meta = {"command": "x", "cpu_line": "cpu", "load": {}, "service": "s", "model": "m", "dtype": "bfloat16",
            "max_tokens": 8, "users_desc": "u", "requests_n1": 10, "requests_per_user": 2, "wall_s": 1.0,
            "engine_replicas_users": {k: {"on_several": service.users_on_several(v), "by_replica": v}
                                      for k, v in spread.items()}}
    text = service.markdown({"meta": meta, "rows": [], "ratios": [], "checks": [], "requests": []})
    assert ("after adds 0 (facts read from the cluster tier per replica: 0, 0); "
            "after load 2 (facts read from the cluster tier per replica: 50, 150).") in text


def burner_code(seconds: float) -> str:
    """A child's Python that waits for a line on stdin, burns `seconds` of CPU, prints "burnt", waits again."""
    return ("import sys,time\nsys.stdin.readline()\nt=time.process_time()\n"
            f"while time.process_time() - t < {seconds}: pass\nprint('burnt', flush=True)\nsys.stdin.readline()")


def send_line(proc) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()


@contextlib.contextmanager
def burner(argv: list[str]):
    """A burner child started by `argv` (stdin and stdout piped); on exit it is sent its last line and waited for."""
    import subprocess

    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        send_line(proc)
        proc.wait(timeout=30)


def burn_and_mark(ledger, proc, label: str) -> dict[str, float]:
    """Let the burner burn once, then the ledger's mark `label` (what each part spent since the last mark)."""
    send_line(proc)
    assert proc.stdout.readline().strip() == "burnt"
    return ledger.mark(label)


def test_the_cpu_ledger_charges_a_childs_cpu_to_its_part_between_marks():
    """bench/cpu_ledger.py, which splits each cell's CPU by the service's parts: a child that burns ~0.4 s of CPU
    is charged to the part it was named (and nothing to it before it ran); Ray's and Serve's command lines are
    named by deployment and daemon."""
    import sys

    from bench.cpu_ledger import CpuLedger, part_of

    assert part_of("ray::ServeReplica:inferscale:EngineReplica") == "EngineReplica"
    assert part_of("ray::ServeReplica:inferscale:Gateway.handle_request") == "Gateway"
    assert part_of("ray::ProxyActor") == "serve proxy"
    assert part_of("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x") == "ray daemons"
    assert part_of("/usr/bin/redis-server 127.0.0.1:6379") == "redis"
    assert part_of("python something.py") == "other"

    ledger = CpuLedger()
    with burner([sys.executable, "-c", burner_code(0.4)]) as child:
        ledger.named[child.pid] = "burner"
        time.sleep(0.5)  # the interpreter's own start-up is charged before the first mark
        ledger.start()
        idle = ledger.mark("idle")
        busy = burn_and_mark(ledger, child, "busy")
    assert idle.get("burner", 0.0) < 0.05
    assert 0.35 <= busy["burner"] < 1.0
    assert [label for label, _ in ledger.marks] == ["idle", "busy"]


def test_a_process_the_ledger_cannot_name_is_charged_to_its_parents_part():
    """vLLM's engine core is a process of its own (`VLLM::EngineCore`) under its engine replica: its CPU is the
    replica's. Here a named shell's unnamed child (`sleep`)."""
    import subprocess

    import psutil

    from bench.cpu_ledger import CpuLedger

    ledger = CpuLedger()
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        ledger.named[shell.pid] = "shell"
        deadline = time.monotonic() + 10
        while not psutil.Process(shell.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(shell.pid).children()
        ledger.start()
        assert ledger.part(shell.pid) == "shell" and ledger.part(child.pid) == "shell"
        assert ledger.part(os.getpid()) == "bench driver"
    finally:
        for p in psutil.Process(shell.pid).children():
            p.kill()
        shell.wait(timeout=30)


def test_a_vllm_engine_cores_cpu_is_its_parts_and_also_told_apart():
    """The engine replicas' CPU is their own process and vLLM's engine core under it (`VLLM::EngineCore`): the
    ledger charges both to the part and keeps the core's share beside, so the report can say how much of an engine
    replica's CPU is vLLM and how much the replica around it."""
    import sys

    import psutil

    from bench.cpu_ledger import VLLM_CORE, CpuLedger

    ledger = CpuLedger()
    # a named "replica" (a shell) whose unnamed child is titled as vLLM titles its engine core
    with burner(["sh", "-c", f"{sys.executable} -c \"$0\" {VLLM_CORE}", burner_code(0.3)]) as replica:
        ledger.named[replica.pid] = "EngineReplica"
        time.sleep(0.5)
        (core,) = psutil.Process(replica.pid).children()
        assert VLLM_CORE in " ".join(core.cmdline())
        ledger.start()
        spent = burn_and_mark(ledger, replica, "busy")
    assert 0.25 <= spent["EngineReplica"] < 1.0
    assert ledger.vllm_core_marks == [("busy", {"EngineReplica": spent["EngineReplica"]})]


def test_the_report_splits_each_cells_cpu_per_request_by_part_engine_first():
    service = import_service()
    rows = [{"cell": "grpc-n100-inject-k50", "ok": 200, "wall_s": 20.0},
            {"cell": "engine-n100-inject-k50", "ok": 200, "wall_s": 10.0}]
    text = "\n".join(service.cpu_lines({"rows": rows, "cpu_by_cell": {
        "grpc-n100-inject-k50": {"Gateway": 8.0, "EngineReplica": 24.0, "Retrieval": 6.0},
        "engine-n100-inject-k50": {"engine alone": 19.0}}}))
    assert "| grpc-n100-inject-k50 | 200 | 20.0 | 1.90 | total 190: EngineReplica 120, Gateway 40, Retrieval 30 |" in text
    assert "| engine-n100-inject-k50 | 200 | 10.0 | 1.90 | total 95: engine alone 95 |" in text
    text = "\n".join(service.cpu_lines({"rows": rows[:1], "cpu_by_cell": {
        "grpc-n100-inject-k50": {"Gateway": 8.0, "EngineReplica": 24.0}},
        "vllm_core_by_cell": {"grpc-n100-inject-k50": {"EngineReplica": 18.0}}}))
    assert "| total 160: EngineReplica 120 (vLLM core 90), Gateway 40 |" in text


def test_every_phase_of_the_noisy_neighbour_has_a_quarter_adds():
    """Each well-behaved user adds on every fourth request, shifted by its index: over the 3 requests a user makes in
    a phase (--phase 45 --period 15), 20 users make 15 adds, in the baseline too (the same fourth request for every
    user gave the baseline no adds and compared the attacks' adds with answers)."""
    import threading
    from types import SimpleNamespace

    import bench.noisy_neighbour as noisy

    adds = 0
    for turn in range(20):
        calls: list[str] = []
        stop = threading.Event()

        class Client:
            def _called(self, kind):
                calls.append(kind)
                if len(calls) == 3:
                    stop.set()

            def add_facts(self, user, facts):
                self._called("add")

            def answer(self, user, question, k, max_tokens):
                self._called("answer")
                return [SimpleNamespace(timings_ms={"retrieval": 1.0})]

        log = noisy.Log()
        noisy.well_behaved(Client(), f"u{turn}", log, stop, period_s=0.0, offset_s=0.0, turn=turn)
        assert [op for _, _, op, _, _ in log.rows] == calls and len(log.hops) == calls.count("answer")
        assert sorted(log.timings_of) == [i for i, op in enumerate(calls) if op == "answer"]  # kept with the row
        adds += calls.count("add")
    assert adds == 15


def test_the_noisy_neighbour_json_puts_every_row_on_one_clock_with_its_answers_hops():
    """The JSON beside the report: when each request ended, the abuser's rows (from its own process, with their own
    end times) on the same clock as the well-behaved ones, and each answer's hops with its row."""
    import bench.noisy_neighbour as noisy

    log = noisy.Log()
    log.phase = "extraction"
    log.add("tenant-00", "answer", 0.5, "OK", ended_at=100.0, timings={"retrieval": 20.0})
    log.add(noisy.abuser_of("extraction"), "add_memory infer", 2.0, "OK", ended_at=101.5)
    log.add("tenant-01", "add", 0.3, "OK", ended_at=100.25)
    assert noisy.json_rows(log) == [
        {"phase": "extraction", "who": "tenant-00", "op": "answer", "s": 0.5, "code": "OK", "ended": 0.0,
         "timings_ms": {"retrieval": 20.0}},
        {"phase": "extraction", "who": noisy.abuser_of("extraction"), "op": "add_memory infer", "s": 2.0, "code": "OK", "ended": 1.5},
        {"phase": "extraction", "who": "tenant-01", "op": "add", "s": 0.3, "code": "OK", "ended": 0.25}]


def test_the_noisy_neighbour_report_compares_each_kind_with_its_own_baseline():
    """Adds and answers cost differently: each kind's p99 against the same kind's in the baseline; the answers'
    hops and each part's CPU per phase are in the report."""
    from types import SimpleNamespace

    import bench.noisy_neighbour as noisy

    log = noisy.Log()
    for phase, answer_s, add_s in (("baseline", 0.5, 1.0), ("filter", 1.5, 1.5)):
        log.phase = phase
        for _ in range(4):
            log.add("tenant-00", "answer", answer_s, "OK",
                    timings={"retrieval": 20.0, "gateway_total_to_first_chunk": answer_s * 500})
        log.add("tenant-01", "add", add_s, "OK")
        log.add(noisy.abuser_of("extraction"), "filter", 0.1, "HTTP 429")
    args = SimpleNamespace(dtype="float32", users=2, period=15.0, phase=45.0, drain=15.0, attacks="filter",
                           scan_facts=0)
    text = noisy.report(log, ["baseline", "filter"], args, "cpu", {"baseline": {"Gateway": 1.0},
                                                                   "filter": {"Gateway": 9.0, "EngineReplica": 3.0}})
    assert "| filter | 4 | 1,500 | 1,500 | 3.00x | 1 | 1,500 | 1,500 | 1.50x |" in text
    assert "| filter | 4 | 20 | - | - | - | - | 750 | 750 |" in text  # retrieval, ..., first chunk, outside
    assert "| filter | 3.0 | 9.0 | 12.0 |" in text or "| filter | 9.0 | 3.0 | 12.0 |" in text


def test_the_noisy_neighbour_report_says_when_each_phase_s_slowest_request_began_and_how_long_the_phase_lasted():
    """A phase's p99 of 15-45 requests is its slowest one or two: the report says when in the phase the slowest
    answer and add began (a flood's first seconds, its steady state, or a large write landing at its end), and the
    CPU table divides each phase's CPU by ITS seconds, not --phase (an attack's phase lasts until its last request
    ended: a 256-fact add kept one going ~110 s, and its parts' CPU read as twice what 45 s of 2 cores allow)."""
    import bench.noisy_neighbour as noisy

    log = noisy.Log()
    for phase, start in (("baseline", 1000.0), ("kv_flood", 2000.0)):
        log.phase, log.started[phase] = phase, start
        log.add("tenant-00", "answer", 0.5, "OK", ended_at=start + 10.5)
        log.add("tenant-01", "answer", 2.0, "OK", ended_at=start + 110.0)  # began 108 s in
        log.add("tenant-02", "add", 0.4, "OK", ended_at=start + 5.4)
        log.add("tenant-03", "add", 9.0, "DEADLINE_EXCEEDED", ended_at=start + 20.0)  # failed: not "slowest OK"
        log.add(noisy.abuser_of("extraction"), "add", 50.0, "OK", ended_at=start + 60.0)  # the abuser's: never counted
    log.lasted = {"baseline": 45.0, "kv_flood": 112.0}
    args = SimpleNamespace(dtype="float32", users=20, period=15.0, phase=45.0, drain=15.0, attacks="kv_flood",
                           scan_facts=0)
    cpu = {"baseline": {"EngineReplica": 30.0, "Gateway": 6.0}, "kv_flood": {"EngineReplica": 150.0, "Gateway": 29.2}}
    text = noisy.report(log, ["baseline", "kv_flood"], args, "test cpu", cpu)
    cores = os.cpu_count() or 1
    assert "| kv_flood | 2 | 500 | 2,000 | 1.00x | 1 | 400 | 400 | 1.00x | 108.0 / 5.0 |" in text
    assert f"| kv_flood | 150.0 | 29.2 | 179.2 | 112 | {179.2 / (112 * cores):.0%} |" in text
    assert f"| baseline | 30.0 | 6.0 | 36.0 | 45 | {36.0 / (45 * cores):.0%} |" in text


def test_the_noisy_neighbour_abuser_starts_before_its_phase_and_attacks_only_when_let_go(tmp_path):
    """The abuser's process is spawned and has imported its clients before its phase (its ~1 s of start-up, at the
    engine's niceness, had fallen in the phase's first seconds, where the slowest well-behaved requests of three
    attacks were); its first request is sent only once the phase lets it go. Against a port nothing listens on: every
    request a connection error, every one recorded."""
    import bench.noisy_neighbour as noisy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    abuser = noisy.AbuserProcess("filter", SimpleNamespace(grpc_port=port, http_port=port), "s" * 40, 0.5, tmp_path)
    abuser.start()
    assert abuser.ready.is_set() and abuser.proc.is_alive() and not abuser.out.exists()
    time.sleep(0.3)
    let_go = time.time()
    rows = abuser.run()
    assert rows and all(who == noisy.abuser_of("filter") for who, *_ in rows)
    assert all(ended - secs >= let_go - 0.05 for _, _, secs, _, ended in rows)  # none began before the phase
    assert {code for *_, code, _ in rows} == {"ConnectError"}
