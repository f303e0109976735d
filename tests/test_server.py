"""``kvmem serve`` on the transformers engine: the real ``openai`` client and ``httpx`` against a
server on a loopback port. Chat (sync and streaming, memory kv / prompt / off), KV injection equal to prompt
injection through HTTP, the memories REST API with a write visible to the next chat, tenant isolation (404 /
401), and bad input that gets the right status and never a 500."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import http_server, metric, stalled_stream
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-acme-0123456789abcdef", "key-globex-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    root = tmp_path_factory.mktemp("serve") / "store"
    srv = KvmemServer.start(
        root,
        model=FAST,
        engine="hf",
        dtype="float32",
        window=2,
        api_keys={KEY_A: "acme", KEY_B: "globex"},
        limits=Limits(max_body_bytes=64 << 10, default_max_tokens=12),
    )
    with http_server(srv) as base:
        yield srv, base


def _h(key=KEY_A):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def alice(server):
    """User alice of tenant acme with three memories (one a canary)."""
    _, base = server
    facts = [
        "Alice adopted a grey cat named Pixel in March.",
        "Alice works as a nurse at the city hospital.",
        "Alice's secret code word is PINEAPPLE-42.",
    ]
    ids = []
    for f in facts:
        r = httpx.post(
            f"{base}/v1/memories", headers=_h(), json={"messages": f, "user_id": "alice", "infer": False}, timeout=120
        )
        assert r.status_code == 200, r.text
        [ev] = r.json()["results"]
        assert ev["event"] == "ADD" and ev["memory"] == f
        ids.append(ev["id"])
    return dict(zip(["cat", "job", "canary"], ids))


def _client(server, key=KEY_A):
    import openai

    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key=key, max_retries=0, timeout=120)


def test_openai_client_chat_kv_equals_prompt_and_streams(server, alice):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [FAST]
    msgs = [{"role": "user", "content": "What is Alice's secret code word?"}]
    out = {}
    for mode in ("kv", "prompt", "off"):
        r = client.chat.completions.create(
            model=FAST,
            messages=msgs,
            user="alice",
            max_tokens=12,
            temperature=0,
            extra_body={"memory": {"top_k": 3, "mode": mode}},
        )
        extra = r.model_extra["kvmem"]
        out[mode] = (r, extra)
        assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens >= 1
    (kv, kvx), (pr, prx), (off, offx) = out["kv"], out["prompt"], out["off"]
    # the same prompt ids; the memory is injected (cached), so only the conversation is prefilled
    assert kvx["fact_ids"] == prx["fact_ids"] and set(kvx["fact_ids"]) == set(alice.values()) and kvx["k"] == 3
    assert kv.usage.prompt_tokens == pr.usage.prompt_tokens
    assert kv.usage.prompt_tokens_details.cached_tokens > 20
    assert pr.usage.prompt_tokens_details.cached_tokens == 0
    assert offx["k"] == 0 and offx["fact_ids"] == [] and off.usage.prompt_tokens < kv.usage.prompt_tokens
    # fp32 transformers engine: KV injection is exact, so greedy answers agree token for token
    assert kv.choices[0].message.content == pr.choices[0].message.content
    assert set(kvx["timings_ms"]) >= {"embed", "search", "compose", "ttft"}
    # streaming: the pieces add up to the same answer, the last chunk carries finish_reason, then usage
    pieces, finish, usage = [], None, None
    for ch in client.chat.completions.create(
        model=FAST,
        messages=msgs,
        user="alice",
        max_tokens=12,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"memory": {"top_k": 3, "mode": "kv"}},
    ):
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert "".join(pieces) == kv.choices[0].message.content and finish in ("stop", "length")
    assert usage.prompt_tokens == kv.usage.prompt_tokens and usage.completion_tokens == kv.usage.completion_tokens


def test_selective_recompute_over_http(server, alice):
    """``memory.selective_recompute`` p runs the kv-sel<p> method: at 100% the injected facts are recomputed, so
    the greedy answer is prompt injection's and fewer prompt tokens come from the cache; bad values are 400s."""
    _, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=120)
    chat = {
        "model": FAST,
        "user": "alice",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is Alice's job?"}],
    }
    out = {}
    for name, memory in (
        ("kv", {"mode": "kv"}),
        ("sel", {"mode": "kv", "selective_recompute": 100}),
        ("prompt", {"mode": "prompt"}),
    ):
        r = c.post("/v1/chat/completions", json={**chat, "memory": {"top_k": 3, **memory}})
        assert r.status_code == 200, r.text
        out[name] = r.json()
    cached = {n: o["usage"]["prompt_tokens_details"]["cached_tokens"] for n, o in out.items()}
    assert out["sel"]["choices"][0]["message"]["content"] == out["prompt"]["choices"][0]["message"]["content"]
    assert out["sel"]["kvmem"]["fact_ids"] == out["kv"]["kvmem"]["fact_ids"]
    assert cached["prompt"] == 0 < cached["sel"] < cached["kv"]  # the header stays injected; the facts are re-run
    for memory in ({"selective_recompute": 101}, {"selective_recompute": 20, "tail_recompute": 1}):
        r = c.post("/v1/chat/completions", json={**chat, "memory": memory})
        assert r.status_code in (400, 422) and "error" in r.json(), r.text
    # memory.cache "cold" (load tests): refused unless the server allows it; then answered exactly like kv
    cold = {**chat, "memory": {"top_k": 3, "mode": "kv", "cache": "cold"}}
    r = c.post("/v1/chat/completions", json=cold)
    assert r.status_code == 400 and r.json()["error"]["param"] == "memory.cache", r.text
    srv = server[0]
    srv.limits.allow_cold = True
    try:
        r = c.post("/v1/chat/completions", json=cold)
    finally:
        srv.limits.allow_cold = False
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["message"]["content"] == out["kv"]["choices"][0]["message"]["content"]
    assert got["kvmem"]["fact_ids"] == out["kv"]["kvmem"]["fact_ids"]


