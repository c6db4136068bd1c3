"""Mem0's platform HTTP API over a GatewayCore, close enough that Mem0's own client (`mem0ai` 2.2's
`MemoryClient(api_key=<InferScale token>, host=<InferScale URL>)`, and AsyncMemoryClient) works unchanged: add (with
and without inference), get_all, search (filters, threshold), get, update, delete, delete_all (scopes, filters),
history, batch_update, batch_delete, users, delete_users, reset and feedback; add's timestamp (created_at) and
expiration_date (also update's: an expired memory is stored but not listed, searched or injected into answers, as
on Mem0's platform; get by id still answers it). Every other route of the client answers 501 naming the call
(UNSUPPORTED), never 404: the client raises 404 as MemoryNotFoundError, and an app could not tell "not implemented"
from "already gone".

The caller is the token in `Authorization: Token <jwt>` (as Mem0 sends it; `Bearer` works too), checked before the
body is read. The memory used is the token's subject: a `user_id` a request names (top level, query or filters)
must be that subject (or the token carries memory:admin), never another user; "*" (Mem0's wildcard) names every
user the token may act for, which for a user's token is its subject and for an admin is refused (nothing here acts
on every user at once). Without authentication (--insecure-no-auth) a memory id alone names its memory, its owner
looked up in the registry (Registry.owners_of), since the client sends no user_id with get, update, delete and
history. agent_id / run_id / app_id are Mem0's scopes below a user, stored in each fact's metadata
under those names (services/filters.py). Errors are {"detail": message, "code"} with the HTTP status Mem0's client
maps to its exceptions. docs/mem0.md lists the routes and each client call; the schema is FastAPI's, at
/openapi.json.
"""
from __future__ import annotations

import ast
import asyncio
import json
import math
import re
import time
from datetime import date, datetime, timedelta, timezone
from datetime import time as clock
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, ValidationError

from .. import filters, validation
from ..api import pb2
from ..errors import ApiError, invalid, to_api_error, too_big
from ..limits import Limits
from ..registry import FactRecord
from .http_common import (
    HTTP_STATUS,
    PARSE_INLINE_BYTES,
    Outcome,
    check_declared_size,
    is_overload,
    read_body,
    retry_after_header,
)
from .work_budget import Resource, scan_units

DEFAULT_TOP_K = 10   # Mem0's default for search
IDEMPOTENCY_HEADER = "idempotency-key"  # add's idempotency key (infer=false), as the IETF httpapi draft names it
DEPLOYMENT_ID = "inferscale"  # ping's org_id and project_id: MemoryClient needs both; one deployment is one project
PREFIX = "mem0."     # metric names of these routes (services/metrics.py)
WILDCARD = "*"       # Mem0's "every": a user_id of every user the caller may act for, a scope value of any value
ENTITY_FIELDS = {"user": "user_id", "agent": "agent_id", "app": "app_id", "run": "run_id"}  # Mem0's entity types
MAX_FEEDBACK_REASON_CHARS = 2000
# add's `timestamp` (the memory's created_at) may be this far ahead of this server's clock (a client's clock skew),
# never further: a memory is not created in the future.
MAX_TIMESTAMP_AHEAD_S = 3600
DAY_S = 86400

# Options of Mem0's client refused when they carry a value, and why (a null is "not set" and passes, as the client
# sends update's expiration_date=None). Any other unknown field is refused by name too, never dropped.
REFUSED_OPTIONS = {
    "timestamp": "an update does not change when a memory was created; add(timestamp=...) sets that",
    "expiration_date": "batch_update changes text and metadata; update(memory_id, expiration_date=...) sets or "
                       "clears a memory's expiry",
    "custom_instructions": "the extraction prompt is Mem0's own (services/mem0_provider.py)",
    "agent_custom_instructions": "the extraction prompt is Mem0's own (services/mem0_provider.py)",
    "custom_categories": "memories here have no categories",
    "categories": "memories here have no categories",
    "structured_data_schema": "no structured extraction",
    "fields": "a memory is always answered whole",
    "reference_date": "no relative-time queries",
    "start_date": "filter on created_at instead: filters={\"created_at\": {\"gte\": ...}}",
    "end_date": "filter on created_at instead: filters={\"created_at\": {\"lte\": ...}}",
    "immutable": "every memory here can be updated",
    "enable_graph": "no graph memory",
    "async_mode": "add answers when the memories are stored",
    "output_format": "answers have Mem0's current (v1.1) format only",
}

# The client's routes this server does not serve: (method, path, the client calls that send it, why). Each answers
# 501 with {"detail", "code": "unimplemented", "call"}; any other path under the client's prefixes (is_mem0_path)
# answers 501 too. docs/mem0.md's table lists them; tests/unit/test_mem0_api.py checks it against the installed client.
_PROJECT = "/api/v1/orgs/organizations/{org_id}/projects/{project_id}/"
_NO_EXPORTS = "no export jobs: page through get_all (POST /v3/memories/) instead"
_NO_PROFILES = "no memory profiles"
_NO_PROJECTS = ("no organizations or projects: one deployment is one project, configured by its operator "
                "(docs/config.md), and custom instructions and categories are not supported")
