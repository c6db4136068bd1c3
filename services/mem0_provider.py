"""Mem0 on InferScale: `AddMemory(infer=true)` runs mem0ai's own `Memory.add` pipeline (existing memories of
the user, one LLM extraction call, JSON parsing, hash dedup, insert, history) with InferScale's parts:

  vector store  `InferScaleVectorStore` (mem0's VectorStoreBase) over the registry, the retrieval index and
                the engine replicas' KV stores: a fact mem0 inserts gets ONE fact_id, used by its registry
                record, its index entry and its KV (encoded once by the encoder pool).
  LLM           `ServingLLM` (mem0's LLMBase): plain chat generation on the serving model (no memory).
  embedder      `ServiceEmbedder` (mem0's EmbeddingBase): the retrieval replicas' embedder, so mem0's vectors
                are the index's own, and the gateway loads no model (no torch: its start stays ~2 s, not ~15).

mem0ai 2.2 validates providers against fixed lists and has no hook for a custom vector store, so the
`mem0.Memory` is built from inert built-in parts (an in-memory Qdrant client and OpenAI configs that are
never called) and its `vector_store`, `llm` and `embedding_model` are then replaced; `check_mem0_version` pins the API this was
written against. mem0ai 2.2's `add` is additive: its events are ADD only (duplicates are dropped by hash).

Small models: mem0's extraction system prompt is ~8.5k tokens, longer than SmolLM2's whole context. When
it does not fit the serving model, `ServingLLM` sends `COMPACT_SYSTEM_PROMPT` instead (same output contract)
and constrains decoding to that contract, because a 135M model does not reliably write JSON on its own.

All calls into the service go through a `FactSink` (services/gateway/core.py:GatewaySink implements it); mem0 runs in a
worker thread, so the sink's methods are blocking.
"""
from __future__ import annotations

import builtins
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .registry import FactRecord, NewFact


def _mem0_env() -> None:
    """mem0 reads these when it is first imported: no telemetry to posthog (no phoning home from a
    service), and its files (~/.mem0 otherwise) under the InferScale cache."""
    from inferscale_core.cache import cache_dir

    os.environ.setdefault("MEM0_TELEMETRY", "false")
    os.environ.setdefault("MEM0_DIR", str(cache_dir() / "mem0"))


_mem0_env()
from mem0.embeddings.base import EmbeddingBase  # noqa: E402 - mem0 reads the environment _mem0_env sets first
from mem0.llms.base import LLMBase  # noqa: E402
from mem0.vector_stores.base import VectorStoreBase  # noqa: E402

log = logging.getLogger("inferscale.mem0")
SUPPORTED_MEM0 = (2, 2)
MEM0_KEYS_DROPPED = ("data", "text_lemmatized")  # payload keys kept elsewhere (text) or derivable
EMBEDDING_DIMS = 384  # the service's embedder, all-MiniLM-L6-v2 (mem0's configs want the size before any vector)

COMPACT_SYSTEM_PROMPT = (
    "Extract facts about the user from the New Messages below, one short sentence per fact. Skip facts "
    "already listed under Existing Memories.\n"
    "Example: if the user says \"I'm Sam, I live in Paris and I love jazz\", answer "
    "{\"memory\": [{\"text\": \"User's name is Sam.\"}, {\"text\": \"User lives in Paris.\"}, "
    "{\"text\": \"User loves jazz.\"}]}")
_ITEM = r'\{"text": "[^".\\\n]+\."\}'
# mem0's additive output contract, {"memory": [{"text": ...}, ...]}, at most 5 one-sentence facts.
COMPACT_OUTPUT_REGEX = r'\{"memory": \[(' + _ITEM + r'(, ' + _ITEM + r'){0,4})?\]\}'


def check_mem0_version(version: str | None = None) -> str:
    if version is None:
        from importlib.metadata import version as installed

        version = installed("mem0ai")
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    if major_minor != SUPPORTED_MEM0:
        want = ".".join(map(str, SUPPORTED_MEM0))
        raise RuntimeError(f"services/mem0_provider.py is written against mem0ai {want}.x (its Memory internals "
                           f"and prompts), found mem0ai {version}; install mem0ai=={want}.*")
    return version


