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
from contextlib import contextmanager

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
    def for_model(cls, model) -> Rotary:
        """From a loaded transformers causal LM (``model.model.rotary_emb``)."""
        base = getattr(model, "model", model)
        return cls(model.config, base.rotary_emb, sys.modules[type(base).__module__].apply_rotary_pos_emb)

    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> Rotary:
        """Instantiate the family's rotary module from a config alone (no weights)."""
        family = config.model_type.removesuffix("_text")
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        names = [n for n in dir(mod) if n.endswith("RotaryEmbedding")]
        if len(names) != 1:
            raise ValueError(f"expected one rotary embedding class for {config.model_type!r}, found {names}")
        return cls(config, getattr(mod, names[0])(config).to(device), mod.apply_rotary_pos_emb)

    def cos_sin(
        self,
        positions: torch.Tensor,
        layer_type: str | None,
        dtype: torch.dtype,
        device: torch.device,
        served_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] for ``positions`` ([T] int64), in ``dtype`` on ``device``.

        Length-dependent RoPE (``dynamic``, ``longrope``) picks its frequencies from the largest position the
        module sees; ``served_len`` (tokens in the whole served prompt) makes that the prompt's last position,
        which is what a prefill of the whole prompt would use.
        """
        x = torch.empty(0, dtype=dtype, device=device)
        pos = positions.to(device).view(-1)
        n = pos.numel()
        if served_len is not None:
            reset_rope_state(self.module)
            pos = torch.cat([pos, torch.tensor([served_len - 1], device=device)])
        pos = pos.view(1, -1)
        if self._takes_layer_type:
            cos, sin = self.module(x, pos, layer_type or self.layer_types[0])
        else:
            cos, sin = self.module(x, pos)
        return cos[0, :n], sin[0, :n]

    def rotate_keys(self, keys: torch.Tensor, positions: torch.Tensor, served_len: int | None = None) -> torch.Tensor:
        """Rotate pre-RoPE keys to ``positions``.

        Args:
            keys: [L, H, T, D] pre-RoPE keys for all layers.
            positions: [T] int64 virtual positions.
            served_len: total prompt length (memory + query) for length-dependent RoPE types; see ``cos_sin``.
        Returns:
            [L, H, T, D] keys (same dtype/device) as the model's attention would cache them at those positions.
        """
        by_type: dict[str | None, list[int]] = {}
        for i, t in enumerate(self.layer_types):
            by_type.setdefault(t, []).append(i)
        if len(by_type) == 1:
            cos, sin = self.cos_sin(positions, self.layer_types[0], keys.dtype, keys.device, served_len)
            return self.apply(keys, keys, cos[None], sin[None])[1]
        out = torch.empty_like(keys)
        for t, idx in by_type.items():
            cos, sin = self.cos_sin(positions, t, keys.dtype, keys.device, served_len)
            sel = keys[idx]
            # apply_rotary_pos_emb broadcasts cos/sin [1, T, D] over [layers-as-batch, H, T, D].
            out[idx] = self.apply(sel, sel, cos[None], sin[None])[1]
        return out


@contextmanager
def served_length(model, served_len: int | None):
    """While active, the model's own forward passes pick length-dependent RoPE frequencies (``dynamic``,
    ``longrope``) for a prompt of ``served_len`` tokens, as a prefill of the whole served prompt would.

    Used to encode memory under the frequencies it will be served with; a no-op for other RoPE types. Done with
    PyTorch forward hooks on the rotary module (removed on exit): the pre-hook appends position
    ``served_len - 1`` to ``position_ids``, so the module picks the served length's frequencies, and the hook
    drops that extra column from cos/sin. The module's ``forward`` itself is never replaced."""
    if served_len is None:
        yield
        return
    rotary = getattr(model, "model", model).rotary_emb
    reset_rope_state(rotary)
    widths: list[int] = []

    def extend(_module, args, kwargs):
        pos = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        widths.append(pos.shape[-1])
        pos = torch.cat([pos, pos.new_full((*pos.shape[:-1], 1), served_len - 1)], -1)
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": pos}
        return (args[0], pos, *args[2:]), kwargs

    def trim(_module, _args, _kwargs, output):
        n = widths.pop()
        return tuple(t[..., :n, :] for t in output)

    handles = [
        rotary.register_forward_pre_hook(extend, with_kwargs=True),
        rotary.register_forward_hook(trim, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reset_rope_state(rotary: torch.nn.Module) -> None:
    """Return a length-dependent rotary module (``dynamic``) to its base frequencies.

    transformers' dynamic RoPE only grows its frequencies with the longest sequence seen since the last reset,
    so results would depend on earlier requests. Every request starts from the base state instead; within a
    request the frequencies are those of the served prompt length and grow during decode as transformers does."""
    for prefix in [""] + [f"{t}_" for t in getattr(rotary, "layer_types", [])]:
        original = getattr(rotary, f"{prefix}original_inv_freq", None)
        if original is not None and hasattr(rotary, "original_max_seq_len"):
            rotary.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
            setattr(rotary, f"{prefix}max_seq_len_cached", rotary.original_max_seq_len)


def is_length_dependent(rotary: torch.nn.Module) -> bool:
    """True for RoPE types whose frequencies depend on the sequence length (``dynamic``, ``longrope``)."""
    types = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    return any("dynamic" in t or t == "longrope" for t in types)


LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_type(cfg) -> str:
    """A config's RoPE type: a length-dependent one (``LENGTH_DEPENDENT``) if any layer type has it, else the
    first one ("default", "linear", "yarn", "llama3", ...)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    dicts = [v for v in params.values() if isinstance(v, dict)] or [params]
    types = [d.get("rope_type") or d.get("type") or "default" for d in dicts]
    return next((t for t in types if any(x in t for x in LENGTH_DEPENDENT)), types[0] if types else "default")
