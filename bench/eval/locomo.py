"""LoCoMo dataset loading: conversations, memory facts with their source turn, and questions.

Format (the original `locomo10.json`, see ../shared/README.md): a JSON list of samples, each with
`sample_id`, `conversation` (speaker_a, speaker_b, session_N = list of turns {speaker, dia_id, text,
optional blip_caption}, session_N_date_time), `qa` (question, answer or adversarial_answer, evidence,
category) and `observation` (session_N_observation = {speaker: [[fact, dia_id], ...]}).

Structural problems (missing keys, wrong types, duplicate dia_ids) raise LocomoFormatError naming the
sample and the field. Known quirks of the real data are tolerated explicitly: a fact's dia_id may be a
list or a "D1:2, D1:4" string, an evidence entry may be "D8:6; D9:17" or "D:11:26", and a few evidence
ids point to turns that do not exist (kept as given; they simply never match a retrieved fact).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
ANSWERABLE_CATEGORIES = (1, 2, 3, 4)

_SESSION_KEY = re.compile(r"session_(\d+)")
_DIA_ID = re.compile(r"D:?(\d+):(\d+)")  # "D:11:26" is a typo for "D11:26" in the real data


class LocomoFormatError(ValueError):
    """The file is not in LoCoMo's format; the message names the file, sample and field."""


@dataclass(frozen=True)
class Turn:
    index: int          # position in the whole conversation (all sessions, in order)
    dia_id: str         # "D<session>:<n>"
    session: int
    date_time: str      # the session's date, e.g. "1:56 pm on 8 May, 2023"
    speaker: str
    text: str
    blip_caption: str | None = None  # caption of a shared photo, when the turn has one

    def render(self) -> str:
        """The turn as a memory window line: "[1:56 pm on 8 May, 2023] Caroline: text"."""
        line = f"[{self.date_time}] {self.speaker}: {self.text}"
        if self.blip_caption:
            line += f" [shares a photo: {self.blip_caption}]"
        return line


@dataclass(frozen=True)
class Fact:
    fact_id: str                # "<sample_id>:s<session>:<speaker>:<j>", stable for a given file
    text: str
    speaker: str
    session: int
    date_time: str              # the session's date
    dia_ids: tuple[str, ...]    # the turns the fact was extracted from
    turn_index: int             # index of the LAST of those turns: the fact is known from there on

    def render(self, with_date: bool = True) -> str:
        """The fact as memory text; with its session date, which temporal questions need."""
        return f"[{self.date_time}] {self.text}" if with_date else self.text


@dataclass(frozen=True)
class Question:
    qid: str                    # "<sample_id>:q<n>", n = position in the sample's qa list
    sample_id: str
    question: str
    category: int
    answer: str | None          # stringified; None only for adversarial questions without one
    adversarial_answer: str | None
    evidence: tuple[str, ...]   # dia_ids, normalized

    @property
    def answerable(self) -> bool:
        return self.category in ANSWERABLE_CATEGORIES


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    speaker_a: str
    speaker_b: str
    turns: tuple[Turn, ...]
    facts: tuple[Fact, ...]
    questions: tuple[Question, ...]
    turn_index: dict[str, int] = field(repr=False, compare=False)  # dia_id -> Turn.index

    def turn(self, dia_id: str) -> Turn:
        return self.turns[self.turn_index[dia_id]]

    def fact_dia_ids(self) -> dict[str, tuple[str, ...]]:
        return {f.fact_id: f.dia_ids for f in self.facts}


def default_data_path() -> Path | None:
    """`../shared/data/locomo_dev.json` next to the repository, if it is there."""
    path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "locomo_dev.json"
    return path if path.is_file() else None


LOCOMO_SOURCE = "https://github.com/snap-research/locomo (file data/locomo10.json)"


