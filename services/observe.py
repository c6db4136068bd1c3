"""What a running application looks like from outside: replica counts per deployment, sampled over time
(tests/service/two_engines/test_autoscaling.py; bench/service.py records them next to its load), and each engine
replica's own stats (the tests' and bench/service.py's view of which users a replica holds)."""
from __future__ import annotations

import asyncio
import threading
import time


def replica_counts(app_name: str = "inferscale") -> dict[str, int]:
    """RUNNING replicas of each deployment of the app (replicas starting or stopping are not counted); {} when
    the app is not deployed. Needs a connected Ray (ray.init) with Serve running."""
    from ray import serve
    from ray.serve._private.common import ReplicaState

    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {name: int(d.replica_states.get(ReplicaState.RUNNING, 0)) for name, d in app.deployments.items()}


def engine_replica_stats(replicas: int, app_name: str = "inferscale", calls: int = 60,
                         timeout_s: float = 60) -> dict[str, dict]:
    """stats() of each of `replicas` engine replicas (held users, loads, admission), by replica id. A call without
    a user lands on the replica Serve picks, so this asks until each has answered; RuntimeError after `calls` calls
    with fewer. Needs a connected Ray with the app running.

    Asked from an event loop of its own, made and closed here: with RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 in this
    process's environment (services/app.py SERVE_REQUEST_PATH_ENV; `inferscale serve` and bench/service.py export
    it) a handle routes on the loop it is first used in and refuses a blocking .result() outside one."""
    from ray import serve

    async def ask() -> dict[str, dict]:
        handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
        out: dict[str, dict] = {}
        for _ in range(calls):
            st = await asyncio.wait_for(handle.stats.remote(), timeout_s)
            out[st["replica_id"]] = st
            if len(out) >= replicas:
                return out
        raise RuntimeError(f"only {len(out)} of {replicas} engine replicas answered stats() in {calls} calls")

    return asyncio.run(ask())


class ReplicaTimeline:
    """Samples replica_counts every `period_s` in a background thread while in a `with` block.
    `samples`: [(seconds since start, {deployment: running replicas})]; a failed sample is skipped."""

    def __init__(self, app_name: str = "inferscale", period_s: float = 1.0):
        self.app_name, self.period_s = app_name, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-timeline", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> "ReplicaTimeline":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self._t0, replica_counts(self.app_name)))
            except Exception:  # noqa: BLE001 - a busy controller misses a sample; the next one counts
                pass
            self._stop.wait(self.period_s)

    def peak(self, deployment: str) -> int:
        return max((c.get(deployment, 0) for _, c in self.samples), default=0)

    def changes(self) -> list[tuple[float, dict[str, int]]]:
        """The samples where some count differs from the previous sample (the first one included)."""
        out, last = [], None
        for t, counts in self.samples:
            if counts != last:
                out.append((t, counts))
                last = counts
        return out

    def table(self) -> str:
        """The changes as text lines: `t=12.0s Gateway=1 Retrieval=2 ...`."""
        return "\n".join(f"t={t:6.1f}s " + " ".join(f"{k}={v}" for k, v in sorted(c.items()))
                         for t, c in self.changes())