_NO_MEMBERS = "no project members: who may call is decided by the token (docs/security.md)"
_NO_WEBHOOKS = "no webhooks"
UNSUPPORTED = (
    ("POST", "/v1/exports/", "create_memory_export", _NO_EXPORTS),
    ("POST", "/v1/exports/get/", "get_memory_export", _NO_EXPORTS),
    ("POST", "/v1/summary/", "get_summary", "no memory summaries"),
    ("GET", "/v2/entities/user/{entity_id}/profile/", "get_profile", _NO_PROFILES),
    ("POST", "/v2/profiles/jobs/", "generate_profile, sample_profiles", _NO_PROFILES),
    ("GET", "/v2/profiles/jobs/{job_id}/", "get_profile_job", _NO_PROFILES),
    ("GET", "/v2/profiles/settings/", "get_profile_settings", _NO_PROFILES),
    ("POST", "/v2/profiles/settings/", "update_profile_settings", _NO_PROFILES),
    ("GET", _PROJECT, "get_project, project.get", _NO_PROJECTS),
    ("PATCH", _PROJECT, "update_project, project.update", _NO_PROJECTS),
    ("DELETE", _PROJECT, "project.delete", _NO_PROJECTS),
    ("POST", "/api/v1/orgs/organizations/{org_id}/projects/", "project.create", _NO_PROJECTS),
    ("GET", _PROJECT + "members/", "project.get_members", _NO_MEMBERS),
    ("POST", _PROJECT + "members/", "project.add_member", _NO_MEMBERS),
    ("PUT", _PROJECT + "members/", "project.update_member", _NO_MEMBERS),
    ("DELETE", _PROJECT + "members/", "project.remove_member", _NO_MEMBERS),
    ("GET", "/api/v1/webhooks/projects/{project_id}/", "get_webhooks", _NO_WEBHOOKS),
    ("POST", "/api/v1/webhooks/projects/{project_id}/", "create_webhook", _NO_WEBHOOKS),
    ("PUT", "/api/v1/webhooks/{webhook_id}/", "update_webhook", _NO_WEBHOOKS),
    ("DELETE", "/api/v1/webhooks/{webhook_id}/", "delete_webhook", _NO_WEBHOOKS),
)
MEM0_V1 = ("memories", "batch", "entities", "exports", "summary", "feedback", "ping")  # Mem0's /v1/<first segment>


def _path_pattern(path: str) -> re.Pattern:
    """A route's path with its {placeholders} as one path segment each."""
    return re.compile("^" + "[^/]+".join(re.escape(p) for p in re.split(r"\{[^}]*\}", path)) + "$")


_UNSUPPORTED = [(method, path, calls, why, _path_pattern(path)) for method, path, calls, why in UNSUPPORTED]


def is_mem0_path(path: str) -> bool:
    """Under the prefixes of Mem0's client: /v2/, /v3/, /api/, and Mem0's part of /v1/ (OpenAI's /v1/chat/...
    and /v1/models are not)."""
    parts = path.lstrip("/").split("/")
    return parts[0] in ("v2", "v3", "api") or (parts[0] == "v1" and len(parts) > 1 and parts[1] in MEM0_V1)


def unsupported(method: str, path: str) -> tuple[str, str]:
    """(the client call, the message) of a request to a route this server does not serve."""
    for m, template, calls, why, pattern in _UNSUPPORTED:
        if m == method and pattern.match(path):
            return calls, f"{calls} ({m} {template}) is not supported by InferScale: {why}"
    where = f"{method} {path[:200]}"
    return where, (f"{where} is not supported by InferScale: its Mem0 API has no such route (docs/mem0.md lists "
                   "the routes and Mem0 client calls it serves)")


# ------------------------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not implement is refused, never dropped
    _nulls: frozenset = PrivateAttr(default_factory=frozenset)  # unknown top-level fields sent as null (not set)


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
    timestamp: StrictInt | None = Field(None, description="the added memories' created_at, a Unix time in seconds "
                                                          f"(at most {MAX_TIMESTAMP_AHEAD_S} s ahead of the "
                                                          "server's clock); default: now")
    expiration_date: str | None = Field(None, description="YYYY-MM-DD (UTC): the added memories are served through "
                                                          "that day, not after it")


class ListRequest(Scope):
    filters: dict[str, Any] | None = None
    show_expired: bool | None = Field(None, description="get_all: true lists expired memories too (default: not); "
                                                        "search: true is refused (an expired memory is never "
                                                        "searched or injected)")
    latest_only: bool | None = Field(None, description="an update replaces a memory here (its earlier versions are "
                                                       "its history): either value answers the same")


class SearchRequest(ListRequest):
    query: str
    top_k: int | None = Field(None, description=f"1..200, default {DEFAULT_TOP_K}")
    threshold: float | None = Field(None, description="only memories with score >= threshold")
    rerank: Literal[False] | None = None  # no reranker here: true is refused
    keyword_search: Literal[False] | None = None  # no keyword index: true is refused


class UpdateRequest(_Body):
    text: str | None = None
    metadata: dict[str, Any] | None = Field(None, description="replaces the memory's metadata")
    expiration_date: str | None = Field(None, description="YYYY-MM-DD (UTC): served through that day, not after "
                                                          "it; null clears the expiry")


class BatchUpdateItem(_Body):
    memory_id: str
    text: str | None = None
    metadata: dict[str, Any] | None = Field(None, description="replaces the memory's metadata")


class BatchUpdateRequest(_Body):
    memories: list[BatchUpdateItem] = Field(min_length=1, description="at most Limits.max_facts_per_request")


class BatchDeleteItem(_Body):
    memory_id: str


class BatchDeleteRequest(_Body):
    memories: list[BatchDeleteItem] = Field(min_length=1, description="at most Limits.max_facts_per_request")


class FeedbackRequest(_Body):
    memory_id: str
    feedback: Literal["POSITIVE", "NEGATIVE", "VERY_NEGATIVE"] | None = None
    feedback_reason: str | None = Field(None, max_length=MAX_FEEDBACK_REASON_CHARS)


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
    expiration_date: str | None = None
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


