"""BackgroundPrefillMixin's choice of what vLLM's schedule() sees, on a stand-in for vLLM's scheduler (the real
engine: tests/engine/test_background_prefill.py)."""
from __future__ import annotations

from types import SimpleNamespace

from inferscale_core.background_prefill import (
    BACKGROUND_EVERY_STEPS,
    BACKGROUND_PREFIX,
    BackgroundPrefillMixin,
    is_background,
)


class Queue(list):
    """vLLM's FCFS RequestQueue, the two calls the mixin makes."""

    def remove_requests(self, requests):
        for r in requests:
            self.remove(r)

    def prepend_requests(self, requests):
        self[:0] = list(requests)


class VllmScheduler:
    """Records what each schedule() saw, as vLLM's would plan from it."""

    def __init__(self):
        self.running: list = []
        self.waiting = Queue()
        self.max_num_running_reqs = 8
        self.max_num_scheduled_tokens = 2048
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=256)
        self.seen: list[tuple[list[str], list[str], int]] = []
        self.budgets: list[int] = []

    def schedule(self):
        self.seen.append(([r.request_id for r in self.running], [r.request_id for r in self.waiting],
                          self.max_num_running_reqs))
        self.budgets.append(self.max_num_scheduled_tokens)
        return "planned"


class Scheduler(BackgroundPrefillMixin, VllmScheduler):
    pass


def req(rid: str, computed: int = 0, tokens: int = 1500):
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_tokens=tokens)


def test_a_background_prefill_is_held_out_of_the_steps_of_others_but_one_in_every_few():
    s = Scheduler()
    fg, bg = req("answer-1", computed=200, tokens=201), req(BACKGROUND_PREFIX + "x")
    s.running = [bg, fg]
    ran = []
    for _ in range(2 * BACKGROUND_EVERY_STEPS):
        assert s.schedule() == "planned"
        running, _, cap = s.seen[-1]
        ran.append(bg.request_id in running)
        assert cap == (8 if bg.request_id in running else 7)  # room kept for the held one
        assert s.running == [fg, bg] or s.running == [bg, fg]  # put back after the step
        assert s.max_num_running_reqs == 8
    assert ran == ([False] * (BACKGROUND_EVERY_STEPS - 1) + [True]) * 2
    assert s.running[-1] is bg  # put back last: vLLM preempts from the end, background first


def test_alone_or_decoding_a_background_request_is_never_held():
    s = Scheduler()
    bg = req(BACKGROUND_PREFIX + "x")
    s.running = [bg]
    s.schedule()
    assert s.seen[-1][0] == [bg.request_id]  # alone: it runs every step,
    assert s.budgets[-1] == 256 and s.max_num_scheduled_tokens == 2048  # in steps of the long-prefill cap only
    decoding = req(BACKGROUND_PREFIX + "y", computed=1500, tokens=1501)
    s.running = [decoding, req("answer-1", computed=10, tokens=11)]
    for _ in range(3):
        s.schedule()
        assert decoding.request_id in s.seen[-1][0]  # its next token costs the step ~nothing
        assert s.budgets[-1] == 2048  # others run too: vLLM's own budget (and its cap for long prompts)


def test_a_waiting_background_request_waits_while_others_run_and_keeps_its_turn():
    s = Scheduler()
    bg, later = req(BACKGROUND_PREFIX + "w"), req("answer-2", computed=0, tokens=100)
    s.running = [req("answer-1", computed=10, tokens=11)]
    s.waiting = Queue([bg, later])
    s.schedule()
    assert s.seen[-1][1] == ["answer-2"]
    assert list(s.waiting) == [bg, later]  # back at its place, ahead of the later one
    s.running, s.waiting = [], Queue([bg])
    s.schedule()
    assert s.seen[-1][1] == [bg.request_id]  # nothing else: admitted


def test_background_is_named_by_the_request_id_prefix_vllm_keeps():
    assert is_background(f"{BACKGROUND_PREFIX}3f2a-1b2c3d4e")  # vLLM appends "-<8 hex>" to the caller's id
    assert not is_background("3f2a") and not is_background(f"x{BACKGROUND_PREFIX}")
