"""The vLLM connector's store work per request is O(1): the scheduler side checks a kv request with one version read
per scope (one row by primary key) and the rows of the facts it names, only those its token cache lacks; never a
sum or a scan over the user's facts, nor over the store's for a user with no live facts. Its token cache stays
bounded however many users it serves. On the local store (SQLite) and the shared one (PostgreSQL); each statement's
plan is checked for a full scan. Segments are read by ``pread``: one truncated under an open reader is a clean
read error, never a SIGBUS."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace as NS

import pytest
import torch

import store_worker as sw
from conftest import store_backend
from kvmem.store import FactRecord, Store, StoreError, Write


@pytest.fixture(params=["local", "postgres"])
def backend(request, monkeypatch):
    """The local store (SQLite rows) and the shared one (rows in PostgreSQL, ``conftest.postgres``)."""
    return store_backend(request, monkeypatch)


def _commit(st: Store, user: str, n: int) -> str:
    """``n`` facts of 2 tokens each for ``user``, in one commit; the new version."""
    ids = [(10 + i % 50, 11 + i % 7) for i in range(n)]
    facts = [FactRecord(f"{user}-{i}", user, f"fact {i}", "", "", "", ids[i], 0, 0) for i in range(n)]
    kv = [torch.full((2, 1, 2, 64), float(i)) for i in range(n)]
    return st.writes.commit(
        Write(user, facts, kv, [k.clone() for k in kv], torch.nn.functional.normalize(torch.randn(n, 4), dim=1))
    )


def _spy(monkeypatch, st: Store) -> list[tuple[str, tuple]]:
    """Every statement ``st`` runs from now on through its rows (``Rows.execute``, where all of them pass), run as
    before on the real database."""
    seen: list[tuple[str, tuple]] = []
    run = st.rows.execute

    def execute(sql, args=()):
        seen.append((sql, tuple(args)))
        return run(sql, args)

    execute.__wrapped__ = run  # what ``_full_scans`` explains with, unrecorded
    monkeypatch.setattr(st.rows, "execute", execute)
    return seen


def _full_scans(st: Store, statements) -> list[str]:
    """The steps of the statements' plans that read a whole table or index: SQLite's ``SCAN``; PostgreSQL's
    ``Seq Scan`` where no index can serve (sequential scans disabled, so small tables do not choose one)."""
    out, run = [], getattr(st.rows.execute, "__wrapped__", st.rows.execute)
    for sql, args in list(statements):
        if sql.lstrip().upper().startswith(("BEGIN", "COMMIT", "SET")):
            continue
        if getattr(st.rows, "shared", False):
            run("SET enable_seqscan = off")
            try:
                plan = [r[0] for r in run("EXPLAIN " + sql, args)]
            finally:
                run("RESET enable_seqscan")
            out += [line for line in plan if "Seq Scan" in line]
        else:
            plan = [r[-1] for r in run("EXPLAIN QUERY PLAN " + sql, args)]
            # the scan of a statement's own VALUES list (the ids it names) reads no table
            out += [p for p in plan if p.startswith("SCAN") and p != "SCAN w" and "CONSTANT ROW" not in p]
    return out


def _request(st: Store, user: str, version: str, fact_ids: list[str], rid: str = "r"):
    from kvmem.engines.vllm.params import MemoryRef

    ref = MemoryRef(str(st.root), st.manifest["store_id"], user, version, fact_ids)
    ids = list(st.header_token_ids)
    for fid in fact_ids:
        f = st.reads.fact(fid, user)
        ids += list(f.token_ids) if f is not None else [1, 2]
    return NS(
        kv_transfer_params=ref.to_params(),
        prompt_token_ids=[*ids, 7],
        cache_salt=ref.salt,
        request_id=rid,
        num_prompt_tokens=len(ids) + 1,
    )


def _scheduler(st: Store):
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from kvmem.engines.vllm.config import Settings
    from kvmem.engines.vllm.scheduler import KvmemScheduler

    identity = {k: st.fingerprint[k] for k in ("weights_sha256", "dtype")}
    return KvmemScheduler(Settings(stores=[str(st.root)], identity=identity))


def _shape(statements, user: str) -> list[tuple[str, tuple]]:
    """The statements with the user's name and fact ids spelled alike, to compare two users' work."""
    return [(sql, tuple(re.sub(rf"^{re.escape(user)}", "U", str(a)) for a in args)) for sql, args in statements]


def test_the_scheduler_reads_one_version_row_per_request(backend, tmp_path, monkeypatch):
    """A kv request costs the scheduler side the same statements for a user with 400 facts as with 8: a cached
    request one version read, by primary key; an uncached one that read and the named facts' rows, by the live
    facts' (user, fact_id) index. None sums or scans the user's facts (the version read alone used to sum every
    fact's tokens: 13.2 ms at 20,000 facts). A user whose facts are all deleted costs an indexed read too, never a
    scan of the store's facts, and falls back to a plain prefill."""
    from kvmem.engines.vllm import stores

    st = sw.create(tmp_path / "s")
    versions = {"few": _commit(st, "few", 8), "many": _commit(st, "many", 400)}
    _commit(st, "gone", 3)
    versions["gone"] = st.writes.commit(Write("gone", delete=[f"gone-{i}" for i in range(3)]))
    conn = _scheduler(st)
    handle = stores.open_store(str(st.root))  # the scheduler side's own handle
    seen = _spy(monkeypatch, handle)
    work = {}
    for user in ("few", "many"):
        named = [f"{user}-{i}" for i in (5, 1, 7, 3)]
        req = _request(st, user, versions[user], named)
        n_ids = len(req.prompt_token_ids) - 1
        for phase in ("cold", "warm"):
            del seen[:]
            assert conn.get_num_new_matched_tokens(req, 0) == (n_ids, True), (user, phase)
            work[user, phase] = list(seen)
        (version_read,) = work[user, "warm"]  # cached: the version alone
        assert version_read == ('SELECT version FROM users WHERE "user"=?', (user,))
        facts_reads = [s for s, _ in work[user, "cold"] if " facts " in s]
        assert len(facts_reads) == 1 and "VALUES (?), (?), (?), (?)" in facts_reads[0], work[user, "cold"]
        assert _full_scans(handle, work[user, "cold"] + work[user, "warm"]) == []
    for phase in ("cold", "warm"):
        assert _shape(work["few", phase], "few") == _shape(work["many", phase], "many"), phase
    del seen[:]
    assert conn.get_num_new_matched_tokens(_request(st, "gone", versions["gone"], ["gone-1"]), 0) == (0, False)
    assert conn.metrics["store_error"] == 1
    assert not any("DISTINCT" in s or "COUNT" in s for s, _ in seen) and _full_scans(handle, seen) == []
    # a version replaced since: refused by the one version read, cached facts or not
    new = st.writes.commit(Write("few", delete=["few-2"]))
    del seen[:]
    assert conn.get_num_new_matched_tokens(_request(st, "few", versions["few"], ["few-5"]), 0) == (0, False)
    assert len(seen) == 1 and conn.metrics["store_error"] == 2
    assert conn.get_num_new_matched_tokens(_request(st, "few", new, ["few-5"]), 0)[0] > 0


def test_store_version_is_one_indexed_row_read(backend, tmp_path, monkeypatch):
    """``Store.reads.version``, what the scheduler side reads per request, is one statement on the users table by its
    primary key, and ``Store.reads.fact_token_ids`` reads the named facts' rows alone, in one read transaction with the
    version: the same statements at 8 facts as at 400, no full scan."""
    st = sw.create(tmp_path / "s")
    v = {"few": _commit(st, "few", 8), "many": _commit(st, "many", 400)}
    reader = Store.open(st.root)
    seen = _spy(monkeypatch, reader)
    work = {}
    for user in ("few", "many"):
        del seen[:]
        assert reader.reads.version(user) == v[user]
        got = reader.reads.fact_token_ids(user, v[user], [f"{user}-3", f"{user}-0", "nope"])
        assert got == {f"{user}-3": (13, 14), f"{user}-0": (10, 11)}
        work[user] = _shape(seen, user)
        assert _full_scans(reader, seen) == []
    assert work["few"] == work["many"]
    assert [s for s, _ in work["few"]].count('SELECT version FROM users WHERE "user"=?') == 2 and len(work["few"]) == 3
    with pytest.raises(LookupError, match="no longer current"):
        reader.reads.fact_token_ids("few", v["many"], ["few-0"])


def test_the_token_cache_stays_bounded_after_many_users(tmp_path, monkeypatch):
    """The connector's token cache is an LRU bounded by token ids (``stores.TOKEN_CACHE_TOKENS``; 100 here): after
    300 users it holds what the last requests named, not every user served (it held one entry per user ever
    served: 302 after 300). An evicted user's next request reads its facts again and is injected as before."""
    from kvmem.engines.vllm import stores

    st = sw.create(tmp_path / "s")
    users = [f"u{i:03d}" for i in range(300)]
    versions = {}
    for u in users:
        versions[u] = _commit(st, u, 2)
    conn = _scheduler(st)
    stores.configure(token_cache_tokens=100)
    try:
        for u in users:
            req = _request(st, u, versions[u], [f"{u}-1", f"{u}-0"])
            assert conn.get_num_new_matched_tokens(req, 0) == (len(req.prompt_token_ids) - 1, True), u
        stats = stores.token_cache_stats()
        assert stats["max_tokens"] == 100 and stats["tokens"] <= 100 and stats["facts"] <= 100 // 3, stats
        handle = stores.open_store(str(st.root))
        seen = _spy(monkeypatch, handle)
        req = _request(st, users[-1], versions[users[-1]], [f"{users[-1]}-0"])
        assert conn.get_num_new_matched_tokens(req, 0)[0] > 0 and len(seen) == 1  # the last user: cached
        del seen[:]
        req = _request(st, users[0], versions[users[0]], [f"{users[0]}-1", f"{users[0]}-0"])
        assert conn.get_num_new_matched_tokens(req, 0) == (len(req.prompt_token_ids) - 1, True)  # evicted: read
        assert any(" facts " in s for s, _ in seen)
    finally:
        stores.configure(token_cache_tokens=stores.TOKEN_CACHE_TOKENS)


def test_a_segment_truncated_under_an_open_reader_is_a_read_error(tmp_path):
    """A segment shortened after a reader opened and verified it (between its checksum pass and its span reads):
    the read raises ``SegmentCorrupt`` ("shrank"), and through the store a StoreError that costs the request a
    prefill. Reads are ``pread`` into fresh buffers, never a memory map, so nothing in the process can take a
    SIGBUS; the rest of the file, and other segments, still read."""
    from kvmem.store import segments as seg

    st = sw.create(tmp_path / "s")
    _commit(st, "u", 40)
    ukv = st.reads.snapshot("u")
    (name,) = ukv.segments
    path = st.segment_path("u", name)
    with seg.FileHandle(path) as handle:
        seg.verify(handle, ukv.segments[name])
        layout = seg.read_layout(handle)
        os.truncate(path, layout.values_at + 64)  # under the open handle: the keys still there, the values gone
        with pytest.raises(seg.SegmentCorrupt, match="shrank"):
            seg.read_spans(handle, layout, [(70, 2)])
        assert handle.read(0, 8)  # what is left still reads
    with pytest.raises(StoreError, match="truncated|checksum"):
        Store.open(st.root, cache_bytes=1).reads.snapshot("u").gather([35])


def test_a_chat_reads_only_its_facts_kv_past_the_cache(backend, tmp_path):
    """A user whose memory exceeds the read cache (1 byte here: nothing stays) costs a chat the KV bytes of the k
    facts it gathers, the same at 400 facts as at 8, never the user's whole KV (both engines gather through
    ``UserKV.gather``)."""
    st = sw.create(tmp_path / "s")
    for user, n in (("few", 8), ("many", 400)):
        _commit(st, user, n)
    reader = Store.open(st.root, cache_bytes=1)
    fact_bytes = 2 * 2 * 1 * 2 * 64 * 4  # keys and values [L=2, H=1, n=2, D=64] fp32
    for user in ("few", "many"):
        ukv = reader.reads.snapshot(user)
        before = reader.reads.cache_stats()["kv_read_bytes"]
        for _ in range(3):  # every chat reads its facts again: nothing is cached
            keys, _ = ukv.gather([5, 1, 7, 3])
            assert keys.shape == (2, 1, 8, 64) and float(keys[0, 0, 0, 0]) == 5.0
        assert reader.reads.cache_stats()["kv_read_bytes"] - before == 3 * 4 * fact_bytes, user