class BatchItem(BaseModel):
    memory_id: str
    status: Literal["updated", "deleted", "not_found", "failed"]
    memory: Memory | None = None
    code: str | None = None
    detail: str | None = None


class BatchResponse(BaseModel):
    message: str
    updated: int | None = None
    deleted: int | None = None
    results: list[BatchItem]


class Entity(BaseModel):
    id: str
    name: str
    type: Literal["user", "agent", "app", "run"]
    total_memories: int
    created_at: str
    updated_at: str
    owner: str
    organization: str
    metadata: dict[str, Any] | None = None


class Entities(BaseModel):
    count: int
    next: None = None
    previous: None = None
    results: list[Entity]


class FeedbackAck(BaseModel):
    message: str
    memory_id: str
    feedback: str | None
    feedback_reason: str | None


class Ping(BaseModel):
    status: str
    user_id: str
    org_id: str
    project_id: str
    user_email: None = None


class BatchFailed(ApiError):
    """A batch whose checks passed but some of whose writes failed: the first failure's status, with every item's
    outcome (the client raises it; its `details` hold the results)."""

    def __init__(self, err: ApiError, message: str, results: list[dict]):
        super().__init__(err.code, message, retry_after_s=err.retry_after_s, quota=err.quota, reason=err.reason)
        self.results = results


# --------------------------------------------------------------------------------------------------- helpers
def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def expires_at_of(value: str, name: str = "expiration_date") -> float:
    """Mem0's expiration_date, YYYY-MM-DD in UTC and the day itself included, as FactRecord.expires_at: the
    midnight (UTC) that ends that day. A date already past is taken: the memory is stored expired."""
    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value):
        raise invalid(f"{name} must be a date YYYY-MM-DD, got {value[:40]!r}", name)
    try:
        day = date.fromisoformat(value)
    except ValueError as e:
        raise invalid(f"{name} {value!r} is not a date ({e})", name) from None
    return datetime.combine(day, clock(), timezone.utc).timestamp() + DAY_S


def expiration_date_of(expires_at: float) -> str | None:
    """FactRecord.expires_at as Mem0's expiration_date: the last day (UTC) the memory is served, that day included;
    None: never expires. An expiry set on gRPC may fall within a day (Unix seconds): the memory is served during
    part of that day, so that day is the date."""
    if expires_at == math.inf:
        return None
    end = datetime.fromtimestamp(expires_at, timezone.utc)
    last = end.date() if end.time() != clock() else end.date() - timedelta(days=1)
    return last.isoformat()


def created_at_of(timestamp: int, now: float) -> float:
    """add's `timestamp`: a Unix time in seconds, from 1970 to MAX_TIMESTAMP_AHEAD_S past `now`."""
    if not 0 <= timestamp <= now + MAX_TIMESTAMP_AHEAD_S:
        raise invalid(f"timestamp {timestamp} is not a time a memory was created: it sets the memory's "
                          "created_at, a Unix time in seconds from 0 (1970) to now (at most "
                          f"{MAX_TIMESTAMP_AHEAD_S} s ahead of this server's clock)", "timestamp")
    return float(timestamp)


def memory_json(rec: FactRecord, score: float | None = None) -> dict:
    """A fact as Mem0 shows a memory: its scope fields beside the metadata, ISO-8601 times, its expiry date."""
    meta = {k: v for k, v in rec.metadata.items() if k not in filters.SCOPE_FIELDS}
    out = {"id": rec.fact_id, "memory": rec.text, "user_id": rec.user_id,
           **{k: rec.metadata.get(k) for k in filters.SCOPE_FIELDS}, "metadata": meta or None,
           "created_at": _iso(rec.created_at), "updated_at": _iso(rec.updated_at),
           "expiration_date": expiration_date_of(rec.expires_at), "version": rec.version}
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


def _metadata(value, limits: Limits, name: str = "metadata") -> dict:
    """Mem0 metadata: a JSON object (any JSON values), within the same bounds as the gRPC metadata map; the scope
    names are set through their own fields."""
    if value is None:
        return {}
    if len(value) > limits.max_metadata_entries:
        raise too_big(f"{name} has {len(value)} entries, the limit is {limits.max_metadata_entries}")
    for k, v in value.items():
        if not k or len(k) > limits.max_metadata_key_chars:
            raise invalid(f"{name} keys must be 1..{limits.max_metadata_key_chars} characters")
        if k in filters.SCOPE_FIELDS:
            raise invalid(f"{name}.{k}: set the {k} field (or filters.{k}) instead; it is a scope")
        if len(json.dumps(v)) > limits.max_metadata_value_chars:
            raise too_big(f"{name}[{k!r}] is over {limits.max_metadata_value_chars} characters as JSON")
    return dict(value)


