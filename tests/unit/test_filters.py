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
