"""The KV segment file format: the immutable safetensors file of one commit's pre-RoPE keys and raw values, read by
fact (where the files live: ``segments``).

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

import bisect
import errno
import hashlib
import itertools
import json
import math
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .. import kvformat

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
}
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
    kv_format: str = "native"
    key_scales_at: int = 0  # lossy formats: [F, L, H, D] fp16, one row per fact (key group)
    value_scales_at: int = 0  # lossy formats: [n, L, H] fp16
    groups: tuple[int, ...] = ()  # lossy formats: each key group's first token, ascending

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of keys plus values (scales not counted)."""
        return 2 * math.prod(self.shape) * self.itemsize


def to_file(
    keys: torch.Tensor, values: torch.Tensor, kv_format: str = "native", fact_tokens: list[int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata for ``safetensors`` to write a segment: keys / values [L, H, n, D] stored token-major
    [n, L, H, D], so each fact is one contiguous range, in ``kv_format`` (``kvformat``; lossy formats need each
    fact's token count, ``fact_tokens``, and add ``key_scales`` / ``value_scales``)."""
    tensors = kvformat.quantize(
        keys.permute(2, 0, 1, 3).contiguous(), values.permute(2, 0, 1, 3).contiguous(), fact_tokens or [], kv_format
    )
    if kv_format == "native":
        return tensors, TOKEN_MAJOR
    return tensors, {**TOKEN_MAJOR, "kvmem_kv_format": kv_format, "kvmem_key_groups": json.dumps(fact_tokens)}


_UMASK = os.umask(0)  # read once at import: setting it later would race with other threads' file creation
os.umask(_UMASK)


def save_file(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> str:
    """Write, fsync and return the SHA-256 of a safetensors file. safetensors' writer creates files 0600; give them
    the same umask-derived mode as the manifest and SQLite. Raises OSError(ENOSPC) when the disk is full (the
    partial file removed)."""
    from safetensors.torch import save_file as _save_file

    need = sum(t.nbytes for t in tensors.values())
    try:
        _save_file(tensors, path, metadata=metadata)
    except Exception as exc:  # safetensors reports a full disk as its own error type
        path.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno != errno.ENOSPC or shutil.disk_usage(path.parent).free >= need:
            raise
        raise OSError(errno.ENOSPC, f"no space left on the store's disk for {need} bytes of KV", str(path)) from None
    os.chmod(path, 0o666 & ~_UMASK)
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
    return digest


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentHandle(ABC):
    """One open segment: its identity, its size, and byte ranges of it. Use as a context manager."""

    @abstractmethod
    def identity(self) -> tuple:
        """What must not change after ``verify`` (a file's inode, size and mtime; an object's size and ETag)."""

    @abstractmethod
    def size(self) -> int:
        """Bytes of the segment."""

    @abstractmethod
    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from byte ``offset``. Raises SegmentCorrupt if the segment ends first."""

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(memoryview(buf), offset)
        return bytes(buf)

    def chunks(self, size: int = 1 << 22):
        """The whole segment, in order, as byte chunks (``verify``)."""
        at, total = 0, self.size()
        while at < total:
            n = min(size, total - at)
            yield self.read(at, n)
            at += n

    def close(self) -> None:  # noqa: B027 (a no-op default, as vLLM's connector ABCs have)
        """Release what the handle holds (default: nothing)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FileHandle(SegmentHandle):
    """A segment file opened read-only: ``pread`` of byte ranges, never a memory map."""

    def __init__(self, path=None, fd: int | None = None):
        self.fd = os.open(path, os.O_RDONLY) if fd is None else fd  # FileNotFoundError, PermissionError: the caller's

    def identity(self) -> tuple:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, view: memoryview, offset: int) -> None:
        while len(view):  # one call moves at most ~2 GiB on Linux
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise SegmentCorrupt("is truncated (it shrank while being read)")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def verify(handle: SegmentHandle, sha256: str) -> None:
    """Hash the whole segment; raises SegmentCorrupt unless it matches ``sha256`` (hex)."""
    h = hashlib.sha256()
    for chunk in handle.chunks():
        h.update(chunk)
    if h.hexdigest() != sha256:
        raise SegmentCorrupt("fails its checksum (truncated or corrupt file)")


def read_layout(handle: SegmentHandle) -> SegmentLayout:
    """Parse the safetensors header of an open segment file. Raises SegmentCorrupt if it is malformed, names
    keys / values that are not equal-shaped 4-d tensors (a lossy format: without scales of the right shapes, or
    key groups that do not cover the tokens), or the file is not exactly as long as the header says."""
    size = handle.size()
    try:
        n = int.from_bytes(handle.read(0, 8), "little") if size >= 8 else 0
        if not 0 < n < size:
            raise ValueError("header length")
        header = json.loads(handle.read(8, n))
        k, v = header["keys"], header["values"]
        dtype = DTYPES[k["dtype"]]
        shape = tuple(int(x) for x in k["shape"])
        if v["dtype"] != k["dtype"] or tuple(v["shape"]) != shape or len(shape) != 4:
            raise ValueError("keys and values differ")
        ends = max(t["data_offsets"][1] for name, t in header.items() if name != "__metadata__")
        if 8 + n + ends != size:
            raise ValueError("size")
        meta = header.get("__metadata__") or {}
        token_major = meta.get("kvmem_layout") == "nlhd"
        fmt = meta.get("kvmem_kv_format", "native")
        base = 8 + n
        scales, groups = (0, 0), ()
        if fmt != "native":
            if fmt not in kvformat.LOSSY or not token_major or dtype != kvformat.LOSSY[fmt]:
                raise ValueError(f"format {fmt!r} with {k['dtype']} tensors")
            counts = [int(c) for c in json.loads(meta["kvmem_key_groups"])]
            ks, vs = header["key_scales"], header["value_scales"]
            N, L, H, D = shape
            if sum(counts) != N or min(counts, default=1) <= 0 or ks["dtype"] != "F16" or vs["dtype"] != "F16":
                raise ValueError("key groups or scales")
            if tuple(ks["shape"]) != (len(counts), L, H, D) or tuple(vs["shape"]) != (N, L, H):
                raise ValueError("scale shapes")
            scales = (base + ks["data_offsets"][0], base + vs["data_offsets"][0])
            groups = tuple(itertools.accumulate(counts[:-1], initial=0)) if counts else ()
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise SegmentCorrupt(f"is malformed or truncated ({exc})") from None
    if token_major:
        shape = (shape[1], shape[2], shape[0], shape[3])
    return SegmentLayout(
        size,
        dtype,
        shape,
        base + k["data_offsets"][0],
        base + v["data_offsets"][0],
        token_major,
        fmt,
        *scales,
        groups,
    )


def _tensor(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=dtype).view(shape) if buf else torch.empty(shape, dtype=dtype)


def read_spans(handle: SegmentHandle, layout: SegmentLayout, spans: list[tuple[int, int]]) -> list[kvformat.SpanKV]:
    """The KV of token spans ``(token_offset, n)`` of an open segment, as stored (``kvformat.SpanKV``: native
    keys / values [L, H, n, D] in the segment's dtype; lossy ones [L, H, n, D] too, with their scales), in fresh
    contiguous memory. Token-major segments: one pread per span and tensor (and scale tensor). Older
    [L, H, n, D] segments: each tensor read whole when that costs at most 4x the spans' bytes (or a small tensor),
    otherwise the spans' L*H runs. Raises SegmentCorrupt for a span outside the segment or a file shorter than its
    layout."""
    L, H, N, D = layout.shape
    row = D * layout.itemsize
    if any(o < 0 or n < 0 or o + n > N for o, n in spans):
        raise SegmentCorrupt(f"has {N} tokens; a fact's span lies outside them")

    def read(at: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        buf = bytearray(nbytes)
        handle.read_into(memoryview(buf), at)
        return _tensor(buf, dtype, shape)

    if layout.token_major:
        token = L * H * row  # bytes of one token's [L, H, D]
        out = []
        for o, n in spans:
            k, v = (
                read(at + o * token, n * token, layout.dtype, (n, L, H, D)) for at in (layout.keys_at, layout.values_at)
            )
            if layout.kv_format == "native":
                out.append(kvformat.SpanKV(k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous()))
                continue
            first = bisect.bisect_right(layout.groups, o) - 1
            last = bisect.bisect_right(layout.groups, o + n - 1) - 1 if n else first
            key_row, f16 = L * H * D * 2, torch.float16
            ks = read(
                layout.key_scales_at + first * key_row, (last - first + 1) * key_row, f16, (last - first + 1, L, H, D)
            )
            vs = read(layout.value_scales_at + o * L * H * 2, n * L * H * 2, f16, (n, L, H))
            bounds = [*layout.groups[first + 1 : last + 1], N]
            starts = [o, *bounds[:-1]]
            counts = tuple(min(b, o + n) - s for s, b in zip(starts, bounds))  # the span's tokens in each group
            # laid out [L, H, n, D] once, when read (the cache keeps it so): assembly then writes rows in order
            k, v, vs = k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous(), vs.permute(1, 2, 0)
            out.append(kvformat.SpanKV(k, v, ks, counts, vs.contiguous()))
        return out
    needed = sum(n for _, n in spans)
    whole = N * row * L * H <= WHOLE_READ_BYTES or 4 * needed >= N
    per_tensor = []
    for at in (layout.keys_at, layout.values_at):
        if whole:
            buf = bytearray(L * H * N * row)
            handle.read_into(memoryview(buf), at)
            t = _tensor(buf, layout.dtype, (L, H, N, D))
            per_tensor.append([t if (o, n) == (0, N) else t[:, :, o : o + n].clone() for o, n in spans])
            continue
        parts = []
        for o, n in spans:
            buf = bytearray(L * H * n * row)
            view, run = memoryview(buf), n * row
            for i in range(L * H):
                handle.read_into(view[i * run : (i + 1) * run], at + (i * N + o) * row)
            parts.append(_tensor(buf, layout.dtype, (L, H, n, D)))
        per_tensor.append(parts)
    return [kvformat.SpanKV(k, v) for k, v in zip(*per_tensor)]


def byte_ranges(layout: SegmentLayout, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) of the bytes reading ``spans`` touches in a token-major segment (keys, values and, for a
    lossy format, value scales; key scales are one small tensor, read whole); [] for an older layout."""
    if not layout.token_major:
        return []
    L, H, _, D = layout.shape
    token = L * H * D * layout.itemsize
    out = [(at + o * token, n * token) for o, n in spans for at in (layout.keys_at, layout.values_at)]
    if layout.kv_format != "native":
        out += [(layout.value_scales_at + o * L * H * 2, n * L * H * 2) for o, n in spans]
        out.append((layout.key_scales_at, len(layout.groups) * L * H * D * 2))
    return out
