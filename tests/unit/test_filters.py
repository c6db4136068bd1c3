"""Mem0's filter language (services/filters.py): one size limit on every path, counted before the work it bounds,
and `in` / `nin` on sets with a list's answers. No server: the HTTP door's use of it is in test_mem0_api.py."""
from __future__ import annotations

import json
import random
import time

import grpc
import pytest

from inferscale_server import filters
from inferscale_server.errors import ApiError
from inferscale_server.registry import FactRecord

OWNER = "alice"


def record(meta: dict, created_at: float = 1.7e9) -> FactRecord:
    return FactRecord(fact_id="f", user_id=OWNER, text="t", version=1, created_at=created_at, updated_at=created_at,
                      metadata=meta)


def refused(flt) -> ApiError:
    with pytest.raises(ApiError) as e:
        filters.compile_filter(flt, OWNER)
    return e.value


@pytest.mark.parametrize("door", ["object", "json text"])
def test_list_items_count_toward_the_node_limit_on_every_door(door):
    """A 100,000-value `in` list was one node; now each value is one, so both doors refuse it the same way, after
    counting at most MAX_NODES + 1 of its values."""
    at_limit = {"lang": {"in": [f"v{i}" for i in range(filters.MAX_NODES - 2)]}}  # key + operator + values
    huge = {"lang": {"in": [f"v{i}" for i in range(100_000)]}}

    def compiled(flt):
        if door == "object":
            return filters.compile_filter(flt, OWNER)
        text = json.dumps(flt)
        if len(text) > filters.MAX_FILTER_BYTES:  # the gRPC field's own limit comes first there
            with pytest.raises(ApiError) as e:
                filters.parse_json(text)
            raise e.value
        return filters.compile_filter(filters.parse_json(text), OWNER)

    assert compiled(at_limit)(record({"lang": "v3"}))
    t0 = time.perf_counter()
    with pytest.raises(ApiError) as e:
        compiled(huge)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(filters.MAX_NODES) in e.value.message or str(filters.MAX_FILTER_BYTES) in e.value.message
    assert time.perf_counter() - t0 < 1.0  # a bound against a regression to converting every value first
    over = {"lang": {"in": [f"v{i}" for i in range(filters.MAX_NODES - 1)]}}
    assert "more than 256 conditions and list items" in refused(over).message


def test_characters_count_on_the_object_path_too():
    """A Mem0 HTTP body's filter (already an object) is held to the gRPC field's 16 KiB: keys and values."""
    long_value = "x" * (filters.MAX_FILTER_BYTES + 1)
    for flt in ({"topic": long_value}, {"topic": {"eq": long_value}}, {"topic": {"in": [long_value]}},
                {long_value: "x"}, {"metadata": {long_value: "x"}},
                {"OR": [{"topic": "y" * 6000}, {"topic": "z" * 6000}, {"topic": "w" * 6000}]}):
        e = refused(flt)
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "16384 characters" in e.message, e.message
    assert filters.compile_filter({"topic": "y" * 16000}, OWNER)(record({"topic": "y" * 16000}))


def test_in_and_nin_on_a_set_answer_as_a_list_does():
    rng = random.Random(20261127)
    pool = [0, 1, 2, 1.0, 2.5, True, False, None, "a", "b", "1", "", ["a"], {"k": 1}]
    for _ in range(300):
        values = rng.sample([v for v in pool if not isinstance(v, (list, dict))], rng.randint(1, 6))
        x = rng.choice(pool)
        rec = record({"m": x})
        for op in ("in", "nin"):
            want = (x in values) if op == "in" else (x not in values)
            assert filters.compile_filter({"m": {op: values}}, OWNER)(rec) is want, (op, values, x)


def test_the_operator_and_structure_errors_still_name_where():
    assert "must be a list" in refused({"m": {"in": "a"}}).message
    assert "filters.m.in[1]" in refused({"m": {"in": ["a", {"x": 1}]}}).message
    assert "unknown operator" in refused({"m": {"between": [1, 2]}}).message
    deep = {"m": 1}
    for _ in range(filters.MAX_DEPTH + 1):
        deep = {"AND": [deep]}
    assert "deeper than" in refused(deep).message


def test_a_compiled_filter_says_its_conditions_and_text_conditions_which_list_items_are_not():
    """What work_budget.scan_units weighs a scan by: every key and operator is a condition evaluated per fact; an
    `in` / `nin` list's items are one set lookup, not conditions (they count toward MAX_NODES only); contains and
    icontains are text conditions too. Both are bounded by MAX_NODES whatever the filter."""
    flt = filters.compile_filter({"lang": {"in": [f"v{i}" for i in range(100)]}, "agent_id": "bot",
                                  "OR": [{"note": {"icontains": "tea"}}, {"metadata": {"tags": {"contains": "x"}}}]},
                                 OWNER)
    # lang, in | agent_id | OR, note, icontains, metadata, tags, contains
    assert flt is not None and (flt.conditions, flt.text_conditions) == (9, 2)
    assert flt(record({"lang": "v7", "agent_id": "bot", "note": "Green TEA"}))
    assert not flt(record({"lang": "v7", "agent_id": "bot", "note": "coffee"}))
    widest = filters.compile_filter({"OR": [{"note": {"icontains": f"z{i}"}} for i in range(127)]}, OWNER)
    assert widest is not None and (widest.conditions, widest.text_conditions) == (255, 127)
    assert filters.compile_filter({}, OWNER) is None


