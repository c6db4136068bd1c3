"""Gateway: the ingress of the service. gRPC `inferscale.v1.Memory` (through Ray Serve's gRPC proxy) and an
OpenAI-compatible `POST /v1/chat/completions` over HTTP, where the request's `user` selects the memory.

`GatewayCore` holds the logic and is transport-free: it validates every request (services/api.py), writes
the registry (the source of truth) first, then pushes the change to the retrieval and engine replicas
(`Backends`). A push that fails is repaired by the replicas themselves, which re-sync a user from the
registry whenever its version counter moved. The gateway never holds KV: encoder output travels to the
engine replica as an object-store reference (see ServeBackends.index_facts).

Three front ends share the core: `Gateway` (the Ray Serve deployment), `GrpcServicer` (a plain grpc.aio
server, for a Ray-less run and the API tests) and `build_http_app` (FastAPI, mounted by `Gateway`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import api
from .api import ApiError, Limits, pb2
from .registry import FactRecord, NewFact, Registry

log = logging.getLogger("inferscale.gateway")


class Backends(Protocol):
    """What the gateway asks of the rest of the service (ServeBackends implements it with Serve handles)."""

    async def index_facts(self, user_id: str, records: list[FactRecord]) -> None:
        """Embed + index the facts (retrieval) and encode them into the engine replica's KV store."""

    async def search(self, user_id: str, query: str, k: int) -> list[tuple[str, float]]: ...

    def answer(self, user_id: str, query: str, k: int, max_tokens: int, temperature: float,
               mode: str) -> AsyncIterator[dict]:
        """Yields {"text": ...} pieces, then one {"final": True, "fact_ids", "ttft_ms", ...}."""

    async def forget(self, user_id: str, facts: list[tuple[str, int]]) -> None:
        """Deleted facts `(fact_id, last version)`: out of the indices and every KV store."""

    async def forget_user(self, user_id: str) -> None: ...

    async def search_vector(self, user_id: str, vector: list[float], k: int) -> list[tuple[str, float]]:
        """Top-k by a query embedding the caller computed (Mem0's pipeline embeds for itself)."""

    async def chat(self, messages: list[dict], max_tokens: int, temperature: float,
                   structured: dict | None) -> str:
        """Plain chat generation on the serving model (no memory); `structured`: vLLM structured outputs."""

    async def chat_room(self, messages: list[dict]) -> int:
        """Tokens left in the serving model's context after these messages."""

    async def health(self) -> dict[str, str]: ...


def _blocking(fn, *args, **kw):
    """Registry calls are short blocking I/O: keep them off the event loop."""
    return asyncio.to_thread(fn, *args, **kw)


