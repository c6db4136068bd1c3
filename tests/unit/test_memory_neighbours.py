"""Neighbour windows come from the user's memory, not from the call (inferscale_core/defaults.py), as the
gateway applies them: GatewayCore with the embedded registry in registry-only mode (what is stored is what the
encoders encode: text and window), and what a neighbour's later delete or update does to the facts encoded
behind it (docs/architecture.md, "Neighbour windows")."""
from __future__ import annotations

import asyncio

import pytest

from inferscale_core.defaults import NEIGHBOUR_WINDOW
from inferscale_core.template import PromptTemplate
from inferscale_server.api import pb2
from inferscale_server.auth import Authenticator
from inferscale_server.gateway import GatewayCore
from inferscale_server.registry import EmbeddedRegistry, NewFact

LINE = PromptTemplate.render_fact


@pytest.fixture
def core():
    return GatewayCore(EmbeddedRegistry(), backends=None, auth=Authenticator.insecure())


def _add(core, user, *texts, window=()):
    return [r.fact_id for r in asyncio.run(core.store_new(user, [NewFact(t, window=window) for t in texts]))]


def _window(core, user, fid):
    return core.registry.get(user, fid).window


def test_a_fact_added_alone_is_encoded_behind_the_users_latest_facts(core):
    assert NEIGHBOUR_WINDOW == 5
    texts = [f"fact number {i}" for i in range(9)]
    ids = []
    for t in texts[:3]:  # one call per fact
        ids += _add(core, "ann", t)
    _add(core, "bob", "bob's fact")  # another user's facts are never neighbours
    ids += _add(core, "ann", *texts[3:6])  # one call, three facts: they see the earlier calls and each other
    ids += _add(core, "ann", texts[6], window=("user: I won at chess today",))  # a caller's own window wins
    ids += _add(core, "ann", *texts[7:])
    lines = [LINE(t) for t in texts]
    expected = [tuple(lines[max(0, j - 5):j]) for j in range(len(texts))]
    expected[6] = ("user: I won at chess today",)
    assert [_window(core, "ann", f) for f in ids] == expected
    assert expected[8] == tuple(lines[3:8]) and expected[1] == (lines[0],)  # stored before, whatever call
    (bobs,) = core.registry.list("bob")[0]
    assert bobs.window == ()


def test_deleting_a_neighbour_takes_its_text_out_of_every_window(core):
    """Privacy: a deleted fact's text survives in no other fact's stored window (and so in no KV: a window
    change is a new version, which the encoders re-encode from text and window)."""
    texts = [f"fact number {i}" for i in range(8)]
    ids = [f for t in texts for f in _add(core, "ann", t)]
    before = {f: core.registry.get("ann", f) for f in ids}
    asyncio.run(core.delete_fact("ann", ids[3]))
    gone = LINE(texts[3])
    after = {r.fact_id: r for r in core.registry.list("ann")[0]}
    assert ids[3] not in after and not any(gone in r.window for r in after.values())
    for f, r in after.items():
        if gone in before[f].window:  # facts 4..7 were encoded behind it: re-windowed, new version
            assert r.window == tuple(x for x in before[f].window if x != gone) and r.version == 2
        else:
            assert r.window == before[f].window and r.version == 1
    assert sum(r.version == 2 for r in after.values()) == 4
    new = _add(core, "ann", "a new fact")[0]  # the 5 latest facts still stored
    assert _window(core, "ann", new) == tuple(LINE(t) for t in (texts[2], *texts[4:8]))


def test_updating_a_neighbour_replaces_its_line_in_every_window(core):
    ids = [f for t in ("likes tea", "lives in Oslo", "plays chess") for f in _add(core, "ann", t)]
    asyncio.run(core.update_fact("ann", ids[0], "likes coffee", None))
    assert _window(core, "ann", ids[1]) == (LINE("likes coffee"),)
    assert _window(core, "ann", ids[2]) == (LINE("likes coffee"), LINE("lives in Oslo"))
    assert [core.registry.get("ann", f).version for f in ids] == [2, 2, 2]
    asyncio.run(core.update_fact("ann", ids[1], None, {"src": "chat"}))  # metadata only: no window moves
    assert [core.registry.get("ann", f).version for f in ids] == [2, 3, 2]


def test_after_delete_user_nothing_is_a_neighbour(core):
    _add(core, "ann", "likes tea", "lives in Oslo")
    caller = asyncio.run(core.authenticate("DeleteUser", None))
    asyncio.run(core.DeleteUser(pb2.DeleteUserRequest(user_id="ann"), caller))
    assert _window(core, "ann", _add(core, "ann", "plays chess")[0]) == ()


