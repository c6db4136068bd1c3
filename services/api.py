"""The wire contract of `inferscale.v1.Memory`: limits, request validation, status codes, proto conversion.

Requests arrive as raw bytes (the handlers are registered without a deserializer) so that a request that is
too big or does not parse answers RESOURCE_EXHAUSTED / INVALID_ARGUMENT naming the problem, instead of the
transport's generic INTERNAL. Validation is pure: it runs before any backend is touched, in the Ray Serve
gateway and in the plain grpc server alike.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from inferscale_client import codegen
from inferscale_core.errors import InvalidIdError, UnknownFactError, UnknownUserError, check_id
from inferscale_core.types import Mode, check_user_id

from .registry import (
    DuplicateFactError,
    FactRecord,
    Quota,
    QuotaExceededError,
    UnconfirmedWriteError,
    VersionConflictError,
)

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
    max_window_chars: int = 16000          # a caller's window, all turns together: what one fact is encoded behind
    # What one write asks the shared encoder pool to encode: the facts' texts and the windows they are encoded
    # behind (the caller's, or the user's latest facts), ~4 characters a token: about 32 forwards of 4k tokens.
    max_encode_chars_per_request: int = 524_288
    max_query_chars: int = 4000
    max_metadata_entries: int = 32
    max_metadata_key_chars: int = 128
    max_metadata_value_chars: int = 1024
    max_facts_per_user: int = 100_000
    # What the user's facts take in Redis: text + metadata + window (UTF-8) and registry.FACT_STORED_BYTES a fact
    # (embedding and Redis's own keys): ~18,000 facts of LoCoMo's size, 64 MiB of the registry's memory at most.
    max_bytes_per_user: int = 64 << 20
    max_kv_bytes_per_user: int = 16 << 30  # KV of all the user's facts (tokens x the model's KV bytes per token)
    default_k: int = 5
    max_k: int = 200  # Mem0 retrieves up to 200 facts per query (~7K tokens): the size KV injection is for
    default_max_tokens: int = 256
    max_max_tokens: int = 4096
    default_page_size: int = 100
    max_page_size: int = 1000
    # Each caller's (token subject's) share of a gateway replica; admins are not limited
    # (services/gateway/principal_limits.py): requests at once, and a rate with its burst.
    max_in_flight_per_caller: int = 64
    requests_per_s_per_caller: float = 100.0
    request_burst_per_caller: int = 200

    def quota(self) -> Quota:
        return Quota(self.max_facts_per_user, self.max_bytes_per_user, self.max_kv_bytes_per_user)


class ApiError(Exception):
    """An answer with a gRPC status code and a message that names the field at fault. What a client needs to act
    on it travels as google.rpc details (error_status below): `field`, the request field
    at fault (BadRequest); `retry_after_s`, set only where the same call may succeed after that long (RetryInfo:
    overload, a replica restarting); `quota`, the QuotaExceededError of a per-user quota (QuotaFailure: do not
    retry); `reason`, a stable UPPER_SNAKE_CASE name (ErrorInfo; the status code's name when unset)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, field: str | None = None,
                 retry_after_s: float | None = None, quota: QuotaExceededError | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.field, self.retry_after_s, self.quota, self.reason = field, retry_after_s, quota, reason

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __reduce__(self):  # Ray ships it between processes (replica -> proxy), details included
        return (ApiError, (self.code, self.message), {"field": self.field, "retry_after_s": self.retry_after_s,
                                                      "quota": self.quota, "reason": self.reason})


# ------------------------------------------------------------------------------------- error details
ERROR_DOMAIN = SERVICE  # google.rpc.ErrorInfo.domain: whose `reason` names these are
DETAILS_KEY = "grpc-status-details-bin"  # the trailer a google.rpc.Status travels in (grpcio-status reads it)
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry policy: wait this long, or (negative) do not retry
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)  # what clients' policies retry


