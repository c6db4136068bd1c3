"""Typed messages between deployments: what the gateway asks of an engine replica (writes, deletes, answers) and
what the engine replica streams back for an answer, through the gateway, to the front doors (gRPC AnswerChunk,
OpenAI chat). Plain frozen dataclasses: Ray pickles them across processes."""
from __future__ import annotations

from dataclasses import dataclass, field

from inferscale_core.types import Mode


@dataclass(frozen=True)
class FactRef:
    """A fact at a version: a deleted fact's last version (every version up to it goes)."""
    fact_id: str
    version: int


@dataclass(frozen=True)
class FactWrite:
    """A fact the registry just stored, at its version, as the replica holds it (books.HeldFact): its text (prompt
    mode needs it), its window (a re-encode needs it) and when it expires. No defaults: a write that left the window
    or the expiry out would be held wrong until the fact changes (the replica's sync reads only changed versions)."""
    fact_id: str
    version: int
    text: str
    window: tuple[str, ...]
    expires_at: float

    @classmethod
    def of(cls, rec) -> "FactWrite":
        """From the registry's FactRecord just stored."""
        return cls(rec.fact_id, rec.version, rec.text, tuple(rec.window), rec.expires_at)


@dataclass(frozen=True)
class OpenAIChat:
    """The parts of an OpenAI chat request the HTTP front door checked (services/openai_params.py): its sampling
    fields (they replace max_tokens and temperature), its turns with the question at `question_index`, its tools.
    An answer to it streams pieces with the choice `index` and OpenAI `logprobs`, and ends with `choices`."""
    sampling: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    question_index: int = 0
    tools: list = field(default_factory=list)


@dataclass(frozen=True)
class AnswerRequest:
    """An answer for `user_id` from the facts retrieval named (`fact_ids`, in prompt order). `conversation`: system
    messages and earlier turns, after the memory in the chat template; `openai`: an OpenAI chat request's parts."""
    user_id: str
    query: str
    fact_ids: list[str]
    max_tokens: int
    temperature: float
    mode: Mode
    conversation: list[dict] | None = None
    openai: OpenAIChat | None = None


# Tokens an answer's piece gathers after each choice's first piece (EngineReplicaConfig.stream_interval, vLLM's
# --stream-interval): every piece crosses two Ray hops (services/engine_replica/answering.py PieceCoalescer).
DEFAULT_STREAM_INTERVAL = 8


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
