"""One running application shared by the modules of this folder (test_multi_replica, test_autoscaling): starting
it costs about a minute of the suite each time, and what each module checks holds on the union of their settings:

  EngineReplica: 2 replicas, each bound to     test_multi_replica (each engine on its own core, users spread over
  a core of its own (engine_cpu_cores=1),      both, every answer on the user's home below the move threshold)
  users moved at ENGINE_MOVE_AT ongoing
  Gateway, Retrieval, EncoderPool: 1 to 2      test_autoscaling (a deployment rises to 2 under a ramp and falls
  replicas, target 1 ongoing request, Serve's  back to 1). Under test_multi_replica's load a second gateway may
  metrics every 0.5 s, 2 s up / 5 s down       start: its router computes the same homes (services/routing.py)
  4 logical CPUs for Ray                       two replicas of each autoscaled deployment beside the two engines

The fixture is package-scoped: the app starts before the folder's first test and stops after its last, so no other
module's Ray overlaps it. Order (tests/support/shared_app.py's order_folder): test_multi_replica first (it counts
the users the engines hold and the facts they were pushed from fresh replicas), then test_autoscaling (users of
its own; it starts its ramp once the deployments are back at one replica).

INFERSCALE_MEASURE_SERVE_ROUTER=1 runs the folder with Serve's default router instead, to measure what the
affinity router fixes (test_multi_replica).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import shared_app
from support.local_service import service_on_local_ray
from support.serve_specs import spec_with
from support.shared_app import order_folder

# The folder's package-scoped fixtures (support/shared_app.py): bound here, where pytest looks for this folder's.
redis_url = shared_app.redis_url
jwt_secret = shared_app.jwt_secret

AUTOSCALED = ("Gateway", "Retrieval", "EncoderPool")
# Seconds, not minutes: 2 s above target to add a replica, 5 s below to remove it; replicas report every 0.5 s,
# averaged over 2 s (Serve's metric timings, which DeploymentSpec leaves at their defaults).
DELAYS = {"upscale_delay_s": 2.0, "downscale_delay_s": 5.0}
FAST_METRICS = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0}
# The engines' autoscaling target and Serve's per-replica limit: the router moves a user off its home at
# min(2 x target, max_ongoing_requests) = 9 ongoing requests (services/routing.py move_threshold).
ENGINE_TARGET, ENGINE_MAX_ONGOING = 8, 9
SERVE_ROUTER = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
MODULE_ORDER = ("test_multi_replica.py", "test_autoscaling.py")
HERE = Path(__file__).parent


@pytest.fixture(scope="package")
def service(redis_url, tmp_path_factory, jwt_secret):
    pytest.importorskip("ray")
    from inferscale_server.app import DeploymentSpec, ServiceConfig
    from inferscale_server.local_processes import free_port
    from inferscale_server.routing import move_threshold

    if os.environ.get("INFERSCALE_MEASURE_SERVE_ROUTER"):  # a measurement, not the test: Serve's own router
        import inferscale_server.routing

        inferscale_server.routing.ROUTER_PATH = SERVE_ROUTER
    deployments = {name: spec_with(autoscaling=FAST_METRICS, min_replicas=1, max_replicas=2,
                                   target_ongoing_requests=1, num_cpus=0.25, **DELAYS) for name in AUTOSCALED}
    deployments["EngineReplica"] = DeploymentSpec(2, 2, max_ongoing_requests=ENGINE_MAX_ONGOING,
                                                  target_ongoing_requests=ENGINE_TARGET, num_cpus=0.5)
    kv_dir = tmp_path_factory.mktemp("kv")
    # One core each: two vLLM CPU engines bound to the same cores preempt each other inside their OpenMP regions
    # (bench/engines_sharing_cores.py).
    cfg = ServiceConfig(registry_url=redis_url, kv_dir=str(kv_dir), max_model_len=1024,
                        http_port=free_port(), grpc_port=free_port(), deployments=deployments,
                        auth={"hs256_secret_file": str(jwt_secret[0])}, engine_cpu_cores=1)
    # Logical CPUs (Ray's scheduling shares) for 2 x 0.25 of each autoscaled deployment and 2 x 0.5 of the engines
    # on 2 real cores.
    with service_on_local_ray(cfg, kv_dir, jwt_secret, num_cpus=4) as svc:
        svc.autoscaled = AUTOSCALED
        svc.engine_move_at = move_threshold(ENGINE_TARGET, ENGINE_MAX_ONGOING)
        yield svc


def pytest_collection_modifyitems(items):
    order_folder(items, HERE, MODULE_ORDER)
