"""The wire contract of `inferscale.v1.Memory`: limits, request validation, status codes, proto conversion.

Requests arrive as raw bytes (the handlers are registered without a deserializer) so that a request that is
too big or does not parse answers RESOURCE_EXHAUSTED / INVALID_ARGUMENT naming the problem, instead of the
transport's generic INTERNAL. Validation is pure: it runs before any backend is touched, in the Ray Serve
gateway and in the plain grpc server alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from inferscale_core.errors import InvalidIdError, UnknownFactError, UnknownUserError, check_id

from inferscale_client import codegen
from .registry import DuplicateFactError, FactRecord, Quota, QuotaExceededError, VersionConflictError

pb2, pb2_grpc = codegen.load()
SERVICE = "inferscale.v1.Memory"


@dataclass(frozen=True)
class Limits:
    """Per-request bounds. Over a size bound: RESOURCE_EXHAUSTED; out of a range: INVALID_ARGUMENT."""
    max_request_bytes: int = 1 << 20        # serialized request
    max_fact_chars: int = 2000
    max_facts_per_request: int = 256
    max_messages: int = 100
    max_message_chars: int = 16000
    max_window_turns: int = 16
    max_query_chars: int = 4000
    max_metadata_entries: int = 32
    max_metadata_key_chars: int = 128
    max_metadata_value_chars: int = 1024
    max_facts_per_user: int = 100_000
    max_bytes_per_user: int = 64 << 20     # text + metadata + window of all the user's facts (UTF-8)
    default_k: int = 5
    max_k: int = 64
    default_max_tokens: int = 256
    max_max_tokens: int = 4096
    default_page_size: int = 100
    max_page_size: int = 1000

    def quota(self) -> Quota:
        return Quota(self.max_facts_per_user, self.max_bytes_per_user)


class ApiError(Exception):
    """An answer with a gRPC status code and a message that names the field at fault."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __reduce__(self):  # Ray ships it between processes (replica -> proxy)
        return (ApiError, (self.code, self.message))


def invalid(msg: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def too_big(msg: str) -> ApiError:
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)


def to_api_error(err: BaseException) -> ApiError:
    """Maps the errors the registry and the core raise on purpose to status codes; anything else is a bug
    (INTERNAL), reported without internals. An error raised in another Ray process arrives wrapped: only
    an ApiError it carries is passed on; its traceback never reaches a client."""
    cause = _ray_cause(err)
    if cause is not None:
        if isinstance(cause, ApiError):
            return cause
        if _registry_unreachable(cause):
            return REGISTRY_UNAVAILABLE
        if cause is err:  # the replica or actor itself failed (died, unreachable): retryable
            return ApiError(grpc.StatusCode.UNAVAILABLE,
                            f"a backend replica is unavailable ({type(err).__name__}); retry shortly")
        return ApiError(grpc.StatusCode.INTERNAL,
                        f"internal error ({type(cause).__name__} in a backend replica); see the server log")
    if isinstance(err, ApiError):
        return err
    if isinstance(err, (UnknownFactError, UnknownUserError)):
        return ApiError(grpc.StatusCode.NOT_FOUND, _clean(str(err)))
    if isinstance(err, VersionConflictError):
        return ApiError(grpc.StatusCode.ABORTED, _clean(str(err)))
    if isinstance(err, DuplicateFactError):
        return ApiError(grpc.StatusCode.ALREADY_EXISTS, _clean(str(err)))
    if isinstance(err, QuotaExceededError):
        return too_big(_clean(str(err)))
    if isinstance(err, (InvalidIdError, ValueError, TypeError)):
        return invalid(_clean(str(err)))
    if _registry_unreachable(err):
        return REGISTRY_UNAVAILABLE
    if isinstance(err, TimeoutError):
        return ApiError(grpc.StatusCode.UNAVAILABLE, "a backend replica did not answer in time; retry shortly")
    return ApiError(grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); see the server log")


REGISTRY_UNAVAILABLE = ApiError(grpc.StatusCode.UNAVAILABLE, "the registry (Redis) cannot be reached or is full; retry shortly")


