"""Test helpers for authenticated calls: a fresh HS256 secret in a file, tokens signed with it, and a gRPC
channel interceptor that sends a token with every call. A pytest plugin (tests/conftest.py): the fixtures
`jwt_secret` and `admin_token` are asked for by name; the helpers are imported:

    from support.auth_fixture import token_channel, token_for
"""
from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from inferscale_server.api import pb2
from inferscale_server.auth import SCOPE_ADMIN, USER_SCOPES, mint


def new_jwt_secret(tmp_path_factory) -> tuple[Path, bytes]:
    """(secret file, secret): a fresh HS256 secret in a file of its own."""
    path = tmp_path_factory.mktemp("auth") / "jwt-secret"
    secret = secrets.token_urlsafe(48).encode()
    path.write_bytes(secret)
    return path, secret


@pytest.fixture(scope="module")
def jwt_secret(tmp_path_factory) -> tuple[Path, bytes]:
    """(secret file, secret) for one test module."""
    return new_jwt_secret(tmp_path_factory)


def token_gateway(registry, jwt_secret, limits):
    """A Ray-less GatewayCore over `registry` (no backends: memory calls only) verifying HS256 tokens signed with
    the module's `jwt_secret`."""
    from inferscale_server.auth import AuthConfig, Authenticator
    from inferscale_server.gateway import GatewayCore

    auth = Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0])))
    return GatewayCore(registry, backends=None, limits=limits, auth=auth)


def token_for(secret: bytes, user: str, admin: bool = False, **kw) -> str:
    return mint(secret, user, (*USER_SCOPES, SCOPE_ADMIN) if admin else USER_SCOPES, **kw)


@pytest.fixture(scope="module")
def admin_token(jwt_secret):
    """A support engineer's token with the admin scope: may act on any user."""
    return token_for(jwt_secret[1], "support", admin=True)


def refused(call) -> tuple[grpc.StatusCode, str]:
    """Run a gRPC call that must fail; its status code and details."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def rich_refusal(call) -> tuple[grpc.StatusCode, dict, dict]:
    """A refused call's code, google.rpc details by type name (decoded by grpcio-status, not by our code) and
    trailing metadata."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(grpc.RpcError) as e:
        call()
    status = rpc_status.from_call(e.value)
    assert status is not None, f"no google.rpc.Status on {e.value.code()}: {e.value.details()}"
    assert status.code == e.value.code().value[0] and status.message == e.value.details()
    details = {}
    for any_ in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.QuotaFailure,
                    error_details_pb2.RetryInfo):
            if any_.Is(cls.DESCRIPTOR):
                msg = cls()
                any_.Unpack(msg)
                details[cls.__name__] = msg
    return e.value.code(), details, dict(e.value.trailing_metadata() or ())


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def _with_token(self, details):
        md = [*(details.metadata or ()), ("authorization", f"Bearer {self.token}")]
        return details._replace(metadata=md) if hasattr(details, "_replace") else _Details(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression


def token_channel(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel` with `authorization: Bearer <token>` added to every call."""
    return grpc.intercept_channel(channel, _Token(token))


def one_call_per_rpc(user: str, fact_id: str) -> dict:
    """RPC name -> call(stub, metadata): one well-formed request per RPC but Health, for `user`
    (Answer: 4 tokens at most, its stream read to the end)."""
    return {
        "AddFacts": lambda s, md: s.AddFacts(pb2.AddFactsRequest(user_id=user, facts=[pb2.FactInput(text="x")]),
                                             metadata=md),
        "AddMemory": lambda s, md: s.AddMemory(pb2.AddMemoryRequest(
            user_id=user, infer=False, messages=[pb2.Message(role="user", content="x")]), metadata=md),
        "Search": lambda s, md: s.Search(pb2.SearchRequest(user_id=user, query="locker"), metadata=md),
        "Answer": lambda s, md: list(s.Answer(pb2.AnswerRequest(user_id=user, query="locker?", max_tokens=4), metadata=md)),
        "GetMemory": lambda s, md: s.GetMemory(pb2.GetMemoryRequest(user_id=user, fact_id=fact_id), metadata=md),
        "ListMemories": lambda s, md: s.ListMemories(pb2.ListMemoriesRequest(user_id=user), metadata=md),
        "UpdateMemory": lambda s, md: s.UpdateMemory(pb2.UpdateMemoryRequest(user_id=user, fact_id=fact_id,
                                                                              text="hacked"), metadata=md),
        "DeleteMemory": lambda s, md: s.DeleteMemory(pb2.DeleteMemoryRequest(user_id=user, fact_id=fact_id),
                                                     metadata=md),
        "DeleteUser": lambda s, md: s.DeleteUser(pb2.DeleteUserRequest(user_id=user), metadata=md),
    }
