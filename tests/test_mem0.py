"""The Mem0 drop-in, with Mem0's own code: mem0ai 2.2.1's ``MemoryClient`` and ``AsyncMemoryClient`` against
``kvmem serve`` on a loopback port (every call, return values asserted, an add visible to the next chat, another
tenant's key refused), and Mem0's OSS API on ``from kvmem import Memory, AsyncMemory``: the quickstart, entity
scopes, filters before the top-k, update, expiration, ``from_config`` in Mem0's config shape, with return shapes
checked against Mem0's own ``MemoryItem`` model. Scoped chats inject only the scopes they name, and their KV
equals prompt injection of the same ids (fp32). Bad input gets one clear error and changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
import time

os.environ.setdefault("MEM0_TELEMETRY", "False")  # mem0ai would otherwise post events (there is no network)

import httpx
import pytest

from conftest import http_server
from kvmem.models import MANIFEST, model_dir

mem0 = pytest.importorskip("mem0", reason="mem0ai==2.2.1 is installed by scripts/setup.sh")
from mem0.configs.base import MemoryItem  # noqa: E402
from mem0.exceptions import MemoryError as Mem0Error  # noqa: E402

FAST = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-acme-0123456789abcdef", "key-globex-0123456789abcdef"
PROMOTED = {"user_id", "agent_id", "run_id", "actor_id", "role", "expiration_date"}


def assert_mem0_item(item: dict, score: bool | None = None) -> None:
    """Field by field what Mem0's ``MemoryItem`` (plus its promoted payload keys) promises."""
    assert set(item) <= set(MemoryItem.model_fields) | PROMOTED, set(item) - set(MemoryItem.model_fields)
    MemoryItem(**{k: v for k, v in item.items() if k in MemoryItem.model_fields})  # types as Mem0 declares them
    assert isinstance(item["id"], str) and isinstance(item["memory"], str) and item["memory"]
    assert item["created_at"] and item["updated_at"]
    if score is True:
        assert isinstance(item["score"], float) and 0.1 <= item["score"] <= 1.0
    elif score is False:
        assert "score" not in item


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    root = tmp_path_factory.mktemp("mem0") / "store"
    srv = KvmemServer.start(
        root,
        model=FAST,
        engine="hf",
        dtype="float32",
        window=2,
        api_keys={KEY_A: "acme", KEY_B: "globex"},
        limits=Limits(default_max_tokens=8),
    )
    with http_server(srv) as base:
        yield srv, base


