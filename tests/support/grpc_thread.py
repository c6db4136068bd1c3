"""A grpc.aio server (inferscale_server.gateway.start_grpc_server) on its own event loop in a thread, so tests can call it
with the blocking client."""
from __future__ import annotations

import asyncio
import threading

import grpc

from inferscale_server.gateway import GatewayCore, start_grpc_server


class ServerThread:
    def __init__(self, core: GatewayCore, tls: tuple[bytes, bytes] | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(
            start_grpc_server(core, tls=tls), self.loop).result(30)

    def channel(self) -> grpc.Channel:
        """A blocking client channel to this server, connected."""
        ch = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        grpc.channel_ready_future(ch).result(timeout=30)
        return ch

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