def _registry_unreachable(err: BaseException) -> bool:
    """Redis down, refusing, or not answering in time (redis-py's ConnectionError / TimeoutError)."""
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:
        return False
    from redis.exceptions import ResponseError

    # noeviction at maxmemory: Redis refuses writes ("OOM command not allowed ...") until space is freed
    return isinstance(err, (RedisConnectionError, RedisTimeoutError)) or (
        isinstance(err, ResponseError) and str(err).startswith("OOM"))


def _ray_cause(err: BaseException) -> BaseException | None:
    """The original exception of a Ray task/actor error (the replica's), or None for a local error."""
    try:
        from ray.exceptions import RayError, RayTaskError
    except ImportError:
        return None
    if isinstance(err, RayTaskError):
        return err.cause if isinstance(err.cause, BaseException) else err
    if isinstance(err, RayError):
        return err
    return None


def _clean(message: str, limit: int = 500) -> str:
    """One line, bounded: a message for a client, never a traceback."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first if len(first) <= limit else first[:limit] + "..."


# ------------------------------------------------------------------------------------------ parsing
REQUEST_TYPES = {
    "AddMemory": pb2.AddMemoryRequest, "AddFacts": pb2.AddFactsRequest, "Search": pb2.SearchRequest,
    "Answer": pb2.AnswerRequest, "GetMemory": pb2.GetMemoryRequest, "ListMemories": pb2.ListMemoriesRequest,
    "UpdateMemory": pb2.UpdateMemoryRequest, "DeleteMemory": pb2.DeleteMemoryRequest,
    "DeleteUser": pb2.DeleteUserRequest, "Health": pb2.HealthRequest,
}
STREAMING = {"Answer"}


def parse(method: str, raw, limits: Limits):
    """Raw request bytes (or an already parsed message) -> the request message, or ApiError."""
    cls = REQUEST_TYPES[method]
    if isinstance(raw, cls):
        size = raw.ByteSize()
        msg = raw
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        size = len(raw)
        msg = None
    else:
        raise invalid(f"{method} request must be a serialized {cls.DESCRIPTOR.full_name}")
    if size > limits.max_request_bytes:
        raise too_big(f"{method} request is {size} bytes, the limit is {limits.max_request_bytes} bytes")
    if msg is None:
        msg = cls()
        try:
            msg.ParseFromString(bytes(raw))
        except DecodeError as e:
            raise invalid(f"{method} request is not a valid {cls.DESCRIPTOR.full_name} message ({e})") from None
    return msg


def user_id(value: str, field_name: str = "user_id") -> str:
    try:
        return check_id(field_name, value)
    except InvalidIdError as e:
        raise invalid(str(e)) from None


def fact_id(value: str, field_name: str = "fact_id") -> str:
    return user_id(value, field_name)


def text_field(value: str, name: str, max_chars: int, required: bool = True) -> str:
    if required and not value.strip():
        raise invalid(f"{name} must not be empty")
    if len(value) > max_chars:
        raise too_big(f"{name} is {len(value)} characters long, the limit is {max_chars}")
    return value


def metadata(value, name: str, limits: Limits) -> dict[str, str]:
    if len(value) > limits.max_metadata_entries:
        raise too_big(f"{name} has {len(value)} entries, the limit is {limits.max_metadata_entries}")
    for k, v in value.items():
        if not k:
            raise invalid(f"{name} has an empty key")
        if len(k) > limits.max_metadata_key_chars:
            raise too_big(f"{name} key {k[:40]!r}... is {len(k)} characters, the limit is "
                          f"{limits.max_metadata_key_chars}")
        if len(v) > limits.max_metadata_value_chars:
            raise too_big(f"{name}[{k!r}] is {len(v)} characters, the limit is {limits.max_metadata_value_chars}")
    return dict(value)


def bounded_int(value: int, name: str, lo: int, hi: int, default: int) -> int:
    """0 means 'server default'; otherwise lo <= value <= hi or INVALID_ARGUMENT."""
    if value == 0:
        return default
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}] (or 0 for the default {default}), got {value}")
    return value


@dataclass(frozen=True)
class FactIn:
    text: str
    metadata: dict = field(default_factory=dict)
    window: tuple[str, ...] = ()


def facts_in(facts, limits: Limits) -> list[FactIn]:
    if not facts:
        raise invalid("facts must not be empty")
    if len(facts) > limits.max_facts_per_request:
        raise too_big(f"facts has {len(facts)} entries, the limit is {limits.max_facts_per_request} per request")
    out = []
    for i, f in enumerate(facts):
        text = text_field(f.text, f"facts[{i}].text", limits.max_fact_chars)
        if len(f.window) > limits.max_window_turns:
            raise too_big(f"facts[{i}].window has {len(f.window)} turns, the limit is {limits.max_window_turns}")
        for j, turn in enumerate(f.window):
            text_field(turn, f"facts[{i}].window[{j}]", limits.max_message_chars, required=False)
        out.append(FactIn(text.strip(), metadata(f.metadata, f"facts[{i}].metadata", limits), tuple(f.window)))
    return out


ROLES = ("system", "user", "assistant")


def messages_in(messages, limits: Limits) -> list[dict[str, str]]:
    if not messages:
        raise invalid("messages must not be empty")
    if len(messages) > limits.max_messages:
        raise too_big(f"messages has {len(messages)} entries, the limit is {limits.max_messages}")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}")
        text_field(m.content, f"messages[{i}].content", limits.max_message_chars)
        out.append({"role": m.role, "content": m.content})
    return out


def page_token(token: str) -> int:
    if not token:
        return 0
    if not token.isdigit() or len(token) > 12:
        raise invalid(f"page_token {token[:40]!r} is not a token this server issued")
    return int(token)


MODES = ("inject", "prompt")


def answer_mode(mode: str) -> str:
    if mode == "":
        return "inject"
    if mode not in MODES:
        raise invalid(f"mode must be one of {', '.join(MODES)} (or empty for inject), got {mode!r}")
    return mode


# --------------------------------------------------------------------------------------- conversion
def fact_pb(rec: FactRecord):
    return pb2.Fact(fact_id=rec.fact_id, user_id=rec.user_id, text=rec.text,
                    metadata={str(k): str(v) for k, v in rec.metadata.items()}, version=rec.version,
                    created_at=rec.created_at, updated_at=rec.updated_at, unservable_reason=rec.unservable_reason)


# ------------------------------------------------------------------------------- grpc registration
def _method_handlers(servicer) -> dict:
    """Handlers WITHOUT a request deserializer: each method receives the request's raw bytes."""
    handlers = {}
    for name in REQUEST_TYPES:
        fn = getattr(servicer, name)
        make = grpc.unary_stream_rpc_method_handler if name in STREAMING else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(fn, request_deserializer=None, response_serializer=lambda m: m.SerializeToString())
    return handlers


