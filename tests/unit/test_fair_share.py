"""Each tenant's fair share of the shared engine and encoder (issue 31, the noisy neighbour): a user who keeps the
engine's admission limit or the encoder pool busy must not make another user's small request wait behind all of
its work. No Ray, no vLLM: the admission bookkeeping and the encoder pool's scheduler are checked directly, the
scheduler over a recording encoder (the order of encodes is what is under test)."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch

from inferscale_server.admission import Admission, EngineAtCapacity
from inferscale_server.fair_queue import Again, FairBatcher


# ------------------------------------------------------------------------------------ engine admission
def test_a_user_past_its_share_is_refused_while_another_user_is_still_admitted():
    adm = Admission(capacity_tokens=500, queue_factor=2.0)  # limit 1,000
    with contextlib.ExitStack() as held:
        held.enter_context(adm.admit("heavy", 400))
        held.enter_context(adm.admit("light", 10))  # two users in flight: a share is 500 tokens each
        # 400 + 200 > 500, and 610 in flight would pass the KV cache (it would queue), though the limit has room
        with pytest.raises(EngineAtCapacity) as e:
            held.enter_context(adm.admit("heavy", 200))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "ENGINE_AT_CAPACITY"
        assert e.value.retry_after_s >= 1
        assert "this user holds 400 tokens of its share of 500 (this request: 200)" in e.value.message
        assert "contended" in e.value.message
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


def test_below_the_kv_caches_size_no_share_applies():
    adm = Admission(capacity_tokens=500, queue_factor=2.0)
    with contextlib.ExitStack() as held:
        for u in range(20):  # 20 users: a share would be 47 tokens
            held.enter_context(adm.admit(f"user{u}", 10))
        held.enter_context(adm.admit("busy", 50))
        held.enter_context(adm.admit("busy", 100))  # 350 in flight: everything runs at once, nobody waits
        with pytest.raises(EngineAtCapacity, match="share of 47"):  # 501 would queue: the share applies
            held.enter_context(adm.admit("busy", 151))
    assert adm.stats()["refused_over_share"] == 1


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


# ------------------------------------------------------------------------------------ the encoder pool's scheduler
class Recorder:
    """A batch runner that records each batch's (user, item) pairs; the first batch can be held open so that
    others submit while it runs (as facts arrive while the pool encodes)."""

    def __init__(self, hold_first: bool = False):
        self.batches: list[list[tuple[str, int]]] = []
        self.first_running, self.release = asyncio.Event(), asyncio.Event()
        if not hold_first:
            self.release.set()

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        self.first_running.set()
        await self.release.wait()
        await asyncio.sleep(0)
        return [f"done {user} {i}" for user, i in payloads]

    def batch_of(self, item) -> int:
        return next(n for n, b in enumerate(self.batches) if item in b)


class SteppedRunner:
    """A batch runner whose items take several turns, as the encoder's long forwards do: an item listed in `steps`
    answers Again(100) until its last step, any other finishes at once. The first batch is held open until `release`
    is set, so that others submit while it runs. Made inside the test's event loop."""

    def __init__(self, steps: dict[tuple[str, int], int]):
        self.steps_left = dict(steps)
        self.batches: list[list[tuple[str, int]]] = []
        self.release = asyncio.Event()

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        if len(self.batches) == 1:
            await self.release.wait()
        out: list = []
        for p in payloads:
            self.steps_left[p] = self.steps_left.get(p, 1) - 1
            out.append(Again(100) if self.steps_left[p] > 0 else f"done {p[0]} {p[1]}")
        return out


def _items(user: str, n: int) -> list[tuple[str, int]]:
    return [(user, i) for i in range(n)]


