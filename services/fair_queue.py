"""Fair batching of one shared worker among users (issue 31): the encoder pool's facts, so that one user's
256-fact add or facts behind huge windows cannot make another user's 1-fact add wait behind all of it.

Every user has a queue of items, each with a cost (for the encoder: the tokens of its forward). Batches are
formed by deficit round robin over the users with items waiting (Shreedhar and Varghese, 1995): on its turn a
user's deficit grows by `quantum` and its items are taken while their cost fits the deficit, so over time every
waiting user gets the same cost per round whatever the size of its items or how many it sent. A batch closes at
`batch_cost` (an item costlier than that goes alone); one batch runs at a time, and the next is formed from what
is waiting when the last one ends, so an item that arrives behind another user's work waits at most the batch
that is running and its own turn in the next. Arrival order is kept within a user.

A user that had nothing waiting when its items came (a sparse one: a one-fact add) goes before the users whose
turns go on with items left (as fq_codel serves its new flows first, RFC 8290 section 4.1): it waits for the batch
that is running, not also for a full turn of each heavy user ahead of it in the round. The first turn is all the
precedence it gets: a user whose turn ends with items left, and an unfinished item's next step (below), wait among
the others, so sending items one at a time buys one turn at a time, and a long item is never new again.

An item may take several turns: `run` answers `Again(cost)` for an item that made progress and has more to do (the
encoder pool's fact behind a 4k-token window, a step of its forward at a time: inferscale_core/encoder.py
FactForward); it goes back to the front of its user's queue at that cost, so no batch holds more than `batch_cost`
of any one item and a user's big item never makes another user wait for all of it.

One event loop (the deployment's): no lock. An item whose caller went away (its future cancelled) is dropped when
its turn comes, uncharged.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Waiting:
    payload: Any
    cost: int
    result: asyncio.Future
    key: str


@dataclass(frozen=True)
class Again:
    """What `run` answers for an item that is not finished: run it again, at this cost, on its user's next turn."""
    cost: int


class FairBatcher(Generic[T, R]):
    def __init__(self, run: Callable[[list[T]], Awaitable[list[R | Again]]], batch_cost: int, quantum: int):
        """`run`: encodes one batch, answering per item in order its result, or Again(cost) when it has more to do.
        `batch_cost`: the cost at which a batch closes. `quantum`: the cost a waiting user is granted per turn."""
        for name, value in (("batch_cost", batch_cost), ("quantum", quantum)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._run, self.batch_cost, self.quantum = run, batch_cost, quantum
        self._queues: dict[str, deque[_Waiting]] = {}
        self._deficit: dict[str, int] = {}
        # Users with items waiting, in two rounds: the new ones (nothing was waiting when their items came) are
        # served first; the front user of the round being served has the turn.
        self._new: deque[str] = deque()
        self._old: deque[str] = deque()
        self._granted: set[str] = set()  # users whose turn in progress had its quantum (a batch closed mid-turn)
        self._worker: asyncio.Task | None = None
        self.batches = 0

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def submit(self, key: str, payloads: Sequence[T], costs: Sequence[int]) -> list[R]:
        """Queues `payloads` (with their costs) for user `key`; their results in order once all ran."""
        if len(payloads) != len(costs):
            raise ValueError(f"{len(payloads)} items but {len(costs)} costs")
        if not payloads:
            return []
        loop = asyncio.get_running_loop()
        items = [_Waiting(p, max(1, int(c)), loop.create_future(), key) for p, c in zip(payloads, costs)]
        self._queue_of(key).extend(items)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return list(await asyncio.gather(*(i.result for i in items)))

    def _queue_of(self, key: str, new: bool = True) -> deque[_Waiting]:
        """The user's queue; a user with nothing waiting joins the end of the new round (`new`; an unfinished
        item's next step: of the old one), without credit."""
        if key not in self._queues:
            self._queues[key], self._deficit[key] = deque(), 0
            (self._new if new else self._old).append(key)
        return self._queues[key]

    async def _work(self) -> None:
        while self._new or self._old:
            batch = self._next_batch()
            if not batch:  # every item taken had been cancelled
                continue
            self.batches += 1
            try:
                results = await self._run([i.payload for i in batch])
            except Exception as e:  # noqa: BLE001 - handed to each item's caller
                for i in batch:
                    if not i.result.done():
                        i.result.set_exception(e)
                continue
            unfinished: dict[str, list[_Waiting]] = {}
            for i, r in zip(batch, results):
                if i.result.done():
                    continue
                if isinstance(r, Again):  # back to the front of its user's queue, ahead of what came after it
                    i.cost = max(1, int(r.cost))
                    unfinished.setdefault(i.key, []).append(i)
                else:
                    i.result.set_result(r)
            for key, items in unfinished.items():
                self._queue_of(key, new=False).extendleft(reversed(items))

    def _next_batch(self) -> list[_Waiting]:
        batch: list[_Waiting] = []
        cost = 0
        while self._new or self._old:
            ring = self._new or self._old
            key = ring[0]
            queue = self._queues[key]
            if key not in self._granted:
                self._deficit[key] += self.quantum
                self._granted.add(key)
            while queue:
                head = queue[0]
                if head.result.done():  # its caller went away: dropped, not charged
                    queue.popleft()
                    continue
                if head.cost > self._deficit[key]:
                    break
                if batch and cost + head.cost > self.batch_cost:
                    return batch  # the batch is full; this user's turn goes on in the next one
                queue.popleft()
                batch.append(head)
                cost += head.cost
                self._deficit[key] -= head.cost
            ring.popleft()
            self._granted.discard(key)
            if queue:
                self._old.append(key)  # its turn is over: the next user's; what it has left waits among the old
            else:  # nothing left: an idle user keeps no credit
                del self._queues[key], self._deficit[key]
            if cost >= self.batch_cost:
                return batch
        return batch
