"""Online memory: Mem0-shaped round trips, events and history, tombstones never served, updates that
keep the id, exact KV for every write, compaction, bad input that changes nothing, extraction with a stub and
with the real model (output always parses), and a concurrent writer against readers checking every served id."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading

import pytest
import torch

from kvmem.memory import Memory, MemoryInputError
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def shared():
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder

    return load(FAST, dtype="float32"), Embedder()


@pytest.fixture
def mem(tmp_path, shared):
    lm, emb = shared
    return Memory(tmp_path / "s", model=lm, embedder=emb, window=2)


def test_round_trip_events_and_history(mem):
    r = mem.add(
        [
            {"role": "user", "content": "I moved to Lisbon in March."},
            {"role": "user", "content": "My sister Ana plays the cello."},
        ],
        "alice",
        infer=False,
        metadata={"source": "chat"},
    )
    assert [x["event"] for x in r["results"]] == ["ADD", "ADD"]
    lisbon, ana = (x["id"] for x in r["results"])
    assert [m["memory"] for m in mem.get_all("alice")["results"]] == [
        "I moved to Lisbon in March.",
        "My sister Ana plays the cello.",
    ]
    hits = mem.search("Which instrument does Ana play?", "alice", limit=2)["results"]
    assert hits[0]["id"] == ana and hits[0]["score"] > hits[1]["score"]
    assert set(hits[0]) >= {"id", "memory", "score", "metadata", "created_at", "updated_at"}
    assert hits[0]["metadata"] == {"source": "chat"}
    assert mem.search("cello", "alice", limit=5, filters={"source": "other"})["results"] == []
    assert mem.get(lisbon)["memory"] == "I moved to Lisbon in March."
    assert mem.update(lisbon, "I moved to Porto in April.") == {"message": "Memory updated successfully!"}
    got = mem.get(lisbon)
    assert got["memory"] == "I moved to Porto in April." and got["id"] == lisbon
    # Ana's fact and her turn; the update to Porto was encoded behind both, so it is re-encoded without them
    erased = {"erased": 1, "turns": 1, "reencoded": 1, "deferred": 0}
    assert mem.delete(ana) == {"message": "Memory deleted successfully!", "erasure": erased}
    assert mem.get(ana) is None
    assert [m["id"] for m in mem.get_all("alice")["results"]] == [lisbon]
    assert all(h["id"] != ana for h in mem.search("cello", "alice", limit=10)["results"])
    h = mem.history(lisbon)
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in h] == [
        ("ADD", None, "I moved to Lisbon in March."),
        ("UPDATE", "I moved to Lisbon in March.", "I moved to Porto in April."),
    ]
    assert [e["event"] for e in mem.history(ana)] == ["ADD", "DELETE"]
    assert mem.get_all("bob")["results"] == [] and mem.search("x", "bob")["results"] == []
    mem.delete_all("alice")
    assert mem.get_all("alice")["results"] == [] and [e["event"] for e in mem.history(lisbon)][-1] == "DELETE"
    mem.reset()
    with pytest.raises(MemoryInputError, match="not found"):
        mem.history(lisbon)


def test_every_write_stores_exact_context_window_kv(mem, shared):
    """Each fact's stored KV is its tokens' pre-RoPE K / raw V behind the w turns before it (stored turns,
    then this add's earlier messages), as one plain encode of [header][context][fact] gives."""
    from kvmem.encode import encode_spans

    lm, _ = shared
    mem.encoding = dataclasses.replace(
        mem.encoding, neighbours=0
    )  # the window alone (neighbour-aware encoding: tests/test_neighbours.py)
    mem.add("Hello there, I am Carla.", "carla", infer=False)
    r = mem.add(
        [{"role": "user", "content": "I work as a nurse."}, {"role": "user", "content": "I like tea."}],
        "carla",
        infer=False,
    )
    ukv = mem.store.reads.snapshot("carla")
    pos = ukv.row_of()[r["results"][1]["id"]]
    fact = ukv.facts[pos]
    header = mem.store.header_token_ids
    ctx = lm.tokenizer("user: Hello there, I am Carla.\nuser: I work as a nurse.\n", add_special_tokens=False)[
        "input_ids"
    ]
    seq = header + ctx + list(fact.token_ids)
    (ref,) = encode_spans(lm.model, [seq], [(len(seq) - fact.num_tokens, len(seq))])
    k, v = ukv.fact_kv(pos)
    assert torch.allclose(k, ref.keys, atol=1e-5) and torch.allclose(v, ref.values, atol=1e-5)
    assert lm.tokenizer.decode(fact.token_ids).strip().endswith("I like tea.")


def test_adds_are_incremental_and_compaction_keeps_what_is_served(mem):
    """An add writes one new segment and leaves the old files untouched (O(new tokens)); compaction rewrites
    the live facts into one segment, drops dead rows, and search / get_all return the same."""
    users = mem.store.root / "users"
    ids = [mem.add(f"Fact number {i} about the garden.", "dan", infer=False)["results"][0]["id"] for i in range(4)]
    files = {p.name: p.stat().st_ino for p in users.iterdir()}
    assert len(files) == 4
    mem.add("Fact number 4 about the garden.", "dan", infer=False)
    after = {p.name: p.stat().st_ino for p in users.iterdir()}
    assert len(after) == 5 and all(after[n] == ino for n, ino in files.items())
    mem.delete(ids[1])
    before = (mem.get_all("dan"), mem.search("garden fact 3", "dan", limit=3))
    version = mem.store.reads.version("dan")
    mem.compact("dan")
    # replaced segments outlive the commit (readers of the old version), then go: fsck removes them at once. 7: the
    # 5 adds', the one the delete re-encoded the later facts into (encoded behind the erased one), the compacted one
    assert mem.store.reads.version("dan") != version and len(list(users.iterdir())) == 7
    assert mem.store.fsck()["removed"] == [] and len(list(users.iterdir())) == 1
    assert (mem.get_all("dan"), mem.search("garden fact 3", "dan", limit=3)) == before
    db = sqlite3.connect(mem.store.root / "meta.sqlite")
    dead = db.execute("SELECT COUNT(*) FROM facts WHERE user='dan' AND deleted IS NOT NULL").fetchone()
    assert dead == (0,) and [e["event"] for e in mem.history(ids[1])] == ["ADD", "DELETE"]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m: m.add("", "u", infer=False), "message 0 is empty"),
        (lambda m: m.add("x" * 9000, "u", infer=False), "at most 8000"),
        (lambda m: m.add([{"role": "user"}], "u", infer=False), "string 'content'"),
        (lambda m: m.add([1, 2], "u", infer=False), "string 'content'"),
        (lambda m: m.add("hi", "../etc", infer=False), "not allowed"),
        (lambda m: m.add("hi", "", infer=False), "non-empty"),
        (lambda m: m.add("hi \ud83d", "u", infer=False), "not valid Unicode"),
        (lambda m: m.update("nope", "text"), "not found"),
        (lambda m: m.delete("nope"), "not found"),
        (lambda m: m.history("nope"), "not found"),
        (lambda m: m.search("", "u"), "non-empty"),
    ],
)
def test_bad_input_raises_and_changes_nothing(mem, call, match):
    mem.add("I keep bees.", "u", infer=False)
    version = mem.store.reads.version("u")
    with pytest.raises(MemoryInputError, match=match):
        call(mem)
    assert mem.store.reads.version("u") == version and len(mem.get_all("u")["results"]) == 1


