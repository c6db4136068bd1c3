"""Each caller's work budget on a gateway replica (services/gateway/work_budget.py, issue 31): one balance per shared
resource (the gateway, the encoder pool, the engine) and the arithmetic of each (refill, debt, the retry hint, admins
exempt, the LRU of tracked callers); a debt refuses only the routes that use its resource (an import's encoder debt
leaves questions served, an answer-heavy caller's engine debt leaves its adds served); and through the real gRPC
server and the real Mem0 HTTP app: a caller whose heavy adds spent its encoder share is refused further adds with
RESOURCE_EXHAUSTED / HTTP 429, reason CALLER_WORK and a retry hint, while its reads and questions pass the budget and
another caller is served at the same moment. A debt binds only while another caller not in debt for that resource is
active on it (the budget is a share: work-conserving). No Ray: the gateway runs in registry-only mode, where an add's
encode cost is still charged before the encoder would be asked."""
from __future__ import annotations

import contextvars
import time
import uuid

import grpc
import httpx
import pytest
from support.auth_fixture import rich_refusal, token_channel, token_for
from support.gateway_doors import both_doors

from inferscale_server import api
from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import OPEN_RPCS, RPC_SCOPES, Principal
from inferscale_server.errors import ApiError
from inferscale_server.gateway.work_budget import (
    ACTIVE_RECOUNT_S,
    REQUEST_UNITS,
    ROUTE_RESOURCES,
    SHARES_PER_RESOURCE,
    Resource,
    WorkBudget,
    WorkLimit,
    query_units,
    route_resources,
)
from inferscale_server.limits import Limits

ALICE, BOB = Principal("alice", frozenset({"memory:read"})), Principal("bob", frozenset({"memory:read"}))
ADMIN = Principal("ops", frozenset({"memory:read", "memory:admin"}))
ENCODE, ENGINE, GATEWAY = Resource.ENCODE, Resource.ENGINE, Resource.GATEWAY


def request(budget: WorkBudget, caller: Principal, *charges: float, route: str = "AddFacts",
            spent: float = 0.0) -> None:
    """One request of `caller` on `route` (its own context, as a front door's task has): admitted, then `charges`
    before its work, then `spent` after it, all on the resource the route's work draws on (AddFacts: the encoder,
    Answer: the engine, a read: the gateway)."""
    resource = next(iter(ROUTE_RESOURCES[route]), GATEWAY)

    def run():
        budget.admit(caller, route)
        for units in charges:
            budget.charge(resource, units)
        budget.spent(resource, spent)
    contextvars.copy_context().run(run)


def refusal(budget: WorkBudget, caller: Principal, route: str, *charges: float) -> ApiError:
    with pytest.raises(ApiError) as e:
        request(budget, caller, *charges, route=route)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "CALLER_WORK"
    return e.value


def test_a_request_runs_into_debt_and_the_caller_is_refused_until_it_has_refilled():
    budget = WorkBudget(WorkLimit(rate_per_s=100.0, burst=100.0))
    request(budget, BOB, 1.0)  # a light caller of the encoder, active: alice's debt costs bob, so it binds
    request(budget, ALICE, 40.0)
    assert budget.balance("alice", ENCODE) == pytest.approx(100 - 40, abs=20)
    assert budget.balance("alice", GATEWAY) == pytest.approx(100 - REQUEST_UNITS, abs=20)  # every request's
    # a request is never refused for its own size: admitted at a balance >= 0, it may charge far past zero
    request(budget, ALICE, 300.0)
    debt = -budget.balance("alice", ENCODE)
    assert debt == pytest.approx(300 - 100 + 40, abs=20)
    e = refusal(budget, ALICE, "AddFacts")
    assert e.retry_after_s == pytest.approx(debt / 100.0, abs=0.2)  # the time to refill to zero
    assert "in debt" in e.message and "the encode" in e.message and budget.refused == 1
    request(budget, BOB, 90.0)  # another caller, at the same moment: its own balance
    for _ in range(5):
        request(budget, ADMIN, 10_000.0)  # admins are not limited, nor tracked
    assert all(budget.balance("ops", r) == 100.0 for r in Resource)
    time.sleep(e.retry_after_s + 0.05)
    request(budget, ALICE)  # the hint was enough
    time.sleep(1.1)
    assert budget.balance("alice", ENCODE) == 100.0  # refilled up to the burst, not past it
    with pytest.raises(ValueError, match="positive"):
        WorkLimit(rate_per_s=0.0)


