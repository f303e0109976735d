"""``kvmem serve --engine vllm``: the CLI starts vLLM's AsyncLLM with the kvmem connector; the real
``openai`` client chats in kv and prompt mode (fp32: the injected memory gives the same greedy answer as
prefilling it), streams, and a second tenant's request is never injected with the first tenant's memory."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("vllm")

from conftest import FAST_MODEL as FAST
from conftest import VLLM_KEYS, VLLM_SEND_TIMEOUT_S, metric, stalled_stream

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY_A, KEY_B = VLLM_KEYS  # acme's, globex's


@pytest.fixture
def base(vllm_server):
    """The session's ``kvmem serve --engine vllm`` (tests/conftest.py): tenants acme (KEY_A) and globex (KEY_B)."""
    return vllm_server


def test_vllm_server_injects_memory_and_isolates_tenants(base):
    import openai

    h = {"Authorization": f"Bearer {KEY_A}"}
    facts = [
        "Alice adopted a grey cat named Pixel in March.",
        "Alice's secret code word is PINEAPPLE-42.",
        "Alice works as a nurse at the city hospital.",
    ]
    r = httpx.post(
        f"{base}/v1/memories",
        headers=h,
        timeout=300,
        json={"messages": [{"role": "user", "content": f} for f in facts], "user_id": "alice", "infer": False},
    )
    assert r.status_code == 200, r.text
    ids = {e["id"] for e in r.json()["results"]}
    assert len(ids) == 3
    assert httpx.get(f"{base}/ready").json()["engine"] == "vllm"

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What is Alice's secret code word?"}]
    got = {}
    for mode in ("kv", "prompt"):
        got[mode] = client.chat.completions.create(
            model=FAST,
            messages=msgs,
            user="alice",
            max_tokens=10,
            temperature=0,
            extra_body={"memory": {"top_k": 3, "mode": mode}},
        )
    kv, pr = got["kv"], got["prompt"]
    assert set(kv.model_extra["kvmem"]["fact_ids"]) == ids and kv.model_extra["kvmem"]["engine"] == "vllm"
    assert kv.model_extra["kvmem"]["fact_ids"] == pr.model_extra["kvmem"]["fact_ids"]
    assert kv.usage.prompt_tokens == pr.usage.prompt_tokens
    # the memory came from the connector: all but the conversation was not prefilled
    assert kv.usage.prompt_tokens_details.cached_tokens >= 30
    assert pr.usage.prompt_tokens_details.cached_tokens == 0
    assert kv.choices[0].message.content == pr.choices[0].message.content  # fp32: injection is exact
    # tail recompute: the last retrieved fact is prefilled with the question, the rest still injected
    tail = client.chat.completions.create(
        model=FAST,
        messages=msgs,
        user="alice",
        max_tokens=4,
        temperature=0,
        extra_body={"memory": {"top_k": 3, "mode": "kv", "tail_recompute": 1}},
    )
    assert tail.model_extra["kvmem"]["fact_ids"] == kv.model_extra["kvmem"]["fact_ids"]
    assert 20 <= tail.usage.prompt_tokens_details.cached_tokens < kv.usage.prompt_tokens_details.cached_tokens
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=FAST,
            messages=msgs,
            user="alice",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"memory": {"top_k": 3, "mode": "kv"}},
        )
        if c.choices
    ]
    assert "".join(pieces) == kv.choices[0].message.content
    # another tenant's "alice" is another user: nothing injected, nothing of acme's served
    other = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_B, max_retries=0, timeout=300)
    r = other.chat.completions.create(model=FAST, messages=msgs, user="alice", max_tokens=10)
    assert r.model_extra["kvmem"]["fact_ids"] == [] and r.usage.prompt_tokens_details.cached_tokens == 0
    assert (
        httpx.get(f"{base}/v1/memories/{next(iter(ids))}", headers={"Authorization": f"Bearer {KEY_B}"}).status_code
        == 404
    )
    # a delete is seen by the next request
    gone = next(iter(ids))
    assert httpx.delete(f"{base}/v1/memories/{gone}", headers=h, timeout=300).status_code == 200
    again = client.chat.completions.create(
        model=FAST, messages=msgs, user="alice", max_tokens=4, extra_body={"memory": {"top_k": 3, "mode": "kv"}}
    )
    assert gone not in again.model_extra["kvmem"]["fact_ids"] and len(again.model_extra["kvmem"]["fact_ids"]) == 2
    text = httpx.get(f"{base}/metrics").text
    injected = [ln for ln in text.splitlines() if ln.startswith('kvmem_connector_events{event="requests_injected"}')]
    assert (
        injected and float(injected[0].split()[-1]) >= 2
    )  # kv, then the new version (the stream hit the prefix cache)
    time.sleep(1.1)  # the worker reports its reads at most once a second: the next load writes them
    client.chat.completions.create(
        model=FAST, messages=msgs, user="alice", max_tokens=2, extra_body={"memory": {"top_k": 2, "mode": "kv"}}
    )
    text = httpx.get(f"{base}/metrics").text
    reads = {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("kvmem_store_reads{")}
    assert reads["kv_misses"] >= 3 and reads["kv_read_bytes"] > 0, reads  # the worker's reads of facts' KV


