"""Typed messages between deployments: what the engine replica streams for an answer, through the gateway, to
the front doors (gRPC AnswerChunk, OpenAI chat). Plain frozen dataclasses: Ray pickles them across processes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AnswerPiece:
    """A piece of the answer's text; `index`: the choice (an OpenAI request with n > 1), `logprobs`: OpenAI's
    logprobs content of the piece's tokens when the request asked for them."""
    text: str
    index: int = 0
    logprobs: list | None = None


@dataclass(frozen=True)
class Choice:
    """How one choice of an OpenAI request ended."""
    index: int
    finish_reason: str
    completion_tokens: int = 0
    tool_calls: list | None = None  # OpenAI tool_calls, when the request named a tool or required one


@dataclass(frozen=True)
class AnswerEnd:
    """The last message of an answer: the facts injected (in prompt order), what was prefilled and the hops'
    timings (AnswerChunk.timings_ms in the proto)."""
    fact_ids: list[str]
    ttft_ms: float
    prompt_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    finish_reason: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    choices: list[Choice] | None = None  # OpenAI requests: one per choice
    max_tokens: int | None = None        # OpenAI requests: the cap each choice ran with
