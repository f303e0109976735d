"""Chunked RoPE: rotate stored pre-RoPE keys to arbitrary virtual positions with the model's own rotary.

Paper §3.2 (Theorem 6): RoPE is a rotation applied after the key projection (and any k-norm), so a key can be
stored un-rotated and rotated later to any position; attention scores depend only on relative position.
We never re-implement RoPE: cos/sin come from the family's own rotary module (``model.model.rotary_emb``, per
layer type where the family has several, with its ``attention_scaling`` folded in), and the rotation is the
modeling file's own ``apply_rotary_pos_emb``. ``Rotary.from_config`` builds the same module without weights,
for processes that hold no transformers model (the vLLM worker).

Latent attention (DeepSeek V2 / V3) rotates only its decoupled key ``k_pe``, the first ``qk_rope_head_dim``
channels of the stored keys (``models.split_latent``), with the modeling file's own rotation: V3's
``apply_rotary_pos_emb_interleave`` where the config sets ``rope_interleave`` (its output is de-interleaved, as the
model caches it), V2's complex ``apply_rotary_emb`` (its rotary module yields complex frequencies, kept here as
their real and imaginary parts, which rebuild them exactly).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from contextlib import contextmanager

import torch


class Rotary:
    """The model family's rotary embedding and rotation function, per attention layer type."""

    def __init__(self, config, rotary_module: torch.nn.Module, apply_fn):
        self.config = config
        self.module = rotary_module
        self.apply = apply_fn
        # latent attention: only the keys' first channels (k_pe) rotate, the rest (c_kv) is position-free
        latent = getattr(config, "kv_lora_rank", None) is not None  # the configs of models.LATENT
        self.rope_dim: int | None = config.qk_rope_head_dim if latent else None
        types = getattr(config, "layer_types", None)
        self.layer_types: list[str | None] = list(types) if types else [None] * config.num_hidden_layers
        self._takes_layer_type = "layer_type" in inspect.signature(rotary_module.forward).parameters
        self._lock = threading.Lock()  # cos_sin resets and runs the module: loader threads share it
        self._halves_ok: dict = {}  # (layer type, dtype, device) -> the family's rotation is the half-split form

    @classmethod
    def for_model(cls, model) -> Rotary:
        """From a loaded transformers causal LM (``model.model.rotary_emb``)."""
        base = getattr(model, "model", model)
        return cls(model.config, base.rotary_emb, _rotation(sys.modules[type(base).__module__], model.config))

    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> Rotary:
        """Instantiate the family's rotary module from a config alone (no weights)."""
        family = config.model_type.removesuffix("_text")
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        names = [n for n in dir(mod) if n.endswith("RotaryEmbedding")]
        if len(names) != 1:
            raise ValueError(f"expected one rotary embedding class for {config.model_type!r}, found {names}")
        return cls(config, getattr(mod, names[0])(config).to(device), _rotation(mod, config))

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
        with self._lock:
            if served_len is not None:
                reset_rope_state(self.module)
                pos = torch.cat([pos, torch.tensor([served_len - 1], device=device)])
            pos = pos.view(1, -1)
            if self._takes_layer_type:
                out = self.module(x, pos, layer_type or self.layer_types[0])
            else:
                out = self.module(x, pos)
        if torch.is_tensor(out) and out.is_complex():  # DeepSeek V2: complex frequencies [1, T, rotary_dim / 2]
            out = (out.real.contiguous(), out.imag.contiguous())
        cos, sin = out
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
            return self.rotate(keys, cos, sin, self.layer_types[0])
        out = torch.empty_like(keys)
        for t, idx in by_type.items():
            cos, sin = self.cos_sin(positions, t, keys.dtype, keys.device, served_len)
            out[idx] = self.rotate(keys[idx], cos, sin, t)
        return out

    def rotate(
        self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_type: str | None = None, out=None
    ) -> torch.Tensor:
        """Rotate pre-RoPE ``keys`` [B, H, T, D] (B: layers of ``layer_type``) by ``cos``, ``sin`` [T, rotary_dim]
        (``cos_sin``); into ``out`` (any strides, the shape of ``keys``) when given.

        Where the family's ``apply_rotary_pos_emb`` is the half-split form ``x * cos + rotate_half(x) * sin`` (checked
        once per layer type, dtype and device against that function itself, on these cos/sin), the rotation is
        four fused multiply-adds over the two halves, with no temporaries: rotation is memory-bound, and at k=50 it
        touches tens of MB. Otherwise (interleaved pairs, partial rotary, anything else) it is the family's function.
        Latent attention: the first ``rope_dim`` channels (``k_pe``) rotate so, the rest is copied as it is."""
        r = self.rope_dim
        if r is not None and r < keys.shape[-1]:
            out = torch.empty_like(keys) if out is None else out
            out[..., r:] = keys[..., r:]
            # contiguous: V2's complex rotation views channel pairs, which needs even strides
            self._rotate(keys[..., :r].contiguous(), cos, sin, layer_type, out[..., :r])
            return out
        return self._rotate(keys, cos, sin, layer_type, out)

    def _rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_type, out) -> torch.Tensor:
        if self._half_split(keys, cos, sin, layer_type):
            d = keys.shape[-1] // 2
            c, s = cos[:, :d], sin[:, :d]
            x1, x2 = keys[..., :d], keys[..., d:]
            out = torch.empty_like(keys) if out is None else out
            o1, o2 = out[..., :d], out[..., d:]
            torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1)
            torch.mul(x2, c, out=o2).addcmul_(x1, s)
            return out
        # the family's function broadcasts cos/sin [1, T, D] over [B, H, T, D] and rotates q and k alike, each on
        # its own: one layer stands in for q, so only the keys pay
        rotated = self.apply(keys[:1], keys, cos[None], sin[None])[1]
        if out is None:
            return rotated
        out.copy_(rotated)
        return out

    def rotate_layers(
        self, keys: torch.Tensor, first: int, cos_sin: dict, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate layers ``first .. first + c - 1``'s pre-RoPE ``keys`` [c, H, T, D], each by its layer type's
        ``cos_sin[type]`` (``cos_sin`` per type at the same positions); into ``out`` when given. One call where the
        chunk's layers share a type."""
        types = self.layer_types[first : first + keys.shape[0]]
        out = torch.empty_like(keys) if out is None else out
        if len(set(types)) == 1:
            return self.rotate(keys, *cos_sin[types[0]], types[0], out=out)
        for i, t in enumerate(types):
            self.rotate(keys[i : i + 1], *cos_sin[t], t, out=out[i : i + 1])
        return out

    def _half_split(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_type) -> bool:
        """Whether the family's rotation is ``x * cos + rotate_half(x) * sin`` with equal cos/sin halves, for this
        layer type, dtype and device: decided once, on random keys at positions 1..16 of the family's own module
        (position 0 alone would pass any form), never per call (on a GPU a check would sync the host)."""
        D = keys.shape[-1]
        if cos.shape[-1] != D or D % 2:
            return False
        key = (layer_type, keys.dtype, str(keys.device))
        if key not in self._halves_ok:
            d = D // 2
            c, s = self.cos_sin(torch.arange(1, 17), layer_type, keys.dtype, keys.device)
            g = torch.Generator().manual_seed(0)
            x = torch.randn((1, 2, 16, D), generator=g).to(dtype=keys.dtype, device=keys.device)
            ref = self.apply(x, x, c[None], s[None])[1].float()
            x1, x2, cf, sf = x[..., :d].float(), x[..., d:].float(), c[:, :d].float(), s[:, :d].float()
            mine = torch.cat([x1 * cf - x2 * sf, x2 * cf + x1 * sf], -1)
            tol = 8 * torch.finfo(keys.dtype).eps * ref.abs().max().clamp_min(1)
            halves = torch.equal(c[:, :d], c[:, d:]) and torch.equal(s[:, :d], s[:, d:])
            self._halves_ok[key] = bool(halves and (mine - ref).abs().max() <= tol)
        return self._halves_ok[key]


def _rotation(mod, config):
    """The modeling module ``mod``'s own rotation for ``config``, as ``f(q, k, cos, sin) -> (q, k)``."""
    if getattr(config, "rope_interleave", False) and hasattr(mod, "apply_rotary_pos_emb_interleave"):
        return mod.apply_rotary_pos_emb_interleave  # DeepSeek V3's interleaved pairs
    if not hasattr(mod, "apply_rotary_pos_emb") and hasattr(mod, "apply_rotary_emb"):  # DeepSeek V2: complex
        complex_rotation = mod.apply_rotary_emb

        def apply(q, k, cos, sin):
            return complex_rotation(q, k, torch.complex(cos, sin))

        return apply
    return mod.apply_rotary_pos_emb


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
        if torch.is_tensor(output):  # DeepSeek V2: one complex tensor of frequencies
            return output[..., :n, :]
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