def test_an_encoder_debt_leaves_the_callers_questions_and_reads_served_and_refuses_its_further_writes():
    """The bench's onboarding user (bench/service.py: an import of its history, then questions): its import spent
    its encoder share, not its engine share; while another caller uses both, its answers and reads are admitted, its
    further adds, updates and deletes (which re-encode) are refused until its encoder balance has refilled."""
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=100.0))
    request(budget, BOB, 1.0)  # bob is active on the encoder ...
    request(budget, BOB, 1.0, route="Answer")  # ... and on the engine, in debt for neither
    request(budget, ALICE, 5000.0)  # alice imports her history: ~4,900 units in debt on the encoder
    for _ in range(3):
        request(budget, ALICE, 60.0, route="Answer", spent=-10.0)  # her questions: the engine is hers to share
    for route in ("ListMemories", "Search", "GetMemory", "DeleteUser"):
        request(budget, ALICE, route=route)
    assert budget.balance("alice", ENGINE) == pytest.approx(100 - 3 * 50, abs=1)  # an engine debt of its own now
    e = refusal(budget, ALICE, "AddFacts", 1.0)
    assert e.retry_after_s == pytest.approx(4900, abs=5) and "4900 units for the encode" in e.message
    for route in ("AddMemory", "UpdateMemory", "DeleteMemory"):
        refusal(budget, ALICE, route)
    request(budget, BOB, 1.0)  # bob's adds at the same moment
    assert budget.refused == 4


def test_an_engine_debt_refuses_the_callers_answers_and_extractions_and_leaves_its_adds_served():
    """The reverse: a caller whose n x max_tokens answers spent its engine share is refused answers (and Mem0's
    infer=true extraction, checked once the body says infer=true: WorkBudget.check), never its plain adds."""
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=100.0))
    request(budget, BOB, 1.0, route="Answer")
    request(budget, BOB, 1.0)
    request(budget, ALICE, 16 * 780.0, route="Answer")  # n=16 x 780 tokens: ~12,400 units in debt on the engine
    e = refusal(budget, ALICE, "Answer")
    assert e.retry_after_s == pytest.approx(16 * 780 - 100, abs=5) and "for the engine" in e.message
    request(budget, ALICE, 50.0)  # an add: the encoder is another resource
    request(budget, ALICE, 40.0, route="AddMemory")  # Mem0's add with infer=false: admitted, encoded
    extraction = contextvars.copy_context()
    extraction.run(budget.admit, ALICE, "AddMemory")  # admitted for its encoder work ...
    extraction.run(budget.check, ENCODE)
    with pytest.raises(ApiError) as refused:
        extraction.run(budget.check, ENGINE)  # ... the body says infer=true: the engine it needs is in debt
    assert refused.value.reason == "CALLER_WORK"
    assert budget.balance("alice", ENCODE) == pytest.approx(100 - 90, abs=1) and budget.refused == 2


def test_a_scan_debt_binds_every_route_because_every_request_uses_the_gateway():
    """Scans (registry reads, filter matching) are the gateway replica's own work: a share of their own, and every
    request uses the gateway, so a caller in debt there is refused everything while another caller is active."""
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=100.0))
    request(budget, BOB, route="GetMemory")
    request(budget, ALICE, 500.0, route="ListMemories")  # 16,000 facts read and matched
    assert budget.balance("alice", GATEWAY) < -300
    assert budget.balance("alice", ENCODE) == budget.balance("alice", ENGINE) == 100.0
    for route in ("ListMemories", "AddFacts", "Answer", "Models"):
        refusal(budget, ALICE, route)


def test_every_route_the_doors_authenticate_names_its_resources():
    """The front doors authenticate with the RPC names (gRPC, the Mem0 door) and "Models" (the OpenAI door's
    model listing); each is mapped, the gateway always included; an unmapped route is a bug, said plainly."""
    for rpc in (set(api.REQUEST_TYPES) - OPEN_RPCS) | set(RPC_SCOPES) | {"Models"}:
        assert GATEWAY in route_resources(rpc)
    assert route_resources("Answer") == {GATEWAY, ENGINE} and route_resources("AddFacts") == {GATEWAY, ENCODE}
    with pytest.raises(ValueError, match="'Frobnicate'"):
        WorkBudget().admit(ADMIN, "Frobnicate")


