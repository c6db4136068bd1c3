"""Gateway: the ingress of the service, split by front door over one transport-free core.

    core.py           GatewayCore (auth order, validation, all-or-nothing writes, the RPCs), GatewaySink (Mem0)
    grpc_front.py     GrpcServicer + start_grpc_server: a plain grpc.aio server (Ray-less runs, API tests);
                      grpc.health.v1 Check/Watch for both gRPC front doors
    http_common.py    what the two HTTP APIs share (status codes, 429 vs 413, body limits, metrics outcome)
    http_front.py     build_http_app: OpenAI-compatible POST /v1/chat/completions, GET /v1/models, /healthz
    mem0_http.py      Mem0's platform HTTP API (mount_mem0, on the same app): Mem0's MemoryClient unchanged
    serve_ingress.py  Gateway (the Ray Serve deployment behind Serve's gRPC and HTTP proxies), ServeBackends

The registry (the source of truth) is written first, then the change is pushed to the retrieval and engine
replicas; writes of new facts are undone if the push fails. Every RPC but Health needs a bearer token
(services/auth.py).
"""
from __future__ import annotations

from .core import UNARY, Backends, GatewayCore, GatewaySink
from .grpc_front import GrpcServicer, start_grpc_server
from .http_front import HTTP_STATUS, build_http_app
from .serve_ingress import Gateway, ServeBackends, http_app

__all__ = ["UNARY", "Backends", "Gateway", "GatewayCore", "GatewaySink", "GrpcServicer", "HTTP_STATUS",
           "ServeBackends", "build_http_app", "http_app", "start_grpc_server"]