def _chat(base, key, user, question, **memory):
    r = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": FAST,
            "user": user,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
            "memory": {"top_k": 10, **memory},  # memory may override top_k
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_memory_client_every_call_against_kvmem_serve(server):
    from mem0 import MemoryClient

    srv, base = server
    client = MemoryClient(api_key=KEY_A, host=base)  # GET /v1/ping/ with "Authorization: Token <key>"
    added = client.add("I moved to Porto in April.", user_id="alice", infer=False, metadata={"topic": "home"})
    [ev] = added["results"]
    assert ev["event"] == "ADD" and ev["memory"] == "I moved to Porto in April."
    pid = ev["id"]
    more = client.add(
        [{"role": "user", "content": "I play the cello on Sundays."}],
        filters={"user_id": "alice"},
        infer=False,
        metadata={"topic": "music"},
    )
    cello = more["results"][0]["id"]

    found = client.search("Where do I live?", filters={"user_id": "alice"}, top_k=1)
    assert [m["id"] for m in found["results"]] == [pid]
    assert_mem0_item(found["results"][0], score=True)
    assert found["results"][0]["user_id"] == "alice" and found["results"][0]["metadata"] == {"topic": "home"}
    only_music = client.search("Where do I live?", filters={"AND": [{"user_id": "alice"}, {"topic": "music"}]})
    assert [m["id"] for m in only_music["results"]] == [cello]  # the filter runs before the top-k

    page = client.get_all(filters={"user_id": "alice"}, page=1, page_size=1)
    assert page["count"] == 2 and page["previous"] is None and page["next"] and len(page["results"]) == 1
    assert page["results"][0]["id"] == pid  # oldest first
    assert [m["id"] for m in client.get_all(filters={"user_id": "alice"})["results"]] == [pid, cello]

    got = client.get(pid)
    assert_mem0_item(got) and got["memory"] == "I moved to Porto in April."
    # the next chat sees the add, as KV
    chat = _chat(base, KEY_A, "alice", "Where do I live?")
    assert pid in chat["kvmem"]["fact_ids"] and chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    assert client.update(pid, text="I moved to Braga in May.")["message"]
    assert client.update(pid, metadata={"checked": True})["message"]
    got = client.get(pid)
    assert got["memory"] == "I moved to Braga in May." and got["metadata"] == {"topic": "home", "checked": True}
    hist = client.history(pid)
    assert [h["event"] for h in hist] == ["ADD", "UPDATE", "UPDATE"]
    assert hist[1]["old_memory"] == "I moved to Porto in April." and hist[1]["new_memory"] == "I moved to Braga in May."
    assert hist[0]["user_id"] == "alice" and {"memory_id", "created_at", "is_deleted"} <= set(hist[0])

    # another tenant's key: refused on every id route, and it sees none of acme's memories
    other = MemoryClient(api_key=KEY_B, host=base)
    for call in (lambda: other.get(pid), lambda: other.update(pid, text="x"), lambda: other.delete(pid)):
        with pytest.raises(Mem0Error):
            call()
    assert other.search("Where do I live?", filters={"user_id": "alice"})["results"] == []
    with pytest.raises(ValueError, match="API key"):
        MemoryClient(api_key="not-a-key-0123456789", host=base)

    users = client.users()
    assert [(e["type"], e["name"]) for e in users["results"]] == [("user", "alice")]
    assert client.delete(cello)["message"]
    with pytest.raises(Mem0Error):
        client.get(cello)
    assert client.delete_all(user_id="alice")["message"]
    assert client.get_all(filters={"user_id": "alice"})["results"] == []
    assert pid not in _chat(base, KEY_A, "alice", "Where do I live?")["kvmem"]["fact_ids"]
    client.add("Temporary.", user_id="bob", infer=False)
    assert client.reset()["message"] and client.users()["results"] == []