class FactSink(Protocol):
    """What the provider asks of the service. Every method is scoped to one user and blocking."""

    def add(self, user_id: str, facts: list[NewFact]) -> list[FactRecord]:
        """Registry write, then index + KV under the same ids."""

    def search(self, user_id: str, vector: list[float], k: int) -> list[tuple[str, float]]: ...

    def embed(self, texts: builtins.list[str], as_query: bool) -> builtins.list[builtins.list[float]]:
        """The service's embeddings of `texts`: as search queries, or as facts (what the index stores)."""

    def get(self, user_id: str, fact_id: str) -> FactRecord: ...

    def list(self, user_id: str) -> list[FactRecord]: ...

    def update(self, user_id: str, fact_id: str, text: str | None, vector, metadata: dict | None) -> FactRecord: ...

    def delete(self, user_id: str, fact_id: str) -> None: ...

    def chat(self, user_id: str, messages: builtins.list[dict], max_tokens: int, temperature: float,
             structured: dict | None) -> str:
        """Plain chat generation on the serving model for `user_id` (mem0's extraction prompt)."""

    def chat_room(self, user_id: str, messages: builtins.list[dict]) -> int:
        """Tokens left in the serving model's context after these messages (negative: they do not fit)."""


@dataclass
class Hit:
    """mem0's search/get result shape: id, score, payload ({"data": text, ...metadata})."""

    id: str
    score: float | None
    payload: dict


def _payload(rec: FactRecord) -> dict:
    return {**rec.metadata, "data": rec.text, "user_id": rec.user_id}


def _unit(vector) -> np.ndarray:
    """The index compares L2-normalized embeddings (inner product = cosine)."""
    v = np.asarray(vector, dtype=np.float32)
    return v / max(float(np.linalg.norm(v)), 1e-12)


def _metadata(payload: dict | None) -> dict:
    return {k: v for k, v in (payload or {}).items() if k not in MEM0_KEYS_DROPPED}


# ---------------------------------------------------------------------------------------------- vector store
class InferScaleVectorStore(VectorStoreBase):
    """mem0's vector store interface over InferScale, bound to one user: mem0 calls `get(id)` / `delete(id)`
    without a user, and a store that can only see its user keeps one user from touching another's facts."""

    def __init__(self, sink: FactSink, user_id: str):
        self.sink, self.user_id = sink, user_id

    def _scope(self, filters: dict | None) -> str:
        user = (filters or {}).get("user_id")
        if user is not None and user != self.user_id:
            raise ValueError(f"this store serves user {self.user_id!r}, not {user!r}")
        return self.user_id

    def insert(self, vectors, payloads=None, ids=None):
        payloads = payloads or [{} for _ in vectors]
        if ids is None or not (len(ids) == len(vectors) == len(payloads)):
            raise ValueError("insert needs one id and one payload per vector")
        for p in payloads:
            self._scope({"user_id": p.get("user_id")})
        facts = [NewFact(p["data"], _metadata(p), embedding=_unit(v), fact_id=str(i))
                 for v, p, i in zip(vectors, payloads, ids)]
        self.sink.add(self.user_id, facts)

    def search(self, query, vectors, top_k=5, filters=None):
        user = self._scope(filters)
        hits = self.sink.search(user, list(vectors), top_k)
        recs = {}
        for fid, _ in hits:
            try:
                recs[fid] = self.sink.get(user, fid)
            except KeyError:  # deleted since the search
                continue
        return [Hit(fid, score, _payload(recs[fid])) for fid, score in hits if fid in recs]

    def get(self, vector_id):
        try:
            return Hit(str(vector_id), None, _payload(self.sink.get(self.user_id, str(vector_id))))
        except KeyError:
            return None

    def list(self, filters=None, top_k=None):
        recs = self.sink.list(self._scope(filters))
        return [[Hit(r.fact_id, None, _payload(r)) for r in (recs if top_k is None else recs[:top_k])]]

    def update(self, vector_id, vector=None, payload=None):
        text = payload.get("data") if payload else None
        self.sink.update(self.user_id, str(vector_id), text, None if vector is None else _unit(vector),
                         _metadata(payload) if payload else None)

    def delete(self, vector_id):
        self.sink.delete(self.user_id, str(vector_id))

    # Collections: InferScale keeps one namespace per user in the registry; nothing to create or drop.
    def create_col(self, name, vector_size, distance):
        return None

    def list_cols(self):
        return [self.user_id]

    def col_info(self):
        return {"name": self.user_id, "count": len(self.sink.list(self.user_id))}

    def delete_col(self):
        raise NotImplementedError("dropping a collection is not supported: use DeleteUser")

    def reset(self):
        raise NotImplementedError("reset is not supported: use DeleteUser")


