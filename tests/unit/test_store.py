"""FactStore: disk round trip, restart, tiers and budgets, byte accounting, errors, user isolation."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from support.fact_store import D, H, L, assert_same, make_fact, store

from inferscale_core.errors import InferScaleError, InvalidIdError, UnknownFactError, UnknownUserError
from inferscale_core.model_spec import ModelSpec
from inferscale_core.store import FactStore, host_copy
from inferscale_core.types import EncodedFact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_round_trip_is_bit_exact(tmp_path, dtype):
    s = store(tmp_path, dtype=dtype, device_budget_bytes=0)  # budget 0: nothing stays in memory
    fact = make_fact(7, dtype=dtype, seed=1)
    s.put("alice", "f1", fact)
    assert s.tier_of("alice", "f1") == "disk"
    got = s.get("alice", "f1")
    assert_same(got, fact)
    assert got.token_ids.dtype == torch.int64
    assert s.stats()["hits"]["disk"] == 1


def test_restart_returns_every_fact(tmp_path):
    facts = {(u, f"fact-{i}"): make_fact(3 + i, seed=10 * i + len(u)) for u in ("alice", "bob") for i in range(4)}
    s = store(tmp_path / "db")
    for (u, f), fact in facts.items():
        s.put(u, f, fact)
    before = s.bytes_used()
    del s

    reopened = FactStore.open(tmp_path / "db")  # shape and dtype learned from the files
    assert sorted(reopened.users()) == ["alice", "bob"]
    assert sorted(reopened.fact_ids("alice")) == [f"fact-{i}" for i in range(4)]
    assert reopened.bytes_used() == {"device": 0, "host": 0, "disk": before["disk"]}
    for (u, f) in facts:  # lazy: listed at open, loaded on first get
        assert reopened.tier_of(u, f) == "disk"
    for (u, f), fact in facts.items():
        assert_same(reopened.get(u, f), fact)
        assert reopened.tier_of(u, f) == "device"
    assert reopened.stats()["hits"]["disk"] == len(facts)


def test_open_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no fact store"):
        FactStore.open(tmp_path / "nope")


@pytest.mark.parametrize("spoil", ["shape", "dtype", "truncated", "renamed"])
def test_open_quarantines_unreadable_files(tmp_path, spoil):
    """A file the store cannot read as one of its facts is moved aside at open and the other facts are served:
    one bad file never keeps the store (and the engine serving from it) from starting."""
    s = store(tmp_path)
    good, bad = make_fact(4, seed=1), make_fact(5, seed=2)
    s.put("alice", "good", good)
    s.put("alice", "bad", bad)
    bad_path = s._path("alice", "bad")
    del s
    kw = {}
    if spoil == "shape":  # the same files opened with another model's shape: every file is foreign
        kw = {"num_layers": L + 1, "num_kv_heads": H, "head_dim": D}
    elif spoil == "dtype":
        kw = {"dtype": torch.bfloat16}
    elif spoil == "truncated":
        bad_path.write_bytes(bad_path.read_bytes()[:40])
    else:  # a file under another fact's name
        bad_path.rename(bad_path.with_name("0" * 32 + bad_path.suffix))
    reopened = FactStore.open(tmp_path, **kw)
    moved = sorted(p.name for p in (tmp_path / ".quarantine").iterdir())
    if spoil in ("shape", "dtype"):
        assert reopened.users() == [] and len(moved) == 2
        assert reopened.stats()["disk_quarantined"] == 2
        return
    assert reopened.fact_ids("alice") == ["good"] and len(moved) == 1
    assert_same(reopened.get("alice", "good"), good)
    stats = reopened.stats()
    assert stats["disk_quarantined"] == 1 and stats["disk_file_bytes"] == reopened._path("alice", "good").stat().st_size
    reopened.put("alice", "bad", bad)  # the fact can be stored again; the quarantine folder is never read
    again = FactStore.open(tmp_path)
    assert sorted(again.fact_ids("alice")) == ["bad", "good"] and again.stats()["disk_quarantined"] == 0
    assert_same(again.get("alice", "bad"), bad)


def test_replace_keeps_position_and_updates_disk(tmp_path):
    s = store(tmp_path)
    s.put("alice", "a", make_fact(4, seed=1))
    s.put("alice", "b", make_fact(4, seed=2))
    new = make_fact(9, seed=3)
    s.put("alice", "a", new)
    assert s.fact_ids("alice") == ["a", "b"]
    assert_same(s.get("alice", "a"), new)
    assert s.bytes_used()["disk"] == new.nbytes + make_fact(4).nbytes
    assert_same(FactStore.open(tmp_path).get("alice", "a"), new)


def test_delete_removes_from_disk_too(tmp_path):
    s = store(tmp_path)
    s.put("alice", "a", make_fact(4, seed=1))
    s.put("alice", "b", make_fact(5, seed=2))
    s.put("bob", "a", make_fact(6, seed=3))
    s.delete("alice", "a")
    assert not s.contains("alice", "a")
    with pytest.raises(UnknownFactError):
        s.get("alice", "a")
    reopened = FactStore.open(tmp_path)
    assert reopened.fact_ids("alice") == ["b"]
    assert reopened.contains("bob", "a")

    s.delete_user("alice")
    assert s.users() == ["bob"]
    with pytest.raises(UnknownUserError):
        s.fact_ids("alice")
    assert FactStore.open(tmp_path).users() == ["bob"]
    s.delete("bob", "a")  # last fact: user and folder gone
    assert s.users() == [] and len(s) == 0
    assert list(tmp_path.iterdir()) == []
    assert s.bytes_used() == {"device": 0, "host": 0, "disk": 0}


def test_budget_demotes_lru_and_get_promotes(tmp_path):
    one = make_fact(4).nbytes
    s = store(tmp_path, device_budget_bytes=2 * one)
    for i in range(3):
        s.put("alice", f"f{i}", make_fact(4, seed=i))
    # f0 is least recently used: it was pushed out to disk.
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["disk", "device", "device"]
    assert s.bytes_used() == {"device": 2 * one, "host": 0, "disk": 3 * one}

    s.get("alice", "f1")  # now f2 is the LRU one
    assert_same(s.get("alice", "f0"), make_fact(4, seed=0))
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["device", "device", "disk"]
    st = s.stats()
    assert st["hits"] == {"device": 1, "host": 0, "disk": 1}
    assert st["promotions"] == 1 and st["demotions"] == 2
    assert st["facts_per_tier"] == {"device": 2, "host": 0, "disk": 1}
    assert st["bytes"]["device"] <= 2 * one


def test_fact_larger_than_budget_is_served_but_not_kept(tmp_path):
    s = store(tmp_path, device_budget_bytes=make_fact(4).nbytes)
    big = make_fact(10, seed=5)
    s.put("alice", "big", big)
    assert s.tier_of("alice", "big") == "disk"
    assert_same(s.get("alice", "big"), big)
    assert s.tier_of("alice", "big") == "disk"
    assert s.bytes_used()["device"] == 0


def test_budget_without_disk_is_refused():
    with pytest.raises(ValueError, match="device_budget_bytes needs disk_dir"):
        store(None, device_budget_bytes=1000)


def test_cpu_store_keeps_one_copy():
    s = store(None)
    assert not s.use_host_tier
    s.put("alice", "f", make_fact(4))
    assert s.tier_of("alice", "f") == "device"
    assert s.bytes_used()["host"] == 0


def test_bytes_formula_by_hand():
    spec = ModelSpec(architecture="llama", num_layers=30, num_kv_heads=3, head_dim=64, rotary_dim=64,
                     rope_type="default", rope_theta=1e5, max_position_embeddings=8192, has_k_norm=False,
                     dtype=torch.bfloat16)
    s = FactStore.for_spec(spec)
    s.put("alice", "a", make_fact(11, torch.bfloat16, layers=30, heads=3, head_dim=64))
    s.put("alice", "b", make_fact(5, torch.bfloat16, layers=30, heads=3, head_dim=64))
    s.put("bob", "a", make_fact(2, torch.bfloat16, layers=30, heads=3, head_dim=64))
    per_token = 2 * 30 * 3 * 64 * 2  # 2·L·h·d·b, with b = 2 bytes for bf16
    assert s.bytes_used("alice") == {"device": 16 * per_token, "host": 0, "disk": 0}
    assert s.bytes_used("bob")["device"] == 2 * per_token == spec.kv_bytes(2)
    assert s.bytes_used()["device"] == 18 * per_token


def test_put_copies_the_callers_tensors():
    s = store(None)
    fact = make_fact(4)
    s.put("alice", "f", fact)
    fact.k_pre.zero_()
    assert s.get("alice", "f").k_pre.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_host_copy_is_exact_contiguous_and_owns_its_memory(dtype):
    """The store's one-thread copy (inferscale_core.store.host_copy): same bits, shape and dtype for every KV
    dtype, a layout a cache write reads without a copy, from a non-contiguous source too, sharing nothing."""
    fact = make_fact(9, dtype=torch.float32, seed=4)
    for src in (fact.k_pre.to(dtype), fact.k_pre.to(dtype).transpose(1, 2)):
        out = host_copy(src)
        assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
        assert torch.equal(out.view(torch.uint8), src.contiguous().view(torch.uint8))
        assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    s = store(None, dtype=dtype)
    s.put("alice", "f", EncodedFact(fact.token_ids, fact.k_pre.to(dtype), fact.v.to(dtype)))
    assert torch.equal(s.get("alice", "f").v.view(torch.uint8), fact.v.to(dtype).view(torch.uint8))


def test_get_many_keeps_order():
    s = store(None)
    facts = {f"f{i}": make_fact(2 + i, seed=i) for i in range(4)}
    for f, fact in facts.items():
        s.put("alice", f, fact)
    order = ["f2", "f0", "f3", "f2"]
    for got, f in zip(s.get_many("alice", order), order):
        assert_same(got, facts[f])
    with pytest.raises(UnknownFactError, match="'zz'"):
        s.get_many("alice", ["f1", "zz"])


def test_users_are_isolated():
    s = store(None)
    s.put("alice", "shared-id", make_fact(4, seed=1))
    s.put("bob", "shared-id", make_fact(4, seed=2))
    assert_same(s.get("alice", "shared-id"), make_fact(4, seed=1))
    assert_same(s.get("bob", "shared-id"), make_fact(4, seed=2))
    s.put("carol", "only-carol", make_fact(3))
    with pytest.raises(UnknownFactError, match="only-carol"):
        s.get("alice", "only-carol")
    s.delete_user("alice")
    assert_same(s.get("bob", "shared-id"), make_fact(4, seed=2))


@pytest.mark.parametrize("fact, message", [
    (make_fact(0), "empty fact"),
    (make_fact(9), "more than the limit of 8"),
    (make_fact(4, dtype=torch.float16), "dtype torch.float16, expected torch.float32"),
    (make_fact(4, layers=L + 1), r"shape \(4, 4, 2, 8\), expected \(3, 4, 2, 8\)"),
    (make_fact(4, head_dim=D * 2), "expected \\(3, 4, 2, 8\\)"),
    (EncodedFact(torch.arange(4), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), "4-D tensor"),
    (EncodedFact(torch.arange(4), torch.zeros(L, 4, H, D, dtype=torch.int64),
                 torch.zeros(L, 4, H, D, dtype=torch.int64)), "floating-point"),
    ("not a fact", "expected an EncodedFact"),
])
def test_bad_facts_are_rejected_with_the_reason(fact, message):
    s = store(None, max_fact_tokens=8)
    with pytest.raises(ValueError, match=message):
        s.put("alice", "f", fact)
    assert s.users() == []


def test_shape_learned_from_first_fact():
    s = FactStore()
    s.put("alice", "a", make_fact(4))
    with pytest.raises(ValueError, match="expected"):
        s.put("alice", "b", make_fact(4, heads=H + 1))
    with pytest.raises(ValueError, match="dtype"):
        s.put("alice", "b", make_fact(4, dtype=torch.bfloat16))


def test_unknown_ids_and_bad_ids(tmp_path):
    s = store(tmp_path)
    s.put("alice", "f", make_fact(3))
    with pytest.raises(UnknownUserError, match="unknown user 'mallory'") as e:
        s.get("mallory", "f")
    assert isinstance(e.value, KeyError) and isinstance(e.value, InferScaleError)
    with pytest.raises(UnknownFactError, match="unknown fact 'nope' for user 'alice'"):
        s.get("alice", "nope")
    with pytest.raises(UnknownUserError):
        s.delete_user("mallory")
    with pytest.raises(UnknownFactError):
        s.delete("alice", "nope")
    bad = [("", "empty"), ("   ", "empty"), ("../etc", "path separator"), ("a\\b", "path separator"),
           ("..", "not allowed"), ("a\x00b", "control character"), ("x" * 300, "limit is 256"), (7, "must be a str")]
    for bad_id, message in bad:
        with pytest.raises(InvalidIdError, match=f"user_id.*{message}"):
            s.put(bad_id, "f", make_fact(3))
        with pytest.raises(InvalidIdError, match="fact_id"):
            s.put("alice", bad_id, make_fact(3))
    # Any printable id is fine: folders and files are named by hashes, never by the id itself.
    s.put("Ünïcode user: 'x' *?", "fact with spaces & <chars>", make_fact(3, seed=4))
    assert_same(FactStore.open(tmp_path).get("Ünïcode user: 'x' *?", "fact with spaces & <chars>"),
                make_fact(3, seed=4))
    assert all(len(p.name) == 32 for p in tmp_path.iterdir())


def test_concurrent_readers_and_writer(tmp_path):
    s = store(tmp_path, device_budget_bytes=3 * make_fact(4).nbytes)
    for i in range(8):
        s.put("alice", f"f{i}", make_fact(4, seed=i))
    errors = []

    def reader():
        try:
            for _ in range(50):
                for i in range(8):
                    assert_same(s.get("alice", f"f{i}"), make_fact(4, seed=i))
        except Exception as err:  # noqa: BLE001 - surfaced below; a thread's assert would otherwise be lost
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for j in range(50):
        s.put("bob", f"g{j % 5}", make_fact(4, seed=100 + j))
    for t in threads:
        t.join()
    assert errors == []
    assert s.bytes_used()["device"] <= 3 * make_fact(4).nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for the device and pinned host tiers")
def test_cuda_three_tiers(tmp_path):
    one = make_fact(4).nbytes
    s = store(tmp_path, device="cuda", device_budget_bytes=one, host_budget_bytes=one)
    for i in range(3):
        s.put("alice", f"f{i}", make_fact(4, seed=i))
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["disk", "host", "device"]
    got = s.get("alice", "f1")
    assert got.k_pre.is_cuda
    assert_same(got.to("cpu"), make_fact(4, seed=1))
    assert s.stats()["hits"]["host"] == 1
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["disk", "device", "host"]
    assert s._users["alice"]["f2"].fact.k_pre.is_pinned()
    assert_same(s.get("alice", "f0").to("cpu"), make_fact(4, seed=0))


# ----------------------------------------------------------------------------- the disk tier's byte budget

def file_size(s: FactStore, user_id: str, fact_id: str) -> int:
    return s._path(user_id, fact_id).stat().st_size


def on_disk(s: FactStore) -> int:
    """Bytes of fact files in the store's folder, counted on the file system (temp files included)."""
    return sum(p.stat().st_size for p in s.disk_dir.rglob("*") if p.is_file())