def test_a_one_fact_add_waits_for_one_batch_not_for_another_users_256_facts():
    async def scenario():
        run = Recorder(hold_first=True)
        fair = FairBatcher(run, batch_cost=2048, quantum=512)
        finished = []

        async def add(user, n, cost):
            out = await fair.submit(user, _items(user, n), [cost] * n)
            finished.append(user)
            return out

        big = asyncio.create_task(add("heavy", 256, 60))
        await run.first_running.wait()  # the heavy user's first batch is encoding
        small = asyncio.create_task(add("light", 1, 60))
        await asyncio.sleep(0)
        run.release.set()
        results = await asyncio.gather(big, small)
        return run, fair, finished, results

    run, fair, finished, (big, small) = asyncio.run(scenario())
    assert small == ["done light 0"] and big == [f"done heavy {i}" for i in range(256)]  # in order, each its own
    assert run.batch_of(("light", 0)) == 1  # the batch after the one that was running, not after all 256 facts
    assert finished == ["light", "heavy"] and len(run.batches) == 8
    assert fair.waiting() == 0


def test_users_get_the_same_tokens_per_round_whatever_their_facts_cost():
    async def scenario():
        run = Recorder(hold_first=True)
        fair = FairBatcher(run, batch_cost=2048, quantum=512)
        first = asyncio.create_task(fair.submit("warmup", [("warmup", 0)], [1]))
        await run.first_running.wait()  # both users' work waits together from here
        windows = asyncio.create_task(fair.submit("windows", _items("windows", 20), [1500] * 20))
        short = asyncio.create_task(fair.submit("short", _items("short", 400), [50] * 400))
        await asyncio.sleep(0)
        run.release.set()
        await asyncio.gather(first, windows, short)
        return run

    run = asyncio.run(scenario())
    cost = {"windows": 1500, "short": 50, "warmup": 1}
    served = {"windows": 0, "short": 0}
    for batch in run.batches[1:]:
        for user, _ in batch:
            served[user] += cost[user]
        if served["windows"] < 20 * 1500 and served["short"] < 400 * 50:  # both still waiting: a fair split
            assert abs(served["windows"] - served["short"]) <= 1500 + 512, (served, len(run.batches))
    # By count the short facts went 30 to 1, as their costs say; arrival order kept within each user.
    shorts = [i for b in run.batches for u, i in b if u == "short"]
    assert shorts == list(range(400))


def test_a_user_alone_keeps_full_batches_and_an_oversized_fact_goes_alone():
    async def scenario():
        run = Recorder()
        fair = FairBatcher(run, batch_cost=2048, quantum=512)
        await fair.submit("alone", _items("alone", 256), [60] * 256)
        alone = list(run.batches)
        run.batches.clear()
        await fair.submit("huge", _items("huge", 3), [5000, 10, 10])
        return alone, run.batches

    alone, huge = asyncio.run(scenario())
    assert [len(b) for b in alone] == [34] * 7 + [18]  # 34 x 60 = 2,040 tokens a batch: the pool stays batched
    assert huge == [[("huge", 0)], [("huge", 1), ("huge", 2)]]


def test_a_caller_that_went_away_costs_nothing_and_a_failed_batch_fails_only_its_callers():
    async def scenario():
        calls = []

        async def run(payloads):
            calls.append(list(payloads))
            if any(user == "breaks" for user, _ in payloads):
                raise RuntimeError("the encoder broke")
            await asyncio.sleep(0.01)
            return [f"done {user} {i}" for user, i in payloads]

        fair = FairBatcher(run, batch_cost=100, quantum=50)
        gone = asyncio.create_task(fair.submit("gone", _items("gone", 50), [10] * 50))
        await asyncio.sleep(0.005)  # its first batch runs
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        with pytest.raises(RuntimeError, match="the encoder broke"):
            await fair.submit("breaks", [("breaks", 0)], [10])
        return calls, await fair.submit("after", [("after", 0)], [10])

    calls, after = asyncio.run(scenario())
    assert sum(1 for b in calls for u, _ in b if u == "gone") == 10  # the batch that ran; the other 40 dropped
    assert after == ["done after 0"]
    with pytest.raises(ValueError, match="quantum must be an int >= 1"):
        FairBatcher(None, 10, 0)


