"""Bringing a replica's copy of one user's facts up to the registry's state: the sync that the retrieval replica
(its vector index) and the engine replica (its facts' texts, versions and KV) share.

The registry keeps a version counter per user that every write bumps. When the counter is still the one the
replica last synced, nothing moved: one read. Otherwise one listing of (fact, version) and one read of the
records that changed. The listing is read after the counter, so a change landing in between bumps the counter
again and the next sync sees it: a replica can be ahead of the counter it records, never silently behind."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from .registry.base import FactRecord, Registry


@dataclass(frozen=True)
class UserChanges:
    version: int               # the registry's counter the replica is brought up to
    gone: list[str]            # held facts deleted, or at another version now: drop them
    fresh: list[FactRecord]    # facts new or at a new version: take them (one deleted since the listing is absent)


def moved_facts(held: Mapping[str, int], wanted: Mapping[str, int]) -> list[str]:
    """Of the facts held (fact_id -> version), those the registry (`wanted`) no longer has at that version."""
    return [f for f, v in held.items() if wanted.get(f) != v]


def user_changes(registry: Registry, user_id: str, synced_version: int | None,
                 held: Mapping[str, int]) -> UserChanges | None:
    """What changed for the user since `synced_version`, given the facts held (fact_id -> version); None when
    the registry's counter is still `synced_version`. Blocking (registry calls): run it off the event loop."""
    version = registry.user_version(user_id)
    if synced_version == version:
        return None
    wanted = registry.fact_versions(user_id)
    changed = [f for f, v in wanted.items() if held.get(f) != v]
    found = registry.find_many(user_id, changed) if changed else {}  # one round trip
    return UserChanges(version, moved_facts(held, wanted), [found[f] for f in changed if f in found])


T = TypeVar("T")


class UserBook(Generic[T]):
    """One replica's copy of its users' facts: per user, what it holds of each fact (`T`: the retrieval replica
    keeps the version it indexed, the engine replica a HeldFact with the text and window) and the registry's
    version counter it last synced to. The one record both replicas keep; `changes` is their sync."""

    def __init__(self, version_of: Callable[[T], int]):
        self._version_of = version_of
        self.facts: dict[str, dict[str, T]] = {}  # user -> fact_id -> what this replica holds of it
        self.synced: dict[str, int] = {}          # user -> the registry's user version last synced to

    def of(self, user_id: str) -> dict[str, T]:
        """The user's facts (an empty record made for a user not held yet)."""
        return self.facts.setdefault(user_id, {})

    def versions(self, user_id: str) -> dict[str, int]:
        return {f: self._version_of(h) for f, h in self.facts.get(user_id, {}).items()}

    def changes(self, registry: Registry, user_id: str) -> UserChanges | None:
        """`user_changes` since this book's last sync of the user. Blocking (registry calls)."""
        return user_changes(registry, user_id, self.synced.get(user_id), self.versions(user_id))

    def forget(self, user_id: str) -> None:
        self.facts.pop(user_id, None)
        self.synced.pop(user_id, None)

    def users(self) -> list[str]:
        return list(self.synced)
