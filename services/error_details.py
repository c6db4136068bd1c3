"""How an ApiError travels on gRPC: a google.rpc.Status in the trailing metadata, and gRPC's retry pushback."""
from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from .errors import ApiError

ERROR_DOMAIN = "inferscale.v1.Memory"  # google.rpc.ErrorInfo.domain: whose `reason` names these are (api.SERVICE)
DETAILS_KEY = "grpc-status-details-bin"  # the trailer a google.rpc.Status travels in (grpcio-status reads it)
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry policy: wait this long, or (negative) do not retry
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)  # what clients' policies retry


def error_status(err: ApiError):
    """The google.rpc.Status of an error: its code and message, and as details an ErrorInfo (always: a stable
    reason), BadRequest naming the field at fault, QuotaFailure for a per-user quota, RetryInfo with the delay
    where a retry can succeed (overload, a replica restarting). RESOURCE_EXHAUSTED is told apart this way:
    RetryInfo means "overloaded, retry after the delay", QuotaFailure or BadRequest means "do not retry"."""
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
