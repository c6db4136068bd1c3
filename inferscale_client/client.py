"""Blocking and asyncio clients of `inferscale.v1.Memory` (needs only grpcio and protobuf).

    with MemoryClient("localhost:9000", token=TOKEN) as c:
        c.add_facts("alice", ["likes green tea", "has a dog named Rex"])
        for piece in c.answer("alice", "What is my dog called?"):
            print(piece.text, end="")

    async with AsyncMemoryClient("localhost:9000", token=TOKEN) as c:
        await c.add_facts("alice", ["likes green tea"])
        async for piece in c.answer("alice", "What do I drink?", messages=[{"role": "system", "content": "Be brief."}]):
            print(piece.text, end="")

`target` defaults to $INFERSCALE_TARGET (else localhost:9000) and `token` (a JWT; `inferscale token USER`
prints one for a local server) to $INFERSCALE_TOKEN; the token is sent on every call as the metadata
`authorization: Bearer <token>`. Against Ray Serve, `application` selects the Serve application (metadata
"application"); it is only needed when several applications run. For a server behind TLS pass
`credentials=grpc.ssl_channel_credentials(...)`. Errors arrive as grpc.RpcError (grpc.aio.AioRpcError) with the
server's status code and a message naming the field at fault.

Retries: unless `retry=False`, the channel carries a gRPC service config (retry_service_config) that retries a
call answered UNAVAILABLE (a replica restarting, the server not up yet) or RESOURCE_EXHAUSTED (the server shedding
load) with exponential backoff, within the call's deadline. The server decides with gRPC's retry pushback
trailer: an error with google.rpc RetryInfo (overload) is retried after its delay, and every other UNAVAILABLE or
RESOURCE_EXHAUSTED (a per-user quota, a size limit: QuotaFailure / BadRequest) carries
`grpc-retry-pushback-ms: -1` and is never retried. An add is sent with an idempotency key (a new UUID per
add_facts call unless the caller passes its own), which every retry of the call repeats: a retry after an answer
that was lost, or an UNAVAILABLE WRITE_UNCONFIRMED whose write was applied after all, gets the facts the first try
stored instead of storing them twice. A caller that retries an add itself passes the same `idempotency_key`. The details themselves (ErrorInfo, BadRequest, QuotaFailure,
RetryInfo) decode with grpcio-status: `grpc_status.rpc_status.from_call(err)`. Every call has a deadline
(`timeout_s`), which the server honours end to end (it stops its backend calls when the deadline passes).
"""
from __future__ import annotations

import builtins
import json
import math
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc

from . import DEFAULT_TARGET, TARGET_ENV, TOKEN_ENV
from .codegen import load

pb2, pb2_grpc = load()
SERVICE = "inferscale.v1.Memory"
RETRYABLE_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")


def retry_service_config(max_attempts: int = 4, initial_backoff_s: float = 0.25, max_backoff_s: float = 4.0) -> str:
    """The gRPC service config (JSON) that retries every Memory method on UNAVAILABLE and RESOURCE_EXHAUSTED.
    gRPC waits a random time up to initial_backoff_s * 2**(attempt-1) (at most max_backoff_s) between attempts,
    and never retries once a response message of a stream has arrived (a half-streamed answer is not repeated)."""
    return json.dumps({"methodConfig": [{
        "name": [{"service": SERVICE}],
        "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": f"{initial_backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s", "backoffMultiplier": 2,
                        "retryableStatusCodes": list(RETRYABLE_CODES)}}]})


def channel_options(retry: bool) -> list[tuple[str, object]]:
    if not retry:
        return [("grpc.enable_retries", 0)]
    return [("grpc.enable_retries", 1), ("grpc.service_config", retry_service_config())]


def call_metadata(token: str | None, application: str | None) -> tuple[tuple[str, str], ...]:
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    return ((("application", application),) if application else ()) + (
        (("authorization", f"Bearer {token}"),) if token else ())


def default_target(target: str | None) -> str:
    return target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET


# ---- requests, built once for both clients
def messages_pb(messages: Sequence[Mapping[str, str]] | None) -> list:
    out = []
    for i, m in enumerate(messages or ()):
        if isinstance(m, pb2.Message):
            out.append(m)
            continue
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r}")
        out.append(pb2.Message(role=m["role"], content=m["content"]))
    return out


def expiry_field(expires_at: float | None) -> dict:
    """The proto's optional expires_at: {} for None (unset), 0 for math.inf (never expires), else the Unix time."""
    if expires_at is None:
        return {}
    return {"expires_at": 0.0 if expires_at == math.inf else expires_at}


