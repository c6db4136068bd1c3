"""The Ray Serve ingress: `Gateway`, the deployment behind Serve's gRPC proxy (methods named like the RPCs,
called with the request's raw bytes and a RayServegRPCContext) and its HTTP proxy (the FastAPI app of
http_front), plus `ServeBackends`, the GatewayCore's view of the other deployments through their handles."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import cast

import grpc

from inferscale_core.ordering import serving_order

from ..auth import AuthConfig, Authenticator
from ..deadlines import caller_deadline, time_left, within_deadline
from ..errors import to_api_error
from ..limits import Limits
from ..messages import AnswerEnd, AnswerRequest, FactRef, FactWrite
from ..metrics import GatewayMetrics
from ..modes import wire_mode
from ..proxy_setup import DEADLINE_ATTR
from ..registry import open_registry
from .core import GatewayCore
from .grpc_front import health_check, health_watch, metadata_value, status_of
from .http_front import HttpConfig, build_http_app

log = logging.getLogger("inferscale.gateway")
ANSWER_RETRIES = 2  # an Answer whose engine replica was lost before its first piece is tried this often again
RETRY_WAIT_S = 0.5
BACKEND_TIMEOUT_S = 120.0  # the server's cap on one backend call; a caller's shorter deadline wins (deadlines.time_left)


def _replica_lost(e: BaseException) -> bool:
    """A backend replica that died or cannot be reached, or whose vLLM engine died (UNAVAILABLE); not a
    timeout, not a refusal."""
    return not isinstance(e, TimeoutError) and to_api_error(e).code == grpc.StatusCode.UNAVAILABLE


class ServeBackends:
    """Backends over Serve deployment handles. Every per-user call carries multiplexed_model_id = user id,
    so Serve routes it to a replica that already holds the user's index / KV store."""

    def __init__(self, encoder, retrieval, engine, timeout_s: float = BACKEND_TIMEOUT_S, metrics=None):
        self.encoder, self.retrieval, self.engine, self.timeout_s = encoder, retrieval, engine, timeout_s
        self.metrics = metrics  # inferscale_server.metrics.GatewayMetrics: q2ft

    def _r(self, user_id: str):
        return self.retrieval.options(multiplexed_model_id=user_id)

    def _e(self, user_id: str, stream: bool = False):
        return self.engine.options(multiplexed_model_id=user_id, stream=stream)

    async def check_facts(self, texts):
        return await within_deadline(self.encoder.check.remote(list(texts)), self.timeout_s)

    async def index_facts(self, user_id, records):
        indexed = self._r(user_id).index_facts.remote(user_id, [(r.fact_id, r.version, r.text) for r in records])
        # The encoder's response is handed to the engine call unresolved: Serve passes it on as an object
        # reference; it holds token counts when the pool wrote the KV to the cluster tier, else the KV
        # tensors, which the engine replica reads from the object store. KV never comes here.
        encoded = self.encoder.encode_for.remote(
            user_id, [(r.fact_id, r.version, r.text, list(r.window)) for r in records])
        placed = self._e(user_id).put_facts.remote(user_id, [FactWrite.of(r) for r in records], encoded)
        await within_deadline(asyncio.gather(indexed, placed), self.timeout_s)

    async def search(self, user_id, query, k):
        return await within_deadline(self._r(user_id).search.remote(user_id, query, k), self.timeout_s)

    async def answer(self, user_id, query, k, max_tokens, temperature, mode, conversation=None, openai=None):
        """Streams the engine's pieces. An engine replica lost before the first piece (died, unreachable, its
        vLLM engine dead: UNAVAILABLE) is retried up to ANSWER_RETRIES times, on the replica Serve's router
        picks once it knows (services/routing.py moves the user); after a piece was sent the error is final."""
        t0, first = time.perf_counter(), True
        hits = await self.search(user_id, query, k)  # the query alone is searched, not the conversation
        retrieval_ms = (time.perf_counter() - t0) * 1000
        request = AnswerRequest(user_id, query, serving_order(hits), max_tokens, temperature, mode, conversation,
                                openai)  # the facts in serving order: most relevant last, next to the query
        for attempt in range(ANSWER_RETRIES + 1):
            try:
                async for piece in self._e(user_id, stream=True).answer.remote(request):
                    if first:  # q2ft: query in -> first token out, retrieval included
                        first_ms = (time.perf_counter() - t0) * 1000
                        if self.metrics is not None:
                            self.metrics.q2ft.observe(first_ms / 1000, tags={"mode": wire_mode(mode)})
                    first = False
                    if isinstance(piece, AnswerEnd):  # the gateway's hops next to the engine replica's
                        piece = dataclasses.replace(piece, timings_ms={
                            **piece.timings_ms, "retrieval": retrieval_ms, "gateway_total_to_first_chunk": first_ms})
                    yield piece
                return
            except Exception as e:  # retried, or raised as it is
                if not first or attempt == ANSWER_RETRIES or not _replica_lost(e):
                    raise
                time_left(None)  # DEADLINE_EXCEEDED rather than a retry the caller no longer waits for
                log.warning("answer: engine replica lost before the first piece (%s); retry %d of %d",
                            type(e).__name__, attempt + 1, ANSWER_RETRIES)
                await asyncio.sleep(RETRY_WAIT_S * (attempt + 1))  # lets Serve's router learn of the death

    async def forget(self, user_id, facts):
        await asyncio.gather(self._r(user_id).forget.remote(user_id, [f for f, _ in facts]),
                             self._e(user_id).forget.remote(user_id, [FactRef(f, v) for f, v in facts]))

    async def forget_user(self, user_id):
        await asyncio.gather(self._r(user_id).forget_user.remote(user_id),
                             self._e(user_id).forget_user.remote(user_id))

    async def search_vector(self, user_id, vector, k):
        return await within_deadline(self._r(user_id).search_vector.remote(user_id, vector, k), self.timeout_s)

    async def embed(self, texts, as_query):
        # No user's index is read: any retrieval replica will do.
        return await within_deadline(self.retrieval.embed_texts.remote(list(texts), as_query), self.timeout_s)

    async def chat(self, user_id, messages, max_tokens, temperature, structured):
        # Plain chat holds no user's KV: any engine replica will do.
        return await within_deadline(self.engine.chat.remote(user_id, messages, max_tokens, temperature, structured),
                                     self.timeout_s)

    async def chat_room(self, user_id, messages):
        return await within_deadline(self.engine.chat_room.remote(user_id, messages), self.timeout_s)

    async def health(self):
        out = {}
        for name, handle in (("encoder_pool", self.encoder), ("retrieval", self.retrieval),
                             ("engine", self.engine)):
            try:
                out[name] = await asyncio.wait_for(handle.health.remote(), 10)
            except Exception as e:  # noqa: BLE001 - reported in the health answer
                log.warning("health: %s: %s", name, e)
                out[name] = f"error: {type(e).__name__}"
        return out


