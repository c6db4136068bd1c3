"""A GatewayCore in registry-only mode (no Ray) behind both real front doors, gRPC and HTTP, each on a free loopback
port in a thread of the test: what the per-caller limit tests drive as a client would."""
from __future__ import annotations

import contextlib
import uuid

from inferscale_server.auth import AuthConfig, Authenticator
from inferscale_server.gateway import GatewayCore, build_http_app
from inferscale_server.limits import Limits
from inferscale_server.registry import RedisRegistry
from support.grpc_thread import ServerThread
from support.http_thread import HttpThread


@contextlib.contextmanager
def both_doors(redis_url: str, jwt_secret, limits: Limits, prefix: str):
    """Yields (core, grpc server, HTTP server, the HS256 secret's bytes) over a Redis registry under a fresh
    `prefix` (the module's own keys); HS256 tokens signed with `jwt_secret` (the fixture's (file, bytes))."""
    reg = RedisRegistry(redis_url, prefix=f"{prefix}{uuid.uuid4().hex[:8]}:")
    core = GatewayCore(reg, limits=limits, auth=Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0]))))
    grpc_server, http_server = ServerThread(core), HttpThread(build_http_app(lambda: core))
    try:
        yield core, grpc_server, http_server, jwt_secret[1]
    finally:
        http_server.stop()
        grpc_server.stop()
        reg.close()
