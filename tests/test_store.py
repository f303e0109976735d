"""Store persistence: bit-identical reopen, fingerprint refusal, atomic replacement, compose budget."""

from types import SimpleNamespace

import pytest
import torch

from conftest import random_ids, tiny_model
from kvmem.compose import compose, compose_raw, max_facts_that_fit
from kvmem.encode import encode_spans
from kvmem.retrieve import FlatIPIndex, Retrieved, order_facts, order_reverse_proximity
from kvmem.rope import Rotary
from kvmem.store import FactRecord, Store, StoreError, StoreMismatch, Write

FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}


def _facts(user, n, lens):
    return [
        FactRecord(f"{user}/{i}", user, f"fact {i}", "A", "D1:1", "d", tuple(random_ids(lens[i], seed=i)), 0, 0)
        for i in range(n)
    ]


def _store(tmp_path, model, user="u1", n=4):
    header = random_ids(6, seed=99)
    (hkv,) = encode_spans(model, [header], [(0, 6)])
    st = Store.create(tmp_path / "s", FP, "hdr", header, hkv.keys, hkv.values, {"name": "e", "dim": 8})
    facts = _facts(user, n, [5, 7, 3, 9, 4, 6][:n])
    kvs = encode_spans(model, [header + list(f.token_ids) for f in facts], [(6, 6 + f.num_tokens) for f in facts])
    emb = torch.nn.functional.normalize(torch.randn(n, 8), dim=1)
    st.writes.put_user(user, facts, [k.keys for k in kvs], [k.values for k in kvs], emb, window=0)
    return st, header, facts, kvs, emb


def test_reopen_is_bit_identical(tmp_path):
    model = tiny_model("llama")
    st, header, facts, kvs, emb = _store(tmp_path, model)
    st.close()
    st2 = Store.open(tmp_path / "s", FP)
    ukv = st2.reads.snapshot("u1")
    assert [f.fact_id for f in ukv.facts] == [f.fact_id for f in facts]
    for i, kv in enumerate(kvs):
        k, v = ukv.fact_kv(i)
        assert torch.equal(k, kv.keys) and torch.equal(v, kv.values)
    assert torch.equal(ukv.embeddings, emb)
    assert st2.header_token_ids == header
    # every store file gets the same umask-derived mode (safetensors alone would write 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "s").rglob("*") if p.is_file()}
    assert len(set(modes.values())) == 1 and any(n.endswith(".kv.safetensors") for n in modes), modes


def test_other_model_is_refused(tmp_path):
    model = tiny_model("llama")
    _store(tmp_path, model)[0].close()
    other = dict(FP, weights_sha256="def")
    with pytest.raises(StoreMismatch, match="refusing to inject"):
        Store.open(tmp_path / "s", other)
    with pytest.raises(StoreError, match="no kvmem store"):
        Store.open(tmp_path / "nothing", FP)


def test_users_are_isolated_and_a_bad_replacement_writes_nothing(tmp_path):
    model = tiny_model("llama")
    st, header, facts, kvs, emb = _store(tmp_path, model)
    v1 = st.reads.user_info("u1")["version"]
    facts2 = _facts("u2", 2, [3, 3])
    kv2 = encode_spans(model, [list(f.token_ids) for f in facts2], [(0, 3), (0, 3)])
    st.writes.put_user("u2", facts2, [k.keys for k in kv2], [k.values for k in kv2], torch.eye(2, 8), window=0)
    assert st.reads.users() == ["u1", "u2"]
    assert [f.fact_id for f in st.reads.snapshot("u2").facts] == ["u2/0", "u2/1"]
    assert st.reads.user_info("u1")["version"] == v1  # untouched
    with pytest.raises(StoreError, match="unknown user 'u3'"):
        st.reads.snapshot("u3")
    # A failing replacement (token/KV mismatch) leaves the old version readable.
    with pytest.raises(StoreError):
        st.writes.put_user("u1", facts[:1], [kvs[1].keys], [kvs[1].values], emb[:1], window=0)
    assert st.reads.user_info("u1")["version"] == v1 and len(st.reads.snapshot("u1").facts) == 4


