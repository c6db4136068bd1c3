"""The gRPC front door without Ray: a plain grpc.aio server over a GatewayCore (a Ray-less run, the API tests).
The Ray Serve front door (serve_ingress.Gateway) maps errors the same way."""
from __future__ import annotations

import logging

import grpc

from .. import api
from .core import UNARY, GatewayCore

log = logging.getLogger("inferscale.gateway")


def metadata_value(metadata, key: str) -> str | None:
    """The first value of `key` in gRPC invocation metadata (keys arrive lower-cased)."""
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


def status_of(name: str, e: BaseException) -> api.ApiError:
    """ApiError -> itself; a bug -> INTERNAL without internals (logged with its traceback here)."""
    err = api.to_api_error(e)
    if err.code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", name, exc_info=e)
    return err


class GrpcServicer:
    """grpc.aio servicer over a GatewayCore: ApiError -> status code + details; anything else -> INTERNAL."""

    def __init__(self, core: GatewayCore):
        self.core = core
        for name in UNARY:
            setattr(self, name, self._unary(name))

    def _unary(self, name: str):
        async def handler(raw, context):
            try:
                caller = self.core.authenticate(name, metadata_value(context.invocation_metadata(), "authorization"))
                return await getattr(self.core, name)(raw, caller)
            except Exception as e:  # noqa: BLE001 - mapped to a status, never leaked
                err = status_of(name, e)
            await context.abort(err.code, err.message)
        return handler

    async def Answer(self, raw, context):  # noqa: N802
        try:
            caller = self.core.authenticate("Answer", metadata_value(context.invocation_metadata(), "authorization"))
            async for chunk in self.core.Answer(raw, caller):
                yield chunk
            return
        except Exception as e:  # noqa: BLE001
            err = status_of("Answer", e)
        await context.abort(err.code, err.message)


async def start_grpc_server(core: GatewayCore, address: str = "127.0.0.1:0",
                            tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the Memory service on `address`; `tls`: (certificate chain PEM, private key PEM)
    to terminate TLS here. Returns (server, bound port)."""
    server = grpc.aio.server()
    api.add_MemoryServicer_to_server(GrpcServicer(core), server)
    if tls is not None:
        cert, key = tls
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the gRPC server to {address}")
    await server.start()
    return server, port
