"""What the HTTP front door's two APIs share (services/gateway/http_front.py: OpenAI's; mem0_http.py: Mem0's): the
status code of each gRPC code, overload (429 with Retry-After) against a request that is too big (413), the
request body read under its limit, and one request's outcome in the gateway's metrics. Both import it; neither
imports the other's internals."""
from __future__ import annotations

import math

import grpc
from fastapi import Request

from ..errors import ApiError, too_big

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


def is_overload(err: ApiError) -> bool:
    """RESOURCE_EXHAUSTED that a retry may get past (a retry hint: the engine at capacity, a caller over its
    share, a full extraction queue): HTTP 429 with Retry-After. Without one (too large, a quota): 413."""
    return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s is not None


def retry_after_header(err: ApiError) -> dict[str, str]:
    """For an error that is_overload: it carries a retry hint."""
    assert err.retry_after_s is not None
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))}  # whole seconds (RFC 9110)


class Outcome:
    """One HTTP request in the gateway's metrics (services/metrics.py): in flight until called with its status
    code, counted once."""

    def __init__(self, metrics, rpc: str):
        self.metrics, self.rpc = metrics, rpc
        if metrics is not None:
            metrics.started()

    def __call__(self, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.finished(self.rpc, code.name)
            self.metrics = None


PARSE_INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (well under a millisecond)


def check_declared_size(request: Request, max_bytes: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise too_big(f"request body is {int(declared)} bytes, the limit is {max_bytes} bytes")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, read piece by piece and refused (413) as soon as it passes `max_bytes`: a body is
    never held whole before its size is known."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise too_big(f"request body is over the limit of {max_bytes} bytes")
    return bytes(body)
