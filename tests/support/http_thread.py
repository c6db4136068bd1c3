"""An ASGI app (the HTTP front door) served by uvicorn on a free loopback port, in a thread of the test."""
from __future__ import annotations

import threading
import time


class HttpThread:
    """The HTTP front door's app in uvicorn on a free loopback port, in a thread."""

    def __init__(self, app):
        import uvicorn

        from inferscale_server.local_processes import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
