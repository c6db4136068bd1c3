"""LoCoMo benchmark: InferScale KV injection ("kv") against Mem0-style prompt injection ("pi").

For every conversation and window size w, the conversation's memory facts are added once for a user
"<sample_id>.w<w>", each with the w dialogue turns before it (KV mode encodes the fact in that context;
prompt injection only ever uses the fact text). Every selected question is then answered in both modes
for every k (facts retrieved), and scored with LoCoMo's F1 and, with --judge-model, a binary LLM judge.
A second phase measures throughput with 1..N concurrent users. Results go to --out as JSON, Markdown
and PNG plots (inferscale_core.eval.report).

    python bench/locomo.py --quick                    # minutes on 2 CPU cores
    python bench/locomo.py --k 5,10,20,50 --w 0,5,20,50 --judge-model default

The engine is reached only through AnswerBackend; `EngineBackend` adapts inferscale_core.engine.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from inferscale_core.eval import report
from inferscale_core.eval.locomo import (CATEGORY_NAMES, Conversation, Question, answerable, default_data_path,
                                         load_locomo, window_turns)
from inferscale_core.eval.scoring import judge_prompt, locomo_f1, parse_judge_reply
from inferscale_core.eval.stats import by_category, group_by, paired_bootstrap, summarize

MODES = ("kv", "pi")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
FULL_DEFAULTS = {"k": (5, 10, 20, 50), "w": (0, 5, 20, 50), "users": (1, 2, 4, 8)}
QUICK_DEFAULTS = {"k": (5, 10), "w": (0, 5), "users": (1, 2), "conversations": 1, "max_questions": 6,
                  "requests_per_user": 2}


class FactWithWindow(NamedTuple):
    """One memory fact as the backend receives it: KV mode encodes `window` (rendered turns, oldest
    first) before `text` and keeps only the fact's tokens; prompt injection uses `text` alone."""
    fact_id: str
    text: str
    window: tuple[str, ...]


class Answer(NamedTuple):
    text: str
    ttft_s: float        # request start -> first token, as the engine measures it
    q2ft_s: float        # question arrival -> first token, retrieval included
    total_s: float       # question arrival -> last token
    retrieved_fact_ids: list[str]


@runtime_checkable
class AnswerBackend(Protocol):
    """What the runner needs from a serving system. `answer` may be called from several threads at
    once (the throughput phase); a backend that cannot serve concurrently must serialize itself."""

    def add_facts(self, user_id: str, facts_with_windows: Sequence[FactWithWindow]) -> None: ...

    def answer(self, user_id: str, question: str, k: int, mode: str) -> tuple[str, float, float, float, list[str]]: ...


class Judge(Protocol):
    def complete(self, prompt: str) -> str: ...


class BackendUnavailableError(RuntimeError):
    pass


class EngineBackend:
    """AnswerBackend over inferscale_core.engine.InjectingEngine (written separately).

    Expects the engine to offer the same two calls (add_facts / answer with mode "kv" or "pi"); this class
    only checks that contract and forwards, so the benchmark fails at start-up, not mid-run, if it does not."""

    def __init__(self, model: str | None = None):
        try:
            from inferscale_core.engine import InjectingEngine
        except ImportError as e:
            raise BackendUnavailableError(
                "the LoCoMo runner needs inferscale_core.engine.InjectingEngine (the vLLM KV-injection "
                f"engine), which cannot be imported: {e}") from e
        self.engine = InjectingEngine(model) if model else InjectingEngine()
        missing = [m for m in ("add_facts", "answer") if not callable(getattr(self.engine, m, None))]
        if missing:
            raise BackendUnavailableError(f"InjectingEngine lacks {missing}, which the LoCoMo runner calls")

    def add_facts(self, user_id, facts_with_windows):
        self.engine.add_facts(user_id, list(facts_with_windows))

    def answer(self, user_id, question, k, mode):
        return self.engine.answer(user_id, question, k, mode)


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
    max_questions: int | None = None      # per conversation, spread over categories; None = all answerable
    requests_per_user: int = 4            # throughput phase: sequential requests by each concurrent user
    throughput_k: int | None = None       # k for the throughput phase; None = the smallest k
    fact_dates: bool = True               # prefix facts with their session date
    judge_model: str | None = None
    seed: int = 0
    bootstrap_resamples: int = 10_000
    out: str = str(RESULTS_DIR)
    quick: bool = False
    warmup: bool = True


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


