"""Composition: header + retrieved facts -> token ids, contiguous virtual positions, chunked-RoPE K/V.

Paper §3.3 and §5.1: the memory is ``[header][fact_1]...[fact_k]`` at virtual positions ``start .. start+m-1``;
each fact's stored pre-RoPE keys are rotated to their new positions (``rope.Rotary.rotate_keys``). The query, in the
model's prompt format, follows at ``start+m``. The same ``token_ids`` feed both KV injection and prompt injection,
so the baseline is fair by construction.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import torch

from .rope import Rotary

# The header is stored with a store (its text, token ids and KV): a store keeps the header it was made with.
HEADER_TEXT = (
    "You are a helpful assistant with a long-term memory of the user's conversations. "
    "Answer the question in a few words, using the memory below. If the memory does not hold the answer, "
    'say "I don\'t know" instead of guessing.\n\nMemory:\n'
)
_MEM, _Q = "\x00KVMEM_MEMORY\x00", "\x00KVMEM_QUESTION\x00"


class ContextOverflow(ValueError):
    """Memory plus query does not fit the model's context window."""


@dataclass(frozen=True)
class PromptFormat:
    """Where memory and question sit in the model's prompt: ``header + facts + query_prefix + q + query_suffix``."""

    header: str
    query_prefix: str
    query_suffix: str
    bos_token_id: int | None = None  # prepended to the header ids (completion-style models that need BOS)
    chat: bool = False  # the split comes from the tokenizer's chat template
    tools: bool = False  # the chat template renders OpenAI tools (``conversation_ids(..., tools=)``)

    @classmethod
    def for_tokenizer(cls, tokenizer, chat: bool) -> PromptFormat:
        """Derive the split from the tokenizer's own chat template (system message = header + memory,
        user message = question), or a completion-style format for base models."""
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": HEADER_TEXT + _MEM}, {"role": "user", "content": _Q}],
                tokenize=False,
                add_generation_prompt=True,
            )
            i, j = text.index(_MEM), text.index(_Q)
            return cls(
                text[:i], text[i + len(_MEM) : j], text[j + len(_Q) :], chat=True, tools=_renders_tools(tokenizer)
            )
        bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", True) else None
        return cls(HEADER_TEXT, "\nQuestion: ", "\nShort answer:", bos)

    def header_ids(self, tokenizer) -> list[int]:
        ids = tokenizer(self.header, add_special_tokens=False)["input_ids"]
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

    def query_ids(self, tokenizer, question: str) -> list[int]:
        check_text(question, "the question")
        return tokenizer(self.query_prefix + question + self.query_suffix, add_special_tokens=False)["input_ids"]

    def conversation_ids(
        self, tokenizer, messages: list[dict], memory: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """A multi-turn chat after the memory: the ids that follow ``header + facts``, ending in the assistant's
        generation prompt. ``messages``: OpenAI-style [{role, content}] as chat templates take them (an
        assistant's ``tool_calls`` with object ``arguments``, ``tool`` results); a system message's text follows
        the memory inside the one system block. For a single user message this equals ``query_ids``.
        ``memory=False``: the whole prompt of the same chat without any memory block. ``tools``: OpenAI tool
        definitions, rendered by the model's own chat template (in its system part, after the memory, so the
        header ids and the injected KV stay the same). Raises ValueError for bad text, for tools or tool messages
        on a model whose template has none, and for a template that would put tools before the memory."""
        system = "".join("\n\n" + m["content"] for m in messages if m["role"] == "system")
        turns = [m for m in messages if m["role"] != "system"]
        for m in messages:
            check_text(m["content"], f"a {m['role']} message")
        has_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if has_tools and not self.tools:
            raise ValueError("this model's chat template has no tools: tool calls are not available with it")
        if has_tools:
            check_text(json.dumps([tools, [m.get("tool_calls") for m in turns]], ensure_ascii=False), "the tools")
        kw = {"tools": tools} if tools else {}
        if self.chat:
            if not memory:
                sys_msg = [{"role": "system", "content": system.strip()}] if system.strip() else []
                text = tokenizer.apply_chat_template(sys_msg + turns, tokenize=False, add_generation_prompt=True, **kw)
                return tokenizer(text, add_special_tokens=False)["input_ids"]
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": HEADER_TEXT + _MEM + system}] + turns,
                tokenize=False,
                add_generation_prompt=True,
                **kw,
            )
            at = text.index(_MEM)
            if text[:at] != self.header:  # the injected header's KV would not be this prompt's
                raise ValueError("this model's chat template renders tools before the system message")
            return tokenizer(text[at + len(_MEM) :], add_special_tokens=False)["input_ids"]
        past = "".join(f"\n{m['role'].capitalize()}: {m['content']}" for m in turns[:-1])
        text = system.strip() + past + self.query_prefix + turns[-1]["content"] + self.query_suffix
        if not memory:
            return ([self.bos_token_id] if self.bos_token_id is not None else []) + tokenizer(
                text.lstrip("\n"), add_special_tokens=False
            )["input_ids"]
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def conversation_parts(
        self, tokenizer, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[str, list[int], list[int]]:
        """``conversation_ids`` (with memory) split where the template's system message ends: (the block's text,
        its ids [b], the rest's ids), block + rest being exactly ``conversation_ids``. The block is what the
        template renders after the memory inside the system message: the request's system text, then the tools
        section (Qwen2.5: ``# Tools ... <tools>...</tools> ...<|im_end|>\n``). It is the same text for every
        chat of an agent that sends the same system message and tools, so its KV can be encoded once, behind the
        header, and injected after the facts (``engines.base.ToolsBlock``). ("", [], all ids) without tools, on
        a completion-style format, or where the template's system part is not a token-exact prefix of the
        conversation. Raises what ``conversation_ids`` raises."""
        ids = self.conversation_ids(tokenizer, messages, tools=tools)
        if not tools or not self.chat:
            return "", [], ids
        system = "".join("\n\n" + m["content"] for m in messages if m["role"] == "system")
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": HEADER_TEXT + _MEM + system}],
                tools=tools,
                tokenize=False,
                add_generation_prompt=False,
            )
        except Exception:  # a template that needs a user turn: no block, the tools are prefilled
            return "", [], ids
        if not text.startswith(self.header + _MEM):
            return "", [], ids
        block_text = text[len(self.header) + len(_MEM) :]
        block = tokenizer(block_text, add_special_tokens=False)["input_ids"]
        if not block or ids[: len(block)] != block:  # the split would change the prompt's tokens
            return "", [], ids
        return block_text, block, ids[len(block) :]


