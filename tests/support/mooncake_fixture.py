"""A real Mooncake Store (mooncake_master + one segment-holding mooncake_client) on free loopback ports for one
test module, stopped afterwards. A pytest plugin (tests/conftest.py): ask for `mooncake` by name; the fixture
yields inferscale_server.local_mooncake.LocalMooncake (`.config` is a ServiceConfig's cluster_store)."""
from __future__ import annotations

import contextlib

import pytest

from inferscale_server.local_mooncake import MooncakeMissing, local_mooncake


@contextlib.contextmanager
def mooncake_store():
    """A running Mooncake Store; the test fails (not skips) where the binaries are missing."""
    try:
        with local_mooncake() as store:
            yield store
    except MooncakeMissing as e:  # raised before anything starts
        pytest.fail(f"{e}; the cluster KV tier tests need it (and Debian's libibverbs1)")


@pytest.fixture(scope="module")
def mooncake():
    with mooncake_store() as store:
        yield store


def raw_client(cfg: dict):
    """A plain Mooncake client: looks for the bytes, not through ClusterStore."""
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", cfg["metadata"], 0, 16 << 20, "tcp", "", cfg["master"]) == 0
    return c