def error_status(err: ApiError):
    """The google.rpc.Status of an error: its code and message, and as details an ErrorInfo (always: a stable
    reason), BadRequest naming the field at fault, QuotaFailure for a per-user quota, RetryInfo with the delay
    where a retry can succeed (overload, a replica restarting). RESOURCE_EXHAUSTED is told apart this way:
    RetryInfo means "overloaded, retry after the delay", QuotaFailure or BadRequest means "do not retry"."""
    from google.protobuf import duration_pb2
    from google.rpc import error_details_pb2, status_pb2

    details = [error_details_pb2.ErrorInfo(reason=err.reason or err.code.name, domain=ERROR_DOMAIN)]
    if err.field:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.message)]))
    if err.quota is not None:
        details.append(error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
            subject=f"user:{err.quota.user_id}", description=err.message, quota_id=err.quota.quota_id,
            quota_value=int(err.quota.limit))]))
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(err.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    for d in details:
        status.details.add().Pack(d)
    return status


def error_trailers(err: ApiError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata of a refused call: the google.rpc.Status (error_status), and for the codes clients
    retry, gRPC's retry pushback: the RetryInfo delay, or -1 (do not retry: a quota, a size limit, a
    permanent UNAVAILABLE), so a client's standard retry policy needs no knowledge of the details."""
    out: list[tuple[str, str | bytes]] = [(DETAILS_KEY, error_status(err).SerializeToString())]
    if err.code in RETRIED_CODES:
        out.append((PUSHBACK_KEY, str(-1 if err.retry_after_s is None else int(err.retry_after_s * 1000))))
    return tuple(out)


# ------------------------------------------------------------------------------------------ deadlines
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


RETRY_AFTER_S = 1.0  # RetryInfo of a backend that is restarting or unreachable: worth one more try after this


def invalid(msg: str, field: str | None = None) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, msg, field=field)


def too_big(msg: str, field: str | None = None) -> ApiError:
    """A request, or a field of it, over a size limit: RESOURCE_EXHAUSTED with BadRequest (never retried)."""
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, msg, field=field,
                    reason="FIELD_TOO_LARGE" if field else "REQUEST_TOO_LARGE")


def unavailable(msg: str, retry_after_s: float | None = RETRY_AFTER_S) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, msg, retry_after_s=retry_after_s)


def to_api_error(err: BaseException) -> ApiError:
    """Maps the errors the registry and the core raise on purpose to status codes; anything else is a bug
    (INTERNAL), reported without internals. An error raised in another Ray process arrives wrapped: only
    an ApiError it carries is passed on; its traceback never reaches a client."""
    cause = _ray_cause(err)
    if cause is not None:
        if isinstance(cause, ApiError):
            return cause
        if (registry := _registry_error(cause)) is not None:
            return registry
        if cause is err:  # the replica or actor itself failed (died, unreachable): retryable
            return unavailable(f"a backend replica is unavailable ({type(err).__name__}); retry shortly")
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
        return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, _clean(str(err)), quota=err, reason="QUOTA_EXCEEDED")
    if isinstance(err, (InvalidIdError, ValueError, TypeError)):
        return invalid(_clean(str(err)))
    if (registry := _registry_error(err)) is not None:
        return registry
    if isinstance(err, TimeoutError):
        return unavailable("a backend replica did not answer in time; retry shortly")
    return ApiError(grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); see the server log")


REGISTRY_UNAVAILABLE = unavailable("the registry (Redis) cannot be reached; retry shortly")
REGISTRY_FULL_RETRY_S = 10.0  # a full Redis frees space only when facts or users are deleted: not within a second
REGISTRY_FULL = ApiError(grpc.StatusCode.UNAVAILABLE, "the registry (Redis) is full (at its maxmemory): nothing was "
                         "written; reads and deletes still work; retry once facts or users have been deleted",
                         retry_after_s=REGISTRY_FULL_RETRY_S, reason="REGISTRY_FULL")


