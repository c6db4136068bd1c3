"""Page tokens of ListMemories: opaque, bound to the listing that issued them."""
from __future__ import annotations

import base64
import hashlib
import hmac

from .errors import invalid

PAGE_TOKEN_VERSION = 1


def _page_digest(cursor: int, scope: str) -> bytes:
    return hashlib.blake2b(cursor.to_bytes(8, "big") + scope.encode(), digest_size=8, person=b"inferscale-page").digest()


def next_page_token(cursor: int | None, scope: str) -> str:
    """An opaque page token: the registry's cursor (a creation sequence number, never an offset, so deletes
    while paging shift nothing) bound to `scope` (the user, and any filter the listing applies), so a token is
    only accepted for the listing that issued it. "" at the end."""
    if cursor is None:
        return ""
    raw = bytes([PAGE_TOKEN_VERSION]) + cursor.to_bytes(8, "big") + _page_digest(cursor, scope)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def page_token(token: str, scope: str, field_name: str = "page_token") -> int:
    """The cursor of a token from next_page_token(..., scope); 0 for ""; INVALID_ARGUMENT for anything else."""
    if not token:
        return 0
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)) if len(token) <= 64 else b""
    except ValueError:
        raw = b""
    if len(raw) != 17 or raw[0] != PAGE_TOKEN_VERSION:
        raise invalid(f"{field_name} {token[:40]!r} is not a token this server issued", field_name)
    cursor = int.from_bytes(raw[1:9], "big")
    if not hmac.compare_digest(raw[9:], _page_digest(cursor, scope)):
        raise invalid(f"{field_name} was issued for another listing (another user or other filters); "
                      "start again without a page_token", field_name)
    return cursor
