"""GatewayCore: the logic behind both front doors, transport-free.

Every RPC runs in this order: the front door authenticates the caller (services/auth.py; Health is open),
the request is parsed and validated (services/api.py, validation.py), the caller is authorized for the request's user,
and only then is anything read or written. Writes are all or nothing: a fact is checked against the
encoder's real limits before the registry (the source of truth) is written, and if the KV or index push
that follows fails, the registry rows are removed again. The gateway never holds KV: encoder output
travels to the engine replica as an object-store reference (see serve_ingress.ServeBackends.index_facts).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from inferscale_core.defaults import NEIGHBOUR_WINDOW, default_windows, rewindow
from inferscale_core.errors import UnknownFactError
from inferscale_core.types import Mode

from .. import api, filters, validation
from ..api import pb2
from ..auth import OPEN_RPCS, RPC_SCOPES, Authenticator, Principal
from ..deadlines import within_deadline
from ..errors import ApiError, invalid, to_api_error, too_big, unavailable
from ..limits import Limits
from ..messages import AnswerEnd, AnswerPiece, OpenAIChat
from ..modes import answer_mode
from ..openai_params import MAX_OUTPUT_TOKENS
from ..page_tokens import next_page_token, page_token
from ..registry import (
    FactRecord,
    IdempotentAdd,
    IdempotentRepeatError,
    NewFact,
    Registry,
    VersionConflictError,
    check_idempotency_key,
)
from .principal_limits import PrincipalLimit, PrincipalLimits, pause_before_refusal
from .work_budget import Resource, WorkBudget, WorkLimit, query_units, scan_units, text_units

if TYPE_CHECKING:  # mem0ai loads in GatewayCore.build_extractor, not at import
    from ..mem0_provider import Mem0Extractor

log = logging.getLogger("inferscale.gateway")
# Facts read after a fact that left the memory, for the windows that hold it: NEIGHBOUR_WINDOW and as many again
# for adds racing the delete (GatewayCore._rewindow).
REWINDOW_SPAN = 2 * NEIGHBOUR_WINDOW
MAX_PAGE_BYTES = 2 << 20  # half the proxies' transport limit (services/app.py:TRANSPORT_MAX_MESSAGE_BYTES)
# A write whose KV/index step failed removes its rows again; the registry may be failing too (the same outage):
# a few tries over ~1.5 s, then the ids it could not remove are reported rather than "nothing was stored".
UNDO_ATTEMPTS = 3
UNDO_BACKOFF_S = 0.5


class Backends(Protocol):
    """What the gateway asks of the rest of the service (ServeBackends implements it with Serve handles)."""

    async def check_facts(self, texts: list[str]) -> list[str | int]:
        """Per text: why the encoder cannot encode it (its real limits, the serving tokenizer), or the bytes its
        KV will take (counted against the user's KV quota)."""

    async def index_facts(self, user_id: str, records: list[FactRecord]) -> None:
        """Embed + index the facts (retrieval) and encode them into the engine replica's KV store; raises
        (naming the fact) if any of them could not be stored."""

    async def search(self, user_id: str, query: str, k: int) -> list[tuple[str, float]]: ...

    def answer(self, user_id: str, query: str, k: int, max_tokens: int, temperature: float,
               mode: Mode, conversation: list[dict] | None = None, openai: OpenAIChat | None = None
               ) -> AsyncIterator[AnswerPiece | AnswerEnd]:
        """Yields AnswerPiece messages, then one AnswerEnd (services/messages.py).
        `conversation`: system messages and earlier turns, put after the memory in the chat template.
        `openai`: an OpenAI chat request's parts (services/messages.py OpenAIChat)."""

    async def forget(self, user_id: str, facts: list[tuple[str, int]]) -> None:
        """Deleted facts `(fact_id, last version)`: out of the indices and every KV store."""

    async def forget_user(self, user_id: str) -> None: ...

    async def search_vector(self, user_id: str, vector: list[float], k: int) -> list[tuple[str, float]]:
        """Top-k by a query embedding the caller computed (Mem0's pipeline embeds for itself)."""

    async def embed(self, texts: list[str], as_query: bool) -> list[list[float]]:
        """The retrieval replicas' embeddings of `texts`, as queries or as facts (Mem0's pipeline embeds for
        itself, with the service's embedder rather than a copy of the model in the gateway)."""

    async def chat(self, user_id: str, messages: list[dict], max_tokens: int, temperature: float,
                   structured: dict | None) -> str:
        """Plain chat generation on the serving model for `user_id` (no memory; the prompt under the user's
        prefix-cache salt); `structured`: vLLM structured outputs."""

    async def chat_room(self, user_id: str, messages: list[dict]) -> int:
        """Tokens left in the serving model's context after these messages."""

    async def health(self) -> dict[str, str]: ...


# The latest expiry a fact may have: the end of year 9999, the last day Mem0's expiration_date (YYYY-MM-DD) can name,
# so that every expiry set on gRPC reads back as a date on the Mem0 API.
MAX_EXPIRES_AT = 253402300800.0


def expires_at_in(msg, name: str) -> float | None:
    """A request's optional `expires_at` as FactRecord.expires_at: None when unset, inf (never) for 0, else the
    Unix time; INVALID_ARGUMENT naming `name` when negative, not finite or past MAX_EXPIRES_AT. A time already past
    is taken (the fact is stored expired), as Mem0 takes a past expiration_date."""
    if not msg.HasField("expires_at"):
        return None
    t = msg.expires_at
    if t == 0:
        return math.inf
    if not 0 < t <= MAX_EXPIRES_AT:  # NaN fails too
        raise invalid(f"{name} must be a Unix time in seconds up to {MAX_EXPIRES_AT:.0f} (the end of year 9999), "
                      f"or 0 for never, got {t!r}", name)
    return float(t)


MEM0_QUEUE = 8           # infer=true extractions that may wait behind the running one, per gateway replica
MEM0_PER_USER = 2        # of those (running + waiting), one user's: no tenant takes the whole queue
MEM0_TIMEOUT_S = 240.0   # an extraction (its wait included) stopped after this
HEALTH_TTL_S = 5.0            # Health, Check and Watch answer a probe at most this old
REGISTRY_FULL = "full: writes refused until facts are deleted"  # Health's registry component at Redis' maxmemory
WATCH_STREAMS_MAX = 32        # open grpc.health.v1 Watch streams per gateway replica (services/app.py reserves
WATCH_STREAMS_PER_PEER = 4    # them on top of the users' request slots); per client connection
WATCH_RETRY_S = 5.0           # RetryInfo of a refused Watch (a slot frees when a stream ends)
MEM0_RETRY_S = 10.0           # RetryInfo when MEM0_QUEUE is full (an extraction takes seconds to minutes)


class WatchSlots:
    """Open Watch streams, bounded in total and per client connection (the gRPC peer, ip:port): beyond either
    bound a Watch gets RESOURCE_EXHAUSTED at once. Watches read the cached health state, so they cost no probe."""

    def __init__(self, total: int = WATCH_STREAMS_MAX, per_peer: int = WATCH_STREAMS_PER_PEER):
        self.total, self.per_peer, self.open = total, per_peer, 0
        self.by_peer: Counter[str] = Counter()

    @contextmanager
    def hold(self, peer: str | None):
        peer = peer or "unknown"
        if self.open >= self.total or self.by_peer[peer] >= self.per_peer:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"too many open health Watch streams (at most {self.total} per server and "
                           f"{self.per_peer} per connection); use Check, or watch again later",
                           retry_after_s=WATCH_RETRY_S, reason="TOO_MANY_WATCHES")
        self.open += 1
        self.by_peer[peer] += 1
        try:
            yield
        finally:
            self.open -= 1
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]