def memory_items(conv: Conversation, w: int, fact_dates: bool = True) -> list[FactWithWindow]:
    return [FactWithWindow(f.fact_id, f.render(with_date=fact_dates),
                           tuple(t.render() for t in window_turns(conv, f, w))) for f in conv.facts]


def _call(backend: AnswerBackend, conv: Conversation, uid: str, question: str, k: int, mode: str) -> tuple[Answer, float]:
    t0 = time.perf_counter()
    raw = backend.answer(uid, question, k, mode)
    wall = time.perf_counter() - t0
    ans = Answer(*raw)
    ids = list(ans.retrieved_fact_ids)
    if len(ids) > k:
        raise RuntimeError(f"backend returned {len(ids)} facts for k={k} (user {uid})")
    own = {f.fact_id for f in conv.facts}
    foreign = [i for i in ids if i not in own]
    if foreign:  # a user must never see another user's facts
        raise RuntimeError(f"backend returned facts that are not user {uid}'s: {foreign[:5]}")
    return ans._replace(retrieved_fact_ids=ids), wall


def evidence_recall(conv: Conversation, q: Question, fact_ids: Sequence[str]) -> float | None:
    """Share of the question's evidence turns covered by the retrieved facts' source turns
    (None when the question cites no turn of this conversation)."""
    evidence = [e for e in q.evidence if e in conv.turn_index]
    if not evidence:
        return None
    dia = conv.fact_dia_ids()
    covered = {d for i in fact_ids for d in dia[i]}
    return sum(e in covered for e in evidence) / len(evidence)


def run_benchmark(cfg: RunConfig, backend: AnswerBackend, judge: Judge | None = None, progress: bool = True) -> dict:
    if not isinstance(backend, AnswerBackend):
        raise TypeError(f"{type(backend).__name__} does not implement AnswerBackend (add_facts, answer)")
    if not cfg.k or not cfg.w or any(k <= 0 for k in cfg.k) or any(w < 0 for w in cfg.w):
        raise ValueError(f"need k > 0 and w >= 0, got k={cfg.k} w={cfg.w}")
    convs = load_locomo(cfg.data)[: cfg.conversations]
    selected = [(c, q) for c in convs for q in select_questions(c.questions, cfg.max_questions)]
    if not selected:
        raise ValueError(f"{cfg.data}: no answerable questions selected")

    encode = []
    for conv in tqdm(convs, desc="add facts", disable=not progress):
        for w in cfg.w:
            items = memory_items(conv, w, cfg.fact_dates)
            t0 = time.perf_counter()
            backend.add_facts(user_id(conv, w), items)
            encode.append({"sample_id": conv.sample_id, "w": w, "n_facts": len(items),
                           "add_facts_s": time.perf_counter() - t0})

    # Every (mode, k, w) configuration answers a question before the next question starts, so slow
    # phases of a shared machine hit both modes alike. Prompt injection does not depend on w.
    configs = [("kv", k, w) for k in cfg.k for w in cfg.w] + [("pi", k, None) for k in cfg.k]
    if cfg.warmup:
        conv, q = selected[0]
        for mode in MODES:
            backend.answer(user_id(conv, cfg.w[0]), q.question, cfg.k[0], mode)
    records = []
    for conv, q in tqdm(selected, desc=f"answer ({len(configs)} configs each)", disable=not progress):
        for mode, k, w in configs:
            uid = user_id(conv, w if mode == "kv" else cfg.w[0])
            ans, wall = _call(backend, conv, uid, q.question, k, mode)
            records.append({
                "qid": q.qid, "sample_id": conv.sample_id, "category": q.category, "mode": mode, "k": k, "w": w,
                "question": q.question, "gold": q.answer, "answer": ans.text,
                "f1": locomo_f1(ans.text, q.answer, q.category),
                "ttft_s": float(ans.ttft_s), "q2ft_s": float(ans.q2ft_s), "total_s": float(ans.total_s),
                "wall_s": wall, "retrieved_fact_ids": ans.retrieved_fact_ids,
                "evidence_recall": evidence_recall(conv, q, ans.retrieved_fact_ids),
                "judge": None, "judge_reply": None})

    if judge is not None:
        run_judge(judge, records, progress)
    throughput = run_throughput(cfg, backend, convs, selected, progress)
    return {"config": asdict(cfg), "dataset": _dataset_summary(cfg, convs, selected), "encode": encode,
            **aggregate(records, cfg, judged=judge is not None), "throughput": throughput, "records": records}


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


