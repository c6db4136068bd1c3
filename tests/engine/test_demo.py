"""`inferscale demo` (what `make demo` runs, the first thing a user sees): at the shipped default, KV injection is
right wherever prompt injection is right on every question of its script, and the demo says so and exits 0.
The demo itself exits 1 when KV injection gets a fact wrong that prompt injection gets right."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale_core.cli import DEMO_FACTS, DEMO_QUESTIONS
from inferscale_core.defaults import NEIGHBOUR_WINDOW, RECOMPUTE_FACTS, RECOMPUTE_TOKENS, default_windows, rewindow

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_demo_questions_are_about_the_demo_facts():
    for user, question, expected in DEMO_QUESTIONS:
        assert user in DEMO_FACTS
        assert any(expected.lower() in fact.lower() for fact in DEMO_FACTS[user]), question


def test_demo_kv_is_right_wherever_prompt_injection_is_right(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    log = tmp_path / "demo.log"
    proc = subprocess.run([sys.executable, "-m", "inferscale_core.cli", "demo", "--log-file", str(log)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr[-3000:]}\n{log.read_text()[-3000:]}"
    # the terminal shows the demo alone; the engine's INFO/WARNING lines are in the log file it names
    assert out.splitlines()[0] == f"demo: the engine's log goes to {log}" and not proc.stderr.strip(), proc.stderr
    assert not [ln for ln in out.splitlines() if re.search(r"\b(INFO|WARNING|DEBUG)\b", ln)], out
    assert re.search(r"\bINFO\b", log.read_text()), "vLLM's log lines should be in the log file"
    # the demo runs the shipped default
    assert (f"neighbour window={NEIGHBOUR_WINDOW}, recompute_tokens={RECOMPUTE_TOKENS}, "
            f"recompute_facts={RECOMPUTE_FACTS}") in out
    verdicts = [line.strip() for line in out.splitlines() if line.strip().startswith("-> ")]
    assert len(verdicts) == len(DEMO_QUESTIONS)
    assert not any("KV WRONG" in v for v in verdicts)
    # every question was answered right by prompt injection too: the script holds only questions a 135M model
    # can answer, so agreement means something
    assert out.count(", right: ") == 2 * len(DEMO_QUESTIONS), out
    assert f"OK: on all {len(DEMO_QUESTIONS)} questions" in out
    injected = next(line for line in out.splitlines() if line.startswith("injected tokens:"))
    assert int(injected.split(":")[1].split(",")[0]) > 0  # memory KV really was injected, not all recomputed


def test_default_windows_keep_a_callers_window_and_give_the_rest_their_neighbours():
    texts = ["a one", "b two", "c three"]
    assert default_windows(texts, w=1) == [(), ("- a one\n",), ("- b two\n",)]
    assert default_windows(texts, [[], ["user: hi"], []], w=2) == [(), ("user: hi",), ("- a one\n", "- b two\n")]
    assert default_windows(texts, w=0) == [(), (), ()]
    with pytest.raises(ValueError, match="3 facts but 2 windows"):
        default_windows(texts, [[], []])
    # facts the user stored before this call are neighbours too: one by one gives what together gives
    assert default_windows(texts[2:], w=2, stored=texts[:2]) == default_windows(texts, w=2)[2:]
    assert default_windows(["d"], w=2, stored=texts) == [("- b two\n", "- c three\n")]
    assert default_windows(["d"], w=0, stored=texts) == [()]


def test_rewindow_drops_or_replaces_a_neighbours_line():
    win = ("- a one\n", "user: hi", "- b two\n")
    assert rewindow(win, "a one", None) == ("user: hi", "- b two\n")
    assert rewindow(win, "b two", "b 2") == ("- a one\n", "user: hi", "- b 2\n")
    assert rewindow(win, "c three", None) is None and rewindow((), "a one", None) is None


REDIRECT = """
import logging, os, subprocess, sys
from pathlib import Path
from inferscale_core.cli import engine_output_to

logging.basicConfig(stream=sys.stdout, level=logging.INFO)  # as vLLM's logger: a handler on sys.stdout
print("before", flush=True)
out = engine_output_to(Path(sys.argv[1]))
out.write("demo line 1\\n")
logging.getLogger("vllm").info("engine INFO line")
print("WARNING a print to sys.stdout", flush=True)
os.write(2, b"C-level stderr line\\n")
subprocess.run(["sh", "-c", "echo child process line"])
out.write("demo line 2\\n")
import atexit
atexit.register(lambda: print("exit-time line", file=sys.stderr, flush=True))
"""


def test_engine_output_goes_to_the_log_and_the_demo_lines_to_the_terminal(tmp_path):
    """What `make demo` relies on: after engine_output_to, whatever the process or its children write to stdout or
    stderr (Python logging, print, C-level writes, subprocesses, exit-time lines) lands in the log; the demo's own
    stream stays on the terminal."""
    log = tmp_path / "engine.log"
    proc = subprocess.run([sys.executable, "-c", REDIRECT, str(log)], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "before\ndemo line 1\ndemo line 2\n" and proc.stderr == ""
    text = log.read_text()
    for line in ("engine INFO line", "WARNING a print to sys.stdout", "C-level stderr line", "child process line",
                 "exit-time line"):
        assert line in text, text
