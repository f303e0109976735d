"""The store under faults: counts checked before anything is written, WAL + busy timeout, no DDL on open, schema
version, one consistent snapshot per read under a concurrent writer, serialized writers, crash and kill -9 safety
(every kill leaves the previous or the new generation, checksummed, and fsck leaves no orphan)."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import store_worker as sw
from kvmem.store import SCHEMA_VERSION, Store, StoreError

WORKER = [sys.executable, str(Path(__file__).with_name("store_worker.py"))]


@pytest.fixture
def store(tmp_path) -> Store:
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    st.put_user("u", facts, kv, kv, emb, window=0)
    return st


def test_put_user_refuses_mismatched_counts_and_writes_nothing(store):
    files = sorted(p.name for p in (store.root / "users").iterdir())
    facts, kv, emb = sw.generation("u", 2)
    for keys, values, e, what in (
        (kv[:2], kv, emb, "2 keys"),
        (kv, kv[:1], emb, "1 values"),
        (kv, kv, emb[:2], "2 embeddings"),
    ):
        with pytest.raises(StoreError, match=f"3 facts but .*{what}"):
            store.put_user("u", facts, keys, values, e, window=0)
    bad_values = [v[:, :, :2] for v in kv]
    with pytest.raises(StoreError, match="values"):
        store.put_user("u", facts, kv, bad_values, emb, window=0)
    assert sorted(p.name for p in (store.root / "users").iterdir()) == files
    assert sw.check(store.snapshot("u")) == 1


def test_sqlite_wal_busy_timeout_schema_version(store):
    db = sqlite3.connect(store.root / "meta.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.busy_timeout_s >= 10
    db.execute("PRAGMA user_version=1")
    db.commit()
    with pytest.raises(StoreError, match="schema version 1 is not 3"):
        Store.open(store.root)


def test_open_never_writes(store):
    """Opening runs no DDL: a table dropped from outside is not silently re-created (the old open did)."""
    store.close()
    db = sqlite3.connect(store.root / "meta.sqlite")
    db.execute("DROP TABLE facts")
    db.commit()
    st = Store.open(store.root)
    with pytest.raises(sqlite3.OperationalError, match="no such table: facts"):
        st.snapshot("u")
    assert db.execute("SELECT name FROM sqlite_master WHERE name='facts'").fetchone() is None


def test_failed_write_keeps_old_version_and_leaves_no_orphan(store, monkeypatch):
    """A writer that dies after its segment file is written but before the commit (like a kill, no cleanup):
    the old generation stays served, and the next fsck removes the half-written file."""
    import kvmem.store as ks

    def dying(path):
        raise KeyboardInterrupt  # after save_file, before the commit

    monkeypatch.setattr(ks, "fsync_dir", dying)
    facts, kv, emb = sw.generation("u", 2)
    with pytest.raises(KeyboardInterrupt):
        store.put_user("u", facts, kv, kv, emb, window=0)
    monkeypatch.undo()
    st = Store.open(store.root)
    assert sw.check(st.snapshot("u")) == 1
    assert len(list((store.root / "users").iterdir())) == 2  # 1 live + 1 orphan
    report = st.fsck()
    assert report["ok"] == ["u"] and len(report["removed"]) == 1 and report["bad"] == {}
    assert len(list((store.root / "users").iterdir())) == 1


def test_exit_after_the_commit_keeps_the_new_segment(store, monkeypatch):
    """SystemExit from a signal handler can land after SQLite's COMMIT, before ``commit`` returns: the new rows
    are durable, so their KV file must stay (it used to be unlinked, leaving a fact whose KV is gone)."""
    real = Store._commit_rows

    def commit_then_exit(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise SystemExit(143)

    monkeypatch.setattr(Store, "_commit_rows", commit_then_exit)
    facts, kv, emb = sw.generation("u", 2)
    with pytest.raises(SystemExit):
        store.put_user("u", facts, kv, kv, emb, window=0)
    monkeypatch.undo()
    st = Store.open(store.root)
    assert sw.check(st.snapshot("u")) == 2
    report = st.fsck()
    assert report["ok"] == ["u"] and report["bad"] == {}


def test_reads_are_one_snapshot_under_a_concurrent_writer(store):
    """One process rewrites U, another writes V, a third reads U. No read may pair one
    generation's rows with another's tensors, and none may fail."""
    facts, kv, emb = sw.generation("v", 1)
    store.put_user("v", facts, kv, kv, emb, window=0)
    root = str(store.root)
    procs = [
        subprocess.Popen(WORKER + ["write", root, "u", "2", "150"], stdout=subprocess.DEVNULL),
        subprocess.Popen(WORKER + ["write", root, "v", "2", "150"], stdout=subprocess.DEVNULL),
    ]
    reader = subprocess.run(WORKER + ["read", root, "u", "6"], capture_output=True, text=True, timeout=120)
    for p in procs:
        assert p.wait(timeout=120) == 0
    r = json.loads(reader.stdout)
    assert r["reads"] > 50 and r["generations"] > 1, r  # it really read while the writer wrote
    assert (r["torn"], r["failed"]) == (0, 0), r
    st = Store.open(root)
    assert sw.check(st.snapshot("u")) == 151 and sw.check(st.snapshot("v")) == 151
    assert st.fsck()["removed"] == []  # two writers, serialized: no orphan


def test_kill_dash_9_during_writes(store):
    """Kill a writer at random points, 20 times. After each kill the store opens, the user is
    at the last committed generation or the one in flight, its KV passes the checksum, and fsck leaves only
    live files."""
    rng = random.Random(0)
    root, committed = str(store.root), 1
    for _ in range(20):
        p = subprocess.Popen(
            WORKER + ["write", root, "u", str(committed + 1), "50", "--big"], stdout=subprocess.PIPE, text=True
        )
        first = p.stdout.readline()  # one generation committed: the kill lands among the writes that follow
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        done = [int(x) for x in (first + out).split()]
        last = done[-1] if done else committed
        st = Store.open(root)
        g = sw.check(st.snapshot("u"))  # raises on a checksum failure or a torn pair
        assert g in (last, last + 1), (g, last)
        st.fsck()
        live = {st.segment_path("u", seg).name for seg in st.snapshot("u").segments}
        assert {p.name for p in (Path(root) / "users").iterdir()} == live
        committed = g
        st.close()
    assert committed >= 21  # every writer committed at least once before its kill


def test_fsck_reports_a_corrupt_user(store):
    (seg,) = store.snapshot("u").segments
    kv_file = store.segment_path("u", seg)
    data = bytearray(kv_file.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside a tensor
    kv_file.write_bytes(bytes(data))
    report = Store.open(store.root).fsck()
    assert report["ok"] == [] and "fails its checksum" in report["bad"]["u"]


def test_fsck_command(store):
    from typer.testing import CliRunner

    from kvmem.cli import app

    (store.root / "users" / "u.deadbeef0000.kv.safetensors").write_bytes(b"half a write")
    res = CliRunner().invoke(app, ["store", "fsck", "--store", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"users": 1, "ok": ["u"], "bad": {}, "removed": ["u.deadbeef0000.kv.safetensors"]}
    res = CliRunner().invoke(app, ["store", "fsck", "--store", str(store.root / "nope")])
    assert res.exit_code == 2 and "no kvmem store" in res.output


def test_deleted_facts_are_never_served_under_a_concurrent_writer(tmp_path):
    """One writer makes 2,000 single-fact adds and deletes while this process retrieves and gathers
    KV in a loop; every served fact id is checked against the history: added at or before the version read,
    and not deleted by then."""
    from kvmem.retrieve import UserIndex

    st = sw.create(tmp_path / "s")
    root = str(st.root)
    writer = subprocess.Popen(WORKER + ["churn", root, "u", "2000"])
    reader, served, index = Store.open(root), [], UserIndex(4)
    while writer.poll() is None or not served:
        if reader.version("u") is None:
            continue
        ukv = reader.snapshot("u")
        index.sync(reader, ukv)
        _, rows = index.search(torch.randn(4), 5, ukv)
        keys, _ = ukv.gather(list(rows))
        assert keys.shape[2] == 2 * len(rows)
        assert all(bool((ukv.fact_kv(r)[0] == float(ukv.facts[r].fact_id[1:])).all()) for r in rows)
        served.append((int(ukv.version), [ukv.facts[r].fact_id for r in rows]))
    assert writer.wait() == 0
    added, deleted = {}, {}
    history = sqlite3.connect(reader.root / "meta.sqlite").execute("SELECT fact_id, event, version FROM history")
    for fid, event, version in history:
        (added if event == "ADD" else deleted)[fid] = version
    assert len(added) > 1000 and len(deleted) > 500
    assert len(served) > 50 and len({v for v, _ in served}) > 20  # many versions were read mid-churn
    for version, ids in served:
        for fid in ids:
            assert added[fid] <= version < deleted.get(fid, 1 << 62), (fid, version)


def test_one_store_object_shared_by_threads(store):
    """The SQLite connection is shared: a reader thread and a writer thread interleave without a nested-
    transaction error and without reading the writer's uncommitted rows."""
    errors, seen = [], []

    def write():
        try:
            for g in range(2, 40):
                facts, kv, emb = sw.generation("u", g)
                store.put_user("u", facts, kv, kv, emb, window=0)
        except Exception as exc:
            errors.append(repr(exc))

    def read():
        try:
            for _ in range(300):
                store.drop_caches()
                seen.append(sw.check(store.snapshot("u")))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [] and len(seen) == 300 and sw.check(store.snapshot("u")) == 39


