"""Encoder pool deployment: turns new facts into pre-RoPE KV (one forward over [prefix | window | fact]).

Stateless and autoscaled on ongoing requests (services/app.py). Concurrent requests, of any users, are merged
into encode calls by a fair scheduler (services/fair_queue.py): each user's facts wait in the user's own queue,
and the next forward is picked by deficit round robin over the waiting users, by each fact's forward work (fact +
window + prefix tokens, and their attention), so one user's 256-fact add or facts behind 4k-token windows cannot
make another user's 1-fact add wait behind all of it (issue 31). A batch is one forward (inferscale_core/encoder.py
ENCODE_BATCH_SIZE: a fact's KV never depends on what it was encoded with), and a fact whose forward is longer than
WHOLE_TOKENS runs one step of STEP_TOKENS' work per turn (FactForward), so what a fact arriving behind other users'
work waits for is one forward or one step, whatever their windows. Facts are tokenized before
they queue (their cost is known), in a thread beside the batch that runs. The result is a list of
`EncodedFact` on the CPU: Serve stores it in the Ray object store and the engine replica that asked for it
(through the gateway's unresolved response) reads it from there. Facts are encoded exactly as
`inferscale_core.memory.Memory.add` does — fact tokens from the prompt template, behind the instruction prefix
and the fact's own context window — so KV made here composes like KV made in-process.

With a cluster KV tier (`cluster_store`, inferscale_core/cluster_store.py), `encode_for` writes each fact's KV
into it as one object per fact version and answers only its token count (`StoredKV`): the KV never travels
through Ray, the gateway or the engine replica; the engine replica that serves the fact reads it from the
cluster tier. Without one (or when the write fails) `encode_for` answers the EncodedFact itself, as `encode`.

Failures are per fact: `encode` answers an `EncodeFailure` for an item it cannot encode and encodes the
others, so one bad fact never fails the other facts of a request, or other users' requests merged into the
same batch. `check` applies the same limits without encoding: the gateway calls it before it writes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inferscale_core.encoder import STEP_TOKENS, FactForward
from inferscale_core.types import EncodedFact, kv_id

from .fair_queue import Again, FairBatcher
from .kv_tier_share import TierShare

log = logging.getLogger("inferscale.encoder_pool")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def positive_int(name: str, value) -> int:
    """A config value that must be an int >= 1 (ValueError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_device(device) -> str:
    """A config's device: "auto", "cpu", "cuda" or "cuda:N"."""
    if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or
                                           (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def resolve_device(device: str) -> str:
    """"auto": the GPU Ray gave this replica when it has one (num_gpus > 0), else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class StoredKV:
    """In place of an EncodedFact: its KV is in the cluster tier under its kv_id (read it from there)."""
    num_tokens: int


@dataclass(frozen=True)
class EncodeFailure:
    """An item the encoder could not encode, in place of its EncodedFact; `reason` is safe to show a client.
    `transient`: the encoder failed (out of memory during a mass re-encode, say), not the fact; trying again
    later may work, so the fact must not be marked unservable for good."""
    reason: str
    transient: bool = False


@dataclass(frozen=True)
class EncoderPoolConfig:
    """What an encoder pool replica is built from, checked once when made (services/app.py
    ServiceConfig.encoder_pool_config): FactEncoder's settings and the cluster tier it writes to."""

    model_path: str | None = None  # None: the packaged SmolLM2-135M-Instruct
    device: str = "auto"  # "auto": the GPU Ray gave the replica, else the CPU
    dtype: str = "float32"  # the model's dtype for the forward
    store_dtype: str | None = None  # the KV's stored dtype; None: dtype
    prefix_window: bool = True  # facts encoded behind the instruction prefix
    max_fact_tokens: int = 256
    cluster_store: dict = field(default_factory=dict)  # ClusterConfig fields; empty: no cluster tier
    # Where each user's share of the cluster tier is booked (services/kv_tier_share.py); None: no per-user bound.
    registry_url: str | None = None

    def __post_init__(self):
        from inferscale_core.cluster_store import ClusterConfig

        check_device(self.device)
        dtype_of(self.dtype)
        if self.store_dtype is not None:
            dtype_of(self.store_dtype)
        if not isinstance(self.prefix_window, bool):
            raise ValueError(f"prefix_window must be a bool, got {self.prefix_window!r}")
        positive_int("max_fact_tokens", self.max_fact_tokens)
        if not isinstance(self.cluster_store, dict):
            raise ValueError(f"cluster_store must be a dict, got {type(self.cluster_store).__name__}")
        ClusterConfig.from_dict(self.cluster_store or None)  # its own fields checked


TRANSIENT_RETRIES = 2  # a fact whose encode raised is tried this often more, from its start, before it is reported
# The fair scheduler's sizes, in work (token-equivalents: inferscale_core/encoder.py step_work). A batch is one
# forward, or one step of one (BATCH_COST 1: a batch closes at its first item), so a fact arriving behind other
# users' work waits for the one forward or step that runs, besides its own: on the reference node's 2 cores, alone,
# ~0.2 s for a short fact behind its 5 neighbours, 0.4-0.5 s for a step of a long window. Batches of one cost no
# throughput: every fact is its own forward anyway (ENCODE_BATCH_SIZE). Batches of 256 tokens (2-3 such facts) made a
# one-fact add wait for the 256 that ran and for 256 more with its own (adds under the noisy benchmark's kv_flood:
# p50 1,055 -> 558 ms, one run each). QUANTUM_WORK per user per turn: a short fact with its window goes in one turn,
# a 4k-token window in about 25 (its steps' work).
BATCH_COST = 1
QUANTUM_WORK = STEP_TOKENS


@dataclass(frozen=True)
class PreparedFact:
    """A fact tokenized for its forward: the fact's tokens and what it is encoded behind (the prefix and the
    window turns, cut to the encoder's max_window_tokens as the encoder cuts them)."""
    fact_ids: list[int]
    context_ids: list[int]

    @property
    def cost(self) -> int:
        """The forward's tokens (the fair scheduler charges their work a step at a time: EncodeJob)."""
        return len(self.fact_ids) + len(self.context_ids)


class FactEncoder:
    """Model + template + encoder, transport-free (the deployment below and tests use it)."""

    def __init__(self, model_path: str | None = None, device: str = "auto", dtype: str = "float32",
                 store_dtype: str | None = None, prefix_window: bool = True, max_fact_tokens: int = 256):
        from inferscale_core.cluster_store import kv_fingerprint
        from inferscale_core.encoder import PreRopeEncoder
        from inferscale_core.models import load_model, resolve_model_path
        from inferscale_core.template import PromptTemplate

        device = resolve_device(device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"encoder replica asked for device {device!r} but no GPU is visible")
        model, tokenizer = load_model(model_path, device=device, dtype=dtype_of(dtype))
        self.encoder = PreRopeEncoder(model, tokenizer, store_dtype=dtype_of(store_dtype) if store_dtype else None)
        self.template = PromptTemplate(tokenizer)
        self.prefix_window = prefix_window
        self.max_fact_tokens = max_fact_tokens
        # What the KV depends on besides the fact: model, stored dtype, the prefix facts are encoded behind.
        self.fingerprint = kv_fingerprint(resolve_model_path(model_path), dtype_of(store_dtype or dtype),
                                          self.template.prefix_ids if prefix_window else [])

    def prefix(self) -> EncodedFact:
        """The shared instruction-prefix chunk (position 0 of every composed memory)."""
        return self.encoder.encode(self.template.prefix_ids).to("cpu")

    def problem(self, text: str) -> str | None:
        """Why this fact text cannot be encoded (measured with the serving model's tokenizer), or None."""
        n = len(self.template.fact_ids(text))
        if n == 0:
            return "is empty after tokenization"
        if n > self.max_fact_tokens:
            return f"is {n} tokens long (serving model's tokenizer), the limit is {self.max_fact_tokens} tokens"
        return None

    def check(self, texts: Sequence[str]) -> list[str | int]:
        """Per text: why it cannot be encoded, else the bytes its KV will take (tokens x KV bytes per token in
        the stored dtype): what the gateway counts against the user's KV quota before it writes."""
        out: list[str | int] = []
        for t in texts:
            why = self.problem(t)
            out.append(why if why is not None else self.encoder.spec.kv_bytes(
                len(self.template.fact_ids(t)), self.encoder.store_dtype))
        return out

    def prepare(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[PreparedFact | EncodeFailure]:
        """`(fact text, window turns)` pairs -> what their forwards take (or why the fact cannot be encoded)."""
        out: list[PreparedFact | EncodeFailure] = []
        keep = self.encoder.max_window_tokens
        for text, window in items:
            why = self.problem(text)
            if why is not None:
                out.append(EncodeFailure(f"the fact {why}"))
                continue
            # Window turns are user text too: tokenized as text (no special token can come from them).
            context = (list(self.template.prefix_ids) if self.prefix_window else []) + [
                t for w in window for t in (self.template.text_ids(w) if isinstance(w, str) else w)]
            out.append(PreparedFact(self.template.fact_ids(text), context[-keep:] if len(context) > keep else context))
        return out

    def encode(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[EncodedFact | EncodeFailure]:
        """`(fact text, window turns)` pairs -> EncodedFact on the CPU (or EncodeFailure), in input order, at once
        (no scheduler: the benchmarks' in-process encodes)."""
        out: list = self.prepare(items)
        todo = [i for i, p in enumerate(out) if isinstance(p, PreparedFact)]
        for i, enc in zip(todo, self.encode_prepared([out[i] for i in todo])):
            out[i] = enc
        return out

    def encode_prepared(self, prepared: Sequence[PreparedFact]) -> list[EncodedFact | EncodeFailure]:
        """Prepared facts -> EncodedFact on the CPU (or EncodeFailure), in input order, every step at once."""
        jobs = [EncodeJob(self, p) for p in prepared]
        out: list = [None] * len(jobs)
        while todo := [i for i, r in enumerate(out) if r is None or isinstance(r, Again)]:
            for i, r in zip(todo, self.run_steps([jobs[i] for i in todo])):
                out[i] = r
        return out

    def run_steps(self, jobs: Sequence[EncodeJob]) -> list[EncodedFact | EncodeFailure | Again]:
        """One step of each job's forward: its EncodedFact on the CPU after its last step, Again(the next step's
        cost) before, or an EncodeFailure once it failed 1 + TRANSIENT_RETRIES times (each failure starts the fact
        again from its first step; one job's failure is its own)."""
        out: list[EncodedFact | EncodeFailure | Again] = []
        for job in jobs:
            try:
                enc = job.forward.step()
            except Exception as e:  # reported per fact, transient: prepare() checked it against every limit
                job.failures += 1
                log.exception("fact failed to encode (attempt %d of %d)", job.failures, 1 + TRANSIENT_RETRIES)
                if job.failures > TRANSIENT_RETRIES:
                    out.append(EncodeFailure(f"the encoder failed on this fact ({type(e).__name__})", transient=True))
                    continue
                job.forward = job.start()
                out.append(Again(job.forward.next_cost))
                continue
            out.append(Again(job.forward.next_cost) if enc is None else enc.to("cpu"))
        return out


class EncodeJob:
    """A prepared fact on its way through the encoder: its forward, run a step per turn (FactForward), and how
    often it failed."""

    def __init__(self, fe: FactEncoder, prepared: PreparedFact):
        self.fe, self.prepared, self.failures = fe, prepared, 0
        self.forward = self.start()

    def start(self) -> FactForward:
        return self.fe.encoder.fact_forward(self.prepared.context_ids, self.prepared.fact_ids)


class EncoderCore:
    """The encoder pool without Serve: a FactEncoder and the cluster tier it writes to. Tests and the engine
    replica's unit tests call it directly (tests/unit/test_replica_core.py); EncoderPool below is the Serve deployment
    built from a config. Every user's facts go through one fair scheduler (`batcher`): one batch runs at a time."""

    def __init__(self, fe: FactEncoder, cluster=None, metrics=None, share: TierShare | None = None):
        """`share`: each user's bound in the cluster tier, applied before every write there (None: unbounded)."""
        from .metrics import EncoderMetrics

        self.fe, self.cluster, self.share = fe, cluster, share
        self.metrics = metrics if metrics is not None else EncoderMetrics()
        self.batcher: FairBatcher[EncodeJob, EncodedFact | EncodeFailure] = FairBatcher(
            self._encode_batch, BATCH_COST, QUANTUM_WORK)
        if self.cluster is not None:
            self.cluster.available  # noqa: B018 - starts connecting in the background

    async def _encode_batch(self, jobs: list[EncodeJob]) -> list[EncodedFact | EncodeFailure | Again]:
        started = time.perf_counter()
        try:
            return await asyncio.to_thread(self.fe.run_steps, jobs)
        finally:
            self.metrics.step.observe(time.perf_counter() - started)

    async def encode(self, user_id: str, items: list[tuple[str, list[str]]]) -> list[EncodedFact | EncodeFailure]:
        """`(fact text, window turns)` pairs of `user_id` -> EncodedFact on the CPU (or EncodeFailure), in input
        order, encoded in the fair scheduler's batches among every user's facts."""
        with self.metrics.request("encode"):
            if not items:
                return []
            out: list = await asyncio.to_thread(self.fe.prepare, list(items))
            todo = [i for i, p in enumerate(out) if isinstance(p, PreparedFact)]
            jobs = [EncodeJob(self.fe, out[i]) for i in todo]
            encoded = await self.batcher.submit(user_id, jobs, [j.forward.next_cost for j in jobs])
            for i, enc in zip(todo, encoded):
                out[i] = enc
            return out

    async def encode_for(self, user_id: str, facts: list[tuple[str, int, str, list[str]]]
                         ) -> Sequence[StoredKV | EncodedFact | EncodeFailure]:
        """`(fact_id, version, text, window)` of one user's facts -> per fact StoredKV (written to the cluster
        tier), the EncodedFact (no cluster tier, or the write failed) or an EncodeFailure. Writing version v
        removes the fact's older versions from the cluster tier."""
        encoded = await self.encode(user_id, [(text, list(window)) for _, _, text, window in facts])
        if self.cluster is None:
            return encoded
        good = [(i, kv_id(f, v), e) for i, ((f, v, _, _), e) in enumerate(zip(facts, encoded))
                if not isinstance(e, EncodeFailure)]
        if self.share is not None:  # room within the user's own share first, never at another user's cost
            await asyncio.to_thread(self.share.make_room, user_id, [
                (facts[i][0], int(facts[i][1]), e.nbytes) for i, _, e in good])
        stored = await asyncio.to_thread(self.cluster.put_many, user_id, [(k, e) for _, k, e in good])
        out: list[StoredKV | EncodedFact | EncodeFailure] = list(encoded)
        for (i, _, e), ok in zip(good, stored):
            if ok:
                out[i] = StoredKV(e.num_tokens)
        for fact_id, version, _, _ in facts:
            if int(version) > 1:
                await asyncio.to_thread(self.cluster.remove_versions, user_id, fact_id, int(version))
        return out

    async def fingerprint(self) -> str:
        return self.fe.fingerprint

    async def cluster_stats(self) -> dict | None:
        if self.cluster is None:
            return None
        return {**self.cluster.counters, **(self.share.counters if self.share is not None else {})}

    async def check(self, texts: list[str]) -> list[str | int]:
        """Per text: why it cannot be encoded, or its KV bytes (tokenizer only, no forward)."""
        with self.metrics.request("check"):
            return await asyncio.to_thread(self.fe.check, list(texts))

    async def prefix(self) -> EncodedFact:
        return await asyncio.to_thread(self.fe.prefix)

    async def health(self) -> str:
        return "ok"


class EncoderPool(EncoderCore):
    """The Serve deployment (options in services/app.py): concurrent requests share the fair scheduler's batches."""

    def __init__(self, config: EncoderPoolConfig | None = None):
        from inferscale_core.cluster_store import ClusterConfig, ClusterStore
        from inferscale_core.vllm_env import below_light_work

        config = config or EncoderPoolConfig()
        # Heavy compute, as the engines: below the node's light work, equal to the engines (vllm_env.py).
        self.niceness = below_light_work(resolve_device(config.device))
        fe = FactEncoder(config.model_path, config.device, config.dtype, config.store_dtype, config.prefix_window,
                         config.max_fact_tokens)
        cluster = ClusterConfig.from_dict(config.cluster_store or None)
        store = ClusterStore(cluster, fe.fingerprint) if cluster else None
        cap = cluster.user_cap() if cluster else None
        share = None
        if store is not None and cap is not None and config.registry_url:
            from .registry import open_registry

            share = TierShare(open_registry(config.registry_url), store, cap)
            log.info("cluster KV tier: each user's KV there bounded to %d bytes", cap)
        super().__init__(fe, store, share=share)
