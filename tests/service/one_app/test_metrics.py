"""Observability of the running service: the Prometheus endpoint of Ray's metrics agent (the node's metrics export
port, 127.0.0.1) is scraped after real traffic (gRPC and HTTP, several users) and must carry every deployment's
metrics, vLLM's own metrics from the engine replica and every metric the chart's Grafana dashboard reads, and no
user id anywhere. The app is the one this folder shares (tests/service/one_app/conftest.py; its metrics export port); that an
engine replica whose vLLM engine core dies fails Serve's health check and is replaced is test_service_e2e's.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.auth_fixture import token_for

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from dashboard_snapshot import DASHBOARD, dashboard_metrics

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

# Distinctive ids: none of them may appear anywhere in the scrape (labels or values).
USERS = {"metrics-user-7f3a9c": ["Ines grows tomatoes on her balcony.", "Ines plays the cello."],
         "metrics-user-b41d02": ["Tariq drives a green van.", "Tariq has two daughters."]}
ADDED_FACTS = sum(map(len, USERS.values()))
SCRAPE_TIMEOUT_S = 120  # Ray's agent exports every ~10 s; a loaded machine is slower


def _scrape(url: str) -> tuple[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=30).read().decode()  # noqa: S310 - a loopback URL built here
    return text, [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _has(samples, name: str, **labels) -> bool:
    return any(s.name == name and all(s.labels.get(k) == v for k, v in labels.items()) for s in samples)


def _value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_deployment_exports_metrics_without_user_ids(service):
    import httpx

    from inferscale_server.api import pb2, pb2_grpc

    for user, facts in USERS.items():  # AddFacts: encoder, retrieval, engine; then an answer per user, two ways
        service.client.add_facts(user, facts)
        service.ask(user, "What does this person play or drive?", k=2, max_tokens=4)
        r = httpx.post(f"http://127.0.0.1:{service.cfg.http_port}/v1/chat/completions", timeout=300,
                       headers={"authorization": f"Bearer {token_for(service.secret, user)}"},
                       json={"messages": [{"role": "user", "content": "What grows on the balcony?"}],
                             "max_completion_tokens": 4})
        assert r.status_code == 200, r.text
    with pytest.raises(grpc.RpcError):  # one refused call: counted with its status code
        pb2_grpc.MemoryStub(service.channel).Search(pb2.SearchRequest(user_id="metrics-user-7f3a9c", query="x"))
    want = [  # (metric as scraped, labels it must have a series with)
        ("ray_inferscale_requests_total", {"deployment": "Gateway", "rpc": "AddFacts", "code": "OK"}),
        ("ray_inferscale_requests_total", {"deployment": "Gateway", "rpc": "Answer", "code": "OK"}),
        ("ray_inferscale_requests_total", {"deployment": "Gateway", "rpc": "chat.completions", "code": "OK"}),
        ("ray_inferscale_requests_total", {"deployment": "Gateway", "rpc": "Search", "code": "UNAUTHENTICATED"}),
        ("ray_inferscale_requests_total", {"deployment": "Retrieval", "rpc": "search", "code": "OK"}),
        ("ray_inferscale_requests_total", {"deployment": "EncoderPool", "rpc": "encode", "code": "OK"}),
        ("ray_inferscale_requests_total", {"deployment": "EngineReplica", "rpc": "answer", "code": "OK"}),
        ("ray_inferscale_q2ft_seconds_count", {"deployment": "Gateway", "mode": "inject"}),
        ("ray_inferscale_ttft_seconds_count", {"deployment": "EngineReplica", "mode": "inject"}),
        ("ray_inferscale_encoder_step_seconds_count", {"deployment": "EncoderPool"}),
        ("ray_inferscale_injected_tokens_total", {"deployment": "EngineReplica"}),
        ("ray_inferscale_store_hits_total", {"deployment": "EngineReplica"}),
        ("ray_inferscale_resident_bytes", {"deployment": "EngineReplica", "tier": "disk"}),
        *(("ray_inferscale_queue_depth", {"deployment": d}) for d in ("Gateway", "Retrieval", "EncoderPool",
                                                                      "EngineReplica")),
        ("ray_serve_num_multiplexed_models", {"deployment": "EngineReplica"}),  # Serve's own metrics stay
        # vLLM's own metrics, from the engine replica through vLLM's Ray stat logger (issue 20 item 5)
        ("ray_vllm_num_requests_waiting", {}), ("ray_vllm_num_requests_running", {}),
        ("ray_vllm_kv_cache_usage_perc", {}), ("ray_vllm_time_to_first_token_seconds_count", {}),
        ("ray_vllm_prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
        # every metric the chart's Grafana dashboard reads
        *((m, {}) for m in sorted(dashboard_metrics(json.loads(DASHBOARD.read_text())))),
    ]
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        text, samples = _scrape(service.metrics_url)
        missing = [(n, lb) for n, lb in want if not _has(samples, n, **lb)]
        if (not missing and _value(samples, "ray_inferscale_injected_tokens_total") > 0
                and _value(samples, "ray_inferscale_encoder_step_seconds_count") >= ADDED_FACTS):
            break
        assert time.monotonic() < deadline, f"not exported within {SCRAPE_TIMEOUT_S} s: {missing}"
        time.sleep(1)  # a scrape is cheap: the first export that has them all ends the wait
    assert _value(samples, "ray_inferscale_ttft_seconds_count", deployment="EngineReplica") >= 4
    assert _value(samples, "ray_vllm_time_to_first_token_seconds_count") >= 4  # every answer, both doors
    assert _value(samples, "ray_vllm_prompt_tokens_by_source_total", source="external_kv_transfer") > 0  # injected
    vllm = [s for s in samples if s.name.startswith("ray_vllm_")]
    assert {s.labels.get("ReplicaId") for s in vllm} - {""}, "vLLM's metrics do not name their engine replica"
    for s in samples:  # no label value holds a test user's id (the raw text is checked below too)
        assert not any(user in value for user in USERS for value in s.labels.values()), (s.name, s.labels)
    assert _value(samples, "ray_inferscale_store_hits_total") > 0
    # every fact added is at least one forward of the encoder pool (the wait above), each of which took some time
    assert _value(samples, "ray_inferscale_encoder_step_seconds_sum") > 0
    assert _value(samples, "ray_inferscale_resident_bytes", tier="disk") > 0  # written through to the disk tier
    for user in USERS:
        assert user not in text, f"a user id is in the metrics: {[ln for ln in text.splitlines() if user in ln][:3]}"
    # Serve's per-model gauge would label each user id: it is not exported at all
    assert not any(s.name.startswith("ray_serve_registered_multiplexed_model_id") and s.labels.get("model_id")
                   for s in samples)