def require_data_path(path) -> Path:
    """The LoCoMo file a benchmark reads; if it is missing, exit with one line saying where to get it."""
    if path is None or not Path(path).is_file():
        where = f" at {path}" if path else " (no --data given and no ../shared/data/locomo_dev.json)"
        raise SystemExit(f"LoCoMo data file not found{where}: download LoCoMo from {LOCOMO_SOURCE} "
                         f"and pass --data PATH")
    return Path(path)


def answerable(questions) -> list[Question]:
    """Questions of categories 1-4; category 5 (adversarial) is excluded from accuracy, as in the literature."""
    return [q for q in questions if q.answerable]


def window_turns(conversation: Conversation, fact: Fact, w: int) -> list[Turn]:
    """The w turns immediately before the fact's turn (fewer near the start), oldest first.

    The fact's own turn is not included: the window is the context that precedes it."""
    if w < 0:
        raise ValueError(f"window size must be >= 0, got {w}")
    t = fact.turn_index
    return list(conversation.turns[max(0, t - w):t])


def session_facts(conversation: Conversation, session: int) -> list[Fact]:
    """The facts of one session in the order they became known: by source turn, then file order."""
    position = {f.fact_id: i for i, f in enumerate(conversation.facts)}
    return sorted((f for f in conversation.facts if f.session == session),
                  key=lambda f: (f.turn_index, position[f.fact_id]))


def parse_dia_ids(value) -> tuple[str, ...]:
    """Normalize a dia_id field (a string, possibly "D1:2, D1:4" or "D8:6; D9:17", or a list) to ids."""
    parts = value if isinstance(value, list) else [value]
    ids: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise TypeError(f"dia_id must be a string or list of strings, got {part!r}")
        for session, n in _DIA_ID.findall(part):
            dia_id = f"D{int(session)}:{int(n)}"
            if dia_id not in ids:
                ids.append(dia_id)
    return tuple(ids)