def run_throughput(cfg: RunConfig, backend: AnswerBackend, convs, selected, progress: bool = True) -> list[dict]:
    """For each user count n: n threads, thread i acting for conversation i mod #conversations, each sending
    requests_per_user questions back to back; throughput = requests / wall time of the whole batch."""
    k = cfg.throughput_k or min(cfg.k)
    w = cfg.w[0]
    by_conv = {c.sample_id: [q for cc, q in selected if cc is c] for c in convs}
    rows = []
    for n in tqdm(cfg.users, desc="throughput", disable=not progress):
        for mode in MODES:
            def user_loop(i: int) -> list[float]:
                conv = convs[i % len(convs)]
                qs = by_conv[conv.sample_id]
                lat = []
                for j in range(cfg.requests_per_user):
                    q = qs[(i + j) % len(qs)]
                    _, wall = _call(backend, conv, user_id(conv, w), q.question, k, mode)
                    lat.append(wall)
                return lat
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                latencies = [x for lat in pool.map(user_loop, range(n)) for x in lat]
            wall = time.perf_counter() - t0
            rows.append({"users": n, "mode": mode, "k": k, "w": w if mode == "kv" else None,
                         "requests": len(latencies), "wall_s": wall, "req_per_s": len(latencies) / wall,
                         "latency_s": summarize(latencies)})
    return rows


def aggregate(records: list[dict], cfg: RunConfig, judged: bool) -> dict:
    accuracy, latency, comparisons = [], [], []
    for (mode, k, w), rs in group_by(records, "mode", "k", "w").items():
        accuracy.append({"mode": mode, "k": k, "w": w, "n": len(rs),
                         "f1": by_category(rs, lambda r: r["f1"]),
                         "judge": by_category(rs, lambda r: None if r["judge"] is None else float(r["judge"]))
                         if judged else None,
                         "evidence_recall": summarize(r["evidence_recall"] for r in rs)["mean"]})
        latency.append({"mode": mode, "k": k, "w": w,
                        **{m: summarize(r[m] for r in rs) for m in ("ttft_s", "q2ft_s", "total_s", "wall_s")}})
    # KV (k, w) against PI at the same k, paired by question.
    pi = {(r["qid"], r["k"]): r for r in records if r["mode"] == "pi"}
    for k in cfg.k:
        for w in cfg.w:
            pairs = [(r, pi[(r["qid"], k)]) for r in records
                     if r["mode"] == "kv" and r["k"] == k and r["w"] == w and (r["qid"], k) in pi]
            if not pairs:
                continue
            row = {"k": k, "w": w, "n": len(pairs), "f1": _paired(pairs, "f1", cfg), "f1_by_category": {},
                   "judge": None}
            for cat in sorted({a["category"] for a, _ in pairs}):
                row["f1_by_category"][str(cat)] = _paired([p for p in pairs if p[0]["category"] == cat], "f1", cfg)
            if judged:
                jp = [(a, b) for a, b in pairs if a["judge"] is not None and b["judge"] is not None]
                row["judge"] = _paired(jp, "judge", cfg) if jp else None
            for m in ("ttft_s", "q2ft_s", "total_s"):
                row[m] = _paired(pairs, m, cfg)
            comparisons.append(row)
    return {"accuracy": accuracy, "latency": latency, "comparisons": comparisons}