def test_a_charge_is_refused_for_the_debt_of_the_callers_other_requests_never_for_its_own():
    """Requests admitted together at a non-negative balance: the first to charge may go into debt; the others'
    charges before their work are refused. Work already done (`spent`) is never refused, and a refund (an estimate
    corrected down) fills the balance back, up to the burst."""
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=50.0))
    request(budget, BOB, 1.0)
    first, second = contextvars.copy_context(), contextvars.copy_context()
    first.run(budget.admit, ALICE, "AddFacts")
    second.run(budget.admit, ALICE, "AddFacts")  # both admitted: the encoder balance is 50
    first.run(budget.charge, ENCODE, 30.0)
    first.run(budget.charge, ENCODE, 30.0)  # its own charges: never a refusal, whatever the balance
    with pytest.raises(ApiError) as e:
        second.run(budget.charge, ENCODE, 5.0)  # the first request's debt, made since this one was admitted
    assert e.value.reason == "CALLER_WORK" and e.value.retry_after_s == pytest.approx(10, abs=0.2)
    second.run(budget.charge, ENGINE, 5.0)  # another resource: its balance is not in debt
    second.run(budget.spent, ENCODE, 5.0)  # done work is charged, never refused
    assert budget.balance("alice", ENCODE) == pytest.approx(50 - 65, abs=0.2)
    first.run(budget.spent, ENCODE, -500.0)  # an estimate corrected by what the request really cost
    assert budget.balance("alice", ENCODE) == 50.0
    budget.spent(ENCODE, 1e9)  # outside any request (no bill): nothing is charged
    assert budget.balance("alice", ENCODE) == 50.0


def test_a_debt_binds_only_while_a_caller_not_in_debt_is_active_on_that_resource():
    """Work-conserving: a caller alone is served however deep in debt; so are callers who are all in debt (the
    encoder's fair queue divides their work); the debt binds as soon as a light caller of the same resource is
    active (a caller active only on another one does not count), and stops binding once that caller has been quiet
    for CONTENTION_WINDOW_S."""
    from inferscale_server.gateway import work_budget

    # the gateway's balance roomy: the requests' own REQUEST_UNITS are not what this is about
    budget = WorkBudget(WorkLimit(rate_per_s=1.0, burst=10.0), gateway=WorkLimit(rate_per_s=1.0, burst=100.0))
    for _ in range(3):
        request(budget, ALICE, 1000.0)  # alone: admitted every time, the debt grows
    assert budget.balance("alice", ENCODE) < -2900 and budget.refused == 0
    request(budget, BOB, 500.0)  # bob in debt too: nobody light to protect, both served
    request(budget, ALICE)
    carol = Principal("carol", frozenset({"memory:read"}))
    request(budget, carol, 5.0, route="Answer")  # a light caller of the engine, not of the encoder
    request(budget, ALICE)
    request(budget, carol, 1.0)  # now of the encoder too
    refusal(budget, ALICE, "AddFacts")
    refusal(budget, BOB, "AddFacts")
    request(budget, carol, 1.0)  # carol is served, of course
    saved = work_budget.CONTENTION_WINDOW_S
    work_budget.CONTENTION_WINDOW_S = 0.2
    try:
        time.sleep(0.3)  # carol has gone quiet: alice is alone with her debt again
        request(budget, ALICE)
    finally:
        work_budget.CONTENTION_WINDOW_S = saved
    assert budget.refused == 2


def test_the_gateway_has_a_budget_of_its_own_sized_in_its_cpu_not_the_models():
    """Limits' gateway budget (64 a second, bursts of 256) is not the model's (the chart sets 4,096 a second for a
    GPU engine): a caller's scans spend the gateway's balance only, and a scan debt is refused with the gateway's
    numbers and a retry hint at the gateway's rate, while the encoder's and the engine's balances stay full."""
    budget = WorkBudget(WorkLimit(rate_per_s=4096.0, burst=8192.0), gateway=WorkLimit(rate_per_s=64.0, burst=1024.0))
    assert budget.balance("alice", GATEWAY) == 1024.0 and budget.balance("alice", ENCODE) == 8192.0
    request(budget, BOB, route="GetMemory")  # a caller not in debt is active on the gateway
    request(budget, ALICE, 1024.0 + 640.0, route="ListMemories")  # ~53,000 facts read: 640 units past the burst
    err = refusal(budget, ALICE, "AddFacts")  # every route uses the gateway
    assert ("the gateway: 64 work units per second and bursts of 1024 now (64 and 1024 while at most 4 callers share "
            "it)") in err.message
    assert 9.0 < err.retry_after_s <= 10.5  # ~641 units at 64 a second, not at 4,096
    assert budget.balance("alice", ENCODE) == 8192.0 and budget.balance("alice", ENGINE) == 8192.0
    stats = budget.stats()
    assert (stats["rate_per_s"], stats["burst"], stats["gateway_rate_per_s"], stats["gateway_burst"]) == (
        4096.0, 8192.0, 64.0, 1024.0)
    assert Limits().gateway_work_units_per_s_per_caller == 64.0 and Limits().gateway_work_burst_per_caller == 256.0


