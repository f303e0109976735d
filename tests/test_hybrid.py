"""Hybrid retrieval: the store's full-text index follows every write on both backends (SQLite FTS5, PostgreSQL's
tsvector), cosine fused with it under Mem0's filters and scopes, ``explain``, and LoCoMo evidence recall."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import store_worker as sw
from conftest import store_backend
from kvmem.store import FactRecord, Store, Write


@pytest.fixture(params=["local", "postgres"])
def backend(request, monkeypatch):
    """The local store (SQLite FTS5) and the shared one (PostgreSQL, a real cluster: ``conftest.postgres``)."""
    return store_backend(request, monkeypatch)


def _add(st: Store, user: str, texts: list[str], prefix: str, emb=None, metadata=None) -> str:
    facts = [
        FactRecord(f"{prefix}{i}", user, t, "", "", "", (1, 2), 0, 0, metadata=json.dumps((metadata or {}).get(i, {})))
        for i, t in enumerate(texts)
    ]
    kv = [torch.zeros(2, 1, 2, 64) for _ in facts]
    if emb is None:
        emb = torch.nn.functional.normalize(torch.ones(len(facts), 4), dim=1)
    return st.writes.commit(Write(user, facts, kv, kv, emb))


def _found(st: Store, user: str, query: str) -> list[str]:
    """Fact ids of ``user``'s keyword matches for ``query``, best first (scores checked positive, descending)."""
    got = st.reads.keyword(user, query, 10)
    scores = [s for _, s in got]
    assert all(s > 0 for s in scores) and scores == sorted(scores, reverse=True), got
    by_row = {f.row: f.fact_id for f in st.reads.snapshot(user).facts} if got else {}
    return [by_row[r] for r, _ in got]


def test_the_keyword_index_follows_every_write(tmp_path, backend):
    """Adds, deletes, compaction and reset keep the full-text index of live facts, per user: a user whose name
    starts another's sees only its own facts; stop words and full-text syntax in a query match nothing extra."""
    st = sw.create(tmp_path / "s")
    _add(st, "u", ["Caroline went hiking in the mountains", "Melanie paints sunsets", "Oscar the dog hikes too"], "a")
    _add(st, "u-2", ["Caroline hiking again"], "b")
    assert _found(st, "u", "Where did Caroline go hiking?") == ["a0", "a2"]  # both words, then one (stemmed)
    assert _found(st, "u-2", "hiking") == ["b0"] and _found(st, "nobody", "hiking") == []
    assert _found(st, "u", "what is the") == []  # stop words only
    assert _found(st, "u", '"sunsets" OR NEAR( owner : * -') == ["a1"]  # only the words reach the index
    st.writes.commit(Write("u", delete=["a0"]))
    assert _found(st, "u", "Caroline hiking") == ["a2"]
    _add(st, "u", ["Caroline hikes every Sunday"], "c")
    assert _found(st, "u", "Caroline hiking") == ["c0", "a2"]
    rows = {f.fact_id: f.row for f in st.reads.snapshot("u").facts}
    st.writes.compact("u")
    assert {f.fact_id: f.row for f in st.reads.snapshot("u").facts} == rows and _found(st, "u", "Caroline hiking") == [
        "c0",
        "a2",
    ]
    st.writes.delete_user("u")
    assert _found(st, "u", "Caroline hiking") == [] and _found(st, "u-2", "Caroline") == ["b0"]
    st.writes.reset()
    assert _found(st, "u-2", "Caroline") == []
    st.close()


def test_a_store_from_before_the_index_is_searched_by_cosine_until_it_gets_one(tmp_path):
    """``tests/fixtures/store_0cc4d45`` has no full-text index: keyword search says so (None) and hybrid search
    ranks by cosine; ``add_text_index`` indexes its live facts once, and writes after it keep it."""
    from kvmem.retrieve import Fusion, IndexCache, search

    root = tmp_path / "old"
    shutil.copytree(Path(__file__).with_name("fixtures") / "store_0cc4d45", root)
    st = Store.open(root, sw.FP)
    assert st.reads.keyword("v", "a later fact", 5) is None
    ukv = st.reads.snapshot("v")
    (hit,) = search(IndexCache(1 << 20), st, ukv, torch.tensor([1.0, 0, 0, 0]), "later", 5, None, Fusion())
    assert (hit.position, hit.keyword, hit.score) == (0, None, 1.0)
    from typer.testing import CliRunner

    from kvmem.cli import app

    res = CliRunner().invoke(app, ["store", "text-index", "--store", str(root)])  # another connection
    assert res.exit_code == 0 and "full-text index created" in res.output and st.reads.has_text_index()
    assert st.writes.add_text_index() is False
    assert _found(st, "v", "later") == ["x1"]
    assert _found(st, "u", "gen") == ["u-g1-1", "u-g1-2"]  # live facts only: the fixture deleted u-g1-0
    _add(st, "v", ["another later fact"], "y")
    assert sorted(_found(st, "v", "later")) == ["x1", "y0"]
    st.close()