HEALTH_SERVICE = "grpc.health.v1.Health"  # the standard health service (load balancers, Kubernetes gRPC probes)


def _health_handlers(servicer) -> dict:
    """grpc.health.v1.Health's Check and Watch, also raw bytes in (services/gateway/grpc_front.py parses them)."""
    return {"Check": grpc.unary_unary_rpc_method_handler(servicer.Check, request_deserializer=None,
                                                         response_serializer=lambda m: m.SerializeToString()),
            "Watch": grpc.unary_stream_rpc_method_handler(servicer.Watch, request_deserializer=None,
                                                          response_serializer=lambda m: m.SerializeToString())}


def add_MemoryServicer_to_server(servicer, server) -> None:  # noqa: N802 (the name gRPC tooling expects)
    """What Ray Serve's `grpc_servicer_functions` points at; also used by the plain grpc server. Registers
    inferscale.v1.Memory and the standard grpc.health.v1.Health (the servicer has Check and Watch too)."""
    from grpc_health.v1 import health_pb2  # noqa: F401 - its descriptor, for server reflection in this process

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _method_handlers(servicer)),))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HEALTH_SERVICE,
                                                                          _health_handlers(servicer)),))


SERVICER_FUNCTION = f"{__name__}.add_MemoryServicer_to_server"
