"""The eviction rule of every fact-store tier (inferscale_core/fair_lru.py; issue 31): the least recently used entry
of the owner holding the most bytes, the incoming bytes counted as their owner's, the shared owner last; checked
against a plain scan of every owner over random operations, and the heap that replaces the scan stays O(owners)."""
from __future__ import annotations

import random

import pytest

from inferscale_core.fair_lru import FairLRU

SHARED = "__inferscale_shared__"


def test_the_owner_holding_the_most_pays_with_its_least_recently_used_entry():
    lru: FairLRU[str, str] = FairLRU()
    assert lru.victim() is None and lru.victim("a", 10) is None  # nothing to evict
    for key, nbytes in (("a1", 5), ("a2", 5), ("a3", 5)):
        lru.add("a", key, key, nbytes)
    lru.add("b", "b1", "b1", 12)
    assert lru.bytes == 27 and lru.owner_bytes("a") == 15 and lru.owner_bytes("b") == 12
    assert lru.victim() == "a1"
    lru.touch("a", "a1")  # LRU within the owner
    assert lru.victim() == "a2" and lru.keys_of("a") == ["a2", "a3", "a1"]
    assert lru.victim("b", 2) == "a2"  # b would hold 14, a holds 15
    assert lru.victim("b", 3) == "b1"  # b would hold 15: a tie, and the one adding pays
    assert lru.victim("c", 100) == "a2"  # c holds nothing here: it cannot pay, the largest holder does
    assert lru.remove("a", "a2") == "a2" and lru.owner_bytes("a") == 10 and lru.victim() == "b1"
    for key in ("a3", "a1"):
        lru.remove("a", key)
    assert lru.owner_bytes("a") == 0 and ("a", "a1") not in lru and ("b", "b1") in lru
    assert lru.victim("a", 50) == "b1"  # a emptied: no longer an owner


def test_an_owner_alone_is_plain_lru():
    lru: FairLRU[int, int] = FairLRU()
    for i in range(5):
        lru.add("only", i, i, 1)
    lru.touch("only", 0)
    lru.touch("only", 2)
    order = []
    while (v := lru.victim("only", 1)) is not None:
        order.append(lru.remove("only", v))
    assert order == [1, 3, 4, 0, 2] and lru.bytes == 0


def test_the_shared_owner_pays_only_when_no_other_owner_holds_anything():
    lru: FairLRU[str, str] = FairLRU(last=SHARED)
    lru.add(SHARED, "prefix", "prefix", 100)  # one large entry: the largest holder by far
    lru.add("a", "a1", "a1", 1)
    assert lru.victim() == "a1" and lru.victim(SHARED, 1000) == "a1"  # the shared owner adding does not pay first
    lru.remove("a", "a1")
    assert lru.victim("a", 1) == "prefix"  # nothing else is left


def test_equal_owners_pay_in_the_order_their_holdings_last_changed():
    lru: FairLRU[str, str] = FairLRU()
    for owner in ("x", "y", "z"):
        lru.add(owner, owner + "1", owner + "1", 4)
    lru.touch("x", "x1")  # a touch does not change a holding
    assert lru.victim() == "x1"
    lru.remove("x", "x1")
    lru.add("x", "x1", "x1", 4)  # x changed last now: y is the longest unchanged
    assert lru.victim() == "y1"


def test_bad_calls_are_refused():
    lru: FairLRU[str, str] = FairLRU()
    lru.add("a", "k", "k", 1)
    with pytest.raises(ValueError, match="already holds 'k'"):
        lru.add("a", "k", "k", 1)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        lru.add("a", "j", "j", -1)
    with pytest.raises(KeyError):
        lru.remove("b", "k")
    with pytest.raises(KeyError):
        lru.touch("a", "nope")
    assert lru.bytes == 1 and lru.keys_of("a") == ["k"]


class ScanReference:
    """The rule written as a scan of every owner (what the disk tier did before the heap)."""

    def __init__(self, last: str):
        self.last, self.clock = last, 0
        self.entries: dict[str, dict[str, int]] = {}  # insertion order = LRU order
        self.changed: dict[str, int] = {}

    def add(self, owner, key, nbytes):
        self.entries.setdefault(owner, {})[key] = nbytes
        self.clock += 1
        self.changed[owner] = self.clock

    def remove(self, owner, key):
        del self.entries[owner][key]
        if not self.entries[owner]:
            del self.entries[owner]
        self.clock += 1
        self.changed[owner] = self.clock

    def touch(self, owner, key):
        self.entries[owner][key] = self.entries[owner].pop(key)

    def victim(self, owner, nbytes):
        ranked = [o for o in self.entries if o != self.last]
        if not ranked:
            return next(iter(self.entries[self.last])) if self.last in self.entries else None
        held = {o: sum(self.entries[o].values()) + (nbytes if o == owner else 0) for o in ranked}
        top = min(ranked, key=lambda o: (-held[o], o != owner, self.changed[o]))
        return next(iter(self.entries[top]))