TEXTS = [
    "Alex mended the garden wall last spring",
    "Alex repaired the broken gate in April",
    "Alex painted the shed green",
    "Alex plays tennis on Thursdays",
]
TARGET = "Pemberton came by on Tuesday"  # the only fact sharing a word with QUERY, in the agent's scope
QUERY = "When did Pemberton fix the fence?"


@pytest.fixture(scope="module")
def embedder():
    from kvmem.retrieve import Embedder

    return Embedder()


def test_hybrid_search_fuses_keywords_under_filters_and_explains(tmp_path, backend, embedder):
    """Memory.search across two scopes (user alex, and alex with agent coach): reciprocal rank fusion puts the one
    keyword match first and the rest in cosine order, with each result's cosine (equal to the embedder's) and BM25
    parts in ``score_details``; a filter that excludes it keeps it out of hybrid results too; the Memory's default
    and a call's ``keyword_search`` choose the retrieval."""
    from kvmem import Memory
    from kvmem.retrieve import Fusion

    st = sw.create(tmp_path / "s")
    _add(st, "alex", TEXTS, "a", embedder.embed(TEXTS), {i: {"topic": "home"} for i in range(len(TEXTS))})
    _add(st, "alex/agent:coach", [TARGET], "t", embedder.embed([TARGET]), {0: {"topic": "visits"}})
    root = st.root
    st.close()
    m = Memory(root, embedder=embedder, hybrid=Fusion("rrf", 1.0, 60))  # hybrid by default, per call off below
    q = embedder.embed([QUERY])[0]
    cosine = {t: float(v @ q) for t, v in zip([*TEXTS, TARGET], embedder.embed([*TEXTS, TARGET]))}

    plain = m.search(QUERY, filters={"user_id": "alex"}, top_k=5, threshold=None, explain=True, keyword_search=False)
    plain = plain["results"]
    by_cosine = sorted(cosine, key=lambda t: -cosine[t])
    assert [r["memory"] for r in plain] == by_cosine
    assert all(r["score_details"]["bm25_score"] is None for r in plain)

    hybrid = m.search(QUERY, filters={"user_id": "alex"}, top_k=5, threshold=None, explain=True)
    got = hybrid["results"]
    # reciprocal rank fusion: the one keyword match first, then the rest in cosine order
    assert [r["memory"] for r in got] == [TARGET] + [t for t in by_cosine if t != TARGET]
    assert got[0]["agent_id"] == "coach"
    for r in got:
        d = r["score_details"]
        assert d["semantic_score"] == pytest.approx(cosine[r["memory"]], abs=1e-5)
        assert (d["bm25_score"] is not None) == (r["memory"] == TARGET) and d["fusion"] == "rrf"
        assert r["score"] == pytest.approx(d["final_score"], abs=1e-6) and 0 < r["score"] <= 1
    assert got[0]["score_details"]["bm25_score"] > 0 and got[0]["score_details"]["keyword_rank"] == 1
    assert [r["score"] for r in got] == sorted((r["score"] for r in got), reverse=True)

    home = m.search(QUERY, filters={"user_id": "alex", "topic": "home"}, top_k=5, threshold=None, keyword_search=True)
    assert TARGET not in {r["memory"] for r in home["results"]} and len(home["results"]) == len(TEXTS)
    assert "score_details" not in home["results"][0]
    on = Memory(root, embedder=embedder, hybrid=True)  # the default fusion (weighted); a call turns it off
    assert on.search(QUERY, filters={"user_id": "alex"}, top_k=1, threshold=None)["results"][0]["memory"] == TARGET
    off = on.search(QUERY, filters={"user_id": "alex"}, top_k=1, threshold=None, keyword_search=False)
    assert off["results"][0]["memory"] == plain[0]["memory"]
    m.close()
    on.close()


