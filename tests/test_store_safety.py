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
from conftest import store_backend
from kvmem.store import SCHEMA_VERSION, Store, StoreError, Write


@pytest.fixture(autouse=True, params=["local", "object", "postgres", "s3"])
def backend(request, monkeypatch):
    """Every store test runs on four backends: the local directory (SQLite rows, segment files beside them); the
    same with its segments in an object store reached through obstore (a ``file://`` URL); the shared store:
    rows in PostgreSQL (a real cluster, ``conftest.postgres``), segments in that object store; and the shared
    store with its segments on a real S3 server over HTTP with SigV4 keys (``conftest.s3``: ``rclone serve s3``,
    ``s3://kvmem/PREFIX``)."""
    return store_backend(request, monkeypatch)


@pytest.fixture
def sqlite_only(backend):
    if backend in ("postgres", "s3"):
        pytest.skip("SQLite's own behaviour (WAL, PRAGMA user_version); PostgreSQL's is checked by its own tests")


WORKER = [sys.executable, str(Path(__file__).with_name("store_worker.py"))]


@pytest.fixture
def store(tmp_path) -> Store:
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    return st


def test_put_user_refuses_mismatched_counts_and_writes_nothing(store):
    files = sorted(store.segments.names())
    facts, kv, emb = sw.generation("u", 2)
    for keys, values, e, what in (
        (kv[:2], kv, emb, "2 keys"),
        (kv, kv[:1], emb, "1 values"),
        (kv, kv, emb[:2], "2 embeddings"),
    ):
        with pytest.raises(StoreError, match=f"3 facts but .*{what}"):
            store.writes.put_user("u", facts, keys, values, e, window=0)
    bad_values = [v[:, :, :2] for v in kv]
    with pytest.raises(StoreError, match="values"):
        store.writes.put_user("u", facts, kv, bad_values, emb, window=0)
    assert sorted(store.segments.names()) == files
    assert sw.check(store.reads.snapshot("u")) == 1


