"""Mem0's filter language over a user's facts: what Search, ListMemories and the Mem0 HTTP API
(services/gateway/mem0_http.py) accept as `filters`, compiled once into a predicate on a FactRecord.

    {"agent_id": "travel-bot"}                                  a field equals a value
    {"AND": [{"run_id": "s1"}, {"metadata": {"topic": "food"}}]}  AND / OR / NOT take a list of filters
    {"created_at": {"gte": "2026-01-01"}, "lang": {"in": ["de", "fr"]}}

A filter object's keys are ANDed. Keys: `user_id` (only the caller's own, and only at the top or in a top-level
AND: it never widens a request to another user), the scope fields `agent_id`, `run_id`, `app_id` (stored in the
fact's metadata under those names, as Mem0 names them), `created_at` / `updated_at` (unix seconds or an ISO-8601
date), `metadata` (an object of metadata key -> condition); any other key is a metadata key (as in Mem0's open
source Memory). A condition is a value (equality) or {operator: value}: eq, ne, in, nin, gt, gte, lt, lte,
contains, icontains, or "*" for "present". Anything else is INVALID_ARGUMENT naming where it is.

One size limit on every path (the gRPC field's JSON text, a Mem0 HTTP body's object): at most MAX_NODES keys and
list items together and MAX_FILTER_BYTES characters of keys and values, counted while compiling and refused
(RESOURCE_EXHAUSTED) at the first one over, so a filter costs the same bounded work per fact whichever door
it came through; `in` / `nin` test a set.

A compiled filter (Filter) says what it costs to evaluate on one fact: its conditions (keys and operators, each a
Python call per fact; an `in` list's items are one set lookup, not counted) and, of those, its text conditions
(`contains` / `icontains`, a walk of the fact's metadata value, up to the door's max_metadata_value_chars). The
gateway's work budget charges a scan by them (services/gateway/work_budget.py scan_units).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from . import validation
from .auth import permission_denied
from .errors import invalid, too_big
from .registry import FactRecord

SCOPE_FIELDS = ("agent_id", "run_id", "app_id")  # Mem0's scopes below a user, kept in the fact's metadata
TIME_FIELDS = ("created_at", "updated_at")
LOGICAL = ("AND", "OR", "NOT")
OPERATORS = ("eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "contains", "icontains")
MAX_DEPTH = 8      # nesting of AND/OR/NOT
MAX_NODES = 256    # keys and list items in one filter (an `in` list's values count one each)
MAX_FILTER_BYTES = 16 << 10  # characters: of the JSON text (gRPC), of keys and string values (any path)

Predicate = Callable[[FactRecord], bool]


@dataclass(frozen=True)
class Filter:
    """A compiled filter: called on a record, whether it matches; and what one evaluation costs at most, in the
    terms work_budget.scan_units weighs (both bounded by MAX_NODES, whatever the filter)."""
    test: Predicate
    conditions: int       # keys and operators: each evaluated (a Python call) per fact at most
    text_conditions: int  # of those, contains / icontains: each walks the fact's metadata value

    def __call__(self, record: FactRecord) -> bool:
        return self.test(record)


def parse_json(text: str, name: str = "filters") -> dict | None:
    """A filter sent as JSON text (the gRPC field); "" means none."""
    if not text:
        return None
    if len(text) > MAX_FILTER_BYTES:
        raise too_big(f"{name} is {len(text)} characters, the limit is {MAX_FILTER_BYTES}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"{name} is not JSON ({e})") from None


def scope_metadata(**scopes: str | None) -> dict[str, str]:
    """Mem0 scope fields (agent_id, run_id, app_id) of a write, validated like ids, as the fact metadata that
    holds them; empty or None ones are left out."""
    out = {}
    for name, value in scopes.items():
        if name not in SCOPE_FIELDS:
            raise ValueError(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise invalid(f"{name} must be a string")
        out[name] = validation.user_id(value, name)  # the same rules as ids: bounded, printable
    return out


def request_filter(filters, owner: str, agent_id: str = "", run_id: str = "") -> Filter | None:
    """A request's filter and its scope fields (agent_id / run_id, "" = any) as one predicate, or None."""
    scope = scope_metadata(agent_id=agent_id, run_id=run_id)
    if scope:
        filters = {"AND": [scope, filters]} if filters else scope
    return compile_filter(filters, owner)