def load_locomo(path: str | Path) -> list[Conversation]:
    """Load every conversation of a LoCoMo-format JSON file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoCoMo data file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LocomoFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, list) or not data:
        raise LocomoFormatError(f"{path}: expected a non-empty JSON list of samples, got {type(data).__name__}")
    conversations = []
    seen: set[str] = set()
    for i, sample in enumerate(data):
        conv = _parse_sample(path, i, sample)
        if conv.sample_id in seen:
            raise LocomoFormatError(f"{path}: duplicate sample_id {conv.sample_id!r}")
        seen.add(conv.sample_id)
        conversations.append(conv)
    return conversations


def _require(where: str, obj: dict, key: str, kind):
    if not isinstance(obj, dict):
        raise LocomoFormatError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise LocomoFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise LocomoFormatError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                                f"got {type(value).__name__}")
    return value


def _parse_sample(path: Path, i: int, sample) -> Conversation:
    where = f"{path}: sample {i}"
    sample_id = _require(where, sample, "sample_id", str)
    where = f"{path}: sample {sample_id!r}"
    conv = _require(where, sample, "conversation", dict)
    speaker_a = _require(f"{where}.conversation", conv, "speaker_a", str)
    speaker_b = _require(f"{where}.conversation", conv, "speaker_b", str)

    turns = _parse_turns(where, conv)
    turn_index = {t.dia_id: t.index for t in turns}
    facts = _parse_facts(where, sample_id, _require(where, sample, "observation", dict), turns, turn_index)
    questions = tuple(_parse_question(f"{where}.qa[{n}]", sample_id, n, qa)
                      for n, qa in enumerate(_require(where, sample, "qa", list)))
    return Conversation(sample_id, speaker_a, speaker_b, turns, facts, questions, turn_index)


def _parse_turns(where: str, conv: dict) -> tuple[Turn, ...]:
    # Sessions in numeric order; the real data has extra session_N_date_time keys without turns.
    sessions = sorted((int(m.group(1)), key) for key in conv if (m := _SESSION_KEY.fullmatch(key)))
    if not sessions:
        raise LocomoFormatError(f"{where}.conversation: no session_N lists")
    turns: list[Turn] = []
    seen: set[str] = set()
    for session, key in sessions:
        date_time = _require(f"{where}.conversation", conv, f"{key}_date_time", str)
        raw_turns = _require(f"{where}.conversation", conv, key, list)
        for j, raw in enumerate(raw_turns):
            tw = f"{where}.conversation.{key}[{j}]"
            dia_id = _require(tw, raw, "dia_id", str)
            if dia_id in seen:
                raise LocomoFormatError(f"{tw}: duplicate dia_id {dia_id!r}")
            seen.add(dia_id)
            caption = raw.get("blip_caption")
            turns.append(Turn(index=len(turns), dia_id=dia_id, session=session, date_time=date_time,
                              speaker=_require(tw, raw, "speaker", str), text=_require(tw, raw, "text", str),
                              blip_caption=caption if isinstance(caption, str) and caption else None))
    return tuple(turns)


def _parse_facts(where: str, sample_id: str, observation: dict, turns, turn_index) -> tuple[Fact, ...]:
    facts: list[Fact] = []
    keyed = []
    for key, per_speaker in observation.items():
        m = re.fullmatch(r"session_(\d+)_observation", key)
        if not m:
            raise LocomoFormatError(f"{where}.observation: unexpected key {key!r}")
        keyed.append((int(m.group(1)), key, per_speaker))
    for session, key, per_speaker in sorted(keyed):
        ow = f"{where}.observation.{key}"
        if not isinstance(per_speaker, dict):
            raise LocomoFormatError(f"{ow}: expected {{speaker: [[fact, dia_id], ...]}}")
        for speaker, entries in per_speaker.items():
            if not isinstance(entries, list):
                raise LocomoFormatError(f"{ow}.{speaker}: expected a list of [fact, dia_id]")
            for j, entry in enumerate(entries):
                ew = f"{ow}.{speaker}[{j}]"
                if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                    raise LocomoFormatError(f"{ew}: expected [fact text, dia_id], got {entry!r}")
                try:
                    dia_ids = parse_dia_ids(entry[1])
                except TypeError as e:
                    raise LocomoFormatError(f"{ew}: {e}") from e
                known = tuple(d for d in dia_ids if d in turn_index)
                if not known:
                    # A fact with no turn cannot be placed in the conversation; skip it loudly.
                    warnings.warn(f"{ew}: dia_id {entry[1]!r} matches no turn; fact skipped")
                    continue
                last = max(turn_index[d] for d in known)
                facts.append(Fact(fact_id=f"{sample_id}:s{session}:{speaker}:{j}", text=entry[0].strip(),
                                  speaker=speaker, session=session, date_time=turns[last].date_time,
                                  dia_ids=known, turn_index=last))
    return tuple(facts)


def _parse_question(where: str, sample_id: str, n: int, qa) -> Question:
    question = _require(where, qa, "question", str)
    category = _require(where, qa, "category", int)
    if category not in CATEGORY_NAMES:
        raise LocomoFormatError(f"{where}.category: expected 1-5, got {category}")
    answer = qa.get("answer")
    if answer is None and category in ANSWERABLE_CATEGORIES:
        raise LocomoFormatError(f"{where}: category {category} question has no 'answer'")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise LocomoFormatError(f"{where}.answer: expected a string or number, got {answer!r}")
    adversarial = qa.get("adversarial_answer")
    evidence = _require(where, qa, "evidence", list)
    try:
        evidence_ids = parse_dia_ids(evidence)
    except TypeError as e:
        raise LocomoFormatError(f"{where}.evidence: {e}") from e
    return Question(qid=f"{sample_id}:q{n}", sample_id=sample_id, question=question, category=category,
                    answer=None if answer is None else str(answer),  # some answers are ints (years)
                    adversarial_answer=None if adversarial is None else str(adversarial),
                    evidence=evidence_ids)
