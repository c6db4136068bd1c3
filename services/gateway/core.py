"""GatewayCore: the logic behind both front doors, transport-free.

Every RPC runs in this order: the front door authenticates the caller (services/auth.py; Health is open),
the request is parsed and validated (services/api.py), the caller is authorized for the request's user,
and only then is anything read or written. Writes are all or nothing: a fact is checked against the
encoder's real limits before the registry (the source of truth) is written, and if the KV or index push
that follows fails, the registry rows are removed again. The gateway never holds KV: encoder output
travels to the engine replica as an object-store reference (see serve_ingress.ServeBackends.index_facts).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from inferscale_core.defaults import NEIGHBOUR_WINDOW, default_windows, rewindow
from inferscale_core.errors import UnknownFactError

from .. import api
from ..api import ApiError, Limits, pb2
from ..auth import OPEN_RPCS, RPC_SCOPES, Authenticator, Principal
from ..registry import FactRecord, NewFact, Registry, VersionConflictError

log = logging.getLogger("inferscale.gateway")


class Backends(Protocol):
    """What the gateway asks of the rest of the service (ServeBackends implements it with Serve handles)."""

    async def check_facts(self, texts: list[str]) -> list[str | None]:
        """Per text: why the encoder cannot encode it (its real limits, the serving tokenizer), or None."""

    async def index_facts(self, user_id: str, records: list[FactRecord]) -> None:
        """Embed + index the facts (retrieval) and encode them into the engine replica's KV store; raises
        (naming the fact) if any of them could not be stored."""

    async def search(self, user_id: str, query: str, k: int) -> list[tuple[str, float]]: ...

    def answer(self, user_id: str, query: str, k: int, max_tokens: int, temperature: float,
               mode: str, conversation: list[dict] | None = None) -> AsyncIterator[dict]:
        """Yields {"text": ...} pieces, then one {"final": True, "fact_ids", "ttft_ms", "timings_ms", ...}.
        `conversation`: system messages and earlier turns, put after the memory in the chat template."""

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
                 embedder_path: str | None = None, *, auth: Authenticator):
        """`auth` is required: Authenticator.insecure() is the explicit way to run without it."""
        self.registry, self.backends, self.limits, self.auth = registry, backends, limits, auth
        self.embedder_path = embedder_path  # Mem0's embedder: the same model as retrieval's
        self._extractor = None  # services.mem0_provider.Mem0Extractor, built on the first infer=true request
        self._extractor_lock = asyncio.Lock()

    # ------------------------------------------------------------------------------------ auth
    def authenticate(self, rpc: str, authorization: str | None) -> Principal | None:
        """What the front doors call first, with the `authorization` header or metadata (None: absent)."""
        if rpc in OPEN_RPCS:
            return None
        return self.auth.authenticate(authorization)

    def _owner(self, caller: Principal, rpc: str, user_id: str, field_name: str = "user_id") -> str:
        """The request's user id, validated, once the caller may act for it (before anything is read)."""
        uid = api.user_id(user_id, field_name)
        self.auth.authorize(caller, uid, RPC_SCOPES[rpc])
        return uid

    def _need(self, what: str) -> Backends:
        if self.backends is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           f"{what} needs the retrieval/engine deployments, and this gateway runs without them "
                           "(registry-only mode)")
        return self.backends

    async def _push(self, coro, what: str) -> None:
        """A replica push that the replicas can repair themselves (they re-sync from the registry): failures
        are logged, not returned."""
        try:
            await coro
        except Exception:  # noqa: BLE001 - see docstring
            log.exception("push to replicas failed (%s); replicas will re-sync from the registry", what)

    # ------------------------------------------------------------------------------------ writes
    async def _check_encodable(self, texts: list[str], names: list[str]) -> None:
        """The encoder's real limits, before anything is written; the error names the first bad field."""
        if self.backends is None:  # registry-only mode: nothing is encoded here
            return
        for name, why in zip(names, await self.backends.check_facts(texts)):
            if why is not None:
                raise api.too_big(f"{name} {why}; nothing was stored")

    async def _store_facts(self, user_id: str, facts: list[api.FactIn], names: list[str]) -> list[FactRecord]:
        return await self.store_new(user_id, [NewFact(f.text, f.metadata, window=f.window) for f in facts], names)

    async def store_new(self, user_id: str, facts: list[NewFact], names: list[str] | None = None) -> list[FactRecord]:
        """All or nothing: checked, then registry rows (quota checked atomically), then KV + index; if those
        fail, the rows are removed again and the error says nothing was stored."""
        names = names or [f"facts[{i}].text" for i in range(len(facts))]
        for f, name in zip(facts, names):
            api.text_field(f.text, name, self.limits.max_fact_chars)
        # The shipped encoding default: each fact behind the facts its user stored most recently, this call's
        # earlier ones included (a caller's own window wins). Stored with the fact: a re-encode reproduces it.
        stored = ([r.text for r in await _blocking(self.registry.latest, user_id, NEIGHBOUR_WINDOW)]
                  if any(not f.window for f in facts) else [])
        windows = default_windows([f.text for f in facts], [f.window for f in facts], stored=stored)
        facts = [dataclasses.replace(f, window=win) for f, win in zip(facts, windows)]
        await self._check_encodable([f.text for f in facts], names)
        recs = await _blocking(self.registry.create, user_id, facts, self.limits.quota())
        if self.backends is not None:
            try:
                await self.backends.index_facts(user_id, recs)
            except Exception as e:  # noqa: BLE001 - undone, then reported
                await self._undo_create(user_id, recs)
                err = api.to_api_error(e)
                if err.code == grpc.StatusCode.INTERNAL:
                    log.exception("storing %d facts failed; undone", len(recs))
                raise ApiError(err.code, err.message if "nothing was stored" in err.message
                               else f"{err.message}; nothing was stored") from None
        return recs

    async def _undo_create(self, user_id: str, recs: list[FactRecord]) -> None:
        removed = []
        for r in recs:
            try:
                removed.append((r.fact_id, (await _blocking(self.registry.delete, user_id, r.fact_id)).version))
            except Exception:  # noqa: BLE001 - already gone (a concurrent delete)
                continue
        if removed and self.backends is not None:
            await self._push(self.backends.forget(user_id, removed), "forget (undo)")

    async def update_fact(self, user_id: str, fact_id: str, text: str | None, metadata: dict | None,
                          replace_metadata: bool = False, expected_version: int = 0, embedding=None) -> FactRecord:
        old = None
        if text is not None:
            api.text_field(text, "text", self.limits.max_fact_chars)
            await self._check_encodable([text], ["text"])
            old = await _blocking(self.registry.get, user_id, fact_id)
        rec = await _blocking(self.registry.update, user_id, fact_id, text=text, metadata=metadata,
                              replace_metadata=replace_metadata, expected_version=expected_version,
                              embedding=embedding, quota=self.limits.quota())
        if text is not None and self.backends is not None:  # metadata changes do not touch KV or embeddings
            # The text passed the encoder's check; a push that still fails is repaired by the replicas' sync.
            await self._push(self.backends.index_facts(user_id, [rec]), "index_facts (update)")
        if old is not None and old.text != rec.text:
            await self._rewindow(user_id, old.text, rec.text)
        return rec

    async def delete_fact(self, user_id: str, fact_id: str) -> FactRecord:
        rec = await _blocking(self.registry.delete, user_id, fact_id)
        if self.backends is not None:
            await self._push(self.backends.forget(user_id, [(fact_id, rec.version)]), "forget")
        await self._rewindow(user_id, rec.text, None)
        return rec

    async def _rewindow(self, user_id: str, old_text: str, new_text: str | None) -> list[FactRecord]:
        """A fact's text left the memory (deleted, or changed to `new_text`): every fact of the user encoded
        behind it gets that line removed (or replaced) in its stored window and is re-encoded, so the old text
        survives in no other fact's window or KV. Costs one pass over the user's facts plus up to
        NEIGHBOUR_WINDOW re-encodes (docs/architecture.md, "Neighbour windows")."""
        changed, offset = [], 0
        while offset is not None:
            page, offset = await _blocking(self.registry.list, user_id, offset, 1000)
            for rec in page:
                for _ in range(3):  # a concurrent write to the same fact: read it again
                    win = rewindow(rec.window, old_text, new_text)
                    if win is None:
                        break
                    try:
                        changed.append(await _blocking(self.registry.update, user_id, rec.fact_id, window=win,
                                                       expected_version=rec.version))
                        break
                    except UnknownFactError:  # deleted meanwhile
                        break
                    except VersionConflictError:
                        try:
                            rec = await _blocking(self.registry.get, user_id, rec.fact_id)
                        except UnknownFactError:
                            break
        if changed and self.backends is not None:  # a failed push is repaired by the replicas' sync
            await self._push(self.backends.index_facts(user_id, changed), "index_facts (neighbour left)")
        return changed

    async def _extract(self, user_id: str, messages: list[dict], metadata: dict) -> list[dict]:
        """Mem0's add with inference (services/mem0_provider.py), in a worker thread."""
        self._need("AddMemory with infer=true")
        async with self._extractor_lock:
            if self._extractor is None:
                try:
                    from ..mem0_provider import Mem0Extractor
                except ImportError as e:
                    raise ApiError(grpc.StatusCode.UNIMPLEMENTED,
                                   f"AddMemory with infer=true needs mem0ai 2.2 in the service's image ({e}); "
                                   "send infer=false or use AddFacts") from None
                sink = GatewaySink(self, asyncio.get_running_loop())
                self._extractor = await asyncio.to_thread(Mem0Extractor, sink, self.embedder_path)
        return await asyncio.to_thread(self._extractor.add, user_id, messages, metadata)

    # ------------------------------------------------------------------------------------ RPCs
    # Each takes the raw request and the authenticated caller (None only for Health).
    async def AddFacts(self, raw, caller: Principal):  # noqa: N802 (RPC names)
        req = api.parse("AddFacts", raw, self.limits)
        uid = self._owner(caller, "AddFacts", req.user_id)
        facts = api.facts_in(req.facts, self.limits)
        recs = await self._store_facts(uid, facts, [f"facts[{i}].text" for i in range(len(facts))])
        return pb2.AddFactsResponse(facts=[api.fact_pb(r) for r in recs])

    async def AddMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("AddMemory", raw, self.limits)
        uid = self._owner(caller, "AddMemory", req.user_id)
        messages = api.messages_in(req.messages, self.limits)
        meta = api.metadata(req.metadata, "metadata", self.limits)
        infer = req.infer if req.HasField("infer") else True
        if infer:
            events = await self._extract(uid, messages, meta)
            return pb2.AddMemoryResponse(results=[
                pb2.MemoryEvent(fact_id=e["id"], text=e.get("memory", ""), event=e.get("event", "ADD"),
                                previous_text=e.get("previous_memory") or "") for e in events])
        # Mem0's infer=False: every non-system message is stored as it is, tagged with its role.
        kept = [(i, m) for i, m in enumerate(messages) if m["role"] != "system"]
        facts = [api.FactIn(api.text_field(m["content"], f"messages[{i}].content", self.limits.max_fact_chars).strip(),
                            {**meta, "role": m["role"]}) for i, m in kept]
        if not facts:
            raise api.invalid("messages hold only system messages; with infer=false nothing would be stored")
        recs = await self._store_facts(uid, facts, [f"messages[{i}].content" for i, _ in kept])
        return pb2.AddMemoryResponse(results=[pb2.MemoryEvent(fact_id=r.fact_id, text=r.text, event="ADD")
                                              for r in recs])

    async def Search(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("Search", raw, self.limits)
        uid = self._owner(caller, "Search", req.user_id)
        query = api.text_field(req.query, "query", self.limits.max_query_chars)
        k = api.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        hits = await self._need("Search").search(uid, query, k)
        recs = await self._records(uid, [f for f, _ in hits])
        return pb2.SearchResponse(hits=[pb2.SearchHit(fact=api.fact_pb(recs[f]), score=s)
                                        for f, s in hits if f in recs])

    async def _records(self, user_id: str, fact_ids: list[str]) -> dict[str, FactRecord]:
        """Records of the user by id, in one registry round trip, skipping any deleted since the replica answered."""
        return await _blocking(self.registry.find_many, user_id, fact_ids) if fact_ids else {}

    async def Answer(self, raw, caller: Principal):  # noqa: N802 - async generator of AnswerChunk
        req = api.parse("Answer", raw, self.limits)
        uid = self._owner(caller, "Answer", req.user_id)
        query = api.text_field(req.query, "query", self.limits.max_query_chars)
        k = api.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        max_tokens = api.bounded_int(req.max_tokens, "max_tokens", 1, self.limits.max_max_tokens,
                                     self.limits.default_max_tokens)
        if not 0.0 <= req.temperature <= 2.0:  # also refuses NaN
            raise api.invalid(f"temperature must be in [0, 2], got {req.temperature}")
        mode = api.answer_mode(req.mode)
        conversation = api.messages_in(req.messages, self.limits) if req.messages else None
        backends = self._need("Answer")
        async for piece in backends.answer(uid, query, k, max_tokens, float(req.temperature), mode, conversation):
            if piece.get("final"):
                yield pb2.AnswerChunk(
                    text=piece.get("text", ""), final=True, ttft_ms=piece.get("ttft_ms", 0.0),
                    fact_ids=piece.get("fact_ids", []), prompt_tokens=piece.get("prompt_tokens", 0),
                    prefilled_tokens=piece.get("prefilled_tokens", 0),
                    completion_tokens=piece.get("completion_tokens", 0),
                    finish_reason=piece.get("finish_reason", ""), timings_ms=piece.get("timings_ms", {}))
            else:
                yield pb2.AnswerChunk(text=piece.get("text", ""))

    async def GetMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("GetMemory", raw, self.limits)
        uid = self._owner(caller, "GetMemory", req.user_id)
        rec = await _blocking(self.registry.get, uid, api.fact_id(req.fact_id))
        return api.fact_pb(rec)

    async def ListMemories(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("ListMemories", raw, self.limits)
        uid = self._owner(caller, "ListMemories", req.user_id)
        size = api.bounded_int(req.page_size, "page_size", 1, self.limits.max_page_size,
                               self.limits.default_page_size)
        offset = api.page_token(req.page_token)
        recs, nxt = await _blocking(self.registry.list, uid, offset, size)
        return pb2.ListMemoriesResponse(facts=[api.fact_pb(r) for r in recs],
                                        next_page_token="" if nxt is None else str(nxt))

    async def UpdateMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("UpdateMemory", raw, self.limits)
        uid = self._owner(caller, "UpdateMemory", req.user_id)
        fid = api.fact_id(req.fact_id)
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

    async def DeleteMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("DeleteMemory", raw, self.limits)
        uid = self._owner(caller, "DeleteMemory", req.user_id)
        fid = api.fact_id(req.fact_id)
        await self.delete_fact(uid, fid)
        return pb2.DeleteMemoryResponse(fact_id=fid)

    async def DeleteUser(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("DeleteUser", raw, self.limits)
        uid = self._owner(caller, "DeleteUser", req.user_id)
        n = await _blocking(self.registry.delete_user, uid)
        if n == 0:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown user {uid!r}: no facts stored for this user")
        if self.backends is not None:
            await self._push(self.backends.forget_user(uid), "forget_user")
        return pb2.DeleteUserResponse(deleted=n)

    async def Health(self, raw, caller: Principal | None = None):  # noqa: N802 - open: no token needed
        api.parse("Health", raw, self.limits)
        components = {}
        try:
            await _blocking(self.registry.ping)
            components["registry"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported by type only: Health is open to anyone
            log.warning("health: registry unreachable: %s", e)
            components["registry"] = f"error: {type(e).__name__}"
        if self.backends is None:
            components["backends"] = "none (registry-only mode)"
        else:
            try:
                components.update(await self.backends.health())
            except Exception as e:  # noqa: BLE001
                log.warning("health: backends: %s", e)
                components["backends"] = f"error: {type(e).__name__}"
        ok = all(v == "ok" or v.startswith("none") for v in components.values())
        return pb2.HealthResponse(status="SERVING" if ok else "DEGRADED", components=components)


class GatewaySink:
    """The FactSink of services/mem0_provider.py over a GatewayCore, for one authorized AddMemory. Mem0 runs
    in a worker thread; writes and backend calls are run on the gateway's event loop, so they take the same
    path as the RPCs (checked, quota, all or nothing)."""

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