def test_sqlite_wal_busy_timeout_schema_version(store, sqlite_only):
    db = sqlite3.connect(store.root / "meta.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.busy_timeout_s >= 10
    db.execute("PRAGMA user_version=1")
    db.commit()
    with pytest.raises(StoreError, match="schema version 1 is not 4"):
        Store.open(store.root)


def test_open_never_writes(store, sqlite_only):
    """Opening runs no DDL: a table dropped from outside is not silently re-created (the old open did)."""
    store.close()
    db = sqlite3.connect(store.root / "meta.sqlite")
    db.execute("DROP TABLE facts")
    db.commit()
    st = Store.open(store.root)
    with pytest.raises(sqlite3.OperationalError, match="no such table: facts"):
        st.reads.snapshot("u")
    assert db.execute("SELECT name FROM sqlite_master WHERE name='facts'").fetchone() is None


def test_failed_write_keeps_old_version_and_leaves_no_orphan(store, monkeypatch):
    """A writer that dies after its segment file is written but before the commit (like a kill, no cleanup):
    the old generation stays served, and the next fsck removes the half-written file."""
    written = store.segments.put

    def dying(name, tensors, metadata):
        written(name, tensors, metadata)
        raise KeyboardInterrupt  # the segment is durable; the commit never starts

    monkeypatch.setattr(store.segments, "put", dying)
    facts, kv, emb = sw.generation("u", 2)
    with pytest.raises(KeyboardInterrupt):
        store.writes.put_user("u", facts, kv, kv, emb, window=0)
    monkeypatch.undo()
    st = Store.open(store.root)
    assert sw.check(st.reads.snapshot("u")) == 1
    assert len(store.segments.names()) == 2  # 1 live + 1 orphan
    report = st.fsck()
    assert report["ok"] == ["u"] and len(report["removed"]) == 1 and report["bad"] == {}
    assert len(store.segments.names()) == 1


def test_exit_after_the_commit_keeps_the_new_segment(store, monkeypatch):
    """SystemExit from a signal handler can land after SQLite's COMMIT, before ``commit`` returns: the new rows
    are durable, so their KV file must stay (it used to be unlinked, leaving a fact whose KV is gone)."""
    real = store.rows.commit

    def commit_then_exit(*args, **kwargs):
        real(*args, **kwargs)
        raise SystemExit(143)

    monkeypatch.setattr(store.rows, "commit", commit_then_exit)
    facts, kv, emb = sw.generation("u", 2)
    with pytest.raises(SystemExit):
        store.writes.put_user("u", facts, kv, kv, emb, window=0)
    monkeypatch.undo()
    st = Store.open(store.root)
    assert sw.check(st.reads.snapshot("u")) == 2
    report = st.fsck()
    assert report["ok"] == ["u"] and report["bad"] == {}


def test_reads_are_one_snapshot_under_a_concurrent_writer(store):
    """One process rewrites U, another writes V, a third reads U. No read may pair one
    generation's rows with another's tensors, and none may fail."""
    facts, kv, emb = sw.generation("v", 1)
    store.writes.put_user("v", facts, kv, kv, emb, window=0)
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
    assert sw.check(st.reads.snapshot("u")) == 151 and sw.check(st.reads.snapshot("v")) == 151
    assert st.fsck()["removed"] == []  # two writers, serialized: no orphan


@pytest.mark.slow
def test_kill_dash_9_during_writes(store, backend):
    """Kill a writer at random points, 12 times (8 on the other backends: the commit protocol is the same). After
    each kill the store opens, the user is at the last committed generation or the one in flight, its KV passes
    the checksum, and fsck leaves only live files."""
    rng = random.Random(0)
    root, committed, kills = str(store.root), 1, 12 if backend == "local" else 8
    for _ in range(kills):
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
        g = sw.check(st.reads.snapshot("u"))  # raises on a checksum failure or a torn pair
        assert g in (last, last + 1), (g, last)
        st.fsck()
        live = {st.segment_name("u", seg) for seg in st.reads.snapshot("u").segments}
        assert st.segments.names() == live
        committed = g
        st.close()
    assert committed >= kills + 1  # every writer committed at least once before its kill


def test_compaction_keeps_what_is_served_and_fsck_removes_what_it_replaced(tmp_path):
    """Four single-fact commits and a delete, then ``compact``: the same live facts with the same KV, from one
    segment; the change feed asks for a rebuild; the replaced segments stay for readers until fsck removes them
    (reported as replaced, not as leftovers); a reader holding the old snapshot still gathers its KV."""
    from kvmem.store import FactRecord

    st = sw.create(tmp_path / "s")
    for i in range(4):
        f = FactRecord(f"c{i}", "u", f"fact {i}", "", "", "", (1, 2, 3), 0, 0)
        k = torch.full((2, 1, 3, 64), float(i))
        st.writes.commit(Write("u", [f], [k], [-k], torch.ones(1, 4) / 2))
    st.writes.commit(Write("u", delete=["c1"]))
    before = st.reads.snapshot("u")
    v = before.version
    kb, vb = before.gather([0, 1, 2])
    st.writes.compact("u")
    after = Store.open(st.root).reads.snapshot("u")
    assert [f.fact_id for f in after.facts] == ["c0", "c2", "c3"] and len(after.segments) == 1
    ka, va = after.gather([0, 1, 2])
    assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(ka[:, :, 3:6], torch.full((2, 1, 3, 64), 2.0))
    assert st.reads.changes("u", v) is None
    assert torch.equal(before.gather([2])[0], kb[:, :, 6:9])  # the old snapshot's files are still there
    report = st.fsck()
    assert report["ok"] == ["u"] and report["removed"] == [] and len(report["replaced"]) == 4
    assert len(st.segments.names()) == 1


def test_another_models_or_dtypes_store_is_refused(store):
    from kvmem.store import StoreDtypeMismatch, StoreMismatch

    with pytest.raises(StoreDtypeMismatch, match="computed in float32, but this run computes in bfloat16"):
        Store.open(store.root, {**sw.FP, "dtype": "bfloat16"})
    with pytest.raises(StoreMismatch, match="does not match the loaded model 'tiny'.*weights_sha256"):
        Store.open(store.root, {**sw.FP, "weights_sha256": "def"})
    assert Store.open(store.root, dict(sw.FP)).reads.snapshot("u").version == store.reads.version("u")


def test_fsck_reports_a_corrupt_user(store):
    (seg,) = store.reads.snapshot("u").segments
    data = bytearray(sw.get_object(store, store.segment_name("u", seg)))
    data[-5] ^= 0xFF  # one flipped byte inside a tensor
    sw.put_object(store, store.segment_name("u", seg), bytes(data))
    report = Store.open(store.root).fsck()
    assert report["ok"] == [] and "fails its checksum" in report["bad"]["u"]


def test_fsck_command(store, tmp_path):
    from typer.testing import CliRunner

    from kvmem.cli import app

    sw.put_object(store, "u.deadbeef0000.kv.safetensors", b"half a write")
    res = CliRunner().invoke(app, ["store", "fsck", "--store", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report == {
        "users": 1,
        "ok": ["u"],
        "bad": {},
        "removed": ["u.deadbeef0000.kv.safetensors"],
        "replaced": [],
        "derived": {},
    }
    res = CliRunner().invoke(app, ["store", "fsck", "--store", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no kvmem store" in res.output


def test_deleted_facts_are_never_served_under_a_concurrent_writer(tmp_path, backend):
    """One writer makes 1,200 single-fact adds and deletes while this process retrieves and gathers
    KV in a loop; every served fact id is checked against the history: added at or before the version read,
    and not deleted by then."""
    from kvmem.retrieve import UserIndex

    st = sw.create(tmp_path / "s")
    root = str(st.root)
    writer = subprocess.Popen(WORKER + ["churn", root, "u", "1200"])
    reader, served, index = Store.open(root), [], UserIndex(4)
    while writer.poll() is None or not served:
        if reader.reads.version("u") is None:
            continue
        ukv = reader.reads.snapshot("u")
        index.sync(reader, ukv)
        _, rows = index.search(torch.randn(4), 5, ukv)
        keys, _ = ukv.gather(list(rows))
        assert keys.shape[2] == 2 * len(rows)
        assert all(bool((ukv.fact_kv(r)[0] == float(ukv.facts[r].fact_id[1:])).all()) for r in rows)
        served.append((int(ukv.version), [ukv.facts[r].fact_id for r in rows]))
    assert writer.wait() == 0
    added, deleted = {}, {}
    history = reader.rows.execute("SELECT fact_id, event, version FROM history").fetchall()
    for fid, event, version in history:
        (added if event == "ADD" else deleted)[fid] = version
    assert len(added) > 600 and len(deleted) > 300
    reads, versions = (10, 5) if backend == "s3" else (50, 20)  # each S3 read is a round trip: fewer fit
    assert len(served) > reads and len({v for v, _ in served}) > versions  # many versions were read mid-churn
    for version, ids in served:
        for fid in ids:
            assert added[fid] <= version < deleted.get(fid, 1 << 62), (fid, version)


def test_one_store_object_shared_by_threads(store, backend):
    """The SQLite connection is shared: a reader thread and a writer thread interleave without a nested-
    transaction error and without reading the writer's uncommitted rows."""
    errors, seen = [], []
    reads = 100 if backend == "s3" else 300  # each S3 snapshot after drop_caches is round trips: fewer fit

    def write():
        try:
            for g in range(2, 40):
                facts, kv, emb = sw.generation("u", g)
                store.writes.put_user("u", facts, kv, kv, emb, window=0)
        except Exception as exc:
            errors.append(repr(exc))

    def read():
        try:
            for _ in range(reads):
                store.reads.forget()
                seen.append(sw.check(store.reads.snapshot("u")))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [] and len(seen) == reads and sw.check(store.reads.snapshot("u")) == 39


def test_index_sync_racing_a_writer_matches_its_snapshot(store):
    """A commit between a snapshot and the index's delta read (delete b, add c) must not leave the index with
    c instead of b for that snapshot."""
    from kvmem.retrieve import UserIndex

    index = UserIndex(4)
    index.sync(store, store.reads.snapshot("u"))
    facts, kv, emb = sw.generation("u", 2)
    store.writes.commit(Write("u", facts[:1], kv[:1], kv[:1], emb[:1]))
    snap = store.reads.snapshot("u")  # 4 facts
    store.writes.commit(Write("u", facts[1:2], kv[1:2], kv[1:2], emb[1:2], delete=[snap.facts[0].fact_id]))
    index.sync(store, snap)
    import faiss

    assert set(faiss.vector_to_array(index.index.id_map).tolist()) == set(snap.position)


def test_delete_all_twice_and_junk_in_the_users_folder(store):
    if store.segment_path("u", "x") is not None:  # an object store has no directories
        store.segment_path("u", "x").parent.joinpath("a-directory").mkdir()
    store.writes.delete_user("u")
    store.writes.delete_user("u")  # nothing live: a no-op commit, not an error
    store.writes.commit(Write("t", turns=[{"content": "only turns"}]))
    store.writes.delete_user("t")
    assert (
        store.reads.users() == [] and store.reads.history(sw.generation("u", 1)[0][0].fact_id)[-1]["event"] == "DELETE"
    )
    facts, kv, emb = sw.generation("u", 5)
    store.writes.commit(Write("u", facts, kv, kv, emb))  # writes go on despite the directory _gc cannot remove
    assert sw.check(store.reads.snapshot("u")) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_segment_layouts_read_exactly(tmp_path, dtype):
    """``read_spans`` on token-major segments (one range per fact) and on the older [L, H, n, D] files, whose
    reads are whole tensors or per-(layer, head) runs: every path gives exactly the stored K/V."""
    from safetensors.torch import save_file

    from kvmem.store import kvfile as segments  # the segment file format

    k = torch.randn(3, 2, 40, 8).to(dtype)
    v = torch.randn(3, 2, 40, 8).to(dtype)
    spans = [(0, 3), (7, 1), (39, 1), (10, 0), (12, 20)]
    tm, legacy = tmp_path / "tm.safetensors", tmp_path / "old.safetensors"
    tensors, meta = segments.to_file(k, v)
    save_file(tensors, str(tm), metadata=meta)
    save_file({"keys": k.contiguous(), "values": v.contiguous()}, str(legacy))
    for path, whole_bytes in ((tm, None), (legacy, 1 << 20), (legacy, 0)):  # 0: legacy per-run reads
        old, segments.WHOLE_READ_BYTES = segments.WHOLE_READ_BYTES, whole_bytes or segments.WHOLE_READ_BYTES
        try:
            with segments.FileHandle(path) as h:
                lay = segments.read_layout(h)
                assert lay.shape == (3, 2, 40, 8) and lay.token_major == (path == tm) and lay.nbytes == 2 * k.nbytes
                got = segments.read_spans(h, lay, spans if whole_bytes != 0 else [(7, 1)])
        finally:
            segments.WHOLE_READ_BYTES = old
        for (gk, gv), (o, n) in zip(((g.keys, g.values) for g in got), spans if whole_bytes != 0 else [(7, 1)]):
            assert torch.equal(gk, k[:, :, o : o + n]) and torch.equal(gv, v[:, :, o : o + n]) and gk.is_contiguous()
    with segments.FileHandle(tm) as h, pytest.raises(segments.SegmentCorrupt, match="outside"):
        segments.read_spans(h, segments.read_layout(h), [(38, 3)])


def test_reads_by_fact_are_exact_and_a_file_changed_after_its_first_read_is_refused(tmp_path):
    """Gathers read only the asked facts' spans (pread, no mapping) and give exactly the stored K/V. A segment
    that shrinks or has bytes flipped after this process verified and read it is refused on the next uncached
    read (StoreError), never served; the process survives (a memory-mapped reader died of SIGBUS here)."""
    from safetensors.torch import load

    from kvmem.store import FactRecord

    st = sw.create(tmp_path / "s")
    for i in range(3):  # three segments of distinct random values
        facts = [FactRecord(f"f{i}{j}", "u", f"fact {i}{j}", "", "", "", tuple(range(3 + j)), 0, 0) for j in range(4)]
        kv = [torch.randn(2, 1, 3 + j, 64) for j in range(4)]
        st.writes.commit(
            Write("u", facts, kv, [x * 2 for x in kv], torch.nn.functional.normalize(torch.randn(4, 4), dim=1))
        )
    ukv = Store.open(st.root).reads.snapshot("u")
    rows = [5, 0, 11, 7]
    keys, values = ukv.gather(rows)
    at = 0
    for r in rows:  # against the whole files, loaded independently
        f = ukv.facts[r]
        t = load(sw.get_object(st, st.segment_name("u", f.segment)))  # token-major [n, L, H, D] on disk
        span = slice(f.token_offset, f.token_offset + f.num_tokens)
        assert torch.equal(keys[:, :, at : at + f.num_tokens], t["keys"].permute(1, 2, 0, 3)[:, :, span])
        assert torch.equal(values[:, :, at : at + f.num_tokens], t["values"].permute(1, 2, 0, 3)[:, :, span])
        at += f.num_tokens
    assert keys.shape[2] == sum(ukv.facts[r].num_tokens for r in rows) and values.abs().sum() > 0
    # read once (verified), then changed in place: the next uncached read is refused, the cached one stands
    reader = Store.open(st.root, cache_bytes=1)  # 1 byte: nothing is cached, every gather reads the files
    r = reader.reads.snapshot("u")
    first = r.fact_kv(0)
    seg0 = st.segment_name("u", r.facts[0].segment)
    sw.put_object(st, seg0, sw.get_object(st, seg0)[:-64])  # truncated after this process read it
    with pytest.raises(StoreError, match="truncated|checksum"):
        r.fact_kv(0)
    seg1 = st.segment_name("u", r.facts[4].segment)
    r.fact_kv(4)
    data = bytearray(sw.get_object(st, seg1))
    data[-40:] = bytes(b ^ 0x5A for b in data[-40:])  # same size
    sw.put_object(st, seg1, bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        r.fact_kv(4)
    assert torch.equal(r.fact_kv(8)[0], ukv.fact_kv(8)[0])  # the untouched segment still reads
    assert first[0].shape == (2, 1, 3, 64)


def test_both_segment_stores_satisfy_the_seam(tmp_path):
    """``LocalSegments``, ``ObjectSegments`` and ``CachedSegments`` (a disk cache in front of an object store)
    implement every method of ``SegmentStore`` with its parameters
    (and their handles ``SegmentHandle``), and behave the same through it: put returns the file's SHA-256, open
    reads it back, names and bytes list it, delete removes it (twice is no error), a missing name is
    FileNotFoundError."""
    import hashlib

    from kvmem.engines.base import check_implements
    from kvmem.store import segments

    for impl, role in (
        (segments.LocalSegments, segments.SegmentStore),
        (segments.ObjectSegments, segments.SegmentStore),
        (segments.CachedSegments, segments.SegmentStore),
        (segments.FileHandle, segments.SegmentHandle),
        (segments.ObjectHandle, segments.SegmentHandle),
    ):
        assert check_implements(impl, role) == [], impl
    (tmp_path / "local").mkdir()
    k = torch.randn(2, 1, 5, 8)
    tensors, meta = segments.to_file(k, 2 * k)
    cached = segments.CachedSegments(segments.ObjectSegments((tmp_path / "obj2").as_uri()), tmp_path / "cache", 1 << 20)
    for store in (
        segments.LocalSegments(tmp_path / "local"),
        segments.ObjectSegments((tmp_path / "obj").as_uri()),
        cached,
    ):
        sha = store.put("u.seg.kv.safetensors", tensors, meta)
        path = store.local_path("u.seg.kv.safetensors")
        assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
        assert store.names() == {"u.seg.kv.safetensors"} and store.nbytes() == path.stat().st_size
        with store.open("u.seg.kv.safetensors") as h:
            segments.verify(h, sha)
            lay = segments.read_layout(h)
            (span,) = segments.read_spans(h, lay, [(1, 3)])
            gk, gv = span.keys, span.values
        assert torch.equal(gk, k[:, :, 1:4]) and torch.equal(gv, 2 * k[:, :, 1:4])
        store.delete("u.seg.kv.safetensors")
        store.delete("u.seg.kv.safetensors")
        assert store.names() == set()
        with pytest.raises(FileNotFoundError):
            store.open("u.seg.kv.safetensors")