def _reference(f, r: FactRecord) -> bool:
    """The filter language read as the module's docstring states it, one node at a time (no compilation): what the
    compiled predicate, shaped for speed, must answer on every record."""
    def value(key, in_metadata):
        return getattr(r, key) if key in filters.TIME_FIELDS and not in_metadata else r.metadata.get(key)

    def when(v, is_time):
        return filters._time(v, "t") if is_time else v

    def op(name, want, x, is_time):
        if name in ("in", "nin"):
            try:
                hit = x in {when(v, is_time) for v in want}
            except TypeError:
                hit = False
            return hit if name == "in" else not hit
        if name == "contains":
            return isinstance(x, (str, list)) and want in x
        if name == "icontains":
            if isinstance(x, str):
                return want.lower() in x.lower()
            return isinstance(x, list) and any(isinstance(e, str) and e.lower() == want.lower() for e in x)
        want = when(want, is_time)
        if name == "eq":
            return x == want
        if name == "ne":
            return x != want
        if isinstance(want, (int, float)):
            ok = isinstance(x, (int, float)) and not isinstance(x, bool)
        else:
            ok = isinstance(x, str)
        return ok and {"gt": x > want, "gte": x >= want, "lt": x < want, "lte": x <= want}[name] if ok else False

    def field(key, cond, in_metadata):
        is_time = key in filters.TIME_FIELDS and not in_metadata
        x = value(key, in_metadata)
        if cond == "*":
            return x is not None
        if not isinstance(cond, dict):
            return x == when(cond, is_time)
        return all(op(name, want, x, is_time) for name, want in cond.items())

    def node(f):
        out = []
        for key, cond in f.items():
            if key == "AND":
                out.append(all(node(c) for c in cond))
            elif key == "OR":
                out.append(any(node(c) for c in cond))
            elif key == "NOT":
                out.append(not any(node(c) for c in cond))
            elif key == "user_id":
                out.append(True)
            elif key == "metadata":
                out.append(all(field(k, c, True) for k, c in cond.items()))
            else:
                out.append(field(key, cond, False))
        return all(out)
    return node(f)


def test_a_compiled_filter_answers_as_the_language_reads_on_random_filters_and_records():
    """The compiled predicate skips wrappers and generators for speed (a scan evaluates it ~127,000 times under the
    largest filter); on 2,000 random filters over 30 random records each it answers exactly as _reference reads the
    language, operators, nesting, empty AND lists' neighbours and all."""
    rng = random.Random(20261201)
    values = [0, 1, 2, 2.5, -1, True, False, None, "", "a", "b", "Tea", "green TEA", "tea",
              ["a", "Tea"], ["b"], ["green TEA"], []]
    keys = ["agent_id", "topic", "tags", "n"]

    def condition():
        kind = rng.random()
        if kind < 0.15:
            return "*"
        if kind < 0.35:
            return rng.choice([v for v in values if not isinstance(v, list)])
        ops = {}
        for name in rng.sample(filters.OPERATORS, rng.randint(1, 3)):
            if name in ("in", "nin"):
                ops[name] = rng.sample([v for v in values if not isinstance(v, list)], rng.randint(1, 4))
            elif name in ("contains", "icontains"):
                ops[name] = rng.choice(["a", "tea", "TEA", "b", "x"])
            elif name in ("gt", "gte", "lt", "lte"):
                ops[name] = rng.choice([0, 1, 2.5, "a", "b", "Tea"])
            else:
                ops[name] = rng.choice([v for v in values if not isinstance(v, list)])
        return ops

    def flt(depth=0):
        out = {}
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if depth < 3 and kind < 0.3:
                out[rng.choice(filters.LOGICAL)] = [flt(depth + 1) for _ in range(rng.randint(1, 3))]
            elif kind < 0.4:
                out["metadata"] = {rng.choice(keys): condition() for _ in range(rng.randint(1, 2))}
            elif kind < 0.5:
                out["created_at"] = {rng.choice(["gt", "gte", "lt", "lte"]): rng.choice([1.6e9, "2023-11-14", 1.7e9])}
            elif kind < 0.55 and depth == 0:
                out["user_id"] = OWNER
            else:
                out[rng.choice(keys)] = condition()
        return out

    recs = [record({k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 4))},
                   created_at=rng.choice([1.65e9, 1.7e9, 1.75e9])) for _ in range(30)]
    matched = 0
    for _ in range(2000):
        f = flt()
        compiled = filters.compile_filter(f, OWNER)
        for r in recs:
            want = _reference(f, r)
            assert compiled(r) is want, (f, r.metadata, r.created_at)
            matched += want
    assert 0.05 < matched / 60_000 < 0.95  # the random filters are neither all-true nor all-false
