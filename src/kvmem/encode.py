"""Offline encoding: the answer model's pre-RoPE keys and raw values for chosen token spans.

Paper §3.1-3.2, §5.2 (context-window encoding): each fact is encoded once, behind the fixed instruction header
and the ``window`` conversation turns before its source turn; only the fact tokens' K/V are kept. Keys are
tapped with forward hooks at the family's pre-RoPE point (``models.kv_taps``): after any k-norm, before rotation,
so they are exactly what the model would rotate. Values are the raw ``v_proj`` output.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .models import head_dim, kv_taps, split_latent
from .rope import is_length_dependent, reset_rope_state, served_length


@dataclass
class SpanKV:
    """Pre-RoPE keys and raw values of one token span: both [L, H, num_tokens, D] (``models.kv_shape``: num_kv_heads
    x head_dim, or for latent attention one head of the latent row's halves)."""

    keys: torch.Tensor
    values: torch.Tensor


def _layers(model):
    return getattr(model, "model", model).layers


def _to_bhtd(x: torch.Tensor, layout: str, num_kv_heads: int, dim: int, q_size: int = 0) -> torch.Tensor:
    kv_size = num_kv_heads * dim
    if layout == "qkv_k":  # fused [q | k | v] projection (Phi-3)
        return _to_bhtd(x[..., q_size : q_size + kv_size], "flat", num_kv_heads, dim)
    if layout == "qkv_v":
        return _to_bhtd(x[..., q_size + kv_size :], "flat", num_kv_heads, dim)
    if layout == "flat":
        return x.view(x.shape[0], x.shape[1], num_kv_heads, dim).transpose(1, 2)
    if layout == "bthd":
        return x.transpose(1, 2)
    return x  # "bhtd"


@contextmanager
def capture_kv(model):
    """Hook every attention layer; yields ``(keys, values)`` lists filled on each forward with
    per-layer [B, H, T, D] pre-RoPE keys and raw values (``models.kv_shape``: H = num_kv_heads, D = head_dim; for
    latent attention H = 1 and the latent row [pre-RoPE k_pe | c_kv] split in halves, ``models.split_latent``)."""
    cfg = model.config
    taps = kv_taps(cfg)
    h, d = cfg.num_key_value_heads, head_dim(cfg)
    q_size = cfg.num_attention_heads * d
    keys: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
    values: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
    handles = []
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn

        def k_hook(_m, _inp, out, i=i):
            if taps.key_layout == "mla_k_pe":  # [B, T, c + r]: k_pe is the tail; joined with c_kv in v_hook
                keys[i] = out[..., cfg.kv_lora_rank :].unsqueeze(1)
                return
            keys[i] = _to_bhtd(out, taps.key_layout, h, d, q_size)

        def v_hook(_m, _inp, out, i=i):
            if taps.value_layout == "mla_c_kv":  # [B, T, c], after k_hook of this layer: both in stored form
                keys[i], values[i] = split_latent(keys[i], out.unsqueeze(1))
                return
            values[i] = _to_bhtd(out, taps.value_layout, h, d, q_size)

        handles.append(getattr(attn, taps.key_module).register_forward_hook(k_hook))
        handles.append(getattr(attn, taps.value_module).register_forward_hook(v_hook))
    try:
        yield keys, values
    finally:
        for hd in handles:
            hd.remove()


def length_batches(sequences: list[list[int]], max_batch_tokens: int, equal_lengths_only: bool = False):
    """Yield ``(items, ids)``: sequences sorted by length, grouped so that batch x longest <= max_batch_tokens
    (a longer single sequence goes alone), right-padded into ids [B, longest] int64 (pad 0)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    i = 0
    while i < len(order):
        longest = len(sequences[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * max(longest, len(sequences[order[j]])) <= max(max_batch_tokens, longest):
            if equal_lengths_only and len(sequences[order[j]]) != longest:
                break
            longest = max(longest, len(sequences[order[j]]))
            j += 1
        batch = order[i:j]
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        for r, item in enumerate(batch):
            ids[r, : len(sequences[item])] = torch.tensor(sequences[item])
        yield batch, ids
        i = j


@torch.inference_mode()
def encode_spans(
    model,
    sequences: list[list[int]],
    spans: list[tuple[int, int]],
    max_batch_tokens: int = 2048,
    progress=None,
    served_len: int | None = None,
) -> list[SpanKV]:
    """Run the model over each sequence and keep the K/V of ``sequence[start:end]``.

    Sequences are sorted by length and batched with right padding and no attention mask: under causal
    attention a real token never sees the pads after it, so each kept span is what an unbatched prefill
    computes (positions start at 0 in every row). Length-dependent RoPE (``dynamic``, ``longrope``) would take
    its frequencies from the padded length, so there only sequences of equal length share a batch.

    Args:
        sequences: token ids, one list per item.
        spans: (start, end) token offsets of the span to keep, per item.
        max_batch_tokens: padded tokens per forward pass (batch x longest sequence).
        progress: optional callable(n_tokens_done), called after every decoder layer of every batch with that
            layer's share of the batch's real tokens, so a bar advances within a long batch (and sums to the
            total number of tokens).
        served_len: encode under the RoPE frequencies of a served prompt of this many tokens (length-dependent
            RoPE types only; see ``rope.served_length``).
    Returns:
        One SpanKV per item, in input order, keys/values [L, num_kv_heads, end-start, head_dim] in the model dtype.
    """
    if len(sequences) != len(spans):
        raise ValueError("sequences and spans differ in length")
    device = next(model.parameters()).device
    base = getattr(model, "model", model)
    rotary = base.rotary_emb
    equal_lengths_only = served_len is None and is_length_dependent(rotary)
    out: list[SpanKV | None] = [None] * len(sequences)
    layers = _layers(model)
    in_flight = [0]  # real tokens of the batch being run, for the per-layer progress ticks

    def tick(i: int):
        def hook(_module, _inputs, _output) -> None:  # returns None: a forward hook's value would replace the output
            progress(in_flight[0] * (i + 1) // len(layers) - in_flight[0] * i // len(layers))

        return hook

    hooks = [layer.register_forward_hook(tick(i)) for i, layer in enumerate(layers)] if progress else []
    with capture_kv(model) as (keys, values), served_length(model, served_len):
        try:
            for batch, ids in length_batches(sequences, max_batch_tokens, equal_lengths_only):
                in_flight[0] = sum(len(sequences[item]) for item in batch)
                if served_len is None:
                    reset_rope_state(rotary)
                base(input_ids=ids.to(device), use_cache=False)
                for r, item in enumerate(batch):
                    s, e = spans[item]
                    out[item] = SpanKV(
                        torch.stack([k[r, :, s:e] for k in keys]).contiguous(),
                        torch.stack([v[r, :, s:e] for v in values]).contiguous(),
                    )
        finally:
            for h in hooks:
                h.remove()
    return out  # type: ignore[return-value]


@torch.inference_mode()
def encode_chain(
    model, prefix: list[int], facts: list[list[int]], contexts: list[list[int]] | None = None, progress=None
) -> list[SpanKV]:
    """History encoding: fact i's K/V as a prefill of ``prefix + facts[0] + ... + facts[i-1] + contexts[i] +
    facts[i]`` computes them, so each fact's values mix in every fact written before it, as in a prompt that
    lists them all.

    Without contexts this is one forward over ``prefix + facts`` (each fact is encoded once). With contexts
    (the fact's window of turns) the chain ``prefix + facts[:-1]`` is prefilled once with a KV cache, and each
    ``contexts[i] + facts[i]`` is then prefilled on that cache cut at fact i, so the chain is never run twice.

    Args:
        prefix: token ids before the first fact (the header, then earlier facts' ids).
        facts: token ids per fact, in the order they were written.
        contexts: token ids between the chain and each fact (its window of turns), or None.
        progress: optional callable(n_tokens_done).
    Returns:
        One SpanKV per fact, keys/values [L, num_kv_heads, len(facts[i]), head_dim] in the model dtype.
    Raises:
        ValueError: a length-dependent RoPE (dynamic, longrope: the chain's frequencies differ from those of
            each fact's own prefill), contexts with sliding-window layers (their cache keeps only the chain's
            last window of tokens), or an empty fact.
    """
    from transformers import DynamicCache

    if not facts:
        return []
    contexts = contexts or [[] for _ in facts]
    if len(contexts) != len(facts):
        raise ValueError("facts and contexts differ in length")
    if not all(facts):
        raise ValueError("a fact has no tokens")
    base = getattr(model, "model", model)
    if is_length_dependent(base.rotary_emb):  # one chain's frequencies would differ from each fact's own prefill
        raise ValueError("history encoding needs a fixed-frequency RoPE (not dynamic or longrope)")
    cfg = model.config
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or (
        getattr(cfg, "layer_types", None) is None
        and getattr(cfg, "sliding_window", None)
        and getattr(cfg, "use_sliding_window", True)
    )
    seq, bounds = list(prefix), []
    for ids in facts:
        bounds.append((len(seq), len(seq) + len(ids)))
        seq += ids
    if not any(contexts):
        (kv,) = encode_spans(model, [seq], [(len(prefix), len(seq))], max_batch_tokens=len(seq), progress=progress)
        return [
            SpanKV(
                kv.keys[:, :, s - len(prefix) : e - len(prefix)].contiguous(),
                kv.values[:, :, s - len(prefix) : e - len(prefix)].contiguous(),
            )
            for s, e in bounds
        ]
    if sliding:  # a sliding layer's cache keeps only the chain's last window of tokens
        raise ValueError(
            "history encoding with a window of turns needs a model without sliding-window layers; use window=0"
        )
    device = next(model.parameters()).device
    reset_rope_state(base.rotary_emb)
    chain = base(input_ids=torch.tensor([seq[: bounds[-1][0]]], device=device), use_cache=True).past_key_values
    if progress:
        progress(bounds[-1][0])
    out = []
    with capture_kv(model) as (keys, values):
        for (start, _), ctx, ids in zip(bounds, contexts, facts, strict=True):
            cache = DynamicCache(config=model.config)
            for i, layer in enumerate(chain.layers):  # a view of the chain up to this fact; update() copies on append
                cache.update(layer.keys[:, :, :start], layer.values[:, :, :start], i)
            base(input_ids=torch.tensor([list(ctx) + list(ids)], device=device), past_key_values=cache, use_cache=True)
            n = len(ids)
            out.append(
                SpanKV(
                    torch.stack([k[0, :, -n:] for k in keys]).contiguous(),
                    torch.stack([v[0, :, -n:] for v in values]).contiguous(),
                )
            )
            if progress:
                progress(len(ctx) + n)
    return out