def _blocking(fn, *args, **kw):
    """Registry calls are short blocking I/O: keep them off the event loop."""
    return asyncio.to_thread(fn, *args, **kw)


def _read(fn, *args):
    """A registry read, waited for until the caller's deadline at most (the thread finishes its command). Writes
    use _blocking: one is never abandoned halfway."""
    return within_deadline(asyncio.to_thread(fn, *args))


def _page_facts(page: list, nxt, after, match, unexpired_at: float | None) -> tuple[list, object]:
    """ListMemories' page as wire Facts: the records of `page` ((seq, record) after the cursor `after`) that `match`
    keeps (None: all) and, unless `unexpired_at` is None, that have not expired then; and the cursor of the next
    page (`nxt` when the whole page fits). A page also ends before MAX_PAGE_BYTES (the transport's send limit)."""
    facts: list = []  # pb2.Fact messages
    total = 0
    for seq, r in page:
        if (match is not None and not match(r)) or (unexpired_at is not None and r.expired(unexpired_at)):
            after = seq
            continue
        pb = api.fact_pb(r)
        total += pb.ByteSize() + 8
        if facts and total > MAX_PAGE_BYTES:
            return facts, after
        facts.append(pb)
        after = seq
    return facts, nxt


def _fingerprint(facts: list[NewFact]) -> str:
    """What an add asked for, as an idempotency key's repeat must ask it again: each fact's text, metadata, own
    window, id, creation and expiry time, before the server adds anything (default windows: the user's latest
    facts, which the add itself changes)."""
    asked = [[f.text, f.metadata, list(f.window), f.fact_id, f.created_at, repr(f.expires_at)] for f in facts]
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