def compare_with_scan(lru: FairLRU[str, str], ref: ScanReference, owners: list[str], seed: int, sizes: list[int],
                      touch_below: float, keep_for=None) -> None:
    """20,000 random operations on `lru` and the scan `ref` side by side: adds (bytes from `sizes`), touches (ops
    below `touch_below`), and evictions of what the rule names for the owner, as a tier making room for it does (with
    the keys `keep_for(rnd, held, serial)` names kept, when given); the victims must agree at every step, the bytes
    too, and the heap stays O(owners)."""
    rnd = random.Random(seed)
    serial = 0
    for step in range(20_000):
        owner = rnd.choice(owners)
        op = rnd.random()
        held = ref.entries.get(owner, {})
        if op < 0.45 or not held:
            serial += 1
            key, nbytes = f"k{serial}", rnd.choice(sizes)
            lru.add(owner, key, key, nbytes)
            ref.add(owner, key, nbytes)
        elif op < touch_below:
            key = rnd.choice(list(held))
            lru.touch(owner, key)
            ref.touch(owner, key)
        else:
            keep = keep_for(rnd, held, serial) if keep_for is not None else None
            args = (owner, rnd.choice([0, 1, 5])) + ((keep,) if keep is not None else ())
            want = ref.victim(*args)
            assert lru.victim(*args) == want, f"step {step}"
            if want is not None:
                o = next(o for o, keys in ref.entries.items() if want in keys)
                assert lru.remove(o, want) == want
                ref.remove(o, want)
        assert lru.bytes == sum(sum(k.values()) for k in ref.entries.values())
        assert len(lru._heap) <= FairLRU._SLACK * len(owners) + 32


def test_the_heap_chooses_what_a_scan_of_every_owner_chooses_and_stays_small():
    owners = [f"u{i}" for i in range(40)] + [SHARED]
    compare_with_scan(FairLRU(last=SHARED), ScanReference(SHARED), owners, seed=31, sizes=[1, 2, 3, 8],
                      touch_below=0.75)


def test_with_ties_held_equal_owners_pay_in_the_order_they_came_to_hold_something():
    """ties="held" (ResidentKV's order): among equal owners the one holding something the longest pays, however
    recently its holding changed; an owner that emptied and came back joins the end."""
    lru: FairLRU[str, str] = FairLRU(ties="held")
    for owner in ("x", "y", "z"):
        lru.add(owner, owner + "1", owner + "1", 4)
    lru.remove("x", "x1")
    lru.add("x", "x1", "x1", 4)  # x emptied and came back: held the shortest now
    assert lru.victim() == "y1"
    lru.add("y", "y2", "y2", 1)
    lru.remove("y", "y1")  # y changed last, 1 byte now, but holding all along
    lru.add("y", "y3", "y3", 3)
    assert lru.victim() == "y2" and lru.victim("z", 0) == "z1"  # the adding owner still pays a tie first
    with pytest.raises(ValueError, match="ties must be"):
        FairLRU(ties="newest")  # type: ignore[arg-type]


def test_keep_passes_over_the_adding_owners_kept_entries_to_the_next_owner():
    lru: FairLRU[str, str] = FairLRU(last=SHARED)
    lru.add("a", "a1", "a1", 10)
    lru.add("a", "a2", "a2", 10)
    lru.add("b", "b1", "b1", 5)
    lru.add("c", "c1", "c1", 7)
    assert lru.victim("a", keep={"a1"}) == "a2"  # its oldest not kept
    assert lru.victim("a", keep={"a1", "a2"}) == "c1"  # all of a kept: the largest of the others, not b
    assert lru.victim("b", keep={"b1"}) == "a1"  # a holds more than b: keep is about b's entries only
    assert lru.victim("b", 15, keep={"b1"}) == "a1"  # b would hold the most, but all of it is kept
    assert lru.victim("a", keep={"a1", "a2"}) == "c1" and lru.victim() == "a1"  # the heap is as it was
    for owner, key in (("b", "b1"), ("c", "c1")):
        lru.remove(owner, key)
    assert lru.victim("a", keep={"a1", "a2"}) is None  # nothing else left
    lru.add(SHARED, "prefix", "prefix", 100)
    assert lru.victim("a", keep={"a1", "a2"}) == "prefix"  # the shared owner is last, but before nothing
    assert lru.victim(SHARED, keep={"prefix"}) == "a1" and lru.victim(SHARED, 1, keep={"prefix"}) == "a1"
    lru.remove("a", "a1")
    lru.remove("a", "a2")
    assert lru.victim(SHARED, keep={"prefix"}) is None and lru.victim(SHARED) == "prefix"


class HeldScanReference(ScanReference):
    """The rule with `keep` and either tie order, as a scan: owners in order (most bytes, the adding owner on a tie,
    then the tie order), the first entry of the first that has one not kept, the shared owner after all of them."""

    def __init__(self, last: str, ties: str):
        super().__init__(last)
        self.ties = ties
        self.since: dict[str, int] = {}

    def add(self, owner, key, nbytes):
        if owner not in self.entries:
            self.since[owner] = self.clock + 0.5  # before this add's own stamp, after everything earlier
        super().add(owner, key, nbytes)

    def victim(self, owner, nbytes, keep=()):
        tie = self.since if self.ties == "held" else self.changed
        ranked = [o for o in self.entries if o != self.last]
        held = {o: sum(self.entries[o].values()) + (nbytes if o == owner else 0) for o in ranked}
        order = sorted(ranked, key=lambda o: (-held[o], o != owner, tie[o]))
        for o in order + ([self.last] if self.last in self.entries else []):
            for key in self.entries[o]:
                if o != owner or key not in keep:
                    return key
        return None


@pytest.mark.parametrize("ties", ["changed", "held"])
def test_with_keep_and_either_tie_order_the_heap_chooses_what_a_scan_chooses(ties):
    def keep_for(rnd, held, serial):  # any of the owner's keys (all of them now and then), and keys it does not hold
        keep = set(held) if rnd.random() < 0.3 else {k for k in held if rnd.random() < 0.5}
        return keep | {"nobody", f"k{serial}"}

    owners = [f"u{i}" for i in range(12)] + [SHARED]
    compare_with_scan(FairLRU(last=SHARED, ties=ties), HeldScanReference(SHARED, ties), owners, seed=311,
                      sizes=[0, 1, 2, 3, 8], touch_below=0.6, keep_for=keep_for)
