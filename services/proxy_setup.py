"""What runs inside each Ray Serve proxy process when it starts: Serve calls `proxy_setup()` because the proxy's
environment names it (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, set with the other proxy settings in
services/app.py:SERVE_START_ENV), before the proxy opens its ports.

- HTTP: bodies are bounded in the proxy, before anything is buffered or sent to a replica: a declared
  Content-Length over the transport limit is answered 413 at once, a body without Content-Length 411 (every
  OpenAI client sends one), and a body that runs past its declared length 400. A body within the limit is read
  whole in the proxy, within BODY_TIMEOUT_ENV's seconds (408 after them), before the request goes to a replica:
  Serve hands the replica a `receive` that pulls the body from the proxy as the replica reads it, so a client
  that sends its body slowly would otherwise hold one of the Gateway's request slots for as long as it likes.
- gRPC: Ray 2.60's gRPC proxy binds `[::]:PORT` whatever the HTTP host is; with INFERSCALE_GRPC_HOST set
  (`inferscale serve --host`), it binds that address instead. (Its message size limit is Ray's own
  RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, in the same environment.)
- gRPC receive window (GRPC_RECEIVE_OPTIONS): the proxy refuses an oversized message from its length prefix, but
  with gRPC's BDP probing on (its default) each stream's HTTP/2 window grows with the measured bandwidth, and a
  client pushes that much before the refusal: 4, 8, then up to 32 MiB of a 64 MiB message read into memory per
  refused call on loopback (a bare grpc.aio server with Serve's options, grpcio 1.85). With probing off and a
  fixed window of the API's largest request (Limits.max_request_bytes, 1 MiB), at most 1 MiB of a refused
  message is let in, and a legal request still fits in one window.
- gRPC deadlines: the context Serve sends to the Gateway replica carries no deadline; the caller's (the
  `grpc-timeout` it sent) is noted on it as DEADLINE_ATTR (unix time), so the replica's backend calls stop
  when the caller gives up (services/deadlines.py:time_left).
- gRPC error details: Serve's proxy answers an error the Gateway raised with its code and message only; for
  the Gateway's errors (errors.ApiError) it also sends their google.rpc details and retry pushback
  (services/error_details.py:error_trailers), unary and streaming RPCs alike.
- A stream its caller leaves: Serve's proxy cancels the replica's call only when the caller's cancel reaches it
  while it waits for the replica's next item; when the cancel comes while the proxy is handing an item to gRPC (its
  generator suspended at `yield`), the generator is closed, the call is dropped uncancelled and the replica's answer
  decodes to its end (measured: a gRPC Answer left by `break` in a reading loop went on for its remaining 16 s in
  vLLM, 2 runs of 2). Every ProxyResponseGenerator the proxy makes now cancels its call when the proxy's task for
  the request ends before the stream did (`_cancel_streams_left_between_items`); a stream that ended, failed or was
  cancelled by Serve itself is left alone.

The receive window and the last three patch Ray Serve 2.60 internals (`DEFAULT_GRPC_SERVER_OPTIONS`;
`RayServegRPCContext.__init__`; `get_grpc_response_status` and `set_grpc_code_and_details` as
ray.serve._private.proxy uses them; its `ProxyResponseGenerator`): check them when Ray is upgraded;
tests/service/test_grpc_serve_proxy.py and tests/service/one_app/test_openai_compat.py
(`test_a_caller_that_leaves_ends_its_answers_in_the_engine_at_once`) fail if any stops working.
"""
from __future__ import annotations

import asyncio
import json
import os

TRANSPORT_MAX_MESSAGE_BYTES = 4 << 20  # a gRPC message or an HTTP body, either way (services/app.py:SERVE_START_ENV)
GRPC_HOST_ENV = "INFERSCALE_GRPC_HOST"
MAX_BODY_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # one transport limit for both proxies
BODY_TIMEOUT_ENV = "INFERSCALE_HTTP_BODY_TIMEOUT_S"  # seconds a client has to send its whole body
# 1 MiB (the API's request limit) at 100 KB/s takes 10 s; a client slower than a third of that is refused.
BODY_TIMEOUT_S = 30.0
BODY_METHODS = {"POST", "PUT", "PATCH"}
DEADLINE_ATTR = "inferscale_deadline"  # on RayServegRPCContext: the caller's deadline, unix time
# The gRPC proxy's HTTP/2 receive window per stream: fixed (no BDP probing), the API's largest request.
GRPC_STREAM_WINDOW_BYTES = 1 << 20  # services/limits.py:Limits.max_request_bytes
GRPC_RECEIVE_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", GRPC_STREAM_WINDOW_BYTES)]


