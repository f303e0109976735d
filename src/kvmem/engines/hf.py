"""The transformers engine: inject composed KV into a ``DynamicCache``, prefill only the query, decode greedily.

Paper §3.3 / Theorem 3: under causal attention, injecting the KV computed for a token sequence is exactly
equivalent to prefilling that sequence, so the query positions see the same logits. ``prompt`` mode (the
Mem0-style baseline) prefills the whole identical token sequence instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..compose import ComposedMemory
from ..rope import reset_rope_state


@dataclass
class Generation:
    """token_ids: generated ids (greedy); ttft_ms: model call start -> first token's logits;
    prefilled_tokens: tokens the engine ran a forward pass over before the first token;
    first_logits: [vocab] float32 logits at the last prompt position."""

    token_ids: list[int]
    ttft_ms: float
    decode_ms: float
    prefilled_tokens: int
    first_logits: torch.Tensor
    step_logits: list[torch.Tensor] = field(default_factory=list)


def build_cache(model, memory: ComposedMemory) -> DynamicCache:
    """A transformers cache holding the composed memory's rotated keys and values, [1, H, m, D] per layer.

    Sliding-window layers (Gemma 3) keep their last ``window - 1`` positions, exactly as after a prefill.
    """
    cache = DynamicCache(config=model.config)
    for layer in range(memory.keys.shape[0]):
        cache.update(memory.keys[layer][None], memory.values[layer][None], layer)
    return cache


class HFEngine:
    """Greedy generation with optional injected memory. Picks nothing itself: runs on the model's device."""

    def __init__(self, model, eos_token_ids: list[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        eos = eos_token_ids if eos_token_ids is not None else model.generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def generate(self, query_ids: list[int], memory: ComposedMemory | None = None, mode: str = "kv",
                 max_new_tokens: int = 32, keep_step_logits: bool = False) -> Generation:
        """Answer ``query_ids`` after ``memory``.

        mode "kv": inject ``memory`` (already rotated) and prefill only ``query_ids`` at positions memory.end...
        mode "prompt": prefill ``memory.token_ids + query_ids`` at positions memory.start...
        Without memory both modes prefill the bare query at position 0.
        Raises ValueError for an unknown mode or an empty query.
        """
        if mode not in ("kv", "prompt"):
            raise ValueError(f"mode must be 'kv' or 'prompt', not {mode!r}")
        if not query_ids:
            raise ValueError("empty query")
        start = memory.start if memory is not None else 0
        if memory is None or mode == "prompt":
            # KV mode keeps the state the composition set (frequencies for the served length).
            reset_rope_state(getattr(self.model, "model", self.model).rotary_emb)
        if memory is not None and mode == "kv":
            cache, ids, pos0 = build_cache(self.model, memory), list(query_ids), memory.end
        else:
            cache = DynamicCache(config=self.model.config)
            ids = (memory.token_ids if memory is not None else []) + list(query_ids)
            pos0 = start
        self._sync()
        t0 = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         position_ids=torch.arange(pos0, pos0 + len(ids), device=self.device)[None])
        logits = out.logits[0, -1].float()
        self._sync()
        ttft_ms = (time.perf_counter() - t0) * 1e3
        first_logits = logits
        steps = [logits] if keep_step_logits else []
        tokens: list[int] = []
        pos = pos0 + len(ids)
        t1 = time.perf_counter()
        while True:
            nxt = int(logits.argmax())
            tokens.append(nxt)
            if nxt in self.eos or len(tokens) >= max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[nxt]], device=self.device), past_key_values=cache,
                             use_cache=True, position_ids=torch.tensor([[pos]], device=self.device))
            logits = out.logits[0, -1].float()
            if keep_step_logits:
                steps.append(logits)
            pos += 1
        self._sync()
        return Generation(tokens, ttft_ms, (time.perf_counter() - t1) * 1e3, len(ids), first_logits, steps)
