"""Each caller's work budget on a gateway replica (services/gateway/work_budget.py, issue 31): the bucket's
arithmetic (refill, debt, the retry hint, admins exempt, the LRU of tracked callers), and through the real gRPC
server and the real Mem0 HTTP app: a caller whose heavy requests spent its budget is refused with
RESOURCE_EXHAUSTED / HTTP 429, reason CALLER_WORK and a retry hint, while another caller is served at the same
moment. A debt binds only while another caller not in debt is active (the budget is a share: work-conserving). No Ray: the gateway runs in registry-only mode, where an add's encode cost is still charged before the
encoder would be asked."""
from __future__ import annotations

import contextvars
import time
import uuid

import grpc
import httpx
import pytest
from support.auth_fixture import rich_refusal, token_channel, token_for
from support.gateway_doors import both_doors

from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import Principal
from inferscale_server.errors import ApiError
from inferscale_server.gateway.work_budget import REQUEST_UNITS, WorkBudget, WorkLimit
from inferscale_server.limits import Limits

ALICE, BOB = Principal("alice", frozenset({"memory:read"})), Principal("bob", frozenset({"memory:read"}))
ADMIN = Principal("ops", frozenset({"memory:read", "memory:admin"}))


def request(budget: WorkBudget, caller: Principal, *charges: float, spent: float = 0.0) -> None:
    """One request of `caller` (its own context, as a front door's task has): admitted, then `charges` before its
    work, then `spent` after it."""
    def run():
        budget.admit(caller)
        for units in charges:
            budget.charge(units)
        budget.spent(spent)
    contextvars.copy_context().run(run)


def test_a_request_runs_into_debt_and_the_caller_is_refused_until_it_has_refilled():
    budget = WorkBudget(WorkLimit(rate_per_s=100.0, burst=100.0))
    request(budget, BOB)  # a light caller, active: alice's debt costs bob, so it binds
    request(budget, ALICE, 40.0)
    assert budget.balance("alice") == pytest.approx(100 - REQUEST_UNITS - 40, abs=20)
    # a request is never refused for its own size: admitted at a balance >= 0, it may charge far past zero
    request(budget, ALICE, 300.0)
    debt = -budget.balance("alice")
    assert debt == pytest.approx(300 + 2 * REQUEST_UNITS - 100 + 40, abs=20)
    with pytest.raises(ApiError) as e:
        request(budget, ALICE)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "CALLER_WORK"
    assert e.value.retry_after_s == pytest.approx(debt / 100.0, abs=0.2)  # the time to refill to zero
    assert "in debt" in e.value.message and budget.refused == 1
    request(budget, BOB, 90.0)  # another caller, at the same moment: its own balance
    for _ in range(5):
        request(budget, ADMIN, 10_000.0)  # admins are not limited, nor tracked
    assert budget.balance("ops") == 100.0
    time.sleep(e.value.retry_after_s + 0.05)
    request(budget, ALICE)  # the hint was enough
    time.sleep(1.1)
    assert budget.balance("alice") == 100.0  # refilled up to the burst, not past it
    with pytest.raises(ValueError, match="positive"):
        WorkLimit(rate_per_s=0.0)


def test_a_charge_is_refused_for_the_debt_of_the_callers_other_requests_never_for_its_own():
    """Requests admitted together at a non-negative balance: the first to charge may go into debt; the others'
    charges before their work are refused. Work already done (`spent`) is never refused, and a refund (an estimate
    corrected down) fills the balance back, up to the burst."""
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=50.0))
    request(budget, BOB)
    first, second = contextvars.copy_context(), contextvars.copy_context()
    first.run(budget.admit, ALICE)
    second.run(budget.admit, ALICE)  # both admitted: the balance is 48
    first.run(budget.charge, 30.0)
    first.run(budget.charge, 30.0)  # its own charges: never a refusal, whatever the balance
    with pytest.raises(ApiError) as e:
        second.run(budget.charge, 5.0)  # the first request's debt, made since this one was admitted
    assert e.value.reason == "CALLER_WORK" and e.value.retry_after_s == pytest.approx(12 - REQUEST_UNITS, abs=0.2)
    second.run(budget.spent, 5.0)  # done work is charged, never refused
    assert budget.balance("alice") == pytest.approx(50 - 2 * REQUEST_UNITS - 65, abs=0.2)
    first.run(budget.spent, -500.0)  # an estimate corrected by what the request really cost
    assert budget.balance("alice") == 50.0
    budget.spent(1e9)  # outside any request (no bill): nothing is charged
    assert budget.balance("alice") == 50.0