def test_disk_budget_holds_and_files_leave_in_lru_order(tmp_path):
    one = len(FactStore._file_data("u", "f0", make_fact(6)))  # every fact here: 6 tokens, same file size
    s = store(tmp_path, device_budget_bytes=0, disk_budget_bytes=3 * one)  # disk only, room for 3 files
    for i in range(3):
        s.put("u", f"f{i}", make_fact(6, seed=i))
    assert file_size(s, "u", "f0") == one and on_disk(s) == 3 * one
    s.get("u", "f0")  # f0 used: f1 is now the least recently used
    s.put("u", "f3", make_fact(6, seed=3))
    assert sorted(s.fact_ids("u")) == ["f0", "f2", "f3"] and not s._path("u", "f1").exists()
    s.put("v", "g0", make_fact(6, seed=4))  # another user's write: u holds the most, its oldest (f2) goes
    assert sorted(s.fact_ids("u")) == ["f0", "f3"]
    assert on_disk(s) <= 3 * one and s.stats()["disk_file_bytes"] == on_disk(s) == 3 * one
    assert s.stats()["disk_collected"] == 2 and s.stats()["budgets"]["disk"] == 3 * one
    for i in range(20):  # many writes: the budget holds after every one
        s.put("w", f"h{i}", make_fact(6, seed=100 + i))
        assert on_disk(s) <= 3 * one
    # w took u's extra file once (u held two), then recycled its own: u and v keep their share
    assert s.fact_ids("w") == ["h19"] and s.fact_ids("u") == ["f3"] and s.fact_ids("v") == ["g0"]