def test_selective_recompute_needs_the_transformers_engine(tmp_path):
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmem.cli",
            "serve",
            "--store",
            str(tmp_path / "s"),
            "--engine",
            "vllm",
            "--selective-recompute",
            "10",
            "--model",
            FAST,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "transformers engine only" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "s").exists()


def test_sampling_parameters_are_honoured(server, alice):
    client = _client(server)
    msgs = [{"role": "user", "content": "Tell me about Alice."}]
    kw = dict(model=FAST, messages=msgs, user="alice", max_tokens=10, extra_body={"memory": {"mode": "kv"}})
    a = client.chat.completions.create(temperature=1.5, top_p=0.95, seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(temperature=1.5, top_p=0.95, seed=7, **kw).choices[0].message.content
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    others = {
        client.chat.completions.create(temperature=1.5, seed=s, **kw).choices[0].message.content for s in range(8, 12)
    }
    assert a == b  # same seed, same sample
    assert len(others | {greedy}) > 1  # sampling is not greedy
    # a temperature too small to divide by is greedy, as in vLLM (it made the softmax NaN: a 500)
    tiny = client.chat.completions.create(temperature=5e-324, top_p=5e-324, **kw).choices[0].message.content
    assert tiny == greedy
    r = client.chat.completions.create(max_tokens=3, **{k: v for k, v in kw.items() if k != "max_tokens"})
    assert r.usage.completion_tokens <= 3
    text = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    if len(text) > 4:  # a stop string cuts the answer before it
        stop = text[2:4]
        cut = client.chat.completions.create(temperature=0, stop=[stop], **kw).choices[0].message.content
        assert cut == text[: text.index(stop)]


def test_memories_rest_round_trip_and_next_chat_sees_writes(server, alice):
    _, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=120)
    listed = c.get("/v1/memories", params={"user_id": "alice"}).json()["results"]
    assert {m["id"] for m in listed} >= set(alice.values()) and all(m["user_id"] == "alice" for m in listed)
    found = c.post("/v1/memories/search", json={"query": "pet cat", "user_id": "alice", "limit": 1}).json()
    assert found["results"][0]["id"] == alice["cat"] and "score" in found["results"][0]
    # a new memory is visible to the very next chat
    new = c.post(
        "/v1/memories",
        json={
            "messages": [{"role": "user", "content": "Alice plays the cello on Sundays."}],
            "user_id": "alice",
            "infer": False,
        },
    ).json()["results"][0]["id"]
    chat = dict(
        model=FAST,
        user="alice",
        max_tokens=4,
        memory={"top_k": 10, "mode": "kv"},
        messages=[{"role": "user", "content": "Which instrument does Alice play?"}],
    )
    assert new in c.post("/v1/chat/completions", json=chat).json()["kvmem"]["fact_ids"]
    # update keeps the id; history has both events; the old text is never served again
    assert c.put(f"/v1/memories/{new}", json={"text": "Alice plays the viola on Sundays."}).status_code == 200
    assert c.get(f"/v1/memories/{new}").json()["memory"] == "Alice plays the viola on Sundays."
    events = c.get(f"/v1/memories/{new}/history").json()
    assert [e["event"] for e in events] == ["ADD", "UPDATE"] and events[1]["old_memory"].endswith("cello on Sundays.")
    # delete: gone from the next search and the next chat
    assert c.delete(f"/v1/memories/{new}").status_code == 200
    assert c.get(f"/v1/memories/{new}").status_code == 404
    ids = [
        m["id"] for m in c.post("/v1/memories/search", json={"query": "viola", "user_id": "alice"}).json()["results"]
    ]
    assert new not in ids
    assert new not in c.post("/v1/chat/completions", json=chat).json()["kvmem"]["fact_ids"]


def test_tenants_are_isolated(server, alice):
    _, base = server
    b = httpx.Client(base_url=base, headers=_h(KEY_B), timeout=120)
    for method, path, body in [
        ("GET", f"/v1/memories/{alice['canary']}", None),
        ("GET", f"/v1/memories/{alice['canary']}/history", None),
        ("PUT", f"/v1/memories/{alice['canary']}", {"text": "stolen"}),
        ("DELETE", f"/v1/memories/{alice['canary']}", None),
    ]:
        r = b.request(method, path, json=body)
        assert "PINEAPPLE" not in r.text
        # answered as an id that exists nowhere: same status, same body (but for the id it names)
        nowhere = b.request(method, path.replace(alice["canary"], "no-such-memory-id"), json=body)
        assert r.status_code == nowhere.status_code == 404, (method, path, r.text)
        assert r.text.replace(alice["canary"], "X") == nowhere.text.replace("no-such-memory-id", "X"), (method, path)
    # the same user_id in another tenant is another user: nothing of acme's is listed, found or injected
    assert b.get("/v1/memories", params={"user_id": "alice"}).json() == {"results": []}
    assert b.post("/v1/memories/search", json={"query": "code word", "user_id": "alice"}).json() == {"results": []}
    r = b.post(
        "/v1/chat/completions",
        json={
            "model": FAST,
            "user": "alice",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the code word?"}],
        },
    )
    assert r.status_code == 200 and r.json()["kvmem"]["fact_ids"] == [] and "PINEAPPLE" not in r.text
    assert httpx.get(f"{base}/v1/memories", params={"user_id": "alice"}).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=_h("key-wrong-0123456789abcdef")).status_code == 401
    assert httpx.get(f"{base}/v1/memories/{alice['canary']}", headers=_h()).status_code == 200  # the owner can
    # an import naming acme's id answers as one naming an id that exists nowhere: ids are looked up per tenant
    answers = []
    for fid in (alice["canary"], "0f8fad5b-d9cb-469f-a165-70867728950e"):
        rec = {"id": fid, "memory": "The tea is green.", "user_id": "bob", "created_at": "2026-01-02T03:04:05Z"}
        answers.append(b.post("/v1/memories/import", json={"results": [rec]}))
    assert [r.status_code for r in answers] == [200, 200] and answers[0].json() == answers[1].json(), answers[0].text
    mine = b.get(f"/v1/memories/{alice['canary']}").json()  # globex's own memory under that id
    assert mine["memory"] == "The tea is green." and mine["user_id"] == "bob"
    theirs = httpx.get(f"{base}/v1/memories/{alice['canary']}", headers=_h()).json()  # acme's, untouched
    assert "PINEAPPLE" in theirs["memory"] and theirs["user_id"] == "alice"
    assert all(e["user_id"] == "bob" for e in b.get(f"/v1/memories/{alice['canary']}/history").json())
    assert b.delete(f"/v1/memories/{alice['canary']}").status_code == 200  # globex's goes, acme's stays
    assert "PINEAPPLE" in httpx.get(f"{base}/v1/memories/{alice['canary']}", headers=_h()).text