def _scopes(rec: FactRecord) -> dict:
    return {k: v for k, v in rec.metadata.items() if k in filters.SCOPE_FIELDS}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _parse(model: type[_Body], body: bytes):
    """The body as `model`. A top-level field the model does not know is refused by name (with the reason when
    it is one of Mem0's options, REFUSED_OPTIONS), unless it is null: Mem0's "not set"."""
    try:
        data = json.loads(body or b"{}", parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise invalid(f"request body is not JSON ({str(e)[:200]})") from None
    nulls: frozenset[str] = frozenset()
    if isinstance(data, dict):
        nulls = frozenset(k for k, v in data.items() if v is None and k not in model.model_fields)
        data = {k: v for k, v in data.items() if k not in nulls}
    try:
        out = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            why = REFUSED_OPTIONS.get(str(first["loc"][-1]))
            raise invalid(f"`{where}` is not supported by this server" + (f": {why}" if why else "")) from None
        raise invalid(f"{where}: {first['msg']}"[:500]) from None
    out._nulls = nulls
    return out


def _query_filters(raw: str | None) -> dict | None:
    """delete_all's `filters` query parameter. MemoryClient sends a dict there as Python's str() of it (httpx
    writes a query value with str()): JSON is read, and so is that form (a Python literal, never evaluated as
    code), both turned into JSON values; the filter language and its limits are the same as everywhere."""
    if raw is None:
        return None
    if len(raw) > filters.MAX_FILTER_BYTES:
        raise too_big(f"filters is {len(raw)} characters, the limit is {filters.MAX_FILTER_BYTES}")
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        try:
            value = json.loads(json.dumps(ast.literal_eval(raw), allow_nan=False))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise invalid("filters (a query parameter here) must be a JSON object (or the str() of a Python "
                              "dict, as MemoryClient sends it)") from None
    if not isinstance(value, dict):
        raise invalid("filters must be an object of conditions")
    return value


def _without_user(flt: dict | None) -> dict | None:
    """`flt` without the user_id it names at its top or in a top-level AND (the request's user, resolved and
    authorized on its own): what is left narrows the user's memories; None when nothing is left."""
    if not isinstance(flt, dict):
        return flt
    out = {k: v for k, v in flt.items() if k != "user_id"}
    if isinstance(out.get("AND"), list) and out["AND"]:  # an empty AND stays, for the filter's own error
        rest = [{k: v for k, v in sub.items() if k != "user_id"} if isinstance(sub, dict) else sub
                for sub in out["AND"]]
        rest = [sub for sub in rest if sub != {}]
        if rest:
            out["AND"] = rest
        else:
            del out["AND"]
    return out or None


def _scope_filter(values: dict[str, str | None]) -> dict:
    """Scope fields as filter conditions: a value, or "*" (any value: the memories that have the scope)."""
    return {k: v if v == WILDCARD else validation.user_id(v, k) for k, v in values.items() if v not in (None, "")}


def _and(*parts: dict | None) -> dict | None:
    given = [p for p in parts if p]
    return None if not given else given[0] if len(given) == 1 else {"AND": given}


def _error(err: ApiError) -> JSONResponse:
    """{"detail", "code"} with the status Mem0's client maps to its exceptions; overload is 429 with Retry-After
    (its RateLimitError), 401 carries the challenge, not implemented is 501 (the client's base MemoryError)."""
    content: dict[str, object] = {"detail": err.message, "code": err.code.name.lower()}
    if isinstance(err, BatchFailed):
        content["results"] = err.results
    if is_overload(err):
        return JSONResponse(status_code=429, headers=retry_after_header(err), content=content)
    headers = {"WWW-Authenticate": "Token"} if err.code == grpc.StatusCode.UNAUTHENTICATED else None
    status = 501 if err.code == grpc.StatusCode.UNIMPLEMENTED else HTTP_STATUS.get(err.code, 500)
    return JSONResponse(status_code=status, headers=headers, content=content)


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
    out: dict[str, dict] = {}
    if request_model is not None:
        out["openapi_extra"] = {"requestBody": {"required": True, "content": {
            "application/json": {"schema": _schema(request_model)}}}}
    if response_model is not None:
        out["responses"] = {200: {"model": response_model}}
    return out


# ---------------------------------------------------------------------------------------------------- routes
def mount_mem0(app: FastAPI, core_getter, metrics_getter=None) -> None:
    """Adds Mem0's routes to the HTTP front door's FastAPI app, and 501 for the client's routes it does not serve."""
    from .grpc_front import status_of

    def metrics():
        return metrics_getter() if metrics_getter is not None else None

    def route(rpc: str, name: str, body_model=None):
        """Wraps a handler(core, caller, request, body) with: declared size, authentication (before the body is
        read), the body read within the limit and parsed, metrics, and errors as {"detail": ...}."""
        def wrap(handler):
            async def endpoint(request: Request):
                core = core_getter()
                done = Outcome(metrics(), PREFIX + name)
                try:
                    check_declared_size(request, core.limits.max_request_bytes)
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
        """The user the request acts for: the user_id it names (all that name one must agree; "*" is every user
        the caller may act for) or the token's subject; authorized like every RPC (another user's needs the
        memory:admin scope)."""
        given = {n for n in named if n is not None}
        if len(given) > 1:
            raise invalid("the request names more than one user_id")
        if given:
            uid = given.pop()
            if uid == WILDCARD:
                if not core.auth.enabled or caller.admin:
                    raise invalid("user_id \"*\" names every user, and a request here acts for one user "
                                      "(InferScale does not act on every user at once): name the user")
                uid = caller.subject  # every user a user's token may act for: itself
        elif core.auth.enabled:
            uid = caller.subject
        else:
            raise invalid("user_id is required (this server runs without authentication)")
        return core._owner(caller, rpc, uid)

    async def owners_of(core, caller, request, rpc: str, fids: list[str]) -> dict[str, str | None]:
        """memory id -> the user it is read or written as (None: no such memory). With authentication: the user
        the request names or the token's subject, never a lookup (another user's memory id is then unknown, 404,
        and nothing says whose it is). Without: the memory id alone is enough, its owner looked up in the
        registry (Registry.owners_of: every caller may act for every user there anyway); a `user_id` query
        parameter still narrows it to that user, and is needed for an id that several users' memories have."""
        named = request.query_params.get("user_id")
        if named is not None or core.auth.enabled:
            uid = owner(core, caller, rpc, named)
            return {f: uid for f in fids}
        out = {}
        for f in fids:
            users = await asyncio.to_thread(core.registry.owners_of, f)
            if len(users) > 1:
                raise invalid(f"memory id {f!r} names a memory of {len(users)} users here (ids chosen by their "
                                  "writers); name the user: the user_id query parameter", "user_id")
            out[f] = core._owner(caller, rpc, users[0]) if users else None
        return out

    async def fact_of(core, caller, request, rpc: str) -> tuple[str, str]:
        """(user, memory id) of a route with {memory_id}: 404 when that memory does not exist for the caller."""
        fid = validation.fact_id(request.path_params["memory_id"], "memory_id")
        uid = (await owners_of(core, caller, request, rpc, [fid]))[fid]
        if uid is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown memory {fid!r}")
        return uid, fid

    async def current(core, owners: dict[str, str | None]) -> dict[str, FactRecord]:
        """The records of those memories that exist for their owners now (one registry read per owner)."""
        by_user: dict[str, list[str]] = {}
        for fid, uid in owners.items():
            if uid is not None:
                by_user.setdefault(uid, []).append(fid)
        out = {}
        for uid, fids in by_user.items():
            out.update(await asyncio.to_thread(core.registry.find_many, uid, fids))
        return out

    def scope_of(body: Scope, flt: dict | None) -> dict:
        """agent_id / run_id / app_id from the body's fields and the filters' top level (must agree)."""
        out = {}
        for name in filters.SCOPE_FIELDS:
            values = {v for v in (getattr(body, name), (flt or {}).get(name)) if v is not None}
            if len(values) > 1:
                raise invalid(f"{name} and filters.{name} differ")
            if values:
                out[name] = values.pop()
        return filters.scope_metadata(**out)

    def no_params(request: Request, allowed=("user_id",)):
        extra = sorted(set(request.query_params) - set(allowed))
        if extra:
            raise invalid(f"query parameter `{extra[0]}` is not supported here")

    def batch_ids(items, limits: Limits) -> list[str]:
        """The memory ids of a batch, checked: at most max_facts_per_request, each valid, none twice."""
        if len(items) > limits.max_facts_per_request:
            raise too_big(f"memories has {len(items)} entries, the limit is {limits.max_facts_per_request}",
                              "memories")
        seen: dict[str, int] = {}
        for i, item in enumerate(items):
            fid = validation.fact_id(item.memory_id, f"memories[{i}].memory_id")
            if fid in seen:
                raise invalid(f"memories[{i}].memory_id repeats memories[{seen[fid]}].memory_id")
            seen[fid] = i
        return list(seen)

    async def delete_matching(core, uid: str, match) -> int:
        """Deletes the user's memories that `match` keeps (scanned(): read 1000 at a time, matched in a worker
        thread); one deleted meanwhile is gone either way."""
        n, doomed = 0, []
        async for recs in scanned(core, uid, match, match):
            doomed += [r.fact_id for r in recs]
        for fid in doomed:
            try:
                await core.delete_fact(uid, fid)
                n += 1
            except Exception as e:  # deleted meanwhile: gone either way
                if to_api_error(e).code != grpc.StatusCode.NOT_FOUND:
                    raise
        return n

    async def erase_user(core, caller, uid: str) -> int:
        """GDPR erasure: the same as DeleteUser on gRPC (registry, KV tiers, index, tombstones)."""
        return (await core.DeleteUser(pb2.DeleteUserRequest(user_id=uid), caller)).deleted

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
            raise invalid(f"filters.{unknown[0]}: add takes only user_id, agent_id, run_id and app_id in filters")
        uid = owner(core, caller, "AddMemory", body.user_id, flt.get("user_id"))
        messages = validation.messages_in(body.messages, core.limits)
        meta = {**_metadata(body.metadata, core.limits), **scope_of(body, flt)}
        created_at = None if body.timestamp is None else created_at_of(body.timestamp, time.time())
        expires_at = math.inf if body.expiration_date is None else expires_at_of(body.expiration_date)
        # The IETF draft's Idempotency-Key header (core.store_new: a repeat answers with the first add's memories)
        events = await core.add_memory(uid, messages, meta, body.infer, created_at, expires_at,
                                       request.headers.get(IDEMPOTENCY_HEADER, ""))
        return {"results": [{"id": e["id"], "memory": e.get("memory", ""), "event": e.get("event", "ADD"),
                             **({"previous_memory": e["previous_memory"]} if e.get("previous_memory") else {})}
                            for e in events]}

    @route("ListMemories", "get_all", ListRequest)
    async def get_all(core, caller, request, body: ListRequest):
        no_params(request, ("page", "page_size"))
        uid = owner(core, caller, "ListMemories", body.user_id, filters.user_of(body.filters))
        flt, now = _match(body, uid), time.time()  # the request's filter: what a scan is charged for
        match = flt
        if not body.show_expired and await asyncio.to_thread(core.registry.expired_facts, uid, now):
            match = _unexpired(flt, now)  # the user has expired memories: hidden, so the count is a pass too
        page = _int_param(request, "page", 1, 1 << 30, 1)
        size = _int_param(request, "page_size", 1, core.limits.max_page_size, core.limits.default_page_size)
        first = (page - 1) * size
        if match is None:  # the page alone: the count is the registry's
            count = await asyncio.to_thread(core.registry.count, uid)
            recs = (await asyncio.to_thread(core.registry.list, uid, first, size))[0] if first < count else []
            core.work.spent(Resource.GATEWAY, scan_units(len(recs)))
            results = [memory_json(r) for r in recs]
        else:  # one pass over the user's facts (scanned(): read and matched in a worker thread, never the loop)
            count, results = 0, []
            async for recs in scanned(core, uid, match, flt):  # charged the filter's weight, not the expiry's
                results += [memory_json(r) for r in recs[max(0, first - count):max(0, first + size - count)]]
                count += len(recs)
        base = f"{str(request.base_url).rstrip('/')}/v3/memories/?page_size={size}&page="
        return {"count": count, "next": base + str(page + 1) if first + size < count else None,
                "previous": base + str(page - 1) if page > 1 else None, "results": results}

    def _match(body: ListRequest, uid: str):
        """The request's scope fields and filter (its user_id, resolved by owner(), left out) as one predicate."""
        return filters.compile_filter(_and(scope_of(body, None), _without_user(body.filters)), uid)

    def _unexpired(match, now: float):
        """`match` (None: every memory) less the memories expired at `now`."""
        return lambda r: not r.expired(now) and (match is None or match(r))

    @route("Search", "search", SearchRequest)
    async def search(core, caller, request, body: SearchRequest):
        uid = owner(core, caller, "Search", body.user_id, filters.user_of(body.filters))
        if body.show_expired:
            raise invalid("show_expired=true is not supported on search: a search finds what answers may "
                              "inject, and an expired memory is never injected; get_all(show_expired=True) lists "
                              "expired memories", "show_expired")
        query = validation.text_field(body.query, "query", core.limits.max_query_chars).strip()
        k = DEFAULT_TOP_K if body.top_k is None else body.top_k
        if not 1 <= k <= core.limits.max_k:
            raise invalid(f"top_k must be in [1, {core.limits.max_k}], got {k}")
        hits = await core.search_records(uid, query, k, _match(body, uid), body.threshold)
        return {"results": [memory_json(r, s) for r, s in hits]}

    @route("GetMemory", "get")
    async def get(core, caller, request, body):
        no_params(request)
        uid, fid = await fact_of(core, caller, request, "GetMemory")
        return memory_json(await asyncio.to_thread(core.registry.get, uid, fid))

    @route("UpdateMemory", "update", UpdateRequest)
    async def update(core, caller, request, body: UpdateRequest):
        no_params(request)
        text = None if body.text is None else validation.text_field(body.text, "text", core.limits.max_fact_chars).strip()
        meta = None if body.metadata is None else _metadata(body.metadata, core.limits)
        expiry = None  # not sent: as it is; sent as null: cleared (Mem0's update(expiration_date=None))
        if "expiration_date" in body.model_fields_set:
            expiry = math.inf if body.expiration_date is None else expires_at_of(body.expiration_date)
        uid, fid = await fact_of(core, caller, request, "UpdateMemory")
        if text is None and meta is None and expiry is None:
            if body._nulls:  # only options set to null: nothing asked
                return memory_json(await asyncio.to_thread(core.registry.get, uid, fid))
            raise invalid("nothing to update: send text, metadata and/or expiration_date")
        cur = None if meta is None and expiry is None else await asyncio.to_thread(core.registry.get, uid, fid)
        if text is None and meta is None and cur is not None and expiry == cur.expires_at:
            return memory_json(cur)  # the expiry it has already (clearing none, say): no new version
        if meta is not None:  # Mem0 replaces the metadata; the scope fields stay what they were
            assert cur is not None  # read above whenever metadata is sent
            meta = {**meta, **_scopes(cur)}
        rec = await core.update_fact(uid, fid, text, meta, replace_metadata=meta is not None, expires_at=expiry)
        return memory_json(rec)

    @route("DeleteMemory", "delete")
    async def delete(core, caller, request, body):
        no_params(request, ("user_id", "delete_linked"))
        if request.query_params.get("delete_linked", "false").lower() not in ("false", "0"):
            raise invalid("delete_linked is not supported: a memory here has no linked earlier memories")
        uid, fid = await fact_of(core, caller, request, "DeleteMemory")
        await core.delete_fact(uid, fid)
        return {"message": "Memory deleted successfully!"}

    @route("GetMemory", "history")
    async def history(core, caller, request, body):
        no_params(request)
        uid, fid = await fact_of(core, caller, request, "GetMemory")
        earlier = await asyncio.to_thread(core.registry.history, uid, fid)
        rec = await asyncio.to_thread(core.registry.get, uid, fid)
        return history_json(rec, [v for v in earlier if v.version < rec.version])

    @route("DeleteUser", "delete_all")
    async def delete_all(core, caller, request, body):
        """The user's memories that the scopes (agent_id / run_id / app_id, "*": any value) and `filters` keep.
        All of them only when the request names the user (user_id=<the user> or "*", in the query or in
        filters), as Mem0's platform refuses a delete_all without a filter: then it is the erasure DeleteUser
        is. A user with no memories is no error (Mem0's delete_all)."""
        no_params(request, ("user_id", "filters", *filters.SCOPE_FIELDS))
        q = request.query_params
        flt = _query_filters(q.get("filters"))
        named = [q.get("user_id"), filters.user_of(flt)]
        uid = owner(core, caller, "DeleteUser", *named)
        narrowed = _and(_scope_filter({k: q.get(k) for k in filters.SCOPE_FIELDS}), _without_user(flt))
        if narrowed is not None:
            n = await delete_matching(core, uid, filters.compile_filter(narrowed, uid))
        elif any(v is not None for v in named):
            n = await erase_user(core, caller, uid)
        else:
            raise invalid(
                "delete_all without a filter would delete all of this user's memories, and it must be asked for "
                f"explicitly (as on Mem0's platform): delete_all(user_id={uid!r}) or delete_all(user_id=\"*\") "
                "deletes them all; agent_id / run_id / app_id or filters delete some")
        return {"message": "Memories deleted successfully!", "deleted": n}

    @route("UpdateMemory", "batch_update", BatchUpdateRequest)
    async def batch_update(core, caller, request, body: BatchUpdateRequest):
        """Each item is checked (ids, text, metadata, that the memory exists, the encoder's limits) before
        anything is written; then the updates run in order, each reported. One that fails then (deleted
        meanwhile, a quota) fails the call with its status, every item's outcome in the body."""
        no_params(request)
        fids = batch_ids(body.memories, core.limits)
        changes = []
        for i, item in enumerate(body.memories):
            where = f"memories[{i}]"
            text = (None if item.text is None
                    else validation.text_field(item.text, f"{where}.text", core.limits.max_fact_chars).strip())
            meta = None if item.metadata is None else _metadata(item.metadata, core.limits, f"{where}.metadata")
            if text is None and meta is None:
                raise invalid(f"{where}: nothing to update: send text and/or metadata")
            changes.append((text, meta))
        owners = await owners_of(core, caller, request, "UpdateMemory", fids)
        recs = await current(core, owners)
        missing = [f for f in fids if f not in recs]
        if missing:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown memory {missing[0]!r}" + (
                f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + "; nothing was updated")
        texts = [(f"memories[{i}].text", t) for i, (t, _) in enumerate(changes) if t is not None]
        if texts:
            await core._check_encodable([t for _, t in texts], [n for n, _ in texts])
        results, failed = [], None
        for fid, (text, meta) in zip(fids, changes):
            try:
                rec = await core.update_fact(owners[fid], fid, text, None if meta is None else
                                             {**meta, **_scopes(recs[fid])}, replace_metadata=meta is not None)
                results.append({"memory_id": fid, "status": "updated", "memory": memory_json(rec)})
            except Exception as e:  # noqa: BLE001 - reported with the item
                err = status_of(PREFIX + "batch_update", e)
                failed = failed or err
                results.append({"memory_id": fid, "status": "failed", "code": err.code.name.lower(),
                                "detail": err.message})
        n = sum(r["status"] == "updated" for r in results)
        if failed is not None:
            raise BatchFailed(failed, f"{n} of {len(fids)} memories updated; the first failure: {failed.message}",
                              results)
        return {"message": f"{n} memories updated", "updated": n, "results": results}

    @route("DeleteMemory", "batch_delete", BatchDeleteRequest)
    async def batch_delete(core, caller, request, body: BatchDeleteRequest):
        """Each id is checked before anything is deleted; an unknown one (or one deleted meanwhile) is reported
        `not_found`: it is gone either way. A delete that fails fails the call, every item's outcome in the body."""
        no_params(request)
        fids = batch_ids(body.memories, core.limits)
        owners = await owners_of(core, caller, request, "DeleteMemory", fids)
        recs = await current(core, owners)
        results, failed = [], None
        for fid in fids:
            status = "not_found"
            if fid in recs:
                try:
                    await core.delete_fact(owners[fid], fid)
                    status = "deleted"
                except Exception as e:  # noqa: BLE001 - reported with the item
                    err = status_of(PREFIX + "batch_delete", e)
                    if err.code != grpc.StatusCode.NOT_FOUND:
                        failed = failed or err
                        results.append({"memory_id": fid, "status": "failed", "code": err.code.name.lower(),
                                        "detail": err.message})
                        continue
            results.append({"memory_id": fid, "status": status})
        n = sum(r["status"] == "deleted" for r in results)
        if failed is not None:
            raise BatchFailed(failed, f"{n} of {len(fids)} memories deleted; the first failure: {failed.message}",
                              results)
        return {"message": f"{n} memories deleted", "deleted": n, "results": results}

    @route("ListMemories", "users")
    async def users(core, caller, request, body):
        """The entities the caller may see that have memories: its user, then the agents, apps and runs of its
        memories. Every user (an admin's token, or no authentication) needs an index of users, which the registry
        does not keep: 501 unless the request names the user."""
        no_params(request)
        named = request.query_params.get("user_id")
        if named is None and (not core.auth.enabled or caller.admin):
            raise ApiError(grpc.StatusCode.UNIMPLEMENTED,
                           "users() for an admin token (or without authentication) would list every user, and "
                           "InferScale's registry keeps no index of users; name one: GET /v1/entities/?user_id=<id>. "
                           "So delete_users() without arguments and reset() are refused too: InferScale does not "
                           "delete every user at once; delete_users(user_id=<id>) erases one")
        uid = owner(core, caller, "ListMemories", named)
        seen: dict[tuple[str, str], list] = {}
        async for recs in scanned(core, uid, None, None):  # every fact read: charged as a listing of them all
            await asyncio.to_thread(_tally_entities, seen, recs, uid, core.limits.max_page_size)
        found = [{"id": name, "name": name, "type": kind, "total_memories": n, "created_at": _iso(first),
                  "updated_at": _iso(last), "owner": uid, "organization": DEPLOYMENT_ID, "metadata": None}
                 for (kind, name), (n, first, last) in seen.items()]
        return {"count": len(found), "next": None, "previous": None, "results": found}

    @route("DeleteUser", "delete_entity")
    async def delete_entity(core, caller, request, body):
        """delete_users(): a user is erased as DeleteUser erases it (a user's token: only itself); an agent, app
        or run is a scope of the caller's memories (or of the user_id the query names): those memories go."""
        kind, name = request.path_params["entity_type"], request.path_params["entity_id"]
        if kind not in ENTITY_FIELDS:
            raise invalid(f"entity type {kind[:40]!r} is not one of {', '.join(ENTITY_FIELDS)}")
        if kind == "user":
            no_params(request, ())
            n = await erase_user(core, caller, owner(core, caller, "DeleteUser", name))
        else:
            no_params(request)
            uid = owner(core, caller, "DeleteUser", request.query_params.get("user_id"))
            n = await delete_matching(core, uid, filters.compile_filter(
                _scope_filter({ENTITY_FIELDS[kind]: name}), uid))
        return {"message": "Entity deleted successfully!", "deleted": n}

    @route("GetMemory", "feedback", FeedbackRequest)
    async def feedback(core, caller, request, body: FeedbackRequest):
        """Acknowledged for a memory of the caller's (404 otherwise) and not stored: nothing here would use it
        (Mem0 tunes its own extraction with it)."""
        no_params(request)
        fid = validation.fact_id(body.memory_id, "memory_id")
        uid = (await owners_of(core, caller, request, "GetMemory", [fid]))[fid]
        if uid is None or not await asyncio.to_thread(core.registry.find_many, uid, [fid]):
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown memory {fid!r}")
        return {"message": "Feedback acknowledged; InferScale does not store feedback, and it changes nothing",
                "memory_id": fid, "feedback": body.feedback, "feedback_reason": body.feedback_reason}

    async def not_served(request: Request, exc):
        """No route here: under the client's prefixes, 501 naming the call (never 404, which the client raises as
        MemoryNotFoundError); elsewhere FastAPI's own answer."""
        if exc.status_code not in (404, 405) or not is_mem0_path(request.url.path):
            return await http_exception_handler(request, exc)
        done = Outcome(metrics(), PREFIX + "unsupported")
        call, message = unsupported(request.method, request.url.path)
        done(grpc.StatusCode.UNIMPLEMENTED)
        return JSONResponse(status_code=501, content={"detail": message, "code": "unimplemented", "call": call})

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
    app.add_api_route("/v1/batch/", batch_update, methods=["PUT"], **_doc(BatchUpdateRequest, BatchResponse),
                      tags=["mem0"])
    app.add_api_route("/v1/batch/", batch_delete, methods=["DELETE"], **_doc(BatchDeleteRequest, BatchResponse),
                      tags=["mem0"])
    app.add_api_route("/v1/entities/", users, methods=["GET"], **_doc(None, Entities), tags=["mem0"])
    app.add_api_route("/v2/entities/{entity_type}/{entity_id}/", delete_entity, methods=["DELETE"],
                      **_doc(None, Done), tags=["mem0"])
    app.add_api_route("/v1/feedback/", feedback, methods=["POST"], **_doc(FeedbackRequest, FeedbackAck),
                      tags=["mem0"])
    app.add_exception_handler(404, not_served)
    app.add_exception_handler(405, not_served)


