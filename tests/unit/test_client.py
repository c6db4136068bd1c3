"""The light client's own behaviour (inferscale_client): its gRPC retry policy and its argument checks. The
clients against the real service: tests/packaging/test_packaging.py (installed alone, registry-only gateway) and
tests/service/one_app/test_service_e2e.py (the whole app, answers with `messages`)."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from inferscale_client import MemoryClient, pb2
from inferscale_client.client import messages_pb


class ScriptedHealth:
    """A gRPC server whose Memory/Health answers the given status codes in turn, then OK; counts the attempts.
    The client's retries are a property of its channel, so they are tested against a server that fails on cue
    (the real gateway cannot be made to answer UNAVAILABLE exactly twice)."""

    def __init__(self, codes: list[grpc.StatusCode]):
        self.codes, self.attempts, self.lock = list(codes), 0, threading.Lock()

        def health(request, context):
            with self.lock:
                self.attempts += 1
                code = self.codes.pop(0) if self.codes else None
            if code is not None:
                context.abort(code, f"scripted {code.name}")
            return pb2.HealthResponse(status="SERVING")

        handler = grpc.method_handlers_generic_handler("inferscale.v1.Memory", {
            "Health": grpc.unary_unary_rpc_method_handler(
                health, request_deserializer=pb2.HealthRequest.FromString,
                response_serializer=pb2.HealthResponse.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop(None)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_unavailable_and_overload_are_retried(code):
    with ScriptedHealth([code, code]) as srv, MemoryClient(f"127.0.0.1:{srv.port}", timeout_s=20) as c:
        assert c.health().status == "SERVING" and srv.attempts == 3
    with ScriptedHealth([code] * 10) as srv, MemoryClient(f"127.0.0.1:{srv.port}", timeout_s=20) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.health()
        assert e.value.code() == code and srv.attempts == 4  # maxAttempts, then the last status
    with ScriptedHealth([code]) as srv, MemoryClient(f"127.0.0.1:{srv.port}", timeout_s=20, retry=False) as c:
        with pytest.raises(grpc.RpcError):
            c.health()
        assert srv.attempts == 1


def test_other_errors_are_not_retried():
    with ScriptedHealth([grpc.StatusCode.INVALID_ARGUMENT]) as srv, MemoryClient(f"127.0.0.1:{srv.port}") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.health()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and srv.attempts == 1


def test_bad_arguments_are_refused_before_sending():
    assert [m.role for m in messages_pb([{"role": "system", "content": "Be brief."}])] == ["system"]
    with pytest.raises(ValueError, match=r"messages\[1\] must be a mapping with 'role' and 'content'"):
        messages_pb([{"role": "user", "content": "hi"}, {"text": "no role"}])
    with MemoryClient("127.0.0.1:1", retry=False) as c, pytest.raises(TypeError, match="not one string"):
        c.add_facts("alice", "one string, not a list")