def test_a_querys_embedding_is_charged_by_its_length_up_to_what_the_embedder_reads():
    """A search's (and an answer's) query costs the retrieval replica a MiniLM forward of up to 256 tokens; a token
    covers at least one character, so its characters bound its tokens: a unit per 8 of them, at most 32 units (the
    longest query the door takes, 4,000 characters, is read as 256 tokens)."""
    assert query_units("") == 0.0
    assert query_units("Where does the sister live?") == pytest.approx(27 / 8)
    assert query_units("x" * 256) == query_units("x" * Limits().max_query_chars) == 32.0
    assert query_units("x" * Limits().max_message_chars) == 32.0  # an OpenAI question is read as far, no further


def test_with_more_callers_active_than_four_shares_each_refills_at_an_equal_part_of_the_whole():
    """A caller's rate is a quarter of the resource (SHARES_PER_RESOURCE); with more callers active on it, each
    balance refills at rate x 4 / active callers: the retry hint of a caller in debt grows with the callers that
    share the encoder, and the gateway, which every request charges, counts them all."""
    budget = WorkBudget(WorkLimit(rate_per_s=40.0, burst=100.0))
    light = [Principal(f"light-{i}", frozenset({"memory:read"})) for i in range(8)]
    for who in light[:3]:
        request(budget, who, 1.0)
    request(budget, ALICE, 300.0)  # alice in debt, with three light callers of the encoder: four active
    time.sleep(ACTIVE_RECOUNT_S)
    assert budget.stats()["rate_now_per_s"]["encode"] == 40.0
    first = refusal(budget, ALICE, "AddFacts")
    assert first.retry_after_s == pytest.approx(-budget.balance("alice", ENCODE) / 40.0, rel=0.05)
    assert "40 work units per second and bursts of 100 now" in first.message
    for who in light[3:]:
        request(budget, who, 1.0)  # eight light callers and alice: nine active
    time.sleep(ACTIVE_RECOUNT_S)
    rates = budget.stats()["rate_now_per_s"]
    assert rates["encode"] == pytest.approx(40.0 * SHARES_PER_RESOURCE / 9)
    assert rates["gateway"] == rates["encode"] and rates["engine"] == 40.0  # no one answered: nobody shares it
    again = refusal(budget, ALICE, "AddFacts")
    debt = -budget.balance("alice", ENCODE)
    assert again.retry_after_s == pytest.approx(debt / (40.0 * 4 / 9), rel=0.05)
    assert again.retry_after_s > first.retry_after_s * 2
    assert "17.8 work units per second and bursts of 44.44 now (40 and 100 while at most 4 callers share it)" in again.message
    before = budget.balance("alice", ENCODE)
    time.sleep(0.5)
    assert budget.balance("alice", ENCODE) - before == pytest.approx(0.5 * 40.0 * 4 / 9, rel=0.3)


def test_with_more_callers_active_than_four_a_quiet_caller_may_spend_an_equal_part_of_the_burst_at_once():
    """The burst is a share as the rate is: beside three other callers a caller that has been quiet spends the whole
    burst at once (10 adds of a tenth of it), beside eight it holds burst x 4 / 8 (or / 9 once it is counted too) and
    is refused its 6th: a flood's first seconds take an equal part of the resource, not a quarter of the node."""
    def admitted(budget: WorkBudget) -> int:
        for n in range(20):
            try:
                request(budget, ALICE, 10.0)
            except ApiError as e:
                assert e.reason == "CALLER_WORK" and "for the encode" in e.message
                return n
        raise AssertionError("never refused")

    light = [Principal(f"light-{i}", frozenset({"memory:read"})) for i in range(8)]
    few = WorkBudget(WorkLimit(rate_per_s=0.001, burst=90.0))
    for who in light[:3]:
        request(few, who, 1.0)
    assert few.balance("alice", ENCODE) == 90.0 and few.stats()["burst_now"]["encode"] == 90.0
    assert admitted(few) == 10

    crowded = WorkBudget(WorkLimit(rate_per_s=0.001, burst=90.0))
    for who in light:
        request(crowded, who, 1.0)
    time.sleep(ACTIVE_RECOUNT_S)
    assert crowded.balance("alice", ENCODE) == pytest.approx(90.0 * SHARES_PER_RESOURCE / 8)
    assert crowded.stats()["burst_now"]["encode"] == pytest.approx(45.0)
    assert admitted(crowded) == 5  # 45 (or 40 once alice is counted) in adds of 10, each admitted at >= 0
    assert crowded.balance("light-0", ENCODE) <= 45.0  # a balance saved under the whole burst is cut to the share


