"""Chunked RoPE: rotate stored pre-RoPE keys to arbitrary virtual positions with the model's own rotary.

Paper §3.2 (Theorem 6): RoPE is a rotation applied after the key projection (and any k-norm), so a key can be
stored un-rotated and rotated later to any position; attention scores depend only on relative position.
We never re-implement RoPE: cos/sin come from the model's own rotary module (``model.model.rotary_emb``, per
layer type where the family has several, with its ``attention_scaling`` folded in), and the rotation is the
modeling file's own ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import inspect
import sys

import torch


def _base(model):
    return getattr(model, "model", model)


def layer_types(model) -> list[str | None]:
    """Per-layer attention type (e.g. Gemma 3 "sliding_attention"/"full_attention"); None where uniform."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else [None] * cfg.num_hidden_layers


def _rotary_takes_layer_type(rotary) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters


def cos_sin(model, positions: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for ``positions`` ([T] int64) from the model's own rotary module.

    Returns two tensors [T, rotary_dim] in the model's dtype, on the model's device.
    """
    base = _base(model)
    rotary = base.rotary_emb
    p = next(model.parameters())
    x = torch.empty(0, dtype=p.dtype, device=p.device)
    pos = positions.to(p.device).view(1, -1)
    if _rotary_takes_layer_type(rotary):
        cos, sin = rotary(x, pos, layer_type or layer_types(model)[0])
    else:
        cos, sin = rotary(x, pos)
    return cos[0], sin[0]


def _apply_fn(model):
    return sys.modules[type(_base(model)).__module__].apply_rotary_pos_emb


def rotate_keys(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pre-RoPE keys to ``positions``.

    Args:
        keys: [L, H, T, D] pre-RoPE keys for all layers (model dtype).
        positions: [T] int64 virtual positions.
    Returns:
        [L, H, T, D] rotated keys, as the model's attention would cache them at those positions.
    """
    apply = _apply_fn(model)
    types = layer_types(model)
    out = torch.empty_like(keys)
    by_type: dict[str | None, list[int]] = {}
    for i, t in enumerate(types):
        by_type.setdefault(t, []).append(i)
    for t, idx in by_type.items():
        cos, sin = cos_sin(model, positions, t)
        sel = keys[idx] if len(idx) < len(types) else keys
        # apply_rotary_pos_emb broadcasts cos/sin [1, T, D] over [layers-as-batch, H, T, D].
        _, rotated = apply(sel, sel, cos[None], sin[None])
        out[idx] = rotated
    return out
