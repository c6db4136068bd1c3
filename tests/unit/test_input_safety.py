"""Input that can never poison a user, below the service level: the encoder pool's per-fact failures (one
bad fact, or one bad request among several users' requests, never fails the others), the encoder's own limit as the
gateway checks it, and all-or-nothing writes in the gateway when the push after the registry write fails.
The same properties on the running service: tests/service/test_service_safety.py."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch
from support.fact_texts import LONG_FACT, text_of_tokens

from inferscale_server.api import pb2
from inferscale_server.auth import Authenticator
from inferscale_server.encoder_pool import EncodeFailure
from inferscale_server.errors import ApiError
from inferscale_server.gateway import GatewayCore
from inferscale_server.registry import RedisRegistry

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    from inferscale_server.encoder_pool import EncoderPool

    return EncoderPool()  # the deployment class, called directly: the real model and its fair scheduler


def test_the_limit_is_measured_with_the_serving_tokenizer(pool):
    fe = pool.fe
    why = fe.problem(LONG_FACT)
    n = len(fe.template.fact_ids(LONG_FACT))
    assert n > fe.max_fact_tokens and why == f"is {n} tokens long (serving model's tokenizer), the limit is 256 tokens"
    exact = text_of_tokens(fe.template, fe.max_fact_tokens)
    assert len(fe.template.fact_ids(exact)) == fe.max_fact_tokens and fe.problem(exact) is None
    assert fe.problem(exact + " and one more word") is not None


def _batch(pool, requests):
    """Requests of several users sent at once (the fair scheduler merges what waits together into its batches)."""
    async def together():
        return await asyncio.gather(*(pool.encode(f"user{i}", items) for i, items in enumerate(requests)))

    return asyncio.run(together())


def test_one_bad_fact_fails_only_itself(pool):
    (out,) = _batch(pool, [[("Bob is allergic to peanuts.", []), (LONG_FACT, []), ("Bob lives in Denver.", [])]])
    assert isinstance(out[1], EncodeFailure) and "tokens long" in out[1].reason
    assert not isinstance(out[0], EncodeFailure) and not isinstance(out[2], EncodeFailure)
    ((alone,),) = _batch(pool, [[("Bob is allergic to peanuts.", [])]])
    assert torch.equal(out[0].token_ids, alone.token_ids)  # the same fact as when encoded alone
    assert torch.allclose(out[0].k_pre, alone.k_pre, atol=1e-4)


def test_a_bad_request_in_the_same_batch_never_fails_another_users(pool):
    bad, good = _batch(pool, [[(LONG_FACT, [])], [("Alice has a cat named Pixel.", [])]])
    assert len(bad) == len(good) == 1 and isinstance(bad[0], EncodeFailure)
    assert not isinstance(good[0], EncodeFailure) and good[0].num_tokens > 0


class _FailingPush:
    """Fault injection: the retrieval/engine push after the registry write fails (a replica died mid-write).
    Everything before it (the encoder's check) is the real pool's."""

    def __init__(self, pool):
        self.pool, self.forgotten = pool, []

    async def check_facts(self, texts):
        return await self.pool.check(texts)

    async def index_facts(self, user_id, records):
        raise ConnectionError("engine replica went away")

    async def forget(self, user_id, facts):
        self.forgotten += facts


def test_writes_are_all_or_nothing(pool, redis_url):
    reg = RedisRegistry(redis_url, prefix=f"safe{uuid.uuid4().hex[:8]}:")
    backends = _FailingPush(pool)
    core = GatewayCore(reg, backends=backends, auth=Authenticator.insecure())
    caller = asyncio.run(core.authenticate("AddFacts", None))
    req = pb2.AddFactsRequest(user_id="carol", facts=[pb2.FactInput(text="Carol keeps bees."),
                                                      pb2.FactInput(text=LONG_FACT)])
    with pytest.raises(ApiError) as e:  # refused by the encoder's limit before anything is written
        asyncio.run(core.AddFacts(req.SerializeToString(), caller))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.message.startswith("facts[1].text is ") and "limit is 256 tokens; nothing was stored" in e.value.message
    assert reg.count("carol") == 0 and reg.user_bytes("carol") == 0
    ok = pb2.AddFactsRequest(user_id="carol", facts=[pb2.FactInput(text="Carol keeps bees.")])
    with pytest.raises(ApiError) as e:  # the push fails: the registry rows are removed again
        asyncio.run(core.AddFacts(ok.SerializeToString(), caller))
    assert e.value.code == grpc.StatusCode.INTERNAL and "nothing was stored" in e.value.message
    assert "engine replica went away" not in e.value.message  # internals stay in the log
    assert reg.count("carol") == 0 and reg.user_bytes("carol") == 0 and len(backends.forgotten) == 1
    reg.close()


class _FlakyDeletes:
    """Fault injection: the registry's delete fails `failures` times (the outage that failed the push)."""

    def __init__(self, registry, failures: int):
        self.registry, self.failures = registry, failures

    def delete(self, user_id, fact_id):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("redis went away")
        return self.registry.delete(user_id, fact_id)

    def __getattr__(self, name):
        return getattr(self.registry, name)


def test_an_undo_that_fails_says_what_may_still_be_stored(pool, redis_url, monkeypatch):
    """Issue 31: a write whose push failed removes its rows again; when the registry fails that too, the delete
    is retried, and what could not be removed is reported by id instead of "nothing was stored"."""
    from inferscale_server.gateway import core as gateway_core

    monkeypatch.setattr(gateway_core, "UNDO_BACKOFF_S", 0.01)
    reg = RedisRegistry(redis_url, prefix=f"undo{uuid.uuid4().hex[:8]}:")
    caller = None
    for failures, user in ((gateway_core.UNDO_ATTEMPTS - 1, "dan"), (10, "eve")):
        flaky = _FlakyDeletes(reg, failures)
        core = GatewayCore(flaky, backends=_FailingPush(pool), auth=Authenticator.insecure())
        caller = caller or asyncio.run(core.authenticate("AddFacts", None))
        req = pb2.AddFactsRequest(user_id=user, facts=[pb2.FactInput(text=f"{user} keeps bees.")])
        with pytest.raises(ApiError) as e:
            asyncio.run(core.AddFacts(req.SerializeToString(), caller))
        if user == "dan":  # removed at the last try
            assert "nothing was stored" in e.value.message and reg.count("dan") == 0
        else:
            assert "nothing was stored" not in e.value.message, e.value.message
            (left,) = reg.list("eve")[0]  # what the message says is there
            assert f"1 of its 1 facts could not be removed again and may still be stored ({left.fact_id})" in (
                e.value.message)
    reg.close()


def test_the_kv_quota_counts_the_encoders_measure_before_the_write(pool, redis_url):
    """The gateway counts each fact's KV bytes (the serving tokenizer's tokens x the model's KV bytes per token,
    as the encoder pool measures them) against the user's KV quota in the registry's write: over it, the request
    is refused whole (RESOURCE_EXHAUSTED naming the limit) and nothing is written or pushed."""
    from inferscale_server.errors import to_api_error
    from inferscale_server.limits import Limits
    from inferscale_server.registry import QuotaExceededError

    texts = ["Dora keeps bees on the roof.", "Dora's hives are painted yellow."]
    sizes = asyncio.run(pool.check(texts))
    tokens = [len(pool.fe.template.fact_ids(t)) for t in texts]
    assert sizes == [2 * 30 * 3 * 64 * 4 * n for n in tokens]  # SmolLM2 fp32: 46,080 bytes per token
    reg = RedisRegistry(redis_url, prefix=f"kvq{uuid.uuid4().hex[:8]}:")
    backends = _FailingPush(pool)
    core = GatewayCore(reg, backends=backends, limits=Limits(max_kv_bytes_per_user=sum(sizes) - 1),
                       auth=Authenticator.insecure())
    caller = asyncio.run(core.authenticate("AddFacts", None))
    req = pb2.AddFactsRequest(user_id="dora", facts=[pb2.FactInput(text=t) for t in texts])
    with pytest.raises(QuotaExceededError) as e:  # the front doors map it (errors.to_api_error)
        asyncio.run(core.AddFacts(req.SerializeToString(), caller))
    err = to_api_error(e.value)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit of {sum(sizes) - 1} KV bytes" in err.message
    assert reg.count("dora") == 0 and reg.user_kv_bytes("dora") == 0 and backends.forgotten == []
    reg.close()
