"""The service's errors: ApiError (a gRPC status code and a message that names the field at fault) and what
the registry, the core and Ray raise mapped onto it. Every module may import this one: it needs no generated
protobuf code (how an ApiError travels on the wire: services/error_details.py)."""
from __future__ import annotations

import grpc

from inferscale_core.errors import InvalidIdError, UnknownFactError, UnknownUserError

from .registry import (
    DuplicateFactError,
    QuotaExceededError,
    UnconfirmedWriteError,
    VersionConflictError,
    tls_failure,
)


class ApiError(Exception):
    """An answer with a gRPC status code and a message that names the field at fault. What a client needs to act
    on it travels as google.rpc details (services/error_details.py): `field`, the request field
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
# The certificate, the CA the service trusts, or TLS on one side only: the server's log names which (RegistryTlsError)
REGISTRY_TLS_FAILED = unavailable("the registry (Redis) cannot be reached: TLS with it failed (see the server "
                                  "log); retry shortly")
REGISTRY_FULL_RETRY_S = 10.0  # a full Redis frees space only when facts or users are deleted: not within a second
REGISTRY_FULL = ApiError(grpc.StatusCode.UNAVAILABLE, "the registry (Redis) is full (at its maxmemory): nothing was "
                         "written; reads and deletes still work; retry once facts or users have been deleted",
                         retry_after_s=REGISTRY_FULL_RETRY_S, reason="REGISTRY_FULL")


def _registry_error(err: BaseException) -> ApiError | None:
    """The registry's Redis full, unreachable (over TLS: said), or unable to confirm a write: UNAVAILABLE, each with
    its retry hint; None for anything else."""
    if registry_full(err):
        return REGISTRY_FULL
    if isinstance(err, UnconfirmedWriteError):
        return ApiError(grpc.StatusCode.UNAVAILABLE, f"{_clean(err.message)}; {UNCONFIRMED_ADVICE}",
                        retry_after_s=RETRY_AFTER_S, reason="WRITE_UNCONFIRMED")
    if tls_failure(err):
        return REGISTRY_TLS_FAILED
    if _registry_unreachable(err):
        return REGISTRY_UNAVAILABLE
    return None


# What a repeated request does when the first one was applied after all (docs/deploy.md, "Failover").
UNCONFIRMED_ADVICE = ("a retry is safe for a delete (NOT_FOUND if it was applied), an update with an expected "
                      "version (ABORTED if it was applied), DeleteUser, and an add sent with an idempotency key "
                      "(the same key answers with the facts the first try stored); read before retrying an add "
                      "without one, which may store the facts twice")


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
