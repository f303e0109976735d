"""KV segment files: the immutable safetensors file of one commit's pre-RoPE keys and raw values, read by fact.

A segment holds ``keys`` and ``values`` for the n fact tokens that one commit added; a fact owns tokens
``token_offset .. +num_tokens``. Segments are written token-major, [n, L, H, D] (``to_file``, metadata
``kvmem_layout: "nlhd"``), so a fact is one contiguous byte range per tensor: one ``pread`` here, one range request
on object storage. Segments written before that are [L, H, n, D], a fact being L*H runs; both are read. Readers
never memory-map a file: they ``pread`` the ranges of the facts they gather into fresh buffers. A file that shrinks
or changes under a reader is then a ``SegmentCorrupt`` error for that read, never a SIGBUS in the process that
holds the mapping (a whole engine, on vLLM).

Integrity: ``verify`` checks a whole file against its SHA-256 once per process (the store records the digest at
commit); later reads only ``fstat`` the open file and compare its identity (inode, size, mtime) with the one
verified, so a file rewritten, flipped or truncated since is verified again and refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
TOKEN_MAJOR = {"kvmem_layout": "nlhd"}  # safetensors metadata of segments stored [n, L, H, D]
WHOLE_READ_BYTES = 1 << 20  # a tensor at most this large is read in one pread, then sliced


class SegmentCorrupt(ValueError):
    """A segment file is malformed, truncated, or does not match its recorded SHA-256."""


@dataclass(frozen=True)
class SegmentLayout:
    """Where a segment file's tensors lie. ``shape``: [L, H, n, D] of keys and of values (whatever the file
    order); ``token_major``: stored [n, L, H, D]; ``keys_at`` / ``values_at``: absolute byte offsets of their data;
    ``size``: the file's bytes."""

    size: int
    dtype: torch.dtype
    shape: tuple[int, int, int, int]
    keys_at: int
    values_at: int
    token_major: bool = False

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of keys plus values."""
        return 2 * math.prod(self.shape) * self.itemsize


def to_file(keys: torch.Tensor, values: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata for ``safetensors`` to write a segment: keys / values [L, H, n, D] stored token-major
    [n, L, H, D], so each fact is one contiguous range."""
    return {
        "keys": keys.permute(2, 0, 1, 3).contiguous(),
        "values": values.permute(2, 0, 1, 3).contiguous(),
    }, TOKEN_MAJOR


def file_identity(fd: int) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime ns) of an open file: what must not change after ``verify``."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def verify(fd: int, sha256: str) -> None:
    """Hash the whole open file; raises SegmentCorrupt unless it matches ``sha256`` (hex)."""
    h, at = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 22, at):
        h.update(chunk)
        at += len(chunk)
    if h.hexdigest() != sha256:
        raise SegmentCorrupt("fails its checksum (truncated or corrupt file)")


def read_layout(fd: int) -> SegmentLayout:
    """Parse the safetensors header of an open segment file. Raises SegmentCorrupt if it is malformed, names
    tensors other than equal-shaped [L, H, n, D] ``keys`` / ``values``, or the file is not exactly as long as the
    header says."""
    size = os.fstat(fd).st_size
    try:
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if not 0 < n < size:
            raise ValueError("header length")
        header = json.loads(os.pread(fd, n, 8))
        k, v = header["keys"], header["values"]
        dtype = DTYPES[k["dtype"]]
        shape = tuple(int(x) for x in k["shape"])
        if v["dtype"] != k["dtype"] or tuple(v["shape"]) != shape or len(shape) != 4:
            raise ValueError("keys and values differ")
        ends = max(t["data_offsets"][1] for name, t in header.items() if name != "__metadata__")
        if 8 + n + ends != size:
            raise ValueError("size")
        token_major = (header.get("__metadata__") or {}).get("kvmem_layout") == "nlhd"
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise SegmentCorrupt(f"is malformed or truncated ({exc})") from None
    if token_major:
        shape = (shape[1], shape[2], shape[0], shape[3])
    base = 8 + n
    return SegmentLayout(size, dtype, shape, base + k["data_offsets"][0], base + v["data_offsets"][0], token_major)


def layout_of(path) -> SegmentLayout:
    """``read_layout`` of the segment file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_layout(fd)
    finally:
        os.close(fd)


def _tensor(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=dtype).view(shape) if buf else torch.empty(shape, dtype=dtype)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` (one call moves at most ~2 GiB on Linux: loop); a read of 0 bytes before it
    is full means the file ended early."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise SegmentCorrupt("is truncated (it shrank while being read)")
        view, offset = view[n:], offset + n


def read_spans(fd: int, layout: SegmentLayout, spans: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of token spans ``(token_offset, n)`` of an open segment: [(keys, values)], each
    [L, H, n, D] in the segment's dtype, in fresh contiguous memory. Token-major segments: one pread per span
    and tensor. Older [L, H, n, D] segments: each tensor read whole when that costs at most 4x the spans' bytes
    (or a small tensor), otherwise the spans' L*H runs. Raises SegmentCorrupt for a span outside the segment or a
    file shorter than its layout."""
    L, H, N, D = layout.shape
    row = D * layout.itemsize
    if any(o < 0 or n < 0 or o + n > N for o, n in spans):
        raise SegmentCorrupt(f"has {N} tokens; a fact's span lies outside them")
    if layout.token_major:
        token = L * H * row  # bytes of one token's [L, H, D]
        out = []
        for o, n in spans:
            kv = []
            for at in (layout.keys_at, layout.values_at):
                buf = bytearray(n * token)
                _pread_into(fd, memoryview(buf), at + o * token)
                kv.append(_tensor(buf, layout.dtype, (n, L, H, D)).permute(1, 2, 0, 3).contiguous())
            out.append((kv[0], kv[1]))
        return out
    needed = sum(n for _, n in spans)
    whole = N * row * L * H <= WHOLE_READ_BYTES or 4 * needed >= N
    per_tensor = []
    for at in (layout.keys_at, layout.values_at):
        if whole:
            buf = bytearray(L * H * N * row)
            _pread_into(fd, memoryview(buf), at)
            t = _tensor(buf, layout.dtype, (L, H, N, D))
            per_tensor.append([t if (o, n) == (0, N) else t[:, :, o : o + n].clone() for o, n in spans])
            continue
        parts = []
        for o, n in spans:
            buf = bytearray(L * H * n * row)
            view, run = memoryview(buf), n * row
            for i in range(L * H):
                _pread_into(fd, view[i * run : (i + 1) * run], at + (i * N + o) * row)
            parts.append(_tensor(buf, layout.dtype, (L, H, n, D)))
        per_tensor.append(parts)
    return list(zip(*per_tensor))