class GatewayCore:
    def __init__(self, registry: Registry, backends: Backends | None = None, limits: Limits = Limits(), *,
                 auth: Authenticator):
        """`auth` is required: Authenticator.insecure() is the explicit way to run without it."""
        self.registry, self.backends, self.limits, self.auth = registry, backends, limits, auth
        self._extractor: Mem0Extractor | None = None  # build_extractor (the Gateway replica's start)
        self._extractor_missing: str | None = None  # why it cannot be built (mem0ai not installed)
        self._extractor_lock = asyncio.Lock()
        self._sink: GatewaySink | None = None
        # Mem0 runs one extraction at a time (its vector store is bound to the call's user): one thread of its own.
        self._mem0_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mem0-extract")
        self._mem0_pending = 0  # running + waiting
        self._mem0_by_user: collections.Counter[str] = collections.Counter()  # running + waiting, per user
        self._health = None        # (monotonic time, HealthResponse) of the last probe
        self._health_probe = None  # the probe in flight
        self.watches = WatchSlots()
        self.caller_limits = PrincipalLimits(PrincipalLimit(
            limits.max_in_flight_per_caller, limits.requests_per_s_per_caller, limits.request_burst_per_caller))
        self.work = WorkBudget(WorkLimit(limits.work_units_per_s_per_caller, limits.work_burst_per_caller),
                               gateway=WorkLimit(limits.gateway_work_units_per_s_per_caller,
                                                 limits.gateway_work_burst_per_caller))

    # ------------------------------------------------------------------------------------ auth
    async def authenticate(self, rpc: str, authorization: str | None) -> Principal | None:
        """What the front doors call first, with the `authorization` header or metadata (None: absent). A JWKS
        fetch it needs runs in a worker thread, never on the event loop."""
        if rpc in OPEN_RPCS:
            return None
        caller = await self.auth.authenticate_async(authorization)
        async with self._refusal_paused():
            # first the caller's share (requests in flight, request rate): a refusal below is paused holding a slot
            self.caller_limits.admit(caller)
            self.work.admit(caller, rpc)
        return caller

    @contextlib.asynccontextmanager
    async def _refusal_paused(self):
        """A refusal the caller's own use caused, raised inside (its rate, its work budget, its extraction slots:
        PAUSED_REASONS), is answered after pause_before_refusal: at authentication, at the extraction queue, and where
        a request's work is charged before it is done (its caller's other requests may have spent the budget since),
        the request holds its caller's slot."""
        try:
            yield
        except ApiError as e:
            await pause_before_refusal(e, self.limits.refusal_pause_max_s, self.caller_limits.refusal_spread_s())
            raise

    async def charge_before(self, resource: Resource, units: float) -> None:
        """Work on `resource` known before it is done, charged before it is done (WorkBudget.charge): refused when
        the caller's other requests have put that balance in debt, the refusal paused as at authentication."""
        async with self._refusal_paused():
            self.work.charge(resource, units)

    def _owner(self, caller: Principal, rpc: str, user_id: str, field_name: str = "user_id") -> str:
        """The request's user id, validated, once the caller may act for it (before anything is read)."""
        uid = validation.user_id(user_id, field_name)
        self.auth.authorize(caller, uid, RPC_SCOPES[rpc])
        return uid

    def _need(self, what: str) -> Backends:
        if self.backends is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,  # no RetryInfo: a retry cannot help
                           f"{what} needs the retrieval/engine deployments, and this gateway runs without them "
                           "(registry-only mode)", reason="BACKENDS_NOT_DEPLOYED")
        return self.backends

    async def _push(self, coro, what: str) -> None:
        """A replica push that the replicas can repair themselves (they re-sync from the registry): failures
        are logged, not returned."""
        try:
            await coro
        except Exception:  # see docstring
            log.exception("push to replicas failed (%s); replicas will re-sync from the registry", what)

    # ------------------------------------------------------------------------------------ writes
    async def _check_encodable(self, texts: list[str], names: list[str]) -> list[int]:
        """The encoder's real limits, before anything is written; the error names the first bad field. Returns
        each text's KV bytes (0 in registry-only mode, where nothing is encoded)."""
        if self.backends is None:
            return [0] * len(texts)
        checked = await self.backends.check_facts(texts)
        for name, why in zip(names, checked):
            if isinstance(why, str):
                raise too_big(f"{name} {why}; nothing was stored", name)
        return [int(n or 0) for n in checked]

    async def _store_facts(self, user_id: str, facts: list[validation.FactIn], names: list[str],
                           expiries: list[float], idempotency_key: str = "") -> list[FactRecord]:
        return await self.store_new(user_id, [NewFact(f.text, f.metadata, window=f.window, expires_at=e)
                                              for f, e in zip(facts, expiries)], names, idempotency_key)

    async def store_new(self, user_id: str, facts: list[NewFact], names: list[str] | None = None,
                        idempotency_key: str = "") -> list[FactRecord]:
        """All or nothing: checked, then registry rows (quota checked atomically), then KV + index; if those
        fail, the rows are removed again and the error says nothing was stored. `idempotency_key` ("": none): a
        repeat of an add the user made under this key answers with that add's facts, and stores and encodes
        nothing (_repeated_add)."""
        names = names or [f"facts[{i}].text" for i in range(len(facts))]
        for f, name in zip(facts, names):
            validation.text_field(f.text, name, self.limits.max_fact_chars)
        idem = None
        if idempotency_key:
            try:
                idem = IdempotentAdd(check_idempotency_key(idempotency_key), _fingerprint(facts))
            except ValueError as e:
                raise invalid(str(e), "idempotency_key") from None
            earlier = await _blocking(self.registry.idempotent_add, user_id, idem.key, answering=idem.fingerprint)
            if earlier is not None:  # before anything is encoded
                return await self._repeated_add(user_id, idem, earlier)
        # The shipped encoding default: each fact behind the facts its user stored most recently, this call's
        # earlier ones included (a caller's own window wins). Stored with the fact: a re-encode reproduces it.
        behind = (await _blocking(self.registry.latest, user_id, NEIGHBOUR_WINDOW)
                  if any(not f.window for f in facts) else [])
        stored = [r.text for r in behind]
        windows = default_windows([f.text for f in facts], [f.window for f in facts], stored=stored)
        facts = [dataclasses.replace(f, window=win) for f, win in zip(facts, windows)]
        encoded = sum(len(f.text) + sum(len(turn) for turn in f.window) for f in facts)
        if encoded > self.limits.max_encode_chars_per_request:
            raise too_big(f"this write would have the encoder pool encode {encoded} characters (the facts and the "
                          f"windows they are encoded behind), the limit per request is "
                          f"{self.limits.max_encode_chars_per_request}: send fewer facts per request; nothing "
                          "was stored", "facts")
        await self.charge_before(Resource.ENCODE, text_units(encoded))  # before the encoder pool is asked for anything
        kv_bytes = await self._check_encodable([f.text for f in facts], names)
        facts = [dataclasses.replace(f, kv_bytes=n) for f, n in zip(facts, kv_bytes)]
        try:
            recs = await _blocking(self.registry.create, user_id, facts, self.limits.quota(), idempotent=idem)
        except IdempotentRepeatError:  # the same key's add stored meanwhile (a concurrent repeat)
            assert idem is not None  # only a create with a key raises it
            earlier = await _blocking(self.registry.idempotent_add, user_id, idem.key, answering=idem.fingerprint)
            if earlier is None:  # that add was undone since: its caller was told nothing was stored
                raise unavailable(f"an add under the same idempotency_key {idem.key!r} ran at the same time and "
                                  "failed; nothing was stored; retry") from None
            return await self._repeated_add(user_id, idem, earlier)
        if behind:
            recs = await self._behind_changed(user_id, behind, recs)
        if self.backends is not None:
            try:
                await self.backends.index_facts(user_id, recs)
            except Exception as e:  # undone, then reported
                ids = [r.fact_id for r in recs]
                kept = idem is not None and not await self._release_key(user_id, idem)
                left = ids if kept else await self._undo_create(user_id, recs)
                err = to_api_error(e)
                if err.code == grpc.StatusCode.INTERNAL:
                    log.exception("storing %d facts failed; %s", len(recs), "kept" if kept else "undone")
                if kept:  # a repeat returned these facts, or may have: they stay, under the key
                    assert idem is not None  # kept only with a key
                    outcome = (f"its {len(ids)} facts are kept ({', '.join(ids[:8])}{', ...' if len(ids) > 8 else ''})"
                               f": a repeat of this add may have been answered with them; a retry with the same "
                               f"idempotency_key {idem.key!r} answers with them")
                elif left:  # the registry failed the undo too: say what may still be stored
                    outcome = (f"{len(left)} of its {len(recs)} facts could not be removed again and may still be "
                               f"stored ({', '.join(left[:8])}{', ...' if len(left) > 8 else ''}): delete them, "
                               "or retry with the same fact ids")
                else:
                    outcome = "nothing was stored"
                raise ApiError(err.code, err.message if "nothing was stored" in err.message and not left
                               else f"{err.message}; {outcome}", field=err.field,
                               retry_after_s=err.retry_after_s, quota=err.quota, reason=err.reason) from None
        return recs

    async def _repeated_add(self, user_id: str, idem: IdempotentAdd, earlier: IdempotentAdd) -> list[FactRecord]:
        """The answer to an add whose idempotency key an earlier add of the user holds: that add's facts as they
        are now, if the request is the same and they are all still stored; nothing is written or encoded (the
        replicas index and encode stored facts they lack at their next sync, as after any push that failed)."""
        if earlier.fingerprint != idem.fingerprint:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"idempotency_key {idem.key!r} was used by an earlier add of this user with other facts "
                           "(texts, metadata, windows or times); one key names one add: send a new key for a new "
                           "add; nothing was stored", field="idempotency_key", reason="IDEMPOTENCY_KEY_REUSED")
        found = await _blocking(self.registry.find_many, user_id, list(earlier.fact_ids))
        gone = [f for f in earlier.fact_ids if f not in found]
        if gone:
            raise ApiError(grpc.StatusCode.ALREADY_EXISTS,
                           f"the add with idempotency_key {idem.key!r} was already applied, and {len(gone)} of its "
                           f"{len(earlier.fact_ids)} facts have been deleted since ({', '.join(gone[:8])}"
                           f"{', ...' if len(gone) > 8 else ''}); nothing was stored",
                           field="idempotency_key", reason="IDEMPOTENT_ADD_DELETED")
        return [found[f] for f in earlier.fact_ids]

    async def _release_key(self, user_id: str, idem: IdempotentAdd) -> bool:
        """The first step of undoing an add sent with a key: releases the key (a retry under it must store the
        facts again: the caller is told nothing was stored). False when the add must stand instead: a repeat was
        answered with its facts meanwhile (Registry.release_idempotency_key), or the registry failed to say
        whether one was (the key still names the facts, so a retry under it answers with them)."""
        try:
            return await _blocking(self.registry.release_idempotency_key, user_id, idem.key)
        except Exception:  # logged; kept, as above
            log.exception("undoing a failed write: its idempotency key could not be released; its facts are kept")
            return False

    async def _undo_create(self, user_id: str, recs: list[FactRecord]) -> list[str]:
        """Removes the rows of a write whose KV/index step failed (after its idempotency key, _release_key);
        returns the ids it could not remove (the registry failing now too, after UNDO_ATTEMPTS tries), which the
        caller reports instead of "nothing was stored"."""
        removed, left = [], []
        for r in recs:
            for attempt in range(UNDO_ATTEMPTS):
                try:
                    removed.append((r.fact_id, (await _blocking(self.registry.delete, user_id, r.fact_id)).version))
                    break
                except UnknownFactError:  # already gone (a concurrent delete)
                    break
                except Exception:  # the registry failing: retried, then reported (log.exception keeps it)
                    if attempt + 1 == UNDO_ATTEMPTS:
                        log.exception("undoing a failed write: fact %s of a user could not be removed", r.fact_id)
                        left.append(r.fact_id)
                    else:
                        await asyncio.sleep(UNDO_BACKOFF_S * (attempt + 1))
        if removed and self.backends is not None:
            await self._push(self.backends.forget(user_id, removed), "forget (undo)")
        return left

    async def update_fact(self, user_id: str, fact_id: str, text: str | None, metadata: dict | None,
                          replace_metadata: bool = False, expected_version: int = 0, embedding=None,
                          expires_at: float | None = None) -> FactRecord:
        """`expires_at`: FactRecord.expires_at (None: as it is). The replicas learn of a new expiry at their next
        sync, as of a metadata change (the version moved)."""
        old = kv_bytes = None
        if text is not None:
            validation.text_field(text, "text", self.limits.max_fact_chars)
            (kv_bytes,) = await self._check_encodable([text], ["text"])
            old = await _blocking(self.registry.get, user_id, fact_id)
            seq = await _blocking(self.registry.seq_of, user_id, fact_id)
            reencode = text_units(len(text) + sum(len(turn) for turn in old.window))
            await self.charge_before(Resource.ENCODE, reencode)  # its re-encode
        rec = await _blocking(self.registry.update, user_id, fact_id, text=text, metadata=metadata,
                              replace_metadata=replace_metadata, expected_version=expected_version,
                              embedding=embedding, quota=self.limits.quota(), kv_bytes=kv_bytes, expires_at=expires_at)
        if text is not None and self.backends is not None:  # metadata changes do not touch KV or embeddings
            # The text passed the encoder's check; a push that still fails is repaired by the replicas' sync.
            await self._push(self.backends.index_facts(user_id, [rec]), "index_facts (update)")
        if old is not None and old.text != rec.text and seq is not None:
            await self._rewindow(user_id, seq, old.text, rec.text)
        return rec

    async def delete_fact(self, user_id: str, fact_id: str) -> FactRecord:
        seq = await _blocking(self.registry.seq_of, user_id, fact_id)  # before: the delete takes it away
        rec = await _blocking(self.registry.delete, user_id, fact_id)
        if self.backends is not None:
            await self._push(self.backends.forget(user_id, [(fact_id, rec.version)]), "forget")
        if seq is not None:
            await self._rewindow(user_id, seq, rec.text, None)
        return rec

    async def _rewindow(self, user_id: str, seq: int, old_text: str, new_text: str | None) -> list[FactRecord]:
        """A fact's text left the memory (deleted, or changed to `new_text`): the facts of the user encoded
        behind it get that line removed (or replaced) in their stored windows and are re-encoded, so the old text
        survives in no other fact's window or KV (docs/architecture.md, "Neighbour windows"). Only the facts
        created after it can hold it, and only the first NEIGHBOUR_WINDOW of them still stored: a window is the
        NEIGHBOUR_WINDOW facts stored most recently when its fact was created, and facts deleted since left
        nothing between them (twice as many are read, for adds racing this one). So the cost is a bounded read
        and at most NEIGHBOUR_WINDOW re-encodes, whatever the size of the user's memory. (A caller's own window
        that happens to quote the text, on a fact further on, is the caller's text, not this fact's.)"""
        page, _ = await _blocking(self.registry.list_after, user_id, seq, REWINDOW_SPAN)
        changed = list((await self._rewrite_windows(user_id, [rec for _, rec in page], old_text, new_text)).values())
        # The neighbours re-encoded: work the delete or update causes once it is done, so charged, never refused.
        self.work.spent(Resource.ENCODE,
                        text_units(sum(len(r.text) + sum(len(turn) for turn in r.window) for r in changed)))
        if changed and self.backends is not None:  # a failed push is repaired by the replicas' sync
            await self._push(self.backends.index_facts(user_id, changed), "index_facts (neighbour left)")
        return changed

    async def _rewrite_windows(self, user_id: str, recs: list[FactRecord], old_text: str,
                               new_text: str | None) -> dict[str, FactRecord]:
        """The records among `recs` whose stored window holds `old_text`'s line, rewritten (the line removed, or
        replaced by `new_text`'s), by fact id; a fact deleted meanwhile is left out."""
        changed = {}
        for rec in recs:
            for _ in range(3):  # a concurrent write to the same fact: read it again
                win = rewindow(rec.window, old_text, new_text)
                if win is None:
                    break
                try:
                    changed[rec.fact_id] = await _blocking(self.registry.update, user_id, rec.fact_id, window=win,
                                                           expected_version=rec.version)
                    break
                except UnknownFactError:  # deleted meanwhile
                    break
                except VersionConflictError:
                    try:
                        rec = await _blocking(self.registry.get, user_id, rec.fact_id)
                    except UnknownFactError:
                        break
        return changed

    async def _behind_changed(self, user_id: str, behind: list[FactRecord],
                              recs: list[FactRecord]) -> list[FactRecord]:
        """A write's facts were given windows of the user's latest facts (`behind`, read before the write); one
        of those deleted or changed between that read and the write would survive in the new windows (its own
        rewindow ran before these facts existed, so it could not see them). Read `behind` again, in one round
        trip, and rewrite the new facts' windows for what left or changed, before anything is encoded."""
        now = await _blocking(self.registry.find_many, user_id, [r.fact_id for r in behind])
        for old in behind:
            cur = now.get(old.fact_id)
            if cur is not None and cur.text == old.text:
                continue
            fixed = await self._rewrite_windows(user_id, recs, old.text, None if cur is None else cur.text)
            recs = [fixed.get(r.fact_id, r) for r in recs]
        return recs

    def build_extractor(self) -> None:
        """Builds Mem0's extractor (AddMemory with infer=true) now, blocking, on the extraction thread: the Gateway
        replica calls it in its constructor, before Serve sends it a request (importing mem0ai and building its
        Memory takes ~2 s on a 2-core node; on the first infer=true request it would add that to the request).
        Mem0 embeds through the retrieval replicas (Backends.embed), so no model, and no torch, is loaded here:
        with its own copy of the embedder the replica's start took ~13 s more and ~540 MB (BENCHMARKS.md, "The
        first extraction's build, before requests"). Without mem0ai nothing is built and infer=true answers
        UNIMPLEMENTED."""
        self._mem0_pool.submit(self._build_extractor_here).result()

    def _build_extractor_here(self) -> None:
        """build_extractor's work, on the extraction thread (once; a missing mem0ai is remembered): mem0ai is
        imported here, not at import."""
        if self._extractor is not None or self._extractor_missing is not None:
            return
        sink = GatewaySink(self)
        try:
            from ..mem0_provider import Mem0Extractor

            self._extractor = Mem0Extractor(sink)
            self._sink = sink
        except ImportError as e:
            self._extractor_missing = str(e)
            log.warning("AddMemory with infer=true is not served: %s", e)

    async def _extractor_built(self) -> Mem0Extractor:
        """The extractor: the one build_extractor made, else built now on the extraction thread (a GatewayCore
        made outside a Gateway replica: tests, tools)."""
        async with self._extractor_lock:
            if self._extractor is None and self._extractor_missing is None:
                await asyncio.get_running_loop().run_in_executor(self._mem0_pool, self._build_extractor_here)
            if self._extractor is None:
                raise ApiError(grpc.StatusCode.UNIMPLEMENTED,
                               f"AddMemory with infer=true needs mem0ai 2.2 in the service's image "
                               f"({self._extractor_missing}); send infer=false or use AddFacts")
            return self._extractor

    async def _extract(self, user_id: str, messages: list[dict], metadata: dict,
                       stamp: dict | None = None) -> list[dict]:
        """Mem0's add with inference (services/mem0_provider.py) on the gateway's own extraction thread, never
        the default pool the other RPCs' registry calls use. At most MEM0_QUEUE extractions wait behind the
        running one; more get RESOURCE_EXHAUSTED (after a pause: pause_before_refusal). One unfinished after
        MEM0_TIMEOUT_S (queueing included) is stopped: nothing of it is written after its error is returned.
        `stamp`: NewFact fields (created_at, expires_at) the facts it adds get."""
        self._need("AddMemory with infer=true")
        # The route (AddMemory) was admitted for the encoder only: the body said infer=true, so the extraction's
        # engine work is checked now, before it queues (its prompts are charged as they run, never refused).
        async with self._refusal_paused():
            self.work.check(Resource.ENGINE)
            if self._mem0_pending >= 1 + MEM0_QUEUE:
                raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many AddMemory calls with infer=true in progress on this server (1 running, "
                               f"{MEM0_QUEUE} waiting); retry later, or send infer=false",
                               retry_after_s=MEM0_RETRY_S, reason="EXTRACTION_QUEUE_FULL")
            if self._mem0_by_user[user_id] >= MEM0_PER_USER:
                raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this user already has {MEM0_PER_USER} AddMemory calls with infer=true in progress "
                               "on this server, the most one user may; retry when one has finished, or send "
                               "infer=false", retry_after_s=MEM0_RETRY_S, reason="EXTRACTION_QUEUE_FULL")
            self._mem0_pending += 1  # counted before any await: the next call sees this one
            self._mem0_by_user[user_id] += 1
        try:
            extractor = await self._extractor_built()
            call = ExtractionCall(stamp)
            assert self._sink is not None  # made with the extractor
            # In this request's context: the extraction's model calls and writes are charged to its caller's budget.
            done = self._mem0_pool.submit(contextvars.copy_context().run, self._sink.running(call, extractor.add),
                                          user_id, messages, metadata)
            try:
                return await within_deadline(asyncio.shield(asyncio.wrap_future(done)), MEM0_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.CancelledError, ApiError) as e:  # ApiError: the caller's deadline
                await call.stop(done)
                if isinstance(e, asyncio.CancelledError):
                    raise
                if isinstance(e, ApiError):
                    raise ApiError(e.code, f"{e.message}; the memory extraction was stopped, {call.written} of its "
                                           "changes had been written, nothing more will be") from None
                raise ApiError(grpc.StatusCode.UNAVAILABLE,  # no RetryInfo: a retry repeats the written part
                               f"the memory extraction did not finish within {MEM0_TIMEOUT_S:g} s and was stopped; "
                               f"{call.written} of its changes had been written, nothing more will be",
                               reason="EXTRACTION_STOPPED") from None
        finally:
            self._mem0_pending -= 1
            self._mem0_by_user[user_id] -= 1
            if not self._mem0_by_user[user_id]:
                del self._mem0_by_user[user_id]

    # ------------------------------------------------------------------------------------ RPCs
    # Each takes the raw request and the authenticated caller (None only for Health).
    async def AddFacts(self, raw, caller: Principal):  # noqa: N802 (RPC names)
        req = api.parse("AddFacts", raw, self.limits)
        uid = self._owner(caller, "AddFacts", req.user_id)
        facts = validation.facts_in(req.facts, self.limits)
        expiries = [expires_at_in(f, f"facts[{i}].expires_at") for i, f in enumerate(req.facts)]
        scope = filters.scope_metadata(agent_id=req.agent_id, run_id=req.run_id)
        if scope:
            facts = [dataclasses.replace(f, metadata={**f.metadata, **scope}) for f in facts]
        recs = await self._store_facts(uid, facts, [f"facts[{i}].text" for i in range(len(facts))],
                                       [math.inf if e is None else e for e in expiries], req.idempotency_key)
        return pb2.AddFactsResponse(facts=[api.fact_pb(r) for r in recs])

    async def AddMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("AddMemory", raw, self.limits)
        uid = self._owner(caller, "AddMemory", req.user_id)
        messages = validation.messages_in(req.messages, self.limits)
        meta = {**validation.metadata(req.metadata, "metadata", self.limits),
                **filters.scope_metadata(agent_id=req.agent_id, run_id=req.run_id)}
        expires_at = expires_at_in(req, "expires_at")
        events = await self.add_memory(uid, messages, meta, req.infer if req.HasField("infer") else True,
                                       expires_at=math.inf if expires_at is None else expires_at)
        return pb2.AddMemoryResponse(results=[
            pb2.MemoryEvent(fact_id=e["id"], text=e.get("memory", ""), event=e.get("event", "ADD"),
                            previous_text=e.get("previous_memory") or "") for e in events])

    async def add_memory(self, uid: str, messages: list[dict], meta: dict, infer: bool,
                         created_at: float | None = None, expires_at: float = math.inf,
                         idempotency_key: str = "") -> list[dict]:
        """Mem0's add for an authorized user: Mem0's events ({"id", "memory", "event", "previous_memory"}).
        `created_at` (None: now) and `expires_at` (FactRecord's) are those of the memories it adds (Mem0's
        timestamp and expiration_date); memories an extraction updates keep theirs. `idempotency_key`: store_new's,
        for infer=false only (an extraction's adds, updates and deletes are no one atomic write to repeat)."""
        stamp: dict[str, Any] = {"created_at": created_at, "expires_at": expires_at}
        if infer and idempotency_key:
            raise invalid("an idempotency key applies to an add that stores the messages as they are "
                          "(infer=false); an extraction (infer=true) adds, updates and deletes memories in "
                          "steps that cannot be repeated as one: send infer=false or no key",
                          "idempotency_key")
        if infer:
            return await self._extract(uid, messages, meta, stamp)
        # Mem0's infer=False: every non-system message is stored as it is, tagged with its role.
        kept = [(i, m) for i, m in enumerate(messages) if m["role"] != "system"]
        facts = [NewFact(validation.text_field(m["content"], f"messages[{i}].content",
                                               self.limits.max_fact_chars).strip(),
                         {**meta, "role": m["role"]}, **stamp) for i, m in kept]
        if not facts:
            raise invalid("messages hold only system messages; with infer=false nothing would be stored",
                              "messages")
        recs = await self.store_new(uid, facts, [f"messages[{i}].content" for i, _ in kept], idempotency_key)
        return [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in recs]

    async def Search(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("Search", raw, self.limits)
        uid = self._owner(caller, "Search", req.user_id)
        query = validation.text_field(req.query, "query", self.limits.max_query_chars)
        k = validation.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        match = filters.request_filter(filters.parse_json(req.filters), uid, req.agent_id, req.run_id)
        threshold = req.threshold if req.HasField("threshold") else None
        hits = await self.search_records(uid, query, k, match, threshold)
        return pb2.SearchResponse(hits=[pb2.SearchHit(fact=api.fact_pb(r), score=s) for r, s in hits])

    async def search_records(self, uid: str, query: str, k: int, match=None,
                             threshold: float | None = None) -> list[tuple[FactRecord, float]]:
        """Top-k (record, score) of an authorized user, best first, only those `match` keeps (filters.py) and
        scoring at least `threshold`. With a filter the ranking is widened (x4 per round) until k facts match
        or the user's facts run out: a filter never hides a match that ranks below k unfiltered facts."""
        backends = self._need("Search")
        if threshold is not None and threshold != threshold:  # NaN
            raise invalid("threshold must be a number")
        want = k
        while True:
            # a filter widens the read up to the user's every fact: each round charged before it reads (up to `want`
            # records) and embeds the query, the read corrected to what it read (mem0_http.scanned says why before)
            estimate = scan_units(want, match)
            await self.charge_before(Resource.GATEWAY, estimate + query_units(query))
            hits = await backends.search(uid, query, want)
            recs = await self._records(uid, [f for f, _ in hits])
            self.work.spent(Resource.GATEWAY, scan_units(len(hits), match) - estimate)
            out = [(recs[f], s) for f, s in hits if f in recs and (threshold is None or s >= threshold)]
            if match is not None:  # up to max_facts_per_user records: matched in a worker thread, never the loop
                out = await asyncio.to_thread(lambda: [(r, s) for r, s in out if match(r)])
            if (len(out) >= k or match is None or len(hits) < want or want >= self.limits.max_facts_per_user
                    or (threshold is not None and hits and hits[-1][1] < threshold)):
                return out[:k]
            want = min(want * 4, self.limits.max_facts_per_user)

    async def _records(self, user_id: str, fact_ids: list[str]) -> dict[str, FactRecord]:
        """Records of the user by id, in one registry round trip, skipping any deleted since the replica answered."""
        return await _read(self.registry.find_many, user_id, fact_ids) if fact_ids else {}

    async def Answer(self, raw, caller: Principal):  # noqa: N802 - async generator of AnswerChunk
        async for piece in self.answer_pieces(raw, caller):
            if isinstance(piece, AnswerEnd):
                yield pb2.AnswerChunk(
                    final=True, ttft_ms=piece.ttft_ms, fact_ids=piece.fact_ids, prompt_tokens=piece.prompt_tokens,
                    prefilled_tokens=piece.prefilled_tokens, completion_tokens=piece.completion_tokens,
                    finish_reason=piece.finish_reason, timings_ms=piece.timings_ms)
            else:
                yield pb2.AnswerChunk(text=piece.text)

    async def answer_pieces(self, raw, caller: Principal, openai: OpenAIChat | None = None):
        """Answer's validation and stream, as the engine replica's messages (AnswerPiece..., AnswerEnd).
        `openai`: the parts of an OpenAI chat request the HTTP front door checked (services/messages.py
        OpenAIChat); its question may be as long as any message, and its sampling replaces max_tokens
        and temperature."""
        req = api.parse("Answer", raw, self.limits)
        uid = self._owner(caller, "Answer", req.user_id)
        query = validation.text_field(req.query, "query", self.limits.max_message_chars if openai is not None
                                      else self.limits.max_query_chars)
        k = validation.bounded_int(req.k, "k", 1, self.limits.max_k, self.limits.default_k)
        max_tokens = validation.bounded_int(req.max_tokens, "max_tokens", 1, self.limits.max_max_tokens,
                                     self.limits.default_max_tokens)
        if not 0.0 <= req.temperature <= 2.0:  # also refuses NaN
            raise invalid(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
        mode = answer_mode(req.mode)
        conversation = validation.messages_in(req.messages, self.limits) if req.messages else None
        backends = self._need("Answer")
        extra = {"openai": openai} if openai is not None else {}
        estimate = self._answer_units(query, conversation, max_tokens, openai)
        # before the engine is asked; corrected by what it reports at the end. The query's embedding (the search the
        # answer starts with) is the gateway's share, known in full before it runs.
        await self.charge_before(Resource.GATEWAY, query_units(query))
        await self.charge_before(Resource.ENGINE, estimate)
        async for piece in backends.answer(uid, query, k, max_tokens, float(req.temperature), mode, conversation,
                                           **extra):
            if isinstance(piece, AnswerEnd):
                self.work.spent(Resource.ENGINE, piece.prefilled_tokens + piece.completion_tokens - estimate)
            yield piece

    def _answer_units(self, query: str, conversation: list[dict] | None, max_tokens: int,
                      openai: OpenAIChat | None) -> float:
        """What an answer may cost before it runs: its text prefilled (the question and the conversation; the
        facts' KV is injected, not prefilled) and every choice's tokens up to its cap. An OpenAI request's n and cap
        are read as sent (the engine replica validates them); one without a cap (most OpenAI clients send none) is
        estimated at default_max_tokens, as gRPC's Answer defaults, not at the end of the context: two such chats
        at once would otherwise put a quiet caller in debt. What it really ran is charged when it ends."""
        if openai is None:
            turns = [query, *(str(m.get("content", "")) for m in conversation or [])]
            return text_units(sum(map(len, turns))) + max_tokens
        turns = [str(m.get("content", "")) for m in openai.messages]

        def whole(name: str) -> int | None:
            v = openai.sampling.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        cap = whole("max_completion_tokens") or whole("max_tokens") or self.limits.default_max_tokens
        # the engine refuses more output than MAX_OUTPUT_TOKENS: an estimate past it would be refunded anyway
        return text_units(sum(map(len, turns))) + min((whole("n") or 1) * cap, MAX_OUTPUT_TOKENS)

    async def GetMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("GetMemory", raw, self.limits)
        uid = self._owner(caller, "GetMemory", req.user_id)
        rec = await _read(self.registry.get, uid, validation.fact_id(req.fact_id))
        return api.fact_pb(rec)

    async def ListMemories(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("ListMemories", raw, self.limits)
        uid = self._owner(caller, "ListMemories", req.user_id)
        size = validation.bounded_int(req.page_size, "page_size", 1, self.limits.max_page_size,
                                      self.limits.default_page_size)
        # A token answers only the listing that issued it: this user, these filters.
        scope = "\n".join((uid, req.filters, req.agent_id, req.run_id))
        after = page_token(req.page_token, scope)
        match = filters.request_filter(filters.parse_json(req.filters), uid, req.agent_id, req.run_id)
        estimate = scan_units(size, match)  # charged before the page is read, corrected to what was read
        await self.charge_before(Resource.GATEWAY, estimate)
        page, nxt = await _read(self.registry.list_after, uid, after, size)
        self.work.spent(Resource.GATEWAY, scan_units(len(page), match) - estimate)
        # Matched and serialized in a worker thread: a page of max_page_size facts under the costliest filter is
        # ~2 s of CPU (bench/results/filter_cost.md), which on the loop would stall every other request here.
        facts, nxt = await within_deadline(asyncio.to_thread(
            _page_facts, page, nxt, after, match, None if req.show_expired else time.time()))
        return pb2.ListMemoriesResponse(facts=facts, next_page_token=next_page_token(nxt, scope))

    async def UpdateMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("UpdateMemory", raw, self.limits)
        uid = self._owner(caller, "UpdateMemory", req.user_id)
        fid = validation.fact_id(req.fact_id)
        text = (validation.text_field(req.text, "text", self.limits.max_fact_chars).strip()
                if req.HasField("text") else None)
        meta = validation.metadata(req.metadata, "metadata", self.limits)
        expires_at = expires_at_in(req, "expires_at")
        if text is None and not meta and not req.replace_metadata and expires_at is None:
            raise invalid("nothing to update: set text, metadata and/or expires_at", "text")
        if req.expected_version < 0:
            raise invalid(f"expected_version must be >= 0, got {req.expected_version}", "expected_version")
        rec = await self.update_fact(uid, fid, text, meta if (meta or req.replace_metadata) else None,
                                     req.replace_metadata, req.expected_version, expires_at=expires_at)
        return api.fact_pb(rec)

    async def DeleteMemory(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("DeleteMemory", raw, self.limits)
        uid = self._owner(caller, "DeleteMemory", req.user_id)
        fid = validation.fact_id(req.fact_id)
        await self.delete_fact(uid, fid)
        return pb2.DeleteMemoryResponse(fact_id=fid)

    async def DeleteUser(self, raw, caller: Principal):  # noqa: N802
        req = api.parse("DeleteUser", raw, self.limits)
        uid = self._owner(caller, "DeleteUser", req.user_id)
        n = await _blocking(self.registry.delete_user, uid)  # a user with no facts: deleted=0, as Mem0's delete_all
        if self.backends is not None:
            await self._push(self.backends.forget_user(uid), "forget_user")
        return pb2.DeleteUserResponse(deleted=n)

    async def Health(self, raw, caller: Principal | None = None):  # noqa: N802 - open: no token needed
        """Open, so it costs nothing per call: the state of the last probe (at most HEALTH_TTL_S old); one
        probe of the registry and the backends runs at a time, started by a call that finds the state stale."""
        api.parse("Health", raw, self.limits)
        return await self.health_state()

    async def health_state(self):
        now = time.monotonic()
        cached = self._health
        if cached is not None and now - cached[0] < HEALTH_TTL_S:
            return cached[1]
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self._probe_health())
        if cached is not None:  # stale: the last state now, the probe refreshes it for the next caller
            return cached[1]
        return await asyncio.shield(self._health_probe)

    async def _probe_health(self):
        components = {}
        try:
            await _blocking(self.registry.ping)
            components["registry"] = REGISTRY_FULL if await _blocking(self.registry.is_full) else "ok"
        except Exception as e:  # noqa: BLE001 - reported by type only: Health is open to anyone
            log.warning("health: registry unreachable: %s", e)
            components["registry"] = f"error: {type(e).__name__}"
        if components["registry"] == REGISTRY_FULL:
            log.warning("health: the registry (Redis) is at its maxmemory: creates and updates are refused")
        if self.backends is None:
            components["backends"] = "none (registry-only mode)"
        else:
            try:
                components.update(await self.backends.health())
            except Exception as e:  # noqa: BLE001
                log.warning("health: backends: %s", e)
                components["backends"] = f"error: {type(e).__name__}"
        # A full registry leaves the status SERVING: reads, answers and the deletes that free space all work, and
        # NOT_SERVING would take every gateway out of its load balancer (they share the one Redis).
        ok = all(v in ("ok", REGISTRY_FULL) or v.startswith("none") for v in components.values())
        resp = pb2.HealthResponse(status="SERVING" if ok else "DEGRADED", components=components)
        self._health = (time.monotonic(), resp)
        return resp


class ExtractionCall:
    """One AddMemory(infer=true) in progress: once stopped, the sink refuses its every further call, and the
    writes it had started are waited for before the error is returned (nothing lands after it). `stamp`: NewFact
    fields the facts it adds get (add's created_at and expires_at)."""

    def __init__(self, stamp: dict | None = None):
        self.stamp = dict(stamp or {})
        self.stopped = False
        self.written = 0
        self.writes: set[asyncio.Task] = set()

    async def stop(self, future) -> None:
        self.stopped = True
        future.cancel()  # not started yet (still queued): it never runs
        if self.writes:
            await asyncio.wait(list(self.writes))


class GatewaySink:
    """The FactSink of services/mem0_provider.py over a GatewayCore. Mem0 runs in the extraction thread; writes
    and backend calls are run on the gateway's event loop, so they take the same path as the RPCs (checked,
    quota, all or nothing), and each checks there, on the loop, that its extraction was not stopped."""

    def __init__(self, core: GatewayCore, loop: asyncio.AbstractEventLoop | None = None, timeout_s: float = 300.0):
        """`loop`: the gateway's event loop; None: the one `running` is first called on (the sink is made in the
        replica's constructor, before the loop serves)."""
        self.core, self.loop, self.timeout_s = core, loop, timeout_s
        self._local = threading.local()

    def running(self, call: ExtractionCall, fn):
        """`fn` for the extraction thread, with `call` as the sink's current extraction."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        def run(*args):
            self._local.call = call
            try:
                return fn(*args)
            finally:
                self._local.call = None
        return run

    def _run(self, make_coro, write: bool = False):
        call = getattr(self._local, "call", None)

        async def guarded():
            if call is not None and call.stopped:
                raise ApiError(grpc.StatusCode.UNAVAILABLE, "the memory extraction was stopped")
            if not write or call is None:
                return await make_coro()
            task = asyncio.current_task()
            call.writes.add(task)
            try:
                out = await make_coro()
                call.written += 1
                return out
            finally:
                call.writes.discard(task)

        assert self.loop is not None  # set by running(), which every extraction goes through
        return asyncio.run_coroutine_threadsafe(guarded(), self.loop).result(self.timeout_s)

    def add(self, user_id, facts):
        call = getattr(self._local, "call", None)
        if call is not None and call.stamp:
            facts = [dataclasses.replace(f, **call.stamp) for f in facts]
        return self._run(lambda: self.core.store_new(user_id, facts), write=True)

    def search(self, user_id, vector, k):
        return self._run(lambda: self.core.backends.search_vector(user_id, vector, k))

    def embed(self, texts, as_query):
        return self._run(lambda: self.core.backends.embed(texts, as_query))

    def get(self, user_id, fact_id):
        return self.core.registry.get(user_id, fact_id)

    def list(self, user_id):
        return self.core.registry.list(user_id)[0]

    def update(self, user_id, fact_id, text, vector, metadata):
        return self._run(lambda: self.core.update_fact(user_id, fact_id, text, metadata, embedding=vector), write=True)

    def delete(self, user_id, fact_id):
        self._run(lambda: self.core.delete_fact(user_id, fact_id), write=True)

    def chat(self, user_id, messages, max_tokens, temperature, structured):
        async def chat():
            # The extraction's prompt and its answer's cap, charged to the add that runs it (never refused: the
            # add's engine balance was checked before the extraction started, _extract, and its own work cannot
            # refuse it).
            self.core.work.spent(Resource.ENGINE,
                                 text_units(sum(len(str(m.get("content", ""))) for m in messages)) + max_tokens)
            return await self.core.backends.chat(user_id, messages, max_tokens, temperature, structured)
        return self._run(chat)

    def chat_room(self, user_id, messages):
        return self._run(lambda: self.core.backends.chat_room(user_id, messages))


UNARY = [m for m in api.REQUEST_TYPES if m not in api.STREAMING]
