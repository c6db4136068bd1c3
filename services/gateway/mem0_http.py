"""Mem0's platform HTTP API over a GatewayCore, close enough that Mem0's own client (`mem0ai` 2.2's
`MemoryClient(api_key=<InferScale token>, host=<InferScale URL>)`) works unchanged: add (with and without
inference), get_all, search (filters, threshold), get, update, delete, delete_all and history.

The caller is the token in `Authorization: Token <jwt>` (as Mem0 sends it; `Bearer` works too), checked before the
body is read. The memory used is the token's subject: a `user_id` a request names (top level, query or filters)
must be that subject (or the token carries memory:admin), never another user. agent_id / run_id / app_id are
Mem0's scopes below a user, stored in each fact's metadata under those names (services/filters.py). Errors are
{"detail": message} with the HTTP status Mem0's client maps to its exceptions. docs/mem0.md lists the routes;
the schema is FastAPI's, at /openapi.json.
"""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import api, filters
from ..api import ApiError
from ..registry import FactRecord
from .http_front import (
    HTTP_STATUS,
    PARSE_INLINE_BYTES,
    _check_declared_size,
    _Outcome,
    is_overload,
    read_body,
    retry_after_header,
)

DEFAULT_TOP_K = 10   # Mem0's default for search
DEPLOYMENT_ID = "inferscale"  # ping's org_id and project_id: MemoryClient needs both; one deployment is one project
PREFIX = "mem0."     # metric names of these routes (services/metrics.py)


# ------------------------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not implement is refused, never dropped


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str


class Scope(_Body):
    """Whose memory: user_id defaults to the token's subject; agent_id / run_id / app_id narrow it (Mem0's
    names). Also accepted inside `filters`."""
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    app_id: str | None = None


class AddRequest(Scope):
    messages: list[Message] = Field(min_length=1)
    infer: bool = Field(True, description="true: Mem0 extracts facts with the serving LLM; false: each non-system "
                                          "message is stored as it is")
    metadata: dict[str, Any] | None = None
    filters: dict[str, Any] | None = Field(None, description="only user_id / agent_id / run_id / app_id")


class ListRequest(Scope):
    filters: dict[str, Any] | None = None


class SearchRequest(ListRequest):
    query: str
    top_k: int | None = Field(None, description=f"1..64, default {DEFAULT_TOP_K}")
    threshold: float | None = Field(None, description="only memories with score >= threshold")
    rerank: Literal[False] | None = None  # no reranker here: true is refused


class UpdateRequest(_Body):
    text: str | None = None
    metadata: dict[str, Any] | None = Field(None, description="replaces the memory's metadata")


# ------------------------------------------------------------------------------------------ response bodies
class Memory(BaseModel):
    id: str
    memory: str
    user_id: str
    agent_id: str | None = None
    run_id: str | None = None
    app_id: str | None = None
    metadata: dict[str, Any] | None = None
    created_at: str
    updated_at: str
    version: int
    score: float | None = None


class HistoryEntry(BaseModel):
    id: str
    memory_id: str
    user_id: str
    event: Literal["ADD", "UPDATE"]
    old_memory: str | None
    new_memory: str
    metadata: dict[str, Any] | None
    version: int
    created_at: str


class AddEvent(BaseModel):
    id: str
    memory: str
    event: str
    previous_memory: str | None = None


class AddResponse(BaseModel):
    results: list[AddEvent]


class Page(BaseModel):
    count: int
    next: str | None
    previous: str | None
    results: list[Memory]


class SearchResponse(BaseModel):
    results: list[Memory]


class Done(BaseModel):
    message: str
    deleted: int | None = None


class Ping(BaseModel):
    status: str
    user_id: str
    org_id: str
    project_id: str
    user_email: None = None


