"""The checkout's folders, for tests that read its files (docs, charts, bench scripts, fixtures)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
