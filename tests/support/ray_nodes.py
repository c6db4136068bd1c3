"""Ray clusters of several nodes on this machine, started with the `ray` CLI as ray_cluster.yaml's commands do
(tests/service/ray_nodes/), and ended without `ray stop` (which would end every Ray here)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILE = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
REDIS_PORT = 6390  # ray_cluster.yaml's Redis port; Ray's GCS has 6379


def file_command(key: str, needle: str) -> str:
    """The one command of ray_cluster.yaml's `key` list that contains `needle`."""
    (cmd,) = [c for c in CLUSTER_FILE[key] if needle in c]
    return cmd


def ray_cli(*args: str, env: dict, timeout: float = 180) -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"ray {' '.join(args)}: {out.stdout[-2000:]}\n{out.stderr[-2000:]}"


def reload_ray_auth() -> None:
    """Make this process's Ray re-read RAY_AUTH_MODE / RAY_AUTH_TOKEN (it caches both)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def processes() -> dict[int, tuple[int, str]]:
    """This machine's processes, read from /proc: pid -> (parent pid, command line); one that ends while it is
    read is left out."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out[int(d.name)] = (ppid, cmd)
    return out


def with_descendants(pids: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    """`pids` and every descendant of theirs in `table` (processes())."""
    out, grew = set(pids), True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in out} - out
        grew = bool(more)
        out |= more
    return out


def stop_ray(markers: list[str]) -> None:
    """Ends this test's Ray processes only: those whose command line names its temp dir or GCS address, and
    their children (`ray stop` would end every Ray on the machine, other people's included)."""
    table = processes()
    me = os.getpid()
    mine = with_descendants({pid for pid, (_, cmd) in table.items() if any(m in cmd for m in markers) and pid != me},
                            {pid: row for pid, row in table.items() if pid != me})
    # SIGKILL at once: the cluster is thrown away, and its raylets, GCS, log monitor and runtime-env agents outwaited
    # every SIGTERM grace they were given (15 s, then 5 s: all of it, every time, a wait in every teardown);
    # SIGKILL ends them within a second.
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(running(p) for p in mine):
        time.sleep(0.2)


def running(pid: int) -> bool:
    """pid is a process that has not exited: a zombie (exited, not yet reaped by its parent) does not count, so
    stop_ray does not wait out a grace period for processes that are already dead."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
