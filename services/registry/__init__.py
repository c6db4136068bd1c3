"""The fact registry: the source of truth for every fact's text, embedding, metadata, version, owner and
servability, plus the placement map (which engine replica holds which user's KV store).

Three backends behind one interface (base.Registry), one module each:
  redis_backend.RedisRegistry   a deployment; every replica of every deployment sees the same data, and it
                                survives process restarts
  embedded.EmbeddedRegistry     in-process, for a single-process run without a Redis URL
  actor.ActorRegistry           an EmbeddedRegistry in a named Ray actor, shared by the replicas of a Serve
                                app without Redis; its data lives as long as the Ray cluster
`open_registry(url)` picks one.

KV tensors are never stored here: they are derived data (re-encodable from the text) and live in the
engine replicas' stores. Every change to a user's facts bumps that user's version counter, so a replica
that cached the user's index or KV can tell with one read that it is stale. Quotas (facts and bytes per
user) are checked in the same atomic step as the write.
"""
from __future__ import annotations

from .actor import ACTOR_NAMESPACE, ACTOR_SCHEME, ActorRegistry
from .base import (
    FACT_STORED_BYTES,
    IDEMPOTENCY_TTL_S,
    MAX_IDEMPOTENCY_KEY_CHARS,
    DuplicateFactError,
    FactRecord,
    IdempotentAdd,
    IdempotentRepeatError,
    NewFact,
    Quota,
    QuotaExceededError,
    Registry,
    Tombstone,
    UnconfirmedWriteError,
    VersionConflictError,
    check_idempotency_key,
    fact_bytes,
)
from .embedded import EmbeddedRegistry
from .redis_backend import PASSWORD_ENV, RedisRegistry, RegistryTlsError, redacted, tls_failure

__all__ = ["ACTOR_NAMESPACE", "ACTOR_SCHEME", "ActorRegistry", "DuplicateFactError", "EmbeddedRegistry",
           "FactRecord", "IDEMPOTENCY_TTL_S", "IdempotentAdd", "IdempotentRepeatError", "MAX_IDEMPOTENCY_KEY_CHARS",
           "NewFact", "PASSWORD_ENV", "Quota", "QuotaExceededError", "RedisRegistry", "Registry", "RegistryTlsError",
           "Tombstone", "UnconfirmedWriteError", "VersionConflictError", "FACT_STORED_BYTES",
           "check_idempotency_key", "fact_bytes", "open_registry", "redacted", "tls_failure"]


def open_registry(url: str | None, prefix: str = "inferscale:", index_owners: bool = False) -> Registry:
    """RedisRegistry for a redis:// (or rediss://, unix://) URL, ActorRegistry for ray-actor://NAME (inside
    a Ray cluster), EmbeddedRegistry for None or "". `index_owners`: RedisRegistry's (the in-process registries
    always know a fact id's owner)."""
    if not url:
        return EmbeddedRegistry()
    if url.startswith(ACTOR_SCHEME):
        return ActorRegistry(url[len(ACTOR_SCHEME):])
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"registry URL {redacted(url)!r} is not a redis://, rediss://, unix:// or "
                         f"{ACTOR_SCHEME} URL")
    return RedisRegistry(url, prefix=prefix, index_owners=index_owners)
