"""The gRPC front door without Ray: a plain grpc.aio server over a GatewayCore (a Ray-less run, the API tests),
with the standard grpc.health.v1.Health (`health_check`, `health_watch`, also used by the Serve ingress) and
server reflection. The Ray Serve front door (serve_ingress.Gateway) maps errors the same way."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from .. import api
from ..deadlines import caller_deadline
from ..error_details import error_trailers
from ..errors import ApiError, invalid, to_api_error
from .core import UNARY, GatewayCore

log = logging.getLogger("inferscale.gateway")


def metadata_value(metadata, key: str) -> str | None:
    """The first value of `key` in gRPC invocation metadata (keys arrive lower-cased)."""
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


WATCH_S = 60.0         # a Watch stream ends after this (clients re-watch): a replica can still drain and stop
WATCH_PERIOD_S = 5.0   # how often a Watch re-checks


async def health_check(core: GatewayCore, raw: bytes, watching: bool = False):
    """grpc.health.v1 Check: "" (the server) and "inferscale.v1.Memory" are SERVING when the Memory Health RPC
    says so, else NOT_SERVING; another service is NOT_FOUND (Watch: SERVICE_UNKNOWN). Open, like Health."""
    from google.protobuf.message import DecodeError
    from grpc_health.v1 import health_pb2

    req = health_pb2.HealthCheckRequest()
    try:
        req.ParseFromString(raw)
    except DecodeError:
        raise invalid("the request is not a valid grpc.health.v1.HealthCheckRequest") from None
    if req.service not in ("", api.SERVICE):
        if watching:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown service {req.service[:100]!r}; this server has "
                                                      f"{api.SERVICE!r} (and '' for the whole server)")
    serving = (await core.health_state()).status == "SERVING"
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if serving
                                          else health_pb2.HealthCheckResponse.NOT_SERVING)


async def health_watch(core: GatewayCore, raw: bytes, peer: str | None = None):
    """grpc.health.v1 Watch: the status now, then every change, for WATCH_S seconds; one of core.watches' slots
    (RESOURCE_EXHAUSTED when they are taken), reading the cached health state (no probe per stream)."""
    with core.watches.hold(peer):
        last, deadline = None, time.monotonic() + WATCH_S
        while True:
            resp = await health_check(core, raw, watching=True)
            if resp.status != last:
                last = resp.status
                yield resp
            if time.monotonic() + WATCH_PERIOD_S > deadline:
                return
            await asyncio.sleep(WATCH_PERIOD_S)


def status_of(name: str, e: BaseException) -> ApiError:
    """ApiError -> itself; a bug -> INTERNAL without internals (logged with its traceback here)."""
    err = to_api_error(e)
    if err.code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", name, exc_info=e)
    return err


async def abort(context, err: ApiError):
    """Ends a grpc.aio call with `err`: status code, message and the error_trailers."""
    await context.abort(err.code, err.message, trailing_metadata=error_trailers(err))


class GrpcServicer:
    """grpc.aio servicer over a GatewayCore: ApiError -> status code + details; anything else -> INTERNAL."""

    def __init__(self, core: GatewayCore):
        self.core = core
        for name in UNARY:
            setattr(self, name, self._unary(name))

    def _unary(self, name: str):
        async def handler(raw, context):
            try:
                with caller_deadline(context.time_remaining()):
                    caller = await self.core.authenticate(name, metadata_value(context.invocation_metadata(),
                                                                               "authorization"))
                    return await getattr(self.core, name)(raw, caller)
            except Exception as e:  # noqa: BLE001 - mapped to a status, never leaked
                err = status_of(name, e)
            await abort(context, err)
        return handler

    async def Answer(self, raw, context):  # noqa: N802
        try:
            with caller_deadline(context.time_remaining()):
                caller = await self.core.authenticate("Answer", metadata_value(context.invocation_metadata(),
                                                                               "authorization"))
                async for chunk in self.core.Answer(raw, caller):
                    yield chunk
            return
        except Exception as e:  # noqa: BLE001
            err = status_of("Answer", e)
        await abort(context, err)

    async def Check(self, raw, context):  # noqa: N802 - grpc.health.v1.Health
        try:
            return await health_check(self.core, raw)
        except Exception as e:  # noqa: BLE001
            err = status_of("Check", e)
        await abort(context, err)

    async def Watch(self, raw, context):  # noqa: N802 - grpc.health.v1.Health
        try:
            async for resp in health_watch(self.core, raw, context.peer()):
                yield resp
            return
        except Exception as e:  # noqa: BLE001
            err = status_of("Watch", e)
        await abort(context, err)


async def start_grpc_server(core: GatewayCore, address: str = "127.0.0.1:0",
                            tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the Memory service on `address`; `tls`: (certificate chain PEM, private key PEM)
    to terminate TLS here. Returns (server, bound port)."""
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server()
    api.add_MemoryServicer_to_server(GrpcServicer(core), server)
    reflection.enable_server_reflection([api.SERVICE, api.HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    if tls is not None:
        cert, key = tls
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the gRPC server to {address}")
    await server.start()
    return server, port
