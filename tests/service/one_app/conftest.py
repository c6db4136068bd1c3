"""One running application shared by the modules of this folder (test_service_e2e, test_openai_compat,
test_metrics): starting it costs about a minute of the suite each time, and what these modules check needs the
same app, so its settings are the union of theirs:

  INFERSCALE_ENGINE_MAX_USERS=2   the engine replica's LRU evicts, so test_service_e2e sees a user reloaded from disk
  http                            two served model names and one CORS origin (test_openai_compat)
  metrics export port             Ray's metrics agent on a port the test scrapes (test_metrics)
  engine health check every 2 s   a dead engine is noticed in seconds (test_service_e2e's replacement test)
  Serve's proxies as shipped      serve_start_env, as `inferscale serve` starts them: the proxy callback cancels
                                  a stream its caller left (test_openai_compat; support.local_service.service_on_local_ray)

The fixture is package-scoped: the app starts before the folder's first test and stops after its last, so no other
module's Ray overlaps it. Order (tests/support/shared_app.py's order_folder): test_service_e2e first (it counts its
users' evictions from a fresh replica), then the others in MODULE_ORDER, then the tests marked
`restarts_the_app` (they kill the engine replica or restart the whole app) in that order, the whole-app restart last.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from support import shared_app
from support.local_service import running_service
from support.shared_app import order_folder

from inferscale_server.local_processes import free_port

# The folder's package-scoped fixtures (support/shared_app.py): bound here, where pytest looks for this folder's.
redis_url = shared_app.redis_url
jwt_secret = shared_app.jwt_secret

MAX_USERS = 2  # per engine replica
# Serve replaces a replica after consecutive failed health checks, one period apart (the shipped period is 10 s); the
# check itself is cheap (services/engine_replica/deployment.py check_health)
ENGINE_HEALTH_CHECK_PERIOD_S = 2
HTTP = {"served_model_names": ["inferscale", "smollm2-memory"], "cors_allow_origins": ["https://app.example"]}
MODULE_ORDER = ("test_service_e2e.py", "test_openai_compat.py", "test_metrics.py")
HERE = Path(__file__).parent


@pytest.fixture(scope="package")
def service(redis_url, tmp_path_factory, jwt_secret):
    pytest.importorskip("ray")
    metrics_port = free_port()
    with running_service(redis_url, tmp_path_factory.mktemp("kv"), jwt_secret,
                         {"INFERSCALE_ENGINE_MAX_USERS": str(MAX_USERS)}, http=HTTP,
                         engine_health_check_period_s=ENGINE_HEALTH_CHECK_PERIOD_S,
                         _metrics_export_port=metrics_port) as svc:
        svc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        svc.max_users = MAX_USERS
        yield svc


def pytest_collection_modifyitems(items):
    order_folder(items, HERE, MODULE_ORDER)
