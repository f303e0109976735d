"""OpenAI tool calls through ``kvmem serve`` on the transformers engine, with the real ``openai`` client: the
default model (Qwen2.5-Coder 0.5B, whose chat template renders tools; the smallest model's has none) in fp32, one
server for the module. A forced call (``tool_choice`` required / named) returns ``tool_calls`` whose arguments
parse and match the tool's schema, streamed the same as whole; the follow-up turn with the tool's result answers
from it; memory is injected ahead of the tools in kv mode, the tools block from its cached KV, with prompt mode's
prompt ids."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import http_server
from kvmem.models import MANIFEST, model_dir
from tool_defs import ASK, TOOLS, checked_call

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(MODEL) / MANIFEST).exists():
        pytest.fail(f"{MODEL} is not installed; run: kvmem models install {MODEL}")
    srv = KvmemServer.start(
        tmp_path_factory.mktemp("serve-tools") / "store",
        model=MODEL,
        engine="hf",
        dtype="float32",
        window=2,
        # 2 shared cores, fp32; MCP's add_memories stores verbatim (no extraction run by the 0.5B model)
        limits=Limits(default_max_tokens=40, request_timeout_s=600, mcp_infer=False),
    )
    with http_server(srv) as url:
        for fact in ("Alice lives in Lisbon, in Portugal.", "Alice's favourite colour is teal."):
            r = httpx.post(
                f"{url}/v1/memories", json={"messages": fact, "user_id": "alice", "infer": False}, timeout=300
            )
            assert r.status_code == 200, r.text
        yield url


@pytest.fixture(scope="module")
def client(base):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)


def test_a_forced_call_parses_streams_the_same_and_uses_the_memory(client):
    """``tool_choice`` naming get_weather (and ``required``): one call, ``content`` null, finish_reason
    tool_calls, arguments that parse and match the schema and name the city from Alice's memory; in kv mode the
    same call as prompt mode (greedy, fp32) over the same prompt ids, with the same header and facts injected as
    without tools and the tools block's KV after them (only the turn prefilled); streamed through the ``openai``
    client's stream helper, it assembles to the same call."""
    out = {}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for mode in ("kv", "prompt"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=named,
            user="alice",
            temperature=0,
            extra_body={"memory": {"mode": mode, "top_k": 2}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        args = checked_call(call, "get_weather")
        assert "lisb" in args["city"].lower(), args  # from the memory: the question names no city
        out[mode] = (r, args)
    (kv, kv_args), (pr, pr_args) = out["kv"], out["prompt"]
    assert kv_args == pr_args
    assert kv.usage.prompt_tokens == pr.usage.prompt_tokens and pr.usage.prompt_tokens_details.cached_tokens == 0
    cached = kv.usage.prompt_tokens_details.cached_tokens  # the header, the facts, then the tools block's KV
    assert kv.usage.prompt_tokens - cached < 30  # only the user's turn is prefilled (engines.tools_kv)
    assert kv.model_extra["kvmem"]["k"] == 2
    # the same header and facts are injected as for the chat without tools, the tools block after them
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, user="alice", max_tokens=1, extra_body={"memory": {"mode": "kv", "top_k": 2}}
    )
    assert 40 < plain.usage.prompt_tokens_details.cached_tokens < cached - 100
    assert plain.model_extra["kvmem"]["fact_ids"] == kv.model_extra["kvmem"]["fact_ids"]

    # required with two tools: one call of one of them (greedy: get_weather, as named)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", user="alice", temperature=0
    )
    [call] = r.choices[0].message.tool_calls
    assert checked_call(call, "get_weather") == kv_args and r.choices[0].finish_reason == "tool_calls"

    # streamed: the openai client's stream helper assembles the deltas to the same message
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        user="alice",
        temperature=0,
        extra_body={"memory": {"mode": "kv", "top_k": 2}},
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    msg = final.choices[0].message
    [call] = msg.tool_calls
    assert msg.content is None and final.choices[0].finish_reason == "tool_calls"
    assert (
        call.function.name == "get_weather"
        and call.function.arguments == kv.choices[0].message.tool_calls[0].function.arguments
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0][0]  # OpenAI's shape: index, id, type and name once, then argument fragments
    assert first.index == 0 and first.id == call.id and first.type == "function" and first.function.name
    assert all(d[0].index == 0 and d[0].id is None and d[0].function.name is None for d in deltas[1:])


