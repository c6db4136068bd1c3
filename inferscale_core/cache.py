"""Where InferScale keeps what it builds (converted models, keys, Mem0's files): $INFERSCALE_CACHE, else
$XDG_CACHE_HOME/inferscale, else ~/.cache/inferscale. No torch here: processes that load no model (the gateway)
ask for it too."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("INFERSCALE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "inferscale")
    return Path(root)
