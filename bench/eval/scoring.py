"""Answer scoring: LoCoMo's token F1 with its per-category rules, and a binary LLM-judge prompt.

Token F1 follows LoCoMo's released evaluation (snap-research/locomo, task_eval/evaluation.py,
`eval_question_answering`), which differs from plain SQuAD F1 in three ways, reproduced here:
  * normalization: remove commas, lowercase, strip ASCII punctuation, drop the words a / an / the
    and also "and", collapse whitespace;
  * every token is Porter-stemmed (NLTK's PorterStemmer; see stem.py);
  * per-category rules:
      1 multi-hop:   the gold answer and the prediction are split on ','; for each gold part take the best
                     F1 over prediction parts; the score is the mean over gold parts;
      2 temporal, 4 single-hop: plain token F1;
      3 open-domain: only the gold answer's first ';'-separated alternative is used, then token F1;
      5 adversarial: 1 if the prediction contains "no information available" or "not mentioned", else 0
                     (kept for completeness; category 5 is excluded from accuracy).
If no token is shared the F1 is 0 (also when either side is empty), as in LoCoMo.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter

from .stem import porter_stem

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")


def normalize_answer(text: str) -> str:
    text = text.replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_tokens(text: str) -> list[str]:
    return [porter_stem(w) for w in normalize_answer(text).split()]


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = answer_tokens(prediction), answer_tokens(gold)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, gold: str) -> float:
    """Category 1: mean over ','-separated gold parts of the best F1 against any prediction part."""
    preds = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return sum(max(token_f1(p, g) for p in preds) for g in golds) / len(golds)


def adversarial_score(prediction: str) -> float:
    low = prediction.lower()
    return 1.0 if ("no information available" in low or "not mentioned" in low) else 0.0


def locomo_f1(prediction: str, gold: str | None, category: int) -> float:
    """LoCoMo's score for one answer, by category (see the module docstring)."""
    if category == 5:
        return adversarial_score(prediction)
    if gold is None:
        raise ValueError(f"category {category} needs a gold answer")
    if category == 1:
        return multi_answer_f1(prediction, gold)
    if category == 3:
        return token_f1(prediction, gold.split(";")[0].strip())
    if category in (2, 4):
        return token_f1(prediction, gold)
    raise ValueError(f"unknown LoCoMo category {category} (expected 1-5)")


# The judge sees the question, the gold answer and the generated answer and must reply with one word.
# It is lenient on wording, length and date formats and strict on the fact itself; "I don't know"-style
# answers are WRONG for answerable questions. The reply is parsed by parse_judge_reply.
JUDGE_PROMPT = """You are grading one answer from a question-answering system about a long conversation between two people.

Question: {question}
Gold answer: {gold}
Generated answer: {answer}

Decide whether the generated answer is CORRECT or WRONG.
- CORRECT: it gives the same fact as the gold answer. It may be longer, worded differently, or give a date or time in another format or relative form, as long as it refers to the same thing, date or period.
- WRONG: it contradicts the gold answer, misses its key information, names a different thing, date or person, or says the information is not available.

Reply with exactly one word: CORRECT or WRONG."""

_VERDICT = re.compile(r"\b(correct|incorrect|wrong)\b", re.IGNORECASE)
_ECHOED_OPTIONS = re.compile(r"\bcorrect\s+or\s+wrong\b", re.IGNORECASE)


def judge_prompt(question: str, gold: str, answer: str) -> str:
    return JUDGE_PROMPT.format(question=question, gold=gold, answer=answer.strip() or "(empty)")


def parse_judge_reply(reply: str) -> bool | None:
    """True for CORRECT, False for WRONG (or INCORRECT), None when the reply holds no verdict.

    Accepts a bare word in any case, surrounding text, or JSON such as {"label": "CORRECT"}; the first
    verdict word decides (judges sometimes explain after answering); an echo of the options
    "CORRECT or WRONG" is ignored."""
    text = reply.strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            for key in ("label", "verdict", "answer", "result"):
                if isinstance(obj.get(key), str):
                    text = obj[key]
                    break
    except (json.JSONDecodeError, ValueError):
        pass
    # A judge that echoes the instruction ("CORRECT or WRONG") has not answered by that echo.
    m = _VERDICT.search(_ECHOED_OPTIONS.sub(" ", text))
    if m is None:
        return None
    return m.group(1).lower() == "correct"
