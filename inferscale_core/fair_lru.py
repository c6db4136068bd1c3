"""The eviction rule every tier of the fact store shares (issue 31): entries grouped by owner (a user), each owner's
least recently used first, and the bytes each owner holds; the next to leave is the least recently used entry of the
owner holding the most bytes. Every owner holding something has the same share of a tier (its budget / owners), so
the owner furthest beyond it pays first: a tenant touching ever new facts recycles its own entries and never flushes
another tenant's, however many tenants there are, while an owner alone is plain LRU over the whole budget.

Stdlib only (no torch): bookkeeping any tier can use. The largest owner is kept in a heap, so adding, removing and
choosing a victim cost O(log owners) amortised and a touch O(1), never a scan of every owner. The engine replica's
ResidentKV keeps its worker store's facts with the same class (ties="held", and `keep` for what a call adds)."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Collection, Generic, Literal, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FairLRU(Generic[K, V]):
    """Entries `owner -> key -> (value, nbytes)`, least recently used first within an owner.

    `victim(owner, nbytes)` is what to evict to make room for `nbytes` more of `owner`: the least recently used entry
    of the owner holding the most bytes, the incoming bytes counted as `owner`'s (so on a tie the one adding pays,
    and an owner alone evicts its own oldest). Among other owners holding the same bytes, the one whose holding
    changed least recently pays (`ties="changed"`), or with `ties="held"` the one holding something the longest
    (without a break since it last held nothing: the order ResidentKV's scan of its users took). The owner named
    `last` (the shared prefix chunk's) is evicted from only when no other owner holds anything: every request reads
    it, so it must not be the first to go for being one large entry."""

    # The heap holds stale rows (an owner's earlier byte counts) until they reach its top; it is rebuilt from the
    # live rows when it grows past this many per owner (plus a constant), which keeps it O(owners) in size and the
    # rebuild's O(owners) cost amortised over at least as many changes.
    _SLACK = 2

    def __init__(self, last: str | None = None, ties: Literal["changed", "held"] = "changed"):
        if ties not in ("changed", "held"):
            raise ValueError(f"ties must be 'changed' or 'held', got {ties!r}")
        self.last = last
        self._ties_held = ties == "held"
        self.bytes = 0  # every entry's bytes
        self._entries: dict[str, OrderedDict[K, tuple[V, int]]] = {}
        self._bytes: dict[str, int] = {}
        # (-bytes, tie, stamp, owner): live while stamp == self._stamp[owner]; tie orders equal owners (the stamp, or
        # with ties="held" the owner's `_since`), and the stamp is unique, so owners themselves are never compared.
        self._heap: list[tuple[int, int, int, str]] = []
        self._stamp: dict[str, int] = {}  # ranked owners (everyone holding something but `last`) -> their live row
        self._since: dict[str, int] = {}  # ties="held": owner -> the clock when it went from nothing to something
        self._clock = itertools.count()

    def __contains__(self, item: tuple[str, K]) -> bool:
        owner, key = item
        return key in self._entries.get(owner, ())

    def add(self, owner: str, key: K, value: V, nbytes: int) -> None:
        """Records a new entry as its owner's most recently used (ValueError for a key it already holds: remove it
        first, so that its bytes are never counted twice)."""
        if nbytes < 0:
            raise ValueError(f"an entry's bytes must be >= 0, got {nbytes}")
        entries = self._entries.get(owner)
        if entries is None:
            entries = self._entries[owner] = OrderedDict()
            if self._ties_held:
                self._since[owner] = next(self._clock)
        if key in entries:
            raise ValueError(f"owner {owner!r} already holds {key!r}")
        entries[key] = (value, nbytes)
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        self.bytes += nbytes
        self._rank(owner)

    def remove(self, owner: str, key: K) -> V:
        """Removes an entry (KeyError when the owner does not hold it) and returns its value."""
        entries = self._entries[owner]
        value, nbytes = entries.pop(key)
        self._bytes[owner] -= nbytes
        self.bytes -= nbytes
        if not entries:
            del self._entries[owner], self._bytes[owner]
            self._since.pop(owner, None)
        self._rank(owner)
        return value

    def touch(self, owner: str, key: K) -> None:
        """Marks an entry most recently used among its owner's (KeyError when the owner does not hold it)."""
        self._entries[owner].move_to_end(key)

    def owner_bytes(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def keys_of(self, owner: str) -> list[K]:
        """An owner's keys, least recently used first."""
        return list(self._entries.get(owner, ()))

    def victim(self, owner: str | None = None, nbytes: int = 0, keep: Collection[K] = ()) -> V | None:
        """The value of the entry to evict before `owner` adds `nbytes` (None: nothing is left to evict). `keep`:
        keys of `owner` never chosen (what it has just added, already counted): when only those are left of it, the
        next owner by the rule pays, and when nothing else is left at all, None."""
        top = self._largest()
        if owner is not None and owner != self.last and owner in self._entries and (
                top is None or self._bytes[owner] + nbytes >= self._bytes[top]):
            found = self._oldest(owner, keep)
            if found is not None:
                return found[0]
            top = self._largest(but=owner)
        if top is None:
            if self.last not in self._entries:
                return None
            top = self.last
        assert top is not None  # the shared owner holds something here
        found = self._oldest(top, keep if top == owner else ())
        return None if found is None else found[0]

    def _oldest(self, owner: str, keep: Collection[K]) -> tuple[V, int] | None:
        """The owner's least recently used entry not in `keep` (ResidentKV's kept keys are the owner's newest, so
        the walk passes over them only when nothing else of the owner is left: O(kept) at most, never O(owners))."""
        for key, entry in self._entries[owner].items():
            if key not in keep:
                return entry
        return None

    def _largest(self, but: str | None = None) -> str | None:
        """The ranked owner holding the most bytes (the stale rows above it dropped on the way), or when that is
        `but`, the one after it: its live row is set aside while the heap is looked under, then put back."""
        heap = self._heap
        while heap and self._stamp.get(heap[0][3]) != heap[0][2]:
            heapq.heappop(heap)
        if not heap or heap[0][3] != but:
            return heap[0][3] if heap else None
        row = heapq.heappop(heap)
        try:
            return self._largest()
        finally:
            heapq.heappush(heap, row)

    def _rank(self, owner: str) -> None:
        """Records the owner's new byte count in the heap (the earlier row goes stale)."""
        if owner == self.last:
            return
        if owner not in self._entries:
            self._stamp.pop(owner, None)
            return
        stamp = self._stamp[owner] = next(self._clock)
        heapq.heappush(self._heap, self._row(owner, stamp))
        if len(self._heap) > self._SLACK * len(self._stamp) + 32:
            self._heap = [self._row(o, s) for o, s in self._stamp.items()]
            heapq.heapify(self._heap)

    def _row(self, owner: str, stamp: int) -> tuple[int, int, int, str]:
        return -self._bytes[owner], self._since[owner] if self._ties_held else stamp, stamp, owner
