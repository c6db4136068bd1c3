"""The fast tier (tests/fast_tier.txt) names test modules that exist, and none of them starts a Ray Serve application
or a vLLM engine (what would make `make test-fast` slow); `make test` runs every module once (the fast tier, then the others)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLOW_STARTS = re.compile(r"service_on_local_ray\(|running_service\(|serve\.run\(|open_harness\(|AsyncLLM|InjectingEngine\(|"
                         r"AsyncMemoryEngine|\"inferscale_server\.cli\", \"serve\"")


def fast_modules() -> list[str]:
    lines = (REPO / "tests" / "fast_tier.txt").read_text().splitlines()
    return [ln for ln in lines if ln.strip() and not ln.startswith("#")]


def test_the_fast_tier_lists_existing_modules_that_start_no_ray_and_no_engine():
    fast = fast_modules()
    assert fast and len(fast) == len(set(fast))
    for path in fast:
        source = (REPO / path).read_text() if REPO / path != Path(__file__).resolve() else ""  # names them itself
        assert path.startswith("tests/test_") and path.endswith(".py"), path
        assert not SLOW_STARTS.search(source), f"{path} starts a Serve app or a vLLM engine: not for the fast tier"


def test_make_test_runs_every_module_once():
    """scripts/run_tests.sh with no arguments: the fast tier, then every other module (pytest --co lists them)."""
    script = (REPO / "scripts" / "run_tests.sh").read_text()
    assert '"${pytest[@]}" "${fast[@]}"' in script and "--ignore=%s" in script
    listed = subprocess.run(["bash", "-c", "grep -v '^#' tests/fast_tier.txt | grep ."], cwd=REPO, text=True,
                            capture_output=True, check=True).stdout.split()
    assert listed == fast_modules()
