"""Chunked RoPE: rotate stored pre-RoPE keys to arbitrary virtual positions with the model's own rotary.

Paper §3.2 (Theorem 6): RoPE is a rotation applied after the key projection (and any k-norm), so a key can be
stored un-rotated and rotated later to any position; attention scores depend only on relative position.
We never re-implement RoPE: cos/sin come from the family's own rotary module (``model.model.rotary_emb``, per
layer type where the family has several, with its ``attention_scaling`` folded in), and the rotation is the
modeling file's own ``apply_rotary_pos_emb``. ``Rotary.from_config`` builds the same module without weights,
for processes that hold no transformers model (the vLLM worker).
"""

from __future__ import annotations

import importlib
import inspect
import sys

import torch


class Rotary:
    """The model family's rotary embedding and rotation function, per attention layer type."""

    def __init__(self, config, rotary_module: torch.nn.Module, apply_fn):
        self.config = config
        self.module = rotary_module
        self.apply = apply_fn
        types = getattr(config, "layer_types", None)
        self.layer_types: list[str | None] = list(types) if types else [None] * config.num_hidden_layers
        self._takes_layer_type = "layer_type" in inspect.signature(rotary_module.forward).parameters

    @classmethod
    def for_model(cls, model) -> "Rotary":
        """From a loaded transformers causal LM (``model.model.rotary_emb``)."""
        base = getattr(model, "model", model)
        return cls(model.config, base.rotary_emb, sys.modules[type(base).__module__].apply_rotary_pos_emb)

    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> "Rotary":
        """Instantiate the family's rotary module from a config alone (no weights)."""
        family = config.model_type.removesuffix("_text")
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        names = [n for n in dir(mod) if n.endswith("RotaryEmbedding")]
        if len(names) != 1:
            raise ValueError(f"expected one rotary embedding class for {config.model_type!r}, found {names}")
        return cls(config, getattr(mod, names[0])(config).to(device), mod.apply_rotary_pos_emb)

    def cos_sin(self, positions: torch.Tensor, layer_type: str | None, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] for ``positions`` ([T] int64), in ``dtype`` on ``device``."""
        x = torch.empty(0, dtype=dtype, device=device)
        pos = positions.to(device).view(1, -1)
        if self._takes_layer_type:
            cos, sin = self.module(x, pos, layer_type or self.layer_types[0])
        else:
            cos, sin = self.module(x, pos)
        return cos[0], sin[0]

    def rotate_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate pre-RoPE keys to ``positions``.

        Args:
            keys: [L, H, T, D] pre-RoPE keys for all layers.
            positions: [T] int64 virtual positions.
        Returns:
            [L, H, T, D] keys (same dtype/device) as the model's attention would cache them at those positions.
        """
        by_type: dict[str | None, list[int]] = {}
        for i, t in enumerate(self.layer_types):
            by_type.setdefault(t, []).append(i)
        if len(by_type) == 1:
            cos, sin = self.cos_sin(positions, self.layer_types[0], keys.dtype, keys.device)
            return self.apply(keys, keys, cos[None], sin[None])[1]
        out = torch.empty_like(keys)
        for t, idx in by_type.items():
            cos, sin = self.cos_sin(positions, t, keys.dtype, keys.device)
            sel = keys[idx]
            # apply_rotary_pos_emb broadcasts cos/sin [1, T, D] over [layers-as-batch, H, T, D].
            out[idx] = self.apply(sel, sel, cos[None], sin[None])[1]
        return out