def test_the_callers_tracked_are_a_bounded_lru_and_one_forgotten_has_a_full_burst():
    budget = WorkBudget(WorkLimit(rate_per_s=0.001, burst=10.0), tracked=3)
    for who in ("p0", "p1", "p2"):
        request(budget, Principal(who, frozenset({"memory:read"})), 100.0)
    request(budget, Principal("p3", frozenset({"memory:read"})), 5.0)  # the least recently charged (p0) goes
    assert budget.balance("p0", ENCODE) == 10.0 and budget.balance("p1", ENCODE) < 0
    assert budget.balance("p2", ENCODE) < 0 and budget.balance("p3", ENCODE) == pytest.approx(10 - 5, abs=0.01)
    refusal(budget, Principal("p1", frozenset({"memory:read"})), "AddFacts")  # still tracked: still in debt
    assert budget.tracked_callers(ENCODE) == budget.tracked_callers(GATEWAY) == 3
    assert budget.tracked_callers(ENGINE) == 0


def test_the_stats_show_a_callers_net_charges_per_resource_an_estimate_and_its_correction_summed():
    """WorkBudget.stats (the Gateway deployment's stats()): each resource's net units charged to a caller, which the
    balance's refill hides: an answer estimated at 1,000 engine units whose engine reported 60 leaves 60 charged
    (and its REQUEST_UNITS on the gateway), while the balance is back at the burst; admins are not tracked; a
    caller the LRU forgets starts again at 0."""
    budget = WorkBudget(WorkLimit(rate_per_s=64.0, burst=8192.0), tracked=2)
    request(budget, ALICE, 1000.0, route="Answer", spent=60.0 - 1000.0)
    request(budget, ADMIN, 500.0, route="Answer")
    stats = budget.stats(ALICE.subject)
    assert stats["caller"]["engine"]["charged"] == 60.0 and stats["caller"]["gateway"]["charged"] == REQUEST_UNITS
    assert stats["caller"]["encode"] == {"balance": 8192.0, "charged": 0.0}
    assert stats["caller"]["engine"]["balance"] == pytest.approx(8192.0 - 60.0, abs=1.0)  # a refund fills, no more
    assert (stats["rate_per_s"], stats["burst"], stats["refused"]) == (64.0, 8192.0, 0)
    assert stats["tracked_callers"] == {"gateway": 1, "encode": 0, "engine": 1}  # the admin is not among them
    assert "caller" not in budget.stats() and budget.stats(ADMIN.subject)["caller"]["engine"]["charged"] == 0.0
    request(budget, ALICE, 40.0, route="Answer", spent=-10.0)  # charges add up over requests
    assert budget.stats(ALICE.subject)["caller"]["engine"]["charged"] == 90.0
    for who in ("p1", "p2"):  # tracked=2: alice, the least recently charged, is forgotten
        request(budget, Principal(who, frozenset({"memory:read"})), 5.0, route="Answer")
    assert budget.stats(ALICE.subject)["caller"]["engine"] == {"balance": 8192.0, "charged": 0.0}


@pytest.fixture(scope="module")
def gateway(redis_url, jwt_secret):
    # Refusals paused 0.2 s at most (refusal_pause_max_s, tests/unit/test_principal_limits.py): the debts here refill
    # slowly, and the checks below refuse over and over.
    limits = Limits(work_units_per_s_per_caller=4.0, work_burst_per_caller=1000.0, gateway_work_units_per_s_per_caller=4.0,
                    gateway_work_burst_per_caller=1000.0, refusal_pause_max_s=0.2)
    with both_doors(redis_url, jwt_secret, limits, "work") as doors:
        yield doors


WINDOW = ["w" * 999 + " "] * 16  # the largest caller window: 16,000 characters, about 4,000 tokens to encode


def test_a_caller_whose_heavy_adds_spent_its_budget_is_refused_further_adds_at_both_doors_while_another_is_served(
        gateway):
    """Through the real doors: carol's add behind the largest window spends her encoder share; while dave adds too,
    her next add is refused on gRPC and on Mem0's door (429, Retry-After), and dave's is served at the same moment;
    her listing and her question pass the budget (the question then meets registry-only mode's missing engine:
    BACKENDS_NOT_DEPLOYED, not CALLER_WORK)."""
    core, grpc_server, http_server, secret = gateway
    ch = grpc_server.channel()
    carol, dave = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("carol", "dave"))
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, carol)))
    other = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, dave)))
    small = pb2.AddFactsRequest(user_id=dave, facts=[pb2.FactInput(text="Dave likes tea.")])
    other.AddFacts(small)  # dave is active on the encoder, not in debt: carol's debt would cost him
    heavy = pb2.AddFactsRequest(user_id=carol, facts=[pb2.FactInput(text="Carol's fact behind a huge window.",
                                                                 window=WINDOW)])
    stub.AddFacts(heavy)  # about 4,000 units from a burst of 1,000: admitted, and not refused for its own size
    assert core.work.balance(carol, Resource.ENCODE) < -2900
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=carol)).facts) == 1  # a read: the gateway's share
    code, details, _ = rich_refusal(lambda: list(stub.Answer(pb2.AnswerRequest(user_id=carol, query="What?"))))
    assert code == grpc.StatusCode.UNAVAILABLE and details["ErrorInfo"].reason == "BACKENDS_NOT_DEPLOYED"
    code, details, trailers = rich_refusal(lambda: stub.AddFacts(heavy))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "CALLER_WORK"
    assert details["RetryInfo"].retry_delay.seconds >= 700  # ~3,000 units in debt at 4 a second
    assert len(other.AddFacts(small).facts) == 1  # the same moment
    add = {"messages": [{"role": "user", "content": "One more note."}], "infer": False}
    r = httpx.post(f"{http_server.url}/v3/memories/add/", json={**add, "user_id": carol},
                   headers={"authorization": f"Token {token_for(secret, carol)}"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 700 and "budget" in r.json()["detail"]
    r = httpx.post(f"{http_server.url}/v3/memories/", json={}, headers={"authorization": f"Token {token_for(secret, carol)}"})
    assert r.status_code == 200 and r.json()["count"] == 1  # her listing on Mem0's door too
    ok = httpx.post(f"{http_server.url}/v3/memories/add/", json={**add, "user_id": dave},
                    headers={"authorization": f"Token {token_for(secret, dave)}"})
    assert ok.status_code == 200, ok.text
    admin = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, "support", admin=True)))
    admin.AddFacts(pb2.AddFactsRequest(user_id=carol, facts=[pb2.FactInput(text="Added by support.",
                                                                           window=WINDOW)]))  # admins: unlimited
    ch.close()


