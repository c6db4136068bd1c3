"""A request with memory, as the injection engines prepare it: `Query` in, `Prepared` (prompt token ids, the
connector's parameters, the cache salt) for vLLM, `Answer` out; `RequestCore` builds them from the prompt template
and the encoded instruction prefix, with no Memory (the serving engine's whole core)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .connector import InjectionParams, LoadReport, cache_salt, memory_hash, pack_fact
from .errors import check_id
from .template import PromptTemplate
from .types import EncodedFact, Mode, kv_id

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt


def check_w(w) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise ValueError(f"w (context-window turns) must be an int >= 0, got {w!r}")
    return w


@dataclass
class Query:
    user_id: str
    query: str
    k: int = 10
    w: int = 0
    mode: Mode = Mode.KV
    # System messages and earlier turns ({"role", "content"}), put after the memory (template.query_ids).
    conversation: tuple[dict, ...] = ()
    # OpenAI chat: tool definitions for the chat template, and the turns after the question (tool calls, results).
    tools: tuple[dict, ...] = ()
    after: tuple[dict, ...] = ()


@dataclass
class Prepared:
    """A request ready for vLLM: token ids and, in KV mode, the connector parameters and cache salt."""

    query: Query
    fact_ids: list[str]  # retrieved, in serving order (best last)
    prompt_ids: list[int]
    memory_len: int
    params: InjectionParams | None
    salt: str | None
    retrieve_s: float  # embed + search + compose

    def prompt(self) -> TokensPrompt:
        p: TokensPrompt = {"prompt_token_ids": self.prompt_ids}
        if self.salt is not None:
            p["cache_salt"] = self.salt
        return p

    def sampling(self, base):
        sp = base.clone()
        if self.params is not None:
            sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": self.params.to_kv_transfer_params()}
        return sp


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    fact_ids: list[str]
    mode: Mode
    k: int
    w: int
    prompt_len: int
    memory_len: int
    num_cached_tokens: int  # prompt tokens vLLM did not prefill (injected + local prefix-cache hits)
    retrieve_s: float
    ttft_s: float | None = None  # submit -> first token (streaming engine only)
    logprobs: list | None = field(default=None, repr=False)
    finish_reason: str | None = None  # vLLM's: "stop" (end of sequence or stop string) or "length"
    # vLLM's RequestStateStats (engine-core queued / scheduled / first-token timestamps) when it logs stats
    engine_stats: Any = field(default=None, repr=False)
    # The connector's asynchronous loads of this request (same clock as engine_stats); None when it had none
    kv_load: LoadReport | None = field(default=None, repr=False)


class RequestCore:
    """What every injection engine does without a Memory: the prompt template and the encoded instruction prefix,
    requests prepared for facts the caller names (`prepare_facts`), the worker extension's payloads, answers."""

    def __init__(self, template: PromptTemplate, prefix: EncodedFact):
        if [int(t) for t in prefix.token_ids.tolist()] != list(template.prefix_ids):
            raise ValueError("the prefix chunk's tokens are not the template's prefix: it was encoded with another "
                             "tokenizer or instruction than this engine's template")
        self.template = template
        self.prefix = prefix
        self.prefix_id = f"prefix-{memory_hash(self.template.prefix_ids)[:16]}"

    # ---- payloads for the worker extension (ids and packed bytes)
    @staticmethod
    def payload(kv: str, fact) -> tuple:
        return (kv, pack_fact(fact))

    def prefix_payload(self) -> list[tuple]:
        return [self.payload(self.prefix_id, self.prefix)]

    @staticmethod
    def encoded_payloads(items: Sequence[tuple[str, EncodedFact]]) -> list[tuple]:
        """`(kv_id, EncodedFact)` pairs from the caller -> worker payloads; every id checked first."""
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[1], EncodedFact):
                raise ValueError(f"items[{i}] must be (kv_id, EncodedFact), got {type(item).__name__}")
            out.append(RequestCore.payload(check_id("kv_id", item[0]), item[1]))
        return out

    # ---- requests
    @staticmethod
    def check_query(q: Query) -> None:
        check_id("user_id", q.user_id)
        check_w(q.w)
        if q.mode not in set(Mode):
            raise ValueError(f"mode must be one of {[m.value for m in Mode]}, got {q.mode!r}")

    def prepare_facts(self, q: Query, fact_ids: Sequence[str], texts: Sequence[str], versions: Sequence[int],
                      kv_ids: Sequence[str] | None = None, started: float | None = None) -> Prepared:
        """A request for facts already chosen (serving order, best last): prompt ids, and in KV mode the
        connector parameters naming `kv_ids` (the facts' stored encodings in the worker store; default
        `kv_id(fact_id, version, q.w)`) and a cache salt over the facts' versions."""
        self.check_query(q)
        t0 = time.perf_counter() if started is None else started
        fact_ids, versions = list(fact_ids), list(versions)
        if kv_ids is None and len(versions) == len(fact_ids):
            kv_ids = [kv_id(f, v, q.w) for f, v in zip(fact_ids, versions)]
        kv_ids = list(kv_ids or ())
        if not len(texts) == len(versions) == len(kv_ids) == len(fact_ids):
            raise ValueError(f"{len(fact_ids)} fact ids but {len(texts)} texts, {len(versions)} versions and "
                             f"{len(kv_ids)} kv ids")
        memory_ids = list(self.template.prefix_ids)
        chunk_lens = [len(memory_ids)]  # per chunk: the connector's recompute_facts needs the fact boundaries
        for t in texts:
            ids = self.template.fact_ids(t)
            memory_ids += ids
            chunk_lens.append(len(ids))
        prompt_ids = memory_ids + self.template.query_ids(q.query, q.conversation, q.tools, q.after)
        params = salt = None
        if q.mode == Mode.KV and fact_ids:
            chunks = [self.prefix_id] + kv_ids
            params = InjectionParams(q.user_id, tuple(chunks), len(memory_ids), memory_hash(memory_ids),
                                     tuple(chunk_lens))
            salt = cache_salt(q.user_id, chunks, [0, *versions])
        else:  # prompt mode, no facts: still per user, so no one learns from the prefix cache what another sent
            salt = cache_salt(q.user_id, (), ())
        return Prepared(q, fact_ids, prompt_ids, len(memory_ids), params, salt, time.perf_counter() - t0)

    def chat_prompt(self, messages: Sequence[dict], user_id: str) -> dict:
        """Plain chat (no memory) for `user_id`: the model's chat template over role/content messages, each
        content kept as text (PromptTemplate.chat_ids), under the user's own prefix-cache salt like any of the
        user's prompts (no one learns from the prefix cache what another user's extraction sent)."""
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content'")
        return {"prompt_token_ids": self.template.chat_ids(messages), "cache_salt": cache_salt(user_id, (), ())}

    def answer(self, p: Prepared, out, ttft_s: float | None = None) -> Answer:
        c = out.outputs[0]
        return Answer(text=c.text, token_ids=list(c.token_ids), fact_ids=p.fact_ids, mode=p.query.mode,
                      k=p.query.k, w=p.query.w, prompt_len=len(p.prompt_ids), memory_len=p.memory_len,
                      num_cached_tokens=out.num_cached_tokens or 0, retrieve_s=p.retrieve_s, ttft_s=ttft_s,
                      logprobs=c.logprobs, finish_reason=c.finish_reason,
                      engine_stats=getattr(out, "metrics", None),
                      kv_load=LoadReport.from_kv_transfer_params(getattr(out, "kv_transfer_params", None)))