def test_vllm_injects_memory_of_several_scopes_through_the_connector(base):
    """A chat naming a user and an agent: the connector reads both scopes' versions (its ``parts``), injects
    them under one salt over both, with no fallback, and both modes answer from it; a write to either scope is
    seen."""
    h = {"Authorization": f"Bearer {KEY_A}"}

    def add(text, **ids):
        r = httpx.post(
            f"{base}/v3/memories/add/", headers=h, json={"messages": text, "infer": False, **ids}, timeout=300
        )
        assert r.status_code == 200, r.text
        return r.json()["results"][0]["id"]

    mine = add("Bruno's bike is a red Brompton.", user_id="bruno")
    agent = add("The repair agent's workshop opens at nine.", agent_id="repair")

    def chat(mode, **memory):
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers=h,
            timeout=300,
            json={
                "model": FAST,
                "user": "bruno",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "When does the workshop open?"}],
                "memory": {"top_k": 5, "mode": mode, **memory},
            },
        )
        assert r.status_code == 200, r.text
        return r.json()

    def fallbacks():
        text = httpx.get(f"{base}/metrics").text
        return sum(
            float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("kvmem_connector_fallbacks_total")
        )

    before = fallbacks()
    kv, pr = chat("kv", agent_id="repair"), chat("prompt", agent_id="repair")
    assert set(kv["kvmem"]["fact_ids"]) == {mine, agent} and kv["kvmem"]["fact_ids"] == pr["kvmem"]["fact_ids"]
    assert kv["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 and fallbacks() == before
    # each scope's first fact is encoded behind the header alone, so greedy text may differ from prompt
    # injection's (where the second fact attends to the first); both must carry the stored answer
    assert "nine" in kv["choices"][0]["message"]["content"] and "nine" in pr["choices"][0]["message"]["content"]
    assert chat("kv")["kvmem"]["fact_ids"] == [mine]  # the agent's memory only when the agent is named
    later = add("The repair agent also fixes scooters.", agent_id="repair")
    again = chat("kv", agent_id="repair")
    assert later in again["kvmem"]["fact_ids"] and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20
    assert fallbacks() == before


def test_vllm_clients_that_stop_reading_are_cut_off_and_free_their_engine_slots(base):
    """Three streamed chats (1,500 tokens each) whose clients never read, on the shared vLLM server (kernel send
    buffer fixed at 4 KB by ``--send-buffer``, so each send stalls after a few dozen tokens): each is cut off
    ``--send-timeout`` after its send stalls, counted in kvmem_send_timeouts_total, its engine stream closed (the
    engine queue depth back to 0 at once; closing the stream aborts the vLLM request) and its connection closed;
    another tenant's chat is answered while they are held."""

    cut0 = metric(base, "kvmem_send_timeouts_total")
    assert metric(base, "kvmem_engine_queue_depth") == 0
    t0 = time.perf_counter()
    socks = [stalled_stream(base, KEY_A, 1500) for _ in range(3)]
    try:
        depth = 0.0
        while depth < 3 and time.perf_counter() - t0 < 30:  # all three are in the engine
            depth = metric(base, "kvmem_engine_queue_depth")
            time.sleep(0.1)
        assert depth == 3
        # another tenant is answered while the three streams are held
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY_B}"},
            json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        while metric(base, "kvmem_send_timeouts_total") < cut0 + 3 and time.perf_counter() - t0 < 90:
            time.sleep(0.2)
        assert metric(base, "kvmem_send_timeouts_total") == cut0 + 3
        cut_s = time.perf_counter() - t0
        while metric(base, "kvmem_engine_queue_depth") > 0 and time.perf_counter() - t0 < cut_s + 5:
            time.sleep(0.1)
        assert metric(base, "kvmem_engine_queue_depth") == 0
        got = []
        for s in socks:  # what the server sent before it gave up, then the end of the stream (connection closed)
            s.settimeout(10)
            n = 0
            while chunk := s.recv(1 << 16):
                n += len(chunk)
            got.append(n)
        # each stalled within the fixed buffers (about 80 KB: a few dozen 3 KB chunks), not after megabytes
        assert all(20_000 < n < 1_000_000 for n in got), got
        assert VLLM_SEND_TIMEOUT_S < cut_s < 60, cut_s  # the bound ran out after each stall, then the cut
    finally:
        for s in socks:
            s.close()
    # the server is whole: a chat of the tenant whose streams were cut is answered
    r = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_vllm_server_refuses_tools_for_a_model_without_them(base):
    """The session's vLLM server runs the smallest model, whose chat template has no tools: a chat with tools
    is a 400 that says so (the route's check, before any engine work), and the server goes on answering. Tool
    calls on a model with tools are checked on the transformers engine (tests/test_server_tools.py); the
    engines share the rendering, the grammar (vLLM's structured outputs take the same JSON Schema) and the parse."""
    h = {"Authorization": f"Bearer {KEY_A}"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": FAST, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [tool]}
    r = httpx.post(f"{base}/v1/chat/completions", headers=h, json=body, timeout=300)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "tools_unsupported" and err["param"] == "tools", r.text
    del body["tools"]
    assert httpx.post(f"{base}/v1/chat/completions", headers=h, json=body, timeout=300).status_code == 200


HERMES_CASES = [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "send_email", "arguments": {"to": "bo", "body": "hi ✓"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # left open at the end
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON: text
    "No call here, just text.",
]


def test_the_tool_call_parse_agrees_with_vllms_hermes_parser():
    """``server.toolcalls.ToolPlan.parse`` (auto) reads the Hermes format as vLLM's own ``hermes`` tool parser
    does: the same calls (names, arguments as JSON text), the same content before them, and text where vLLM
    finds no call."""
    from transformers import AutoTokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from kvmem.models import model_dir
    from kvmem.server.toolcalls import ToolPlan

    plan = ToolPlan(
        "auto",
        {
            "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
            "send_email": {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}}},
        },
    )
    vllm_parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(model_dir(FAST)))
    for text in HERMES_CASES:
        theirs = vllm_parser.extract_tool_calls(text, None)
        ours = plan.parse(text)
        if not theirs.tools_called:
            assert ours is None, text
            continue
        content, calls = ours
        assert content == theirs.content, text
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in theirs.tool_calls
        ], text