def test_mem0_adds_are_charged_and_refuse_their_callers_adds_on_grpc_afterwards(gateway):
    """The Mem0 door's add (infer=false) is charged to the encoder through the same core as AddFacts: its caller's
    next add, on gRPC, is refused, its reads are not, and another caller's Mem0 add goes through."""
    core, grpc_server, http_server, secret = gateway
    erin, frank = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("erin", "frank"))
    # 4 facts of ~1,900 characters, each encoded behind the ones before it: ~19,000 characters, ~4,800 units
    messages = [{"role": "user", "content": f"Erin's note {i}: " + "x" * 1900} for i in range(4)]
    r = httpx.post(f"{http_server.url}/v3/memories/add/", json={"messages": messages[:1], "user_id": frank,
                                                                "infer": False},
                   headers={"authorization": f"Token {token_for(secret, frank)}"})
    assert r.status_code == 200, r.text  # frank is active on the encoder, not in debt: erin's debt would cost him
    r = httpx.post(f"{http_server.url}/v3/memories/add/", json={"messages": messages, "user_id": erin, "infer": False},
                   headers={"authorization": f"Token {token_for(secret, erin)}"})
    assert r.status_code == 200, r.text
    assert core.work.balance(erin, Resource.ENCODE) < -3000  # from a burst of 1,000
    ch = grpc_server.channel()
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, erin)))
    code, details, _ = rich_refusal(lambda: stub.AddFacts(pb2.AddFactsRequest(
        user_id=erin, facts=[pb2.FactInput(text="Another note.")])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "CALLER_WORK"
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=erin)).facts) == 4
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


# The most a filter makes a fact cost (services/filters.py limits): 255 conditions (OR, and 127 key + operator pairs),
# 127 of them text conditions, each walking a metadata list at the door's 1,024 characters (255 strings: a Python
# loop per item, the worst bench/filter_cost.py found).
MAXIMAL = {"OR": [{"tags": {"icontains": f"zz{i}"}} for i in range(127)]}
# What work_budget.py's weights make of it, written out: a fact read (1/32 of a unit), 255 conditions (1/4096 each),
# 127 text conditions (1/128 each).
MAXIMAL_UNITS_PER_FACT = 1 / 32 + 255 / 4096 + 127 / 128


def scanned_user(core, facts: int, tags: int = 255) -> str:
    """A user of `facts` facts whose metadata the maximal filter walks whole (none matches: a list of `tags` strings,
    255 the door's most), written to the registry directly (an add through the door would cost the caller's encoder
    share, not what is measured here)."""
    from inferscale_server.registry import NewFact

    uid = f"scanned-{uuid.uuid4().hex[:6]}"
    for start in range(0, facts, 100):
        core.registry.create(uid, [NewFact(f"Fact {i} about tea.", {"tags": [""] * tags})
                                   for i in range(start, min(facts, start + 100))])
    return uid