def test_an_unfinished_item_goes_back_to_the_front_of_its_users_queue():
    """A long item runs a step per turn (the encoder's fact behind a 4k-token window): another user's item waits for
    one step, not for all of it, and the long item's user keeps its order."""
    async def scenario():
        run = SteppedRunner({("long", 0): 4})
        fair = FairBatcher(run, batch_cost=100, quantum=100)
        long = asyncio.create_task(fair.submit("long", [("long", 0)], [100]))
        while not run.batches:
            await asyncio.sleep(0)
        short = asyncio.create_task(fair.submit("short", [("short", 0)], [10]))
        later = asyncio.create_task(fair.submit("long", [("long", 1)], [10]))  # behind the unfinished one
        await asyncio.sleep(0)
        run.release.set()
        return run.batches, await asyncio.gather(long, later, short)

    batches, (long, later, short) = asyncio.run(scenario())
    assert long == ["done long 0"] and later == ["done long 1"] and short == ["done short 0"]
    assert batches == [[("long", 0)], [("short", 0)], [("long", 0)], [("long", 0)], [("long", 0)], [("long", 1)]]


def test_a_user_with_nothing_waiting_goes_before_the_heavy_users_next_turn():
    """The encoder pool's sizes (a batch is one turn: batch_cost == quantum): a one-fact add that arrives while a heavy
    user's batch runs is in the next batch, not behind the heavy user's next turn as well (before: the third)."""
    async def scenario():
        run = Recorder(hold_first=True)
        fair = FairBatcher(run, batch_cost=256, quantum=256)
        heavy = asyncio.create_task(fair.submit("heavy", _items("heavy", 8), [256] * 8))
        await run.first_running.wait()
        light = asyncio.create_task(fair.submit("light", [("light", 0)], [200]))
        await asyncio.sleep(0)
        run.release.set()
        await asyncio.gather(heavy, light)
        return run

    run = asyncio.run(scenario())
    assert run.batches[:3] == [[("heavy", 0)], [("light", 0)], [("heavy", 1)]]


def test_only_a_users_first_turn_goes_first_and_a_long_items_next_step_is_never_new():
    """Precedence is one turn: a long item (a fact behind a 4k-token window, a step per turn) that arrived new runs
    its first step ahead, then its next steps wait among the old users' turns, behind a later one-fact add and the
    heavy user's next item."""
    async def scenario():
        run = SteppedRunner({("long", 0): 3})
        fair = FairBatcher(run, batch_cost=100, quantum=100)
        heavy = asyncio.create_task(fair.submit("heavy", _items("heavy", 2), [100, 100]))
        while not run.batches:
            await asyncio.sleep(0)
        long = asyncio.create_task(fair.submit("long", [("long", 0)], [100]))
        light = asyncio.create_task(fair.submit("light", [("light", 0)], [100]))
        await asyncio.sleep(0)
        run.release.set()
        await asyncio.gather(heavy, long, light)
        return run.batches

    assert asyncio.run(scenario()) == [[("heavy", 0)], [("long", 0)], [("light", 0)], [("heavy", 1)], [("long", 0)],
                                       [("long", 0)]]


# ------------------------------------------------------------------------------------ the encoder pool itself
@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    from support.tiny_models import save_tiny_model

    from inferscale_core.models import default_model_path
    from inferscale_server.encoder_pool import FactEncoder

    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"), tokenizer_from=default_model_path())
    return FactEncoder(model_path=str(folder), device="cpu")


