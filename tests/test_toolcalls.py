"""``server.toolcalls``: the grammar of a forced call, the parse of the Hermes call format, and the streamed form
(no model: text in, OpenAI ``tool_calls`` out)."""

from __future__ import annotations

import json

import pytest

from kvmem.server.toolcalls import ToolPlan, ToolStream

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
    "send_email": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
}
AUTO = ToolPlan("auto", SCHEMAS)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>'


def _calls(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


def test_auto_parses_calls_and_leaves_everything_else_as_text():
    """Calls in the Hermes format (with text before, several, one left open, the tags left out) become OpenAI
    calls with ``call_`` ids and arguments as JSON text; a call that does not parse, names no tool, or whose
    arguments do not match its schema leaves the whole answer as text (None)."""
    content, calls = AUTO.parse("Let me check.\n" + CALL)
    assert content == "Let me check.\n" and _calls((content, calls)) == [("get_weather", {"city": "Lisbon"})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two = CALL + '\n<tool_call>\n{"name": "send_email", "arguments": {"to": "bo"}}\n</tool_call>'
    assert _calls(AUTO.parse(two)) == [("get_weather", {"city": "Lisbon"}), ("send_email", {"to": "bo"})]
    assert _calls(ToolPlan("auto", SCHEMAS, parallel=False).parse(two)) == [("get_weather", {"city": "Lisbon"})]
    assert _calls(AUTO.parse(CALL[: -len("</tool_call>")])) == [("get_weather", {"city": "Lisbon"})]
    assert AUTO.parse('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')[0] is None  # bare: a call
    for text in (
        "Lisbon is sunny.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "K"}}\n</tool_call>',  # does not match
        '<tool_call>\n{"name": "get_weather", "arguments": "Lisbon"}\n</tool_call>',  # not an object
        CALL + "\n<tool_call>\n{oops}\n</tool_call>",  # one bad call: all text
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather"}',  # two bare objects
    ):
        assert AUTO.parse(text) is None, text


def test_a_forced_call_has_a_grammar_of_its_tools_and_parses_as_one_call():
    """``required`` / named: the answer's JSON Schema is one object of a tool's name (const) and its arguments'
    schema (``anyOf`` over several tools), which xgrammar compiles; the answer parses as exactly one call, and
    an answer cut short (max_tokens) is text."""
    import xgrammar as xgr

    named = ToolPlan("named", {"get_weather": SCHEMAS["get_weather"]})
    schema = json.loads(named.grammar())
    assert schema["properties"] == {"name": {"const": "get_weather"}, "arguments": SCHEMAS["get_weather"]}
    required = json.loads(ToolPlan("required", SCHEMAS).grammar())
    assert [s["properties"]["name"] for s in required["anyOf"]] == [{"const": n} for n in SCHEMAS]
    assert AUTO.grammar() is None
    for plan in (named, ToolPlan("required", SCHEMAS)):
        xgr.Grammar.from_json_schema(plan.grammar())
    assert _calls(named.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')) == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert named.parse('{"name": "get_weather", "arguments": {"ci') is None


@pytest.mark.parametrize(
    "text",
    ["Let me check.\n" + CALL, "\n" + CALL, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "Hello <tool"],
)
@pytest.mark.parametrize("step", [1, 3, 50])
def test_a_streamed_answer_assembles_to_the_parsed_one(text, step):
    """Fed in pieces, ``ToolStream`` sends as content only what the whole answer's parse keeps as content (text
    before a call; never a piece of a call, leading whitespace or a bare object that becomes a call), and its
    calls are the parse's; a text answer comes out whole."""
    stream = ToolStream(AUTO)
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    parsed = AUTO.parse(text)
    if parsed is None:
        assert sent + rest == text and calls == []
    else:
        assert sent + rest == (parsed[0] or "") and _calls(("", calls)) == _calls(parsed)
        assert "<tool" not in sent and "{" not in sent
