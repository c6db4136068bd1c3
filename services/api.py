"""The wire of `inferscale.v1.Memory`: the generated protobuf code, requests parsed from raw bytes, records
converted to messages, and the servicer wiring that registers the handlers. Only the gateway imports it; the
errors, limits and field validation that the backends share are in modules of their own (errors.py,
error_details.py, limits.py, validation.py, deadlines.py, page_tokens.py, modes.py).

Requests arrive as raw bytes (the handlers are registered without a deserializer) so that a request that is
too big or does not parse answers RESOURCE_EXHAUSTED / INVALID_ARGUMENT naming the problem, instead of the
transport's generic INTERNAL. Validation is pure: it runs before any backend is touched, in the Ray Serve
gateway and in the plain grpc server alike.

The module keeps its name and place because Serve configs name its servicer function,
`inferscale_server.api.add_MemoryServicer_to_server` (the chart's serve-config.yaml, docs/deploy.md).
"""
from __future__ import annotations

import math

import grpc
from google.protobuf.message import DecodeError

from inferscale_client import codegen

from .errors import invalid, too_big
from .limits import Limits
from .registry import FactRecord

pb2, pb2_grpc = codegen.load()
SERVICE = "inferscale.v1.Memory"

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