def compile_filter(filters, owner: str, name: str = "filters") -> Filter | None:
    """The compiled `filters` (None: no filter). `owner` is the user the request acts for: a `user_id`
    in the filter must name that user."""
    if filters is None or filters == {}:
        return None
    size = _Size(name)
    test = _compile(filters, owner, name, 0, size, top=True)
    return Filter(test, size.conditions, size.text_conditions)


class _Size:
    """What a filter has cost so far: nodes (keys and list items) and characters (keys and string values), the
    limits; and of the nodes, the conditions evaluated per fact (all but list items) and the text conditions."""

    def __init__(self, name: str):
        self.name, self.nodes, self.chars = name, 0, 0
        self.conditions = self.text_conditions = 0

    def node(self, where: str, item: bool = False) -> None:
        self.nodes += 1
        self.conditions += not item
        if self.nodes > MAX_NODES:
            raise too_big(f"{self.name} has more than {MAX_NODES} conditions and list items (at {where[:80]})")

    def text(self, value) -> None:
        if isinstance(value, str):
            self.chars += len(value)
            if self.chars > MAX_FILTER_BYTES:
                raise too_big(f"{self.name} holds more than {MAX_FILTER_BYTES} characters of keys and values")


def user_of(filters) -> str | None:
    """The `user_id` a filter names at its top or in a top-level AND (Mem0 clients put it there), else None."""
    if not isinstance(filters, dict):
        return None
    found = [filters["user_id"]] if "user_id" in filters else []
    for sub in filters.get("AND") or []:
        if isinstance(sub, dict) and "user_id" in sub:
            found.append(sub["user_id"])
    if len({json.dumps(f, sort_keys=True) for f in found}) > 1:
        raise invalid("filters name more than one user_id")
    if found and not isinstance(found[0], str):
        raise invalid("filters.user_id must be a string: the one user the request acts for")
    return found[0] if found else None


def _compile(f, owner: str, where: str, depth: int, size: _Size, top: bool = False) -> Predicate:
    if depth > MAX_DEPTH:
        raise invalid(f"{where} nests AND/OR/NOT deeper than {MAX_DEPTH} levels")
    if not isinstance(f, dict) or not f:
        raise invalid(f"{where} must be a non-empty object of conditions")
    preds = []
    for key, cond in f.items():
        at = f"{where}.{key}"
        size.node(at)
        size.text(key)
        if key in LOGICAL:
            if not isinstance(cond, list) or not cond:
                raise invalid(f"{at} must be a non-empty list of filter objects")
            subs = [_compile(c, owner, f"{at}[{i}]", depth + 1, size, top=top and key == "AND")
                    for i, c in enumerate(cond)]
            preds.append(_logical(key, subs))
        elif key == "user_id":
            if not top:
                raise invalid(f"{at}: user_id may only be named at the top of the filter or in a top-level AND "
                              "(a request acts for one user)")
            if cond != owner:
                raise permission_denied(f"{at} names another user than the one this request acts for")
        elif key == "metadata":
            if not isinstance(cond, dict) or not cond:
                raise invalid(f"{at} must be a non-empty object of metadata key -> condition")
            for mkey, mcond in cond.items():
                size.node(f"{at}.{mkey}")
                size.text(mkey)
                preds.append(_field(lambda r, k=mkey: r.metadata.get(k), mcond, f"{at}.{mkey}", False, size))
        elif key in TIME_FIELDS:
            preds.append(_field(lambda r, k=key: getattr(r, k), cond, at, True, size))
        elif key in ("categories", "keywords", "memory", "text", "id", "hash"):
            raise invalid(f"{at}: filtering on {key!r} is not supported (scope fields, created_at, updated_at "
                          "and metadata are)")
        else:  # a scope field or any other metadata key
            preds.append(_field(lambda r, k=key: r.metadata.get(k), cond, at, False, size))
    return _all(preds)


def _logical(op: str, subs: list[Predicate]) -> Predicate:
    if op == "AND":
        return _all(subs)
    if op == "OR":
        return _any(subs)
    either = _any(subs)
    return lambda r: not either(r)  # NOT [a, b]: neither a nor b


