"""Test helpers for authenticated calls: a fresh HS256 secret in a file, tokens signed with it, and a gRPC
channel interceptor that sends a token with every call.

    from auth_fixture import jwt_secret, token_channel  # noqa: F401
"""
from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from services.auth import SCOPE_ADMIN, USER_SCOPES, mint


@pytest.fixture(scope="module")
def jwt_secret(tmp_path_factory) -> tuple[Path, bytes]:
    """(secret file, secret) for one test module."""
    path = tmp_path_factory.mktemp("auth") / "jwt-secret"
    secret = secrets.token_urlsafe(48).encode()
    path.write_bytes(secret)
    return path, secret


def token_for(secret: bytes, user: str, admin: bool = False, **kw) -> str:
    return mint(secret, user, (*USER_SCOPES, SCOPE_ADMIN) if admin else USER_SCOPES, **kw)


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