def test_delete_users_erases_and_what_follows_never_saw_it(server, tmp_path):
    """mem0ai's ``delete_users`` (``DELETE /v2/entities/user/{id}``) erases the user: the next memory it adds is
    encoded behind none of the erased turns or facts (its stored KV equals a store's that never saw them, fp32),
    and no byte of the secret is left in the store's files (SQLite and its WAL) or rows."""
    import torch
    from mem0 import MemoryClient

    from kvmem.memory import Memory

    srv, base = server
    secret = "X9081726"
    client = MemoryClient(api_key=KEY_A, host=base)
    client.add(f"My passport number is {secret}.", user_id="erin", infer=False)
    client.add("I collect old stamps.", user_id="erin", infer=False)
    assert client.delete_users(user_id="erin") == {"message": "Entity deleted successfully."}
    client.add("I play chess on Sundays.", user_id="erin", infer=False)
    mem = srv.memory
    (key,) = [u for u in mem.store.reads.users() if "erin" in u]
    ref = Memory(tmp_path / "ref", model=mem.lm, embedder=mem.embedder, window=2)
    ref.add("I play chess on Sundays.", "erin", infer=False)
    got, want = mem.store.reads.snapshot(key), ref.store.reads.snapshot("erin")
    assert [f.text for f in got.facts] == [f.text for f in want.facts] == ["I play chess on Sundays."]
    for a, b in zip(got.fact_kv(0), want.fact_kv(0)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert [t["content"] for t in mem.store.reads.turns(key)] == ["I play chess on Sundays."]
    for path in mem.store.root.rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path


def test_async_memory_client(server):
    from mem0 import AsyncMemoryClient

    _, base = server

    async def run():
        client = AsyncMemoryClient(api_key=KEY_A, host=base)
        r = await client.add("My sister Ana plays the oboe.", user_id="carol", agent_id="tutor", infer=False)
        mid = r["results"][0]["id"]
        found = await client.search("Who plays the oboe?", filters={"user_id": "carol", "agent_id": "tutor"})
        got = await client.get(mid)
        await client.update(mid, text="My sister Ana plays the bassoon.")
        hist = await client.history(mid)
        listed = await client.get_all(filters={"agent_id": "tutor"})
        await client.delete_all(agent_id="tutor")
        after = await client.get_all(filters={"user_id": "carol"})
        return mid, found, got, hist, listed, after

    mid, found, got, hist, listed, after = asyncio.run(run())
    assert [m["id"] for m in found["results"]] == [mid] and found["results"][0]["agent_id"] == "tutor"
    assert got["user_id"] == "carol" and got["agent_id"] == "tutor"
    assert [h["event"] for h in hist] == ["ADD", "UPDATE"]
    assert [m["id"] for m in listed["results"]] == [mid] and after["results"] == []


def test_scoped_chats_inject_only_named_scopes_and_equal_prompt_injection(server):
    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}

    def add(text, **ids):
        r = httpx.post(
            f"{base}/v3/memories/add/", headers=h, json={"messages": text, "infer": False, **ids}, timeout=300
        )
        assert r.status_code == 200, r.text
        return r.json()["results"][0]["id"]

    mine = add("Dana's favourite colour is teal.", user_id="dana")
    agent = add("The travel agent books aisle seats.", agent_id="travel")
    both = add("Dana flies to Oslo on Friday.", user_id="dana", agent_id="travel")
    run = add("This session is about a refund.", user_id="dana", run_id="s1")

    plain = _chat(base, KEY_A, "dana", "What do you know?")["kvmem"]["fact_ids"]
    assert mine in plain and agent not in plain and both not in plain and run not in plain
    with_agent = _chat(base, KEY_A, "dana", "What do you know?", agent_id="travel")["kvmem"]["fact_ids"]
    assert {mine, agent, both} == set(with_agent)
    with_run = _chat(base, KEY_A, "dana", "What do you know?", run_id="s1")["kvmem"]["fact_ids"]
    assert {mine, run} == set(with_run)
    # another tenant naming the same ids sees none of it
    assert _chat(base, KEY_B, "dana", "What do you know?", agent_id="travel")["kvmem"]["fact_ids"] == []

    # a chat over several scopes injects each fact's stored KV: greedy answers equal prompt injection's
    kv = _chat(base, KEY_A, "dana", "Where does Dana fly?", agent_id="travel", run_id="s1", mode="kv")
    pr = _chat(base, KEY_A, "dana", "Where does Dana fly?", agent_id="travel", run_id="s1", mode="prompt")
    assert kv["kvmem"]["fact_ids"] == pr["kvmem"]["fact_ids"] and len(kv["kvmem"]["fact_ids"]) == 4
    assert kv["usage"]["prompt_tokens"] == pr["usage"]["prompt_tokens"]
    assert kv["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert pr["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert kv["choices"][0]["message"]["content"] == pr["choices"][0]["message"]["content"]

    # exactness: the first fact of a fresh scope is encoded behind the header alone, so injecting it from the
    # second of three scopes must give prompt injection's logits (fp32)
    add("Zed's locker number is 12.", user_id="zed")
    solo = add("The solo agent's passphrase is amber falcon.", agent_id="solo")
    kv = _chat(base, KEY_A, "zed", "What is the passphrase?", agent_id="solo", mode="kv", top_k=1)
    pr = _chat(base, KEY_A, "zed", "What is the passphrase?", agent_id="solo", mode="prompt", top_k=1)
    assert kv["kvmem"]["fact_ids"] == pr["kvmem"]["fact_ids"] == [solo]
    lk = [[t["logprob"] for t in e["top_logprobs"]] for e in kv["choices"][0]["logprobs"]["content"]]
    lp = [[t["logprob"] for t in e["top_logprobs"]] for e in pr["choices"][0]["logprobs"]["content"]]
    assert lk and len(lk) == len(lp)
    for a, b in zip(lk, lp):
        assert a == pytest.approx(b, abs=1e-4)

    # a run's memory is deleted by delete_all(run_id) and never injected again
    r = httpx.delete(f"{base}/v1/memories/", headers=h, params={"run_id": "s1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert run not in _chat(base, KEY_A, "dana", "What do you know?", run_id="s1")["kvmem"]["fact_ids"]
    assert mine in _chat(base, KEY_A, "dana", "What do you know?", run_id="s1")["kvmem"]["fact_ids"]


def test_search_route_fuses_keywords_and_explains_on_request(server):
    """``POST /v3/memories/search/`` with Mem0's ``keyword_search`` (it was a 400) ranks by cosine fused with the
    store's BM25 scores, and with ``explain`` each result carries ``score_details``: its cosine and keyword parts.
    Without ``keyword_search`` the server's default (``--hybrid``, on) fuses too; ``keyword_search: false`` ranks
    by cosine alone."""
    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}
    for text in ("Hana repaired the garden wall in spring.", "Pemberton visited Hana on a Tuesday."):
        add = {"messages": text, "user_id": "hana", "infer": False}
        r = httpx.post(f"{base}/v3/memories/add/", headers=h, json=add, timeout=300)
        assert r.status_code == 200, r.text
    body = {"query": "Who is Pemberton?", "filters": {"user_id": "hana"}, "threshold": 0, "explain": True}
    fused = httpx.post(f"{base}/v3/memories/search/", headers=h, json={**body, "keyword_search": True}, timeout=60)
    assert fused.status_code == 200, fused.text
    first, second = fused.json()["results"]
    assert first["memory"] == "Pemberton visited Hana on a Tuesday." and first["score_details"]["keyword_rank"] == 1
    assert first["score_details"]["bm25_score"] > 0 and second["score_details"]["bm25_score"] is None
    assert second["score"] < first["score"] <= 1 and first["score_details"]["fusion"] == "weighted"
    default = httpx.post(f"{base}/v3/memories/search/", headers=h, json=body, timeout=60).json()["results"]
    assert [(r["memory"], r["score"]) for r in default] == [(r["memory"], r["score"]) for r in fused.json()["results"]]
    plain = {**body, "keyword_search": False}
    plain = httpx.post(f"{base}/v3/memories/search/", headers=h, json=plain, timeout=60).json()["results"]
    assert {r["score_details"]["fusion"] for r in plain} == {"cosine"}
    for r in plain:
        assert r["score"] == pytest.approx(r["score_details"]["semantic_score"], abs=1e-5)
    assert (
        "score_details"
        not in httpx.post(f"{base}/v3/memories/search/", headers=h, json={**body, "explain": False}, timeout=60).json()[
            "results"
        ][0]
    )


@pytest.mark.parametrize(
    "path,body,match",
    [
        ("/v3/memories/search/", {"query": "x", "filters": {"user_id": "erin", "n": {"like": 1}}}, "operator 'like'"),
        ("/v3/memories/search/", {"query": "x", "filters": {"user_id": "erin", "nope": 1}}, "'nope'"),
        ("/v3/memories/search/", {"query": "x", "user_id": "frank", "filters": {"user_id": "erin"}}, "conflicting"),
        ("/v3/memories/search/", {"query": "x", "filters": {"OR": [{"user_id": "erin"}]}}, "at least one of"),
        ("/v3/memories/add/", {"messages": "x", "user_id": "erin", "expiration_date": "2001-01-01"}, "in the past"),
        ("/v3/memories/add/", {"messages": "x", "user_id": "erin", "filters": {"user_id": "frank"}}, "conflicting"),
        ("/v3/memories/add/", {"messages": "x", "user_id": "erin", "output_format": "v1.1"}, "output_format"),
        ("/v3/memories/add/", {"messages": "x", "user_id": "erin", "async_mode": True}, "async_mode"),
        ("/v3/memories/add/", {"messages": "x", "app_id": "app"}, "app_id"),
        ("/v3/memories/", {"filters": {"user_id": "erin", "n": {"gt": 1}, "x": {"in": 3}}}, "takes a list"),
    ],
)
def test_bad_input_is_one_clear_error_and_changes_nothing(server, path, body, match):
    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}
    seed = httpx.post(
        f"{base}/v3/memories/add/",
        headers=h,
        json={"messages": "Erin keeps bees.", "user_id": "erin", "infer": False, "metadata": {"n": 1}},
        timeout=300,
    )
    assert seed.status_code == 200
    before = srv.memory.store.reads.version("acme:erin")
    r = httpx.post(f"{base}{path}", headers=h, json={"infer": False, **body} if "add" in path else body, timeout=60)
    assert 400 <= r.status_code < 500 and r.status_code != 404, r.text
    err = r.json()["error"]
    assert match in err["message"] and "Traceback" not in err["message"]
    assert (
        srv.memory.store.reads.version("acme:erin") == before and srv.memory.store.reads.version("acme:frank") is None
    )


# --- the OSS API: from kvmem import Memory --------------------------------------------------------------


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    from kvmem import Memory

    return Memory(tmp_path_factory.mktemp("oss") / "store", model=FAST, dtype="float32", window=1)


def test_mem0_quickstart_and_documented_calls(oss):
    m = oss
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi, I'm Alex. I love basketball and gaming."},
        {"role": "assistant", "content": "Hey Alex! I'll remember your interests."},
    ]
    added = m.add(messages, user_id="alex", infer=False, metadata={"category": "hobbies"})
    assert [e["memory"] for e in added["results"]] == [messages[1]["content"], messages[2]["content"]]  # no system
    m.add("Alex's team plays on Thursdays.", user_id="alex", agent_id="coach", infer=False, metadata={"rank": 3})
    m.add("Alex asked about knee pain.", user_id="alex", run_id="visit-1", infer=False, metadata={"rank": 7})
    m.add("Alex's sister is called Mia.", user_id="alex", infer=False, expiration_date="2999-12-31")

    found = m.search("Does Alex like basketball?", filters={"user_id": "alex"}, top_k=3)
    assert len(found["results"]) == 3 and found["results"][0]["memory"] == messages[1]["content"]
    assert [r["score"] for r in found["results"]] == sorted((r["score"] for r in found["results"]), reverse=True)
    for item in found["results"]:
        assert_mem0_item(item, score=True)
    assert found["results"][0]["role"] == "user" and found["results"][0]["metadata"] == {"category": "hobbies"}
    ranks = m.search("Alex", filters={"user_id": "alex", "rank": {"gte": 5}}, top_k=5, threshold=0.0)
    assert [r["memory"] for r in ranks["results"]] == ["Alex asked about knee pain."]
    either = m.search(
        "Alex",
        filters={"user_id": "alex", "OR": [{"rank": {"lt": 5}}, {"category": {"in": ["hobbies"]}}]},
        top_k=9,
        threshold=0.0,
    )
    assert {r["memory"] for r in either["results"]} == {
        messages[1]["content"],
        messages[2]["content"],
        "Alex's team plays on Thursdays.",
    }
    nots = m.search("Alex", filters={"user_id": "alex", "NOT": [{"rank": {"gte": 5}}]}, top_k=9, threshold=0.0)
    assert len(nots["results"]) == 4 and "Alex asked about knee pain." not in {r["memory"] for r in nots["results"]}
    sister = m.search("Alex", filters={"user_id": "alex", "memory": {"icontains": "SISTER"}}, threshold=0.0)
    assert [r["memory"] for r in sister["results"]] == ["Alex's sister is called Mia."]
    coach = m.get_all(filters={"agent_id": "coach"})
    assert [r["memory"] for r in coach["results"]] == ["Alex's team plays on Thursdays."]
    assert coach["results"][0]["user_id"] == "alex" and coach["results"][0]["agent_id"] == "coach"
    for item in coach["results"]:
        assert_mem0_item(item, score=False)
    assert len(m.get_all(filters={"user_id": "alex"}, top_k=2)["results"]) == 2
    assert len(m.get_all(filters={"user_id": "alex"})["results"]) == 5

    mid = added["results"][0]["id"]
    assert m.update(memory_id=mid, text="Alex loves basketball.") == {"message": "Memory updated successfully!"}
    m.update(mid, metadata={"verified": True})
    item = m.get(mid)
    assert item["memory"] == "Alex loves basketball." and item["metadata"] == {"category": "hobbies", "verified": True}
    assert [h["event"] for h in m.history(mid)] == ["ADD", "UPDATE", "UPDATE"]

    m.delete_all(run_id="visit-1")
    assert "Alex asked about knee pain." not in {r["memory"] for r in m.get_all(filters={"user_id": "alex"})["results"]}
    m.delete_all(agent_id="coach")
    assert m.get_all(filters={"agent_id": "coach"})["results"] == []
    m.delete_all(user_id="alex")
    assert m.get_all(filters={"user_id": "alex"})["results"] == []


