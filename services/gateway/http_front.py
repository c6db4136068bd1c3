"""The HTTP front door: an OpenAI-compatible `POST /v1/chat/completions` over a GatewayCore (FastAPI, mounted by
the Serve ingress). The bearer token in `Authorization` says who calls; the memory used is the request's
`user`, which defaults to the token's subject (another user's needs the memory:admin scope)."""
from __future__ import annotations

import json
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import api
from ..api import ApiError, pb2
from ..auth import Principal

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


def error_response(err: ApiError) -> JSONResponse:
    """An OpenAI-style error object; 401 carries the WWW-Authenticate challenge."""
    headers = {"WWW-Authenticate": "Bearer"} if err.code == grpc.StatusCode.UNAUTHENTICATED else None
    kind = ("invalid_request_error" if err.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
            else "authentication_error" if err.code == grpc.StatusCode.UNAUTHENTICATED
            else "permission_error" if err.code == grpc.StatusCode.PERMISSION_DENIED else "api_error")
    return JSONResponse(status_code=HTTP_STATUS.get(err.code, 500), headers=headers, content={
        "error": {"message": err.message, "type": kind, "code": err.code.name.lower()}})


def build_http_app(core_getter):
    """FastAPI app with the OpenAI-compatible chat endpoint. `core_getter()` returns the GatewayCore (the
    Serve deployment builds its core in __init__, after the app object exists)."""
    from .grpc_front import status_of

    app = FastAPI(title="InferScale", docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        core = core_getter()
        try:
            # Authentication first: an unauthenticated caller learns nothing about the request's validity.
            caller = core.authenticate("Answer", request.headers.get("authorization"))
            body = await request.body()
            if len(body) > core.limits.max_request_bytes:
                raise api.too_big(f"request body is {len(body)} bytes, the limit is "
                                  f"{core.limits.max_request_bytes} bytes")
            areq, stream, model = _chat_to_answer(body, caller, core.auth.enabled)
            raw = areq.SerializeToString()
            gen = core.Answer(raw, caller)
            first = await gen.__anext__()  # validation and backend errors surface before any byte is sent
        except StopAsyncIteration:
            return error_response(ApiError(grpc.StatusCode.INTERNAL, "the engine produced no output"))
        except Exception as e:  # noqa: BLE001
            return error_response(status_of("chat.completions", e))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return StreamingResponse(_sse(gen, first, cid, created, model), media_type="text/event-stream")
        text, last = first.text, first
        async for chunk in gen:
            text += chunk.text
            last = chunk
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": last.finish_reason or "stop"}],
                "usage": {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                          "total_tokens": last.prompt_tokens + last.completion_tokens},
                "inferscale": {"fact_ids": list(last.fact_ids), "ttft_ms": last.ttft_ms,
                               "prefilled_tokens": last.prefilled_tokens}}

    @app.get("/healthz")
    async def healthz():  # open, like the gRPC Health
        h = await core_getter().Health(b"")
        return JSONResponse(status_code=200 if h.status == "SERVING" else 503,
                            content={"status": h.status, "components": dict(h.components)})

    return app


def _chat_to_answer(body: bytes, caller: Principal, auth_enabled: bool):
    """OpenAI chat request -> (AnswerRequest, stream, model). The last user message is the query; `user`
    selects whose memory is used (default: the token's subject); `k` and `inferscale_mode` are InferScale
    extensions."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.invalid(f"request body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise api.invalid("request body must be a JSON object")
    user = data.get("user")
    if user is None and auth_enabled:
        user = caller.subject
    if not isinstance(user, str) or not user:
        raise api.invalid("`user` is required: it selects whose memory answers the request")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise api.invalid("`messages` must be a non-empty list")
    queries = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not queries or not isinstance(queries[-1], str):
        raise api.invalid("`messages` must contain a user message with string content")

    def num(name, kind, default):
        v = data.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, kind):
            raise api.invalid(f"`{name}` must be a {'number' if kind is not int else 'integer'}, got {v!r}"[:300])
        return v

    max_tokens = num("max_completion_tokens", int, None) or num("max_tokens", int, 0)
    k = num("k", int, 0)
    for name, v in (("max_tokens", max_tokens), ("k", k)):
        if not -(1 << 31) <= v < (1 << 31):  # the proto's int32: out of range is the caller's error, not a crash
            raise api.invalid(f"`{name}` is out of range, got {v}")
    try:
        temperature = float(num("temperature", (int, float), 0.0))
    except OverflowError:
        raise api.invalid("`temperature` is out of range") from None
    req = pb2.AnswerRequest(user_id=user, query=queries[-1], k=k, max_tokens=max_tokens, temperature=temperature,
                            mode=str(data.get("inferscale_mode", ""))[:64])
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise api.invalid(f"`stream` must be a boolean, got {stream!r}"[:300])
    return req, stream, str(data.get("model", "inferscale"))[:256]


async def _sse(gen, first, cid: str, created: int, model: str):
    def event(delta: dict, finish=None, extra=None) -> str:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if extra:
            obj["inferscale"] = extra
        return f"data: {json.dumps(obj)}\n\n"

    yield event({"role": "assistant", "content": ""})
    chunk = first
    while True:
        if chunk.final:
            if chunk.text:
                yield event({"content": chunk.text})
            yield event({}, chunk.finish_reason or "stop",
                        {"fact_ids": list(chunk.fact_ids), "ttft_ms": chunk.ttft_ms,
                         "prefilled_tokens": chunk.prefilled_tokens})
            break
        yield event({"content": chunk.text})
        try:
            chunk = await gen.__anext__()
        except StopAsyncIteration:
            break
    yield "data: [DONE]\n\n"
