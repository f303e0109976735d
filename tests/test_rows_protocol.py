"""The rows seam (``store.rows.Rows``): every backend implements each of its named operations with the protocol's
signature, and one small scripted sequence of writes and reads through a ``Store`` calls the same operations in the
same order and gets the same answers on SQLite and on PostgreSQL (versions counted from the first commit's;
scores and retirement times left out, being each backend's own)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch

from conftest import postgres_schema
from kvmem.scopes import IndexQuery, Scope
from kvmem.store import FactRecord, Store, Write, backends
from kvmem.store.rows import Rows
from kvmem.store.sqlite_rows import SQLiteRows

FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}
U, V = Scope(user_id="ana", agent_id="bot").key("acme"), Scope(user_id="ben").key("acme")
T = 1_000_000.0
# made before the sequence, or never by it (a store's creation and the text index's migration are tested elsewhere)
NOT_IN_SCRIPT = {"exists", "check_new", "create", "manifest", "add_text_index"}
UNORDERED = {"segment_rows", "unused_segments"}  # no order promised


def test_every_backend_implements_every_operation_of_the_protocol():
    ops = Rows.__abstractmethods__
    assert {"commit", "live_facts", "fact_token_ids", "retire", "compact_rows", "reencode_rows"} <= ops
    for cls in {SQLiteRows, *backends.BACKENDS.values()}:
        assert not cls.__abstractmethods__, cls
        for name in ops:
            ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(Rows, name))
            assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)


def _fact(user: str, fid: str, text: str, n: int, turns=None, source=()) -> FactRecord:
    return FactRecord(fid, user, text, "", "", "", tuple(range(10, 10 + n)), 0, 0, '{"k": 1}', created_at=T,
                      context_turns=turns, source_turns=source)  # fmt: skip


def _kv(facts, x: float):
    keys = [torch.full((2, 1, f.num_tokens, 8), float(x)) for f in facts]
    emb = torch.nn.functional.normalize(torch.arange(len(facts) * 4.0).reshape(-1, 4) + x, dim=1)
    return keys, [k.clone() for k in keys], emb


def _write(st: Store, user: str, facts, x: float, **kw) -> str:
    keys, values, emb = _kv(facts, x)
    return st.writes.commit(Write(user, facts, keys, values, emb if facts else None, now=T + x, **kw))


def _record(rows: Rows, log: list) -> None:
    """Wrap every protocol operation of ``rows`` (this object's attributes) to append (name, answer) to ``log``:
    the calls the store makes, not those a backend makes of itself inside one (each backend's own business)."""
    depth = [0]

    def inside(method):
        def call(*args, **kwargs):
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    def wrap(name, method):
        def call(*args, **kwargs):
            depth[0] += 1
            try:
                out = method(*args, **kwargs)
            finally:
                depth[0] -= 1
            if not depth[0]:
                log.append((name, out))
            return out

        return call

    ops = Rows.__abstractmethods__
    for name, member in vars(Rows).items():  # the others too (scrub, replaced...), so what they call is inside
        if callable(member) and not name.startswith("_"):
            setattr(rows, name, wrap(name, getattr(rows, name)) if name in ops else inside(getattr(rows, name)))


def _canon(name: str, answer, base: int):
    """``answer`` comparable across backends: versions (digit strings) counted from ``base``, facts as tuples,
    keyword scores and retirement times left out, unordered answers sorted."""

    def walk(x):
        if isinstance(x, str) and x.isdigit():
            return int(x) - base
        if isinstance(x, FactRecord):
            return walk(dataclasses.astuple(x))
        if isinstance(x, dict):
            return {walk(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    if name in ("locked", "nbytes"):  # a context manager; each backend's own bytes
        return None
    if name == "keyword":
        answer = [r for r, _ in answer]
    if name == "retired":
        answer = sorted(n for n, _ in answer)
    if name in UNORDERED:
        answer = sorted(answer)
    return walk(answer)


def _script(location, segments_url, monkeypatch) -> tuple[list, set]:
    ids = itertools.count()
    monkeypatch.setattr("kvmem.store.write.uuid.uuid4", lambda: type("U", (), {"hex": f"seg{next(ids):09d}"}))
    header = torch.zeros(2, 1, 3, 8)
    st = Store.create(location, FP, "hdr", [1, 2, 3], header, header.clone(), {"name": "e", "dim": 4},
                      segments_url=segments_url)  # fmt: skip
    st.writes.retire_after_s = 0
    log: list = []
    _record(st.rows, log)
    try:
        turns = [{"content": "I drink green tea", "speaker": "ana", "time": T}, {"content": "my dog is Rex"}]
        facts = [
            _fact(U, "a", "ana drinks green tea", 3, (-1,), (-1,)),
            _fact(U, "b", "ana has a dog", 2, (-1, -2), (-2,)),
            _fact(U, "c", "the dog is called Rex", 4, (-2,), (-2,)),
        ]
        _write(st, U, facts, 1, turns=turns, window=2, source="chat", neighbours=1, history=False)
        _write(st, V, [_fact(V, "x", "ben reads", 2)], 2)  # unknown provenance
        r = st.reads
        before = r.version(U)
        _write(st, U, [_fact(U, "b", "ana has two dogs", 3, (0, 1), (1,))], 3, delete=["b"],
               events=[("b", "UPDATE", "ana has a dog", "ana has two dogs")])  # fmt: skip
        r.snapshot(U)
        r.fact_token_ids(U, r.version(U), ["a", "b", "nope"])
        with pytest.raises(LookupError):
            r.fact_token_ids(U, before, ["a"])
        r.embedding_page(U, 0, 2)
        r.rows_token_ids(U, [1, 2, 3, 99])
        r.user_info(U)
        r.fact("b", within="acme:")
        r.history("b")
        r.events(U)
        r.turns(U, last=1)
        r.changes(U, before)
        r.keyword(U, "drinks", 5)
        r.scope_keys(IndexQuery(None, "acme:", "bot", None), live=True)
        r.user_page("acme:", "", 0, 10)
        r.users(with_no_live_facts=True)
        st.writes.erase(U, ["c"], now=T + 4, defer_s=5)  # turn 1 goes: b (behind it) turns stale
        r.stale()
        (b,) = [f for f in r.snapshot(U).facts if f.fact_id == "b"]
        keys, values, emb = _kv([b], 5)
        st.writes.reencode(U, [b], keys, values, emb, now=T + 5)
        st.writes.defer_compaction(U)
        for user in st.writes.compactions():
            st.writes.compact(user, st.writes.dead_segments(user))
            st.writes.compacted(user)
        with st.writes.writer(U):
            st.rows.carry_stale(U, {"a": T + 9, "b": None})
        r.stale(U)
        st.writes.delete_user(V)
        st.fsck()
        st.rows.has_segment(U, "seg000000001"), st.rows.has_table("scopes")
        st.collect()
        r.totals()
        st.disk_bytes()
        st.writes.reset()
        r.totals()
    finally:
        st.close()
    base = int(next(out for name, out in log if name == "commit")) - 1
    return [(name, _canon(name, out, base)) for name, out in log], {name for name, _ in log}


def test_a_scripted_sequence_uses_every_operation(tmp_path, monkeypatch):
    log, called = _script(tmp_path / "s", None, monkeypatch)
    assert Rows.__abstractmethods__ - called == NOT_IN_SCRIPT
    assert ("keyword", [1]) in log  # a's row: the one fact that drinks
    assert ("stale", [[U, "b", "seg000000003", T + 9]]) in log  # behind the erased turn, due at now + defer_s
    assert ("dead_segments", ["seg000000001"]) in log and ("derived", [[U, "seg000000006", "a"]]) in log
    assert [out for name, out in log if name == "totals"] == [[2, 1], [0, 0]]  # before and after the reset


def test_sqlite_and_postgresql_answer_alike(tmp_path, postgres, monkeypatch):
    local, _ = _script(tmp_path / "s", None, monkeypatch)
    url = postgres_schema(postgres, "rows_protocol")
    shared, _ = _script(url, (tmp_path / "objects").as_uri(), monkeypatch)
    assert [name for name, _ in shared] == [name for name, _ in local]
    for (name, ours), (_, theirs) in zip(local, shared):
        assert ours == theirs, name