def test_one_user_writing_ever_new_facts_never_flushes_the_others_disk_files(tmp_path):
    """Issue 31: the disk budget is shared per user, not one LRU over everyone. A flood of one user's new facts
    collects its own oldest files; two quiet users under their share (budget / users) keep every file, although
    theirs are the oldest on the disk. A restart with a smaller budget takes from the largest holder too."""
    one = len(FactStore._file_data("flood", "x10", make_fact(6)))  # the largest file here (the ids are in it)
    s = store(tmp_path, device_budget_bytes=0, disk_budget_bytes=10 * one)  # disk only, room for 10 files
    for user, n in (("quiet-a", 2), ("quiet-b", 3)):
        for i in range(n):
            s.put(user, f"q{i}", make_fact(6, seed=i))
    for i in range(50):
        s.put("flood", f"x{i}", make_fact(6, seed=100 + i))
        assert on_disk(s) <= 10 * one
    assert s.fact_ids("quiet-a") == ["q0", "q1"] and s.fact_ids("quiet-b") == ["q0", "q1", "q2"]
    assert s.fact_ids("flood") == [f"x{i}" for i in range(45, 50)]  # its five newest: the rest of the budget
    assert_same(s.get("quiet-a", "q0"), make_fact(6, seed=0))
    s.put("quiet-a", "q2", make_fact(6, seed=2))  # a quiet user's new fact takes from the largest holder
    assert len(s.fact_ids("flood")) == 4 and len(s.fact_ids("quiet-a")) == 3
    del s
    reopened = FactStore.open(tmp_path, disk_budget_bytes=9 * one)  # flood 4 -> 3 files; the others keep theirs
    assert len(reopened.fact_ids("flood")) == 3 and len(reopened.fact_ids("quiet-a")) == 3
    assert sorted(reopened.fact_ids("quiet-b")) == ["q0", "q1", "q2"] and on_disk(reopened) <= 9 * one


