"""OpenAI tool calls through ``kvmem serve --engine vllm`` (Qwen2.5-Coder 0.5B, whose chat template renders
tools; fp32, so the injected memory gives the answer prefilling it gives), with the real ``openai`` client: one
server for the module. A forced call (named, required) and ``auto``: the call's name and parsed arguments, which
come from the user's memory; the streamed call assembled by the client's stream helper equals the whole one; the
follow-up turn with the tool's result answers from it."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

pytest.importorskip("vllm")

from conftest import free_port, serve_cmd, wait_ready
from kvmem.models import MANIFEST, model_dir
from tool_defs import ASK, TOOLS, checked_call

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.real_model]

MODEL = "qwen2.5-coder-0.5b-instruct"
KV = {"memory": {"mode": "kv", "top_k": 2}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``kvmem serve --engine vllm`` on ``MODEL`` (fp32, no API keys): Alice's two memories stored verbatim."""
    import os
    import signal

    from kvmem.hardware import cpu_facts, vllm_problem

    why = vllm_problem(cpu_facts())
    if why:
        pytest.skip(f"vLLM cannot run here: {why}")
    if not (model_dir(MODEL) / MANIFEST).exists():
        pytest.fail(f"{MODEL} is not installed; run: kvmem models install {MODEL}")
    tmp = tmp_path_factory.mktemp("serve-vllm-tools")
    port = free_port()
    cmd = serve_cmd(tmp, port)
    cmd[cmd.index("--model") + 1] = MODEL
    cmd = [a for a in cmd if a not in ("--api-keys", str(tmp / "keys.json"))] + ["--timeout", "600"]
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - the server writes to it until it stops
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, tmp / "server.log", timeout_s=1500)  # a crowded 2-core CPU: starts take long
        for fact in ("Alice lives in Lisbon, in Portugal.", "Alice's favourite colour is teal."):
            r = httpx.post(
                f"{url}/v1/memories", json={"messages": fact, "user_id": "alice", "infer": False}, timeout=300
            )
            assert r.status_code == 200, r.text
        yield url
        proc.terminate()
        assert proc.wait(timeout=120) == 0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


@pytest.fixture(scope="module")
def client(base):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)


def test_vllm_forced_and_auto_calls_use_the_memory_and_stream_the_same(client):
    """Named and ``required``: one call of get_weather, ``content`` null, finish_reason tool_calls, the city from
    Alice's memory (the question names none), the same arguments in kv and prompt mode, the memory injected (kv:
    cached tokens). Streamed through the client's stream helper: the same call, OpenAI's delta shape. ``auto``:
    the same question is a call with the same city, a greeting is text."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = {}
    for choice_, mode in ((named, "kv"), (named, "prompt"), ("required", "kv")):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice_,
            user="alice",
            temperature=0,
            extra_body={"memory": {"mode": mode, "top_k": 2}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        got[(str(choice_), mode)] = (r, checked_call(call, "get_weather"))
    kv, kv_args = got[(str(named), "kv")]
    pr, pr_args = got[(str(named), "prompt")]
    assert "lisb" in kv_args["city"].lower(), kv_args
    assert pr_args == kv_args and got[("required", "kv")][1] == kv_args
    assert kv.model_extra["kvmem"]["engine"] == "vllm" and len(kv.model_extra["kvmem"]["fact_ids"]) == 2
    assert kv.usage.prompt_tokens == pr.usage.prompt_tokens
    assert kv.usage.prompt_tokens_details.cached_tokens > 40 and pr.usage.prompt_tokens_details.cached_tokens == 0

    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, user="alice", temperature=0, extra_body=KV
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    msg = final.choices[0].message
    [call] = msg.tool_calls
    assert msg.content is None and final.choices[0].finish_reason == "tool_calls"
    want = kv.choices[0].message.tool_calls[0].function
    assert (call.function.name, call.function.arguments) == (want.name, want.arguments)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0][0]  # index, id, type and name once, then argument fragments
    assert first.index == 0 and first.id == call.id and first.type == "function" and first.function.name
    assert all(d[0].index == 0 and d[0].id is None and d[0].function.name is None for d in deltas[1:])

    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, user="alice", temperature=0, extra_body=KV
    )  # auto
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert "lisb" in checked_call(call, "get_weather")["city"].lower()
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=TOOLS, user="alice", temperature=0, extra_body=KV
    ) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    hello = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to me in French, in one word."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=10,
    )
    assert hello.choices[0].message.tool_calls is None and hello.choices[0].message.content


def test_vllm_follow_up_turn_answers_from_the_tool_result(client):
    """The assistant's call (``content`` null) and the tool's result (by ``tool_call_id``) in the history,
    ``tool_choice`` none: a text answer that uses the result's word, in kv mode with Alice's memory injected,
    the same as prompt mode."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "hailstorm", "temperature_c": 3}'},
    ]
    out = {}
    for mode in ("kv", "prompt"):
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=MODEL,
            messages=history,
            tools=TOOLS,
            tool_choice="none",  # under auto the 0.5B calls get_weather again (bare objects, cut at max_tokens)
            user="alice",
            temperature=0,
            max_tokens=40,
            extra_body={"memory": {"mode": mode, "top_k": 2}},
        )
        choice = r.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length"), choice
        assert "hail" in choice.message.content.lower(), choice.message.content
        assert r.model_extra["kvmem"]["k"] == 2, time.perf_counter() - t0
        out[mode] = r
    assert out["kv"].choices[0].message.content == out["prompt"].choices[0].message.content
    assert out["kv"].usage.prompt_tokens_details.cached_tokens > 40
