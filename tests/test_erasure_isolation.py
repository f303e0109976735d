"""What an erasure leaves outside the rows it blanks: the SQLite WAL while a reader holds an older snapshot, the
erased scope's id in the store's tables, and the in-memory caches (snapshots, facts' KV, vector indexes) of
another process's store object on the same store. Synthetic stores (``store_worker``): no model."""

from __future__ import annotations

import sqlite3

import store_worker as sw
from kvmem.store import sqlite_rows


def test_a_checkpoint_a_reader_blocks_is_recorded_and_retried_by_the_next_commit(tmp_path, monkeypatch):
    """A reader holding a snapshot taken before an erasure keeps the WAL (and the erased text in it): the
    erasure's checkpoint retries briefly, then records it; the next commit, once the reader is done, completes
    it: the WAL is empty and holds no byte of the text (the old code ignored the checkpoint's busy result)."""
    monkeypatch.setattr(sqlite_rows, "SCRUB_WAIT_S", 0.05)
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    st.put_user("u", facts, kv, kv, emb, window=0)
    wal = tmp_path / "s" / "meta.sqlite-wal"
    reader = sqlite3.connect(tmp_path / "s" / "meta.sqlite", isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 3  # its snapshot: before the erasure
    st.erase("u", [facts[0].fact_id])
    assert st.rows.scrub_pending()
    assert st.rows.execute("SELECT COUNT(*) FROM meta WHERE key='scrub:pending'").fetchone()[0] == 1
    assert b"fact 0 of gen 1" in wal.read_bytes()  # the reader's pages: still there
    reader.execute("COMMIT")
    reader.close()
    facts, kv, emb = sw.generation("other", 2)  # texts "fact i of gen 2"
    st.put_user("other", facts, kv, kv, emb, window=0)  # any commit retries it
    assert not st.rows.scrub_pending()
    assert wal.stat().st_size == 0
    for path in (tmp_path / "s").glob("meta.sqlite*"):
        assert b"fact 0 of gen 1" not in path.read_bytes(), path
