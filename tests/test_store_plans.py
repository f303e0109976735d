"""The row operations a chat and the vLLM scheduler run cost what their arguments say, not what the user holds:
their query plans, on SQLite and PostgreSQL, for a user with 20,000 live facts beside one with 100, read each named
fact through an index on (user, fact_id) or by primary key, never by walking the user's rows. The statements are
the ones the store really runs (recorded from ``Rows.execute``), explained by each backend's own planner."""

from __future__ import annotations

import pytest
import torch

import store_worker as sw
from conftest import postgres_schema
from kvmem.store import Store

BIG, SMALL = 20_000, 100


def _fill(st: Store, user: str, n: int) -> None:
    """``user`` with ``n`` live facts: one real commit, then its first row copied in SQL (the KV is not read)."""
    facts, kv, emb = sw.generation(user, 1)
    st.writes.put_user(user, facts, kv, kv, emb, window=0)
    db = st.rows
    cols = db.execute('SELECT * FROM facts WHERE "user"=? LIMIT 1', (user,))
    names = [d[0] for d in cols.description]
    row = dict(zip(names, cols.fetchone()))
    keep = [c for c in names if c not in ("row", "fact_id")]
    quoted = ", ".join(f'"{c}"' for c in keep)
    with db.transaction():
        db.executemany(
            f"INSERT INTO facts (fact_id, {quoted}) VALUES (?, {', '.join('?' * len(keep))})",
            [(f"{user}-x{i}", *(row[c] for c in keep)) for i in range(n - sw.N_FACTS)],
        )


def _recorded(st: Store, fn) -> list[tuple[str, tuple]]:
    """The statements ``fn()`` runs on ``st``'s rows, with their arguments."""
    seen, real = [], st.rows.execute

    def record(sql, args=()):
        seen.append((sql, tuple(args)))
        return real(sql, args)

    st.rows.execute = record
    try:
        fn()
    finally:
        st.rows.execute = real
    return seen


def _plan(st: Store, sql: str, args: tuple) -> str:
    explain = "EXPLAIN QUERY PLAN " if st.rows.segments_dir is not None else "EXPLAIN "
    return " | ".join(str(r[-1]) for r in st.rows.execute(explain + sql, args).fetchall())


@pytest.fixture(params=["sqlite", "postgres"])
def big_store(request, tmp_path):
    if request.param == "sqlite":
        root, segments = tmp_path / "s", None
    else:
        root, segments = postgres_schema(request.getfixturevalue("postgres"), "plans"), (tmp_path / "kv").as_uri()
    st = Store.create(root, sw.FP, "h", [1], torch.zeros(2, 1, 1, 64), torch.zeros(2, 1, 1, 64),
                      {"name": "e", "dim": 4}, segments_url=segments)  # fmt: skip
    _fill(st, "big", BIG)
    _fill(st, "small", SMALL)
    if request.param == "postgres":
        st.rows.execute("ANALYZE facts")  # what autovacuum does after such a load
    yield request.param, st
    st.close()


def test_scheduler_and_chat_row_reads_follow_their_arguments(big_store):
    """``fact_token_ids`` (the scheduler's check of a request's named facts) and ``rows_token_ids`` read 20 facts
    of a 20,000-fact user through the live (user, fact_id) index or the primary key: each plan probes an index by the
    named fact id or row, never a walk of the user's rows (with ``fact_id IN (...)``, SQLite's planner took the
    (user, deleted) index and walked all 20,000)."""
    backend, st = big_store
    version = st.reads.version("big")
    ids = [f"big-x{i}" for i in range(0, BIG - sw.N_FACTS, 1000)][:20]
    got = {}
    calls = _recorded(st, lambda: got.update(st.reads.fact_token_ids("big", version, ids)))
    assert len(got) == 20 and all(v == tuple(range(4)) for v in got.values())
    # an id looked up within a key prefix (a tenant's "<tenant>:"): found in its own users only, on either backend
    assert st.reads.fact(ids[0], within="bi").user == "big" and st.reads.fact(ids[0], within="sm") is None
    assert (
        st.reads.fact(ids[0], user="big", within="b") is not None
        and st.reads.fact(ids[0], user="big", within="s") is None
    )
    assert st.reads.history("big-g1-0", within="big") and st.reads.history("big-g1-0", within="small") == []
    rows = [r for (r,) in st.rows.execute('SELECT "row" FROM facts WHERE "user"=? AND fact_id LIKE ?',
                                          ("big", "big-x1%")).fetchall()][:20]  # fmt: skip
    calls += _recorded(st, lambda: st.reads.rows_token_ids("big", rows))
    reads = [(sql, args) for sql, args in calls if "facts" in sql]
    assert len(reads) == 2
    for sql, args in reads:
        plan = _plan(st, sql, args)
        if backend == "sqlite":  # each named fact or row is a probe of an index on it
            assert "SCAN f" not in plan.replace("SCAN w", "") and ("fact_id=?" in plan or "rowid=?" in plan), plan
        else:
            assert "Seq Scan on facts" not in plan, plan
            assert 'Index Cond: (fact_id = "*VALUES*"' in plan or 'Index Cond: ("row" = ANY' in plan, plan