def test_bad_hybrid_options_are_refused(tmp_path):
    from kvmem import Memory
    from kvmem.bench.recall import describe, parse_fusion
    from kvmem.memory import MemoryInputError
    from kvmem.retrieve import Fusion

    with pytest.raises(MemoryInputError, match="hybrid must be"):
        Memory(tmp_path / "none", hybrid="yes")
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="fusion must be one of"):
        Fusion("bm25")
    assert parse_fusion("cosine") is None and parse_fusion("rrf:20:0.5") == Fusion("rrf", 0.5, 20)
    assert parse_fusion("weighted:0.3") == Fusion("weighted", 0.3)
    with pytest.raises(ValueError, match="one of cosine, hybrid"):
        parse_fusion("rrf:1:2:3")
    with pytest.raises(ValueError, match=r"keyword weight must be in \[0, 1\], not 1.5"):
        parse_fusion("weighted:1.5")
    with pytest.raises(ValueError, match="rrf_k and pool must be >= 1, not 0 and 60"):
        parse_fusion("rrf:0")
    # what a run records reads back as the fusion that ran (summaries and records carry it)
    recorded = {"weighted:0.1234567": "weighted:0.1234567", "hybrid": "weighted:0.1", "weighted:-0": "weighted:0",
                "rrf": "rrf:60:1", "rrf:7:1.2e-05": "rrf:7:1.2e-05"}  # fmt: skip
    for spec, told in recorded.items():
        assert describe(parse_fusion(spec)) == told and parse_fusion(told) == parse_fusion(spec), spec


def test_locomo_facts_and_questions_name_every_evidence_turn(locomo_path):
    """Evidence as the file spells it (lists, "a; b", "a, b", "a b", a stray "D", the typo "D:11:26") becomes
    turn ids; an observation with several evidence turns keeps all of them, earliest first."""
    from kvmem.locomo import dia_ids, load_locomo

    assert dia_ids(["D8:6; D9:17"]) == ("D8:6", "D9:17") and dia_ids("D26:14, D26:34") == ("D26:14", "D26:34")
    assert dia_ids(["D9:1 D4:4 D4:6"]) == ("D9:1", "D4:4", "D4:6") and dia_ids(["D1:18", "D", "D:11:26"]) == (
        "D1:18",
        "D11:26",
    )
    facts = {f.fact_id: f for c in load_locomo(locomo_path) for f in c.facts}
    multi = [f for f in facts.values() if len(f.source_turns) > 1]
    assert len(multi) == 8 and all(f.source_turn in f.source_turns or "," in f.source_turn for f in multi)
    assert all(f.source_turns for f in facts.values())


def test_evidence_recall_counts_turns_per_category(tmp_path, embedder):
    """Recall@k is the share of a category's evidence turns whose facts are retrieved; a turn no fact came from
    counts against recall and not toward coverage."""
    from kvmem.bench.recall import evidence_recall
    from kvmem.locomo import Conversation, Fact, Question
    from kvmem.retrieve import Fusion, IndexCache

    texts = ["Caroline adopted a cat named Luna", "Melanie ran a marathon in Boston", "Caroline moved to Denver"]
    facts = [
        Fact(f"c/s1/0/{i}", "c", t, "", f"D1:{i + 1}", "", (f"D1:{i + 1}",) + (("D2:1",) if i == 2 else ()))
        for i, t in enumerate(texts)
    ]
    questions = [
        Question("What is the name of Caroline's cat?", "Luna", 4, ("D1:1",)),
        Question("Where did Melanie run, and where did Caroline move?", "Boston; Denver", 1, ("D1:2", "D2:1", "D9:9")),
        Question("unanswerable", "", 5, ("D1:1",)),
    ]
    st = sw.create(tmp_path / "s")
    rec = [FactRecord(f.fact_id, "c", f.text, "", f.source_turn, "", (1, 2)) for f in facts]
    kv = [torch.zeros(2, 1, 2, 64) for _ in rec]
    st.writes.commit(Write("c", rec, kv, kv, embedder.embed(texts)))
    conv = Conversation("c", [], facts, questions)
    for fusion in (None, Fusion()):
        got = evidence_recall([(conv, st, IndexCache(1 << 20))], embedder, (1, 3), fusion)
        cats = got["categories"]
        assert set(cats) == {"1", "4", "overall"} and (cats["4"]["turns"], cats["1"]["turns"]) == (1, 3)
        assert cats["4"]["recall"] == {"1": 100.0, "3": 100.0} and cats["1"]["coverage"] == pytest.approx(66.67)
        assert cats["1"]["recall"]["3"] == pytest.approx(66.67) and cats["overall"]["recall"]["3"] == 75.0
    st.close()
