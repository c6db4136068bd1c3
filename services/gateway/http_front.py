"""The HTTP front door: OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models` over a GatewayCore
(FastAPI, mounted by the Serve ingress). The bearer token in `Authorization` says who calls; the memory used is
the request's `safety_identifier` or `user`, which default to the token's subject (another user's needs the
memory:admin scope). Errors are OpenAI error objects, also mid-stream (docs/deploy.md, "OpenAI clients")."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import api
from ..admission import EngineAtCapacity
from ..api import ApiError, pb2
from ..auth import Principal

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


MODEL_ID = "inferscale"  # the one model this endpoint serves: the serving LLM with each user's memory injected
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions
# Parameters that would change the answer and that this endpoint cannot honour: refused, never silently dropped.
UNSUPPORTED = {"tools": "tool calling", "functions": "function calling", "tool_choice": "tool calling",
               "logprobs": "log probabilities", "top_logprobs": "log probabilities", "stop": "stop sequences",
               "audio": "audio output", "prediction": "predicted outputs", "logit_bias": "logit bias"}


def error_body(err: ApiError) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}} (the message names the field).
    Overload (EngineAtCapacity) is OpenAI's 429 kind: type "rate_limit_error", code "engine_at_capacity"."""
    if isinstance(err, EngineAtCapacity):
        return {"error": {"message": err.message, "type": "rate_limit_error", "param": None,
                          "code": "engine_at_capacity"}}
    kind = ("invalid_request_error" if err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
            else "authentication_error" if err.code == grpc.StatusCode.UNAUTHENTICATED
            else "permission_error" if err.code == grpc.StatusCode.PERMISSION_DENIED else "api_error")
    code = "model_not_found" if isinstance(err, ModelNotFound) else err.code.name.lower()
    return {"error": {"message": err.message, "type": kind, "param": None, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    """An OpenAI error object with the status code of `err`; 401 carries the WWW-Authenticate challenge.
    Overload is 429 with Retry-After (RESOURCE_EXHAUSTED for a too-large request or a quota stays 413)."""
    if isinstance(err, EngineAtCapacity):
        return JSONResponse(status_code=429, headers={"Retry-After": str(err.retry_after_s)}, content=error_body(err))
    headers = {"WWW-Authenticate": "Bearer"} if err.code == grpc.StatusCode.UNAUTHENTICATED else None
    return JSONResponse(status_code=HTTP_STATUS.get(err.code, 500), headers=headers, content=error_body(err))


class ModelNotFound(ApiError):
    def __init__(self, model: str):
        super().__init__(grpc.StatusCode.NOT_FOUND, f"the model {model[:100]!r} does not exist; this endpoint serves "
                                                    f"{MODEL_ID!r} (GET /v1/models)")


@dataclass
class ChatCall:
    """An OpenAI chat request as InferScale runs it."""
    answer: pb2.AnswerRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    model: str


class _Outcome:
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


def build_http_app(core_getter, metrics_getter=None):
    """FastAPI app with the OpenAI-compatible endpoints. `core_getter()` returns the GatewayCore (the Serve
    deployment builds its core in __init__, after the app object exists); `metrics_getter()` the replica's
    DeploymentMetrics (None: not counted)."""
    from .grpc_front import status_of

    def metrics():
        return metrics_getter() if metrics_getter is not None else None

    app = FastAPI(title="InferScale", docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        core = core_getter()
        done = _Outcome(metrics(), "chat.completions")
        try:
            # A declared size over the limit is refused from the headers alone (it says nothing about a user);
            # then authentication: an unauthenticated caller learns nothing about the request's validity.
            _check_declared_size(request, core.limits.max_request_bytes)
            caller = await core.authenticate("Answer", request.headers.get("authorization"))
            body = await read_body(request, core.limits.max_request_bytes)
            # A large JSON body is parsed in a worker thread: the replica's other streams keep running.
            call = (chat_call(body, caller, core.auth.enabled) if len(body) <= PARSE_INLINE_BYTES
                    else await asyncio.to_thread(chat_call, body, caller, core.auth.enabled))
            gen = core.Answer(call.answer.SerializeToString(), caller)
            first = await gen.__anext__()  # validation and backend errors surface before any byte is sent
        except StopAsyncIteration:
            err = ApiError(grpc.StatusCode.INTERNAL, "the engine produced no output")
            done(err.code)
            return error_response(err)
        except Exception as e:  # noqa: BLE001
            err = status_of("chat.completions", e)
            done(err.code)
            return error_response(err)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if call.stream:
            return StreamingResponse(_sse(gen, first, cid, created, call, done), media_type="text/event-stream")
        text, last = first.text, first
        try:
            async for chunk in gen:
                text += chunk.text
                last = chunk
        except Exception as e:  # noqa: BLE001 - nothing was sent yet: a plain error answer
            err = status_of("chat.completions", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return {"id": cid, "object": "chat.completion", "created": created, "model": call.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": last.finish_reason or "stop"}],
                "usage": _usage(last), "inferscale": _extra(last)}

    @app.get("/v1/models")
    async def models(request: Request):
        done = _Outcome(metrics(), "models")
        try:
            await core_getter().authenticate("Answer", request.headers.get("authorization"))
        except Exception as e:  # noqa: BLE001
            err = status_of("models", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        done = _Outcome(metrics(), "models")
        try:
            await core_getter().authenticate("Answer", request.headers.get("authorization"))
            if model != MODEL_ID:
                raise ModelNotFound(model)
        except Exception as e:  # noqa: BLE001
            err = status_of("models", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return _model_card()

    from .mem0_http import mount_mem0  # Mem0's memory API on the same app (its own module)

    mount_mem0(app, core_getter, metrics_getter)

    @app.get("/healthz")
    async def healthz():  # open, like the gRPC Health
        h = await core_getter().health_state()
        return JSONResponse(status_code=200 if h.status == "SERVING" else 503,
                            content={"status": h.status, "components": dict(h.components)})

    return app


_STARTED = int(time.time())


def _model_card() -> dict:
    return {"id": MODEL_ID, "object": "model", "created": _STARTED, "owned_by": "inferscale"}


def _usage(last) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def _extra(last) -> dict:
    """InferScale's own fields next to OpenAI's: which facts were injected, TTFT, tokens actually prefilled, and
    the per-hop timings of AnswerChunk.timings_ms."""
    return {"fact_ids": list(last.fact_ids), "ttft_ms": last.ttft_ms, "prefilled_tokens": last.prefilled_tokens,
            "timings_ms": dict(last.timings_ms)}


PARSE_INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (well under a millisecond)


def _check_declared_size(request: Request, max_bytes: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise api.too_big(f"request body is {int(declared)} bytes, the limit is {max_bytes} bytes")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, read piece by piece and refused (413) as soon as it passes `max_bytes`: a body is
    never held whole before its size is known."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise api.too_big(f"request body is over the limit of {max_bytes} bytes")
    return bytes(body)


def chat_call(body: bytes, caller: Principal, auth_enabled: bool) -> ChatCall:
    """OpenAI chat request -> ChatCall. The last message is the question (a user message); the messages before
    it (system/developer messages, earlier turns) follow the injected memory in the chat template. `user` or
    `safety_identifier` name whose memory is used (default: the token's subject; another user's needs the
    memory:admin scope, checked by the core). `k` and `inferscale_mode` are InferScale extensions."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.invalid(f"request body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise api.invalid("request body must be a JSON object")
    model = data.get("model", MODEL_ID)
    if model is not None and model != MODEL_ID:
        raise ModelNotFound(str(model))
    for name, what in UNSUPPORTED.items():
        if data.get(name) not in (None, False, [], {}, ""):
            raise api.invalid(f"`{name}` is not supported: this endpoint does not do {what}")
    if data.get("n") not in (None, 1):
        raise api.invalid(f"`n` must be 1 (one answer per request), got {data.get('n')!r}"[:300])
    fmt = data.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise api.invalid("`response_format` must be {\"type\": \"text\"}: structured output is not supported")
    conversation, question = _messages(data.get("messages"))

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
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise api.invalid(f"`stream` must be a boolean, got {stream!r}"[:300])
    opts = data.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise api.invalid("`stream_options` must be an object, and only with `stream: true`")
    include_usage = (opts or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise api.invalid("`stream_options.include_usage` must be a boolean")
    mode = data.get("inferscale_mode", "")
    if not isinstance(mode, str):
        raise api.invalid("`inferscale_mode` must be a string")
    req = pb2.AnswerRequest(user_id=_memory_owner(data, caller, auth_enabled), query=question, k=k,
                            max_tokens=max_tokens, temperature=temperature, mode=mode[:64], messages=conversation)
    return ChatCall(req, stream, include_usage, MODEL_ID)


def _memory_owner(data: dict, caller: Principal, auth_enabled: bool) -> str:
    """`safety_identifier` (OpenAI's successor of `user`) or `user`; with auth on and neither, the token's
    subject. Whether the caller may use that user's memory is decided by the core (PERMISSION_DENIED)."""
    named = {}
    for field in ("safety_identifier", "user"):
        v = data.get(field)
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise api.invalid(f"`{field}` is required to be a non-empty string when sent: it selects whose "
                              "memory answers the request")
        named[field] = v
    if len(set(named.values())) > 1:
        raise api.invalid("`user` and `safety_identifier` name different users; send one of them")
    if named:
        return next(iter(named.values()))
    if auth_enabled:
        return caller.subject
    raise api.invalid("`user` is required (or `safety_identifier`): it selects whose memory answers the request")


def _messages(raw) -> tuple[list[pb2.Message], str]:
    """OpenAI messages -> (the conversation before the question, the question)."""
    if not isinstance(raw, list) or not raw:
        raise api.invalid("`messages` must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise api.invalid(f"messages[{i}] must be an object with `role` and `content`")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in api.ROLES:
            raise api.invalid(f"messages[{i}].role must be one of system, developer, user, assistant; "
                              f"got {role!r}"[:300])
        out.append(pb2.Message(role=role, content=_text(m.get("content"), f"messages[{i}].content")))
    if out[-1].role != "user":
        raise api.invalid("`messages` must end with a user message: its content is the question")
    return out[:-1], out[-1].content


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (what most SDKs and `vllm bench` send), joined
    with newlines like vLLM does. Images, audio and files are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.invalid(f"{where} must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise api.invalid(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                              f"got type {str(kind)[:40]!r}: only text is supported")
        parts.append(part["text"])
    if not parts:
        raise api.invalid(f"{where} is an empty list")
    return "\n".join(parts)


async def _sse(gen, first, cid: str, created: int, call: ChatCall, done):
    """Server-sent events as OpenAI streams them. An error after the first event ends the stream with an
    OpenAI error object (`data: {"error": ...}`), which the openai client raises as an APIError."""
    from .grpc_front import status_of

    def event(delta: dict, finish=None, extra=None) -> str:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": call.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if call.include_usage:
            obj["usage"] = None
        if extra:
            obj["inferscale"] = extra
        return f"data: {json.dumps(obj)}\n\n"

    code = grpc.StatusCode.OK
    try:
        yield event({"role": "assistant", "content": ""})
        chunk = first
        while True:
            if chunk.final:
                if chunk.text:
                    yield event({"content": chunk.text})
                yield event({}, chunk.finish_reason or "stop", _extra(chunk))
                if call.include_usage:
                    yield "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                                 "model": call.model, "choices": [], "usage": _usage(chunk)}) + "\n\n"
                break
            yield event({"content": chunk.text})
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                break
    except (GeneratorExit, asyncio.CancelledError):  # the client went away
        code = grpc.StatusCode.CANCELLED
        raise
    except Exception as e:  # noqa: BLE001 - mid-stream: the status line is gone, the error goes in the stream
        err = status_of("chat.completions", e)
        code = err.code
        yield f"data: {json.dumps(error_body(err))}\n\n"
    finally:
        done(code)
    yield "data: [DONE]\n\n"
