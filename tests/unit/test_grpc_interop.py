"""gRPC interop: the standard grpc.health.v1 health service and server reflection, on both gRPC front doors (Ray
Serve's gRPC proxy in front of the Gateway deployment, and the plain grpc.aio server), called by a client that
shares nothing with the project: its modules are compiled at test time with grpcio-tools into a temporary
folder (memory.proto from protos/, and the health service written here from the standard's message shapes) and
it runs in its own interpreter that never imports `services`.

Ray Serve 2.60's proxy serves reflection itself (gRPCOptions.enable_reflection, default on; it advertises the
services the servicer functions registered). It has no health service of its own for user applications
(only ray.serve.RayServeAPIService/Healthz), and a method of a service no servicer function registered is
UNIMPLEMENTED at the proxy. So `inferscale_server.api.add_MemoryServicer_to_server` registers grpc.health.v1.Health next
to inferscale.v1.Memory, and the proxy routes Check/Watch to the Gateway's methods of those names.

The client is tests/support/grpc_interop.py's. The Serve proxy's case is
tests/service/test_grpc_serve_proxy.py::test_health_and_reflection_through_ray_serves_grpc_proxy (the client against that
module's running Gateway: one Ray start fewer); the plain server's is here.
"""
from __future__ import annotations

from support.auth_fixture import token_for
from support.grpc_interop import check_interop, run_client
from support.grpc_thread import ServerThread


def test_health_and_reflection_on_the_plain_grpc_server(redis_url, client_dir, jwt_secret):
    from inferscale_server.auth import AuthConfig, Authenticator
    from inferscale_server.gateway import GatewayCore
    from inferscale_server.registry import RedisRegistry

    core = GatewayCore(RedisRegistry(redis_url, prefix="interop:"), backends=None,
                       auth=Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0]))))
    srv = ServerThread(core)
    try:
        user = "interop-plain"
        check_interop(run_client(client_dir, f"127.0.0.1:{srv.port}", token_for(jwt_secret[1], user), user))
    finally:
        srv.stop()