SCAN_CHUNK = 1000  # facts a scan reads and matches in one worker-thread call


async def scanned(core, uid: str, match, charged_filter):
    """The user's facts that `match` keeps (None: every one), a list per SCAN_CHUNK facts read (in a worker thread,
    never the loop). Each chunk is charged to the caller's gateway balance BEFORE it is read (work_budget.scan_units of
    the facts the user holds past the offset, under `charged_filter`) and corrected to what was read after: so a caller
    whose other requests have put it in debt is refused (CALLER_WORK) before its next chunk is read, not after. Before,
    a scan was charged once read: four maximal scans sent at once were all admitted on a full balance and read 4,000
    facts together, ~4 bursts of the gateway's work before any refusal (bench/noisy_neighbour.py `filter_scan`: the
    well-behaved users' slowest requests were those of the phase's first seconds)."""
    total = await asyncio.to_thread(core.registry.count, uid)
    offset: int | None = 0
    while offset is not None:
        estimate = scan_units(min(SCAN_CHUNK, max(total - offset, 0)), charged_filter)
        await core.charge_before(Resource.GATEWAY, estimate)
        recs, read, offset = await asyncio.to_thread(_matching, core.registry, uid, offset, match)
        core.work.spent(Resource.GATEWAY, scan_units(read, charged_filter) - estimate)
        yield recs


