"""Writes that are all or nothing, and provenance that survives updates: an updated memory keeps the turns it came
from, so erasing it erases the original words and re-encodes what was computed behind them (stored KV equal, in
fp32, to a store that never saw them); an inferred add that UPDATEs one memory and DELETEs another is one
compare-and-set commit, so a 409 (MemoryConflict) leaves the memory it would have deleted live and unchanged; an
import whose last record is bad writes nothing. (Malformed filters as 400s: tests/test_server.py.)"""

from __future__ import annotations

import pytest

from kvmem.memory import Memory, MemoryConflict, MemoryInputError
from kvmem.memory.extract import Decision, Extractor
from kvmem.models import MANIFEST, model_dir
from test_erasure import SECRET, assert_no_byte_of, assert_same_kv

FAST = "smollm2-135m-instruct"
NEW_NUMBER = "987-65-4321"


@pytest.fixture(scope="module")
def shared():
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder

    return load(FAST, dtype="float32"), Embedder()


def memory(root, shared, **kw) -> Memory:
    lm, emb = shared
    return Memory(root, model=lm, embedder=emb, window=5, neighbours=4, **kw)


class Script(Extractor):
    """Scripted extraction: ``facts`` for the facts step; ``decide(existing ids -> texts)`` for the reconcile
    step, after ``hook`` (what another writer does between the add's read of the scope and its commit)."""

    def __init__(self, facts, decide=None, hook=None):
        self.out, self.decide, self.hook = facts, decide, hook

    def facts(self, messages, date, prompt=None):
        return list(self.out)

    def reconcile(self, facts, existing):
        if self.hook is not None:
            self.hook()
        return self.decide(dict(existing)) if self.decide else [Decision("ADD", f) for f in facts]


def test_an_inferred_update_keeps_the_original_turn_and_deleting_it_erases_that_too(tmp_path, shared):
    """ADD a secret (infer), a memory encoded behind its turn, UPDATE the secret (infer): the memory names both
    turns it came from; deleting it erases both, no byte of the secret is left, and the memory encoded behind the
    original turn is re-encoded to what a store that never saw the secret holds (before: only the updating turn
    was erased, the original words and the derived KV stayed)."""
    a, b = memory(tmp_path / "a", shared), memory(tmp_path / "b", shared)
    said = f"My social security number is {SECRET}."
    a.extractor = Script([said])
    [added] = a.add(said, "u")["results"]
    a.add("I walk my dog every morning.", "u", infer=False)
    first = [t["idx"] for t in a.store.reads.turns("u") if SECRET in t["content"]]
    changed = f"My social security number is now {NEW_NUMBER}."
    a.extractor = Script([changed], lambda existing: [Decision("UPDATE", changed, added["id"])])
    out = a.add(changed, "u")
    assert [(r["event"], r["id"]) for r in out["results"]] == [("UPDATE", added["id"])]
    now = a.store.reads.fact(added["id"])
    assert now.text == changed and set(first) < set(now.source_turns) and len(now.source_turns) == 2
    got = a.delete(added["id"])["erasure"]
    assert got == {"erased": 1, "turns": 2, "reencoded": 1, "deferred": 0}
    b.add("I walk my dog every morning.", "u", infer=False)
    assert_same_kv(a, b, "u")
    assert [t["content"] for t in a.store.reads.turns("u")] == [t["content"] for t in b.store.reads.turns("u")]
    assert a.store.fsck()["derived"] == {}
    assert_no_byte_of(a, SECRET)
    assert_no_byte_of(a, NEW_NUMBER)


def test_an_update_of_a_memory_of_unknown_provenance_keeps_the_turns_that_hold_its_words(tmp_path, shared):
    """A memory written before provenance was recorded (its column NULL) came from the turns that hold its words;
    ``Memory.update`` keeps them, so deleting the updated memory still erases the original turn (before: the new
    row named no source and the erasure looked for the new words only)."""
    a = memory(tmp_path / "a", shared)
    [added] = a.add(f"My social security number is {SECRET}.", "u", infer=False)["results"]
    a.add("I walk my dog every morning.", "u", infer=False)
    with a.store.writes.writer("u"), a.store.rows.transaction():
        a.store.rows.execute("UPDATE facts SET provenance=NULL WHERE fact_id=?", (added["id"],))
    a.store.reads.forget("u")
    assert a.store.reads.fact(added["id"]).context_turns is None
    a.update(added["id"], "My social security number changed.")
    assert a.store.reads.fact(added["id"]).source_turns == (0,)
    assert a.delete(added["id"])["erasure"]["turns"] == 1
    assert [t["content"] for t in a.store.reads.turns("u")] == ["I walk my dog every morning."]
    assert_no_byte_of(a, SECRET)


def test_an_inferred_add_that_lost_a_race_applies_nothing(tmp_path, shared):
    """An add planned to UPDATE A and DELETE B, where another writer updated A after the add read the scope: 409
    (MemoryConflict), and B is still live with the same row, text and turn, no turn of the add is kept and A
    holds the other writer's text (before: B's erasure had landed when the conflict was raised)."""
    a = memory(tmp_path / "a", shared)
    other = memory(tmp_path / "a", shared)  # another writer of the same store
    [home] = a.add("I live in Porto.", "u", infer=False)["results"]
    [cat] = a.add("I have a cat named Tom.", "u", infer=False)["results"]
    before, turns = a.store.reads.fact(cat["id"]), a.store.reads.turns("u")
    said = "I live in Lisbon and I gave my cat away."
    a.extractor = Script(
        ["I live in Lisbon."],
        lambda existing: [Decision("UPDATE", "I live in Lisbon.", home["id"]), Decision("DELETE", "", cat["id"])],
        hook=lambda: other.update(home["id"], "I live in Braga."),
    )
    with pytest.raises(MemoryConflict):
        a.add(said, "u")
    after = a.store.reads.fact(cat["id"])
    assert after is not None and (after.row, after.text) == (before.row, before.text)
    assert a.store.reads.turns("u") == turns
    assert a.store.reads.fact(home["id"]).text == "I live in Braga."
    assert [e["event"] for e in a.history(cat["id"])] == ["ADD"]
    a.extractor.hook = None  # the same add again, with no race: both decisions land in one commit
    out = a.add(said, "u")
    assert sorted(r["event"] for r in out["results"]) == ["DELETE", "UPDATE"]
    assert out["erasure"]["erased"] == 1 and a.store.reads.fact(cat["id"]) is None
    assert a.store.reads.fact(home["id"]).text == "I live in Lisbon."


def test_an_import_whose_last_record_is_bad_writes_nothing(tmp_path, shared):
    """Every field of every record is checked before the first batch is committed (batches of one here), so a
    bad ``categories`` / ``role`` / ``actor_id`` in the last record is a MemoryInputError naming it and no scope
    has a version (before: the batches ahead of it were committed, or a bad field was stored)."""
    a = memory(tmp_path / "a", shared)
    a.import_batch_size = 1
    for bad in ({"categories": ["ok", "\ud800"]}, {"role": "x" * 9000}, {"actor_id": {"n": float("nan")}},
                {"categories": "a"}):  # fmt: skip
        export = [
            {"memory": "Jo likes jazz.", "user_id": "jo", "created_at": 1_700_000_000},
            {"memory": "Jo plays chess.", "user_id": "jo", "created_at": 1_700_000_100},
            {"memory": "Jo reads novels.", "user_id": "jo", "created_at": 1_700_000_200, **bad},
        ]
        with pytest.raises(MemoryInputError, match="record 2"):
            a.import_memories(export)
        assert a.store.reads.version("jo") is None and a.store.reads.users() == [], bad