def test_expired_memories_are_neither_searched_nor_injected(oss, monkeypatch):
    import kvmem.memory.mem0 as km

    m = oss
    mid = m.add("Gil's parking code is 4411.", user_id="gil", infer=False, expiration_date="2030-01-01")["results"][0]
    assert m.search("parking code", filters={"user_id": "gil"})["results"]
    monkeypatch.setattr(km, "today", lambda: "2030-01-02")
    assert m.search("parking code", filters={"user_id": "gil"})["results"] == []
    assert [r["id"] for r in m.search("parking code", filters={"user_id": "gil"}, show_expired=True)["results"]] == [
        mid["id"]
    ]
    assert m.get_all(filters={"user_id": "gil"})["results"] == []
    assert m.get(mid["id"])["expiration_date"] == "2030-01-01"
    # the serving path drops it from retrieval too (the expiry check reads today's date where it plans)
    ukv = m.store.reads.snapshot("gil")
    assert ukv.unexpired("2030-01-02") == set() and ukv.unexpired("2029-12-31") is None
    assert ukv.unexpired() is None  # the serving path's default: today's UTC date, before the expiry
    m.update(mid["id"], expiration_date=None)
    assert m.search("parking code", filters={"user_id": "gil"})["results"]


def test_from_config_in_mem0_shape_and_refusals(oss, tmp_path):
    from kvmem import AsyncMemory, Memory, MemoryInputError
    from kvmem.memory.extract import OpenAIExtractor

    cfg = {
        "vector_store": {"provider": "faiss", "config": {"path": str(oss.store.root)}},
        "llm": {"provider": "vllm", "config": {"model": "m", "vllm_base_url": "http://127.0.0.1:9/v1"}},
        "embedder": {"provider": "huggingface", "config": {"model": "sentence-transformers/all-MiniLM-L6-v2"}},
        "version": "v1.1",
        "custom_instructions": "Only remember food preferences.",
    }
    m = Memory.from_config(cfg)
    assert str(m.store.root) == str(oss.store.root) and m.custom_instructions == "Only remember food preferences."
    assert isinstance(m.extractor, OpenAIExtractor) and m.extractor.base_url.startswith("http://127.0.0.1:9")
    for bad, match in [
        ({"vector_store": {"provider": "qdrant", "config": {}}}, "provider 'kvmem'"),
        ({"embedder": {"provider": "openai", "config": {"model": "text-embedding-3-small"}}}, "all-MiniLM-L6-v2"),
        ({"llm": {"provider": "anthropic", "config": {"model": "claude"}}}, "OpenAI-compatible"),
        ({"graph_store": {}}, "unknown config keys: graph_store"),
        ({"reranker": {"provider": "cohere"}}, "reranker"),
        ({"history_db_path": "/tmp/h.db"}, "history"),
    ]:
        with pytest.raises(MemoryInputError, match=match):
            Memory.from_config({**bad, "store": str(tmp_path / "never")})
    assert not (tmp_path / "never").exists()

    am = AsyncMemory.from_config({"store": str(oss.store.root)})

    async def run():
        r = await am.add("Hana drinks green tea.", user_id="hana", infer=False)
        s = await am.search("What does Hana drink?", filters={"user_id": "hana"})
        await am.delete_all(user_id="hana")
        return r, s, await am.get_all(filters={"user_id": "hana"})

    r, s, after = asyncio.run(run())
    assert s["results"][0]["id"] == r["results"][0]["id"] and after["results"] == []