def _registry_error(err: BaseException) -> ApiError | None:
    """The registry's Redis full, unreachable, or unable to confirm a write: UNAVAILABLE, each with its retry hint;
    None for anything else."""
    if registry_full(err):
        return REGISTRY_FULL
    if isinstance(err, UnconfirmedWriteError):
        return ApiError(grpc.StatusCode.UNAVAILABLE, f"{_clean(err.message)}; {UNCONFIRMED_ADVICE}",
                        retry_after_s=RETRY_AFTER_S, reason="WRITE_UNCONFIRMED")
    if _registry_unreachable(err):
        return REGISTRY_UNAVAILABLE
    return None


# What a repeated request does when the first one was applied after all (docs/deploy.md, "Failover").
UNCONFIRMED_ADVICE = ("a retry is safe for a delete (NOT_FOUND if it was applied), an update with an expected "
                      "version (ABORTED if it was applied) and DeleteUser; read before retrying an add, which may "
                      "store the facts twice")


def _registry_unreachable(err: BaseException) -> bool:
    """Redis down, refusing, or not answering in time (redis-py's ConnectionError / TimeoutError); on a Redis
    Cluster also what a failover or a slot move shows while it lasts: a cluster that is down (CLUSTERDOWN,
    MASTERDOWN), a slot no master serves, a slot being moved (TRYAGAIN) or moved (MOVED, ASK, when the redirections
    ran out), a master demoted to a replica (READONLY), no node reachable to learn the slots from."""
    try:
        from redis.exceptions import (
            AskError,
            ClusterDownError,
            ReadOnlyError,
            RedisClusterException,
            SlotNotCoveredError,
            TryAgainError,
        )
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:
        return False
    # A plain RedisClusterException: no startup node answered; its subclasses other than SlotNotCoveredError
    # (a cross-slot transaction, a bad pipeline) are bugs.
    return (type(err) is RedisClusterException
            or isinstance(err, (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError,
                                TryAgainError, AskError, ReadOnlyError)))


def registry_full(err: BaseException) -> bool:
    """Redis at maxmemory under noeviction refusing a write ("OOM command not allowed when used memory >
    'maxmemory'"), in every form redis-py raises it: OutOfMemoryError (a ResponseError; its message lacks the
    "OOM" code), with "Command # N (...) of pipeline caused error: " in front for a command of a pipeline or
    MULTI/EXEC, or a plain ResponseError "Error running script ... -OOM command not allowed ..." from a Lua script
    on Redis 6."""
    try:
        from redis import exceptions
    except ImportError:
        return False
    oom = getattr(exceptions, "OutOfMemoryError", ())  # redis-py >= 4.2
    return isinstance(err, oom) or (isinstance(err, exceptions.ResponseError)
                                    and "command not allowed when used memory > 'maxmemory'" in str(err))


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
        raise invalid(f"{method} request must be a serialized {cls.DESCRIPTOR.full_name}")  # no field: the whole request
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
    """A caller's user id (also a token's subject and a Mem0 scope value): printable, bounded, not reserved."""
    try:
        return check_user_id(field_name, value)
    except InvalidIdError as e:
        raise invalid(str(e), field_name) from None


def fact_id(value: str, field_name: str = "fact_id") -> str:
    try:
        return check_id(field_name, value)
    except InvalidIdError as e:
        raise invalid(str(e), field_name) from None


def text_field(value: str, name: str, max_chars: int, required: bool = True) -> str:
    if required and not value.strip():
        raise invalid(f"{name} must not be empty", name)
    if len(value) > max_chars:
        raise too_big(f"{name} is {len(value)} characters long, the limit is {max_chars}", name)
    return value


