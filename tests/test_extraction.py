"""Extraction a user can trust, mechanics on the test model: grounding drops a fact the user never said (a
prompt fragment, the assistant's or a system message's words) and keeps paraphrase; an explicit request to forget
deletes the memory it is about (a DELETE event; never searched or injected again) and never becomes a fact; a
correction turns the ADD of the corrected fact into an UPDATE; an empty extraction is reported in the result and
in /metrics. Stub extractors script what a model would return where the small model is too weak to rely on; the
real model runs where the rule does the work. The scripted set's scoring is checked on known outcomes."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import http_server
from kvmem.memory.extract import Extractor
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"


class Scripted(Extractor):
    """Returns ``facts`` for the facts step and ADDs them (or ``decisions``) for the reconcile step."""

    def __init__(self, facts, decisions=None):
        self.facts_out, self.decisions, self.prompts = facts, decisions, []

    def complete(self, prompt, schema):
        self.prompts.append(prompt)
        if "facts" in schema["properties"]:
            return json.dumps({"facts": self.facts_out})
        n = prompt.count("\n- ")
        return json.dumps({"memory": self.decisions or [{"event": "ADD", "id": "new", "text": f} for f in
                                                          self.facts_out][:n]})  # fmt: skip


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    from kvmem import Memory

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    return Memory(tmp_path_factory.mktemp("extract") / "s", model=FAST, dtype="float32", window=1)


def test_grounding_rules():
    from kvmem.memory.extract import DECISIONS_PROMPT, FACTS_PROMPT
    from kvmem.memory.grounding import chatter, correction, forget_request, grounded

    prompt = dict(prompts=[FACTS_PROMPT, DECISIONS_PROMPT, "1 December, 2026"])
    said = ["I moved to Porto, my cat died, and I discovered jazz."]
    assert grounded("Alice lives in Porto.", said, **prompt)  # paraphrase keeps the user's words
    assert grounded("The user has a peanut allergy.", ["I'm allergic to peanuts."], **prompt)
    assert not grounded("Today is 1 December, 2026.", said, **prompt)
    assert not grounded("You are a personal memory about the user.", said, **prompt)
    assert not grounded("The user enjoys oat milk lattes.", ["I drink my coffee black."],
                        ["Many people also enjoy oat milk lattes."], **prompt)  # fmt: skip
    assert not grounded("Zelda is a premium customer.", ["I prefer window seats."], ["The user is Zelda, premium."])
    assert not grounded("Zelda prefers window seats.", ["I prefer window seats."], ["The user is Zelda, premium."])
    assert not grounded("17 times 23 is 391.", ["What is 17 times 23?"], ["17 times 23 is 391."])
    for talk in ("The user asked for a joke about penguins.", "The assistant provided a joke.",
                 "user: Ok, talk to you later. Bye!", "Thanks, that was helpful."):  # fmt: skip
        assert chatter(talk), talk
    assert not chatter("The user's sister Mia studies medicine.") and not chatter("I like jokes about cats.")
    assert forget_request("Please forget my social security number.") and forget_request("Delete my address.")
    assert forget_request("Remove my birthday from memory please.") and forget_request("Can you erase that?")
    for keep in ("Don't forget my mom's birthday is Friday.", "I need to delete some photos from my phone.",
                 "Never forget that I love jazz.", "I forgot my keys."):  # fmt: skip
        assert not forget_request(keep), keep
    assert correction("Actually I moved to Braga, not Porto.") and correction("I'm not vegan anymore.")
    assert not correction("I like jazz.") and not correction("I'm learning Japanese.")


def test_a_fact_not_in_the_messages_is_dropped_and_counted(mem):
    mem.extractor = Scripted(["Today is 1 December, 2026.", "The user drinks black coffee.",
                              "The user likes oat milk lattes.", "Zelda is a premium customer."])  # fmt: skip
    out = mem.add(
        [{"role": "system", "content": "The user is a premium customer named Zelda."},
         {"role": "user", "content": "I drink my coffee black."},
         {"role": "assistant", "content": "Noted! Many people also enjoy oat milk lattes."}],
        user_id="g1",
    )  # fmt: skip
    assert [(e["event"], e["memory"]) for e in out["results"]] == [("ADD", "The user drinks black coffee.")]
    assert [m["memory"] for m in mem.get_all(filters={"user_id": "g1"})["results"]] == ["The user drinks black coffee."]
    assert mem.extraction_counts["facts_rejected"] >= 3


def test_a_forget_request_deletes_the_memory_it_is_about(mem):
    ssn = mem.add("My social security number is 078-05-1120.", user_id="g2", infer=False)["results"][0]["id"]
    hike = mem.add("I like hiking in the Alps.", user_id="g2", infer=False)["results"][0]["id"]
    # a model that turns the request itself into a fact, and deletes nothing
    mem.extractor = Scripted(["The user wants to forget their social security number."])
    out = mem.add("Please forget my social security number.", user_id="g2")
    assert [(e["event"], e["id"]) for e in out["results"]] == [("DELETE", ssn)]
    assert mem.extractor.prompts == []  # the request alone: nothing to extract
    left = mem.get_all(filters={"user_id": "g2"})["results"]
    assert [m["id"] for m in left] == [hike]
    found = mem.search("social security number", filters={"user_id": "g2"}, threshold=0.0)["results"]
    assert ssn not in {m["id"] for m in found}
    assert [h["event"] for h in mem.history(ssn)] == ["ADD", "DELETE"]
    # a request about something never stored deletes nothing
    out = mem.add("Please forget my bank PIN.", user_id="g2")
    assert out["results"] == [] and "nothing remembered" in out["message"]
    assert [m["id"] for m in mem.get_all(filters={"user_id": "g2"})["results"]] == [hike]


def test_a_forget_request_on_the_real_model(mem):
    """With the real extractor on the rest of the message, the request still deletes and adds nothing of itself."""
    from kvmem.memory.extract import LocalExtractor

    mem.extractor = LocalExtractor(mem.lm, max_new_tokens=48)
    addr = mem.add("My home address is 12 Elm Street.", user_id="g3", infer=False)["results"][0]["id"]
    kids = mem.add("I have two kids.", user_id="g3", infer=False)["results"][0]["id"]
    out = mem.add("Delete my home address from your memory. I started learning the violin.", user_id="g3")
    assert ("DELETE", addr) in [(e["event"], e["id"]) for e in out["results"]]
    left = mem.get_all(filters={"user_id": "g3"})["results"]
    assert kids in {m["id"] for m in left} and addr not in {m["id"] for m in left}
    assert not any("elm" in m["memory"].lower() for m in left)  # whatever the model extracted, not the address


def test_a_correction_becomes_an_update(mem):
    porto = mem.add("I live in Porto.", user_id="g4", infer=False)["results"][0]["id"]
    mem.extractor = Scripted(["The user lives in Braga."])  # the model ADDs; the correction cue makes it an UPDATE
    out = mem.add("Actually I moved to Braga, not Porto.", user_id="g4")
    assert [(e["event"], e["id"]) for e in out["results"]] == [("UPDATE", porto)]
    assert out["results"][0]["previous_memory"] == "I live in Porto."
    assert [m["memory"] for m in mem.get_all(filters={"user_id": "g4"})["results"]] == ["The user lives in Braga."]
    # a model that only deletes the corrected memory: it is updated with the user's own sentence instead
    ana = mem.add("My wife is called Anna.", user_id="g5", infer=False)["results"][0]["id"]
    mem.extractor = Scripted([], [])
    out = mem.add("My wife's name is Ana, not Anna, please fix that.", user_id="g5")
    assert [(e["event"], e["id"], e["memory"]) for e in out["results"]] == [
        ("UPDATE", ana, "My wife's name is Ana, not Anna, please fix that.")
    ]
    # without a cue, a new fact stays an ADD beside what is known
    mem.extractor = Scripted(["The user loves the beach in Braga."])
    out = mem.add("I love the beach here in Braga.", user_id="g4")
    assert [e["event"] for e in out["results"]] == ["ADD"]


def test_an_empty_extraction_is_reported_in_the_result_and_metrics(tmp_path):
    from kvmem.server import KvmemServer

    srv = KvmemServer.start(tmp_path / "s", model=FAST, engine="hf", dtype="float32", window=1)
    srv.memory.extractor = Scripted([])
    with http_server(srv) as base:
        r = httpx.post(f"{base}/v1/memories", json={"messages": "Hi! How are you?", "user_id": "e"}, timeout=120)
        assert r.status_code == 200 and r.json() == {"results": [], "message": "nothing remembered: no facts found"}
        srv.memory.extractor = Scripted(["Today is 1 December, 2026."])
        r = httpx.post(f"{base}/v1/memories", json={"messages": "Thanks, bye.", "user_id": "e"}, timeout=120)
        assert r.json()["message"] == "nothing remembered: 1 extracted facts were not in the user's messages"
        text = httpx.get(f"{base}/metrics").text
    got = {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("kvmem_extraction{")}
    assert got["adds"] == 2 and got["empty"] == 2 and got["facts_rejected"] == 1 and got["facts_extracted"] == 1


def test_the_scripted_set_and_its_scoring():
    from kvmem.bench.extraction import leaked, score_case
    from kvmem.bench.extraction_cases import CASES

    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 40 and kinds == {"new", "correction", "forget", "third_party", "chitchat"}
    assert sum(q[1] is None for c in CASES for q in c.questions) >= 8  # trap questions
    assert leaked("Today is 1 December, 2026.", "1 December, 2026")
    assert leaked("You keep a personal memory about the user.", "x") and not leaked("I live in Porto.", "x")
    fix = next(c for c in CASES if c.id == "fix-city")
    ok = score_case(fix, ["s0"], {"results": [{"event": "UPDATE", "id": "s0", "memory": "User lives in Braga."}]},
                    [{"id": "s0", "memory": "User lives in Braga."}], "x")  # fmt: skip
    assert ok["correction_update"] and ok["recalled"] == ok["expected"] == 1 and ok["correct"] == ok["stored"] == 1
    both = [{"id": "s0", "memory": "I live in Porto."}, {"id": "n", "memory": "User lives in Braga."}]
    bad = score_case(
        fix, ["s0"], {"results": [{"event": "ADD", "id": "n", "memory": "User lives in Braga."}]}, both, "x"
    )
    assert not bad["correction_update"] and bad["correct"] == 1 and bad["stored"] == 2
    gone = next(c for c in CASES if c.id == "forget-ssn")
    s = score_case(gone, ["a", "b"], {"results": []}, [{"id": "a", "memory": gone.seed[0]},
                                                       {"id": "b", "memory": gone.seed[1]}], "x")  # fmt: skip
    assert s["forget_honoured"] is False and s["forbidden_present"] == 1
