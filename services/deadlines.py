"""How long a backend call may take: the server's cap, or what is left of the caller's deadline when that is shorter."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time

import grpc

from .errors import ApiError

# The caller's deadline (time.time() by which it gives up), set by the front door for the call's task; backend
# calls take what is left of it, capped by the server's own limit (services/gateway/serve_ingress.py). Wall
# clock, not monotonic: Serve's proxy reads the deadline in another process (services/proxy_setup.py).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("inferscale_deadline", default=None)


@contextlib.contextmanager
def caller_deadline(seconds_left: float | None):
    """Within this block (this task and the tasks and threads it starts), the caller gives up `seconds_left`
    from now (None: the caller set no deadline)."""
    token = _DEADLINE.set(None if seconds_left is None else time.time() + max(0.0, seconds_left))
    try:
        yield
    finally:
        try:
            _DEADLINE.reset(token)
        except ValueError:  # a stream finalized in another context (abandoned): nothing to restore there
            pass


DEADLINE_MARGIN = 0.1       # the server gives up this fraction of the caller's time earlier (at most
DEADLINE_MARGIN_MAX_S = 0.25  # this long), so its own DEADLINE_EXCEEDED reaches the caller before its timer fires


def time_left(cap_s: float | None) -> tuple[float | None, bool]:
    """(seconds a backend call may take, whether the caller's deadline is what bounds it): the server's cap (None:
    none), or the caller's remaining time, less a margin, when that is shorter. DEADLINE_EXCEEDED once the
    caller's deadline has passed."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return cap_s, False
    left = deadline - time.time()
    left -= min(left * DEADLINE_MARGIN, DEADLINE_MARGIN_MAX_S)
    if left <= 0:
        raise deadline_exceeded()
    return (left, True) if cap_s is None or left < cap_s else (cap_s, False)


async def within_deadline(aw, cap_s: float | None = None):
    """Awaits `aw` for at most the server's cap or what is left of the caller's deadline: past the caller's,
    DEADLINE_EXCEEDED (the backend call is cancelled); past the cap, TimeoutError (UNAVAILABLE, retryable)."""
    try:
        limit, callers = time_left(cap_s)
    except ApiError:
        stop = getattr(aw, "cancel", None) or getattr(aw, "close", None)  # a future / Serve response; a coroutine
        if stop is not None:
            stop()
        raise
    try:
        return await asyncio.wait_for(aw, limit)
    except asyncio.TimeoutError:
        if callers:
            raise deadline_exceeded() from None
        raise


def deadline_exceeded() -> "ApiError":
    return ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before the backends answered; "
                    "nothing more is done for it")