def test_the_follow_up_turn_answers_from_the_tool_result_with_memory(client):
    """The history: the user's question, the assistant's call (``content`` null), the tool's result (by
    ``tool_call_id``), with ``tool_choice`` none (a text answer now; the tools are not shown). The answer (greedy)
    uses the result's word, in kv mode with the memory still injected (the retrieval question is the last user
    message), the same as prompt mode."""
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
        r = client.chat.completions.create(
            model=MODEL,
            messages=history,
            tools=TOOLS,
            tool_choice="none",
            user="alice",
            temperature=0,
            max_tokens=40,
            extra_body={"memory": {"mode": mode, "top_k": 2}},
        )
        choice = r.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length"), choice
        assert "hail" in choice.message.content.lower(), choice.message.content
        assert r.model_extra["kvmem"]["k"] == 2
        out[mode] = r
    assert out["kv"].choices[0].message.content == out["prompt"].choices[0].message.content
    assert out["kv"].usage.prompt_tokens_details.cached_tokens > 40


def test_auto_answers_text_or_a_call_that_parses(client):
    """``auto``: the model's own choice. A greeting is text (finish_reason stop, no tool_calls); the weather
    question is a call whose arguments parse and match, or, where the model's format did not parse, text:
    never a malformed call."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to me in French, in one word."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=10,
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, user="alice", temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice  # greedy, this model: a call (tags left out)
    [call] = choice.message.tool_calls
    assert "lisb" in checked_call(call, "get_weather")["city"].lower()


def test_tools_are_rendered_by_the_template_after_the_memory():
    """The prompt of a chat with tools and tool messages is exactly the model's own chat template applied to
    the memory (as the system message) and the conversation: ``header + facts + conversation_ids`` decodes to
    it, so the header's and the facts' injected KV are the prompt's; the same chat without memory is the
    template applied to the conversation alone. A template without tools (SmolLM2's) refuses them."""
    from transformers import AutoTokenizer

    from kvmem.compose import HEADER_TEXT, PromptFormat

    if not (model_dir(MODEL) / MANIFEST).exists():
        pytest.fail(f"{MODEL} is not installed; run: kvmem models install {MODEL}")
    tok = AutoTokenizer.from_pretrained(model_dir(MODEL))
    fmt = PromptFormat.for_tokenizer(tok, chat=True)
    assert fmt.tools
    facts = "Alice lives in Lisbon.\nAlice likes teal.\n"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}}
    chat = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "hail", "tool_call_id": "call_1"},
    ]
    ids = fmt.header_ids(tok) + tok(facts, add_special_tokens=False)["input_ids"]
    ids += fmt.conversation_ids(tok, chat, tools=TOOLS)
    whole = tok.apply_chat_template(
        [{"role": "system", "content": HEADER_TEXT + facts + "\n\nBe brief."}, *chat[1:]],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(ids) == whole and '"name": "get_weather"' in whole and "<tool_response>\nhail" in whole
    assert whole.index(facts) < whole.index("# Tools")  # the memory comes first, the tools after it
    bare = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.decode(fmt.conversation_ids(tok, chat, memory=False, tools=TOOLS)) == bare

    small = AutoTokenizer.from_pretrained(model_dir("smollm2-135m-instruct"))
    sfmt = PromptFormat.for_tokenizer(small, chat=True)
    assert not sfmt.tools
    with pytest.raises(ValueError, match="chat template has no tools"):
        sfmt.conversation_ids(small, ASK, tools=TOOLS)


def test_langgraph_react_agent_calls_the_tool_with_the_memory(base):
    """LangChain's ``ChatOpenAI(...).bind_tools`` inside a LangGraph ReAct agent, pointed at kvmem: the agent
    reads kvmem's ``tool_calls`` (auto), runs the tool with arguments from Alice's memory, sends its result back
    as a ``tool`` message kvmem accepts, and ends with the model's answer."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    seen = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return "hailstorm, 3 degrees"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{base}/v1",
        api_key="none",
        temperature=0,
        max_tokens=40,
        max_retries=0,
        timeout=600,
        extra_body={"user": "alice"},  # whose memory (kept when the agent binds its tools)
    )
    agent = create_react_agent(llm, [get_weather])
    ask = "Call get_weather for the city where I live."
    out = agent.invoke({"messages": [("user", ask)]}, {"recursion_limit": 6})
    kinds = [m.type for m in out["messages"]]
    assert kinds[:3] == ["human", "ai", "tool"] and kinds[-1] == "ai", [(m.type, m.content) for m in out["messages"]]
    assert seen and "lisb" in seen[0].lower(), seen
    assert out["messages"][1].tool_calls[0]["name"] == "get_weather"


def test_openai_agents_sdk_runs_the_tool_through_kvmem(base):
    """The OpenAI Agents SDK's ``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client at kvmem: with
    ``tool_choice`` required on the first turn (the SDK resets it to auto after a call), the run calls the
    function tool with arguments from Alice's memory and finishes with a final output."""
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing outside this machine is reached
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return "hailstorm, 3 degrees"

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    agent = Agent(
        name="weather",
        instructions="Answer briefly.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            temperature=0, max_tokens=40, tool_choice="required", extra_body={"user": "alice"}
        ),
        tools=[get_weather],
    )
    result = Runner.run_sync(agent, "What's the weather like where I live?", max_turns=4)
    assert seen and "lisb" in seen[0].lower(), seen
    assert isinstance(result.final_output, str)