def add_facts_request(user_id: str, texts: Sequence[str], metadata: Mapping[str, str] | None,
                      windows: Sequence[Sequence[str]] | None, idempotency_key: str | None = None,
                      expires_at: float | None = None):
    """`idempotency_key` None: a new one (a UUID), which the channel's retries of this request repeat."""
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string")
    windows = windows or [[] for _ in texts]
    facts = [pb2.FactInput(text=t, metadata=dict(metadata or {}), window=list(w), **expiry_field(expires_at))
             for t, w in zip(texts, windows)]
    return pb2.AddFactsRequest(user_id=user_id, facts=facts,
                               idempotency_key=uuid.uuid4().hex if idempotency_key is None else idempotency_key)


def add_memory_request(user_id: str, messages: Sequence[Mapping[str, str]], infer: bool,
                       metadata: Mapping[str, str] | None, expires_at: float | None = None):
    return pb2.AddMemoryRequest(user_id=user_id, infer=infer, metadata=dict(metadata or {}),
                                messages=messages_pb(messages), **expiry_field(expires_at))


def search_request(user_id: str, query: str, k: int, filters: Mapping | None, threshold: float | None):
    """`filters`: Mem0's filter language (docs/mem0.md) as a dict; `threshold`: only hits scoring at least it."""
    req = pb2.SearchRequest(user_id=user_id, query=query, k=k, filters=json.dumps(filters) if filters else "")
    if threshold is not None:
        req.threshold = threshold
    return req


def update_request(user_id: str, fact_id: str, text: str | None, metadata: Mapping[str, str] | None,
                   expected_version: int, replace_metadata: bool, expires_at: float | None = None):
    req = pb2.UpdateMemoryRequest(user_id=user_id, fact_id=fact_id, metadata=dict(metadata or {}),
                                  expected_version=expected_version, replace_metadata=replace_metadata,
                                  **expiry_field(expires_at))
    if text is not None:
        req.text = text
    return req


def answer_request(user_id: str, query: str, k: int, max_tokens: int, temperature: float, mode: str,
                   messages: Sequence[Mapping[str, str]] | None):
    return pb2.AnswerRequest(user_id=user_id, query=query, k=k, max_tokens=max_tokens, temperature=temperature,
                             mode=mode, messages=messages_pb(messages))