def test_the_pool_encodes_facts_as_the_encoder_does_and_charges_the_window(tiny_encoder):
    from inferscale_server.encoder_pool import EncodeFailure, EncoderCore, PreparedFact

    fe = tiny_encoder
    long_window = ["turn about biscuits and tea " * 1000]  # past the encoder's 4,096 window tokens
    items = [("Alice has a cat named Pixel.", []), ("Bob lives in Denver.", ["Earlier: Bob moved."]),
             ("Carol drinks tea.", long_window), ("a fact far too long " * 200, [])]
    prepared = fe.prepare(items)
    assert isinstance(prepared[3], EncodeFailure) and "tokens long" in prepared[3].reason
    assert isinstance(prepared[2], PreparedFact) and prepared[2].cost == len(prepared[2].fact_ids) + 4096
    assert prepared[0].cost == len(fe.template.fact_ids(items[0][0])) + len(fe.template.prefix_ids)

    async def both():
        core = EncoderCore(fe)
        return await asyncio.gather(core.encode("alice", items[:1] + items[2:]), core.encode("bob", items[1:2]))

    (alice, bob) = asyncio.run(both())
    got = [alice[0], bob[0], alice[1]]
    # What the encoder makes of the same fact and window turns, unscheduled (the window cut at its end).
    expected = fe.encoder.encode_batch([
        (fe.template.fact_ids(text), [fe.template.prefix_ids] + [fe.template.text_ids(w) for w in window])
        for text, window in items[:3]], progress=False)
    direct = fe.encode(items)  # in-process, unscheduled (the benchmarks' path)
    for g, d, e in zip(got, direct, expected):
        for t in (g, d):
            assert torch.equal(t.token_ids, e.token_ids) and torch.equal(t.k_pre, e.k_pre) and torch.equal(t.v, e.v)
    assert isinstance(alice[2], EncodeFailure) and isinstance(direct[3], EncodeFailure)


async def _light_add_behind(fe, heavy_items, light_item, held: int = 1):
    """A heavy user's add of `heavy_items` starts; its `held`-th batch is held until a light user's one-fact add of
    `light_item` has queued. Returns each batch's facts (token ids), the users in the order their adds finished,
    and the two adds' results."""
    from inferscale_server.encoder_pool import EncoderCore

    class HeldCore(EncoderCore):
        async def _encode_batch(self, jobs):
            seen.append([j.prepared.fact_ids for j in jobs])
            if len(seen) == held:
                await release.wait()
            return await super()._encode_batch(jobs)

    core, seen, release, done = HeldCore(fe), [], asyncio.Event(), []

    async def add(user, items):
        out = await core.encode(user, items)
        done.append(user)
        return out

    async def until(ready, what: str) -> None:
        for _ in range(10_000):  # 10 s at most
            if ready():
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"{what} never happened; batches so far: {len(seen)}")

    heavy = asyncio.create_task(add("heavy", heavy_items))
    await until(lambda: len(seen) == held, f"the heavy user's batch {held}")
    light = asyncio.create_task(add("light", [light_item]))
    await until(lambda: core.batcher.waiting() > len(heavy_items) - held, "the light add's queueing")
    release.set()
    return seen, done, await asyncio.wait_for(light, 60), await asyncio.wait_for(heavy, 60)


def test_a_batch_is_one_forward_so_a_one_fact_add_waits_for_one_of_another_users_facts(tiny_encoder):
    """A user's 12-fact add (short facts behind their neighbours, as the noisy benchmark's kv_flood sends 256): a
    one-fact add arriving while one of them runs, past that user's first turn (the only turn that goes before
    others: fair_queue.py), goes next, alone. Batches of 256 tokens made it wait for the batch that ran and share
    its own with the heavy user's next facts."""
    from inferscale_server.encoder_pool import QUANTUM_WORK, EncodeJob

    fe = tiny_encoder
    flood = [(f"Flood fact {i} about nothing much at all.", [f"Flood fact {j} about nothing much at all."
                                                            for j in range(max(0, i - 5), i)]) for i in range(12)]
    light_item = ("Bob lives in Denver.", [])
    prepared = fe.prepare(flood)
    costs = [EncodeJob(fe, p).forward.next_cost for p in prepared]
    first_turn = next(n for n in range(len(costs) + 1) if n == len(costs) or sum(costs[:n + 1]) > QUANTUM_WORK)
    assert 1 <= first_turn < 6
    seen, done, light, heavy = asyncio.run(_light_add_behind(fe, flood, light_item, held=first_turn + 1))
    flood_ids, light_ids = [p.fact_ids for p in prepared], fe.prepare([light_item])[0].fact_ids
    n = first_turn + 1
    assert seen == [[ids] for ids in flood_ids[:n]] + [[light_ids]] + [[ids] for ids in flood_ids[n:]]
    assert done == ["light", "heavy"]
    for got, alone in zip([*light, *heavy], fe.encode([light_item, *flood])):
        assert torch.equal(got.k_pre, alone.k_pre) and torch.equal(got.v, alone.v)


