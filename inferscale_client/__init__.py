"""The light InferScale client: the gRPC code of protos/inferscale/v1/memory.proto (`pb2`, `pb2_grpc`, generated
when the package is built), blocking and asyncio clients, and the client commands of `inferscale`. Needs only
grpcio and protobuf: `pip install inferscale-client` (the distribution built from client/ in the repository)
installs it without torch or vLLM; the full `inferscale` distribution carries the same package.

    from inferscale_client import MemoryClient, AsyncMemoryClient

The names are imported on first use, so `python -m inferscale_client.codegen` runs before any code is generated.
"""
DEFAULT_TARGET = "localhost:9000"
TARGET_ENV, TOKEN_ENV = "INFERSCALE_TARGET", "INFERSCALE_TOKEN"  # the client's defaults for target and token
__all__ = ["AsyncMemoryClient", "MemoryClient", "pb2", "pb2_grpc", "retry_service_config"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import client

    return getattr(client, name)
