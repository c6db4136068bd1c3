"""services/engine_replica/answering.py choice_outputs: a request's choices, at most `at_once` decoding at a time,
each as vLLM makes its own children of an n-choice request. vLLM's SamplingParams, and an engine double that
streams a few deltas per request (the real engine's equality with vLLM's own n: tests/engine/test_engine.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from inferscale_server.engine_replica.answering import CHOICES_AT_ONCE, choice_outputs


class SeededEngine:
    """vLLM's `generate` as a stream of RequestOutput-like deltas: each request of n choices streams `steps` steps,
    each choice's text made from its seed (the request's seed + its index, as vLLM seeds an n-choice request's
    children), and records how many requests run at once."""

    def __init__(self, steps: int = 3, fail_seed: int | None = None):
        self.steps, self.fail_seed = steps, fail_seed
        self.running = self.most = self.started = self.ended = 0
        self.seen: list[SamplingParams] = []

    async def generate(self, sp: SamplingParams):
        self.seen.append(sp)
        self.started += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            for step in range(self.steps):
                await asyncio.sleep(0.001)
                if sp.seed is not None and sp.seed == self.fail_seed and step == 1:
                    raise ValueError("a choice's engine error")
                outs = [SimpleNamespace(index=i, text=f"s{(sp.seed or 0) + i}t{step} ", token_ids=[step],
                                        finish_reason="length" if step == self.steps - 1 else None)
                        for i in range(sp.n)]
                yield SimpleNamespace(outputs=outs, num_cached_tokens=0)
        finally:
            self.running -= 1
            self.ended += 1


def collect(engine: SeededEngine, sp: SamplingParams, at_once: int = CHOICES_AT_ONCE) -> dict[int, str]:
    async def run():
        texts: dict[int, str] = {}
        async for index, c, _ in choice_outputs(engine.generate, sp, at_once):
            texts[index] = texts.get(index, "") + c.text
        return texts
    return asyncio.run(run())


def test_few_choices_are_one_request_of_n():
    engine = SeededEngine()
    texts = collect(engine, SamplingParams(n=CHOICES_AT_ONCE, seed=7))
    assert engine.started == 1 and engine.seen[0].n == CHOICES_AT_ONCE
    assert texts == {i: f"s{7 + i}t0 s{7 + i}t1 s{7 + i}t2 " for i in range(CHOICES_AT_ONCE)}


def test_more_choices_run_at_most_at_once_each_seeded_as_vllms_children():
    engine = SeededEngine()
    texts = collect(engine, SamplingParams(n=10, seed=7, max_tokens=3), at_once=3)
    assert engine.started == 10 and engine.most == 3 and engine.running == 0
    assert [sp.n for sp in engine.seen] == [1] * 10 and sorted(sp.seed for sp in engine.seen) == list(range(7, 17))
    assert all(sp.max_tokens == 3 for sp in engine.seen)
    # each choice's text is what vLLM's child `index` (seed 7 + index, its output index 0) makes
    assert texts == {i: f"s{7 + i}t0 s{7 + i}t1 s{7 + i}t2 " for i in range(10)}


def test_unseeded_choices_stay_unseeded():
    engine = SeededEngine()
    collect(engine, SamplingParams(n=6), at_once=2)
    assert engine.started == 6 and {sp.seed for sp in engine.seen} == {None} and engine.most == 2


def test_a_choices_error_is_raised_and_ends_the_others():
    engine = SeededEngine(steps=50, fail_seed=9)
    with pytest.raises(ValueError, match="a choice's engine error"):
        collect(engine, SamplingParams(n=8, seed=7), at_once=4)
    assert engine.running == 0 and engine.started < 8  # the others ended, the rest never started


def test_closing_the_stream_ends_every_choice_it_started():
    engine = SeededEngine(steps=1000)

    async def run():
        stream = choice_outputs(engine.generate, SamplingParams(n=8, seed=1), 4)
        got = [await stream.__anext__() for _ in range(5)]
        await stream.aclose()  # the caller left
        return got

    got = asyncio.run(run())
    assert len(got) == 5 and engine.started == 4 and engine.ended == 4 and engine.running == 0


class ChoicesEngine(SeededEngine):
    """The rest of what Answering asks a ServingEngine for an OpenAI request: `generate(p, sp)`, its sizes,
    sampling defaults and tokenizer; records the admission's tokens in flight while a choice runs."""

    def __init__(self, admission, steps: int = 2):
        super().__init__(steps=steps)
        self.admission, self.in_flight_seen = admission, set()

    def max_model_len(self) -> int:
        return 4096

    def sampling_defaults(self) -> dict:
        return {}

    def tokenizer(self):
        return None

    def generate(self, p, sp):  # type: ignore[override]
        self.in_flight_seen.add(self.admission.in_flight_tokens)
        return super().generate(sp)


def openai_answering(n: int, steps: int = 2):
    """(admission, engine double, Answering, prepared request, AnswerRequest) for an OpenAI chat of n choices."""
    from inferscale_core.types import Mode
    from inferscale_server.admission import Admission
    from inferscale_server.engine_replica.answering import Answering
    from inferscale_server.messages import AnswerRequest, OpenAIChat

    admission = Admission(100_000, 2.0)
    engine = ChoicesEngine(admission, steps)
    metrics = SimpleNamespace(ttft=SimpleNamespace(observe=lambda *a, **k: None))
    answering = Answering(engine, admission, metrics, stream_interval=1)
    p = SimpleNamespace(prompt_ids=list(range(10)), fact_ids=[])
    chat = OpenAIChat(sampling={"n": n, "max_completion_tokens": 100, "seed": 3},
                      messages=[{"role": "user", "content": "q?"}])
    return admission, engine, answering, p, AnswerRequest("u", "q?", [], 100, 1.0, Mode.KV, openai=chat)


@pytest.mark.parametrize("n", [2, 16])
def test_an_openai_answer_holds_admission_for_the_choices_that_run_at_once(n):
    """Answering.stream admits an OpenAI request for its prompt and the max_tokens of the choices that decode at once
    (min(n, CHOICES_AT_ONCE)), not all n: the others start as those finish and hold their KV then."""
    from inferscale_server.messages import AnswerEnd

    admission, engine, answering, p, req = openai_answering(n)

    async def run():
        return [x async for x in answering.stream(p, req, 0.0, {})]

    out = asyncio.run(run())
    end = out[-1]
    assert isinstance(end, AnswerEnd) and [c.index for c in end.choices] == list(range(n))
    assert engine.in_flight_seen == {10 + min(n, CHOICES_AT_ONCE) * 100} and admission.in_flight_tokens == 0
    assert engine.started == (1 if n <= CHOICES_AT_ONCE else n)


def test_an_openai_answer_whose_caller_leaves_ends_its_choices_at_once():
    """The caller gone (the answer's stream closed after a few pieces): every choice it started has ended when the
    close returns, not when the garbage collector gets to it, and its admission is released."""
    admission, engine, answering, p, req = openai_answering(16, steps=1000)

    async def run():
        stream = answering.stream(p, req, 0.0, {})
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        return got, engine.started, engine.running, admission.in_flight_tokens

    got, started, running, in_flight = asyncio.run(run())
    assert len(got) == 3 and started == CHOICES_AT_ONCE and running == 0 and in_flight == 0
