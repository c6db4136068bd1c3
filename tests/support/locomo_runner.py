"""bench/locomo.py (a script, not a package module) loaded as a module, once per process."""
from __future__ import annotations

import importlib.util
import sys

from .paths import REPO


def load_locomo_runner():
    """bench/locomo.py as the module `bench_locomo` (dataclasses look their module up in sys.modules)."""
    if "bench_locomo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_locomo", REPO / "bench" / "locomo.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_locomo"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_locomo"]
