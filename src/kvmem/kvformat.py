"""Stored KV formats: how a segment's pre-RoPE keys and raw values are kept on disk and in the read caches.

* ``native``: the model's compute dtype (bf16, or fp32 on CPUs without native bf16). Lossless; the default.
* ``int8``: symmetric int8 (torchao's affine quantisation, range [-127, 127]). Keys are scaled per (fact, layer,
  head, channel), as KIVI and KVQuant do for keys: pre-RoPE key channels carry outliers that per-token scales would
  spread over the whole head. Values are scaled per (layer, head, token). Scales are fp16.
* ``fp8``: float8 e4m3 (torch's ``float8_e4m3fn``) with the same scale groups, scaled to the format's 448 maximum.

Keys are quantised before RoPE, as stored, and dequantised on the read side before the rotation, so chunked RoPE
stays exact on what is stored (KVQuant §3.2: pre-RoPE keys quantise better than rotated ones). Each fact is its own
key group, so any fact is read with its scales alone, and re-quantising KV dequantised in fp32 with the same groups
gives the same integers back, q * s being exact in fp32 (``compact`` and ``copy`` rewrite quantised stores without
drift, whatever the model dtype).

Sizes per stored token and (layer, head): native bf16 ``4 D`` bytes; int8 / fp8 ``2 D + 2 + 2 D / n`` bytes for a
fact of n tokens (0.53x bf16 at D = 64, n = 24; 0.27x fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FORMATS = ("native", "int8", "fp8")
LOSSY = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float16
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
EPS = float(torch.finfo(SCALE_DTYPE).tiny)  # smallest scale, representable in fp16: an all-zero group stays 0


def check_format(name: str) -> str:
    """``name`` if it is a KV format, else ValueError naming the choices."""
    if name not in FORMATS:
        raise ValueError(f"unknown KV format {name!r}; choose one of {', '.join(FORMATS)}")
    return name


def format_of(fingerprint: dict) -> str:
    """The KV format a store fingerprint records (stores made before formats existed are ``native``)."""
    return fingerprint.get("kv_format", "native")


def _torchao():
    from torchao.quantization import quant_primitives  # imported on first use: a few seconds

    return quant_primitives


def _quantize(x: torch.Tensor, block: tuple[int, ...], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation of ``x`` in blocks of shape ``block``: (q in the format's dtype, scales in fp16,
    shaped like ``x`` with each blocked dim reduced to its count of blocks)."""
    x = x.float()
    grid = [s // b for s, b in zip(x.shape, block)]
    if fmt == "int8":
        qp = _torchao()
        scale, zero = qp.choose_qparams_affine(
            x, qp.MappingType.SYMMETRIC, block, torch.int8, -127, 127, eps=EPS, scale_dtype=SCALE_DTYPE
        )
        q = qp.quantize_affine(x, block, scale, zero, torch.int8, -127, 127)
        return q, scale.view(grid)
    view = x.view([d for g, b in zip(grid, block) for d in (g, b)])
    amax = view.abs().amax(dim=tuple(range(1, 2 * len(block), 2)), keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(EPS).to(SCALE_DTYPE)
    q = (view / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(x.shape)
    return q, scale.view(grid)


def quantize(keys: torch.Tensor, values: torch.Tensor, fact_tokens: list[int], fmt: str) -> dict[str, torch.Tensor]:
    """A segment's tensors in format ``fmt`` (token-major, as ``store.segments.to_file`` writes them).

    Args:
        keys, values: [n, L, H, D] pre-RoPE keys and raw values, n = sum(fact_tokens).
        fact_tokens: each fact's token count, in segment order: the key scale groups.
    Returns:
        native: ``keys``, ``values`` unchanged. Lossy: ``keys`` / ``values`` [n, L, H, D] int8 or float8_e4m3fn,
        ``key_scales`` [F, L, H, D] and ``value_scales`` [n, L, H], fp16.
    """
    check_format(fmt)
    if fmt == "native":
        return {"keys": keys, "values": values}
    if sum(fact_tokens) != keys.shape[0] or any(n <= 0 for n in fact_tokens):
        raise ValueError(f"fact token counts {fact_tokens[:5]}... do not cover {keys.shape[0]} tokens")
    n, L, H, D = keys.shape
    qk, ks = [], []
    for part in torch.split(keys, list(fact_tokens)):
        q, s = _quantize(part, (part.shape[0], 1, 1, 1), fmt)
        qk.append(q)
        ks.append(s)
    qv, vs = _quantize(values, (1, 1, 1, D), fmt)
    return {
        "keys": torch.cat(qk),
        "values": qv,
        "key_scales": torch.cat(ks).contiguous(),
        "value_scales": vs.view(n, L, H).contiguous(),
    }


@dataclass
class SpanKV:
    """One read span's KV as stored, laid out [L, H, n, D]. Native: ``keys`` / ``values`` in the model dtype.
    Lossy: ``keys`` / ``values`` int8 or float8_e4m3fn, ``key_scales`` [g, L, H, D] fp16 (the g key groups the
    span touches), ``group_tokens`` (how many of the span's tokens, in order, each row of ``key_scales`` covers;
    they sum to n) and ``value_scales`` [L, H, n] fp16."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    group_tokens: tuple[int, ...] | None = None
    value_scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.values, self.key_scales, self.value_scales) if t is not None)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]


def assemble(
    spans: list[SpanKV],
    dtype: torch.dtype,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    empty: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spans concatenated in order and dequantised: keys, values [L, H, h + sum n, D] in ``dtype``, contiguous.

    ``prefix``: keys, values [L, H, h, D] placed first (the header), so the caller needs no second copy. Each span
    is written once, in place in the result: a lossy one multiplied in fp32 by each key group's scales [L, H, D]
    broadcast over its tokens and by each token's value scales, and cast on the way. A single native span and no
    prefix is returned as it is (no copy). ``empty(name, shape, dtype)``: where the results go (default new
    tensors; the vLLM worker passes reusable buffers, since fresh ones page-fault on first touch)."""
    if prefix is None and len(spans) == 1 and spans[0].key_scales is None:
        return spans[0].keys, spans[0].values
    if not spans:
        return prefix
    empty = empty or (lambda _name, shape, dtype: torch.empty(shape, dtype=dtype))
    L, H, _, D = spans[0].keys.shape
    h = prefix[0].shape[2] if prefix is not None else 0
    shape = (L, H, h + sum(s.num_tokens for s in spans), D)
    if spans[0].key_scales is None:  # native: one cat
        heads = [prefix] if prefix is not None else []
        return (
            torch.cat([p[0] for p in heads] + [s.keys for s in spans], dim=2, out=empty("keys", shape, dtype)),
            torch.cat([p[1] for p in heads] + [s.values for s in spans], dim=2, out=empty("values", shape, dtype)),
        )
    keys, values = empty("keys", shape, dtype), empty("values", shape, dtype)
    if prefix is not None:
        keys[:, :, :h], values[:, :, :h] = prefix
    at = h
    for s in spans:
        qk, qv = (s.keys, s.values) if s.keys.dtype == torch.int8 else (s.keys.float(), s.values.float())
        n = s.num_tokens
        torch.mul(qv, s.value_scales.float().unsqueeze(-1), out=values[:, :, at : at + n])  # float8: no promotion
        scales, i = s.key_scales.float(), 0
        for g, c in enumerate(s.group_tokens):
            torch.mul(qk[:, :, i : i + c], scales[g].unsqueeze(2), out=keys[:, :, at + i : at + i + c])
            i += c
        at += n
    return keys, values