REFUSAL_CODES = {400: "invalid_content_length", 408: "request_timeout", 411: "length_required",
                 413: "request_too_large"}


def _refusal(status: int, message: str) -> list[dict]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": REFUSAL_CODES[status]}}).encode()
    return [{"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body}]


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_bytes`, checked from the headers before reading, and
    read whole within `timeout_s` before the app (Serve's forwarding to a replica) sees the request."""

    def __init__(self, app, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") not in BODY_METHODS:
            return await self.app(scope, receive, send)
        length = None
        for k, v in scope.get("headers") or ():
            if k.lower() == b"content-length":
                length = v
        refusal, n = None, -1
        if length is None:
            refusal = _refusal(411, "send the request body with a Content-Length header")
        else:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                refusal = _refusal(400, "Content-Length is not a number")
            elif n > self.max_bytes:
                refusal = _refusal(413, f"request body is {n} bytes, the transport limit is {self.max_bytes} bytes")
        body = None
        if refusal is None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    body = await _read_declared(receive, n)
            except TimeoutError:
                refusal = _refusal(408, f"the request body did not arrive within {self.timeout_s:g} s")
            except _BodyTooLong:
                refusal = _refusal(400, f"the request body is longer than its Content-Length of {n} bytes")
            if body is None and refusal is None:
                return None  # the client went away before its body was complete: nobody to answer
        if refusal is not None:
            for msg in refusal:
                await send(msg)
            return None
        return await self.app(scope, _replay(body, receive), send)


class _BodyTooLong(Exception):
    pass


async def _read_declared(receive, declared: int) -> bytes | None:
    """The body's bytes (at most `declared`, else _BodyTooLong), or None when the client disconnected first."""
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        if len(body) > declared:
            raise _BodyTooLong()
        if not msg.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive):
    """A `receive` that gives the body already read in one message, then waits on the client's own `receive`
    (which reports the disconnect an app may watch for)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _bind_grpc_to(host: str) -> None:
    from ray.serve._private import default_impl

    plain = default_impl.add_grpc_address

    def add_grpc_address(grpc_server, server_address: str):  # Serve's parameter names: a drop-in replacement
        port = server_address.rsplit(":", 1)[1]
        return plain(grpc_server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    default_impl.add_grpc_address = add_grpc_address


def _fix_grpc_receive_window() -> None:
    """GRPC_RECEIVE_OPTIONS on the gRPC server Serve's proxy makes: it builds it from Ray's
    DEFAULT_GRPC_SERVER_OPTIONS (the list object ray.serve._private.grpc_util imported) after this callback has run
    (ProxyActor.__init__ calls the callback first, the server starts in a task afterwards). Idempotent."""
    from ray.serve._private.constants import DEFAULT_GRPC_SERVER_OPTIONS

    names = {name for name, _ in GRPC_RECEIVE_OPTIONS}
    DEFAULT_GRPC_SERVER_OPTIONS[:] = [o for o in DEFAULT_GRPC_SERVER_OPTIONS if o[0] not in names]
    DEFAULT_GRPC_SERVER_OPTIONS.extend(GRPC_RECEIVE_OPTIONS)


def _carry_grpc_deadline() -> None:
    """Every RayServegRPCContext made in this proxy notes the caller's deadline (time_remaining of the call it
    is made from) as DEADLINE_ATTR; it travels to the replica with the context. Idempotent."""
    import time

    from ray.serve.grpc_util import RayServegRPCContext

    plain = RayServegRPCContext.__init__
    if getattr(plain, "_inferscale_deadline", False):
        return

    def __init__(self, grpc_context):
        plain(self, grpc_context)
        left = grpc_context.time_remaining()
        setattr(self, DEADLINE_ATTR, None if left is None else time.time() + left)

    setattr(__init__, "_inferscale_deadline", True)
    RayServegRPCContext.__init__ = __init__  # type: ignore[method-assign]  # the patch this function exists for


def _send_error_details() -> None:
    """The proxy's status of a failed gRPC call carries the Gateway's google.rpc trailers when the error is an
    errors.ApiError (Serve wraps it in gRPCStatusError: the Gateway set the code on its context). Idempotent."""
    import dataclasses

    from ray.serve._private import proxy
    from ray.serve.exceptions import gRPCStatusError

    plain_status, plain_set = proxy.get_grpc_response_status, proxy.set_grpc_code_and_details
    if getattr(plain_status, "_inferscale_details", False):
        return

    def get_grpc_response_status(exc, request_timeout_s, request_id):
        from .error_details import error_trailers
        from .errors import ApiError

        status = plain_status(exc, request_timeout_s, request_id)
        original = exc.original_exception if isinstance(exc, gRPCStatusError) else None
        if isinstance(original, ApiError) and status.code == original.code:
            return dataclasses.replace(status, headers=list(error_trailers(original)))
        return status

    def set_grpc_code_and_details(context, status):
        plain_set(context, status)
        if status.is_error and status.headers:  # only ever set by get_grpc_response_status above on this path
            context.set_trailing_metadata(tuple(status.headers))

    setattr(get_grpc_response_status, "_inferscale_details", True)
    proxy.get_grpc_response_status, proxy.set_grpc_code_and_details = get_grpc_response_status, set_grpc_code_and_details


def _cancel_streams_left_between_items() -> None:
    """Every ProxyResponseGenerator ray.serve._private.proxy makes cancels its deployment call when the proxy's task
    for the request ends before the stream did (see the module's docstring). Not when the generator is dropped: the
    proxy's closed generator ends in an error whose traceback keeps it, and with it the call, until the garbage
    collector's next cycle. Idempotent."""
    from ray.serve._private import proxy

    plain = proxy.ProxyResponseGenerator
    if getattr(plain, "_inferscale_cancel_when_left", False):
        return

    class CancelledWhenLeft(plain):  # type: ignore[valid-type,misc]  # Serve's class, patched in this process
        _inferscale_cancel_when_left = True

        def __init__(self, response, **kw):
            super().__init__(response, **kw)
            task = asyncio.current_task()  # the proxy's task for this request: made in it, iterated in it
            if task is not None:
                task.add_done_callback(self._cancel_if_left)

        def _cancel_if_left(self, _task) -> None:
            # Serve's own `_done`: set when the stream ended in __anext__ (its end, an error, a timeout, a unary
            # result); a stream Serve cancelled itself is `cancelled()`
            if not self._done and not self._response.cancelled():
                self._response.cancel()

    proxy.ProxyResponseGenerator = CancelledWhenLeft  # type: ignore[misc]  # the patch this function exists for


def max_body_bytes() -> int:
    try:
        return int(os.environ.get(MAX_BODY_ENV, TRANSPORT_MAX_MESSAGE_BYTES))
    except ValueError:
        return TRANSPORT_MAX_MESSAGE_BYTES


def body_timeout_s() -> float:
    """BODY_TIMEOUT_ENV's seconds (positive), else BODY_TIMEOUT_S."""
    try:
        value = float(os.environ.get(BODY_TIMEOUT_ENV, BODY_TIMEOUT_S))
    except ValueError:
        return BODY_TIMEOUT_S
    return value if value > 0 else BODY_TIMEOUT_S


def proxy_setup() -> list:
    """Serve's proxy callback: returns the HTTP proxy's middlewares (and binds the gRPC proxy)."""
    from starlette.middleware import Middleware

    host = os.environ.get(GRPC_HOST_ENV)
    if host:
        _bind_grpc_to(host)
    _fix_grpc_receive_window()
    _carry_grpc_deadline()
    _send_error_details()
    _cancel_streams_left_between_items()
    return [Middleware(BodyLimit, max_bytes=max_body_bytes(), timeout_s=body_timeout_s())]
