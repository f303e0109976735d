"""Tools blocks as injected KV: an agent's system text and tool definitions, encoded once, injected per chat.

An agent sends the same tools (often thousands of tokens) with every request, and the chat template renders them
after the memory, inside the system message (``compose.PromptFormat.conversation_parts``). The memory changes with
every question, so no prefix cache can hold the tools; prefilling them costs more than the question. Instead the
block is encoded like a fact: one forward over ``[header][block]`` keeps the block's pre-RoPE keys and raw values
(``encode.encode_spans``), and every chat that sends the same block composes ``[header][facts][block]`` with
chunked RoPE (``compose.compose``'s ``suffix``) and prefills only its turns.

Exactness is that of a fact encoded behind the header: the stored KV equals a prefill of ``[header][block]``
(paper Theorem 8), relocated exactly (Theorem 6), so with no facts in between, or facts encoded jointly, kv mode
gives prompt mode's logits; with facts the block has not attended to them, as facts have not attended to each
other (the approximation of KV injection itself). The query attends to all of it.

The cache is bounded (``TOOLS_CACHE_ENTRIES`` blocks, ``TOOLS_CACHE_BYTES`` of KV, least recently used out
first; a block larger than the byte bound is encoded for its chat and not kept) and keyed by the tenant, the
model and dtype, the header's ids, the block's exact text (and the served length under length-dependent RoPE,
whose frequencies depend on it), so one tenant's chats never read KV encoded for another's.
"""

from __future__ import annotations

import torch
from cachetools import LRUCache

from ..encode import encode_spans
from ..rope import is_length_dependent
from .base import ToolsBlock

TOOLS_CACHE_ENTRIES = 32  # tools blocks kept per engine
TOOLS_CACHE_BYTES = 512 << 20  # their keys and values together (20 tools on Qwen2.5 0.5B in fp32: ~60 MiB)


class ToolsKV:
    """The tools blocks' pre-RoPE keys and raw values of one model, [L, H, b, D] each on the CPU, LRU-bounded
    by ``max_entries`` and ``max_bytes``. Not thread-safe: the engine calls it on its model thread.
    ``hits`` / ``misses`` count lookups."""

    def __init__(self, model, max_entries: int = TOOLS_CACHE_ENTRIES, max_bytes: int = TOOLS_CACHE_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the tools cache needs at least one entry and one byte")
        self.model, self.max_entries = model, max_entries
        self._lru = LRUCache(maxsize=max_bytes, getsizeof=lambda kv: kv[0].nbytes + kv[1].nbytes)
        dtype = next(model.parameters()).dtype
        self._model_key = (getattr(model.config, "_name_or_path", ""), str(dtype))
        self._length_dependent = is_length_dependent(getattr(model, "model", model).rotary_emb)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return int(self._lru.currsize)

    def kv(self, block: ToolsBlock, header_ids: list[int], served_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's pre-RoPE keys and raw values [L, H, b, D] as encoded behind ``header_ids`` at positions
        h..h+b-1, from the cache or encoded now (one forward over header + block). ``served_len``: tokens of
        the served prompt (length-dependent RoPE only)."""
        served = served_len if self._length_dependent else None
        key = (block.owner, self._model_key, tuple(header_ids), block.text, served)
        hit = self._lru.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        h, ids = len(header_ids), list(header_ids) + list(block.token_ids)
        (span,) = encode_spans(self.model, [ids], [(h, len(ids))], served_len=served)
        kv = (span.keys.cpu(), span.values.cpu())
        try:
            self._lru[key] = kv
        except ValueError:  # larger than the whole bound: serves this chat, is not kept
            return kv
        while len(self._lru) > self.max_entries:
            self._lru.popitem()
        return kv