class MemoryClient:
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, target: str | None = None, application: str | None = None, timeout_s: float = 60.0,
                 channel: grpc.Channel | None = None, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: bool = True):
        if channel is None:
            target, options = default_target(target), channel_options(retry)
            channel = (grpc.secure_channel(target, credentials, options) if credentials
                       else grpc.insecure_channel(target, options))
        self.channel = channel
        self.stub = pb2_grpc.MemoryStub(self.channel)
        self.metadata = call_metadata(token, application)
        self.timeout_s = timeout_s

    def _kw(self) -> dict:
        return {"metadata": self.metadata, "timeout": self.timeout_s}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "MemoryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writes
    def add_facts(self, user_id: str, texts: Sequence[str], metadata: Mapping[str, str] | None = None,
                  windows: Sequence[Sequence[str]] | None = None, idempotency_key: str | None = None,
                  expires_at: float | None = None) -> list:
        """`idempotency_key`: the add's (None: a new UUID; "": none); pass the same one to repeat this add.
        `expires_at`: the Unix time from which these facts are no longer served (None: never)."""
        req = add_facts_request(user_id, texts, metadata, windows, idempotency_key, expires_at)
        return list(self.stub.AddFacts(req, **self._kw()).facts)

    def add_memory(self, user_id: str, messages: Sequence[Mapping[str, str]], infer: bool = True,
                   metadata: Mapping[str, str] | None = None, expires_at: float | None = None) -> list:
        req = add_memory_request(user_id, messages, infer, metadata, expires_at)
        return list(self.stub.AddMemory(req, **self._kw()).results)

    def update(self, user_id: str, fact_id: str, text: str | None = None, metadata: Mapping[str, str] | None = None,
               expected_version: int = 0, replace_metadata: bool = False, expires_at: float | None = None):
        """A new text, metadata (merged, or replacing it with replace_metadata) and/or expiry (a Unix time;
        math.inf: never expires; None: as it is); expected_version 0: any."""
        req = update_request(user_id, fact_id, text, metadata, expected_version, replace_metadata, expires_at)
        return self.stub.UpdateMemory(req, **self._kw())

    def delete(self, user_id: str, fact_id: str) -> None:
        self.stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    def delete_user(self, user_id: str) -> int:
        return self.stub.DeleteUser(pb2.DeleteUserRequest(user_id=user_id), **self._kw()).deleted

    # ---- reads
    def get(self, user_id: str, fact_id: str):
        return self.stub.GetMemory(pb2.GetMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    def list(self, user_id: str, page_size: int = 0, filters: Mapping | None = None,
             show_expired: bool = False) -> Iterator:
        """Every fact of the user (that `filters` keeps: docs/mem0.md), page by page; expired facts only with
        show_expired."""
        token, flt = "", json.dumps(filters) if filters else ""
        while True:
            page = self.stub.ListMemories(pb2.ListMemoriesRequest(user_id=user_id, page_size=page_size,
                                                                  page_token=token, filters=flt,
                                                                  show_expired=show_expired), **self._kw())
            yield from page.facts
            if not page.next_page_token:
                return
            token = page.next_page_token

    def search(self, user_id: str, query: str, k: int = 0, filters: Mapping | None = None,
               threshold: float | None = None) -> builtins.list:
        return list(self.stub.Search(search_request(user_id, query, k, filters, threshold), **self._kw()).hits)

    def answer(self, user_id: str, query: str, k: int = 0, max_tokens: int = 0, temperature: float = 0.0,
               mode: str = "", messages: Sequence[Mapping[str, str]] | None = None) -> Iterator:
        """Yields AnswerChunk messages; the last has final=True with ttft_ms and fact_ids. `messages`: the
        conversation before the query ({"role", "content"} each, oldest first), placed after the memory."""
        req = answer_request(user_id, query, k, max_tokens, temperature, mode, messages)
        call = self.stub.Answer(req, **self._kw())
        try:
            yield from call
        finally:  # a caller that stops reading (break, close) ends the answer at once, not when the call is collected
            call.cancel()  # once the stream has ended: nothing to cancel, no effect

    def health(self):
        return self.stub.Health(pb2.HealthRequest(), **self._kw())


class AsyncMemoryClient:
    """The same calls as MemoryClient for asyncio (grpc.aio); create and use it inside one event loop."""

    def __init__(self, target: str | None = None, application: str | None = None, timeout_s: float = 60.0,
                 channel: grpc.aio.Channel | None = None, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, retry: bool = True):
        if channel is None:
            target, options = default_target(target), channel_options(retry)
            channel = (grpc.aio.secure_channel(target, credentials, options) if credentials
                       else grpc.aio.insecure_channel(target, options))
        self.channel = channel
        self.stub = pb2_grpc.MemoryStub(self.channel)
        self.metadata = call_metadata(token, application)
        self.timeout_s = timeout_s

    def _kw(self) -> dict:
        return {"metadata": self.metadata, "timeout": self.timeout_s}

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncMemoryClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def add_facts(self, user_id: str, texts: Sequence[str], metadata: Mapping[str, str] | None = None,
                        windows: Sequence[Sequence[str]] | None = None, idempotency_key: str | None = None,
                        expires_at: float | None = None) -> list:
        req = add_facts_request(user_id, texts, metadata, windows, idempotency_key, expires_at)
        return list((await self.stub.AddFacts(req, **self._kw())).facts)

    async def add_memory(self, user_id: str, messages: Sequence[Mapping[str, str]], infer: bool = True,
                         metadata: Mapping[str, str] | None = None, expires_at: float | None = None) -> list:
        req = add_memory_request(user_id, messages, infer, metadata, expires_at)
        return list((await self.stub.AddMemory(req, **self._kw())).results)

    async def update(self, user_id: str, fact_id: str, text: str | None = None,
                     metadata: Mapping[str, str] | None = None, expected_version: int = 0,
                     replace_metadata: bool = False, expires_at: float | None = None):
        req = update_request(user_id, fact_id, text, metadata, expected_version, replace_metadata, expires_at)
        return await self.stub.UpdateMemory(req, **self._kw())

    async def delete(self, user_id: str, fact_id: str) -> None:
        await self.stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    async def delete_user(self, user_id: str) -> int:
        return (await self.stub.DeleteUser(pb2.DeleteUserRequest(user_id=user_id), **self._kw())).deleted

    async def get(self, user_id: str, fact_id: str):
        return await self.stub.GetMemory(pb2.GetMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    async def list(self, user_id: str, page_size: int = 0, filters: Mapping | None = None,
                   show_expired: bool = False) -> AsyncIterator:
        token, flt = "", json.dumps(filters) if filters else ""
        while True:
            page = await self.stub.ListMemories(pb2.ListMemoriesRequest(user_id=user_id, page_size=page_size,
                                                                        page_token=token, filters=flt,
                                                                        show_expired=show_expired), **self._kw())
            for fact in page.facts:
                yield fact
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def search(self, user_id: str, query: str, k: int = 0, filters: Mapping | None = None,
                     threshold: float | None = None) -> builtins.list:
        return list((await self.stub.Search(search_request(user_id, query, k, filters, threshold),
                                            **self._kw())).hits)

    async def answer(self, user_id: str, query: str, k: int = 0, max_tokens: int = 0, temperature: float = 0.0,
                     mode: str = "", messages: Sequence[Mapping[str, str]] | None = None) -> AsyncIterator:
        req = answer_request(user_id, query, k, max_tokens, temperature, mode, messages)
        call = self.stub.Answer(req, **self._kw())
        try:
            async for chunk in call:
                yield chunk
        finally:  # as MemoryClient.answer: a caller that stops reading (aclose) ends the answer at once
            call.cancel()

    async def health(self):
        return await self.stub.Health(pb2.HealthRequest(), **self._kw())