# ------------------------------------------------------------------------------------------------------ LLM
class ServingLLM(LLMBase):
    """mem0's LLM interface over the serving model's plain chat generation, for the user of the extraction in
    progress (`user_id`, set by Mem0Extractor.add like the vector store's user)."""

    def __init__(self, sink: FactSink, max_tokens: int = 256, temperature: float = 0.0):
        from mem0.configs.llms.base import BaseLlmConfig

        super().__init__(BaseLlmConfig(model="inferscale-serving", temperature=temperature, max_tokens=max_tokens))
        self.sink, self.max_tokens, self.temperature = sink, max_tokens, temperature
        self.compact_calls = 0
        self.user_id: str | None = None

    def generate_response(self, messages, tools=None, tool_choice="auto", response_format=None, **kwargs):
        if tools:
            raise NotImplementedError("tool calls are not supported by the InferScale serving LLM")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        structured = {"json_object": True} if (response_format or {}).get("type") == "json_object" else None
        if self.user_id is None:
            raise RuntimeError("ServingLLM called outside an extraction: no user to generate for")
        user = self.user_id
        if messages and messages[0]["role"] == "system" and self.sink.chat_room(user, messages) < self.max_tokens:
            # mem0's system prompt does not fit this model's context: the compact prompt, same contract.
            log.info("mem0's extraction prompt does not fit the serving model's context; using the compact one")
            messages = [{"role": "system", "content": COMPACT_SYSTEM_PROMPT}, *messages[1:]]
            structured = {"regex": COMPACT_OUTPUT_REGEX} if structured else None
            self.compact_calls += 1
        return self.sink.chat(user, messages, self.max_tokens, self.temperature, structured)


class ServiceEmbedder(EmbeddingBase):
    """mem0's embedder interface over the service's (FactSink.embed): mem0 embeds a search's query as a query
    and what it inserts or updates as a fact, as SearchMemories and AddFacts do."""

    def __init__(self, sink: FactSink):
        super().__init__()
        self.sink = sink

    def embed(self, text, memory_action=None):
        return self.embed_batch([text], memory_action)[0]

    def embed_batch(self, texts, memory_action="add"):
        return self.sink.embed(list(texts), as_query=memory_action == "search")


# ------------------------------------------------------------------------------------------------ extractor
class Mem0Extractor:
    """One mem0.Memory per gateway replica (the embedder loads once); calls run one at a time because the
    vector store is bound to the user of the call in progress."""

    def __init__(self, sink: FactSink, max_tokens: int = 256):
        check_mem0_version()
        from mem0 import Memory
        from mem0.configs.base import MemoryConfig
        from qdrant_client import QdrantClient

        unused = "http://127.0.0.1:9/unused"
        config = MemoryConfig(
            # Built and then replaced (see the module docstring): never called.
            embedder={"provider": "openai", "config": {"api_key": "unused", "openai_base_url": unused,
                                                       "embedding_dims": EMBEDDING_DIMS}},
            vector_store={"provider": "qdrant", "config": {"client": QdrantClient(":memory:"),
                                                           "collection_name": "unused",
                                                           "embedding_model_dims": EMBEDDING_DIMS}},
            llm={"provider": "openai", "config": {"model": "inferscale-serving", "api_key": "unused",
                                                  "openai_base_url": unused}},
            history_db_path=":memory:")
        self.memory = Memory(config)
        self.sink = sink
        self.llm = ServingLLM(sink, max_tokens=max_tokens)
        self.memory.llm = self.llm
        self.memory.embedding_model = ServiceEmbedder(sink)
        self._lock = threading.Lock()

    def add(self, user_id: str, messages: list[dict], metadata: dict | None = None) -> list[dict[str, Any]]:
        """mem0's add with inference for one user; returns mem0's events ({"id", "memory", "event"}).
        mem0 keeps, in its SQLite history store, every message it was given (its next extraction for the same
        user reads the last 10 as context) and every memory text it wrote: user text outside the registry,
        which DeleteUser could not reach. The store is emptied after every call, so InferScale keeps no text
        but the registry's and each call extracts from its own messages (the history Mem0's HTTP API serves is
        the registry's)."""
        from mem0.memory.storage import SQLiteManager

        with self._lock:
            self.memory.vector_store = InferScaleVectorStore(self.sink, user_id)
            self.llm.user_id = user_id
            try:
                out = self.memory.add(messages, user_id=user_id, metadata=dict(metadata or {}), infer=True)
            finally:
                self.memory.vector_store = None  # never left bound to a user between calls
                self.llm.user_id = None
                self.memory.db.reset()  # drops the messages and history tables, then a fresh store
                self.memory.db.close()
                self.memory.db = SQLiteManager(":memory:")
        return list(out.get("results", []))