def test_compose_gathers_facts_in_injected_order(tmp_path):
    model = tiny_model("llama")
    st, header, facts, kvs, emb = _store(tmp_path, model)
    ukv = st.reads.snapshot("u1")
    mem = compose(Rotary.for_model(model), header, st.reads.header_kv(), ukv, [2, 0])
    assert mem.token_ids == header + list(facts[2].token_ids) + list(facts[0].token_ids)
    assert mem.fact_ids == ["u1/2", "u1/0"]
    hk, hv = st.reads.header_kv()
    ref = compose_raw(
        Rotary.for_model(model),
        mem.token_ids,
        torch.cat([hk, kvs[2].keys, kvs[0].keys], 2),
        torch.cat([hv, kvs[2].values, kvs[0].values], 2),
    )
    assert torch.equal(mem.keys, ref.keys) and torch.equal(mem.values, ref.values)
    # Read on one thread, assembled on another (the vLLM worker): the same memory, and nothing read again.
    st.reads.forget()
    ukv = st.reads.snapshot("u1")
    timings: dict = {}
    spans = ukv.read([2, 0], timings)
    assert [s.num_tokens for s in spans] == [facts[2].num_tokens, facts[0].num_tokens] and "read" in timings
    before = {k: st.reads.cache_stats()[k] for k in ("kv_hits", "kv_misses")}
    again = compose(Rotary.for_model(model), header, st.reads.header_kv(), ukv, [2, 0], spans=spans)
    assert torch.equal(again.keys, mem.keys) and torch.equal(again.values, mem.values)
    assert {k: st.reads.cache_stats()[k] for k in before} == before
    with pytest.raises(ValueError, match="1 spans for 2 rows"):
        ukv.gather([2, 0], spans=spans[:1])
    # What is in memory is served from memory alone: that exact version, every fact read before.
    got = st.reads.cached([("u1", ukv.version)], ["u1/2", "u1/0"])
    assert got is not None and got[1] == [2, 0] and all(a is b for a, b in zip(got[2], spans))
    assert st.reads.cached([("u1", ukv.version)], ["u1/2", "u1/1"]) is None  # u1/1 was never read
    assert st.reads.cached([("u1", "another version")], ["u1/2"]) is None
    st.reads.forget()
    assert st.reads.cached([("u1", ukv.version)], ["u1/2"]) is None


def test_retrieval_order_and_budget():
    emb = torch.nn.functional.normalize(torch.tensor([[1.0, 0], [0.8, 0.6], [0, 1.0], [0.6, 0.8]]), dim=1)
    scores, rows = FlatIPIndex(emb).search(torch.tensor([1.0, 0.0]), 3)
    assert rows.tolist() == [0, 1, 3]
    assert order_reverse_proximity(Retrieved(rows.tolist(), scores.tolist())) == [3, 1, 0]
    # Time order: write time, then the store's row id; positions 0, 1, 3 of a snapshot written out of row order.
    facts = [SimpleNamespace(created_at=t, row=r) for t, r in [(0.5, 9), (1.0, 4), (0.0, 0), (1.0, 2)]]
    got = Retrieved(rows.tolist(), scores.tolist())
    assert order_facts(got, facts, "time") == [0, 3, 1]
    facts[3] = SimpleNamespace(created_at=1.0, row=7)  # a tie in time goes by row id
    assert order_facts(got, facts, "time") == [0, 1, 3]
    assert order_facts(got, facts) == order_facts(got, facts, "relevance") == [3, 1, 0]
    with pytest.raises(ValueError, match="order must be one of relevance, time"):
        order_facts(got, facts, "newest")
    # Corollary 7: header 10 + query 5; facts 20, 30, 40 best first; context 70 fits two facts.
    assert max_facts_that_fit(10, [20, 30, 40], 5, 70) == 2
    assert max_facts_that_fit(10, [20, 30, 40], 5, 14) == 0
    assert max_facts_that_fit(10, [20, 30, 40], 5, 105) == 3