def test_a_maximal_filter_over_n_facts_costs_what_the_formula_says_on_every_scan(gateway):
    """A scan is charged per fact read AND by the filter's size (work_budget.scan_units): Mem0's get_all and
    delete_all with the maximal filter over 150 facts, and gRPC's ListMemories over a page of them, each charge
    the caller's gateway balance REQUEST_UNITS + facts x (1/32 + 255/4096 + 127/128), read from the budget's stats;
    the same listing without a filter 150/32 (the read alone)."""
    import json

    core, grpc_server, http_server, secret = gateway
    uid = scanned_user(core, 150)
    headers = {"authorization": f"Token {token_for(secret, uid)}"}

    def charged() -> float:
        return core.work.stats(uid)["caller"]["gateway"]["charged"]

    before = charged()
    r = httpx.post(f"{http_server.url}/v3/memories/", json={"filters": MAXIMAL}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["count"] == 0, r.text
    assert charged() - before == pytest.approx(REQUEST_UNITS + 150 * MAXIMAL_UNITS_PER_FACT)
    assert 150 * MAXIMAL_UNITS_PER_FACT > 160  # ~1.09 a fact: 35x the read-only weight of 1/32
    before = charged()
    r = httpx.post(f"{http_server.url}/v3/memories/", json={"filters": {"tags": "*"}}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["count"] == 150  # a one-condition filter: close to the read alone
    assert charged() - before == pytest.approx(REQUEST_UNITS + 150 * (1 / 32 + 1 / 4096))
    before = charged()
    r = httpx.request("DELETE", f"{http_server.url}/v1/memories/", params={"filters": json.dumps(MAXIMAL)},
                      headers=headers, timeout=60)
    assert r.status_code == 200, r.text  # nothing matched, nothing deleted: the scan is charged all the same
    assert charged() - before == pytest.approx(REQUEST_UNITS + 150 * MAXIMAL_UNITS_PER_FACT)
    ch = grpc_server.channel()
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, uid)))
    before = charged()
    page = stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=100, filters=json.dumps(MAXIMAL)))
    assert len(page.facts) == 0 and page.next_page_token  # one page of 100 read, more to come
    assert charged() - before == pytest.approx(REQUEST_UNITS + 100 * MAXIMAL_UNITS_PER_FACT)
    before = charged()
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=100)).facts) == 100
    assert charged() - before == pytest.approx(REQUEST_UNITS + 100 / 32)
    ch.close()
    before = charged()  # Mem0's users(): the entities of every memory of the user, so a read of them all
    r = httpx.get(f"{http_server.url}/v1/entities/", params={"user_id": uid}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["total_memories"] == 150, r.text
    assert charged() - before == pytest.approx(REQUEST_UNITS + 150 / 32)


def test_scans_sent_at_once_past_the_balance_are_refused_before_they_read(gateway):
    """The noisy neighbour's filter_scan: four maximal listings of 1,000 facts sent at once, each costing more than
    the caller's whole gateway burst. The first to be charged reads; the other three are refused (429, CALLER_WORK)
    before they read a fact, because a scan's every chunk is charged before it is read (mem0_http.scanned). Charged
    once read, as before, all four were admitted on the full balance and read 4,000 facts together."""
    import asyncio

    core, grpc_server, http_server, secret = gateway
    abuser = scanned_user(core, 1000, tags=1)  # short tags: the walk is quick, the charge is the filter's
    per_listing = REQUEST_UNITS + 1000 * MAXIMAL_UNITS_PER_FACT
    assert per_listing > core.limits.gateway_work_burst_per_caller
    light = {"authorization": f"Token {token_for(secret, f'light-{uuid.uuid4().hex[:6]}')}"}
    headers = {"authorization": f"Token {token_for(secret, abuser)}"}
    url = f"{http_server.url}/v3/memories/"
    assert httpx.post(url, json={}, headers=light).status_code == 200  # someone to share the gateway with

    async def at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url, json={"filters": MAXIMAL}, headers=headers)
                                          for _ in range(4)))
    replies = asyncio.run(at_once())
    assert sorted(r.status_code for r in replies) == [200, 429, 429, 429], [r.text[:200] for r in replies]
    assert all("budget" in r.json()["detail"] for r in replies if r.status_code == 429)
    # one listing's facts charged, and each request's REQUEST_UNITS: the refused ones read nothing
    assert core.work.stats(abuser)["caller"]["gateway"]["charged"] == pytest.approx(
        per_listing + 3 * REQUEST_UNITS)
    assert httpx.post(url, json={}, headers=light).status_code == 200


