"""vLLM's scheduler with background prefills: a long prompt marked as background work (Mem0's extraction prompts,
~1.5k tokens) is prefilled in the steps the other requests leave, not in theirs.

Why: every running request's next token waits for the whole step, and a step's time grows with its tokens. With
chunked prefill a 1.5k-token prompt takes ~6 steps of 256 tokens (LONG_PREFILL_TOKENS), each ~0.25 s on one CPU
core against ~0.03 s for a step of decodes, and an 8-token answer that overlaps it spans all six: the noisy-neighbour
benchmark's well-behaved answers took 2.5-2.9 s under the `extraction` attack against 0.6 s (BENCHMARKS.md). Smaller
steps only spread the prefill over more of their steps. vLLM's priority policy orders the waiting queue and
preemption, not a running prefill's share of a step.

What: while any other request is running or waiting, a background request's prefill is left out of the step (it
keeps its blocks and its progress; the step is planned as if vLLM's token budget had ended before it), except one
step in BACKGROUND_EVERY_STEPS, so it never starves under steady traffic. Its decode steps are never held back (one
token beside the others costs ~nothing). Alone it runs in steps of the long-prefill cap (vLLM would give a request
alone its whole budget in one step, and an answer arriving meanwhile would wait for all of it). Which requests are
background: their request id starts with BACKGROUND_PREFIX (vLLM keeps the caller's id as the prefix of its own).

`background_prefill_scheduler` is what vLLM's `scheduler_cls` names: it builds the variant of vLLM's own scheduler
that vLLM would have chosen (the asynchronous one where async scheduling is on)."""
from __future__ import annotations

from typing import Any

BACKGROUND_PREFIX = "bg-"
# One step in this many runs a held background prefill anyway: with steady traffic an 8-token answer overlaps about
# one such step instead of every step of the prefill, and the prefill still advances.
BACKGROUND_EVERY_STEPS = 8


def is_background(request_id: str) -> bool:
    return request_id.startswith(BACKGROUND_PREFIX)


class BackgroundPrefillMixin:
    """schedule() with the background prefills held out (module docstring). Mixed into vLLM's Scheduler."""

    running: list
    waiting: Any  # vLLM's RequestQueue
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    scheduler_config: Any

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held_steps: dict[str, int] = {}  # request id -> steps held in a row

    def schedule(self, *args, **kwargs):
        running_bg = [r for r in self.running if is_background(r.request_id)]
        waiting_bg = [r for r in self.waiting if is_background(r.request_id)]
        others = len(running_bg) < len(self.running) or len(waiting_bg) < len(self.waiting)
        held_running, held_waiting = self._hold_background(running_bg, waiting_bg, others)
        # The requests it admits this step may fill the running list only up to what the held ones leave: put
        # back, they must not take it past vLLM's cap (its schedule asserts it).
        self.max_num_running_reqs -= len(held_running)
        # Background work alone still takes steps of the long-prefill cap at most, not vLLM's whole budget (which
        # vLLM lifts the cap to for a request alone): an answer that arrives meanwhile waits for the step in
        # progress, 1,500 tokens in one step (~3.2 s on one core) against 256 (~0.6 s).
        budget = self.max_num_scheduled_tokens
        cap = self.scheduler_config.long_prefill_token_threshold
        if cap > 0 and not others and (running_bg or waiting_bg):
            self.max_num_scheduled_tokens = min(budget, cap)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs += len(held_running)
            self.max_num_scheduled_tokens = budget
            # Back at the end of the running list (vLLM preempts from the end: background work yields its blocks
            # first) and at the head of the waiting queue (they keep their turn).
            self.running.extend(held_running)
            if held_waiting:
                self.waiting.prepend_requests(held_waiting)

    def _hold_background(self, running_bg: list, waiting_bg: list, others: bool) -> tuple[list, list]:
        """Takes the background requests to hold this step out of the running list and the waiting queue; returns
        them. `others`: a request that is not background runs or waits."""
        prefilling = [r for r in running_bg if _prefilling(r)]
        if not prefilling and not waiting_bg:
            self._held_steps.clear()
            return [], []
        if not others:
            return [], []
        held_running = [r for r in prefilling if self._hold(r)]
        held_waiting = [r for r in waiting_bg if self._hold(r)]
        if held_running:
            held_ids = {id(r) for r in held_running}
            self.running = [r for r in self.running if id(r) not in held_ids]
        if held_waiting:
            self.waiting.remove_requests(held_waiting)
        live = {r.request_id for r in prefilling} | {r.request_id for r in waiting_bg}
        for rid in [rid for rid in self._held_steps if rid not in live]:
            del self._held_steps[rid]
        return held_running, held_waiting

    def _hold(self, request) -> bool:
        """Whether to hold `request` out of this step: yes, unless it was held the last BACKGROUND_EVERY_STEPS - 1."""
        n = self._held_steps.get(request.request_id, 0)
        if n >= BACKGROUND_EVERY_STEPS - 1:
            self._held_steps[request.request_id] = 0
            return False
        self._held_steps[request.request_id] = n + 1
        return True


def _prefilling(request) -> bool:
    """Still has prompt tokens to compute (a resumed request's output tokens count as prompt here, as in vLLM)."""
    return request.num_computed_tokens < request.num_tokens - 1


_CLASSES: dict[bool, type] = {}


def _scheduler_class(async_scheduling: bool) -> type:
    if async_scheduling not in _CLASSES:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        base = AsyncScheduler if async_scheduling else Scheduler
        _CLASSES[async_scheduling] = type(f"BackgroundPrefill{base.__name__}", (BackgroundPrefillMixin, base), {})
    return _CLASSES[async_scheduling]


def background_prefill_scheduler(*args, vllm_config, **kwargs):
    """vLLM's `scheduler_cls`: called as vLLM calls its scheduler class (EngineCore.__init__)."""
    cls = _scheduler_class(bool(vllm_config.scheduler_config.async_scheduling))
    return cls(*args, vllm_config=vllm_config, **kwargs)


SCHEDULER_CLS = f"{__name__}.background_prefill_scheduler"