def test_a_collected_fact_is_a_clean_miss(tmp_path):
    one = len(FactStore._file_data("u", "f0", make_fact(5)))
    s = store(tmp_path, device_budget_bytes=0, disk_budget_bytes=2 * one)
    for i in range(3):
        s.put("u", f"f{i}", make_fact(5, seed=i))
    assert not s.contains("u", "f0") and ("u", "f0") not in s
    with pytest.raises(UnknownFactError):
        s.get("u", "f0")
    with pytest.raises(UnknownFactError):
        s.get_many("u", ["f1", "f0"])
    assert_same(s.get("u", "f1"), make_fact(5, seed=1))  # the others are intact
    s.put("u", "f0", make_fact(5, seed=9))  # written again: a new fact, read back as written
    assert_same(s.get("u", "f0"), make_fact(5, seed=9))
    # A restart sees only what the budget kept, and a smaller budget collects the oldest files at once.
    reopened = FactStore.open(tmp_path, disk_budget_bytes=one)
    assert reopened.fact_ids("u") == ["f0"] and on_disk(reopened) == one


def test_a_fact_in_memory_outlives_its_file_until_demoted(tmp_path):
    fact = make_fact(4)
    one, kv = len(FactStore._file_data("u", "a", fact)), fact.nbytes
    s = store(tmp_path, device_budget_bytes=2 * kv, disk_budget_bytes=one)  # 2 facts in memory, 1 file
    s.put("u", "a", make_fact(4, seed=1))
    s.put("u", "b", make_fact(4, seed=2))  # a's file goes; a stays on the device
    assert not s._path("u", "a").exists() and s.tier_of("u", "a") == "device"
    assert_same(s.get("u", "a"), make_fact(4, seed=1))  # served from memory
    s.put("u", "c", make_fact(4, seed=3))  # b (least recently used) leaves the device, and its file leaves: gone
    assert s.fact_ids("u") == ["a", "c"]
    s.put("u", "d", make_fact(4, seed=4))  # a leaves the device with no file: gone, not a FileNotFoundError later
    assert s.fact_ids("u") == ["c", "d"] and on_disk(s) == one


