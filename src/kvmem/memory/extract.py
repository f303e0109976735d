"""Fact extraction for ``Memory.add(infer=True)``: Mem0's two-step design with kvmem's own prompts.

1. ``facts``: new chat messages -> short standalone facts, ``{"facts": [str]}``.
2. ``reconcile``: the new facts and the most similar existing memories (numbered, so the model never copies a
   UUID) -> one decision per fact, ``{"memory": [{"event": "ADD"|"UPDATE"|"DELETE"|"NONE", "id", "text"}]}``.

Outputs are constrained to a JSON schema, so they parse: on the vLLM engine through vLLM's guided decoding
(``StructuredOutputsParams(json=schema)``), on transformers under xgrammar's grammar
(``xgrammar.contrib.hf.LogitsProcessor``, the library vLLM's structured outputs use); an OpenAI-compatible
endpoint gets ``response_format={"type": "json_schema"}``. A reply that is still unusable (cut off at the token
limit, an unknown id) yields no fact or a NONE decision, logged, never an exception.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import httpx

from ..engines.select import reference_engine
from ..store import redact_text

logger = logging.getLogger("kvmem.extract")
EXTRACTOR_KEY_ENV = "KVMEM_EXTRACTOR_API_KEY"  # the extractor endpoint's key, where no config gives one

FACTS_SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 8}},
    "required": ["facts"],
}
DECISIONS_SCHEMA = {
    "type": "object",
    "properties": {
        "memory": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "event": {"enum": ["ADD", "UPDATE", "DELETE", "NONE"]},
                    "id": {"type": "string", "maxLength": 8},
                    "text": {"type": "string", "maxLength": 200},
                },
                "required": ["event", "id", "text"],
            },
            "maxItems": 16,
        }
    },
    "required": ["memory"],
}


def decisions_schema(num_facts: int, num_existing: int) -> dict:
    """``DECISIONS_SCHEMA`` narrowed to one call: exactly one decision per new fact and only ids that exist, so a
    small model can neither ramble past the token limit nor name a memory that is not there."""
    item = DECISIONS_SCHEMA["properties"]["memory"]["items"]
    ids = ["new"] + [str(i) for i in range(num_existing)]
    item = {
        **item,
        "properties": {**item["properties"], "id": {"enum": ids}, "text": {"type": "string", "maxLength": 160}},
    }
    return {
        **DECISIONS_SCHEMA,
        "properties": {"memory": {"type": "array", "items": item, "minItems": num_facts, "maxItems": num_facts}},
    }


FACTS_PROMPT = (
    "You keep a personal memory about the user. Read the new messages and list the facts worth remembering "
    "about the user and the people they mention: preferences, plans, events with dates, relationships, "
    "personal details. Write each fact as one short standalone sentence that names who it is about. Skip "
    "greetings, small talk and questions. If there is nothing worth remembering, return an empty list.\n"
    "Today is {date}.\n\nNew messages:\n{messages}\n\n"
    'Answer with JSON: {{"facts": ["...", "..."]}}'
)
FACTS_FORMAT = 'Answer with JSON: {"facts": ["...", "..."]}'
DECISIONS_PROMPT = (
    "You maintain a memory of facts about a user. Compare each new fact with the existing memories and decide:\n"
    '- ADD: the fact is new information (id: "new").\n'
    "- UPDATE: the fact changes or refines an existing memory (id: that memory's number; text: the merged fact).\n"
    "- DELETE: the fact says an existing memory is no longer true (id: that memory's number).\n"
    '- NONE: the fact is already known (id: the matching memory\'s number, or "new").\n\n'
    "Existing memories:\n{existing}\n\nNew facts:\n{facts}\n\n"
    'Answer with JSON: {{"memory": [{{"event": "...", "id": "...", "text": "..."}}]}}, one entry per new fact.'
)


@dataclass
class Decision:
    event: str  # ADD | UPDATE | DELETE | NONE
    text: str
    target: str | None = None  # the existing memory's id for UPDATE / DELETE / NONE


def _parse(text: str, key: str) -> list:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        logger.warning("extractor reply is not JSON (cut off at the token limit?): %r", str(text)[:200])
        return []
    items = obj.get(key) if isinstance(obj, dict) else None
    return items if isinstance(items, list) else []


class Extractor:
    """The two steps over a ``complete(prompt, schema) -> str`` backend."""

    def complete(self, prompt: str, schema: dict) -> str:  # pragma: no cover - backends implement it
        raise NotImplementedError

    def facts(self, messages: list[dict], date: str, prompt: str | None = None) -> list[str]:
        """Standalone facts in ``messages``. ``prompt``: instructions in place of kvmem's own (Mem0's ``prompt``
        / ``custom_instructions``); the date, the messages and the JSON answer format follow them."""
        shown = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        if prompt is None:
            text = FACTS_PROMPT.format(date=date, messages=shown)
        else:
            text = f"{prompt}\nToday is {date}.\n\nNew messages:\n{shown}\n\n" + FACTS_FORMAT
        out = _parse(self.complete(text, FACTS_SCHEMA), "facts")
        return [f.strip() for f in out if isinstance(f, str) and f.strip()]

    def reconcile(self, facts: list[str], existing: list[tuple[str, str]]) -> list[Decision]:
        """``existing``: (memory id, text) pairs; the model sees them numbered 0..n-1."""
        if not existing:
            return [Decision("ADD", f) for f in facts]
        shown = "\n".join(f"{i}. {text}" for i, (_, text) in enumerate(existing)) or "(none)"
        items = _parse(
            self.complete(
                DECISIONS_PROMPT.format(existing=shown, facts="\n".join(f"- {f}" for f in facts)),
                decisions_schema(len(facts), len(existing)),
            ),
            "memory",
        )
        out = []
        for it in items:
            if not isinstance(it, dict) or it.get("event") not in ("ADD", "UPDATE", "DELETE", "NONE"):
                continue
            event, text, ref = it["event"], str(it.get("text", "")).strip(), str(it.get("id", "")).strip()
            target = existing[int(ref)][0] if ref.isdigit() and int(ref) < len(existing) else None
            if event in ("UPDATE", "DELETE") and target is None:
                logger.warning("extractor chose %s of unknown memory %r: NONE", event, ref)
                event = "NONE"
            if event in ("ADD", "UPDATE") and not text:
                event = "NONE"
            out.append(Decision(event, text, target))
        return out


def chat_prompt_ids(lm, prompt: str) -> list[int]:
    """One user message in the model's chat template (generation prompt added); completion models get the bare
    prompt and a line break."""
    tok = lm.tokenizer
    if lm.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)
    return list(tok(prompt + "\n")["input_ids"])


class LocalExtractor(Extractor):
    """The answer model itself (offline), greedy, constrained to the JSON schema through an engine's
    ``complete_json``: the running engine's (vLLM guided decoding, or the transformers engine under xgrammar),
    else a transformers engine on ``lm`` made on first use."""

    def __init__(self, lm, max_new_tokens: int = 256, engine=None):
        self.lm, self.max_new_tokens, self.engine = lm, max_new_tokens, engine

    def complete(self, prompt: str, schema: dict) -> str:
        ids = chat_prompt_ids(self.lm, prompt)
        if self.engine is None:
            self.engine = reference_engine(self.lm.model, tokenizer=self.lm.tokenizer)
        out = self.engine.complete_json(ids, schema, self.max_new_tokens)
        return self.lm.tokenizer.decode(out, skip_special_tokens=True)


class OpenAIExtractor(Extractor):
    """Any OpenAI-compatible endpoint (a stronger model), with a JSON-schema response format."""

    def __init__(self, base_url: str, model: str, api_key: str = "none", timeout_s: float = 60.0):
        self.base_url, self.model, self.api_key, self.timeout_s = base_url.rstrip("/"), model, api_key, timeout_s

    def complete(self, prompt: str, schema: dict) -> str:

        body = {
            "model": self.model,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "kvmem", "schema": schema}},
        }
        try:
            r = httpx.post(
                f"{self.base_url}/chat/completions",
                json=body,
                timeout=self.timeout_s,
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            logger.warning("extractor endpoint failed: %s", redact_text(str(exc)))  # httpx quotes the URL
            return ""


def make_extractor(spec, lm, engine=None) -> Extractor:
    """None -> the local answer model (through ``engine`` when given: vLLM guided decoding); a dict
    {"base_url", "model", "api_key"?} -> that endpoint (no key given: ``$KVMEM_EXTRACTOR_API_KEY``, so a key need
    not travel in a URL or a config); an Extractor."""
    if spec is None:
        return LocalExtractor(lm, engine=engine)
    if isinstance(spec, Extractor):
        return spec
    if isinstance(spec, dict) and {"base_url", "model"} <= set(spec):
        key = spec.get("api_key") or os.environ.get(EXTRACTOR_KEY_ENV) or "none"
        return OpenAIExtractor(spec["base_url"], spec["model"], key)
    raise ValueError("extractor must be None (the local model), an Extractor, or {'base_url', 'model', 'api_key'}")
