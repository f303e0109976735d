"""Erasure that cascades: a deleted memory, a forgotten one and an erased user leave no byte of their text in the
store (turns, history, every text column, the SQLite files with their WAL, the PostgreSQL tables), and every memory
whose KV was computed behind them is re-encoded without them: its stored KV equals, in fp32 on the transformers
engine, the KV a store that never saw the secret computes. Both backends."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
import torch

from conftest import postgres_schema
from kvmem.memory import Memory
from kvmem.memory.extract import Extractor
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
SECRET = "123-45-6789"
TABLES = ("meta", "users", "segments", "facts", "history", "turns")


@pytest.fixture(scope="module")
def shared():
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder

    return load(FAST, dtype="float32"), Embedder()


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path):
    """Two store locations on one backend: (location of the store under test, of the reference, segments URLs)."""
    if request.param == "sqlite":
        return (tmp_path / "a", None), (tmp_path / "b", None)
    base = request.getfixturevalue("postgres")
    name = request.node.name.replace("[", "_").replace("]", "").replace("-", "_").lower()[-40:]
    return (
        (postgres_schema(base, f"{name}_a"), (tmp_path / "kv_a").as_uri()),
        (postgres_schema(base, f"{name}_b"), (tmp_path / "kv_b").as_uri()),
    )


def memory(loc, shared, **kw) -> Memory:
    lm, emb = shared
    root, segments = loc
    return Memory(root, model=lm, embedder=emb, window=5, neighbours=4, segments_url=segments, **kw)


def kv_by_text(mem: Memory, user: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ukv = mem.store.reads.snapshot(user)
    return {f.text: ukv.fact_kv(i) for i, f in enumerate(ukv.facts)}


def assert_same_kv(a: Memory, b: Memory, user: str) -> None:
    got, want = kv_by_text(a, user), kv_by_text(b, user)
    assert sorted(got) == sorted(want)
    for text, (k, v) in want.items():
        gk, gv = got[text]
        assert gk.shape == k.shape, text
        assert torch.allclose(gk, k, atol=1e-5, rtol=1e-4) and torch.allclose(gv, v, atol=1e-5, rtol=1e-4), text


def assert_no_byte_of(mem: Memory, secret: str) -> None:
    """Nowhere in the store: every file of a local store (the SQLite database, its WAL and shared memory, the
    segments), or every row of every table of a PostgreSQL one (each row as text)."""
    st = mem.store
    if isinstance(st.root, str):
        import psycopg

        with psycopg.connect(st.root, autocommit=True) as conn:
            for table in (*TABLES, "kvmem_manifest"):
                for (row,) in conn.execute(f"SELECT t::text FROM {table} t"):
                    assert secret not in row, (table, row)
        return
    files = [p for p in st.root.rglob("*") if p.is_file()]
    assert any(p.name == "meta.sqlite-wal" for p in files)  # the WAL is searched too
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
        if path.name.startswith("meta.sqlite"):  # the keyword index stores terms, not the text: none may remain
            for term in re.findall(r"[0-9A-Za-z]{4,}", secret):
                assert term.encode() not in path.read_bytes(), (path, term)
    db = sqlite3.connect(st.root / "meta.sqlite")
    for table in TABLES:
        for row in db.execute(f"SELECT * FROM {table}"):
            assert secret not in repr(row), (table, row)
    db.close()


def test_a_deleted_secret_is_erased_and_what_follows_never_saw_it(where, shared):
    """Add a secret, a memory encoded behind it (its window holds the secret's turn, its neighbours the secret),
    delete the secret, add another memory: both memories' stored KV equal a store's that never saw the secret,
    and no byte of it is left (the old code kept the turn, both history rows and the derived KV)."""
    a, b = memory(where[0], shared), memory(where[1], shared)
    a.add("I like green tea.", "u", infer=False)
    secret = a.add(f"My social security number is {SECRET}.", "u", infer=False)["results"][0]["id"]
    a.add("I walk my dog every morning.", "u", infer=False)
    behind = next(f for f in a.store.reads.snapshot("u").facts if f.text.startswith("I walk"))
    assert secret in behind.context_facts and len(behind.context_turns) == 2  # its provenance: the secret
    held = a.store.reads.fact(secret).segment
    out = a.delete(secret)
    assert out["erasure"] == {"erased": 1, "turns": 1, "reencoded": 1, "deferred": 0}
    a.add("I play chess on Sundays.", "u", infer=False)
    for text in ("I like green tea.", "I walk my dog every morning.", "I play chess on Sundays."):
        b.add(text, "u", infer=False)
    assert_same_kv(a, b, "u")
    assert [t["content"] for t in a.store.reads.turns("u")] == [t["content"] for t in b.store.reads.turns("u")]
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in a.history(secret)] == [
        ("ADD", None, None),
        ("DELETE", None, None),
    ]  # the events stay, their text is gone
    report = a.store.fsck()
    assert report["derived"] == {} and report["bad"] == {}
    assert a.store.segment_name("u", held) not in a.store.segments.names()  # the secret's own KV is gone
    assert_no_byte_of(a, SECRET)
    if where[0][1] is None:  # a copy keeps what each fact was computed behind, turn indexes renumbered
        from kvmem.store import Store, copy_store

        copy_store(a.store.root, a.store.root.with_name("copy"))

        def behind(st):
            text = {t["idx"]: t["content"] for t in st.reads.turns("u")}
            return {f.text: ([text[t] for t in f.context_turns], f.context_facts) for f in st.reads.snapshot("u").facts}

        assert behind(Store.open(a.store.root.with_name("copy"))) == behind(a.store)
        assert behind(a.store)["I play chess on Sundays."][0] == ["I like green tea.", "I walk my dog every morning."]


def test_deleting_a_user_erases_its_scopes(where, shared):
    """``delete_all(user_id=...)`` (what ``DELETE /v2/entities/user/{id}`` and mem0's ``delete_users`` call; through
    the real client in ``tests/test_mem0.py``): every scope of the user loses its facts, turns and history text,
    and the user's next memory is encoded as in a store that never saw them."""
    a, b = memory(where[0], shared), memory(where[1], shared)
    a.add(f"My social security number is {SECRET}.", "u", infer=False)
    a.add("I walk my dog every morning.", "u", agent_id="coach", infer=False)
    out = a.delete_all(user_id="u")
    assert out["erasure"] == {"erased": 2, "turns": 2, "reencoded": 0, "deferred": 0}
    a.add("I play chess on Sundays.", "u", infer=False)
    b.add("I play chess on Sundays.", "u", infer=False)
    assert_same_kv(a, b, "u")
    assert [t["content"] for t in a.store.reads.turns("u")] == ["I play chess on Sundays."]
    assert_no_byte_of(a, SECRET)


def test_deferred_reencoding_is_bounded_and_reported(tmp_path, shared):
    """With re-encoding deferred the derived KV stays until the background job runs: fsck names its segment,
    ``stale`` its deadline, and ``reencode_pending`` makes it equal the eager result."""
    a = memory((tmp_path / "a", None), shared, defer_reencode_s=30.0)
    b = memory((tmp_path / "b", None), shared)
    secret = a.add(f"My social security number is {SECRET}.", "u", infer=False)["results"][0]["id"]
    a.add("I walk my dog every morning.", "u", infer=False)
    out = a.delete(secret)
    assert out["erasure"] == {"erased": 1, "turns": 1, "reencoded": 0, "deferred": 1}
    ((user, _, _, by),) = a.store.reads.stale()
    assert user == "u" and by > 0
    assert list(a.store.fsck()["derived"].values()) == [[a.store.reads.snapshot("u").facts[0].fact_id]]
    assert a.reencode_pending() == {"reencoded": 1, "scopes": 1, "collected": 0}
    assert a.store.reads.stale() == [] and a.store.fsck()["derived"] == {}
    b.add("I walk my dog every morning.", "u", infer=False)
    assert_same_kv(a, b, "u")
    assert_no_byte_of(a, SECRET)


class ForgetStub(Extractor):
    """Extracts nothing: the request to forget is acted on by ``reconcile`` itself (no model decode)."""

    def complete(self, prompt, schema):
        return json.dumps({"facts": []} if "facts" in schema["properties"] else {"memory": []})


def test_a_request_to_forget_erases_like_a_delete(where, shared):
    """``add(infer=True)`` of "please forget ...": the memory it names is erased with its turn, the request
    itself is not kept as a turn, and the memory encoded behind the secret is re-encoded without it."""
    a, b = memory(where[0], shared, extractor=ForgetStub()), memory(where[1], shared)
    a.add(f"My social security number is {SECRET}.", "u", infer=False)
    a.add("I walk my dog every morning.", "u", infer=False)
    out = a.add("Please forget my social security number.", "u", infer=True)
    assert [r["event"] for r in out["results"]] == ["DELETE"]
    assert out["erasure"] == {"erased": 1, "turns": 1, "reencoded": 1, "deferred": 0}
    a.add("I play chess on Sundays.", "u", infer=False)
    b.add("I walk my dog every morning.", "u", infer=False)
    b.add("I play chess on Sundays.", "u", infer=False)
    assert_same_kv(a, b, "u")
    assert [t["content"] for t in a.store.reads.turns("u")] == [t["content"] for t in b.store.reads.turns("u")]
    assert_no_byte_of(a, SECRET)


def test_an_expired_memory_is_erased_and_reset_counts(tmp_path, shared):
    """A passed ``expiration_date`` erases like a delete (``Memory.expire``); ``reset`` says what it erased."""
    a = memory((tmp_path / "a", None), shared)
    a.add(f"My social security number is {SECRET}.", "u", infer=False, expiration_date="2099-01-01")
    a.add("I walk my dog every morning.", "u", infer=False)
    assert a.expire(today="2099-01-02") == {"erased": 1, "turns": 1, "reencoded": 1, "deferred": 0}
    assert [f.text for f in a.store.reads.snapshot("u").facts] == ["I walk my dog every morning."]
    assert_no_byte_of(a, SECRET)
    assert a.reset()["erasure"] == {"erased": 1, "turns": 1, "reencoded": 0, "deferred": 0}