def seconds_left(grpc_context) -> float | None:
    """What is left of the gRPC caller's deadline: Serve's proxy notes it on the context it sends here
    (services/proxy_setup.py, DEADLINE_ATTR); None when the caller set none."""
    deadline = getattr(grpc_context, DEADLINE_ATTR, None)
    return None if deadline is None else deadline - time.time()


def _replica() -> "Gateway":
    """The Gateway replica serving this HTTP request. (The FastAPI app is pickled into the replica, so it
    cannot close over module state; Serve's replica context names the instance.)"""
    from ray import serve

    return cast("Gateway", serve.get_replica_context().servable_object)  # Serve types it as a Callable


def _replica_core() -> GatewayCore:
    return _replica().core


def _replica_metrics():
    return _replica().metrics


def _replica_http_config() -> HttpConfig:
    return _replica().http


http_app = build_http_app(_replica_core, _replica_metrics, _replica_http_config)


class Gateway:
    """The ingress deployment (Serve options in services/app.py). gRPC methods carry the RPC names; Ray
    Serve's gRPC proxy calls them with the request's raw bytes (see api.add_MemoryServicer_to_server) and a
    RayServegRPCContext, whose invocation metadata carries the caller's `authorization`; a refusal sets the
    status code and details on that context."""

    def __init__(self, encoder=None, retrieval=None, engine=None, registry_url: str | None = None,
                 limits: dict | None = None, auth: dict | None = None, http: dict | None = None):

        # No handles at all: registry-only mode (CRUD works, Search/Answer answer UNAVAILABLE).
        handles = (encoder, retrieval, engine)
        if any(h is None for h in handles) and not all(h is None for h in handles):
            raise ValueError("Gateway needs all three handles (encoder, retrieval, engine) or none")
        self.metrics = GatewayMetrics()
        self.http = HttpConfig.from_dict(http)  # the HTTP front door's served model names and CORS origins
        backends = ServeBackends(*handles, metrics=self.metrics) if encoder is not None else None
        authenticator = Authenticator(AuthConfig.from_dict(auth))  # fails the replica when no key is configured
        if not authenticator.enabled:
            log.warning("AUTHENTICATION IS OFF (insecure_no_auth): any caller can read and change any user's memory")
        # Without authentication Mem0's clients name a memory by its id alone: only then is its owner indexed.
        self.core = GatewayCore(open_registry(registry_url, index_owners=not authenticator.enabled), backends,
                                Limits(**(limits or {})), auth=authenticator)
        if backends is not None:  # infer=true needs the engine: registry-only mode refuses it without an extractor
            self.core.build_extractor()  # before the first request, which would otherwise wait ~2 s for it

    async def stats(self, subject: str | None = None) -> dict:
        """This replica's work budget (work_budget.WorkBudget.stats; with `subject`, that caller's balance and net
        charges per resource). Called through a Serve handle only: Serve's gRPC proxy routes the Memory service's
        methods and the HTTP ingress its FastAPI routes, so no client reaches this."""
        from ray import serve

        # the budget is per gateway replica: which one answered says whose books these are
        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "work_budget": self.core.work.stats(subject)}

    async def _caller(self, name: str, grpc_context):
        return await self.core.authenticate(name, metadata_value(grpc_context.invocation_metadata(), "authorization"))

    @staticmethod
    def _refuse(name: str, e: BaseException, grpc_context):
        err = status_of(name, e)
        grpc_context.set_code(err.code)
        grpc_context.set_details(err.message)
        return err

    async def _call(self, name: str, request, grpc_context):
        with self.metrics.request(name), caller_deadline(seconds_left(grpc_context)):
            try:
                return await getattr(self.core, name)(request, await self._caller(name, grpc_context))
            except Exception as e:  # noqa: BLE001 - mapped to a status code for the proxy
                raise self._refuse(name, e, grpc_context) from None

    async def AddMemory(self, request, grpc_context):  # noqa: N802
        return await self._call("AddMemory", request, grpc_context)

    async def AddFacts(self, request, grpc_context):  # noqa: N802
        return await self._call("AddFacts", request, grpc_context)

    async def Search(self, request, grpc_context):  # noqa: N802
        return await self._call("Search", request, grpc_context)

    async def GetMemory(self, request, grpc_context):  # noqa: N802
        return await self._call("GetMemory", request, grpc_context)

    async def ListMemories(self, request, grpc_context):  # noqa: N802
        return await self._call("ListMemories", request, grpc_context)

    async def UpdateMemory(self, request, grpc_context):  # noqa: N802
        return await self._call("UpdateMemory", request, grpc_context)

    async def DeleteMemory(self, request, grpc_context):  # noqa: N802
        return await self._call("DeleteMemory", request, grpc_context)

    async def DeleteUser(self, request, grpc_context):  # noqa: N802
        return await self._call("DeleteUser", request, grpc_context)

    async def Health(self, request, grpc_context):  # noqa: N802
        return await self._call("Health", request, grpc_context)

    async def Check(self, request, grpc_context):  # noqa: N802 - grpc.health.v1.Health, open
        with self.metrics.request("Check"):
            try:
                return await health_check(self.core, request)
            except Exception as e:  # noqa: BLE001
                raise self._refuse("Check", e, grpc_context) from None

    async def Watch(self, request, grpc_context):  # noqa: N802 - grpc.health.v1.Health, open, streams
        with self.metrics.request("Watch"):
            try:
                async for resp in health_watch(self.core, request, grpc_context.peer()):
                    yield resp
            except Exception as e:  # noqa: BLE001
                raise self._refuse("Watch", e, grpc_context) from None

    async def Answer(self, request, grpc_context):  # noqa: N802 - server streaming
        with self.metrics.request("Answer"), caller_deadline(seconds_left(grpc_context)):
            try:
                async for chunk in self.core.Answer(request, await self._caller("Answer", grpc_context)):
                    yield chunk
            except Exception as e:  # noqa: BLE001
                raise self._refuse("Answer", e, grpc_context) from None