def test_index_sync_racing_a_writer_matches_its_snapshot(store):
    """A commit between a snapshot and the index's delta read (delete b, add c) must not leave the index with
    c instead of b for that snapshot."""
    from kvmem.retrieve import UserIndex

    index = UserIndex(4)
    index.sync(store, store.snapshot("u"))
    facts, kv, emb = sw.generation("u", 2)
    store.commit("u", facts[:1], kv[:1], kv[:1], emb[:1])
    snap = store.snapshot("u")  # 4 facts
    store.commit("u", facts[1:2], kv[1:2], kv[1:2], emb[1:2], delete=[snap.facts[0].fact_id])
    index.sync(store, snap)
    import faiss

    assert set(faiss.vector_to_array(index.index.id_map).tolist()) == set(snap.position)


def test_delete_all_twice_and_junk_in_the_users_folder(store):
    (store.root / "users" / "a-directory").mkdir()
    store.delete_user("u")
    store.delete_user("u")  # nothing live: a no-op commit, not an error
    store.commit("t", turns=[{"content": "only turns"}])
    store.delete_user("t")
    assert store.users() == [] and store.history(sw.generation("u", 1)[0][0].fact_id)[-1]["event"] == "DELETE"
    facts, kv, emb = sw.generation("u", 5)
    store.commit("u", facts, kv, kv, emb)  # writes go on despite the directory _gc cannot remove
    assert sw.check(store.snapshot("u")) == 5


