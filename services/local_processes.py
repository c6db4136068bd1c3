"""Free ports and throwaway processes on this machine: what `inferscale serve --local-mooncake` uses to start its
Mooncake Store (services/local_mooncake.py), and the tests' and benchmarks' local servers (bench/local_redis.py)."""
from __future__ import annotations

import errno
import socket
import subprocess


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


def stop_process(proc: subprocess.Popen) -> None:
    """Stops a throwaway server: terminate, then kill after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
