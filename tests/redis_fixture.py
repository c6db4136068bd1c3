"""A real redis-server on a free loopback port for one test module (no persistence), stopped afterwards.

Import the fixture into a test module with `from redis_fixture import redis_url  # noqa: F401`;
`redis_password_url` is one started with `requirepass`."""
from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(password: str | None = None):
    """A redis-server bound to 127.0.0.1 on a free port (with `requirepass` when a password is given);
    yields its URL, the password in it."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (Debian package redis-server); the registry tests need it")
    import redis

    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="inferscale-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port} (exit {proc.poll()})")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def redis_password_url():
    """A redis-server started with requirepass; the URL carries the password (redis://:PASSWORD@host:port/0)."""
    with redis_server(password=secrets.token_urlsafe(24)) as url:
        yield url
