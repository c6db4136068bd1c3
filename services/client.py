"""The gRPC client moved to the light client package (inferscale_client/client.py: grpcio and protobuf only);
this name stays for existing imports."""
from inferscale_client.client import AsyncMemoryClient, MemoryClient

__all__ = ["AsyncMemoryClient", "MemoryClient"]
