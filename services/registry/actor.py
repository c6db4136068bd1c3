"""ActorRegistry: an EmbeddedRegistry in a named Ray actor, so the replicas of a Serve app without Redis share
one registry (its data lives as long as the Ray cluster)."""
from __future__ import annotations

from inferscale_core.errors import check_id

from .base import Registry
from .embedded import EmbeddedRegistry

ACTOR_SCHEME = "ray-actor://"
ACTOR_NAMESPACE = "inferscale"


class _RegistryActor:
    """The actor behind ActorRegistry: one EmbeddedRegistry; Ray runs its calls one at a time."""

    def __init__(self):
        self.registry = EmbeddedRegistry()

    def call(self, method: str, args: tuple, kwargs: dict):
        return getattr(self.registry, method)(*args, **kwargs)


class ActorRegistry(Registry):
    """An EmbeddedRegistry inside a named, detached Ray actor (created by the first process that opens it):
    every replica of a Serve application without Redis sees the same facts. In memory only: the data
    lives as long as the Ray cluster."""

    def __init__(self, name: str, namespace: str = ACTOR_NAMESPACE):
        import ray

        check_id("registry actor name", name)
        self.name = name
        self.actor = ray.remote(_RegistryActor).options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0).remote()

    def _call(self, method: str, *args, **kwargs):
        import ray

        try:
            # Ray types an actor's methods as the plain functions unless @ray.method (ray is imported lazily here)
            return ray.get(self.actor.call.remote(method, args, kwargs))  # type: ignore[attr-defined]
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None  # the registry's own error (UnknownFactError, ...), not Ray's wrapper
            raise

    def create(self, user_id, facts, quota=None, idempotent=None):
        return self._call("create", user_id, facts, quota, idempotent)

    def idempotent_add(self, user_id, key, now=None, answering=None):
        return self._call("idempotent_add", user_id, key, now, answering)

    def release_idempotency_key(self, user_id, key):
        return self._call("release_idempotency_key", user_id, key)

    def get(self, user_id, fact_id):
        return self._call("get", user_id, fact_id)

    def get_many(self, user_id, fact_ids):
        return self._call("get_many", user_id, fact_ids)

    def find_many(self, user_id, fact_ids):
        return self._call("find_many", user_id, fact_ids)

    def list(self, user_id, offset=0, limit=None):
        return self._call("list", user_id, offset, limit)

    def list_after(self, user_id, after, limit):
        return self._call("list_after", user_id, after, limit)

    def count(self, user_id):
        return self._call("count", user_id)

    def seq_of(self, user_id, fact_id):
        return self._call("seq_of", user_id, fact_id)

    def latest(self, user_id, n):
        return self._call("latest", user_id, n)

    def fact_versions(self, user_id):
        return self._call("fact_versions", user_id)

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0, quota=None, window=None, kv_bytes=None, expires_at=None):
        return self._call("update", user_id, fact_id, text=text, metadata=metadata,
                          replace_metadata=replace_metadata, embedding=embedding, expected_version=expected_version,
                          quota=quota, window=window, kv_bytes=kv_bytes, expires_at=expires_at)

    def set_embedding(self, user_id, fact_id, version, embedding):
        return self._call("set_embedding", user_id, fact_id, version, embedding)

    def set_unservable(self, user_id, fact_id, version, reason):
        return self._call("set_unservable", user_id, fact_id, version, reason)

    def user_bytes(self, user_id):
        return self._call("user_bytes", user_id)

    def history(self, user_id, fact_id):
        return self._call("history", user_id, fact_id)

    def expired_facts(self, user_id, now):
        return self._call("expired_facts", user_id, now)

    def owners_of(self, fact_id):
        return self._call("owners_of", fact_id)

    def user_kv_bytes(self, user_id):
        return self._call("user_kv_bytes", user_id)

    def kv_tier_admit(self, user_id, items, cap):
        return self._call("kv_tier_admit", user_id, items, cap)

    def kv_tier_touch(self, user_id, fact_ids):
        return self._call("kv_tier_touch", user_id, fact_ids)

    def kv_tier_bytes(self, user_id):
        return self._call("kv_tier_bytes", user_id)

    def tombstones_after(self, cursor, limit=1000):
        return self._call("tombstones_after", cursor, limit)

    def tombstones_missed(self, cursor):
        return self._call("tombstones_missed", cursor)

    def delete(self, user_id, fact_id):
        return self._call("delete", user_id, fact_id)

    def delete_user(self, user_id):
        return self._call("delete_user", user_id)

    def user_version(self, user_id):
        return self._call("user_version", user_id)

    def user_versions(self, user_ids):
        return self._call("user_versions", user_ids)

    def add_placement(self, user_id, replica_id):
        return self._call("add_placement", user_id, replica_id)

    def remove_placement(self, user_id, replica_id):
        return self._call("remove_placement", user_id, replica_id)

    def placement(self, user_id):
        return self._call("placement", user_id)

    def placements(self):
        return self._call("placements")

    def ping(self):
        return self._call("ping")

