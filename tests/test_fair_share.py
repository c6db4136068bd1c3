"""Each tenant's fair share of the shared engine and encoder (issue 31, the noisy neighbour): a user who keeps the
engine's admission limit or the encoder pool busy must not make another user's small request wait behind all of
its work. No Ray, no vLLM: the admission bookkeeping and the encoder pool's scheduler are checked directly, the
scheduler over a recording encoder (the order of encodes is what is under test)."""
from __future__ import annotations

import contextlib

import grpc
import pytest

from inferscale_server.admission import Admission, EngineAtCapacity


# ------------------------------------------------------------------------------------ engine admission
def test_a_user_past_its_share_is_refused_while_another_user_is_still_admitted():
    adm = Admission(capacity_tokens=500, queue_factor=2.0)  # limit 1,000
    with contextlib.ExitStack() as held:
        held.enter_context(adm.admit("heavy", 400))
        held.enter_context(adm.admit("light", 10))  # two users in flight: a share is 500 tokens each
        with pytest.raises(EngineAtCapacity) as e:  # 400 + 200 > 500, though the engine has 590 tokens free
            held.enter_context(adm.admit("heavy", 200))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "ENGINE_AT_CAPACITY"
        assert e.value.retry_after_s >= 1
        assert "this user holds 400 tokens of its share of 500 (this request: 200)" in e.value.message
        held.enter_context(adm.admit("light", 200))  # the other user is still admitted
        held.enter_context(adm.admit("heavy", 100))  # within its share: 500
        assert adm.stats()["users_in_flight"] == 2 and adm.stats()["in_flight_tokens"] == 710
    assert adm.stats()["refused_over_share"] == 1 and adm.stats()["users_in_flight"] == 0


def test_a_user_alone_has_the_whole_limit_and_anyone_gets_one_request():
    adm = Admission(capacity_tokens=500, queue_factor=2.0)
    with contextlib.ExitStack() as held:
        for _ in range(10):  # alone: 10 x 100 = the whole limit
            held.enter_context(adm.admit("alone", 100))
        with pytest.raises(EngineAtCapacity, match="at capacity"):  # the limit itself still holds for everyone
            held.enter_context(adm.admit("other", 1))
    with contextlib.ExitStack() as held:
        for u in range(20):  # 20 users with something in flight: a share is 50 tokens
            held.enter_context(adm.admit(f"user{u}", 10))
        held.enter_context(adm.admit("big", 300))  # its first request: never below one request, whatever its share
        with pytest.raises(EngineAtCapacity, match="share of 47"):  # 1,000 // 21 users
            held.enter_context(adm.admit("big", 1))
        assert adm.share_tokens("newcomer") == 1000 // 22


def test_a_share_grows_back_as_the_other_users_finish():
    adm = Admission(capacity_tokens=500, queue_factor=2.0)
    with adm.admit("heavy", 400):
        with adm.admit("light", 10):
            with pytest.raises(EngineAtCapacity):
                with adm.admit("heavy", 400):
                    pass
        with adm.admit("heavy", 400):  # the light user is done: the heavy one is alone again
            assert adm.stats()["in_flight_tokens"] == 800
    with pytest.raises(ValueError, match="at least 1 token"):
        with adm.admit("u", 0):
            pass