def test_a_debt_binds_only_while_a_caller_not_in_debt_is_active():
    """Work-conserving: a caller alone is served however deep in debt; so are callers who are all in debt (the
    encoder's fair queue divides their work); the debt binds as soon as a light caller is active, and stops binding
    once that caller has been quiet for CONTENTION_WINDOW_S."""
    from inferscale_server.gateway import work_budget

    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=10.0))
    for _ in range(3):
        request(budget, ALICE, 1000.0)  # alone: admitted every time, the debt grows
    assert budget.balance("alice") < -2900 and budget.refused == 0
    request(budget, BOB, 500.0)  # bob in debt too: nobody light to protect, both served
    request(budget, ALICE)
    carol = Principal("carol", frozenset({"memory:read"}))
    request(budget, carol)  # a light caller arrives
    with pytest.raises(ApiError) as e:
        request(budget, ALICE)
    assert e.value.reason == "CALLER_WORK"
    with pytest.raises(ApiError):
        request(budget, BOB)
    request(budget, carol)  # carol is served, of course
    saved = work_budget.CONTENTION_WINDOW_S
    work_budget.CONTENTION_WINDOW_S = 0.2
    try:
        time.sleep(0.3)  # carol has gone quiet: alice is alone with her debt again
        request(budget, ALICE)
    finally:
        work_budget.CONTENTION_WINDOW_S = saved
    assert budget.refused == 2


def test_the_callers_tracked_are_a_bounded_lru_and_one_forgotten_has_a_full_burst():
    budget = WorkBudget(WorkLimit(rate_per_s=0.001, burst=10.0), tracked=3)
    for who in ("p0", "p1", "p2"):
        request(budget, Principal(who, frozenset({"memory:read"})), 100.0)
    request(budget, Principal("p3", frozenset({"memory:read"})), 5.0)  # the least recently charged (p0) goes
    assert budget.balance("p0") == 10.0 and budget.balance("p1") < 0 and budget.balance("p2") < 0
    assert budget.balance("p3") == pytest.approx(10 - REQUEST_UNITS - 5, abs=0.01)
    with pytest.raises(ApiError):
        request(budget, Principal("p1", frozenset({"memory:read"})))  # still tracked: still in debt
    assert len(budget._balances) == 3


@pytest.fixture(scope="module")
def gateway(redis_url, jwt_secret):
    with both_doors(redis_url, jwt_secret, Limits(work_units_per_s_per_caller=4.0, work_burst_per_caller=1000.0), "work") as doors:
        yield doors


WINDOW = ["w" * 999 + " "] * 16  # the largest caller window: 16,000 characters, about 4,000 tokens to encode