def test_corrupt_stores_are_refused_not_overwritten(tmp_path):
    model = tiny_model("llama")
    st, header, facts, kvs, emb = _store(tmp_path, model)
    st.close()
    root = tmp_path / "s"
    manifest = (root / "manifest.json").read_text()
    (root / "manifest.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match="store format list"):
        Store.open(root, FP)
    (root / "manifest.json").write_text('{"format": 1}')
    with pytest.raises(StoreError, match="store format 1 is not 3; re-ingest"):
        Store.open(root, FP)
    (root / "manifest.json").write_text('{"format": 3}')
    with pytest.raises(StoreError, match="corrupt"):
        Store.open(root, FP)
    (root / "manifest.json").unlink()
    hk = encode_spans(model, [header], [(0, 6)])[0].keys
    with pytest.raises(StoreError, match="no manifest.json"):
        Store.create(root, FP, "hdr", header, hk, hk, {"name": "e", "dim": 8})
    assert any((root / "users").glob("*.kv.safetensors"))  # nothing deleted
    (root / "manifest.json").write_text(manifest)
    for p in (root / "users").glob("*.kv.safetensors"):
        p.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(StoreError, match="KV segment .* of user 'u1' fails its checksum"):
        Store.open(root, FP).reads.snapshot("u1").fact_kv(0)  # KV is read (and verified) when gathered


# The schema as commit 0cc4d45 created it (``rows.SQLITE_SCHEMA``, ``rows.POSTGRES_SCHEMA``), kept verbatim but for
# schema 4's two columns (facts.provenance, facts.stale; ``schema.MIGRATIONS`` adds them to an older store): the
# rendered schema must be these statements.
OLD_SQLITE_SCHEMA = """
PRAGMA journal_mode=WAL;
PRAGMA user_version=4;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('version', 0);
CREATE TABLE IF NOT EXISTS users (
    user TEXT PRIMARY KEY, version INTEGER NOT NULL, window INTEGER NOT NULL, source TEXT,
    compacted INTEGER NOT NULL DEFAULT 0, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    user TEXT NOT NULL, segment TEXT NOT NULL, kv_sha256 TEXT NOT NULL, num_tokens INTEGER NOT NULL,
    PRIMARY KEY (user, segment));
CREATE TABLE IF NOT EXISTS facts (
    row INTEGER PRIMARY KEY AUTOINCREMENT, user TEXT NOT NULL, fact_id TEXT NOT NULL, text TEXT NOT NULL,
    speaker TEXT, source_turn TEXT, date TEXT, metadata TEXT NOT NULL DEFAULT '{}', token_ids TEXT NOT NULL,
    segment TEXT NOT NULL, token_offset INTEGER NOT NULL, window INTEGER NOT NULL, embedding BLOB NOT NULL,
    added INTEGER NOT NULL, deleted INTEGER, created_at REAL NOT NULL, updated_at REAL NOT NULL, provenance TEXT,
    stale REAL);
CREATE UNIQUE INDEX IF NOT EXISTS live_fact ON facts (user, fact_id) WHERE deleted IS NULL;
CREATE INDEX IF NOT EXISTS facts_id ON facts (fact_id);
CREATE INDEX IF NOT EXISTS facts_user ON facts (user, deleted);
CREATE INDEX IF NOT EXISTS facts_segment ON facts (user, segment) WHERE deleted IS NULL;
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT, user TEXT NOT NULL, fact_id TEXT NOT NULL, event TEXT NOT NULL,
    old_memory TEXT, new_memory TEXT, time REAL NOT NULL, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS history_fact ON history (fact_id);
CREATE TABLE IF NOT EXISTS turns (
    user TEXT NOT NULL, idx INTEGER NOT NULL, dia_id TEXT, speaker TEXT, content TEXT NOT NULL, time REAL,
    PRIMARY KEY (user, idx));
"""
OLD_POSTGRES_SCHEMA = """
CREATE TABLE kvmem_manifest (
    id INTEGER PRIMARY KEY CHECK (id = 1), schema_version INTEGER NOT NULL, manifest TEXT, header BYTEA);
CREATE SEQUENCE kvmem_version START WITH {start};
CREATE TABLE meta (key TEXT PRIMARY KEY, value DOUBLE PRECISION NOT NULL);
CREATE TABLE users (
    "user" TEXT PRIMARY KEY, version BIGINT NOT NULL, "window" INTEGER NOT NULL, source TEXT,
    compacted BIGINT NOT NULL DEFAULT 0, updated DOUBLE PRECISION NOT NULL);
CREATE TABLE segments (
    "user" TEXT NOT NULL, segment TEXT NOT NULL, kv_sha256 TEXT NOT NULL, num_tokens INTEGER NOT NULL,
    PRIMARY KEY ("user", segment));
CREATE TABLE facts (
    "row" BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "user" TEXT NOT NULL, fact_id TEXT NOT NULL,
    text TEXT NOT NULL, speaker TEXT, source_turn TEXT, date TEXT, metadata TEXT NOT NULL DEFAULT '{}',
    token_ids TEXT NOT NULL, segment TEXT NOT NULL, token_offset INTEGER NOT NULL, "window" INTEGER NOT NULL,
    embedding BYTEA NOT NULL, added BIGINT NOT NULL, deleted BIGINT, created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, provenance TEXT, stale DOUBLE PRECISION);
CREATE UNIQUE INDEX live_fact ON facts ("user", fact_id) WHERE deleted IS NULL;
CREATE INDEX facts_id ON facts (fact_id);
CREATE INDEX facts_user ON facts ("user", deleted);
CREATE INDEX facts_segment ON facts ("user", segment) WHERE deleted IS NULL;
CREATE TABLE history (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "user" TEXT NOT NULL, fact_id TEXT NOT NULL,
    event TEXT NOT NULL, old_memory TEXT, new_memory TEXT, time DOUBLE PRECISION NOT NULL, version BIGINT NOT NULL);
CREATE INDEX history_fact ON history (fact_id);
CREATE TABLE turns (
    "user" TEXT NOT NULL, idx INTEGER NOT NULL, dia_id TEXT, speaker TEXT, content TEXT NOT NULL,
    time DOUBLE PRECISION, PRIMARY KEY ("user", idx));
"""
# Added since, after everything above (a store without them is still read): the scope index.
ADDED_SQLITE = """
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, head TEXT NOT NULL, agent TEXT, run TEXT);
CREATE INDEX IF NOT EXISTS scopes_head ON scopes (head);
CREATE INDEX IF NOT EXISTS scopes_agent ON scopes (agent, head);
CREATE INDEX IF NOT EXISTS scopes_run ON scopes (run, head);
"""
ADDED_POSTGRES = """
CREATE TABLE scopes (
    scope TEXT COLLATE "C" PRIMARY KEY, head TEXT COLLATE "C" NOT NULL, agent TEXT COLLATE "C", run TEXT COLLATE "C");
CREATE INDEX scopes_head ON scopes (head);
CREATE INDEX scopes_agent ON scopes (agent, head);
CREATE INDEX scopes_run ON scopes (run, head);
"""


def test_the_schema_renders_to_both_dialects_as_it_always_was():
    """One table definition, two dialects: each renders, token for token (whitespace aside), the DDL that backend
    has always run, then the tables added since, so a store created after the change has the tables of one
    created before, unchanged."""
    import re

    from kvmem.store.schema import POSTGRES, SQLITE, render

    def tokens(sql: str) -> str:
        return re.sub(r"\s*([(),;])\s*", r"\1", " ".join(sql.split()))

    assert tokens(render(SQLITE)) == tokens(OLD_SQLITE_SCHEMA + ADDED_SQLITE)
    assert tokens(render(POSTGRES, start=1234)) == tokens(
        OLD_POSTGRES_SCHEMA.replace("{start}", "1234") + ADDED_POSTGRES
    )


def test_a_store_written_before_the_layout_change_opens_and_answers(tmp_path):
    """``tests/fixtures/store_0cc4d45``: a tiny local store written by commit 0cc4d45 (``store_worker``'s
    generation 1 of user ``u`` with one fact then deleted, and user ``v``'s one fact with metadata and a turn).
    It opens with its fingerprint, every read answers as written, and it takes a new write and a clean fsck."""
    import shutil
    from pathlib import Path

    import store_worker as sw

    root = tmp_path / "old"
    shutil.copytree(Path(__file__).with_name("fixtures") / "store_0cc4d45", root)
    st = Store.open(root, sw.FP)
    assert st.reads.users() == ["u", "v"] and st.reads.version("u") == "3" and st.reads.version("v") == "2"
    assert sw.check(st.reads.snapshot("u")) == 1 and [f.fact_id for f in st.reads.snapshot("u").facts] == [
        "u-g1-1",
        "u-g1-2",
    ]
    v = st.reads.snapshot("v")
    (f,) = v.facts
    assert (f.fact_id, f.text, f.speaker, f.source_turn, f.date, f.token_ids, f.metadata) == (
        "x1", "a later fact", "A", "D1:1", "d", (5, 6, 7), '{"k": 1}'
    )  # fmt: skip
    k = torch.arange(2 * 1 * 3 * 64, dtype=torch.float32).reshape(2, 1, 3, 64)
    keys, values = v.gather([0])
    assert torch.equal(keys, k) and torch.equal(values, -k)
    assert torch.equal(v.embeddings, torch.tensor([[1.0, 0, 0, 0]]))
    assert [(t["content"], t["speaker"]) for t in st.reads.turns("v")] == [("hi", "A")]
    assert [e["event"] for e in st.reads.events("u")] == ["ADD"] * 3 + ["DELETE"]
    assert st.reads.user_info("u")["num_tokens"] == 8 and st.header_token_ids == [1, 2, 3]
    assert st.fsck() == {"users": 2, "ok": ["u", "v"], "bad": {}, "removed": [], "replaced": [], "derived": {}}
    assert st.reads.snapshot("v").facts[0].context_turns is None  # migrated: provenance unknown
    facts, kv, emb = sw.generation("u", 2)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    assert sw.check(Store.open(root, sw.FP).reads.snapshot("u")) == 2


def _memory_tier(tmp_path):
    from kvmem.kvformat import SpanKV
    from kvmem.store.tiers import MemoryTier

    def value(n: int):
        return SpanKV(torch.ones(1, 1, n, 4), torch.ones(1, 1, n, 4))

    return MemoryTier(1024), value, lambda got: got.keys.shape[2]


def _disk_tier(tmp_path):
    from kvmem.store.tiers import DiskTier

    def read(got):
        with got:
            return len(got.read())

    return DiskTier(tmp_path / "disk", 64 << 10), lambda n: bytes(32 * n), lambda got: read(got) // 32


@pytest.mark.parametrize("make", [_memory_tier, _disk_tier], ids=["memory", "disk"])
def test_both_read_tiers_satisfy_the_seam(tmp_path, make):
    """The memory tier (facts' KV) and the disk tier (whole segments) implement every method of ``ReadTier`` and
    behave the same through it: what is put is contained and got back, removing it twice is no error, a value
    larger than the whole tier is not kept, and the least recently used goes first when the bound is reached."""
    from kvmem.engines.base import check_implements
    from kvmem.store.tiers import DiskTier, MemoryTier, ReadTier

    for impl in (MemoryTier, DiskTier):
        assert check_implements(impl, ReadTier) == [], impl
    tier, value, size = make(tmp_path)
    assert not tier.contains("a") and tier.get("a") is None and tier.remove("a") is False
    assert tier.put("a", value(2)) is True and tier.contains("a") and size(tier.get("a")) == 2
    assert list(tier.held()) == ["a"] and tier.nbytes() > 0
    assert tier.remove("a") is True and not tier.contains("a") and tier.get("a") is None and not tier.remove("a")
    assert tier.put("huge", value(100_000)) is False and not tier.contains("huge")
    tier.clear()
    assert list(tier.held()) == [] and not tier.contains("a")


def test_user_page_lists_one_tenants_users_by_page_and_substring(tmp_path):
    """``Reader.user_page`` (the users of /ui): a tenant's users with live memory counts (their agent scopes
    summed in), tokens and last commit, ordered, paged and searched; another tenant's users, users whose facts
    were all deleted and scopes without a user id are not listed; a LIKE wildcard in the search is a character."""
    L, H, D = 2, 2, 4
    st = Store.create(tmp_path / "s", FP, "hdr", [1, 2], torch.randn(L, H, 2, D), torch.randn(L, H, 2, D),
                      {"name": "e", "dim": 8})  # fmt: skip

    def put(user, n, tokens=3):
        facts = [FactRecord(f"{user}#{i}", user, f"fact {i}", "", "", "", tuple(range(tokens))) for i in range(n)]
        kv = [torch.randn(L, H, tokens, D) for _ in facts]
        vecs = torch.nn.functional.normalize(torch.randn(n, 8), dim=1)
        st.writes.commit(Write(user, tuple(facts), tuple(kv), tuple(kv), vecs))
        return [f.fact_id for f in facts]

    for u in ("bob", "alice", "al_x", "carl"):
        put(f"acme:{u}", 2)
    put("acme:alice/agent:travel", 3, tokens=5)
    put("acme:/agent:solo", 1)  # no user id
    put("globex:alice", 4)
    gone = put("acme:dora", 1)
    st.writes.erase("acme:dora", gone)
    total, page = st.reads.user_page("acme:")
    assert total == 4 and [h for h, *_ in page] == ["acme:al_x", "acme:alice", "acme:bob", "acme:carl"]
    alice = {h: rest for h, *rest in page}["acme:alice"]
    assert alice[:2] == [5, 2 * 3 + 3 * 5] and alice[2] > 0  # both scopes: 5 facts, 21 tokens
    assert st.reads.user_page("acme:", offset=1, limit=2) == (4, page[1:3])
    assert [h for h, *_ in st.reads.user_page("acme:", "ALI")[1]] == ["acme:alice"]  # case-insensitive
    assert st.reads.user_page("acme:", "l_")[0] == 1  # '_' is itself, not any character
    assert st.reads.user_page("globex:")[0] == 1 and st.reads.user_page("initech:") == (0, [])
    st.close()