def _paired(pairs: list[tuple[dict, dict]], key: str, cfg: RunConfig) -> dict:
    """Bootstrap interval of mean(kv[key] - pi[key]) over (kv, pi) record pairs."""
    return paired_bootstrap([float(a[key]) for a, _ in pairs], [float(b[key]) for _, b in pairs],
                            n_resamples=cfg.bootstrap_resamples, seed=cfg.seed)


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


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    default = default_data_path()
    p.add_argument("--data", default=str(default) if default else None, required=default is None,
                   help="LoCoMo-format JSON (default: ../shared/data/locomo_dev.json when present)")
    p.add_argument("--model", default=None, help="model folder for the engine (default: the engine's default)")
    p.add_argument("--k", type=_int_list, help="facts retrieved per question (default 5,10,20,50; quick 5,10)")
    p.add_argument("--w", type=_int_list, help="window turns encoded with each fact (default 0,5,20,50; quick 0,5)")
    p.add_argument("--users", type=_int_list, help="concurrent users in the throughput phase (default 1,2,4,8)")
    p.add_argument("--conversations", type=int, help="use only the first N conversations")
    p.add_argument("--max-questions", type=int, help="questions per conversation (spread over categories)")
    p.add_argument("--requests-per-user", type=int, help="throughput phase: requests per concurrent user")
    p.add_argument("--throughput-k", type=int, help="k in the throughput phase (default: smallest k)")
    p.add_argument("--no-fact-dates", action="store_true", help="do not prefix facts with their session date")
    p.add_argument("--quick", action="store_true",
                   help="minutes on 2 CPU cores: 1 conversation, 6 questions, k 5,10, w 0,5, users 1,2")
    p.add_argument("--judge-model", help="model folder for the LLM judge, or 'default' (SmolLM2); omit to skip")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder (default bench/results)")
    a = p.parse_args(argv)
    d = QUICK_DEFAULTS if a.quick else {**FULL_DEFAULTS, "conversations": None, "max_questions": None,
                                        "requests_per_user": 4}
    pick = lambda v, key: v if v is not None else d[key]
    return RunConfig(data=a.data, model=a.model, k=pick(a.k, "k"), w=pick(a.w, "w"), users=pick(a.users, "users"),
                     conversations=pick(a.conversations, "conversations"),
                     max_questions=pick(a.max_questions, "max_questions"),
                     requests_per_user=pick(a.requests_per_user, "requests_per_user"), throughput_k=a.throughput_k,
                     fact_dates=not a.no_fact_dates, judge_model=a.judge_model, seed=a.seed,
                     bootstrap_resamples=a.bootstrap, out=a.out, quick=a.quick)


def main(argv: Sequence[str] | None = None, backend: AnswerBackend | None = None, judge: Judge | None = None) -> dict:
    cfg = parse_args(argv)
    load_locomo(cfg.data)  # a bad data file fails here, before an engine is started
    if backend is None:
        backend = EngineBackend(cfg.model)
    if judge is None and cfg.judge_model:
        judge = TransformersJudge(cfg.judge_model)
    results = run_benchmark(cfg, backend, judge)
    paths = report.write_report(results, cfg.out)
    for path in paths:
        print(path)
    return results


if __name__ == "__main__":
    try:
        main()
    except (BackendUnavailableError, FileNotFoundError, ValueError) as e:  # LocomoFormatError is a ValueError
        sys.exit(f"error: {e}")