def test_an_agent_stores_a_memory_over_mcp_and_a_later_turn_answers_from_it(base):
    """One agent with kvmem as its model and kvmem's MCP memory server (``/mcp?user_id=bob``, the Agents SDK's
    streamable HTTP MCP client) as its tools. Turn 1, ``tool_choice`` required: the agent calls ``add_memories``
    with the fact, and the memory is Bob's (REST lists it, once). Turn 2, a new run with no history and the
    memory's read tool, ``tool_choice`` required: the agent calls ``search_memory``, and its final answer, the
    model's after the search result (the SDK resets ``tool_choice`` to auto), names the stored code."""
    import anyio
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from agents.items import ToolCallItem
    from agents.mcp import MCPServerStreamableHttp, create_static_tool_filter

    set_tracing_disabled(True)
    settings = dict(temperature=0, max_tokens=40, extra_body={"user": "bob", "memory": {"top_k": 2}})

    def model() -> OpenAIChatCompletionsModel:  # one client per event loop (each turn is its own anyio.run)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)

    def memory(*tools: str) -> MCPServerStreamableHttp:
        return MCPServerStreamableHttp(
            {"url": f"{base}/mcp?user_id=bob", "timeout": 120},
            client_session_timeout_seconds=300,
            tool_filter=create_static_tool_filter(allowed_tool_names=list(tools)),
        )

    async def remember():
        async with memory("add_memories", "search_memory") as mcp:
            agent = Agent(
                name="assistant",
                instructions="Save what the user asks you to remember. Answer briefly.",
                model=model(),
                mcp_servers=[mcp],
                model_settings=ModelSettings(tool_choice="required", **settings),
                tool_use_behavior="stop_on_first_tool",  # the stored memory's report ends the run
            )
            return await Runner.run(agent, "Remember this: my bike lock code is 4812.", max_turns=2)

    async def recall():
        async with memory("search_memory") as mcp:
            agent = Agent(
                name="assistant",
                instructions="Answer briefly.",
                model=model(),
                mcp_servers=[mcp],
                model_settings=ModelSettings(tool_choice="required", **settings),  # auto after the call
            )
            return await Runner.run(agent, "What is my bike lock code?", max_turns=4)

    first = anyio.run(remember)
    [call] = [i.raw_item for i in first.new_items if isinstance(i, ToolCallItem)]
    assert call.name == "add_memories" and "4812" in json.loads(call.arguments)["text"], call
    stored = httpx.get(f"{base}/v1/memories", params={"user_id": "bob"}, timeout=60).json()
    texts = [m["memory"] for m in stored["results"]]
    assert len(texts) == 1 and "4812" in texts[0], stored
    second = anyio.run(recall)
    calls = [i.raw_item for i in second.new_items if isinstance(i, ToolCallItem)]
    assert calls and calls[0].name == "search_memory", second.new_items
    assert "4812" in second.final_output, (second.final_output, second.new_items)