# --------------------------------------------------------------------------------------------------- helpers
def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def memory_json(rec: FactRecord, score: float | None = None) -> dict:
    """A fact as Mem0 shows a memory: its scope fields beside the metadata, ISO-8601 times."""
    meta = {k: v for k, v in rec.metadata.items() if k not in filters.SCOPE_FIELDS}
    out = {"id": rec.fact_id, "memory": rec.text, "user_id": rec.user_id,
           **{k: rec.metadata.get(k) for k in filters.SCOPE_FIELDS}, "metadata": meta or None,
           "created_at": _iso(rec.created_at), "updated_at": _iso(rec.updated_at), "version": rec.version}
    if score is not None:
        out["score"] = score
    return out


def history_json(rec: FactRecord, earlier: list) -> list[dict]:
    """Mem0's history of a memory, oldest first: ADD for version 1, UPDATE for each later text or metadata
    change (the last entry is the current version)."""
    versions = [(v.version, v.text, v.metadata, v.updated_at) for v in earlier]
    versions.append((rec.version, rec.text, rec.metadata, rec.updated_at))
    out, prev = [], None
    for version, text, meta, at in versions:
        meta = {k: v for k, v in meta.items() if k not in filters.SCOPE_FIELDS}
        out.append({"id": f"{rec.fact_id}-v{version}", "memory_id": rec.fact_id, "user_id": rec.user_id,
                    "event": "ADD" if version == 1 else "UPDATE", "old_memory": prev, "new_memory": text,
                    "metadata": meta or None, "version": version, "created_at": _iso(at)})
        prev = text
    return out


def _bearer(header: str | None) -> str | None:
    """Mem0's client sends `Token <key>`: the same JWT as `Bearer <jwt>`."""
    if header is not None and header[:6].lower() == "token ":
        return "Bearer " + header[6:]
    return header


def _metadata(value, limits: api.Limits) -> dict:
    """Mem0 metadata: a JSON object (any JSON values), within the same bounds as the gRPC metadata map; the scope
    names are set through their own fields."""
    if value is None:
        return {}
    if len(value) > limits.max_metadata_entries:
        raise api.too_big(f"metadata has {len(value)} entries, the limit is {limits.max_metadata_entries}")
    for k, v in value.items():
        if not k or len(k) > limits.max_metadata_key_chars:
            raise api.invalid(f"metadata keys must be 1..{limits.max_metadata_key_chars} characters")
        if k in filters.SCOPE_FIELDS:
            raise api.invalid(f"metadata.{k}: set the {k} field (or filters.{k}) instead; it is a scope")
        if len(json.dumps(v)) > limits.max_metadata_value_chars:
            raise api.too_big(f"metadata[{k!r}] is over {limits.max_metadata_value_chars} characters as JSON")
    return dict(value)


def _parse(model: type[_Body], body: bytes):
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise api.invalid(f"`{where}` is not supported by this server") from None
        if first["type"] == "json_invalid":
            raise api.invalid(f"request body is not JSON ({first['msg']})") from None
        raise api.invalid(f"{where}: {first['msg']}"[:500]) from None


def _error(err: ApiError) -> JSONResponse:
    """{"detail", "code"} with the status Mem0's client maps to its exceptions; overload is 429 with Retry-After
    (its RateLimitError), 401 carries the challenge."""
    content = {"detail": err.message, "code": err.code.name.lower()}
    if is_overload(err):
        return JSONResponse(status_code=429, headers=retry_after_header(err), content=content)
    headers = {"WWW-Authenticate": "Token"} if err.code == grpc.StatusCode.UNAUTHENTICATED else None
    return JSONResponse(status_code=HTTP_STATUS.get(err.code, 500), headers=headers, content=content)


