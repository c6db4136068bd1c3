"""`Memory`: Mem0's small API (add / search / get / get_all / update / delete) over the InferScale pipeline.

Adding a fact encodes it once (pre-RoPE KV, optionally behind its context window), stores the KV and indexes
its embedding under the same fact_id; search returns the user's top-k; `compose` builds the injected prompt.
Fact texts are kept beside the KV (a JSON file per user when `store_dir` is set) so the index and the KV can
always be rebuilt from text.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .compose import Composition, compose
from .embedder import as_embedder
from .encoder import PreRopeEncoder
from .errors import UnknownFactError, UnknownUserError, check_id
from .index import VectorIndex
from .models import load_model
from .ordering import serving_order
from .rope import ChunkedRope
from .store import FactStore
from .template import DEFAULT_INSTRUCTION, PromptTemplate
from .types import SHARED_USER_ID, check_user_id

PREFIX_FACT = "prefix"
MAX_K = 200  # Mem0 retrieves up to 200 facts per query


@dataclass
class MemoryRecord:
    fact_id: str
    user_id: str
    text: str
    version: int = 1
    window: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    updated_at: float = field(default_factory=time.time)


@dataclass
class SearchHit:
    fact_id: str
    score: float
    text: str


class Memory:
    def __init__(self, model_path=None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 store_dir: str | Path | None = None, embedder=None, instruction: str = DEFAULT_INSTRUCTION,
                 max_fact_tokens: int = 256, prefix_window: bool = True, model=None, tokenizer=None,
                 **store_kw):
        if model is None:
            model, tokenizer = load_model(model_path, device=device, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device)
        # The instruction prefix sits at position 0 of every composed memory, so encoding each fact behind
        # it is exact context, not a guess; it also gives every fact the attention sink a prompt has.
        self.prefix_window = prefix_window
        self.encoder = PreRopeEncoder(model, tokenizer)
        self.template = PromptTemplate(tokenizer, instruction)
        self.rope = ChunkedRope(model.config, device=self.device, dtype=model.dtype)
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.store = FactStore.for_spec(self.encoder.spec, device=self.device, max_fact_tokens=max_fact_tokens,
                                        disk_dir=self.store_dir / "kv" if self.store_dir else None, **store_kw)
        self.embedder = as_embedder(embedder)
        self.index = VectorIndex(self.embedder.dim, device=self.device)
        self._records: dict[str, dict[str, MemoryRecord]] = {}
        self._lock = threading.RLock()
        self.store.put(SHARED_USER_ID, PREFIX_FACT, self.encoder.encode(self.template.prefix_ids))
        if self.store_dir is not None:
            self._reload()

    # ------------------------------------------------------------------ Mem0-style API

    def add(self, user_id: str, facts: str | Sequence[str], windows: Sequence[Sequence[str]] | None = None,
            fact_ids: Sequence[str] | None = None, metadata: dict | None = None,
            progress: bool = False) -> list[str]:
        """Encode and store facts for `user_id`; returns their fact ids. `windows[i]` holds the conversation
        turns that preceded fact i (context-window encoding, w = len(windows[i])); omitted, w=0. With
        `prefix_window` the instruction prefix comes first in every window."""
        check_user_id("user_id", user_id)
        facts = [facts] if isinstance(facts, str) else list(facts)
        if not facts:
            raise ValueError("no facts given")
        window_lists = [list(w) for w in windows] if windows is not None else [[] for _ in facts]
        ids = list(fact_ids) if fact_ids is not None else [uuid.uuid4().hex for _ in facts]
        if len(window_lists) != len(facts) or len(ids) != len(facts):
            raise ValueError(f"{len(facts)} facts but {len(window_lists)} windows and {len(ids)} fact ids")
        for fid in ids:
            check_id("fact_id", fid)
        fact_tokens = [self.template.fact_ids(t) for t in facts]  # rejects empty facts
        for text, toks in zip(facts, fact_tokens):
            if len(toks) > self.store.max_fact_tokens:
                raise ValueError(f"fact has {len(toks)} tokens, more than the limit of "
                                 f"{self.store.max_fact_tokens}: {text[:60]!r}...")
        encoded = self.encoder.encode_batch(
            [(toks, self.context(w)) for toks, w in zip(fact_tokens, window_lists)], progress=progress)
        embeddings = self.embedder.embed(facts)
        with self._lock:
            for fid, text, window, enc, emb in zip(ids, facts, window_lists, encoded, embeddings):
                old = self._records.get(user_id, {}).get(fid)
                record = MemoryRecord(fid, user_id, text.strip(), (old.version + 1) if old else 1, window,
                                      dict(metadata or {}))
                self.store.put(user_id, fid, enc)
                try:
                    self.index.add(user_id, fid, emb)
                except Exception:
                    self.store.delete(user_id, fid)  # keep store and index consistent
                    raise
                self._records.setdefault(user_id, {})[fid] = record
            self._save(user_id)
        return ids

    def search(self, user_id: str, query: str, k: int = 10) -> list[SearchHit]:
        """The user's top-k facts for `query`, best first."""
        self._check_k(k)
        records = self._user_records(user_id)
        hits = self.index.search(user_id, self.embedder.embed([query])[0], k)
        return [SearchHit(fid, score, records[fid].text) for fid, score in hits]

    def get(self, user_id: str, fact_id: str) -> MemoryRecord:
        records = self._user_records(user_id)
        if fact_id not in records:
            raise UnknownFactError(user_id, fact_id)
        return records[fact_id]

    def get_all(self, user_id: str) -> list[MemoryRecord]:
        return list(self._records.get(user_id, {}).values())

    def update(self, user_id: str, fact_id: str, text: str, window: Sequence[str] | None = None) -> MemoryRecord:
        old = self.get(user_id, fact_id)
        self.add(user_id, [text], [list(window) if window is not None else old.window], [fact_id], old.metadata)
        return self.get(user_id, fact_id)

    def delete(self, user_id: str, fact_id: str) -> None:
        with self._lock:
            self.get(user_id, fact_id)
            self.index.remove(user_id, fact_id)
            self.store.delete(user_id, fact_id)
            del self._records[user_id][fact_id]
            if not self._records[user_id]:
                del self._records[user_id]
            self._save(user_id)

    def delete_user(self, user_id: str) -> None:
        with self._lock:
            self._user_records(user_id)
            self.index.remove_user(user_id)
            self.store.delete_user(user_id)
            del self._records[user_id]
            self._save(user_id)

    def users(self) -> list[str]:
        return list(self._records)

    # ------------------------------------------------------------------ serving helpers

    def retrieve(self, user_id: str, query: str, k: int, order: str = "relevance") -> list[str]:
        """Fact ids in serving order (`ordering.serving_order`: by default the best fact last), or [] for a user
        with no memory."""
        if user_id not in self._records:
            return []
        hits = [(h.fact_id, h.score) for h in self.search(user_id, query, k)]
        if order != "stored":
            return serving_order(hits, order)
        with self._lock:  # records keep insertion order: a fact's place is when it was first stored
            rank = {fact_id: i for i, fact_id in enumerate(self._records.get(user_id, {}))}
        return serving_order([h for h in hits if h[0] in rank], order, rank)

    def compose(self, user_id: str, fact_ids: Sequence[str], question: str) -> Composition:
        """Prefix chunk + the facts in the given order + the query, keys re-rotated to their positions."""
        chunks = [self.store.get(SHARED_USER_ID, PREFIX_FACT)] + self.store.get_many(user_id, list(fact_ids))
        return compose(self.rope, chunks, self.template.query_ids(question))

    def prompt_ids(self, user_id: str, fact_ids: Sequence[str], question: str) -> list[int]:
        """The prompt-injection baseline's prompt: identical token ids to `compose(...).prompt_ids`."""
        return self.template.prompt_ids([self.get(user_id, f).text for f in fact_ids], question)

    def context(self, window: Sequence[str]) -> list:
        """What a fact is encoded behind: the instruction prefix (with `prefix_window`), then its window turns.
        Anything that encodes facts for this Memory's compositions must use the same rule."""
        return ([self.template.prefix_ids] if self.prefix_window else []) + list(window)

    _context = context  # the earlier private name (tests/engine/test_memory.py uses it)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_k(k) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be an int in [1, {MAX_K}], got {k!r}")

    def _user_records(self, user_id: str) -> dict[str, MemoryRecord]:
        check_user_id("user_id", user_id)
        if user_id not in self._records:
            raise UnknownUserError(user_id)
        return self._records[user_id]

    def _records_path(self) -> Path:
        assert self.store_dir is not None  # only a Memory with a store_dir keeps its records in a file
        return self.store_dir / "records.json"

    def _save(self, _user_id: str) -> None:
        if self.store_dir is None:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        data = {u: [asdict(r) for r in recs.values()] for u, recs in self._records.items()}
        tmp = self._records_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self._records_path())  # atomic: a crash never leaves half a file

    def _reload(self) -> None:
        """After a restart: texts from records.json, KV from the disk tier (re-encoded if missing),
        embeddings recomputed (cheap) into a fresh index."""
        path = self._records_path()
        if not path.exists():
            return
        for user_id, recs in json.loads(path.read_text()).items():
            for r in recs:
                record = MemoryRecord(**r)
                if not self.store.contains(user_id, record.fact_id):
                    enc = self.encoder.encode(self.template.fact_ids(record.text), self.context(record.window))
                    self.store.put(user_id, record.fact_id, enc)
                self._records.setdefault(user_id, {})[record.fact_id] = record
            ids = list(self._records[user_id])
            self.index.add_many(user_id, ids, self.embedder.embed([self._records[user_id][i].text for i in ids]))