@pytest.mark.parametrize(
    "method,path,kwargs,status",
    [
        ("POST", "/v1/chat/completions", {"content": b"{not json"}, 400),
        (
            "POST",
            "/v1/chat/completions",
            {
                "json": {
                    "model": FAST,
                    "messages": [{"role": "user", "content": "hi"}],
                    "user": "alice",
                    "max_tokens": "many",
                }
            },
            422,
        ),
        ("POST", "/v1/chat/completions", {"json": {"model": FAST, "messages": []}}, 422),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": "gpt-17", "user": "alice", "messages": [{"role": "user", "content": "hi"}]}},
            404,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": FAST, "user": "a/b", "messages": [{"role": "user", "content": "hi"}]}},
            400,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": FAST, "user": "alice", "messages": [{"role": "assistant", "content": "hi"}]}},
            400,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {
                "json": {
                    "model": FAST,
                    "messages": [{"role": "user", "content": "hi"}],
                    "user": "alice",
                    "memory": {"mode": "telepathy"},
                }
            },
            422,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": FAST, "user": "alice", "messages": [{"role": "user", "content": "x" * 30000}] * 3}},
            413,
        ),
        ("POST", "/v1/memories", {"json": {"messages": "", "user_id": "alice", "infer": False}}, 400),
        ("POST", "/v1/memories", {"json": {"messages": [{"role": "user"}], "user_id": "alice", "infer": False}}, 400),
        ("POST", "/v1/memories", {"json": {"messages": "hi", "user_id": "", "infer": False}}, 400),
        (
            "POST",
            "/v1/memories",
            {"json": {"messages": [{"content": "x", "name": {"a": 1}}], "user_id": "alice", "infer": False}},
            400,
        ),
        (
            "POST",
            "/v1/memories",
            {
                "content": b'{"messages": "x", "user_id": "alice", "infer": false, "metadata": {"a": "\\ud83d"}}',
                "headers": {"Content-Type": "application/json"},
            },
            400,
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": FAST, "user": "alice", "seed": 2**64, "messages": [{"role": "user", "content": "hi"}]}},
            422,
        ),
        ("PUT", "/v1/memories/no-such-id", {"json": {"text": "x"}}, 404),
        ("GET", "/v1/memories/no-such-id", {}, 404),
        ("DELETE", "/v1/memories/no-such-id", {}, 404),
        ("GET", "/v1/memories", {}, 400),
        ("GET", "/v1/nothing-here", {}, 404),
    ],
)
def test_bad_input_gets_the_right_status(server, alice, method, path, kwargs, status):
    _, base = server
    kwargs = dict(kwargs)
    r = httpx.request(method, f"{base}{path}", headers={**_h(), **kwargs.pop("headers", {})}, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


def test_update_to_empty_text_and_overload_and_timeout(server, alice):
    srv, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=120)
    assert c.put(f"/v1/memories/{alice['job']}", json={"text": "  "}).status_code == 400
    assert c.get(f"/v1/memories/{alice['job']}").json()["memory"] == "Alice works as a nurse at the city hospital."
    chat = {
        "model": FAST,
        "user": "alice",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Where does Alice work?"}],
    }
    srv.engine.max_queue = 1  # overload: the engine takes one request; the rest are refused, not queued
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(6) as ex:
            codes = list(ex.map(lambda _: c.post("/v1/chat/completions", json=chat).status_code, range(6)))
    finally:
        srv.engine.max_queue = 64
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    srv.limits.request_timeout_s = 0.001
    try:
        r = c.post("/v1/chat/completions", json=chat)
    finally:
        srv.limits.request_timeout_s = 120.0
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"


