"""A throwaway Mooncake Store on free loopback ports, for `inferscale serve --local-mooncake` (services/cli.py), the
tests and the benchmarks: `mooncake_master` (no metadata server: clients exchange segment descriptors peer to peer,
as the chart and the cluster file run it) and one `mooncake_client` that contributes the memory segment objects
live in. The service itself otherwise only connects to addresses (`cluster_store` =
inferscale_core.cluster_store.ClusterConfig); this starts local ones, like bench/local_redis.py does for Redis.

Its config carries the pool each user's share of the tier is taken from (services/kv_tier_share.py, the chart's
rule): the one segment it starts, so every one-machine use (serve, benchmarks, tests) bounds a tenant's KV there as
a cluster does, at pool / (replicas x tenants). `replicas` is 1 because one segment holds one copy of each object
(Mooncake writes no more than the segments it has); counting the chart's two would halve every user's share for
copies that are never written. A caller that adds segments and wants two copies says so (`add_segment`)."""
from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_core.cluster_store import P2P_METADATA

from .kv_tier_share import smallest_pool_bytes
from .local_processes import free_port, stop_process

log = logging.getLogger(__name__)
LOG_LINES_IN_ERRORS = 30


class MooncakeMissing(RuntimeError):
    """The mooncake wheel (or the libibverbs1 it loads) is not installed."""


def mooncake_binary(name: str) -> str:
    """A binary shipped inside the mooncake wheel (mooncake_master, mooncake_client)."""
    try:
        import mooncake
    except ImportError as e:
        raise MooncakeMissing(f"mooncake is not installed ({e}): pip install 'inferscale[mooncake]'") from None
    path = Path(mooncake.__file__).parent / name
    if not path.is_file():
        raise MooncakeMissing(f"{path} is missing from the mooncake wheel")
    return str(path)


def _wait_port(port: int, proc: subprocess.Popen, what: str, deadline: float, log_path: Path) -> None:
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            # The workdir goes with the store: the error carries what the process said.
            tail = (log_path.read_text(errors="replace").splitlines()[-LOG_LINES_IN_ERRORS:] if log_path.is_file()
                    else [])
            raise RuntimeError(f"{what} did not start on port {port} (exit {proc.poll()}); the end of its log:\n"
                               + "\n".join(tail))
        time.sleep(0.05)


@dataclass
class LocalMooncake:
    config: dict                  # ClusterConfig fields: what a ServiceConfig's cluster_store takes
    master: subprocess.Popen
    segment: subprocess.Popen
    workdir: str
    extra_segments: list = field(default_factory=list)

    def stop_master(self) -> None:
        stop_process(self.master)

    def add_segment(self, segment_bytes: int, start_timeout_s: float = 30.0) -> subprocess.Popen:
        """Another node's segment (one more `mooncake_client`), mounted at the master before this returns.
        Stopped with the store unless the caller kills it first. The config stays the first segment's (its
        pool_bytes, one copy): the pool the store always has, since this one may die (the node-failure test); a
        caller that wants two copies across them sets `replicas: 2` in the config it uses."""
        proc = _listening_segment(self.config, segment_bytes, Path(self.workdir), start_timeout_s)
        self.extra_segments.append(proc)
        _wait_writable(self.config, time.monotonic() + start_timeout_s, segments=1 + len(self.extra_segments))
        return proc


