"""What an erasure leaves outside the rows it blanks: the SQLite WAL while a reader holds an older snapshot, the
erased scope's id in the store's tables, and the in-memory caches (snapshots, facts' KV, vector indexes) of
another process's store object on the same store. Synthetic stores (``store_worker``): no model."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest

import store_worker as sw
from kvmem.store import Store, UnknownUser, Write, sqlite_rows


def test_a_checkpoint_a_reader_blocks_is_recorded_and_retried_by_the_next_commit(tmp_path, monkeypatch):
    """A reader holding a snapshot taken before an erasure keeps the WAL (and the erased text in it): the
    erasure's checkpoint retries briefly, then records it; the next commit, once the reader is done, completes
    it: the WAL is empty and holds no byte of the text (the old code ignored the checkpoint's busy result)."""
    monkeypatch.setattr(sqlite_rows, "SCRUB_WAIT_S", 0.05)
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    wal = tmp_path / "s" / "meta.sqlite-wal"
    reader = sqlite3.connect(tmp_path / "s" / "meta.sqlite", isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 3  # its snapshot: before the erasure
    st.writes.erase("u", [facts[0].fact_id])
    assert st.rows.scrub_pending()
    assert st.rows.execute("SELECT COUNT(*) FROM meta WHERE key='scrub:pending'").fetchone()[0] == 1
    assert b"fact 0 of gen 1" in wal.read_bytes()  # the reader's pages: still there
    reader.execute("COMMIT")
    reader.close()
    facts, kv, emb = sw.generation("other", 2)  # texts "fact i of gen 2"
    st.writes.put_user("other", facts, kv, kv, emb, window=0)  # any commit retries it
    assert not st.rows.scrub_pending()
    assert wal.stat().st_size == 0
    for path in (tmp_path / "s").glob("meta.sqlite*"):
        assert b"fact 0 of gen 1" not in path.read_bytes(), path


def _facts(user: str, g: int):
    facts, kv, emb = sw.generation(user, g)
    return [dataclasses.replace(f, fact_id=f"{f.fact_id[-6:]}-{i}") for i, f in enumerate(facts)], kv, emb


def test_an_erased_scopes_id_is_in_no_row_and_no_file(tmp_path):
    """Erasing every scope of a user (what ``delete_all`` / mem0's ``delete_users`` run per scope: the erasure,
    then the compaction of the segments that held its KV) leaves its id (an email) in no table and no byte of the
    store's files; the history events stay, under the tenant alone; the scope written again starts afresh with a
    newer version. The old code kept the id in ``users``, ``scopes``, ``history`` and ``meta``."""
    from kvmem.ingest import erase_facts
    from kvmem.store import ALL

    email = "alice.liddell@example.com"
    st = sw.create(tmp_path / "s")
    st.writes.retire_after_s = 0
    scopes = [f"acme:{email}", f"acme:{email}/agent:coach"]
    for g, user in enumerate(scopes, 1):
        facts, kv, emb = _facts(user, g)
        st.writes.commit(Write(user, facts, kv, kv, emb, turns=[{"content": "hello"}]))
    keep, kv, emb = _facts("acme:bob", 3)
    st.writes.commit(Write("acme:bob", keep, kv, kv, emb))
    old = int(st.reads.version(scopes[0]))
    gone = [f.fact_id for f in st.reads.snapshot(scopes[0]).facts]
    for user in scopes:
        assert erase_facts(lambda: None, st, user, ALL)["erased"] == 3
    st.close()
    db = sqlite3.connect(tmp_path / "s" / "meta.sqlite")
    tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    for table in tables:
        for row in db.execute(f"SELECT * FROM {table}"):
            assert email not in repr(row), (table, row)
    assert db.execute("SELECT COUNT(*) FROM users").fetchone()[0] == 1  # acme:bob
    assert {u for (u,) in db.execute('SELECT DISTINCT "user" FROM history')} == {"acme:", "acme:bob"}
    db.close()
    for path in (tmp_path / "s").rglob("*"):
        if path.is_file():
            assert email.encode() not in path.read_bytes(), path
    assert not any("alice" in p.name for p in (tmp_path / "s").rglob("*"))  # segment files: named after the scope
    st = Store.open(tmp_path / "s")
    assert [e["event"] for e in st.reads.history(gone[0])] == ["ADD", "DELETE"]
    assert st.reads.users() == ["acme:bob"] and st.reads.version(scopes[0]) is None
    facts, kv, emb = _facts(scopes[0], 4)
    st.writes.commit(Write(scopes[0], facts, kv, kv, emb))
    assert int(st.reads.version(scopes[0])) > old and len(st.reads.snapshot(scopes[0]).facts) == 3


def _held(st: Store, user: str) -> set:
    """What ``st``'s caches hold of ``user``: texts (snapshot), KV keys (memory tier, as (segment, offset))."""
    snap = st.reads.snapshot_cache.get(user)
    kv = {(k[2], k[3]) for k in st.reads.memory.held() if k[1] == user}
    return {f.text for f in snap.facts} if snap else set(), kv


def test_an_erasure_by_another_process_leaves_nothing_in_this_ones_caches(tmp_path):
    """Two store objects on one store stand for two replicas: B has read user u (snapshot, every fact's KV, its
    vector index); A erases a fact. At B's next read of u the erased fact's text, KV and embedding are gone from
    B's snapshot cache, memory tier and index (the old code kept the KV in the memory tier until evicted; the
    index until a search); once A erases the rest, B's next read drops all of u (the old code kept the stale
    snapshot and the index)."""
    import torch

    from kvmem.retrieve import IndexCache

    facts, kv, emb = sw.generation("u", 1)
    emb = torch.eye(4)[:3]
    a = sw.create(tmp_path / "s")
    a.writes.put_user("u", facts, kv, kv, emb, window=0)
    b = Store.open(tmp_path / "s")
    indexes = IndexCache(1 << 20)
    ukv = b.reads.snapshot("u")
    ukv.read([0, 1, 2])
    indexes.search(b, ukv, emb[0], 3)
    assert _held(b, "u") == ({f.text for f in facts}, {(f.segment, f.token_offset) for f in ukv.facts})
    erased = ukv.facts[0]
    a.writes.erase("u", [erased.fact_id])
    ukv = b.reads.snapshot("u")  # B's next read of u
    assert _held(b, "u") == ({f.text for f in facts[1:]}, {(f.segment, f.token_offset) for f in ukv.facts})
    assert erased.fact_id not in {f.fact_id for f in ukv.facts}
    import faiss

    ids = set(faiss.vector_to_array(indexes._lru["u"].index.id_map).tolist())
    assert ids == {f.row for f in ukv.facts} and erased.row not in ids
    _, pos = indexes.search(b, ukv, emb[0], 3)
    assert erased.fact_id not in [ukv.facts[p].fact_id for p in pos]
    a.writes.erase("u", [f.fact_id for f in ukv.facts])
    with pytest.raises(UnknownUser):
        b.reads.snapshot("u")
    assert _held(b, "u") == (set(), set()) and "u" not in indexes._lru