def _schema(model: type[BaseModel]) -> dict:
    """A request body's JSON schema with its $defs inlined (for the OpenAPI document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node
    return inline(schema)


def _doc(request_model=None, response_model=None) -> dict:
    """FastAPI route options that document a body this module parses itself (after authentication)."""
    out = {}
    if request_model is not None:
        out["openapi_extra"] = {"requestBody": {"required": True, "content": {
            "application/json": {"schema": _schema(request_model)}}}}
    if response_model is not None:
        out["responses"] = {200: {"model": response_model}}
    return out


# ---------------------------------------------------------------------------------------------------- routes
def mount_mem0(app: FastAPI, core_getter, metrics_getter=None) -> None:
    """Adds Mem0's routes to the HTTP front door's FastAPI app."""
    from .grpc_front import status_of

    def route(rpc: str, name: str, body_model=None):
        """Wraps a handler(core, caller, request, body) with: declared size, authentication (before the body is
        read), the body read within the limit and parsed, metrics, and errors as {"detail": ...}."""
        def wrap(handler):
            async def endpoint(request: Request):
                core = core_getter()
                done = _Outcome(metrics_getter() if metrics_getter is not None else None, PREFIX + name)
                try:
                    _check_declared_size(request, core.limits.max_request_bytes)
                    caller = await core.authenticate(rpc, _bearer(request.headers.get("authorization")))
                    body = None
                    if body_model is not None:
                        raw = await read_body(request, core.limits.max_request_bytes)
                        body = (_parse(body_model, raw) if len(raw) <= PARSE_INLINE_BYTES
                                else await asyncio.to_thread(_parse, body_model, raw))
                    out = await handler(core, caller, request, body)
                except Exception as e:  # noqa: BLE001
                    err = status_of(PREFIX + name, e)
                    done(err.code)
                    return _error(err)
                done(grpc.StatusCode.OK)
                return JSONResponse(out)
            endpoint.__name__ = f"mem0_{name}"
            return endpoint
        return wrap

    def owner(core, caller, rpc: str, *named: str | None) -> str:
        """The user the request acts for: the user_id it names (all that name one must agree) or the token's
        subject; authorized like every RPC (another user's needs the memory:admin scope)."""
        given = {n for n in named if n is not None}
        if len(given) > 1:
            raise api.invalid("the request names more than one user_id")
        if given:
            uid = given.pop()
        elif core.auth.enabled:
            uid = caller.subject
        else:
            raise api.invalid("user_id is required (this server runs without authentication)")
        return core._owner(caller, rpc, uid)

    def scope_of(body: Scope, flt: dict | None) -> dict:
        """agent_id / run_id / app_id from the body's fields and the filters' top level (must agree)."""
        out = {}
        for name in filters.SCOPE_FIELDS:
            values = {v for v in (getattr(body, name), (flt or {}).get(name)) if v is not None}
            if len(values) > 1:
                raise api.invalid(f"{name} and filters.{name} differ")
            if values:
                out[name] = values.pop()
        return filters.scope_metadata(**out)

    def get_fact(core, caller, request, rpc: str):
        uid = owner(core, caller, rpc, request.query_params.get("user_id"))
        fid = api.fact_id(request.path_params["memory_id"], "memory_id")
        return uid, fid

    def no_params(request: Request, allowed=("user_id",)):
        extra = sorted(set(request.query_params) - set(allowed))
        if extra:
            raise api.invalid(f"query parameter `{extra[0]}` is not supported here")

    @route("GetMemory", "ping")
    async def ping(core, caller, request, body):
        """The token check MemoryClient runs when it is built."""
        return {"status": "ok", "user_id": caller.subject, "org_id": DEPLOYMENT_ID, "project_id": DEPLOYMENT_ID,
                "user_email": None}

    @route("AddMemory", "add", AddRequest)
    async def add(core, caller, request, body: AddRequest):
        flt = body.filters or {}
        unknown = sorted(set(flt) - {"user_id", *filters.SCOPE_FIELDS})
        if unknown:
            raise api.invalid(f"filters.{unknown[0]}: add takes only user_id, agent_id, run_id and app_id in filters")
        uid = owner(core, caller, "AddMemory", body.user_id, flt.get("user_id"))
        messages = api.messages_in(body.messages, core.limits)
        meta = {**_metadata(body.metadata, core.limits), **scope_of(body, flt)}
        events = await core.add_memory(uid, messages, meta, body.infer)
        return {"results": [{"id": e["id"], "memory": e.get("memory", ""), "event": e.get("event", "ADD"),
                             **({"previous_memory": e["previous_memory"]} if e.get("previous_memory") else {})}
                            for e in events]}

    @route("ListMemories", "get_all", ListRequest)
    async def get_all(core, caller, request, body: ListRequest):
        no_params(request, ("page", "page_size"))
        uid = owner(core, caller, "ListMemories", body.user_id, filters.user_of(body.filters))
        match = _match(body, uid)
        page = _int_param(request, "page", 1, 1 << 30, 1)
        size = _int_param(request, "page_size", 1, core.limits.max_page_size, core.limits.default_page_size)
        first = (page - 1) * size
        if match is None:  # the page alone: the count is the registry's
            count = await asyncio.to_thread(core.registry.count, uid)
            recs = (await asyncio.to_thread(core.registry.list, uid, first, size))[0] if first < count else []
            results = [memory_json(r) for r in recs]
        else:  # one pass over the user's facts, 1000 at a time, read and matched in a worker thread (never the loop)
            count, results, offset = 0, [], 0
            while offset is not None:
                recs, offset = await asyncio.to_thread(_matching, core.registry, uid, offset, match)
                results += [memory_json(r) for r in recs[max(0, first - count):max(0, first + size - count)]]
                count += len(recs)
        base = f"{str(request.base_url).rstrip('/')}/v3/memories/?page_size={size}&page="
        return {"count": count, "next": base + str(page + 1) if first + size < count else None,
                "previous": base + str(page - 1) if page > 1 else None, "results": results}

    def _match(body: ListRequest, uid: str):
        scope = scope_of(body, None)
        flt = body.filters
        if scope:
            flt = {"AND": [scope, flt]} if flt else scope
        return filters.compile_filter(flt, uid)

    @route("Search", "search", SearchRequest)
    async def search(core, caller, request, body: SearchRequest):
        uid = owner(core, caller, "Search", body.user_id, filters.user_of(body.filters))
        query = api.text_field(body.query, "query", core.limits.max_query_chars).strip()
        k = DEFAULT_TOP_K if body.top_k is None else body.top_k
        if not 1 <= k <= core.limits.max_k:
            raise api.invalid(f"top_k must be in [1, {core.limits.max_k}], got {k}")
        hits = await core.search_records(uid, query, k, _match(body, uid), body.threshold)
        return {"results": [memory_json(r, s) for r, s in hits]}

    @route("GetMemory", "get")
    async def get(core, caller, request, body):
        no_params(request)
        uid, fid = get_fact(core, caller, request, "GetMemory")
        return memory_json(await asyncio.to_thread(core.registry.get, uid, fid))

    @route("UpdateMemory", "update", UpdateRequest)
    async def update(core, caller, request, body: UpdateRequest):
        no_params(request)
        uid, fid = get_fact(core, caller, request, "UpdateMemory")
        text = None if body.text is None else api.text_field(body.text, "text", core.limits.max_fact_chars).strip()
        meta = None if body.metadata is None else _metadata(body.metadata, core.limits)
        if text is None and meta is None:
            raise api.invalid("nothing to update: send text and/or metadata")
        if meta is not None:  # Mem0 replaces the metadata; the scope fields stay what they were
            cur = await asyncio.to_thread(core.registry.get, uid, fid)
            meta = {**meta, **{k: v for k, v in cur.metadata.items() if k in filters.SCOPE_FIELDS}}
        rec = await core.update_fact(uid, fid, text, meta, replace_metadata=meta is not None)
        return memory_json(rec)

    @route("DeleteMemory", "delete")
    async def delete(core, caller, request, body):
        no_params(request, ("user_id", "delete_linked"))
        if request.query_params.get("delete_linked", "false").lower() not in ("false", "0"):
            raise api.invalid("delete_linked is not supported: a memory here has no linked earlier memories")
        uid, fid = get_fact(core, caller, request, "DeleteMemory")
        await core.delete_fact(uid, fid)
        return {"message": "Memory deleted successfully!"}

    @route("GetMemory", "history")
    async def history(core, caller, request, body):
        no_params(request)
        uid, fid = get_fact(core, caller, request, "GetMemory")
        earlier = await asyncio.to_thread(core.registry.history, uid, fid)
        rec = await asyncio.to_thread(core.registry.get, uid, fid)
        return history_json(rec, [v for v in earlier if v.version < rec.version])

    @route("DeleteUser", "delete_all")
    async def delete_all(core, caller, request, body):
        """All of the user's memories, or with agent_id / run_id / app_id those of that scope. A user with no
        memories is no error (Mem0's delete_all)."""
        no_params(request, ("user_id", *filters.SCOPE_FIELDS))
        q = request.query_params
        uid = owner(core, caller, "DeleteUser", q.get("user_id"))
        scope = filters.scope_metadata(**{k: q.get(k) for k in filters.SCOPE_FIELDS})
        if not scope:
            n = (await core.DeleteUser(api.pb2.DeleteUserRequest(user_id=uid), caller)).deleted
        else:
            match, n, offset, doomed = filters.compile_filter(scope, uid), 0, 0, []
            while offset is not None:
                recs, offset = await asyncio.to_thread(core.registry.list, uid, offset, 1000)
                doomed += [r.fact_id for r in recs if match(r)]
            for fid in doomed:
                try:
                    await core.delete_fact(uid, fid)
                    n += 1
                except Exception as e:  # deleted meanwhile: gone either way
                    if api.to_api_error(e).code != grpc.StatusCode.NOT_FOUND:
                        raise
        return {"message": "Memories deleted successfully!", "deleted": n}

    # Mem0's paths, with their trailing slashes as MemoryClient sends them.
    app.add_api_route("/v1/ping/", ping, methods=["GET"], **_doc(None, Ping), tags=["mem0"])
    app.add_api_route("/v3/memories/add/", add, methods=["POST"], **_doc(AddRequest, AddResponse), tags=["mem0"])
    app.add_api_route("/v3/memories/", get_all, methods=["POST"], **_doc(ListRequest, Page), tags=["mem0"])
    app.add_api_route("/v3/memories/search/", search, methods=["POST"], **_doc(SearchRequest, SearchResponse),
                      tags=["mem0"])
    app.add_api_route("/v1/memories/", delete_all, methods=["DELETE"], **_doc(None, Done), tags=["mem0"])
    app.add_api_route("/v1/memories/{memory_id}/", get, methods=["GET"], **_doc(None, Memory), tags=["mem0"])
    app.add_api_route("/v1/memories/{memory_id}/", update, methods=["PUT"], **_doc(UpdateRequest, Memory),
                      tags=["mem0"])
    app.add_api_route("/v1/memories/{memory_id}/", delete, methods=["DELETE"], **_doc(None, Done),
                      tags=["mem0"])
    app.add_api_route("/v1/memories/{memory_id}/history/", history, methods=["GET"],
                      **_doc(None, list[HistoryEntry]), tags=["mem0"])


def _matching(registry, uid: str, offset: int, match) -> tuple[list, int | None]:
    """The facts `match` keeps among the next 1000 of the user's from `offset`, and the offset after them."""
    recs, offset = registry.list(uid, offset, 1000)
    return [r for r in recs if match(r)], offset


def _int_param(request: Request, name: str, lo: int, hi: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or not lo <= int(raw) <= hi:
        raise api.invalid(f"{name} must be an integer in [{lo}, {hi}], got {raw[:40]!r}")
    return int(raw)