def test_a_flood_of_maximal_filtered_listings_is_refused_within_the_requests_the_calibration_predicts(gateway):
    """The noisy neighbour's filter attack at the per-fact limits: a caller of 100 facts lists them with the maximal
    filter again and again while a light caller is active. Each listing costs REQUEST_UNITS (4) + 100 x ~1.09 units,
    so the burst (1,000 here, or its equal part when more than 4 callers are active) runs out after ceil(1000 / 113.2)
    = 9 listings (the refill, 4 a second, adds less than one listing's cost in the seconds they take): the 10th is refused on Mem0's door (429, CALLER_WORK, Retry-After)
    and on gRPC (RESOURCE_EXHAUSTED, CALLER_WORK), and the light caller is served at the same moment. With the old
    weight (100/32 + 1 a listing) the same flood had ~240 listings before a refusal. The charge is the filter's, not
    the facts' (their tags are short here, so that the flood is quick): what the caller sends decides it."""
    import json
    import math

    core, grpc_server, http_server, secret = gateway
    abuser = scanned_user(core, 100, tags=1)
    light = f"light-{uuid.uuid4().hex[:6]}"
    light_headers = {"authorization": f"Token {token_for(secret, light)}"}
    headers = {"authorization": f"Token {token_for(secret, abuser)}"}
    per_listing = REQUEST_UNITS + 100 * MAXIMAL_UNITS_PER_FACT
    assert math.ceil(core.limits.gateway_work_burst_per_caller / per_listing) == 9
    # The burst of now: the whole 1,000 while at most 4 callers are active on this replica's gateway, an equal part
    # of it when more are (the module's earlier tests' callers may still be, within CONTENTION_WINDOW_S); read after
    # a recount, so that the abuser's first listing, a moment later, starts from it.
    assert httpx.post(f"{http_server.url}/v3/memories/", json={}, headers=light_headers).status_code == 200
    time.sleep(ACTIVE_RECOUNT_S)
    burst = core.work.stats()["burst_now"]["gateway"]
    predicted = math.ceil(burst / per_listing)
    assert 1 <= predicted <= 9
    served = 0
    t0 = time.monotonic()
    for _ in range(predicted + 5):  # bounded: a few past the prediction
        if served:  # the light caller asks between the listings (active on the gateway, never in debt): the debt binds
            assert httpx.post(f"{http_server.url}/v3/memories/", json={}, headers=light_headers).status_code == 200
        r = httpx.post(f"{http_server.url}/v3/memories/", json={"filters": MAXIMAL}, headers=headers, timeout=60)
        if r.status_code != 200:
            break
        served += 1
    assert time.monotonic() - t0 < per_listing / core.limits.work_units_per_s_per_caller  # the refill: < a listing
    assert served == predicted, (served, predicted)
    assert r.status_code == 429 and "budget" in r.json()["detail"] and int(r.headers["Retry-After"]) >= 1
    ch = grpc_server.channel()
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, abuser)))
    code, details, _ = rich_refusal(lambda: stub.ListMemories(pb2.ListMemoriesRequest(
        user_id=abuser, filters=json.dumps(MAXIMAL))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "CALLER_WORK"
    assert httpx.post(f"{http_server.url}/v3/memories/", json={}, headers=light_headers).status_code == 200
    ch.close()


def test_a_charge_refused_deeper_in_a_request_is_paused_like_one_at_authentication():
    """Carol's add is admitted, then her other add (behind the largest window) puts her encoder balance in debt
    before the first is charged: the first's charge is refused (CALLER_WORK), after the pause
    (GatewayCore._refusal_paused), as a refusal at authentication would be; Dave's add, meanwhile, is charged."""
    import asyncio

    from inferscale_server.auth import Authenticator
    from inferscale_server.gateway.core import GatewayCore
    from inferscale_server.registry import EmbeddedRegistry, NewFact

    writer = frozenset({"memory:read", "memory:write"})
    carol, dave = Principal("carol", writer), Principal("dave", writer)
    pause = 0.3

    async def go():
        core = GatewayCore(EmbeddedRegistry(), auth=Authenticator.insecure(),
                           limits=Limits(work_units_per_s_per_caller=4.0, work_burst_per_caller=1000.0,
                                         refusal_pause_max_s=pause))
        admitted, charge = asyncio.Event(), asyncio.Event()

        async def add(who: Principal, window=(), hold=False):
            core.work.admit(who, "AddFacts")  # this task's bill, as authentication opens it
            if hold:
                admitted.set()
                await charge.wait()
            t0 = time.monotonic()
            try:
                await core.store_new(who.subject, [NewFact(f"{who.subject}'s fact", window=tuple(window))])
                return "ok", time.monotonic() - t0
            except ApiError as e:
                return e.reason, time.monotonic() - t0

        assert (await add(dave))[0] == "ok"  # dave is active on the encoder, not in debt
        first = asyncio.create_task(add(carol, hold=True))
        await admitted.wait()
        assert (await add(carol, window=WINDOW))[0] == "ok"  # ~4,000 units from a burst of 1,000: in debt now
        assert core.work.balance("carol", Resource.ENCODE) < -2900
        charge.set()
        reason, waited = await first
        assert reason == "CALLER_WORK" and pause <= waited < pause + 1.0, (reason, waited)
        assert (await add(dave))[0] == "ok"

    asyncio.run(go())