def test_a_delete_or_update_reads_the_same_few_facts_however_large_the_memory(core):
    """What a neighbour's delete or text change reads does not grow with the user's memory: the facts created after
    it, REWINDOW_SPAN of them at most (a window holds the facts stored most recently when its fact was created);
    the ones further on are neither read nor changed, and the windows come out as a full scan would make them."""
    from inferscale_server.gateway.core import REWINDOW_SPAN

    reads = []
    real = core.registry.list_after

    def counted(user_id, after, limit):
        page, nxt = real(user_id, after, limit)
        reads.append(len(page))
        return page, nxt

    core.registry.list_after = counted
    for n in (20, 200):
        user = f"ann{n}"
        ids = _add(core, user, *[f"{user} fact {i}" for i in range(n)])
        reads.clear()
        asyncio.run(core.delete_fact(user, ids[3]))
        asyncio.run(core.update_fact(user, ids[10], f"{user} fact ten, changed", None))
        assert sum(reads) <= 2 * REWINDOW_SPAN, (n, reads)
        gone, old10, new10 = LINE(f"{user} fact 3"), LINE(f"{user} fact 10"), LINE(f"{user} fact ten, changed")
        stored = {r.fact_id: r for r in core.registry.list(user)[0]}
        assert not any(gone in r.window or old10 in r.window for r in stored.values())
        assert [f for f in ids if f in stored and new10 in stored[f].window] == ids[11:16]
        assert {f for f in ids if f in stored and stored[f].version > 1} == {*ids[4:9], ids[10], *ids[11:16]}


def test_what_one_write_asks_the_encoder_to_encode_is_bounded():
    """A caller's window is at most max_window_chars, and one write at most max_encode_chars_per_request of text
    and windows (the user's latest facts count: they are encoded again behind each new fact), refused before
    anything is written."""
    from inferscale_server.errors import ApiError
    from inferscale_server.limits import Limits
    from inferscale_server.validation import facts_in

    limits = Limits(max_encode_chars_per_request=1000, max_window_chars=300)
    core = GatewayCore(EmbeddedRegistry(), backends=None, limits=limits, auth=Authenticator.insecure())
    with pytest.raises(ApiError) as e:
        facts_in([pb2.FactInput(text="x", window=["a" * 200, "b" * 101])], limits)
    assert e.value.field == "facts[0].window" and "301 characters, the limit is 300" in e.value.message
    _add(core, "ann", *[f"fact {i:03d} " + "y" * 40 for i in range(5)])  # 5 x 48 characters
    with pytest.raises(ApiError) as e:  # 4 new facts of 48, each behind 5 facts of 48 (and their line marks): > 1000
        _add(core, "ann", *[f"fact {i:03d} " + "z" * 40 for i in range(5, 9)])
    assert "the limit per request is 1000" in e.value.message and "nothing was stored" in e.value.message
    assert core.registry.count("ann") == 5
    assert len(_add(core, "ann", "fact 009 " + "w" * 40)) == 1  # one fact behind 5: about 300, within the limit


class _RacedWrites(EmbeddedRegistry):
    """The race of issue 31: between an add's read of the user's latest facts and its write, another request
    deletes one of them and changes another (their own rewindows ran then, before the new fact existed)."""

    def __init__(self):
        super().__init__()
        self.before_create = None

    def create(self, user_id, facts, quota=None, idempotent=None):
        if self.before_create is not None:
            race, self.before_create = self.before_create, None
            race()
        return super().create(user_id, facts, quota, idempotent)


def test_a_neighbour_deleted_or_changed_while_an_add_runs_survives_in_no_window():
    core = GatewayCore(_RacedWrites(), backends=None, auth=Authenticator.insecure())
    ids = _add(core, "ann", "Ann's PIN is 4711.", "Ann likes tea.", "Ann plays chess.")

    def race():
        asyncio.run(core.delete_fact("ann", ids[0]))
        asyncio.run(core.update_fact("ann", ids[1], "Ann likes coffee.", None))

    core.registry.before_create = race
    (new,) = _add(core, "ann", "Ann moved to Oslo.")
    assert _window(core, "ann", new) == (LINE("Ann likes coffee."), LINE("Ann plays chess."))
    others = [r for r in core.registry.list("ann")[0] if r.fact_id != new]
    assert all(LINE("Ann's PIN is 4711.") not in r.window and LINE("Ann likes tea.") not in r.window for r in others)
