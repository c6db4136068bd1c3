"""docs/mem0.md's compatibility table (client call -> routes -> verdict), read the way the tests check it."""
from __future__ import annotations

import re

from .paths import REPO


def norm_route(path: str) -> str:
    return "/" + re.sub(r"\{[^}]*\}", "{}", path).lstrip("/")


def doc_table() -> dict[str, tuple[frozenset, str]]:
    """docs/mem0.md's compatibility table: client call -> (routes, "supported" | "501" | "client-side")."""
    text = (REPO / "docs" / "mem0.md").read_text()
    section = text.split("## Every client call", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|"):
            continue
        names = re.findall(r"`([a-z_.]+)`", cells[0])
        routes = frozenset((m, norm_route(p)) for m, p in re.findall(r"\b(GET|POST|PUT|PATCH|DELETE) `([^`]+)`", cells[1]))
        status = re.match(r"\**(supported|501|client-side)", cells[2])
        for name in names:
            assert name not in out, f"{name} twice in docs/mem0.md's table"
            out[name] = (routes, status.group(1) if status else cells[2])
    return out