def _listening(binary: str, args: list[str], port: int, what: str, workdir: Path, log_name: str,
               start_timeout_s: float) -> subprocess.Popen:
    """`binary` of the mooncake wheel started with `args`, its output in `workdir/log_name`, once it listens on
    `port` (RuntimeError with the end of its log if it does not within `start_timeout_s`; it is stopped then)."""
    log_path = workdir / log_name
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([mooncake_binary(binary), *args], stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        _wait_port(port, proc, what, time.monotonic() + start_timeout_s, log_path)
    except RuntimeError:
        stop_process(proc)
        raise
    return proc


def _listening_segment(config: dict, segment_bytes: int, workdir: Path, start_timeout_s: float) -> subprocess.Popen:
    """A `mooncake_client` contributing `segment_bytes`, listening on a free port."""
    port = free_port()
    return _listening("mooncake_client", [f"--master_server_address={config['master']}",
                                          f"--metadata_server={config['metadata']}",
                                          f"--global_segment_size={segment_bytes}", "--host=127.0.0.1",
                                          f"--port={port}", "--protocol=tcp"],
                      port, "mooncake_client (segment)", workdir, f"segment-{port}.log", start_timeout_s)


def _listening_master(workdir: Path, lease_ms: int, client_ttl_s: int,
                      start_timeout_s: float) -> tuple[subprocess.Popen, int]:
    """A `mooncake_master` listening on a free loopback port, and that port."""
    rpc = free_port()
    proc = _listening("mooncake_master", ["--rpc_address", "127.0.0.1", f"--rpc_port={rpc}",
                                          f"--default_kv_lease_ttl={lease_ms}", f"--client_ttl={int(client_ttl_s)}",
                                          # its metrics server's port (default 9003) would collide with another
                                          # master's
                                          "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"],
                      rpc, "mooncake_master", workdir, f"master-{rpc}.log", start_timeout_s)
    return proc, rpc


def _start_store(workdir: Path, segment_bytes: int, lease_ms: int, client_ttl_s: int,
                 start_timeout_s: float) -> LocalMooncake:
    """A master and one segment, writable; what it started is stopped if it raises."""
    master, rpc = _listening_master(workdir, lease_ms, client_ttl_s, start_timeout_s)
    segment = None
    try:
        config = {"master": f"127.0.0.1:{rpc}", "metadata": P2P_METADATA, "lease_s": lease_ms / 1000,
                  "replicas": 1, "pool_bytes": smallest_pool_bytes([(1, segment_bytes)])}
        segment = _listening_segment(config, segment_bytes, workdir, start_timeout_s)
        _wait_writable(config, time.monotonic() + start_timeout_s)
        return LocalMooncake(config, master, segment, str(workdir))
    except BaseException:
        for proc in (segment, master):
            if proc is not None:
                stop_process(proc)
        raise


@contextlib.contextmanager
def local_mooncake(segment_bytes: int = 512 << 20, lease_ms: int = 500, start_timeout_s: float = 30.0,
                   client_ttl_s: int = 10):
    """A master and a segment of `segment_bytes` on 127.0.0.1; yields a LocalMooncake. The read lease is short
    (`lease_ms`) so removes right after a read wait little; a segment whose client stops heartbeating is dropped
    after `client_ttl_s` (Mooncake's default 10). Stopped (terminate, then kill) on exit.

    A start that fails (a process that exits, or never listens or mounts within `start_timeout_s`) is stopped and
    made once more on other ports, its error logged: seen once in a full test run, on an idle machine right after
    another module's Ray had stopped, a segment stayed up without listening for 28 s (a `mooncake_client` that
    cannot reach its master retries for ~90 s before it exits). A second failure raises, with the logs' ends."""
    mooncake_binary("mooncake_master")  # MooncakeMissing before anything starts
    workdir = Path(tempfile.mkdtemp(prefix="inferscale-mooncake-"))
    store = None
    try:
        try:
            store = _start_store(workdir, segment_bytes, lease_ms, client_ttl_s, start_timeout_s)
        except MooncakeMissing:
            raise
        except RuntimeError as e:
            log.warning("the local Mooncake store did not start (%s); starting it again on other ports", e)
            store = _start_store(workdir, segment_bytes, lease_ms, client_ttl_s, start_timeout_s)
        yield store
    finally:
        if store is not None:
            for proc in [*store.extra_segments, store.segment, store.master]:
                stop_process(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_writable(config: dict, deadline: float, segments: int = 1) -> None:
    """Until a put succeeds with a copy in each of `segments` segments: they are mounted at the master."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    client = MooncakeDistributedStore()
    if client.setup("127.0.0.1", config["metadata"], 0, 1 << 20, "tcp", "", config["master"]) != 0:
        raise RuntimeError("cannot connect to the local mooncake_master")
    copies = ReplicateConfig()
    copies.replica_num = segments
    try:
        while True:
            client.remove("__probe__")
            if client.put("__probe__", b"x", copies) == 0 and len(client.get_replica_desc("__probe__")) >= segments:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Mooncake segments ({segments}) were never mounted")
            time.sleep(0.1)
        client.remove("__probe__")
    finally:
        client.close()
