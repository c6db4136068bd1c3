"""The test tiers are folders (tests/README.md): tests/unit starts no Ray Serve application and no vLLM engine (what
would make `make test-fast` slow), every test module lives in one tier, no test module imports another (shared code
is in tests/support/), and `make test` runs every tier once (unit first)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("unit", "engine", "service", "packaging")
SLOW_STARTS = re.compile(r"service_on_local_ray\(|running_service\(|serve\.run\(|open_harness\(|AsyncLLM|InjectingEngine\(|"
                         r"AsyncMemoryEngine|\"inferscale_server\.cli\", \"serve\"")
TEST_IMPORT = re.compile(r"^\s*(from|import) (\S+\.)?test_\w+", re.M)


def all_test_modules() -> list[Path]:
    return sorted((REPO / "tests").rglob("test_*.py"))


def test_every_module_is_in_one_tier_and_unit_starts_no_ray_and_no_engine():
    for path in all_test_modules():
        tier = path.relative_to(REPO / "tests").parts[0]
        assert tier in TIERS, f"{path.relative_to(REPO)} is in no tier folder ({', '.join(TIERS)})"
        if tier == "unit" and path != Path(__file__).resolve():  # this module names them itself
            assert not SLOW_STARTS.search(path.read_text()), \
                f"{path.relative_to(REPO)} starts a Serve app or a vLLM engine: not for tests/unit"


def test_no_test_module_imports_another():
    for path in [*all_test_modules(), *(REPO / "tests" / "support").glob("*.py")]:
        found = TEST_IMPORT.search(path.read_text())
        assert not found, f"{path.relative_to(REPO)} imports a test module ({found.group(0).strip()}): use tests/support/"


def test_make_test_runs_every_tier_unit_first(tmp_path):
    """scripts/run_tests.sh with no arguments: tests/unit across the cores (pytest-xdist, a module per worker), then
    tests/engine and tests/packaging on one worker per core, each pinned to its core (the variable
    tests/conftest.py reads), then tests/service in one process; `--fast`: tests/unit alone; other arguments go to
    pytest as given. Run against a stand-in venv whose python records how it was called."""
    import os
    import subprocess

    log = tmp_path / "calls"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "pin=$INFERSCALE_TESTS_CORE_PER_WORKER $*" >> {log}\n')
    python.chmod(0o755)

    def calls(*args: str) -> list[str]:
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh"), str(tmp_path / "venv"), *args], check=True,
                       env={**os.environ, "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        return [line.split(" ", 1)[0] + " " + line.split(" --show-capture=no ", 1)[1]
                for line in log.read_text().splitlines()]

    cores = len(os.sched_getaffinity(0))  # what nproc prints
    unit = f"pin= tests/unit -n {cores} --dist loadfile"
    assert calls() == [unit, f"pin=1 tests/engine tests/packaging -n {cores} --dist loadfile", "pin= tests/service"]
    assert calls("--fast") == [unit]
    assert calls("--fast", "-k", "registry") == [f"{unit} -k registry"]
    assert calls("tests/engine/test_demo.py") == ["pin= tests/engine/test_demo.py"]