def test_a_fact_behind_a_long_window_does_not_hold_the_pool_for_another_users_fact(tiny_encoder):
    """The long window's forward runs one step per turn: a one-fact add that arrives while it runs is encoded
    after one step, long before the window's fact, and each gets the KV the encoder makes of it alone."""
    from inferscale_core.encoder import step_tokens

    fe = tiny_encoder
    window = ["turn about biscuits and tea " * 1000]
    heavy_item, light_item = ("Carol drinks tea.", window), ("Bob lives in Denver.", [])
    total, done, steps = fe.prepare([heavy_item])[0].cost, 0, 0
    while done < total:  # the window's steps: STEP_TOKENS of work each, fewer tokens as its attention grows
        done, steps = done + step_tokens(done, fe.encoder.balance), steps + 1
    assert steps >= 16

    seen, done, light, heavy = asyncio.run(_light_add_behind(fe, [heavy_item], light_item))
    heavy_ids, light_ids = (fe.prepare([item])[0].fact_ids for item in (heavy_item, light_item))
    # The one-fact add ran after the window's one step that was running, not after all of its steps.
    assert seen == [[heavy_ids], [light_ids]] + [[heavy_ids]] * (steps - 1) and done == ["light", "heavy"]
    for got, item in ((light[0], light_item), (heavy[0], heavy_item)):
        alone = fe.encode([item])[0]
        assert torch.equal(got.k_pre, alone.k_pre) and torch.equal(got.v, alone.v)


def test_a_forward_that_fails_starts_again_and_is_reported_after_its_last_try(tiny_encoder, monkeypatch):
    """A step that raises (the encoder's failure, not the fact's: out of memory in a mass re-encode) starts the
    fact's forward again from its first step; after 1 + TRANSIENT_RETRIES failures the fact is reported as a
    transient EncodeFailure, and the other facts of the batch are encoded as if nothing happened."""
    from inferscale_core.encoder import FactForward
    from inferscale_server.encoder_pool import TRANSIENT_RETRIES, EncodeFailure, EncoderCore

    fe = tiny_encoder
    flaky_item, good_item = ("Carol drinks tea.", ["turn about biscuits and tea " * 1000]), ("Bob lives in Denver.", [])
    flaky_ids = fe.prepare([flaky_item])[0].fact_ids
    real_step, failures = FactForward.step, {"left": 0, "seen": 0}

    def step(self):
        if self.fact == flaky_ids and self.done > 0 and failures["left"] > 0:  # fails mid-way, after a step
            failures["left"] -= 1
            failures["seen"] += 1
            raise RuntimeError("out of memory")
        return real_step(self)

    monkeypatch.setattr(FactForward, "step", step)
    for fail_times in (TRANSIENT_RETRIES, TRANSIENT_RETRIES + 1):
        failures.update(left=fail_times, seen=0)
        flaky, good = asyncio.run(EncoderCore(fe).encode("carol", [flaky_item, good_item]))
        assert failures["seen"] == fail_times
        assert torch.equal(good.k_pre, fe.encode([good_item])[0].k_pre)
        if fail_times == TRANSIENT_RETRIES:  # the last try succeeded: the KV of a clean forward
            assert torch.equal(flaky.k_pre, fe.encode([flaky_item])[0].k_pre)
        else:
            assert isinstance(flaky, EncodeFailure) and flaky.transient
            assert flaky.reason == "the encoder failed on this fact (RuntimeError)"