def metadata(value, name: str, limits: Limits) -> dict[str, str]:
    if len(value) > limits.max_metadata_entries:
        raise too_big(f"{name} has {len(value)} entries, the limit is {limits.max_metadata_entries}", name)
    for k, v in value.items():
        if not k:
            raise invalid(f"{name} has an empty key", name)
        if len(k) > limits.max_metadata_key_chars:
            raise too_big(f"{name} key {k[:40]!r}... is {len(k)} characters, the limit is "
                          f"{limits.max_metadata_key_chars}", name)
        if len(v) > limits.max_metadata_value_chars:
            raise too_big(f"{name}[{k!r}] is {len(v)} characters, the limit is {limits.max_metadata_value_chars}",
                          name)
    return dict(value)


def bounded_int(value: int, name: str, lo: int, hi: int, default: int) -> int:
    """0 means 'server default'; otherwise lo <= value <= hi or INVALID_ARGUMENT."""
    if value == 0:
        return default
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}] (or 0 for the default {default}), got {value}", name)
    return value


@dataclass(frozen=True)
class FactIn:
    text: str
    metadata: dict = field(default_factory=dict)
    window: tuple[str, ...] = ()


def facts_in(facts, limits: Limits) -> list[FactIn]:
    if not facts:
        raise invalid("facts must not be empty", "facts")
    if len(facts) > limits.max_facts_per_request:
        raise too_big(f"facts has {len(facts)} entries, the limit is {limits.max_facts_per_request} per request",
                      "facts")
    out = []
    for i, f in enumerate(facts):
        text = text_field(f.text, f"facts[{i}].text", limits.max_fact_chars)
        if len(f.window) > limits.max_window_turns:
            raise too_big(f"facts[{i}].window has {len(f.window)} turns, the limit is {limits.max_window_turns}",
                          f"facts[{i}].window")
        for j, turn in enumerate(f.window):
            text_field(turn, f"facts[{i}].window[{j}]", limits.max_message_chars, required=False)
        window_chars = sum(len(turn) for turn in f.window)
        if window_chars > limits.max_window_chars:
            raise too_big(f"facts[{i}].window holds {window_chars} characters, the limit is {limits.max_window_chars}",
                          f"facts[{i}].window")
        out.append(FactIn(text.strip(), metadata(f.metadata, f"facts[{i}].metadata", limits), tuple(f.window)))
    return out


ROLES = ("system", "user", "assistant")


def messages_in(messages, limits: Limits) -> list[dict[str, str]]:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    if len(messages) > limits.max_messages:
        raise too_big(f"messages has {len(messages)} entries, the limit is {limits.max_messages}", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}", f"messages[{i}].role")
        text_field(m.content, f"messages[{i}].content", limits.max_message_chars)
        out.append({"role": m.role, "content": m.content})
    return out


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


# The API's names of the modes (the proto's AnswerRequest.mode, HTTP's inferscale_mode, metric labels): the one
# place they map to inferscale_core's Mode.
WIRE_MODES = {"inject": Mode.KV, "prompt": Mode.PI}
_MODE_NAMES = {mode: name for name, mode in WIRE_MODES.items()}


def answer_mode(mode: str) -> Mode:
    """A request's mode ("" = inject) -> Mode; INVALID_ARGUMENT naming the choices otherwise."""
    if mode == "":
        return Mode.KV
    if mode not in WIRE_MODES:
        raise invalid(f"mode must be one of {', '.join(WIRE_MODES)} (or empty for inject), got {mode!r}", "mode")
    return WIRE_MODES[mode]


def wire_mode(mode: Mode) -> str:
    """The API's name of a Mode ("inject", "prompt")."""
    return _MODE_NAMES[Mode(mode)]


# --------------------------------------------------------------------------------------- conversion
def fact_pb(rec: FactRecord):
    """A record as the wire's Fact; expires_at unset when the record never expires (FactRecord's inf)."""
    pb = pb2.Fact(fact_id=rec.fact_id, user_id=rec.user_id, text=rec.text,
                  metadata={str(k): str(v) for k, v in rec.metadata.items()}, version=rec.version,
                  created_at=rec.created_at, updated_at=rec.updated_at, unservable_reason=rec.unservable_reason)
    if rec.expires_at != math.inf:
        pb.expires_at = rec.expires_at
    return pb


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