# A compiled filter runs once per fact for every condition it holds: a scan of 1,000 facts under the largest filter is
# ~127,000 conditions, on the gateway's cores. So the combinators below add no call that the tree does not need (a
# single condition is itself, not wrapped) and loop instead of building a generator per call: that scan's matching took
# ~3x less time than with all(p(r) for p in preds) at every level (285 -> 97 ms, medians of 11, one session, 2 cores).
# They short-circuit exactly as all() and any() do (tests/unit/test_filters.py checks the answers against a plain
# reading of the language on random filters).
def _all(preds: list[Callable]) -> Callable:
    if not preds:
        return lambda x: True
    if len(preds) == 1:
        return preds[0]

    def every(x) -> bool:
        for p in preds:
            if not p(x):
                return False
        return True
    return every


def _any(preds: list[Callable]) -> Callable:
    if len(preds) == 1:
        return preds[0]

    def some(x) -> bool:
        for p in preds:
            if p(x):
                return True
        return False
    return some


def _field(get, cond, where: str, is_time: bool, size: _Size) -> Predicate:
    """One field's condition: a value (equality), "*" (present), or {operator: value, ...} (ANDed)."""
    size.text(cond)
    if cond == "*":
        return lambda r: get(r) is not None
    if not isinstance(cond, dict):
        want = _time(cond, where) if is_time else _scalar(cond, where)
        return lambda r: get(r) == want
    if not cond:
        raise invalid(f"{where} has an empty condition object")
    checks = []
    for op, value in cond.items():
        if op not in OPERATORS:
            raise invalid(f"{where}: unknown operator {str(op)[:40]!r}; use one of {', '.join(OPERATORS)} or \"*\"")
        size.node(f"{where}.{op}")
        size.text(op)
        checks.append(_op(op, value, f"{where}.{op}", is_time, size))
    check = _all(checks)
    return lambda r: check(get(r))


def _op(op: str, value, where: str, is_time: bool, size: _Size):
    conv = (lambda v, w: _time(v, w)) if is_time else _scalar
    if op in ("in", "nin"):
        if not isinstance(value, list):
            raise invalid(f"{where} must be a list")
        for i, v in enumerate(value):  # counted before anything is converted
            size.node(f"{where}[{i}]", item=True)
            size.text(v)
        values = frozenset(conv(v, f"{where}[{i}]") for i, v in enumerate(value))  # scalars: all hashable
        return (lambda x: _member(x, values)) if op == "in" else (lambda x: not _member(x, values))
    size.text(value)
    if op in ("contains", "icontains"):
        if is_time or not isinstance(value, str):
            raise invalid(f"{where} must be a string (and applies to text metadata)")
        low = value.lower()
        size.text_conditions += 1
        if op == "contains":
            return lambda x: (value in x) if isinstance(x, (str, list)) else False

        def icontains(x) -> bool:  # a text holds it, or a list has it as an element, case aside
            if isinstance(x, str):
                return low in x.lower()
            if isinstance(x, list):
                for e in x:
                    if isinstance(e, str) and e.lower() == low:
                        return True
            return False
        return icontains
    v = conv(value, where)
    if op == "eq":
        return lambda x: x == v
    if op == "ne":
        return lambda x: x != v
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise invalid(f"{where} must be a number or a string")
    cmp = {"gt": lambda a, b: a > b, "gte": lambda a, b: a >= b, "lt": lambda a, b: a < b,
           "lte": lambda a, b: a <= b}[op]
    number = isinstance(v, (int, float))

    def check(x):  # a number compares with numbers, a string with strings; anything else does not match
        if number:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and cmp(x, v)
        return isinstance(x, str) and cmp(x, v)
    return check


def _member(x, values: frozenset) -> bool:
    """`x in values` as a list would answer it: a value that cannot be hashed (a list in the metadata) equals no
    scalar."""
    try:
        return x in values
    except TypeError:
        return False


def _scalar(v, where: str):
    if isinstance(v, (dict, list)):
        raise invalid(f"{where} must be a string, number, boolean or null, or an {{operator: value}} object")
    return v


def _time(v, where: str) -> float:
    """Unix seconds, or an ISO-8601 date / date-time (UTC when it names no zone)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            t = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    raise invalid(f"{where} must be unix seconds or an ISO-8601 date, got {str(v)[:40]!r}")