def test_a_fact_over_the_disk_budget(tmp_path):
    small, big = make_fact(2), make_fact(40, seed=1)
    s = store(tmp_path, disk_budget_bytes=len(FactStore._file_data("u", "s", small)))  # CPU: memory unbounded
    s.put("u", "big", big)  # no file (too big for the disk), kept in memory
    assert not s._path("u", "big").exists() and s.tier_of("u", "big") == "device"
    assert_same(s.get("u", "big"), big)
    tight = store(tmp_path / "tight", device_budget_bytes=small.nbytes,
                  disk_budget_bytes=len(FactStore._file_data("u", "s", small)))
    with pytest.raises(ValueError, match="over the disk budget .* fit no memory tier"):
        tight.put("u", "big", big)  # refused before anything is written
    assert tight.users() == [] and on_disk(tight) == 0


@pytest.mark.parametrize("budget", [-1, 1.5, "1G", True])
def test_bad_disk_budgets_are_refused(tmp_path, budget):
    with pytest.raises(ValueError, match="disk_budget_bytes must be an integer >= 0 or None"):
        store(tmp_path, disk_budget_bytes=budget)


def test_disk_budget_without_disk_is_refused():
    with pytest.raises(ValueError, match="disk_budget_bytes needs disk_dir"):
        FactStore(disk_budget_bytes=1 << 20)