def test_update_to_empty_and_concurrent_delete(mem):
    (r,) = mem.add("I keep bees.", "u", infer=False)["results"]
    with pytest.raises(MemoryInputError, match="non-empty"):
        mem.update(r["id"], "  ")
    errors = []

    def delete():
        try:
            mem.delete(r["id"])
        except MemoryInputError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=delete) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(errors) == 1 and "not found" in errors[0]
    assert [e["event"] for e in mem.history(r["id"])] == ["ADD", "DELETE"]


def test_infer_add_update_delete_none(tmp_path, shared):
    """Mem0's two steps through a stub backend: the reconcile prompt numbers the existing memories, and the
    decisions refer to those numbers (an unknown number becomes NONE)."""
    import re

    from kvmem.memory.extract import Extractor

    lm, emb = shared
    seed = Memory(tmp_path / "s", model=lm, embedder=emb, window=2)
    lisbon, cat = (
        x["id"]
        for x in seed.add(
            [{"role": "user", "content": "Alice lives in Lisbon."}, {"role": "user", "content": "Alice has a cat."}],
            "alice",
            infer=False,
        )["results"]
    )
    prompts = []

    class Stub(Extractor):
        def complete(self, prompt, schema):
            prompts.append(prompt)
            if "facts" in schema["properties"]:
                return json.dumps(
                    {
                        "facts": [
                            "Alice lives in Porto.",
                            "Alice has no cat anymore.",
                            "Alice likes jazz.",
                            "Alice lives in Porto.",
                        ]
                    }
                )
            num = {text: n for n, text in re.findall(r"^(\d+)\. (.*)$", prompt, re.M)}
            return json.dumps(
                {
                    "memory": [
                        {"event": "UPDATE", "id": num["Alice lives in Lisbon."], "text": "Alice lives in Porto."},
                        {"event": "DELETE", "id": num["Alice has a cat."], "text": ""},
                        {"event": "ADD", "id": "new", "text": "Alice likes jazz."},
                        {"event": "NONE", "id": "new", "text": "Alice lives in Porto."},
                        {"event": "UPDATE", "id": "77", "text": "an unknown number: NONE"},
                    ]
                }
            )

    m = Memory(tmp_path / "s", model=lm, embedder=emb, window=2, extractor=Stub())
    out = m.add("I moved to Porto, my cat died, and I discovered jazz.", "alice", infer=True)["results"]
    assert {(r["event"], r["memory"]) for r in out} == {
        ("ADD", "Alice likes jazz."),
        ("UPDATE", "Alice lives in Porto."),
        ("DELETE", "Alice has a cat."),
    }
    upd = next(r for r in out if r["event"] == "UPDATE")
    assert upd["id"] == lisbon and upd["previous_memory"] == "Alice lives in Lisbon."
    assert next(r for r in out if r["event"] == "DELETE")["id"] == cat
    assert sorted(x["memory"] for x in m.get_all("alice")["results"]) == ["Alice likes jazz.", "Alice lives in Porto."]
    assert "I moved to Porto" in prompts[0] and lisbon not in prompts[1]  # the model never sees a UUID


