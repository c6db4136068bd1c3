import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pin_this_worker_to_one_core() -> None:
    """scripts/run_tests.sh runs tests/engine and tests/packaging on pytest-xdist workers, one per core, with
    INFERSCALE_TESTS_CORE_PER_WORKER=1: worker gwN is pinned to the N-th usable core (this process and all it
    starts: vLLM's OpenMP threads, engine-core subprocesses, bench scripts) before torch is imported, so two vLLM
    engines never spin on the same core. Engine starts are mostly one-threaded Python (imports, a spawned engine
    core) and these tests' models are small, so two one-core workers finish the tier sooner than one two-core
    process (tests/README.md has the measured times)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("INFERSCALE_TESTS_CORE_PER_WORKER") != "1" or not worker.startswith("gw"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    core = cpus[int(worker[2:]) % len(cpus)]
    os.sched_setaffinity(0, {core})
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1")
    if "torch" in sys.modules:  # imported before this file by a plugin: its thread count is already fixed
        sys.modules["torch"].set_num_threads(1)


pin_this_worker_to_one_core()
sys.path.insert(0, str(Path(__file__).parent))  # the support package (tests/support/)

# Fixtures every module may ask for by name, declared once: a redis-server (redis_url, redis_password_url), a
# 3-master Redis Cluster (redis_cluster_url), both over TLS only (redis_tls_url, redis_tls_cluster_url), a Mooncake Store (mooncake), an HS256 secret and an admin token
# (jwt_secret, admin_token), the independent gRPC client's compiled folder (client_dir). Their helpers (token_for,
# refused, ...) are imported from these modules as functions.
pytest_plugins = ("support.redis_fixture", "support.redis_cluster_fixture", "support.redis_tls_fixture",
                  "support.auth_fixture", "support.mooncake_fixture", "support.grpc_interop")


@pytest.fixture(scope="session")
def smollm2_path():
    from inferscale_core.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2-135M-Instruct in fp32 on the CPU: (model, tokenizer)."""
    from inferscale_core.models import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="session")
def source_copy(tmp_path_factory):
    """A copy of the checkout's package sources (tests/support/wheel_build.py), made once per session."""
    from support.wheel_build import copy_sources

    return copy_sources(tmp_path_factory.mktemp("pkg") / "src")


@pytest.fixture(scope="session")
def wheel(source_copy):
    """The inferscale wheel, built once per session from an sdist of this checkout: tests/packaging/test_packaging.py and
    tests/packaging/test_images.py install the same file."""
    from support.wheel_build import sdist_then_wheel

    return sdist_then_wheel(source_copy, "inferscale")


@pytest.fixture(scope="session")
def client_wheel(source_copy):
    """The inferscale-client wheel (client/), built once per session the same way."""
    from support.wheel_build import sdist_then_wheel

    return sdist_then_wheel(source_copy / "client", "inferscale_client")