def test_default_disk_budget_is_a_quarter_of_the_free_disk(tmp_path):
    import shutil

    from inferscale_core.store import default_disk_budget_bytes

    (tmp_path / "old.safetensors").write_bytes(b"x" * 4096)  # a restarted store's files count as its own
    free = shutil.disk_usage(tmp_path).free
    budget = default_disk_budget_bytes(tmp_path)
    assert abs(budget - (free + 4096) // 4) < 64 << 20  # the free space moves a little under other writers
    with pytest.raises(ValueError, match="fraction must be in"):
        default_disk_budget_bytes(tmp_path, fraction=0)


@pytest.mark.parametrize("value, why", [("0", "must be a number above 0, got 0"),
                                        ("-2", "must be a number above 0, got -2"),
                                        ("lots", "must be a number, got 'lots'"),
                                        ("inf", "must be a number above 0, got inf")])
def test_serve_takes_the_disk_budget_and_refuses_bad_values(capsys, value, why):
    import argparse

    from inferscale_server import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--kv-disk-budget-gib", "1.5"])
    assert cli.store_settings(args) == {"disk_budget_bytes": 3 << 29}
    assert cli.store_settings(parser.parse_args(["serve"])) == {}  # the engine derives it from the disk
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", f"--kv-disk-budget-gib={value}"])
    assert e.value.code == 2 and f"--kv-disk-budget-gib: {why}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- every tier shared per user (issue 31)

def assert_books(s: FactStore, sizes: dict[tuple[str, str], int]) -> None:
    """The store's byte counts after evictions equal what its facts add up to: per tier from `tier_of` and each
    fact's KV bytes (`sizes`), per user in each tier's eviction books, on disk from the files themselves; and no
    tier is over its budget."""
    want = {"device": 0, "host": 0, "disk": 0}
    for user in s.users():
        mine = {"device": 0, "host": 0}
        for f in s.fact_ids(user):
            tier, kv = s.tier_of(user, f), sizes[user, f]
            if tier != "disk":
                mine[tier] += kv
                want[tier] += kv
            want["disk"] += kv if s._path(user, f).exists() else 0
        assert s.bytes_used(user) == {**mine, "disk": s.bytes_used(user)["disk"]}
        for tier, books in s._lru.items():
            assert books.owner_bytes(user) == mine[tier], (user, tier)
        files = s._path(user, "any").parent.glob("*.safetensors")
        assert s._disk_lru.owner_bytes(user) == sum(p.stat().st_size for p in files), user
    assert s.bytes_used() == want
    stats = s.stats()
    assert stats["disk_file_bytes"] == on_disk(s)
    assert sum(stats["facts_per_tier"].values()) == len(s) == sum(len(s.fact_ids(u)) for u in s.users())
    for tier, used in (("device", want["device"]), ("host", want["host"]), ("disk", on_disk(s))):
        assert stats["budgets"][tier] is None or used <= stats["budgets"][tier], tier


def test_a_tenant_touching_far_more_than_memory_holds_leaves_another_tenants_recent_facts_resident(tmp_path):
    """Issue 31: the device and host tiers are shared per user like the disk. Tenant a puts and reads 40 facts
    through tiers that hold 4 facts each; tenant b's three facts stay in memory: its share of the device (the
    budget / 2 users) holds its two most recent, the third is on the host, and b's next reads are memory hits.
    With one LRU for every user (before), a's flood pushed all of b's facts out to disk."""
    one = make_fact(4).nbytes
    s = store(tmp_path, host_tier=True, device_budget_bytes=4 * one, host_budget_bytes=4 * one)
    sizes = {}
    for i in range(3):
        s.put("b", f"b{i}", make_fact(4, seed=i))
        sizes["b", f"b{i}"] = one
    for i in range(40):
        s.put("a", f"a{i}", make_fact(4, seed=100 + i))
        sizes["a", f"a{i}"] = one
        assert_books(s, sizes)
    for _ in range(2):  # a reads every fact again: each comes up from the disk or the host
        for i in range(40):
            assert_same(s.get("a", f"a{i}"), make_fact(4, seed=100 + i))
    assert_books(s, sizes)
    assert [s.tier_of("b", f"b{i}") for i in range(3)] == ["host", "device", "device"]
    assert s.bytes_used("a")["device"] == 2 * one and s.bytes_used("a")["host"] == 3 * one
    before = s.stats()["hits"]
    for i in (2, 1, 0):
        assert_same(s.get("b", f"b{i}"), make_fact(4, seed=i))
    after = s.stats()["hits"]
    assert {t: after[t] - before[t] for t in after} == {"device": 2, "host": 1, "disk": 0}
    assert_books(s, sizes)


def test_a_user_alone_is_plain_lru_in_every_memory_tier(tmp_path):
    """The fair rule changes nothing for one user: random puts and gets through a device and a host tier of 3
    facts each leave every fact in the tier a plain LRU over the two (written out below) puts it in."""
    one = make_fact(3).nbytes
    s = store(tmp_path, host_tier=True, device_budget_bytes=3 * one, host_budget_bytes=3 * one)
    device: list[str] = []  # least recently used first
    host: list[str] = []

    def demote(f):  # device -> host, the host's least recently used out to disk
        device.remove(f)
        if len(host) == 3:
            host.pop(0)
        host.append(f)

    def to_device(f):
        for tier in (device, host):
            if f in tier:
                tier.remove(f)
        if len(device) == 3:
            demote(device[0])
        device.append(f)

    rnd = random.Random(7)
    written = set()
    for step in range(300):
        f = f"f{rnd.randrange(10)}"
        if f not in written or rnd.random() < 0.2:
            s.put("solo", f, make_fact(3, seed=step))
            written.add(f)
        else:
            s.get("solo", f)
        to_device(f)
        tiers = {g: "device" if g in device else "host" if g in host else "disk" for g in written}
        assert {g: s.tier_of("solo", g) for g in written} == tiers, f"step {step}"


def test_the_shared_prefix_chunk_leaves_a_tier_only_when_nothing_else_is_left(tmp_path):
    """The prefix chunk every request reads (SHARED_USER_ID's) is one large entry, the largest holder of every
    tier here, and is never touched while ten users churn their facts through the device and disk budgets: it
    stays on the device and keeps its file. With one LRU for the device and the largest holder first on the disk
    (before), it lost its file and was then evicted out of memory: gone. It leaves a tier only for a fact that
    cannot fit beside it when no other fact is left there, and is then read from its file."""
    from inferscale_core.types import SHARED_USER_ID

    prefix, small = make_fact(8, seed=99), make_fact(2).nbytes
    prefix_file = len(FactStore._file_data(SHARED_USER_ID, "prefix", prefix))
    one_file = len(FactStore._file_data("user-0", "f0", make_fact(2)))
    s = store(tmp_path, device_budget_bytes=prefix.nbytes + 3 * small, disk_budget_bytes=prefix_file + 4 * one_file)
    s.put(SHARED_USER_ID, "prefix", prefix)
    sizes = {(SHARED_USER_ID, "prefix"): prefix.nbytes}
    for round_ in range(3):
        for u in range(10):
            for f in ("f0", "f1"):
                s.put(f"user-{u}", f, make_fact(2, seed=10 * u + round_))
                sizes[f"user-{u}", f] = small
                s.get(f"user-{u}", f)
            assert s.tier_of(SHARED_USER_ID, "prefix") == "device" and s._path(SHARED_USER_ID, "prefix").exists()
            assert_books(s, {k: v for k, v in sizes.items() if s.contains(*k)})
    assert s.stats()["disk_collected"] > 0 and s.stats()["demotions"] > 0  # the users' facts did churn
    for u in s.users():
        if u != SHARED_USER_ID:
            s.delete_user(u)
    s.put("big", "f", make_fact(7, seed=5))  # 7 tokens + the prefix's 8 > the device's 14: nothing else to evict
    assert s.tier_of(SHARED_USER_ID, "prefix") == "disk" and s.tier_of("big", "f") == "device"
    assert_same(s.get(SHARED_USER_ID, "prefix"), prefix)  # read back from its file
    assert s.tier_of(SHARED_USER_ID, "prefix") == "device" and s.tier_of("big", "f") == "disk"


def test_byte_books_stay_right_through_evictions_deletes_and_replacements(tmp_path):
    """Many tenants with facts of every size, replaced and deleted at random, through three budgeted tiers: after
    every call the bytes each tier and each user is counted for are what its facts take, and no tier is over."""
    rnd = random.Random(31)
    kv = make_fact(1).nbytes  # per token
    s = store(tmp_path, host_tier=True, device_budget_bytes=12 * kv, host_budget_bytes=20 * kv,
              disk_budget_bytes=6 * len(FactStore._file_data("t0", "f0", make_fact(5))))
    sizes: dict[tuple[str, str], int] = {}
    for step in range(250):
        user, f = f"t{rnd.randrange(6)}", f"f{rnd.randrange(8)}"
        op = rnd.random()
        if op < 0.5 or not s.contains(user, f):
            tokens = rnd.randint(1, 8)
            s.put(user, f, make_fact(tokens, seed=step))
            sizes[user, f] = tokens * kv
        elif op < 0.9:
            s.get(user, f)
        else:
            s.delete(user, f)
        assert_books(s, {k: v for k, v in sizes.items() if s.contains(*k)})
    assert s.stats()["disk_collected"] > 0 and s.stats()["demotions"] > 0


def files_in(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def test_write_behind_keeps_the_fact_in_memory_and_writes_its_file_later(tmp_path):
    """put(write_file=False) (the connector worker's loads) writes no file; write_back writes it once, and the
    reopened store serves it bit for bit. Until then a demotion out of memory forgets it: a clean miss."""
    s = store(tmp_path)
    fact = make_fact(5, seed=1)
    s.put("u", "a", fact, write_file=False)
    assert files_in(tmp_path) == [] and s.tier_of("u", "a") == "device"
    assert s.bytes_used()["disk"] == 0
    assert s.write_back("u", "a") is True
    assert files_in(tmp_path) == [s._path("u", "a").name] and s.bytes_used()["disk"] == fact.nbytes
    assert s.write_back("u", "a") is False  # already on disk: nothing written twice
    assert_same(FactStore.open(tmp_path).get("u", "a"), fact)

    kv = fact.nbytes
    small = store(tmp_path / "small", device_budget_bytes=kv)
    small.put("u", "a", make_fact(5, seed=1), write_file=False)
    small.put("u", "b", make_fact(5, seed=2))  # a leaves memory before its file was written: gone
    assert small.fact_ids("u") == ["b"] and small.write_back("u", "a") is False
    with pytest.raises(UnknownFactError):
        small.get("u", "a")


def test_a_write_back_loses_to_a_delete_or_a_newer_put_made_while_it_wrote(tmp_path, monkeypatch):
    """The file is written outside the store's lock; a delete (of the fact, or of the user) or a newer put that
    lands meanwhile wins: no file of the deleted fact or of the older copy is left, not even its temporary file."""
    s = store(tmp_path)
    write = FactStore._write_unplaced
    meanwhile = {}

    def slow_write(tmp, data):  # what another thread does while the file is written
        write(tmp, data)
        meanwhile["action"]()

    monkeypatch.setattr(FactStore, "_write_unplaced", staticmethod(slow_write))
    for name, action in (("delete", lambda: s.delete("u", "a")),
                         ("delete_user", lambda: s.delete_user("u")),
                         ("newer put", lambda: s.put("u", "a", make_fact(3, seed=9), write_file=False))):
        s.put("u", "a", make_fact(4, seed=1), write_file=False)
        meanwhile["action"] = action
        assert s.write_back("u", "a") is False, name
        assert files_in(tmp_path) == [], name
        if name == "newer put":  # the newer copy is what is served, and its own write_back writes it
            monkeypatch.setattr(FactStore, "_write_unplaced", staticmethod(write))
            assert s.write_back("u", "a") is True
            assert_same(FactStore.open(tmp_path).get("u", "a"), make_fact(3, seed=9))
        else:
            assert not s.contains("u", "a") and not (tmp_path / s._path("u", "a").parent.name).exists(), name


def test_temporary_files_a_crash_left_are_removed_at_open(tmp_path):
    s = store(tmp_path)
    s.put("u", "a", make_fact(4, seed=1))
    folder = s._path("u", "a").parent
    (folder / "x.safetensors.tmp").write_bytes(b"half a fact")
    (folder / "y.safetensors.140.behind").write_bytes(b"a deleted fact's bytes")
    reopened = FactStore.open(tmp_path)
    assert reopened.fact_ids("u") == ["a"] and files_in(tmp_path) == [s._path("u", "a").name]