def test_unusable_extractor_output_is_none_not_an_exception(mem):
    from kvmem.memory.extract import Extractor

    class Garbage(Extractor):
        def complete(self, prompt, schema):
            return '{"facts": ["cut off'

    mem.extractor = Garbage()
    assert mem.add("I like tea.", "g", infer=True) == {"results": [], "message": "nothing remembered: no facts found"}
    assert [t["content"] for t in mem.store.reads.turns("g")] == ["I like tea."]  # the turn is kept as context


@pytest.mark.slow
def test_local_extractor_output_always_parses(mem):
    """The real model under xgrammar's JSON-schema grammar: whatever it writes parses (or is cut and counted as
    nothing); events are valid, and every ADD is retrievable."""
    mem.extractor = None
    from kvmem.memory.extract import LocalExtractor

    mem.extractor = LocalExtractor(mem.lm, max_new_tokens=48)
    out = mem.add("My name is Omar and I was born in Cairo in 1990.", "omar", infer=True)
    assert isinstance(out["results"], list)
    for r in out["results"]:
        assert r["event"] in ("ADD", "UPDATE", "DELETE") and r["memory"]
        if r["event"] == "ADD":
            assert mem.get(r["id"])["memory"] == r["memory"]
    raw = mem.extractor.complete(
        "Reply with facts about: I like tea.",
        {
            "type": "object",
            "properties": {"facts": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
            "required": ["facts"],
        },
    )
    assert isinstance(json.loads(raw)["facts"], list)


def test_memory_cli(tmp_path, shared):
    from typer.testing import CliRunner

    from kvmem.cli import app

    run = CliRunner()
    root = str(tmp_path / "c")
    msgs = json.dumps(
        [{"role": "user", "content": "I moved to Porto in April."}, {"role": "user", "content": "Ana plays the cello."}]
    )
    res = run.invoke(
        app,
        [
            "memory",
            "add",
            "--store",
            root,
            "--user",
            "alice",
            "--no-infer",
            "--window",
            "2",
            "--model",
            FAST,
            "--dtype",
            "float32",
            "--json",
        ],
        input=msgs,
    )
    assert res.exit_code == 0, res.output
    porto, _ = (r["id"] for r in json.loads(res.output)["results"])
    res = run.invoke(
        app, ["memory", "search", "Where do I live?", "--store", root, "--user", "alice", "--limit", "1", "--json"]
    )
    assert res.exit_code == 0 and json.loads(res.output)["results"][0]["id"] == porto
    assert run.invoke(app, ["memory", "delete", porto, "--store", root]).output.strip() == (
        "Memory deleted successfully! (erased 1 memories and 1 turns; re-encoded 1 memories computed behind them)"
    )  # the second message was encoded behind the first: re-encoded without it
    res = run.invoke(app, ["memory", "history", porto, "--store", root, "--json"])
    assert [e["event"] for e in json.loads(res.output)] == ["ADD", "DELETE"]
    for args, needle in (
        (["memory", "delete", porto, "--store", root], "not found"),
        (["memory", "get", "nope", "--store", root], "not found"),
        (["memory", "list", "--store", root, "--user", "a/b"], "not allowed"),
    ):
        res = run.invoke(app, args)
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, args
    res = run.invoke(app, ["memory", "add", "--store", root, "--user", "alice", "--no-infer"], input="")
    assert res.exit_code == 2 and "no messages given" in res.output
    # text given where a file is expected: a hint, nothing stored; --message stores the text itself
    res = run.invoke(app, ["memory", "add", "My cat is Tom.", "--store", root, "--user", "alice", "--no-infer"])
    assert res.exit_code == 2 and "--message" in res.output and "Traceback" not in res.output
    res = run.invoke(
        app, ["memory", "add", "-m", "My cat is Tom.", "--store", root, "--user", "alice", "--no-infer", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert [r["memory"] for r in json.loads(res.output)["results"]] == ["My cat is Tom."]
    res = run.invoke(app, ["memory", "add", "-m", "42", "--store", root, "--user", "alice", "--no-infer", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["results"][0]["memory"] == "42"  # -m is text, not JSON
    res = run.invoke(app, ["memory", "add", str(tmp_path), "--store", root, "--user", "alice", "--no-infer"])
    assert res.exit_code == 2 and "is a directory" in res.output
    # bad input fails before a store is created
    fresh = tmp_path / "never"
    for args in (["-m", "hi", "--user", "a/b"], ["--user", "alice"]):
        res = run.invoke(
            app, ["memory", "add", *args, "--store", str(fresh), "--no-infer", "--model", FAST], input="[]"
        )
        assert res.exit_code == 2 and "Traceback" not in res.output and not fresh.exists(), res.output


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m: m.add("hi", "u", metadata={"k": {1}}, infer=False), "JSON values"),
        (lambda m: m.add("hi", "u\ud800", infer=False), "not allowed"),
        (lambda m: m.add("hi", "u", timestamp=float("nan"), infer=False), "out of range"),
        (lambda m: m.add("hi", "u", timestamp=1e20, infer=False), "out of range"),
        (lambda m: m.search("bees", "u", filters=["x"]), "filters must be an object"),
        (lambda m: m.search("bees \ud800", "u"), "not valid Unicode"),
        (lambda m: m.get_all("u", limit=-1), "non-negative integer"),
        (lambda m: m.update(m.get_all("u")["results"][0]["id"], "y" * 9000), "at most 8000"),
    ],
)
def test_more_bad_input_raises_and_changes_nothing(mem, call, match):
    test_bad_input_raises_and_changes_nothing(mem, call, match)


def test_ambiguous_ids_are_refused(mem):
    """LoCoMo-style ids are unique per user only: an id live for two users is refused, not guessed."""
    import torch as t

    from kvmem.store import FactRecord, Write

    k = t.zeros(mem.lm.config.num_hidden_layers, mem.lm.config.num_key_value_heads, 1, 64, dtype=mem.lm.dtype)
    for user in ("a", "b"):
        mem.store.writes.commit(
            Write(
                user,
                [FactRecord("D1:3", user, "same id", "", "", "", (1,))],
                [k],
                [k.clone()],
                t.nn.functional.normalize(t.ones(1, mem.embedder.dim), dim=1),
            )
        )
    for call in (lambda: mem.get("D1:3"), lambda: mem.delete("D1:3"), lambda: mem.history("D1:3")):
        with pytest.raises(MemoryInputError, match="several (users|scopes)"):
            call()


def test_reads_never_create_a_store(tmp_path):
    from typer.testing import CliRunner

    from kvmem.cli import app

    missing = tmp_path / "nope"
    for args in (
        ["memory", "get", "x", "--store", str(missing)],
        ["memory", "list", "--store", str(missing), "--user", "u"],
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "no kvmem store" in res.output
    assert not missing.exists()


def test_repeated_extracted_facts_are_added_once(mem):
    from kvmem.memory.extract import Extractor

    class Repeats(Extractor):
        def complete(self, prompt, schema):
            if "facts" in schema["properties"]:
                return json.dumps({"facts": ["I moved to Porto in April."] * 8 + ["i moved to porto in april"]})
            return ""

    mem.extractor = Repeats()
    out = mem.add("I moved to Porto in April.", "p", infer=True)["results"]
    assert [r["event"] for r in out] == ["ADD"] and len(mem.get_all("p")["results"]) == 1
    out = mem.add("I moved to Porto in April.", "p", infer=True)["results"]  # already known: nothing new
    assert out == [] and len(mem.get_all("p")["results"]) == 1


def test_segments_in_an_object_store_serve_the_same_kv(tmp_path, shared):
    """A store created with ``segments_url`` keeps its KV segments as objects there (obstore; a ``file://`` URL,
    the code path ``s3://`` takes), not in its directory. The same writes give exactly the KV, search results and
    compaction of a local store. The URL is fixed at creation: another one is refused. ``memory add --segments``
    creates such a store from the command line."""
    from typer.testing import CliRunner

    from kvmem.cli import app
    from kvmem.store import StoreError

    lm, emb = shared
    url = (tmp_path / "objects").as_uri()
    obj = Memory(tmp_path / "o", model=lm, embedder=emb, window=2, segments_url=url)
    loc = Memory(tmp_path / "l", model=lm, embedder=emb, window=2)
    facts = ["Ana moved to Braga in May.", "Ana's sister is a pilot.", "Ana keeps two cats."]
    for f in facts:
        obj.add(f, "ana", infer=False)
        loc.add(f, "ana", infer=False)
    assert not list((tmp_path / "o" / "users").glob("*.safetensors"))
    assert len(list((tmp_path / "objects").glob("*/*.kv.safetensors"))) == 3  # under <url>/<store_id>/
    assert (
        obj.store.segments.url == f"{url}/{obj.store.manifest['store_id']}"
        and obj.store.disk_bytes() > loc.store.disk_bytes() // 2
    )

    def served(m):
        ukv = m.store.reads.snapshot("ana")
        return [f.text for f in ukv.facts], ukv.gather(list(range(len(ukv.facts))))

    (texts_o, (ko, vo)), (texts_l, (kl, vl)) = served(obj), served(loc)
    assert texts_o == texts_l and torch.equal(ko, kl) and torch.equal(vo, vl) and ko.abs().sum() > 0
    hits = lambda m: [r["memory"] for r in m.search("Where does Ana live?", "ana", limit=2)["results"]]
    assert hits(obj) == hits(loc)
    obj.compact("ana")
    assert obj.store.fsck()["bad"] == {} and len(list((tmp_path / "objects").glob("*/*.kv.safetensors"))) == 1
    assert torch.equal(served(obj)[1][0], kl)
    other = Memory(tmp_path / "o2", model=lm, embedder=emb, window=2, segments_url=url)  # one URL, two stores
    other.add("Bo keeps bees.", "bo", infer=False)
    assert obj.store.fsck()["removed"] == [] and other.store.fsck()["ok"] == ["bo"]  # neither touches the other
    with pytest.raises(StoreError, match="--segments applies only when a store is created"):
        Memory(tmp_path / "o", model=lm, embedder=emb, segments_url=(tmp_path / "elsewhere").as_uri())
    cli_url = (tmp_path / "cli-objects").as_uri()
    args = ["memory", "add", "--store", str(tmp_path / "c"), "--user", "u", "--no-infer", "-m", "Bo sings."]
    res = CliRunner().invoke(app, [*args, "--segments", cli_url, "--model", FAST, "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert len(list((tmp_path / "cli-objects").glob("*/*.kv.safetensors"))) == 1
