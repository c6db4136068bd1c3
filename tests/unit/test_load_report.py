"""The kv_load hop's plumbing without an engine: the connector's scheduler side times each asynchronous load of a
request (grant -> the worker's report of its end) on vLLM's clock and returns it from request_finished as a
LoadReport (kv_transfer_params, which vLLM puts on the request's last RequestOutput); the engine replica's
engine_timings turns it into `kv_load` and keeps it out of vLLM's own `vllm_queue` and `prefill`.

The scheduler side gets real vLLM Requests; the step loop that calls it is vLLM's and runs in
tests/engine/test_connector_async.py (a slow cluster read timed end to end)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from inferscale_core.connector_scheduler import SchedulerSide
from inferscale_core.connector_types import (
    LOAD_REPORT_KEY,
    InjectionParams,
    InjectionWorkerMetadata,
    LoadReport,
    memory_hash,
)
from inferscale_server.engine_replica.engine import engine_timings

PROMPT = list(range(1, 101))
M = 64


def request(req_id: str, fetch: bool = True):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = InjectionParams("alice", ("prefix", "f1", "f2"), M, memory_hash(PROMPT[:M]), fetch=fetch)
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params.to_kv_transfer_params()})
    return Request(req_id, list(PROMPT), sp, None)


def grant(side: SchedulerSide, req) -> int:
    n, load_async = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, [0, 1, 2, 3], n)
    return n if load_async else 0


def test_an_asynchronous_load_is_timed_from_its_grant_to_its_reported_end():
    side = SchedulerSide(None, None)
    req = request("r1")
    t0 = time.monotonic()
    assert grant(side, req) == M
    meta = side.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[],
                                                     scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
    assert [load.fetch for load in meta.loads] == [True]  # handed to the worker's loader in this step
    time.sleep(0.2)
    side.loads_ended([], [])  # a step that ended no load
    side.loads_ended(["r1"], [], {"r1": {"facts_from": {"cluster": 1, "device": 1}, "cluster_bytes": 4096,
                                         "read_s": 0.15}})
    t1 = time.monotonic()
    params = side.request_finished(req)
    report = LoadReport.from_kv_transfer_params(params)
    assert report is not None and len(report.spans) == 1
    granted, loaded = report.spans[0]
    assert t0 <= granted < loaded <= t1  # time.monotonic(): the clock of vLLM's queued_ts / scheduled_ts
    assert 0.2 <= report.seconds <= t1 - t0
    assert report.facts_from == {"cluster": 1, "device": 1} and report.cluster_bytes == 4096
    assert report.read_s == 0.15 and report.failed == 0
    assert side.request_finished(req) is None  # forgotten with the request


def test_a_request_without_an_asynchronous_load_reports_none():
    side = SchedulerSide(None, None)
    sync = request("sync", fetch=False)
    assert grant(side, sync) == 0  # granted, but loaded in the step that schedules it: part of prefill
    side.loads_ended(["sync"], [])  # a stray report for it changes nothing
    assert side.request_finished(sync) is None


def test_a_load_again_after_preemption_adds_a_span_and_a_failed_load_counts():
    side = SchedulerSide(None, None)
    req = request("r2")
    grant(side, req)
    side.loads_ended(["r2"], ["r2"])  # failed: in both sets, as vLLM asks
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # granted nothing more until it finishes
    side.request_finished(req)
    req = request("r3")
    grant(side, req)
    side.loads_ended(["r3"], [], {"r3": {"facts_from": {"cluster": 2}, "cluster_bytes": 10, "read_s": 0.01}})
    grant(side, req)  # preempted after its load, granted again
    side.loads_ended(["r3"], [], {"r3": {"facts_from": {"device": 2}, "cluster_bytes": 0, "read_s": 0.0}})
    report = LoadReport.from_kv_transfer_params(side.request_finished(req))
    assert report is not None and len(report.spans) == 2 and report.spans[0][1] <= report.spans[1][0]
    assert report.facts_from == {"cluster": 2, "device": 2} and report.cluster_bytes == 10
    failed = request("r4")
    grant(side, failed)
    side.loads_ended(["r4"], ["r4"])
    assert LoadReport.from_kv_transfer_params(side.request_finished(failed)).failed == 1


def test_a_request_finished_while_its_load_is_in_flight_reports_nothing():
    side = SchedulerSide(None, None)
    req = request("r5")
    grant(side, req)
    assert side.request_finished(req) is None  # aborted: no output carries it
    side.loads_ended(["r5"], [])  # the worker's late report of the aborted load is ignored
    assert side.request_finished(req) is None


def test_worker_metadata_of_several_steps_aggregates():
    a = InjectionWorkerMetadata({"r1": {"facts_from": {"cluster": 1}}})
    assert a.aggregate(InjectionWorkerMetadata({"r2": {"facts_from": {"host": 3}}})).loads.keys() == {"r1", "r2"}


def stats(queued: float, scheduled: float, first: float):
    return SimpleNamespace(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first)


def test_engine_timings_take_the_load_out_of_vllm_queue_and_prefill():
    """vLLM records SCHEDULED only after the asynchronous load (Scheduler.schedule parks the request first):
    queued 100.0 -> scheduled 103.0 holds a 2.5 s load; a second load after a preemption (0.5 s) lies inside
    scheduled -> first token."""
    load = LoadReport(((100.2, 102.7), (103.4, 103.9)), facts_from={"cluster": 50}, cluster_bytes=10**6, read_s=2.0)
    t = engine_timings(SimpleNamespace(ttft_s=4.5, engine_stats=stats(100.0, 103.0, 104.2), kv_load=load))
    assert t == {"engine_ttft": 4500.0, "kv_load": 3000.0, "kv_load_read": 2000.0, "vllm_queue": 500.0,
                 "prefill": 700.0}
    # Without a load (warm facts, or a prompt-injection request): vLLM's hops as vLLM measures them.
    plain = engine_timings(SimpleNamespace(ttft_s=1.0, engine_stats=stats(100.0, 100.25, 100.75), kv_load=None))
    assert plain == {"engine_ttft": 1000.0, "vllm_queue": 250.0, "prefill": 500.0}
    # An answer built before this field existed (a test double's) still has vLLM's hops.
    assert engine_timings(SimpleNamespace(ttft_s=1.0, engine_stats=None)) == {"engine_ttft": 1000.0}
    # A load that read nothing from the cluster tier has no kv_load_read.
    warm = LoadReport(((100.0, 100.01),), facts_from={"device": 3})
    assert "kv_load_read" not in engine_timings(SimpleNamespace(ttft_s=0.1, engine_stats=None, kv_load=warm))


@pytest.mark.parametrize("bad", [
    {"spans": []},
    {"spans": [[2.0, 1.0]]},
    {"spans": [[1.0]]},
    {"spans": [[1.0, 2.0]], "failed": -1},
    {"spans": [[1.0, 2.0]], "facts_from": {"moon": 1}},
    {"spans": [[1.0, 2.0]], "read_s": "slow"},
    "not a dict",
])
def test_a_malformed_report_is_refused_with_its_reason(bad):
    with pytest.raises(ValueError):
        LoadReport.from_kv_transfer_params({LOAD_REPORT_KEY: bad})


def test_a_report_round_trips_and_other_connectors_keys_are_not_ours():
    report = LoadReport(((1.0, 2.5),), 1, {"cluster": 2, "disk": 1}, 123, 0.5)
    assert LoadReport.from_kv_transfer_params(report.to_kv_transfer_params()) == report
    assert LoadReport.from_kv_transfer_params({"do_remote_prefill": True}) is None
    assert LoadReport.from_kv_transfer_params(None) is None
    assert report.within(0.0, 2.0) == 1.0 and report.within(3.0, 4.0) == 0.0