def test_a_caller_whose_heavy_adds_spent_its_budget_is_refused_at_both_doors_while_another_is_served(gateway):
    core, grpc_server, http_server, secret = gateway
    ch = grpc_server.channel()
    carol, dave = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("carol", "dave"))
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, carol)))
    other = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, dave)))
    assert list(other.ListMemories(pb2.ListMemoriesRequest(user_id=dave)).facts) == []  # dave is active, not in debt
    heavy = pb2.AddFactsRequest(user_id=carol, facts=[pb2.FactInput(text="Carol's fact behind a huge window.",
                                                                 window=WINDOW)])
    stub.AddFacts(heavy)  # about 4,000 units from a burst of 1,000: admitted, and not refused for its own size
    assert core.work.balance(carol) < -2900
    code, details, trailers = rich_refusal(lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id=carol)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "CALLER_WORK"
    assert details["RetryInfo"].retry_delay.seconds >= 700  # ~3,000 units in debt at 4 a second
    assert list(other.ListMemories(pb2.ListMemoriesRequest(user_id=dave)).facts) == []  # the same moment
    r = httpx.post(f"{http_server.url}/v3/memories/", json={}, headers={"authorization": f"Token {token_for(secret, carol)}"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 700 and "budget" in r.json()["detail"]
    ok = httpx.post(f"{http_server.url}/v3/memories/", json={}, headers={"authorization": f"Token {token_for(secret, dave)}"})
    assert ok.status_code == 200 and ok.json()["count"] == 0
    admin = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, "support", admin=True)))
    assert len(admin.ListMemories(pb2.ListMemoriesRequest(user_id=carol)).facts) == 1  # admins are not limited
    ch.close()


def test_mem0_adds_are_charged_and_refuse_their_caller_on_grpc_afterwards(gateway):
    """The Mem0 door's add (infer=false) is charged through the same core as AddFacts: its caller's next request,
    on gRPC, is refused, and another caller's Mem0 add goes through."""
    core, grpc_server, http_server, secret = gateway
    erin, frank = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("erin", "frank"))
    # 4 facts of ~1,900 characters, each encoded behind the ones before it: ~19,000 characters, ~4,800 units
    messages = [{"role": "user", "content": f"Erin's note {i}: " + "x" * 1900} for i in range(4)]
    r = httpx.post(f"{http_server.url}/v3/memories/", json={}, headers={"authorization": f"Token {token_for(secret, frank)}"})
    assert r.status_code == 200  # frank is active, not in debt: erin's debt would cost him
    r = httpx.post(f"{http_server.url}/v3/memories/add/", json={"messages": messages, "user_id": erin, "infer": False},
                   headers={"authorization": f"Token {token_for(secret, erin)}"})
    assert r.status_code == 200, r.text
    assert core.work.balance(erin) < -3000  # from a burst of 1,000
    ch = grpc_server.channel()
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, erin)))
    code, details, _ = rich_refusal(lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id=erin)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "CALLER_WORK"
    r = httpx.post(f"{http_server.url}/v3/memories/add/", json={"messages": messages[:1], "user_id": frank, "infer": False},
                   headers={"authorization": f"Token {token_for(secret, frank)}"})
    assert r.status_code == 200, r.text
    ch.close()


def test_an_answer_is_estimated_from_its_text_and_every_choices_cap_before_it_runs(gateway):
    """What answer_pieces charges before the engine runs (the engine's usage corrects it when the answer ends): the
    text prefilled / 4 and n x the cap; an OpenAI request without a cap at default_max_tokens; never more output
    than the engine would accept (MAX_OUTPUT_TOKENS)."""
    from inferscale_server.messages import OpenAIChat
    from inferscale_server.openai_params import MAX_OUTPUT_TOKENS

    core = gateway[0]
    story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    prefill = len(story[0]["content"]) / 4
    assert core._answer_units("q" * 40, [{"role": "system", "content": "s" * 60}], 8, None) == 100 / 4 + 8
    logprobs = OpenAIChat(sampling={"n": 16, "max_completion_tokens": 780, "logprobs": True, "top_logprobs": 20},
                          messages=story)
    assert core._answer_units(story[0]["content"], None, 256, logprobs) == prefill + 16 * 780
    uncapped = OpenAIChat(sampling={"n": 2}, messages=story)
    assert core._answer_units(story[0]["content"], None, 256, uncapped) == prefill + 2 * core.limits.default_max_tokens
    huge = OpenAIChat(sampling={"max_tokens": 10**6, "n": "x"}, messages=story)  # odd values: the engine refuses them
    assert core._answer_units(story[0]["content"], None, 256, huge) == prefill + MAX_OUTPUT_TOKENS
