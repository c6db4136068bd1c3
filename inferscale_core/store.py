"""Tiered store of encoded facts, keyed by (user_id, fact_id).

Tiers, fastest first:
  device  tensors on the store's device (GPU memory, or plain memory when the device is "cpu"),
  host    CPU memory, pinned when the device is CUDA so promotion is an async copy (by default only when the
          device is not the CPU: a CPU store would otherwise hold the same bytes twice),
  disk    one safetensors file per fact under `disk_dir`, written on every put (write-through), so a fact
          survives a restart and a fact demoted out of memory costs nothing more to drop; or, for a put with
          `write_file=False`, written later by `write_back` (write-behind: the connector worker's loads, whose
          facts the cluster tier holds anyway, never wait for a file or its fsync). Optionally under a
          byte budget (`disk_budget_bytes`, bytes of the files): a write that would exceed it first deletes files,
          by the rule every tier shares (below). A fact whose file is deleted stays
          while a memory tier holds it (until it is demoted out of memory); one in no memory tier is forgotten,
          so a later get is a clean miss (UnknownFactError), as for a fact never stored: the disk is a cache,
          the facts' source of truth is elsewhere (the cluster tier, or the registry's text to re-encode).

Each memory tier has an optional byte budget (KV bytes, 2·L·c·h·d·b). A fact goes to the fastest tier whose
budget can hold it; room is made BEFORE anything is allocated there by moving facts down one tier, so the device
tier never holds more than its budget, not even for a moment. `get` brings a fact back to the device tier; a fact
larger than the whole device budget is served as a temporary device copy and stays where it is. If the device
itself runs out of memory while a fact is stored, the fact goes to the host tier instead (an accelerator shared
with other allocations can be fuller than any budget knows).

Which fact leaves a full tier, in every tier (fair_lru.FairLRU; issue 31): the least recently used fact (put and get
count as uses) of the user holding the most bytes in that tier, the incoming fact counted as its user's. Each tier
is shared by the users holding something in it like the engine replica's resident KV: a tenant touching ever new
facts recycles its own and never flushes the others' KV out of device or host memory or their files off the disk,
while a user alone is plain LRU over the whole budget. The shared prefix chunk (SHARED_USER_ID's, read by every
request) leaves a tier only when no user's fact is left there.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from .errors import UnknownFactError, UnknownUserError, check_id
from .fair_lru import FairLRU
from .model_spec import ModelSpec
from .types import SHARED_USER_ID, EncodedFact

FILE_FORMAT = "inferscale-fact-v1"
FACT_SUFFIX = ".safetensors"
QUARANTINE_DIR = ".quarantine"  # unreadable fact files found at open, moved aside (a dot: never a user folder)
log = logging.getLogger("inferscale.store")
# safetensors header dtype names -> torch dtypes (only what a KV cache is stored in).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation failure: torch's OutOfMemoryError (CUDA and other accelerators), or the CPU allocator's
    RuntimeError, which has no type of its own."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


DISK_BUDGET_FRACTION = 0.25  # of the disk's free space (plus what the store's files already take), by default


def default_disk_budget_bytes(disk_dir: str | Path, fraction: float = DISK_BUDGET_FRACTION) -> int:
    """A disk tier's byte budget derived from the machine: `fraction` of the space its file system has free
    plus what files already in `disk_dir` take (a restarted store keeps the budget it started with). A quarter,
    as a replica's memory budget is a quarter of memory: the disk is shared with the model, logs, other
    replicas on the node (each takes its quarter of what is free when it starts)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    folder = Path(disk_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    held = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return int((shutil.disk_usage(folder).free + held) * fraction)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor made by one thread (numpy's memcpy). torch splits a copy of a fact's size
    over its intra-op threads, and a split can wait for a time slice: beside a running vLLM engine (another
    process, its threads pinned to both cores) a 288 KB bf16 copy took ~7 ms with torch's 2 threads, 0.01 ms
    with one (BENCHMARKS.md, "A fact put into the engine core's store"). Idle, both take ~0.05 ms."""
    src = t.detach().contiguous()
    flat = src.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(flat.copy()).view(t.dtype).reshape(t.shape)


def _hash_name(text: str) -> str:
    """File-system-safe, fixed-length name for an id (ids may hold any printable character)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass
class _Entry:
    user_id: str
    fact_id: str
    nbytes: int
    tier: str  # "device" | "host" | "disk"
    fact: EncodedFact | None  # the in-memory copy (on the device or on the host); None when disk-only
    on_disk: bool
    file_bytes: int = 0  # the size of its file (0 without one)
    version: int = 0  # counts puts of this fact: a write_back whose copy was replaced meanwhile is dropped


class FactStore:
    """Thread-safe map (user_id, fact_id) -> EncodedFact with device / host / disk tiers, each evicting from the
    user holding the most bytes there, least recently used first.

    Shape and dtype: `num_layers`, `num_kv_heads`, `head_dim` and `dtype` left as None are taken from the
    first fact stored (or loaded from disk), after which every fact must match them. Facts returned by
    `get` share memory with the store: treat them as read-only.
    """

    def __init__(self, device: str | torch.device = "cpu", disk_dir: str | Path | None = None,
                 num_layers: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                 dtype: torch.dtype | None = None, max_fact_tokens: int = 1024,
                 device_budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 host_tier: bool | None = None, disk_budget_bytes: int | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"FactStore device {self.device} requested but CUDA is not available")
        if max_fact_tokens < 1:
            raise ValueError(f"max_fact_tokens must be >= 1, got {max_fact_tokens}")
        for name, budget in (("device_budget_bytes", device_budget_bytes), ("host_budget_bytes", host_budget_bytes),
                             ("disk_budget_bytes", disk_budget_bytes)):
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {budget!r}")
        if disk_budget_bytes is not None and disk_dir is None:
            raise ValueError("disk_budget_bytes needs disk_dir: it bounds the files of the disk tier")
        # host_tier=None: a host tier only when the device is not the CPU. True on a CPU device runs the same
        # device -> host spill logic an accelerator uses (how it is tested on machines without one).
        self.use_host_tier = self.device.type != "cpu" if host_tier is None else bool(host_tier)
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._memory_tiers = ("device", "host") if self.use_host_tier else ("device",)
        self._budgets = {"device": device_budget_bytes, "host": host_budget_bytes if self.use_host_tier else None}
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        # The lowest memory tier can only shed facts onto disk; without disk a budget there would drop data.
        lowest = self._memory_tiers[-1]
        if self.disk_dir is None and self._budgets[lowest] is not None:
            raise ValueError(f"{lowest}_budget_bytes needs disk_dir: facts over the {lowest} budget "
                             "are evicted to disk, and without a disk tier they would be lost")
        self.max_fact_tokens = max_fact_tokens
        # None: taken from the first fact (a Mapping: never edited, replaced whole once known)
        self._shape: Mapping[str, int | None] = {"num_layers": num_layers, "num_kv_heads": num_kv_heads,
                                                 "head_dim": head_dim}
        self.dtype = dtype
        self._lock = threading.RLock()
        self._users: dict[str, dict[str, _Entry]] = {}
        # Per tier, the facts it holds per user, least recently used first, and their bytes: KV bytes in a memory
        # tier, file bytes on the disk (what the disk budget bounds). A full tier takes from the user holding the
        # most there (_make_room, _collect).
        self._lru: dict[str, FairLRU[str, _Entry]] = {t: FairLRU(last=SHARED_USER_ID) for t in self._memory_tiers}
        self._disk_lru: FairLRU[str, _Entry] = FairLRU(last=SHARED_USER_ID)
        self._disk_bytes = 0  # KV bytes of the facts with a file
        self.disk_budget_bytes = disk_budget_bytes
        self._collected = 0  # files deleted to stay within the disk budget
        self._quarantined = 0  # unreadable files moved to QUARANTINE_DIR at open
        self._hits = {"device": 0, "host": 0, "disk": 0}
        self._promotions = 0
        self._demotions = 0
        self._oom_spills = 0  # facts stored on the host because the device ran out of memory
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()
            self._collect(0)  # a smaller budget than the files already there: the oldest leave now

    # ----------------------------------------------------------------- construction helpers

    @classmethod
    def for_spec(cls, spec: ModelSpec, **kw) -> "FactStore":
        """A store whose facts must have `spec`'s shape; dtype defaults to the model's dtype."""
        kw.setdefault("dtype", spec.dtype)
        return cls(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, **kw)

    @classmethod
    def open(cls, disk_dir: str | Path, **kw) -> "FactStore":
        """Reopen an existing on-disk store: every fact is listed at once and loaded on first `get`."""
        if not Path(disk_dir).is_dir():
            raise FileNotFoundError(f"no fact store at {disk_dir}: the folder does not exist")
        return cls(disk_dir=disk_dir, **kw)

    # ----------------------------------------------------------------- public API

    def put(self, user_id: str, fact_id: str, fact: EncodedFact, write_file: bool = True) -> None:
        """Insert or replace a fact. Raises ValueError naming the problem for a fact that does not fit.

        `write_file=False` (a store with a disk tier): the fact is kept in a memory tier only, and `write_back`
        writes its file later, off the caller's path and outside the store's lock (the connector worker's loader:
        its facts come from the cluster tier, the file is only a node-local copy, and a file written and fsynced
        per fact under the lock held every step's gather behind it). Until then the fact is like one whose file
        the disk budget collected: demoted out of memory, it is gone. A fact no memory tier can hold has its file
        written now."""
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            self._check_fact(fact, source=f"fact {fact_id!r}")
            in_memory = any(self._fits(t, fact.nbytes) for t in self._memory_tiers)
            later = not write_file and in_memory
            data = self._file_data(user_id, fact_id, fact) if self.disk_dir is not None and not later else None
            if data is not None and not self._disk_fits(len(data)) and not in_memory:
                raise ValueError(f"fact {fact_id!r}: its file of {len(data)} bytes is over the disk budget "
                                 f"({self.disk_budget_bytes} bytes) and its {fact.nbytes} KV bytes fit no memory tier")
            entry = self._users.get(user_id, {}).get(fact_id)
            if entry is not None:  # its memory copy is outdated either way; frees its bytes before admitting
                self._unplace(entry)
            tier, stored = self._admit(user_id, fact)
            if entry is None:
                entry = _Entry(user_id, fact_id, stored.nbytes, "disk", None, False)
                self._users.setdefault(user_id, {})[fact_id] = entry  # replaced in place: keeps its position
            elif entry.on_disk:  # the old file is outdated: its bytes are free for the new one
                self._drop_file(entry, forget=False, collected=False)
            entry.nbytes = stored.nbytes
            entry.version += 1  # a write_back of the older copy must not land over this one
            if tier is not None:
                self._place(entry, tier, stored)
            if data is not None and self._disk_fits(len(data)):
                self._collect(len(data), writer=user_id)  # room first: the largest holder's oldest files leave
                self._write_file(user_id, fact_id, data)
                self._add_file(entry, len(data))

    def write_back(self, user_id: str, fact_id: str) -> bool:
        """Writes the file of a fact `put` with `write_file=False`, if it is still in memory without one; returns
        whether a file was written. The file is serialized and fsynced outside the store's lock, and put in place
        under it only if the fact is still the same copy: a delete or a newer put meanwhile wins (its temporary file
        is removed, nothing of a deleted fact is left)."""
        if self.disk_dir is None:
            return False
        with self._lock:
            entry = self._users.get(user_id, {}).get(fact_id)
            if entry is None or entry.on_disk or entry.fact is None:
                return False
            fact, version = entry.fact, entry.version
        data = self._file_data(user_id, fact_id, fact)
        if not self._disk_fits(len(data)):
            return False
        path = self._path(user_id, fact_id)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.behind")
        self._write_unplaced(tmp, data)
        with self._lock:
            if self._users.get(user_id, {}).get(fact_id) is not entry or entry.version != version or entry.on_disk:
                tmp.unlink(missing_ok=True)
                if user_id not in self._users:  # deleted meanwhile: the folder our write made again goes too
                    shutil.rmtree(path.parent, ignore_errors=True)
                return False
            self._collect(len(data), writer=user_id)  # files only: this fact has none and stays
            os.replace(tmp, path)
            self._add_file(entry, len(data))
            return True

    def get(self, user_id: str, fact_id: str) -> EncodedFact:
        """The fact on the store's device; promotes it to the device tier and counts a hit for its tier. A fact
        the disk budget collected is a miss like one never stored (UnknownFactError)."""
        with self._lock:
            return self._fetch(self._entry(user_id, fact_id))

    def get_many(self, user_id: str, fact_ids: list[str]) -> list[EncodedFact]:
        """Facts in the order of `fact_ids`; every id is checked before anything is promoted."""
        with self._lock:
            entries = [self._entry(user_id, f) for f in fact_ids]
            return [self._fetch(e) for e in entries]

    def delete(self, user_id: str, fact_id: str) -> None:
        """Remove a fact from every tier, its file included."""
        with self._lock:
            self._forget(self._entry(user_id, fact_id))

    def delete_user(self, user_id: str) -> None:
        """Remove every fact of a user, and the user's folder on disk."""
        check_id("user_id", user_id)
        with self._lock:
            if user_id not in self._users:
                raise UnknownUserError(user_id)
            for entry in list(self._users[user_id].values()):
                self._forget(entry)
            if self.disk_dir is not None:
                shutil.rmtree(self.disk_dir / _hash_name(user_id), ignore_errors=True)

    def users(self) -> list[str]:
        """Users with at least one fact, in first-insertion order."""
        with self._lock:
            return list(self._users)

    def fact_ids(self, user_id: str) -> list[str]:
        """A user's fact ids in insertion order (a replaced fact keeps its place)."""
        check_id("user_id", user_id)
        with self._lock:
            if user_id not in self._users:
                raise UnknownUserError(user_id)
            return list(self._users[user_id])

    def contains(self, user_id: str, fact_id: str) -> bool:
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            return fact_id in self._users.get(user_id, {})

    def __contains__(self, key: tuple[str, str]) -> bool:
        return self.contains(*key)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(facts) for facts in self._users.values())

    def tier_of(self, user_id: str, fact_id: str) -> str:
        """Fastest tier holding the fact: "device", "host" or "disk"."""
        with self._lock:
            return self._entry(user_id, fact_id).tier

    def bytes_used(self, user_id: str | None = None) -> dict[str, int]:
        """KV bytes (2·L·c·h·d·b per fact) resident per tier; "disk" counts every fact with a file."""
        with self._lock:
            if user_id is None:
                return {"device": self._resident("device"), "host": self._resident("host"), "disk": self._disk_bytes}
            check_id("user_id", user_id)
            if user_id not in self._users:
                raise UnknownUserError(user_id)
            used = {"device": 0, "host": 0, "disk": 0}
            for e in self._users[user_id].values():
                if e.tier != "disk":
                    used[e.tier] += e.nbytes
                if e.on_disk:
                    used["disk"] += e.nbytes
            return used

    def stats(self) -> dict:
        """Hits per tier, promotions/demotions, resident bytes, fact counts per tier, budgets."""
        with self._lock:
            counts = {"device": 0, "host": 0, "disk": 0}
            for facts in self._users.values():
                for e in facts.values():
                    counts[e.tier] += 1
            return {
                "hits": dict(self._hits),
                "promotions": self._promotions,
                "demotions": self._demotions,
                "oom_spills": self._oom_spills,
                "bytes": self.bytes_used(),
                "facts_per_tier": counts,
                "num_facts": sum(counts.values()),
                "num_users": len(self._users),
                "budgets": {"device": self._budgets["device"], "host": self._budgets["host"],
                            "disk": self.disk_budget_bytes},
                "disk_file_bytes": self._disk_lru.bytes,
                "disk_collected": self._collected,
                "disk_quarantined": self._quarantined,
            }

    # ----------------------------------------------------------------- tier moves

    def _entry(self, user_id: str, fact_id: str) -> _Entry:
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        facts = self._users.get(user_id)
        if facts is None:
            raise UnknownUserError(user_id)
        entry = facts.get(fact_id)
        if entry is None:
            raise UnknownFactError(user_id, fact_id)
        return entry

    def _resident(self, tier: str) -> int:
        """KV bytes a memory tier holds (0 for the host tier of a store without one)."""
        lru = self._lru.get(tier)
        return lru.bytes if lru is not None else 0

    def _place(self, entry: _Entry, tier: str, fact: EncodedFact) -> None:
        """Make `tier` hold `fact` as the entry's only in-memory copy, most recently used."""
        self._unplace(entry)
        entry.tier, entry.fact = tier, fact
        self._lru[tier].add(entry.user_id, entry.fact_id, entry, entry.nbytes)

    def _unplace(self, entry: _Entry) -> None:
        if entry.tier != "disk":
            self._lru[entry.tier].remove(entry.user_id, entry.fact_id)
        entry.tier, entry.fact = "disk", None

    def _fits(self, tier: str, nbytes: int) -> bool:
        budget = self._budgets[tier]
        return budget is None or nbytes <= budget

    def _make_room(self, tier: str, nbytes: int, user_id: str | None = None) -> None:
        """Demote facts of `tier` until `nbytes` more of `user_id`'s fit in its budget, each time the least recently
        used of the user holding the most bytes there, the new bytes counted as `user_id`'s (on a tie it pays)."""
        budget = self._budgets[tier]
        if budget is None:
            return
        lru = self._lru[tier]
        while lru.bytes + nbytes > budget:
            victim = lru.victim(user_id, nbytes)
            if victim is None:
                return
            self._demote(victim)

    def _demote(self, entry: _Entry) -> None:
        """Move a fact one memory tier down (device -> host), or out of memory when it is in the lowest memory
        tier or larger than the next one's budget (its file exists: write-through)."""
        self._demotions += 1
        i = self._memory_tiers.index(entry.tier)
        lower = self._memory_tiers[i + 1] if i + 1 < len(self._memory_tiers) else None
        if lower is not None and self._fits(lower, entry.nbytes):
            fact = entry.fact
            assert fact is not None  # an entry in a memory tier holds its copy there
            self._unplace(entry)
            self._make_room(lower, entry.nbytes, entry.user_id)
            self._place(entry, lower, self._to_host(fact))
        elif entry.on_disk:
            self._unplace(entry)
        else:  # its file was collected (the disk budget): out of memory it is gone, a clean miss
            self._forget(entry)

    def _admit(self, user_id: str, fact: EncodedFact) -> tuple[str | None, EncodedFact]:
        """A private copy of a new fact in the fastest memory tier that can hold it, room made first; tier
        None (a host copy, for the file only) when no memory tier's budget can hold it."""
        nbytes = fact.nbytes
        for tier in self._memory_tiers:
            if not self._fits(tier, nbytes):
                continue
            self._make_room(tier, nbytes, user_id)
            try:
                return tier, self._copy(fact, tier)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err) or tier != "device" or not self.use_host_tier:
                    raise
                self._oom_spills += 1  # the device is fuller than its budget knows: keep the fact on the host
        if self.disk_dir is None:  # only reachable when every tier refused: the budget checks make it rare
            raise ValueError(f"a fact of {nbytes} bytes fits no memory tier and the store has no disk tier")
        return None, self._copy(fact, "file")

    def _copy(self, fact: EncodedFact, tier: str) -> EncodedFact:
        """A copy that never aliases the caller's tensors (they may be reused or mutated)."""
        device = self.device if tier == "device" else torch.device("cpu")
        if not self._pin and device.type == "cpu" and fact.k_pre.device.type == "cpu" and fact.v.device.type == "cpu":
            return EncodedFact(fact.token_ids.to(torch.int64, copy=True), host_copy(fact.k_pre), host_copy(fact.v))
        out = EncodedFact(token_ids=fact.token_ids.to(device, torch.int64, copy=True),
                          k_pre=fact.k_pre.to(device, copy=True, memory_format=torch.contiguous_format),
                          v=fact.v.to(device, copy=True, memory_format=torch.contiguous_format))
        return self._to_host(out) if tier == "host" else out

    def _fetch(self, entry: _Entry) -> EncodedFact:
        if self._users.get(entry.user_id, {}).get(entry.fact_id) is not entry:  # forgotten since it was looked up
            raise UnknownFactError(entry.user_id, entry.fact_id)  # (get_many: demoted out of memory, no file)
        self._hits[entry.tier] += 1
        if entry.on_disk:
            self._disk_lru.touch(entry.user_id, entry.fact_id)
        if entry.tier == "device":
            self._lru["device"].touch(entry.user_id, entry.fact_id)
            assert entry.fact is not None  # an entry in a memory tier holds its copy there
            return entry.fact
        if not self._fits("device", entry.nbytes):  # larger than the whole device budget: a temporary copy
            return self._device_copy(entry, entry.fact)
        tier, source = entry.tier, entry.fact
        self._unplace(entry)  # leaving its tier first, so making room below never evicts it
        try:
            self._make_room("device", entry.nbytes, entry.user_id)
            fact = self._device_copy(entry, source)
        except BaseException:
            if source is not None:  # back where it was (it may be the only copy), then that tier's budget
                self._place(entry, tier, source)
                self._make_room(tier, 0)
            raise
        self._promotions += 1
        self._place(entry, "device", fact)
        return fact

    def _device_copy(self, entry: _Entry, host_copy: EncodedFact | None) -> EncodedFact:
        """The fact on the device, copied from its host-tier copy, or read from its file when it has none."""
        if host_copy is not None:
            return host_copy.to(self.device, non_blocking=self._pin)
        return self._read_file(entry)

    def _to_host(self, fact: EncodedFact) -> EncodedFact:
        if not self._pin:
            return fact.to("cpu")
        return EncodedFact(*(t.to("cpu").pin_memory() for t in (fact.token_ids, fact.k_pre, fact.v)))

    def _forget(self, entry: _Entry) -> None:
        """Delete a fact everywhere: memory tiers, file, and the user when it was their last fact."""
        self._unplace(entry)
        if entry.on_disk:
            self._drop_file(entry, forget=False, collected=False)
        facts = self._users[entry.user_id]
        del facts[entry.fact_id]
        if not facts:
            del self._users[entry.user_id]
            if self.disk_dir is not None:
                try:
                    (self.disk_dir / _hash_name(entry.user_id)).rmdir()
                except OSError:  # not empty (a stray temp file) or already gone
                    pass

    # ----------------------------------------------------------------- validation

    def _check_fact(self, fact: EncodedFact, source: str) -> None:
        if not isinstance(fact, EncodedFact):
            raise ValueError(f"{source}: expected an EncodedFact, got {type(fact).__name__}")
        for name in ("k_pre", "v"):
            x = getattr(fact, name)
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{source}: EncodedFact.{name} must be a 4-D tensor "
                                 f"[layers, tokens, kv_heads, head_dim], got {shape}")
            if not x.dtype.is_floating_point:
                raise ValueError(f"{source}: EncodedFact.{name} must be a floating-point tensor, got {x.dtype}")
        # Learn unset shape / dtype from the first fact, then hold every later fact to them.
        _, _, h, d = fact.k_pre.shape
        want = {k: v if v is not None else got for (k, v), got in
                zip(self._shape.items(), (fact.k_pre.shape[0], h, d))}
        dtype = self.dtype if self.dtype is not None else fact.k_pre.dtype
        try:
            fact.validate(want["num_layers"], want["num_kv_heads"], want["head_dim"],
                          dtype=dtype, max_tokens=self.max_fact_tokens)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        self._shape, self.dtype = want, dtype

    # ----------------------------------------------------------------- disk tier

    def _path(self, user_id: str, fact_id: str) -> Path:
        assert self.disk_dir is not None  # only a store with a disk tier has fact files
        return self.disk_dir / _hash_name(user_id) / (_hash_name(fact_id) + FACT_SUFFIX)

    @staticmethod
    def _file_data(user_id: str, fact_id: str, fact: EncodedFact) -> bytes:
        """A fact file's bytes (its size is what the disk budget counts)."""
        return safetensors_save(
            {"token_ids": fact.token_ids.detach().cpu().to(torch.int64).contiguous(),
             "k_pre": fact.k_pre.detach().cpu().contiguous(), "v": fact.v.detach().cpu().contiguous()},
            metadata={"format": FILE_FORMAT, "user_id": user_id, "fact_id": fact_id})

    def _disk_fits(self, nbytes: int) -> bool:
        return self.disk_budget_bytes is None or nbytes <= self.disk_budget_bytes

    def _collect(self, nbytes: int, writer: str | None = None) -> None:
        """Deletes files until `nbytes` more (a file `writer` is about to write) fit in the disk budget, by the rule
        of the memory tiers: the least recently used file of the user whose files take the most bytes, the new file
        counted as the writer's (on a tie the writer pays)."""
        if self.disk_budget_bytes is None:
            return
        while self._disk_lru.bytes + nbytes > self.disk_budget_bytes:
            victim = self._disk_lru.victim(writer, nbytes)
            if victim is None:
                return
            self._drop_file(victim, forget=True, collected=True)

    def _add_file(self, entry: _Entry, file_bytes: int) -> None:
        entry.on_disk, entry.file_bytes = True, file_bytes
        self._disk_bytes += entry.nbytes
        self._disk_lru.add(entry.user_id, entry.fact_id, entry, file_bytes)

    def _drop_file(self, entry: _Entry, forget: bool, collected: bool) -> None:
        """Deletes a fact's file; with `forget`, a fact no memory tier holds leaves the store too."""
        self._path(entry.user_id, entry.fact_id).unlink(missing_ok=True)
        self._disk_lru.remove(entry.user_id, entry.fact_id)
        self._disk_bytes -= entry.nbytes
        entry.on_disk, entry.file_bytes = False, 0
        self._collected += collected
        if forget and entry.tier == "disk":
            self._forget(entry)

    def _write_file(self, user_id: str, fact_id: str, data: bytes) -> None:
        """Atomic, durable write: temp file, fsync, rename over the old file."""
        path = self._path(user_id, fact_id)
        tmp = path.with_name(path.name + ".tmp")
        self._write_unplaced(tmp, data)
        os.replace(tmp, path)

    @staticmethod
    def _write_unplaced(tmp: Path, data: bytes) -> None:
        """A temporary file's bytes, durable (fsync) before it is renamed into place."""
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _read_file(self, entry: _Entry) -> EncodedFact:
        path = self._path(entry.user_id, entry.fact_id)
        if not path.is_file():
            raise FileNotFoundError(f"fact {entry.fact_id!r} of user {entry.user_id!r}: file {path} is missing")
        with safe_open(str(path), framework="pt", device=str(self.device)) as f:
            meta = f.metadata() or {}
            if (meta.get("user_id"), meta.get("fact_id")) != (entry.user_id, entry.fact_id):
                raise ValueError(f"{path} holds fact {meta.get('fact_id')!r} of user {meta.get('user_id')!r}, "
                                 f"expected fact {entry.fact_id!r} of user {entry.user_id!r}")
            return EncodedFact(f.get_tensor("token_ids"), f.get_tensor("k_pre"), f.get_tensor("v"))

    def _scan_disk(self) -> None:
        """List every fact file (headers only; tensors load on first get). A file that cannot be read as one of
        this store's facts (truncated, foreign, another shape or dtype, a name that does not match its ids) is
        moved to QUARANTINE_DIR and skipped: the facts it held are re-encoded from the registry when asked for,
        where raising would keep the whole store, and the engine serving from it, from starting."""
        assert self.disk_dir is not None  # only a store with a disk tier has fact files
        files = []
        for user_dir in sorted(p for p in self.disk_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for stray in [*user_dir.glob("*.tmp"), *user_dir.glob("*.behind")]:  # a write a crash cut short:
                stray.unlink(missing_ok=True)  # never renamed into place, and maybe a since-deleted fact's bytes
            for path in sorted(user_dir.glob("*" + FACT_SUFFIX)):
                try:
                    user_id, fact_id, nbytes = self._read_header(path)
                    if user_dir.name != _hash_name(user_id) or path.name != _hash_name(fact_id) + FACT_SUFFIX:
                        raise ValueError(f"{path}: file name does not match the ids inside "
                                         f"(user {user_id!r}, fact {fact_id!r})")
                except ValueError as err:
                    self._quarantine(path, err)
                    continue
                entry = _Entry(user_id, fact_id, nbytes, "disk", None, False)
                self._users.setdefault(user_id, {})[fact_id] = entry
                files.append((path.stat().st_mtime_ns, entry, path.stat().st_size))
        for _, entry, size in sorted(files, key=lambda f: f[0]):  # oldest write first: the LRU order after a restart
            self._add_file(entry, size)

    def _quarantine(self, path: Path, err: Exception) -> None:
        """Moves an unreadable fact file aside, for an operator to inspect or delete."""
        assert self.disk_dir is not None  # only a store with a disk tier has fact files
        folder = self.disk_dir / QUARANTINE_DIR
        folder.mkdir(exist_ok=True)
        target = folder / f"{path.parent.name}-{path.name}"
        os.replace(path, target)
        self._quarantined += 1
        log.warning("fact store %s: skipped an unreadable fact file, moved to %s: %s", self.disk_dir, target, err)

    def _read_header(self, path: Path) -> tuple[str, str, int]:
        """Ids and KV bytes from a fact file's header, checked against the store's shape and dtype."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                slices = {name: f.get_slice(name) for name in ("token_ids", "k_pre", "v")}
                shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
                dtypes = {name: s.get_dtype() for name, s in slices.items()}
        except Exception as err:  # safetensors raises several types for truncated or foreign files
            raise ValueError(f"{path}: not a readable fact file ({err})") from err
        if meta.get("format") != FILE_FORMAT or not meta.get("user_id") or not meta.get("fact_id"):
            raise ValueError(f"{path}: missing InferScale metadata (format {meta.get('format')!r})")
        source = f"{path} (fact {meta['fact_id']!r} of user {meta['user_id']!r})"
        if any(dtypes[n] not in _SAFETENSORS_DTYPES for n in ("k_pre", "v")):
            raise ValueError(f"{source}: unsupported tensor dtype {dtypes['k_pre']}/{dtypes['v']}")
        # Validate with empty tensors of the recorded shapes: same checks as put, no tensor data read.
        probe = EncodedFact(
            token_ids=torch.empty(shapes["token_ids"], dtype=torch.int64),
            k_pre=torch.empty(shapes["k_pre"], dtype=_SAFETENSORS_DTYPES[dtypes["k_pre"]], device="meta"),
            v=torch.empty(shapes["v"], dtype=_SAFETENSORS_DTYPES[dtypes["v"]], device="meta"),
        )
        self._check_fact(probe, source=source)
        return meta["user_id"], meta["fact_id"], probe.nbytes