def test_default_store_location_and_refused_calls(oss, monkeypatch, tmp_path):
    from kvmem import Memory, MemoryInputError
    from kvmem.memory import default_store

    monkeypatch.delenv("KVMEM_STORE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_store() == tmp_path / "xdg" / "kvmem" / "memory"
    monkeypatch.setenv("KVMEM_STORE", str(oss.store.root))
    m = Memory()  # opens the default store (here: the env's), for the model it was built with
    assert m.store.fingerprint["model"] == FAST
    m.add("Ivo sails.", user_id="ivo", infer=False)
    version = m.store.reads.version("ivo")
    for call, match in [
        (lambda: m.add("x", user_id="ivo", memory_type="procedural_memory"), "procedural"),
        (lambda: m.search("x", filters={"user_id": "ivo"}, rerank=True), "rerank"),
        (lambda: m.search("x", filters={"user_id": "ivo"}, reference_date="2024-01-01"), "reference_date"),
        (lambda: m.search("x", filters={"user_id": "ivo"}, threshold=2), "threshold"),
        (lambda: m.search("x"), "at least one of"),
        (lambda: m.add("x"), "at least one of"),
        (lambda: m.add("x", user_id="ivo", agent_id="has space"), "whitespace"),
        (lambda: m.delete_all(), "reset()"),
        (lambda: m.update("nope", text="x"), "not found"),
    ]:
        with pytest.raises(MemoryInputError, match=match):
            call()
    assert m.store.reads.version("ivo") == version


def test_import_a_mem0_export_verbatim_or_nothing(server, tmp_path):
    """What ``get_all`` returns is imported with its ids, scopes, metadata and times; a bad record is refused by
    index and nothing is written; the CLI takes the same file."""
    from typer.testing import CliRunner

    from kvmem.cli import app

    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}
    export = {
        "count": 3,
        "results": [
            {
                "id": "7f0e5c1a-0000-4000-8000-000000000001",
                "memory": "Jo is allergic to peanuts.",
                "user_id": "jo",
                "metadata": {"source": "intake"},
                "categories": ["health"],
                "created_at": "2025-03-01T10:00:00-08:00",
                "updated_at": "2025-03-02T10:00:00-08:00",
                "hash": "ignored",
                "score": None,
            },
            {"id": "7f0e5c1a-0000-4000-8000-000000000002", "memory": "Jo likes jazz.", "user_id": "jo",
             "agent_id": "dj", "created_at": "2025-04-01T00:00:00Z", "expiration_date": "2025-05-01"},
            {"id": "7f0e5c1a-0000-4000-8000-000000000003", "memory": "Session notes.", "run_id": "r9",
             "role": "assistant"},
        ],
    }  # fmt: skip
    bad = {"results": [*export["results"][:1], {"memory": "", "user_id": "jo"}, {"memory": "x"}]}
    r = httpx.post(f"{base}/v1/memories/import", headers=h, json=bad, timeout=300)
    assert r.status_code == 400 and "record 1" in r.text and "record 2" in r.text, r.text
    assert srv.memory.store.reads.version("acme:jo") is None  # nothing written, not even record 0

    r = httpx.post(f"{base}/v1/memories/import", headers=h, json=export, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 3,
        "scopes": {"user_id=jo": 1, "user_id=jo&agent_id=dj": 1, "run_id=r9": 1},
        "existing": 0,
    }

    def one(memory_id: str) -> dict:
        r = httpx.get(f"{base}/v1/memories/{memory_id}/", headers=h, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    got = one("7f0e5c1a-0000-4000-8000-000000000001")
    assert got["memory"] == "Jo is allergic to peanuts." and got["user_id"] == "jo"
    assert got["metadata"] == {"source": "intake", "categories": ["health"]}
    assert got["created_at"].startswith("2025-03-01T18:00:00")
    jazz = one("7f0e5c1a-0000-4000-8000-000000000002")
    assert jazz.get("agent_id") == "dj" and jazz.get("expiration_date") == "2025-05-01", jazz  # expired: kept, unserved
    found = httpx.post(f"{base}/v3/memories/search/", headers=h, timeout=60,
                       json={"query": "music", "filters": {"user_id": "jo"}, "threshold": 0}).json()  # fmt: skip
    assert [m["id"] for m in found["results"]] == ["7f0e5c1a-0000-4000-8000-000000000001"]
    again = httpx.post(f"{base}/v1/memories/import", headers=h, json=export, timeout=300)  # idempotent by record
    assert again.status_code == 200 and again.json() == {"count": 0, "scopes": {}, "existing": 3}, again.text
    changed = {"results": [{**export["results"][0], "memory": "Jo is allergic to nothing."}]}
    r = httpx.post(f"{base}/v1/memories/import", headers=h, json=changed, timeout=300)
    assert r.status_code == 400 and "already exists, with another scope or text" in r.text

    (tmp_path / "export.json").write_text(json.dumps({"results": export["results"][:1]}))
    store = tmp_path / "cli-store"
    out = CliRunner().invoke(app, ["memory", "import", str(tmp_path / "export.json"), "--store", str(store),
                                   "--model", FAST, "--dtype", "float32", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"count": 1, "scopes": {"user_id=jo": 1}, "existing": 0}
    (tmp_path / "bad.json").write_text('{"results": [{"memory": "no scope"}]}')
    out = CliRunner().invoke(app, ["memory", "import", str(tmp_path / "bad.json"), "--store", str(store)])
    assert out.exit_code == 2 and "record 0" in out.output and "Traceback" not in out.output


def test_a_big_import_is_batched_bounded_resumable_and_lets_chats_through(server, tmp_path):
    """An import commits 32 records at a time (one version each) and frees the model thread between batches, so
    another tenant's chat sent after the first batch is answered while the import goes on (4 records a batch here, to
    keep the test cheap); running it again
    writes nothing (records without ids get derived ones); over 10,000 records is a 413 that writes nothing."""
    import threading

    from typer.testing import CliRunner

    from kvmem.cli import app
    from kvmem.memory.importer import MAX_IMPORT_RECORDS

    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}
    st = srv.memory.store
    too_many = {"results": [{"memory": f"Fact {i}.", "user_id": "huge"} for i in range(MAX_IMPORT_RECORDS + 1)]}
    r = httpx.post(f"{base}/v1/memories/import", headers=h, json=too_many, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_records", r.text
    assert st.reads.version("acme:huge") is None
    (tmp_path / "huge.json").write_text(json.dumps(too_many))
    out = CliRunner().invoke(app, ["memory", "import", str(tmp_path / "huge.json"), "--store", str(tmp_path / "s")])
    assert out.exit_code == 2 and "at most 10000 records" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "s").exists()  # refused before a store is made or a model loads

    batch = srv.memory.import_batch_size = 4  # the default is 32: six batches at a fraction of the cost
    n = 6 * batch
    export = [{"memory": f"Bulk fact number {i} is about topic {i % 7}.", "user_id": "bulk"} for i in range(n)]
    done = {}
    t = threading.Thread(
        target=lambda: done.update(r=httpx.post(f"{base}/v1/memories/import", headers=h, json=export, timeout=600))
    )
    t.start()
    deadline = time.monotonic() + 300
    while st.reads.version("acme:bulk") is None:  # the first batch is committed
        assert t.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    _chat(base, KEY_B, "someone", "Hello?", mode="off")
    assert t.is_alive(), "the chat waited for the whole import"
    t.join(600)
    assert done["r"].status_code == 200 and done["r"].json() == {
        "count": n,
        "scopes": {"user_id=bulk": n},
        "existing": 0,
    }, done["r"].text
    versions = {v for (v,) in st.rows.execute('SELECT added FROM facts WHERE "user"=?', ("acme:bulk",))}
    assert len(versions) == n // batch  # one commit per batch
    again = httpx.post(f"{base}/v1/memories/import", headers=h, json=export, timeout=300)
    assert again.json() == {"count": 0, "scopes": {}, "existing": n}, again.text
    assert len(srv.memory.get_all(user_id="bulk", namespace="acme", top_k=1000)["results"]) == n
    srv.memory.import_batch_size = 32


def test_an_update_that_lost_a_race_is_a_409_and_changes_nothing(server):
    """Another replica (a second ``Memory`` on the same store) updates a memory between this server's read and
    its commit: the server's update is a compare-and-set, so it answers 409 ``memory_conflict`` and the other
    replica's text stays (before, the server wrote the old text back with its metadata)."""
    from kvmem import Memory

    srv, base = server
    h = {"Authorization": f"Bearer {KEY_A}"}
    body = {"messages": [{"role": "user", "content": "Ana drinks tea."}], "user_id": "ana", "infer": False}
    mid = httpx.post(f"{base}/v1/memories", headers=h, json=body, timeout=120).json()["results"][0]["id"]
    other = Memory(srv.memory.store.root, model=srv.memory.lm, embedder=srv.memory.embedder, window=0)
    write = srv.memory._write

    def raced(*args, **kwargs):
        del srv.memory._write  # once
        other.update(mid, text="Ana drinks coffee.")
        return write(*args, **kwargs)

    srv.memory._write = raced
    r = httpx.put(f"{base}/v1/memories/{mid}/", headers=h, json={"metadata": {"k": 1}}, timeout=120)
    assert r.status_code == 409 and r.json()["error"]["code"] == "memory_conflict", r.text
    got = httpx.get(f"{base}/v1/memories/{mid}/", headers=h).json()
    assert got["memory"] == "Ana drinks coffee." and "k" not in (got["metadata"] or {})
    r = httpx.put(f"{base}/v1/memories/{mid}/", headers=h, json={"metadata": {"k": 1}}, timeout=120)
    assert r.status_code == 200
    assert httpx.get(f"{base}/v1/memories/{mid}/", headers=h).json()["metadata"] == {"k": 1}
    other.close()
