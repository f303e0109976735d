"""OpenAI tool calls in a chat's answer: the grammar that ``tool_choice`` "required" or a named function decodes
under, the parse of the model's own call format, and the streamed form.

The models with tools in their chat template (Qwen2.5) are asked to answer a call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the Hermes format). ``auto``: the model
chooses text or calls; the answer is parsed as vLLM's ``hermes`` tool parser parses it (its regex and its
reading of the JSON; importing vLLM's front end only to parse would cost the transformers engine tens of seconds,
so the parse is here, and a vLLM-tier test checks it against vLLM's parser). ``required`` / named: the answer is
decoded under a JSON Schema of ``{"name": <a tool's name>, "arguments": <that tool's parameters>}`` (guided
decoding: xgrammar on the transformers engine, vLLM's structured outputs), so it is one call whose arguments
match. A call that does not parse, names no tool of the request or whose arguments do not match its schema is
returned as text, never as a malformed ``tool_calls`` entry. Under ``auto`` an answer that is nothing but such a
JSON object, the tags left out (small Qwen2.5-Coder models often answer so), is a call too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# vLLM's Hermes2ProToolParser.tool_call_regex: a closed call, or one left open at the end of the answer
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools as the answer uses them. ``mode``: "auto", "required" or "named" (``ChatRequest.
    tool_mode``; "none" has no plan); ``schemas``: each tool's name -> its arguments' JSON Schema (the named one
    alone when named); ``parallel``: more than one call per answer allowed (auto only; required and named give
    exactly one)."""

    mode: str
    schemas: dict[str, dict]
    parallel: bool = True

    @classmethod
    def of(cls, body) -> ToolPlan | None:
        """The plan of a ``schemas.ChatRequest``; None when its answer is text only."""
        mode = body.tool_mode()
        if mode == "none":
            return None
        schemas = {t.function.name: t.function.schema() for t in body.tools}
        if mode == "named":
            name = body.tool_choice.function.name
            schemas = {name: schemas[name]}
        return cls(mode, schemas, body.parallel_tool_calls is not False)

    def grammar(self) -> str | None:
        """JSON text of the schema the answer decodes under ("required", "named"): an object of one tool's
        name and its arguments (``anyOf`` over the tools); None for "auto"."""
        if self.mode == "auto":
            return None
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        return json.dumps(one[0] if len(one) == 1 else {"anyOf": one}, sort_keys=True)

    def _call(self, obj) -> dict | None:
        """An OpenAI ``tool_calls`` entry for a parsed ``{"name", "arguments"}``; None if it is not a call of one
        of the tools with arguments that match its schema."""
        import jsonschema

        if not isinstance(obj, dict) or not isinstance(obj.get("arguments"), dict):
            return None
        schema = self.schemas.get(obj.get("name")) if isinstance(obj.get("name"), str) else None
        if schema is None:
            return None
        try:
            jsonschema.validate(obj["arguments"], schema)
        except Exception:  # ValidationError, or a local $ref that does not resolve
            return None
        args = json.dumps(obj["arguments"], ensure_ascii=False)
        return {"id": call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}

    def parse(self, text: str) -> tuple[str | None, list[dict]] | None:
        """The answer ``text`` as (content before the calls, or None when only whitespace; the calls), or None
        when it holds no call that parses (it is then the text answer)."""
        if self.mode != "auto":
            try:
                call = self._call(json.loads(text))
            except ValueError:
                return None
            return None if call is None else (None, [call])
        if CALL_START not in text:
            try:  # the bare object, tags left out (Qwen2.5-Coder often answers so)
                call = self._call(json.loads(text)) if text.lstrip().startswith("{") else None
            except ValueError:
                return None
            return None if call is None else (None, [call])
        calls = []
        for closed, open_ in _CALL.findall(text):
            try:
                call = self._call(json.loads(closed or open_))
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        content = text[: text.find(CALL_START)]
        return (content if content.strip() else None), calls if self.parallel else calls[:1]


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``CALL_START`` (a call may be starting there)."""
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """A streamed answer under a ``ToolPlan``: ``feed(piece)`` -> the content that may be sent now (text before
    any call; leading whitespace and a possible start of a call held back; nothing under "required" or
    "named"); ``finish()`` -> (the content still to send, the calls), exactly what ``ToolPlan.parse`` of the
    whole text gives, so a streamed answer assembles to the non-streamed one."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.plan.mode != "auto":
            return ""
        at = self.text.find(CALL_START)
        end = at if at >= 0 else len(self.text) - _partial_start(self.text)
        if not self.text[:end].strip() or (self.sent == 0 and self.text.lstrip().startswith("{")):
            return ""  # nothing yet, or perhaps a bare call (``ToolPlan.parse``): held to the end
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        parsed = self.plan.parse(self.text)
        if parsed is None:  # text after all: what was held back goes out as content
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        content, calls = parsed
        rest = (content or "")[self.sent :]
        self.sent += len(rest)
        return rest, calls