class GatewayCore:
    def __init__(self, registry: Registry, backends: Backends | None = None, limits: Limits = Limits(),
                 embedder_path: str | None = None):
        self.registry, self.backends, self.limits = registry, backends, limits
        self.embedder_path = embedder_path  # Mem0's embedder: the same model as retrieval's
        self._extractor = None  # services.mem0_provider.Mem0Extractor, built on the first infer=true request
        self._extractor_lock = asyncio.Lock()

    def _need(self, what: str) -> Backends:
        if self.backends is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           f"{what} needs the retrieval/engine deployments, and this gateway runs without them "
                           "(registry-only mode)")
        return self.backends

    async def _push(self, coro, what: str) -> None:
        """A replica push after the registry write: failures are logged, not returned, because the registry
        already holds the change and replicas re-sync from it."""
        try:
            await coro
        except Exception:  # noqa: BLE001 - see docstring
            log.exception("push to replicas failed (%s); replicas will re-sync from the registry", what)

    async def _store_facts(self, user_id: str, facts: list[api.FactIn]) -> list[FactRecord]:
        return await self.store_new(user_id, [NewFact(f.text, f.metadata, window=f.window) for f in facts])

    async def store_new(self, user_id: str, facts: list[NewFact]) -> list[FactRecord]:
        """Registry first (quota checked), then index + KV under the registry's ids."""
        have = await _blocking(self.registry.count, user_id)
        if have + len(facts) > self.limits.max_facts_per_user:
            raise api.too_big(f"user {user_id!r} has {have} facts; adding {len(facts)} would pass the limit of "
                              f"{self.limits.max_facts_per_user} facts per user")
        for i, f in enumerate(facts):
            api.text_field(f.text, f"facts[{i}].text", self.limits.max_fact_chars)
        recs = await _blocking(self.registry.create, user_id, facts)
        if self.backends is not None:
            await self._push(self.backends.index_facts(user_id, recs), "index_facts")
        return recs

    async def update_fact(self, user_id: str, fact_id: str, text: str | None, metadata: dict | None,
                          replace_metadata: bool = False, expected_version: int = 0, embedding=None) -> FactRecord:
        rec = await _blocking(self.registry.update, user_id, fact_id, text=text, metadata=metadata,
                              replace_metadata=replace_metadata, expected_version=expected_version,
                              embedding=embedding)
        if text is not None and self.backends is not None:  # metadata changes do not touch KV or embeddings
            await self._push(self.backends.index_facts(user_id, [rec]), "index_facts (update)")
        return rec

    async def delete_fact(self, user_id: str, fact_id: str) -> FactRecord:
        rec = await _blocking(self.registry.delete, user_id, fact_id)
        if self.backends is not None:
            await self._push(self.backends.forget(user_id, [(fact_id, rec.version)]), "forget")
        return rec

    async def _extract(self, user_id: str, messages: list[dict], metadata: dict) -> list[dict]:
        """Mem0's add with inference (services/mem0_provider.py), in a worker thread."""
        self._need("AddMemory with infer=true")
        async with self._extractor_lock:
            if self._extractor is None:
                try:
                    from .mem0_provider import Mem0Extractor
                except ImportError as e:
                    raise ApiError(grpc.StatusCode.UNIMPLEMENTED,
                                   f"AddMemory with infer=true needs mem0ai 2.2 in the service's image ({e}); "
                                   "send infer=false or use AddFacts") from None
                sink = GatewaySink(self, asyncio.get_running_loop())
                self._extractor = await asyncio.to_thread(Mem0Extractor, sink, self.embedder_path)
        return await asyncio.to_thread(self._extractor.add, user_id, messages, metadata)

    # ------------------------------------------------------------------------------------ RPCs
    async def AddFacts(self, raw):  # noqa: N802 (RPC names)
        req = api.parse("AddFacts", raw, self.limits)
        uid = api.user_id(req.user_id)
        facts = api.facts_in(req.facts, self.limits)
        recs = await self._store_facts(uid, facts)
        return pb2.AddFactsResponse(facts=[api.fact_pb(r) for r in recs])

    async def AddMemory(self, raw):  # noqa: N802
        req = api.parse("AddMemory", raw, self.limits)
        uid = api.user_id(req.user_id)
        messages = api.messages_in(req.messages, self.limits)
        meta = api.metadata(req.metadata, "metadata", self.limits)
        infer = req.infer if req.HasField("infer") else True
        if infer:
            events = await self._extract(uid, messages, meta)
            return pb2.AddMemoryResponse(results=[
                pb2.MemoryEvent(fact_id=e["id"], text=e.get("memory", ""), event=e.get("event", "ADD"),
                                previous_text=e.get("previous_memory") or "") for e in events])
        # Mem0's infer=False: every non-system message is stored as it is, tagged with its role.
        facts = [api.FactIn(api.text_field(m["content"], f"messages[{i}].content", self.limits.max_fact_chars).strip(),
                            {**meta, "role": m["role"]})
                 for i, m in enumerate(messages) if m["role"] != "system"]
        if not facts:
            raise api.invalid("messages hold only system messages; with infer=false nothing would be stored")
        recs = await self._store_facts(uid, facts)
        return pb2.AddMemoryResponse(results=[pb2.MemoryEvent(fact_id=r.fact_id, text=r.text, event="ADD")
                                              for r in recs])

    async def Search(self, raw):  # noqa: N802
        req = api.parse("Search", raw, self.limits)
        uid = api.user_id(req.user_id)
        query = api.text_field(req.query, "query", self.limits.max_query_chars)
        k = api.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        hits = await self._need("Search").search(uid, query, k)
        recs = await self._records(uid, [f for f, _ in hits])
        return pb2.SearchResponse(hits=[pb2.SearchHit(fact=api.fact_pb(recs[f]), score=s)
                                        for f, s in hits if f in recs])

    async def _records(self, user_id: str, fact_ids: list[str]) -> dict[str, FactRecord]:
        """Records of the user by id, skipping any deleted since the replica answered."""
        out = {}
        for fid in fact_ids:
            try:
                out[fid] = await _blocking(self.registry.get, user_id, fid)
            except KeyError:
                continue
        return out

    async def Answer(self, raw):  # noqa: N802 - async generator of AnswerChunk
        req = api.parse("Answer", raw, self.limits)
        uid = api.user_id(req.user_id)
        query = api.text_field(req.query, "query", self.limits.max_query_chars)
        k = api.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        max_tokens = api.bounded_int(req.max_tokens, "max_tokens", 1, self.limits.max_max_tokens,
                                     self.limits.default_max_tokens)
        if not 0.0 <= req.temperature <= 2.0:
            raise api.invalid(f"temperature must be in [0, 2], got {req.temperature}")
        mode = api.answer_mode(req.mode)
        backends = self._need("Answer")
        async for piece in backends.answer(uid, query, k, max_tokens, float(req.temperature), mode):
            if piece.get("final"):
                yield pb2.AnswerChunk(
                    text=piece.get("text", ""), final=True, ttft_ms=piece.get("ttft_ms", 0.0),
                    fact_ids=piece.get("fact_ids", []), prompt_tokens=piece.get("prompt_tokens", 0),
                    prefilled_tokens=piece.get("prefilled_tokens", 0),
                    completion_tokens=piece.get("completion_tokens", 0),
                    finish_reason=piece.get("finish_reason", ""))
            else:
                yield pb2.AnswerChunk(text=piece.get("text", ""))

    async def GetMemory(self, raw):  # noqa: N802
        req = api.parse("GetMemory", raw, self.limits)
        rec = await _blocking(self.registry.get, api.user_id(req.user_id), api.fact_id(req.fact_id))
        return api.fact_pb(rec)

    async def ListMemories(self, raw):  # noqa: N802
        req = api.parse("ListMemories", raw, self.limits)
        uid = api.user_id(req.user_id)
        size = api.bounded_int(req.page_size, "page_size", 1, self.limits.max_page_size,
                               self.limits.default_page_size)
        offset = api.page_token(req.page_token)
        recs, nxt = await _blocking(self.registry.list, uid, offset, size)
        return pb2.ListMemoriesResponse(facts=[api.fact_pb(r) for r in recs],
                                        next_page_token="" if nxt is None else str(nxt))

    async def UpdateMemory(self, raw):  # noqa: N802
        req = api.parse("UpdateMemory", raw, self.limits)
        uid, fid = api.user_id(req.user_id), api.fact_id(req.fact_id)
        text = (api.text_field(req.text, "text", self.limits.max_fact_chars).strip()
                if req.HasField("text") else None)
        meta = api.metadata(req.metadata, "metadata", self.limits)
        if text is None and not meta and not req.replace_metadata:
            raise api.invalid("nothing to update: set text and/or metadata")
        if req.expected_version < 0:
            raise api.invalid(f"expected_version must be >= 0, got {req.expected_version}")
        rec = await self.update_fact(uid, fid, text, meta if (meta or req.replace_metadata) else None,
                                     req.replace_metadata, req.expected_version)
        return api.fact_pb(rec)

    async def DeleteMemory(self, raw):  # noqa: N802
        req = api.parse("DeleteMemory", raw, self.limits)
        uid, fid = api.user_id(req.user_id), api.fact_id(req.fact_id)
        await self.delete_fact(uid, fid)
        return pb2.DeleteMemoryResponse(fact_id=fid)

    async def DeleteUser(self, raw):  # noqa: N802
        req = api.parse("DeleteUser", raw, self.limits)
        uid = api.user_id(req.user_id)
        n = await _blocking(self.registry.delete_user, uid)
        if n == 0:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown user {uid!r}: no facts stored for this user")
        if self.backends is not None:
            await self._push(self.backends.forget_user(uid), "forget_user")
        return pb2.DeleteUserResponse(deleted=n)

    async def Health(self, raw):  # noqa: N802
        api.parse("Health", raw, self.limits)
        components = {}
        try:
            await _blocking(self.registry.ping)
            components["registry"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported, not raised
            components["registry"] = f"error: {type(e).__name__}: {e}"
        if self.backends is None:
            components["backends"] = "none (registry-only mode)"
        else:
            try:
                components.update(await self.backends.health())
            except Exception as e:  # noqa: BLE001
                components["backends"] = f"error: {type(e).__name__}: {e}"
        ok = all(v == "ok" or v.startswith("none") for v in components.values())
        return pb2.HealthResponse(status="SERVING" if ok else "DEGRADED", components=components)


class GatewaySink:
    """The FactSink of services/mem0_provider.py over a GatewayCore. Mem0 runs in a worker thread; writes
    and backend calls are run on the gateway's event loop, so they take the same path as the RPCs."""

    def __init__(self, core: GatewayCore, loop: asyncio.AbstractEventLoop, timeout_s: float = 300.0):
        self.core, self.loop, self.timeout_s = core, loop, timeout_s

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def add(self, user_id, facts):
        return self._run(self.core.store_new(user_id, facts))

    def search(self, user_id, vector, k):
        return self._run(self.core.backends.search_vector(user_id, vector, k))

    def get(self, user_id, fact_id):
        return self.core.registry.get(user_id, fact_id)

    def list(self, user_id):
        return self.core.registry.list(user_id)[0]

    def update(self, user_id, fact_id, text, vector, metadata):
        return self._run(self.core.update_fact(user_id, fact_id, text, metadata, embedding=vector))

    def delete(self, user_id, fact_id):
        self._run(self.core.delete_fact(user_id, fact_id))

    def chat(self, messages, max_tokens, temperature, structured):
        return self._run(self.core.backends.chat(messages, max_tokens, temperature, structured))

    def chat_room(self, messages):
        return self._run(self.core.backends.chat_room(messages))


UNARY = [m for m in api.REQUEST_TYPES if m not in api.STREAMING]


# ------------------------------------------------------------------------------- plain grpc server
class GrpcServicer:
    """grpc.aio servicer over a GatewayCore: ApiError -> status code + details; anything else -> INTERNAL."""

    def __init__(self, core: GatewayCore):
        self.core = core
        for name in UNARY:
            setattr(self, name, self._unary(name))

    def _unary(self, name: str):
        async def handler(raw, context):
            try:
                return await getattr(self.core, name)(raw)
            except Exception as e:  # noqa: BLE001 - mapped to a status, never leaked
                err = api.to_api_error(e)
                if err.code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", name)
                await context.abort(err.code, err.message)
        return handler

    async def Answer(self, raw, context):  # noqa: N802
        try:
            async for chunk in self.core.Answer(raw):
                yield chunk
        except Exception as e:  # noqa: BLE001
            err = api.to_api_error(e)
            if err.code == grpc.StatusCode.INTERNAL:
                log.exception("Answer failed")
            await context.abort(err.code, err.message)


async def start_grpc_server(core: GatewayCore, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the Memory service on `address`; returns (server, bound port)."""
    server = grpc.aio.server()
    api.add_MemoryServicer_to_server(GrpcServicer(core), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind the gRPC server to {address}")
    await server.start()
    return server, port


# ----------------------------------------------------------------------------------------- HTTP
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


def build_http_app(core_getter):
    """FastAPI app with the OpenAI-compatible chat endpoint. `core_getter()` returns the GatewayCore (the
    Serve deployment builds its core in __init__, after the app object exists)."""
    app = FastAPI(title="InferScale", docs_url=None, redoc_url=None)

    def error(err: ApiError) -> JSONResponse:
        return JSONResponse(status_code=HTTP_STATUS.get(err.code, 500), content={
            "error": {"message": err.message, "type": "invalid_request_error" if err.code in (
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED) else "api_error",
                      "code": err.code.name.lower()}})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        core = core_getter()
        body = await request.body()
        if len(body) > core.limits.max_request_bytes:
            return error(api.too_big(f"request body is {len(body)} bytes, the limit is "
                                     f"{core.limits.max_request_bytes} bytes"))
        try:
            areq, stream, model = _chat_to_answer(body)
            raw = areq.SerializeToString()
            api.parse("Answer", raw, core.limits)
            gen = core.Answer(raw)
            first = await gen.__anext__()  # validation and backend errors surface before any byte is sent
        except StopAsyncIteration:
            return error(ApiError(grpc.StatusCode.INTERNAL, "the engine produced no output"))
        except Exception as e:  # noqa: BLE001
            return error(api.to_api_error(e))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return StreamingResponse(_sse(gen, first, cid, created, model), media_type="text/event-stream")
        text, last = first.text, first
        async for chunk in gen:
            text += chunk.text
            last = chunk
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": last.finish_reason or "stop"}],
                "usage": {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                          "total_tokens": last.prompt_tokens + last.completion_tokens},
                "inferscale": {"fact_ids": list(last.fact_ids), "ttft_ms": last.ttft_ms,
                               "prefilled_tokens": last.prefilled_tokens}}

    @app.get("/healthz")
    async def healthz():
        h = await core_getter().Health(b"")
        return JSONResponse(status_code=200 if h.status == "SERVING" else 503,
                            content={"status": h.status, "components": dict(h.components)})

    return app


def _chat_to_answer(body: bytes):
    """OpenAI chat request -> (AnswerRequest, stream, model). The last user message is the query; `user`
    selects whose memory is used; `k` and `inferscale_mode` are InferScale extensions."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.invalid(f"request body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise api.invalid("request body must be a JSON object")
    user = data.get("user")
    if not isinstance(user, str) or not user:
        raise api.invalid("`user` is required: it selects whose memory answers the request")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise api.invalid("`messages` must be a non-empty list")
    queries = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not queries or not isinstance(queries[-1], str):
        raise api.invalid("`messages` must contain a user message with string content")

    def num(name, kind, default):
        v = data.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, kind):
            raise api.invalid(f"`{name}` must be a {'number' if kind is not int else 'integer'}, got {v!r}")
        return v

    max_tokens = num("max_completion_tokens", int, None) or num("max_tokens", int, 0)
    req = pb2.AnswerRequest(user_id=user, query=queries[-1], k=num("k", int, 0), max_tokens=max_tokens,
                            temperature=float(num("temperature", (int, float), 0.0)),
                            mode=str(data.get("inferscale_mode", "")))
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise api.invalid(f"`stream` must be a boolean, got {stream!r}")
    return req, stream, str(data.get("model", "inferscale"))


async def _sse(gen, first, cid: str, created: int, model: str):
    def event(delta: dict, finish=None, extra=None) -> str:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if extra:
            obj["inferscale"] = extra
        return f"data: {json.dumps(obj)}\n\n"

    yield event({"role": "assistant", "content": ""})
    chunk = first
    while True:
        if chunk.final:
            if chunk.text:
                yield event({"content": chunk.text})
            yield event({}, chunk.finish_reason or "stop",
                        {"fact_ids": list(chunk.fact_ids), "ttft_ms": chunk.ttft_ms,
                         "prefilled_tokens": chunk.prefilled_tokens})
            break
        yield event({"content": chunk.text})
        try:
            chunk = await gen.__anext__()
        except StopAsyncIteration:
            break
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------ Ray Serve
class ServeBackends:
    """Backends over Serve deployment handles. Every per-user call carries multiplexed_model_id = user id,
    so Serve routes it to a replica that already holds the user's index / KV store."""

    def __init__(self, encoder, retrieval, engine, timeout_s: float = 120.0):
        self.encoder, self.retrieval, self.engine, self.timeout_s = encoder, retrieval, engine, timeout_s

    def _r(self, user_id: str):
        return self.retrieval.options(multiplexed_model_id=user_id)

    def _e(self, user_id: str, stream: bool = False):
        return self.engine.options(multiplexed_model_id=user_id, stream=stream)

    async def index_facts(self, user_id, records):
        indexed = self._r(user_id).index_facts.remote(user_id, [(r.fact_id, r.version, r.text) for r in records])
        # The encoder's response is handed to the engine call unresolved: Serve passes it on as an object
        # reference and the engine replica reads the KV tensors from the object store; they never come here.
        encoded = self.encoder.encode.remote([(r.text, list(r.window)) for r in records])
        placed = self._e(user_id).put_facts.remote(user_id, [(r.fact_id, r.version) for r in records], encoded)
        await asyncio.wait_for(asyncio.gather(indexed, placed), self.timeout_s)

    async def search(self, user_id, query, k):
        return await asyncio.wait_for(self._r(user_id).search.remote(user_id, query, k), self.timeout_s)

    async def answer(self, user_id, query, k, max_tokens, temperature, mode):
        from inferscale_core.compose import serving_order

        hits = await self.search(user_id, query, k)
        fact_ids = serving_order(hits)  # most relevant last, next to the query
        async for piece in self._e(user_id, stream=True).answer.remote(user_id, query, fact_ids, max_tokens,
                                                                       temperature, mode):
            yield piece

    async def forget(self, user_id, facts):
        await asyncio.gather(self._r(user_id).forget.remote(user_id, [f for f, _ in facts]),
                             self._e(user_id).forget.remote(user_id, facts))

    async def forget_user(self, user_id):
        await asyncio.gather(self._r(user_id).forget_user.remote(user_id),
                             self._e(user_id).forget_user.remote(user_id))

    async def search_vector(self, user_id, vector, k):
        return await asyncio.wait_for(self._r(user_id).search_vector.remote(user_id, vector, k), self.timeout_s)

    async def chat(self, messages, max_tokens, temperature, structured):
        # Plain chat holds no user's KV: any engine replica will do.
        return await asyncio.wait_for(self.engine.chat.remote(messages, max_tokens, temperature, structured),
                                      self.timeout_s)

    async def chat_room(self, messages):
        return await asyncio.wait_for(self.engine.chat_room.remote(messages), self.timeout_s)

    async def health(self):
        out = {}
        for name, handle in (("encoder_pool", self.encoder), ("retrieval", self.retrieval),
                             ("engine", self.engine)):
            try:
                out[name] = await asyncio.wait_for(handle.health.remote(), 10)
            except Exception as e:  # noqa: BLE001 - reported in the health answer
                out[name] = f"error: {type(e).__name__}: {e}"
        return out


def _replica_core() -> GatewayCore:
    """The GatewayCore of the Gateway replica serving this HTTP request. (The FastAPI app is pickled into
    the replica, so it cannot close over module state; Serve's replica context names the instance.)"""
    from ray import serve

    return serve.get_replica_context().servable_object.core


http_app = build_http_app(_replica_core)


class Gateway:
    """The ingress deployment (Serve options in services/app.py). gRPC methods carry the RPC names; Ray
    Serve's gRPC proxy calls them with the request's raw bytes (see api.add_MemoryServicer_to_server)."""

    def __init__(self, encoder=None, retrieval=None, engine=None, registry_url: str | None = None,
                 limits: dict | None = None, embedder_path: str | None = None):
        from .registry import open_registry

        # No handles at all: registry-only mode (CRUD works, Search/Answer answer UNAVAILABLE).
        handles = (encoder, retrieval, engine)
        if any(h is None for h in handles) and not all(h is None for h in handles):
            raise ValueError("Gateway needs all three handles (encoder, retrieval, engine) or none")
        backends = ServeBackends(*handles) if encoder is not None else None
        self.core = GatewayCore(open_registry(registry_url), backends, Limits(**(limits or {})), embedder_path)

    async def _call(self, name: str, request, grpc_context):
        try:
            return await getattr(self.core, name)(request)
        except Exception as e:  # noqa: BLE001 - mapped to a status code for the proxy
            err = api.to_api_error(e)
            if err.code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", name)
            grpc_context.set_code(err.code)
            grpc_context.set_details(err.message)
            raise err from None

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

    async def Answer(self, request, grpc_context):  # noqa: N802 - server streaming
        try:
            async for chunk in self.core.Answer(request):
                yield chunk
        except Exception as e:  # noqa: BLE001
            err = api.to_api_error(e)
            if err.code == grpc.StatusCode.INTERNAL:
                log.exception("Answer failed")
            grpc_context.set_code(err.code)
            grpc_context.set_details(err.message)
            raise err from None