def test_health_ready_and_metrics(server, alice):
    _, base = server
    # a kv chat and a memory read of its own: the counters below must not depend on which tests ran before
    _client(server).chat.completions.create(
        model=FAST,
        messages=[{"role": "user", "content": "What is Alice's job?"}],
        user="alice",
        max_tokens=2,
        extra_body={"memory": {"mode": "kv", "top_k": 2}},
    )
    auth = {"Authorization": f"Bearer {KEY_A}"}
    assert httpx.get(f"{base}/v1/memories/{alice['cat']}", headers=auth).status_code == 200
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").json()["engine"] == "hf"
    text = httpx.get(f"{base}/metrics").text
    for name in (
        "kvmem_requests_total",
        "kvmem_ttft_seconds_bucket",
        "kvmem_prompt_tokens_total",
        "kvmem_engine_queue_depth",
        "kvmem_store_bytes",
        "kvmem_cache_bytes",
        "kvmem_index_cache_events",
    ):
        assert name in text, name
    assert 'mode="kv"' in text and 'kind="injected"' in text
    reads = {
        line.split('counter="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmem_store_reads{")
    }
    assert reads["kv_hits"] + reads["kv_misses"] > 0 and reads["kv_read_bytes"] > 0
    assert reads["disk_hits"] == reads["disk_misses"] == 0  # a local store, no --cache-dir
    statuses = {
        line.split('status="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("kvmem_requests_total{")
    }
    # route labels are templates: random paths do not grow the metric
    for i in range(3):
        httpx.get(f"{base}/no-such-route-{i}")
    text = httpx.get(f"{base}/metrics").text
    assert "no-such-route" not in text and 'route="other"' in text and 'route="/v1/memories/{memory_id}"' in text
    assert "500" not in statuses and "200" in statuses


@pytest.mark.slow
def test_logprobs_and_response_format_are_honoured(server, alice):
    """``logprobs`` / ``top_logprobs`` come back per generated token, the same in the non-streamed and the
    streamed response; ``response_format`` json_schema / json_object constrain the
    answer with xgrammar, so it parses and matches the schema."""
    client = _client(server)
    msgs = [{"role": "user", "content": "What is Alice's secret code word?"}]
    got = {}
    for mode in ("kv", "prompt"):
        r = client.chat.completions.create(
            model=FAST,
            messages=msgs,
            user="alice",
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            extra_body={"memory": {"top_k": 3, "mode": mode}},
        )
        content = r.choices[0].logprobs.content
        eos = r.choices[0].finish_reason == "stop"  # the EOS token: counted in usage, no text, no logprob entry
        assert len(content) == r.usage.completion_tokens - eos >= 1
        for e in content:
            tops = [t.logprob for t in e.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
            assert e.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy: the chosen token is the most likely
            assert e.token == e.top_logprobs[0].token and bytes(e.bytes).decode(errors="replace") == e.token
        got[mode] = [e.logprob for e in content]
    streamed = []
    for ch in client.chat.completions.create(
        model=FAST, messages=msgs, user="alice", max_tokens=8, logprobs=True, stream=True
    ):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.logprob for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx(got["kv"], abs=1e-6)
    schema = {
        "type": "object",
        "properties": {"code_word": {"type": "string", "maxLength": 24}},
        "required": ["code_word"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=FAST,
        messages=msgs,
        user="alice",
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"code_word"} and isinstance(answer["code_word"], str)
    r = client.chat.completions.create(
        model=FAST, messages=msgs, user="alice", max_tokens=48, response_format={"type": "json_object"}
    )
    assert r.choices[0].message.content.lstrip().startswith("{")
    r = httpx.post(
        f"{server[1]}/v1/chat/completions",
        headers=_h(),
        json={"messages": msgs, "user": "alice", "response_format": {"type": "json_schema"}},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    r = httpx.post(
        f"{server[1]}/v1/chat/completions",
        headers=_h(),
        json={"messages": msgs, "user": "alice", "response_format": bad},
        timeout=60,
    )
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text


def test_text_parts_developer_role_and_refused_fields(server, alice):
    """Newer OpenAI clients send content as text parts and a ``developer`` role: the same answer as plain strings.
    Fields that would change the response and are not implemented are refused with a 400 naming the field."""
    _, base = server
    plain = {
        "model": FAST,
        "user": "alice",
        "max_tokens": 8,
        "memory": {"top_k": 3},
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is Alice's secret code word?"},
        ],
    }
    parts = {
        **plain,
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is Alice's "},
                    {"type": "text", "text": "secret code word?"},
                ],
            },
        ],
    }
    a = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=plain, timeout=120)
    b = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=parts, timeout=120)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    assert a.json()["usage"]["prompt_tokens"] == b.json()["usage"]["prompt_tokens"]
    refused = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "n": 2,
        "top_logprobs": 2,  # without logprobs: true
    }
    for field, value in refused.items():
        r = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json={**plain, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    image = {**plain, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    r = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=image, timeout=60)
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    ok = httpx.post(
        f"{base}/v1/chat/completions",
        headers=_h(),
        timeout=120,
        json={**plain, "response_format": {"type": "text"}, "frequency_penalty": 0.5},
    )
    assert ok.status_code == 200


def test_bad_tools_and_tool_messages_are_a_400_naming_the_field(server):
    """Tools are checked by the request models (so ``/openapi.json`` carries them): a tool schema that is not a
    JSON Schema of an object (the ``jsonschema`` meta-schema), a remote ``$ref``, ``tool_choice`` naming no tool
    of ``tools``, too many tools or too large a tools block, two tools of one name, a tool message that answers
    no earlier call, call arguments that are not a JSON object: each a 400 whose ``param`` names the field, never
    a 422 or a 500. Valid tools on a model whose chat template has none (the smallest model's) are a 400 that
    says so; validation comes first, so none of these reaches the model."""
    _, base = server

    def tool(name="f", parameters=None):
        params = {"type": "object", "properties": {"x": {"type": "string"}}} if parameters is None else parameters
        return {"type": "function", "function": {"name": name, "parameters": params}}

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": "1"}'}}
    ask = [{"role": "user", "content": "hi"}]
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call]}]
    cases = [
        (
            {"tools": [tool(parameters={"type": "object", "properties": {"x": {"type": "strng"}}})]},
            "tools.0.function.parameters",
            "not a valid JSON Schema at 'properties/x/type'",
        ),
        ({"tools": [tool(parameters={"type": "string"})]}, "tools.0.function.parameters", "JSON object"),
        ({"tools": [tool(parameters={"type": "object", "$schema": 5})]}, "tools.0.function.parameters", "'$schema'"),
        (
            {"tools": [tool(parameters={"$ref": "https://example.com/s.json"})]},
            "tools.0.function.parameters",
            "only local '$ref's",
        ),
        (
            {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "names 'g', which is not in 'tools'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [tool(f"t{i}") for i in range(129)]}, "tools", "at most 128 tools"),
        ({"tools": [tool(parameters={"type": "object", "description": "d" * 40000})]}, "tools", "at most 32768"),
        ({"tools": [tool(), tool()]}, "tools", "two tools are named 'f'"),
        (
            {"messages": [*ask, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
            "messages",
            "no earlier assistant tool call has id 'call_9'",
        ),
        ({"messages": [*ask, {"role": "tool", "content": "r"}]}, "messages.1", "needs the 'tool_call_id'"),
        ({"messages": [*ask, {"role": "user", "content": None}]}, "messages.1", "needs 'content'"),
        (
            {
                "messages": [
                    *ask,
                    {**history[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]},
                    {"role": "user", "content": "?"},
                ]
            },
            "messages.1",
            "JSON text of an object",
        ),
    ]
    for extra, param, words in cases:
        body = {"model": FAST, "messages": ask, "max_tokens": 4, **extra}
        r = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=body, timeout=60)
        assert r.status_code == 400, (param, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (param, err)
    # well-formed, but this model's template has no tools: refused, whether in tools or in the history
    for extra, param in (
        ({"tools": [tool()]}, "tools"),
        ({"messages": [*history, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]}, "messages"),
    ):
        body = {"model": FAST, "messages": ask, "max_tokens": 4, **extra}
        r = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "tools_unsupported" and err["param"] == param, r.text
        assert "chat template has no tools" in err["message"]
    spec = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(spec["ChatRequest"]["properties"])
    assert {"tool_calls", "tool_call_id"} <= set(spec["ChatMessage"]["properties"])


@pytest.mark.slow
def test_concurrent_searches_and_writes_never_duplicate_an_id(server):
    """Rounds of one add followed by 8 concurrent searches (and a chat): no result list holds an id twice, and
    afterwards a search returns exactly the live memories."""
    from concurrent.futures import ThreadPoolExecutor

    _, base = server
    user = "concurrent"
    for i in range(4):
        httpx.post(
            f"{base}/v1/memories",
            headers=_h(),
            timeout=120,
            json={"messages": f"Fact number {i} about the garden.", "user_id": user, "infer": False},
        )
    lists = []

    def search(_):
        r = httpx.post(
            f"{base}/v1/memories/search",
            headers=_h(),
            timeout=120,
            json={"query": "garden", "user_id": user, "limit": 1000},
        )
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["results"]]

    def chat(_):
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers=_h(),
            timeout=120,
            json={
                "user": user,
                "max_tokens": 2,
                "memory": {"top_k": 50},
                "messages": [{"role": "user", "content": "What about the garden?"}],
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["kvmem"]["fact_ids"]

    with ThreadPoolExecutor(9) as pool:
        for i in range(6):
            httpx.post(
                f"{base}/v1/memories",
                headers=_h(),
                timeout=120,
                json={"messages": f"Garden note {i}.", "user_id": user, "infer": False},
            )
            futures = [pool.submit(search, j) for j in range(8)] + [pool.submit(chat, 0)]
            lists += [f.result() for f in futures]
    assert lists and all(len(ids) == len(set(ids)) for ids in lists)
    live = {
        m["id"]
        for m in httpx.get(f"{base}/v1/memories", headers=_h(), params={"user_id": user}, timeout=60).json()["results"]
    }
    assert sorted(search(0)) == sorted(live) and len(live) == 10


def test_a_held_writer_lock_never_blocks_reads(server, alice, tmp_path):
    """Another process holds the store's writer lock (as compaction or fsck would): health, reads and chats
    answer within a second, and a write answers 503 "store busy" after the write timeout."""
    import subprocess
    import sys

    srv, base = server
    root = srv.service.store.root
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, sys, time\n"
                f"f = open({str(root / '.writer.lock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                "print('held', flush=True); time.sleep(30)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    old = srv.memory.store.writes.write_timeout_s
    try:
        assert holder.stdout.readline().strip() == "held"
        srv.memory.store.writes.write_timeout_s = 1.0
        t0 = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert httpx.get(f"{base}/v1/memories/{alice['cat']}", headers=_h(), timeout=5).status_code == 200
        assert (
            httpx.post(
                f"{base}/v1/memories/search", headers=_h(), timeout=5, json={"query": "cat", "user_id": "alice"}
            ).status_code
            == 200
        )
        assert time.perf_counter() - t0 < 3  # health, a get and a search: no wait for the 30 s holder
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers=_h(),
            timeout=30,
            json={"user": "alice", "max_tokens": 2, "messages": [{"role": "user", "content": "Cat?"}]},
        )
        assert r.status_code == 200
        reads_s = time.perf_counter() - t0
        w = httpx.post(
            f"{base}/v1/memories",
            headers=_h(),
            timeout=30,
            json={"messages": "Blocked write.", "user_id": "alice", "infer": False},
        )
        assert w.status_code == 503 and w.json()["error"]["code"] == "store_busy", w.text
        assert reads_s < 15  # a chat too (seconds on a 2-core CPU), not the holder's 30 s
    finally:
        srv.memory.store.writes.write_timeout_s = old
        holder.kill()
        holder.wait()


def test_a_full_disk_answers_507_and_one_log_line(tmp_path, caplog):
    """A store on an 8 MiB tmpfs, then filled: a write answers 507 "no space left on the store's disk" with one
    log line and no traceback; nothing partial stays, reads still answer, and once space is freed the same
    write succeeds."""
    import shutil
    import subprocess

    from kvmem.server import KvmemServer, Limits

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    srv = None
    try:
        srv = KvmemServer.start(mnt / "store", model=FAST, engine="hf", dtype="float32", window=1, limits=Limits())
        with http_server(srv) as base:
            add = {"messages": "Bob keeps three hives of bees on his roof.", "user_id": "bob", "infer": False}
            assert httpx.post(f"{base}/v1/memories", json=add, timeout=120).status_code == 200
            filler = mnt / "filler"
            free = shutil.disk_usage(mnt).free
            filler.write_bytes(b"\0" * (free - 64 * 1024))  # 64 KiB left: less than one fact's KV
            segments = set((mnt / "store" / "users").iterdir())
            caplog.clear()
            honey = {**add, "messages": "Bob sells honey."}
            with caplog.at_level("WARNING"):
                r = httpx.post(f"{base}/v1/memories", json=honey, timeout=120)
            assert r.status_code == 507 and "no space left on the store's disk" in r.json()["error"]["message"], r.text
            lines = [rec for rec in caplog.records if "no space left" in rec.getMessage()]
            assert len(lines) == 1 and lines[0].exc_info is None
            assert set((mnt / "store" / "users").iterdir()) == segments  # no partial segment
            got = httpx.post(f"{base}/v1/memories/search", json={"query": "bees", "user_id": "bob"}, timeout=60)
            assert got.status_code == 200 and len(got.json()["results"]) == 1
            filler.unlink()
            r = httpx.post(f"{base}/v1/memories", json=honey, timeout=120)
            assert r.status_code == 200, r.text
    finally:
        if srv is not None:
            srv.close()
        subprocess.run(["umount", "-l", str(mnt)])


def test_keys_with_spaces_are_refused_at_start_and_user_ids_are_nfc(server, tmp_path):
    """A key written with surrounding spaces could never be presented (the header is stripped): refused when the
    keys file loads. NFC and NFD spellings of one user id are the same user."""
    from kvmem.server.tenants import load_api_keys

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({" padded-key-0123456789 ": "acme"}))
    with pytest.raises(ValueError, match="spaces"):
        load_api_keys(keys)
    _, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=120)
    nfc, nfd = "Zo\u00eb", "Zoe\u0308"
    r = c.post("/v1/memories", json={"messages": "Zoë plays the cello.", "user_id": nfc, "infer": False})
    assert r.status_code == 200, r.text
    hits = c.post("/v1/memories/search", json={"query": "cello", "user_id": nfd}).json()["results"]
    assert [h["memory"] for h in hits] == ["Zoë plays the cello."]
    assert c.delete("/v1/memories", params={"user_id": nfd}).status_code == 200
    assert c.post("/v1/memories/search", json={"query": "cello", "user_id": nfc}).json()["results"] == []


def test_a_request_that_timed_out_in_the_queue_never_runs(server, alice):
    """While the model thread is busy, a chat times out waiting (503): it is dropped from the queue, so the
    engine never prefills it afterwards."""
    srv, base = server
    eng = srv.engine.engine  # the transformers engine behind the async role
    ran, real = [], eng.run_request

    def counting(request, **kw):
        ran.append(request)
        return real(request, **kw)

    eng.run_request = counting
    busy = srv.model_pool.submit(time.sleep, 2.0)  # the one model thread, occupied
    srv.limits.request_timeout_s = 0.5
    try:
        chat = {  # no memory: prepared off the model thread, so the request reaches the engine's queue
            "memory": {"mode": "off"},
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Where does Alice work?"}],
        }
        r = httpx.post(f"{base}/v1/chat/completions", headers=_h(), json=chat, timeout=60)
        busy.result()
        time.sleep(0.5)  # the dropped request's turn on the model thread has come and gone
    finally:
        srv.limits.request_timeout_s = 120.0
        eng.run_request = real
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout", r.text
    assert ran == []


def test_a_client_that_stops_reading_never_holds_an_engine_slot(server, alice, caplog):
    """Two streamed chats whose clients never read, on an engine with two slots (the server's kernel send buffer
    fixed at 4 KB, so the sends stall after a few dozen tokens, not megabytes): each send that does not drain
    within --send-timeout ends its request (the engine stops decoding it), closes its connection, counts in
    kvmem_send_timeouts_total and is logged once; another tenant's chat is answered."""
    import logging

    srv, _ = server
    eng = srv.engine.engine
    done, real = [], eng.run_request

    def recording(request, **kw):
        out = real(request, **kw)
        done.append(request.sampling.max_tokens - len(out.token_ids))  # tokens not decoded (cancelled)
        return out

    eng.run_request = recording
    srv.limits.send_timeout_s, srv.engine.max_queue = 1.0, 2
    socks = []
    try:
        with http_server(srv, sndbuf=4096) as base, caplog.at_level(logging.WARNING, logger="kvmem.server"):
            t0 = time.perf_counter()
            socks = [stalled_stream(base, KEY_A, 400) for _ in range(2)]
            while metric(base, "kvmem_send_timeouts_total") < 2 and time.perf_counter() - t0 < 30:
                time.sleep(0.2)
            assert metric(base, "kvmem_send_timeouts_total") == 2
            while len(done) < 2 and time.perf_counter() - t0 < 30:
                time.sleep(0.1)
            assert len(done) == 2 and min(done) > 0, done  # both stopped decoding before max_tokens
            assert metric(base, "kvmem_engine_queue_depth") == 0
            r = httpx.post(
                f"{base}/v1/chat/completions",
                headers=_h(KEY_B),
                json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 4},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            for s in socks:  # the server closed the connection: what it had sent, then end of stream
                s.settimeout(10)
                while s.recv(1 << 16):
                    pass
        said = [r for r in caplog.records if "stopped reading" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
    finally:
        eng.run_request = real
        srv.limits.send_timeout_s, srv.engine.max_queue = 30.0, 64
        for s in socks:
            s.close()


def test_deep_filters_and_nul_characters_get_one_clear_4xx(server, alice):
    """AND / OR / NOT nested 300 levels deep (3 KB) is a 400 naming the depth limit, never a RecursionError's
    500; a NUL character in a path, a query or a body string is a 400 naming it (no store can hold one)."""
    from kvmem.scopes import MAX_FILTER_DEPTH

    _, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=60)
    deep = {"user_id": "alice"}
    for i in range(300):
        deep = {"AND": [deep]} if i % 2 else {"NOT": [deep]}
    deep = {"user_id": "alice", **deep}  # scoped, so the search reaches the filter
    for path in ("/v1/memories/search", "/v3/memories/search"):
        r = c.post(path, json={"query": "cat", "filters": deep})
        assert r.status_code == 400 and f"more than {MAX_FILTER_DEPTH} levels" in r.json()["error"]["message"], r.text
    r = c.post("/v3/memories", json={"filters": deep})
    assert r.status_code == 400 and "levels deep" in r.text, r.text
    inner = {"user_id": "alice"}
    for _ in range(MAX_FILTER_DEPTH - 1):
        inner = {"AND": [inner]}
    ok = {"user_id": "alice", "AND": [inner]}  # exactly the limit: served
    r = c.post("/v3/memories/search", json={"query": "cat", "filters": ok})
    assert r.status_code == 200 and r.json()["results"], r.text
    for path in ("/v1/memories/%00", "/v1/memories?user_id=al%00ice"):
        r = c.get(path)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("NUL characters"), (path, r.text)
    r = c.post("/v1/memories", json={"messages": "hi", "metadata": {"k": "a\x00b"}, "user_id": "alice", "infer": False})
    assert r.status_code == 400 and "NUL characters" in r.json()["error"]["message"], r.text


def test_store_errors_never_reach_the_client(tmp_path, postgres, monkeypatch):
    """A PostgreSQL error (here: a NUL in a looked-up id) names the store's URL and quotes the database; the
    answer carries neither (logged on the server instead)."""
    import store_worker as sw
    from kvmem.server.schemas import error_of
    from kvmem.store import StoreError

    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", "postgres")
    st = sw.create(tmp_path / "s")
    try:
        with pytest.raises(StoreError) as raised:
            st.reads.fact("a\x00b")
    finally:
        st.close()
    assert "postgresql://" in str(raised.value)  # the store's own words
    resp = error_of(raised.value).response()
    body = json.loads(resp.body)
    assert resp.status_code == 409 and body["error"]["code"] == "write_conflict"
    assert "postgresql" not in resp.body.decode() and "0x00" not in resp.body.decode(), body


def test_metrics_never_walk_the_store_on_the_event_loop(server, alice):
    """A store with 60,000 more files (the walk that sizes it takes most of a second here): /health answers in a
    few milliseconds while /metrics is scraped, since kvmem_store_bytes is measured on a background thread, and
    scrapes never repeat the walk."""
    import concurrent.futures
    import shutil

    from kvmem.server import KvmemServer

    srv, _ = server
    junk = srv.service.store.root / "junk"
    junk.mkdir()
    try:
        for i in range(60_000):
            (junk / f"f{i}").touch()
        t0 = time.perf_counter()
        srv.service.store.disk_bytes()
        walk_s = time.perf_counter() - t0
        assert walk_s > 0.3, walk_s  # the precondition: a walk that would be felt on the event loop
        fresh = KvmemServer(srv.service, srv.memory, srv.engine, srv.tenants, srv.limits, srv.model_pool)
        with http_server(fresh) as base, concurrent.futures.ThreadPoolExecutor(2) as pool:
            waits = []
            for _ in range(5):
                scrape = pool.submit(httpx.get, f"{base}/metrics", timeout=60)
                time.sleep(0.02)
                t0 = time.perf_counter()
                assert httpx.get(f"{base}/health", timeout=60).status_code == 200
                waits.append(time.perf_counter() - t0)
                assert scrape.result().status_code == 200
            # A walk on the loop makes every /health behind a scrape wait about walk_s. The median, not the max:
            # the walk thread and this process's client share one GIL, and on 2 cores one wait in a few can take
            # a few hundred ms of switching (seen: 0.58 s once, against 0.06 and 0.07 s).
            assert sorted(waits)[2] < 0.25 * walk_s, (waits, walk_s)
            deadline = time.time() + 30
            while fresh.store_size.measurements < 1 and time.time() < deadline:
                time.sleep(0.1)
            text = httpx.get(f"{base}/metrics").text
            [line] = [x for x in text.splitlines() if x.startswith("kvmem_store_bytes ")]
            assert float(line.split()[1]) > 0
            assert fresh.store_size.measurements == 1  # six scrapes, one walk
        fresh.store_size.close()
    finally:
        shutil.rmtree(junk)


TRICKY = (
    "Zoë's café — naïve 日本語のテキスト 🙂🚀👩‍👩‍👧 x² ≠ y; Ελληνικά, עברית, العربية 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301\n"
    "  indented\ttab  . ‘quotes’ «guillemets» ½ ⅞ 한국어 ไทย \u200b zero-width"
)


@pytest.mark.parametrize("model", [FAST, "qwen2.5-coder-0.5b-instruct", "gemma3-270m"])
def test_streamed_text_is_decoded_once_per_token_and_equals_a_full_decode(model):
    """The stream's detokenizer (``server.detok``) gives, token by token, exactly what one decode of every id
    gives, for text whose characters span tokens (emoji sequences, CJK, combining marks, byte-fallback), and
    never decodes everything so far again: one whole decode per answer, at its end, whatever its length."""
    from transformers import AutoTokenizer

    from kvmem.server.detok import IncrementalText

    if not (model_dir(model) / MANIFEST).exists():
        pytest.skip(f"{model} is not installed")
    tok = AutoTokenizer.from_pretrained(model_dir(model))
    ids = tok.encode(TRICKY * 40, add_special_tokens=False) + [tok.eos_token_id]
    decodes = []

    class Counting:  # the real tokenizer, its whole decodes counted
        backend_tokenizer = tok.backend_tokenizer

        def decode(self, ids, **kw):
            decodes.append(len(ids))
            return tok.decode(ids, **kw)

    stream = IncrementalText(Counting())
    pieces = [stream.push([t]) for t in ids]
    pieces.append(stream.finish())
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == stream.text == full
    assert len(ids) > 1000 and decodes == [len(ids)]
    assert all("\ufffd" not in p for p in pieces)  # a character is sent whole, never as halves
    k = full.index("🚀") + 1
    assert stream.tokens_for(k) == next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).startswith(full[:k]))


