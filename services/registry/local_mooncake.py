"""A throwaway Mooncake Store on free loopback ports, for the tests and the benchmarks: `mooncake_master` (with
its embedded HTTP metadata server) and one `mooncake_client` that contributes the memory segment objects live
in. The service itself only ever connects to addresses (`cluster_store` = inferscale_core.cluster_store
.ClusterConfig); this starts local ones, like local_redis.py does for Redis."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .local_redis import free_port, stop_process


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


def _wait_port(port: int, proc: subprocess.Popen, what: str, deadline: float) -> None:
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start on port {port} (exit {proc.poll()})")
        time.sleep(0.05)


@dataclass
class LocalMooncake:
    config: dict                  # ClusterConfig fields: what a ServiceConfig's cluster_store takes
    master: subprocess.Popen
    segment: subprocess.Popen
    workdir: str

    def stop_master(self) -> None:
        stop_process(self.master)


@contextlib.contextmanager
def local_mooncake(segment_bytes: int = 512 << 20, lease_ms: int = 500, start_timeout_s: float = 30.0):
    """A master and a segment of `segment_bytes` on 127.0.0.1; yields a LocalMooncake. The read lease is short
    (`lease_ms`) so removes right after a read wait little. Stopped (terminate, then kill) on exit."""
    master_bin, client_bin = mooncake_binary("mooncake_master"), mooncake_binary("mooncake_client")
    rpc, http, seg_port = free_port(), free_port(), free_port()
    workdir = tempfile.mkdtemp(prefix="inferscale-mooncake-")
    out = open(Path(workdir) / "master.log", "wb")
    master = subprocess.Popen([master_bin, "--rpc_address", "127.0.0.1", f"--rpc_port={rpc}",
                               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={http}", f"--default_kv_lease_ttl={lease_ms}"],
                              stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    segment = None
    try:
        deadline = time.monotonic() + start_timeout_s
        _wait_port(rpc, master, "mooncake_master", deadline)
        _wait_port(http, master, "mooncake_master's metadata server", deadline)
        metadata = f"http://127.0.0.1:{http}/metadata"
        seg_log = open(Path(workdir) / "segment.log", "wb")
        segment = subprocess.Popen([client_bin, f"--master_server_address=127.0.0.1:{rpc}",
                                    f"--metadata_server={metadata}", f"--global_segment_size={segment_bytes}",
                                    "--host=127.0.0.1", f"--port={seg_port}", "--protocol=tcp"],
                                   stdout=seg_log, stderr=subprocess.STDOUT, cwd=workdir)
        _wait_port(seg_port, segment, "mooncake_client (segment)", deadline)
        config = {"master": f"127.0.0.1:{rpc}", "metadata": metadata, "lease_s": lease_ms / 1000}
        _wait_writable(config, deadline)
        yield LocalMooncake(config, master, segment, workdir)
    finally:
        if segment is not None:
            stop_process(segment)
        stop_process(master)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_writable(config: dict, deadline: float) -> None:
    """Until a put succeeds: the segment is mounted at the master."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    if client.setup("127.0.0.1", config["metadata"], 0, 1 << 20, "tcp", "", config["master"]) != 0:
        raise RuntimeError("cannot connect to the local mooncake_master")
    try:
        while client.put("__probe__", b"x") != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the local Mooncake segment was never mounted")
            time.sleep(0.1)
    finally:
        client.close()
