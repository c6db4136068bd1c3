"""`inferscale serve`'s last stop step (services/cli.py, `_stop_leftovers`), without Ray: a process whose parent died
before it (a vLLM engine core whose Ray worker was killed) is still found and ended, because serve made itself the
subreaper of its descendants; one that ignores SIGTERM is killed after LEFTOVER_GRACE_S. The whole stop, with Ray and
the engine, is checked at the end of tests/service/test_service_safety.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")

# Stands in for serve: becomes the subreaper, starts a shell that leaves two orphans (one ignoring SIGTERM) and
# exits, prints the orphans' pids and their parent (the stand-in, or init without the subreaper), then stops them.
STAND_IN = """
import os, subprocess, sys, time
from inferscale_server import cli
if sys.argv[1] == "subreaper":
    cli._become_subreaper()
subprocess.run(["bash", "-c", "sleep 300 & echo $!; (trap '' TERM; exec sleep 301) & echo $!"], check=True,
               stdout=open("orphans", "w"), stderr=subprocess.DEVNULL)  # no pipe of the test's held open
orphans = [int(p) for p in open("orphans").read().split()]
time.sleep(0.2)
parents = [int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in orphans]
print("orphans", *orphans, "parents", *parents, "mine", os.getpid(), flush=True)
t = time.monotonic()
cli._stop_leftovers()
print("took", round(time.monotonic() - t, 1), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run(mode: str, tmp_path) -> tuple[list[int], list[int], int, str]:
    out = subprocess.run([sys.executable, "-c", STAND_IN, mode], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    orphans, parents = [int(w) for w in words[1:3]], [int(w) for w in words[4:6]]
    return orphans, parents, int(words[7]), out.stdout


def test_orphans_of_serves_children_are_found_and_ended(tmp_path):
    from inferscale_server.cli import LEFTOVER_GRACE_S

    orphans, parents, mine, out = _run("subreaper", tmp_path)
    assert parents == [mine, mine], out  # re-parented to serve, not to init
    assert not [p for p in orphans if _alive(p)], out  # both ended, the one ignoring SIGTERM by SIGKILL
    assert LEFTOVER_GRACE_S <= float(out.split()[-1]) < LEFTOVER_GRACE_S + 2, out


def test_without_the_subreaper_an_orphan_escapes(tmp_path):
    """The control: without _become_subreaper the orphans go to init (or an outer subreaper) and the sweep, which
    follows serve's own descendants, cannot see them: the subreaper is what makes the sweep complete."""
    orphans, parents, mine, out = _run("plain", tmp_path)
    try:
        assert mine not in parents, out
        assert all(_alive(p) for p in orphans), out
    finally:
        for p in orphans:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