def _matching(registry, uid: str, offset: int, match) -> tuple[list, int, int | None]:
    """The facts `match` keeps (None: all) among the next SCAN_CHUNK of the user's from `offset`, how many were read
    (the scan's cost, work_budget.scan_units), and the offset after them."""
    recs, offset = registry.list(uid, offset, SCAN_CHUNK)
    return [r for r in recs if match is None or match(r)], len(recs), offset


def _tally_entities(seen: dict[tuple[str, str], list], recs, uid: str, cap: int) -> None:
    """Mem0's entities of one user's memories, counted into `seen` from one chunk of them: the user, then each
    agent, app and run value (at most `cap` of those), with how many memories each has and their first creation
    and last update."""
    for r in recs:
        keys = [("user", uid)] + [(kind, str(r.metadata[f])) for kind, f in ENTITY_FIELDS.items()
                                  if f in filters.SCOPE_FIELDS and r.metadata.get(f) is not None]
        for key in keys:
            if key not in seen and len(seen) > cap:
                continue
            s = seen.setdefault(key, [0, r.created_at, r.updated_at])
            s[0] += 1
            s[1], s[2] = min(s[1], r.created_at), max(s[2], r.updated_at)


def _int_param(request: Request, name: str, lo: int, hi: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or not lo <= int(raw) <= hi:
        raise invalid(f"{name} must be an integer in [{lo}, {hi}], got {raw[:40]!r}")
    return int(raw)
