"""A real redis-server on a free loopback port for one test module (no persistence), stopped afterwards.

A pytest plugin (tests/conftest.py): ask for `redis_url` by name;
`redis_password_url` is one started with `requirepass`."""
from __future__ import annotations

import contextlib
import secrets

import pytest

from bench.local_redis import RedisServerMissing, local_redis_server


@contextlib.contextmanager
def redis_server(password: str | None = None):
    """bench.local_redis.local_redis_server; a missing redis-server fails the test, naming it."""
    try:
        with local_redis_server(password) as url:
            yield url
    except RedisServerMissing as e:  # raised before the server starts, never by the caller's block
        pytest.fail(f"{e}; the registry tests need it")


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def redis_password_url():
    """A redis-server started with requirepass; the URL carries the password (redis://:PASSWORD@host:port/0)."""
    with redis_server(password=secrets.token_urlsafe(24)) as url:
        yield url