def test_mmap_snapshot_reads_the_same_kv_and_refuses_truncation(tmp_path):
    """The vLLM worker's reads (``kv="mmap"``) give exactly the stored K/V, and a truncated segment is an
    error, not garbage."""
    from kvmem.store import FactRecord, mmap_segment

    st = sw.create(tmp_path / "s")
    for i in range(3):  # three segments of distinct random values
        facts = [FactRecord(f"f{i}{j}", "u", f"fact {i}{j}", "", "", "", tuple(range(3 + j)), 0, 0) for j in range(4)]
        kv = [torch.randn(2, 1, 3 + j, 64) for j in range(4)]
        st.commit("u", facts, kv, [x * 2 for x in kv], torch.nn.functional.normalize(torch.randn(4, 4), dim=1))
    full = st.snapshot("u")
    mm = Store.open(st.root).snapshot("u", kv="mmap")
    assert mm.mmap and not full.mmap and [f.fact_id for f in mm.facts] == [f.fact_id for f in full.facts]
    rows = [5, 0, 11, 7]
    for a, b in zip(mm.gather(rows), full.gather(rows)):
        assert torch.equal(a, b) and a.abs().sum() > 0
    seg = st.segment_path("u", full.facts[0].segment)
    assert torch.equal(mmap_segment(seg)[1], full.segments[full.facts[0].segment][1])
    bad = tmp_path / "trunc.kv.safetensors"
    bad.write_bytes(seg.read_bytes()[:-10])
    with pytest.raises(StoreError, match="truncated"):
        mmap_segment(bad)