_PROBE_TOOL = "kvmem_probe_tool_7f3a"


def _renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders OpenAI ``tools`` (a probe tool's name shows in the text)."""
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "", "parameters": {}}}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=[tool], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that fails on tools has none
        return False
    return _PROBE_TOOL in text


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str = "text") -> str:
    """All text is untrusted: a lone UTF-16 surrogate (half an emoji, valid JSON as "\\ud83d") cannot be encoded
    or tokenized; a NUL cannot be stored in PostgreSQL text. Raises ValueError naming where it is; returns ``text``
    unchanged otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, not {type(text).__name__}")
    if "\x00" in text:
        raise ValueError(f"{what} holds a NUL character (U+0000) at character {text.index(chr(0))}")
    m = _SURROGATE.search(text)
    if m:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate U+{ord(m.group()):04X} at character {m.start()}"
        )
    return text


def replace_invalid(text: str) -> str:
    """Lone surrogates -> U+FFFD (the documented replacement for data files such as LoCoMo JSON)."""
    return _SURROGATE.sub("\ufffd", text)


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(check_text(text), add_special_tokens=False)["input_ids"]


@dataclass
class ComposedMemory:
    """A composed memory block ready to inject.

    token_ids: [m] header + facts; fact_ids in injected order; start: first virtual position;
    keys: [L, H, m, D] rotated to positions start..start+m-1 (pre-RoPE where ``rotated`` is False);
    values: [L, H, m, D] raw.
    """

    token_ids: list[int]
    fact_ids: list[str]
    start: int
    keys: torch.Tensor
    values: torch.Tensor
    rotated: bool = True

    @property
    def positions(self) -> torch.Tensor:
        """[m] int64: the virtual position of each token."""
        return torch.arange(self.start, self.start + len(self.token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """First position after the memory: where the query starts."""
        return self.start + len(self.token_ids)


def compose(
    rotary: Rotary,
    header_ids: list[int],
    header_kv: tuple[torch.Tensor, torch.Tensor],
    user_kv,
    rows: list[int],
    start: int = 0,
    device: torch.device | str = "cpu",
    served_len: int | None = None,
    timings: dict | None = None,
    rotate: bool = True,
    empty=None,
    spans: list | None = None,
    suffix: tuple[list[int], torch.Tensor, torch.Tensor] | None = None,
) -> ComposedMemory:
    """Compose ``[header][facts rows...]`` (rows in injected order), then ``suffix``, with chunked RoPE.

    Args:
        rotary: the model's rotary (``Rotary.for_model(model)`` or ``Rotary.from_config(config)``).
        header_kv: header pre-RoPE keys, raw values, [L, H, h, D].
        user_kv: ``store.UserKV`` (one version of a user's facts; ``gather`` reads their pre-RoPE keys / raw values).
        rows: fact rows of ``user_kv.facts``, in injected order (see ``retrieve.order_reverse_proximity``).
        start: virtual position of the first header token (0 in serving; d > 0 in the relocation check).
        device: where the composed tensors go (the engine's device); gathering happens on the store's side.
        served_len: memory + query tokens, for length-dependent RoPE (``dynamic``, ``longrope``); see rope.py.
        timings: gets the stages in ms: ``read`` and ``dequantize`` (``UserKV.gather``), ``rotate`` (the
            header and every fact, one call per layer stack).
        rotate: False leaves the keys pre-RoPE (``ComposedMemory.rotated``): the caller rotates them layer by layer
            where they are injected (``rotary.rotate`` with ``cos_sin`` at ``ComposedMemory.positions``).
        empty: where the gathered keys and values go (``kvformat.assemble``; default new tensors).
        spans: ``user_kv.read(rows)``, when the facts were read already (elsewhere, on another thread).
        suffix: (token ids [b], pre-RoPE keys, raw values [L, H, b, D] in the stored dtype) put after the facts
            in the same copy and rotated with them (a chat's tools block, ``engines.base.ToolsBlock``).
    Returns:
        ComposedMemory on ``device``, in the stored dtype.
    """
    facts = [user_kv.facts[r] for r in rows]
    extra, bufs, into = (len(suffix[0]) if suffix is not None else 0), {}, empty
    if extra:  # gather writes into the front of buffers long enough for the suffix too
        new = empty or (lambda _name, shape, dtype: torch.empty(shape, dtype=dtype))

        def into(name, shape, dtype):
            bufs[name] = new(name, (*shape[:2], shape[2] + extra, shape[3]), dtype)
            return bufs[name][:, :, : shape[2]]

    keys, values = user_kv.gather(rows, timings, prefix=header_kv, empty=into, spans=spans)  # one copy
    if extra:
        m = keys.shape[2]
        if not bufs:  # gather handed back its input (the header alone): copy it here
            into("keys", keys.shape, keys.dtype)[:] = keys
            into("values", values.shape, values.dtype)[:] = values
        keys, values = bufs["keys"], bufs["values"]
        keys[:, :, m:], values[:, :, m:] = suffix[1], suffix[2]
    t0 = time.perf_counter()
    keys, values = keys.to(device), values.to(device)
    token_ids = list(header_ids) + [t for f in facts for t in f.token_ids] + list(suffix[0] if extra else ())
    fact_ids = [f.fact_id for f in facts]
    if not rotate:
        return ComposedMemory(token_ids, fact_ids, start, keys, values, rotated=False)
    positions = torch.arange(start, start + len(token_ids))
    rotated = rotary.rotate_keys(keys, positions, served_len)
    if timings is not None:
        timings["rotate"] = (time.perf_counter() - t0) * 1e3
    return ComposedMemory(token_ids, fact_ids, start, rotated, values)


def compose_raw(
    rotary: Rotary,
    token_ids: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int = 0,
    fact_ids: list[str] | None = None,
    served_len: int | None = None,
) -> ComposedMemory:
    """Compose already-concatenated pre-RoPE keys [L, H, m, D] at positions start..start+m-1 (tests, checks)."""
    positions = torch.arange(start, start + len(token_ids))
    return ComposedMemory(
        list(token_ids), fact_ids or [], start, rotary.rotate_keys(keys, positions, served_len), values
    )


def max_facts_that_fit(header_len: int, fact_lens: list[int], query_len: int, context_len: int) -> int:
    """Paper Corollary 7 (context budget): the largest k with header + sum of the k most relevant facts + query
    <= context_len. ``fact_lens`` is in relevance order, best first."""
    used, k = header_len + query_len, 0
    for n in fact_lens:
        if used + n > context_len:
            break
        used += n
        k += 1
    return k