def test_the_connector_counters_file_is_private_and_its_names_are_checked(server, tmp_path):
    """The vLLM connector's counters go to a file in a fresh 0700 directory (never a predictable name in /tmp),
    and only names of its own shape, with numeric values, 64 at most, become kvmem_connector_events labels."""
    import os
    import stat
    from pathlib import Path

    from kvmem.server.runtime import MAX_CONNECTOR_EVENTS, private_metrics_file

    a, b = Path(private_metrics_file()), Path(private_metrics_file())
    try:
        assert a.parent != b.parent and str(os.getpid()) not in str(a)
        assert stat.S_IMODE(a.parent.stat().st_mode) == 0o700 and a.parent.stat().st_uid == os.getuid()
    finally:
        a.parent.rmdir()
        b.parent.rmdir()
    srv, base = server
    path = tmp_path / "connector.json"
    hostile = {"injected": 5, 'x"} 1\nkvmem_fake 9': 1, "Upper": 2, "text": "n/a", "y" * 100: 3}
    path.write_text(json.dumps({**hostile, **{f"e{i:03d}": i for i in range(100)}}))
    srv.metrics._metrics_file = str(path)
    try:
        text = httpx.get(f"{base}/metrics").text
    finally:
        srv.metrics._metrics_file = None
    events = {
        line.split('event="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmem_connector_events{")
    }
    assert events["injected"] == 5 and len(events) == MAX_CONNECTOR_EVENTS, sorted(events)
    assert set(events) <= {"injected"} | {f"e{i:03d}" for i in range(100)}
    assert "kvmem_fake" not in text


@pytest.mark.parametrize(
    "bad, names",
    [
        ({"user_id": "alice", "memory": {"contains": 5}}, "'memory'"),
        ({"user_id": "alice", "topic": {"icontains": None}}, "'topic'"),
        ({"user_id": "alice", "AND": {"topic": "x"}}, "AND"),
        ({"user_id": "alice", "AND": 5}, "AND"),
        ({"user_id": "alice", "OR": [5]}, "object"),
        ({"user_id": "alice", "NOT": {"topic": "x"}}, "NOT"),
        ({"user_id": "alice", "memory": {"in": "x"}}, "'memory'"),
        ({"user_id": "alice", "topic": {"nin": 3}}, "'topic'"),
        ({"user_id": "alice", "created_at": {"gt": [1]}}, "'created_at'"),
        ({"user_id": "alice", "created_at": {"lte": True}}, "'created_at'"),
        ({"user_id": "alice", "topic": {"like": "x"}}, "'like'"),
    ],
)
def test_malformed_filters_are_400s_naming_the_field(server, alice, bad, names):
    """Every operator's operand is checked before any memory is (``scopes.check_operand``): a non-string
    ``contains``, a non-list ``AND`` / ``in``, a list for ``gt``... is a 400 with ``param`` "filters" and a
    message naming the field or operator, on search and on list (before: a TypeError's 500)."""
    _, base = server
    c = httpx.Client(base_url=base, headers=_h(), timeout=60)
    for path, body in (("/v3/memories/search", {"query": "cat"}), ("/v3/memories", {})):
        r = c.post(path, json={**body, "filters": bad})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "filters" and names in err["message"], (path, err)


def test_a_trickled_body_gets_408_within_the_bound(server):
    """A client that sends its headers and part of its body, then nothing (slowloris), is answered 408 and its
    connection closed once ``body_timeout_s`` has passed (uvicorn alone would wait for as long as it stays)."""
    import socket

    srv, base = server
    host, port = base.removeprefix("http://").split(":")
    srv.limits.body_timeout_s = 0.5
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                f"POST /v1/memories/search HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                'Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"query": '.encode()
            )
            t0, got = time.monotonic(), b""
            while chunk := s.recv(4096):  # until the server closes the connection
                got += chunk
            took = time.monotonic() - t0
    finally:
        srv.limits.body_timeout_s = 30.0
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b'"code":"request_timeout"' in got.replace(b" ", b"") and 0.4 <= took < 5, took
