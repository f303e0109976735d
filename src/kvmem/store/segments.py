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

import bisect
import errno
import hashlib
import itertools
import json
import math
import os
import shutil
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .. import kvformat
from ..extras import require
from .location import StoreUnavailable, redact, redact_text
from .reach import PROBE_EVERY_S, PROBE_TIMEOUT_S, Reach
from .tiers import DiskTier

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
}
TOKEN_MAJOR = {"kvmem_layout": "nlhd"}  # safetensors metadata of segments stored [n, L, H, D]
WHOLE_READ_BYTES = 1 << 20  # a tensor at most this large is read in one pread, then sliced
# A remote object store (s3://, gs://, az://) that cannot be reached fails a call within about
# OBJECT_RETRY_S + the request timeout (~15 s, then StoreUnavailable: HTTP 503), not after obstore's default
# 3 minutes of retries. The timeout covers a whole request: a segment of 100 MB needs 10 MB/s.
OBJECT_CLIENT = {"connect_timeout": "2s", "timeout": "10s"}
OBJECT_RETRY_S, OBJECT_RETRIES = 5, 2
# Readiness of a remote object store (``ObjectSegments.available``): one HEAD of a name that is never written, on
# a client without retries, at most once per PROBE_EVERY_S; no answer within PROBE_TIMEOUT_S: unavailable. A store
# found unreachable (by a probe or by any call) fails every call at once until a background probe gets an answer.
PROBE_NAME = ".kvmem-probe"
_ALLOW_HTTP = ("AWS_ALLOW_HTTP", "AZURE_ALLOW_HTTP", "GOOGLE_ALLOW_HTTP")  # as obstore reads them


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


class ObjectHandle(SegmentHandle):
    """A segment object in an object store (obstore: ``file://``, ``s3://``, ``gs://``, ``az://``): byte ranges by
    range request; identity is the object's size and ETag."""

    def __init__(self, store, path: str, unreachable=None):
        import obstore

        self._obs, self.store, self.path = obstore, store, path
        self._unreachable = unreachable  # called before StoreUnavailable is raised (``ObjectSegments``: mark down)
        try:
            meta = obstore.head(store, path)
        except FileNotFoundError:
            raise
        except Exception as exc:  # obstore's NotFoundError subclasses FileNotFoundError; others: unreadable
            _raise_if_unreachable(store, exc, unreachable)
            raise OSError(f"{path}: {exc}") from None
        self._size, self._etag = int(meta["size"]), meta.get("e_tag")

    def identity(self) -> tuple:
        return self._size, self._etag

    def size(self) -> int:
        return self._size

    def read_into(self, view: memoryview, offset: int) -> None:
        if offset + len(view) > self._size:
            raise SegmentCorrupt("is truncated (shorter than its layout)")
        if not len(view):
            return
        try:
            data = self._obs.get_range(self.store, self.path, start=offset, length=len(view))
        except Exception as exc:
            _raise_if_unreachable(self.store, exc, self._unreachable)
            raise SegmentCorrupt(f"cannot be read ({exc})") from None
        if len(data) != len(view):
            raise SegmentCorrupt("is truncated (it shrank while being read)")
        view[:] = memoryview(data)


def _raise_if_unreachable(store, exc: Exception, unreachable=None) -> None:
    """StoreUnavailable when ``exc`` is obstore's error for a remote store that did not answer (a refused or
    timed-out connection, a 5xx after the retries): a read or write to try again later, not a corrupt segment.
    ``unreachable``: called first (``ObjectSegments`` marks itself unavailable)."""
    from obstore.exceptions import GenericError
    from obstore.store import LocalStore

    if isinstance(exc, GenericError) and not isinstance(store, LocalStore):
        if unreachable is not None:
            unreachable()
        raise StoreUnavailable(f"the object store cannot be reached ({' '.join(str(exc).split())[:200]})") from None


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


class SegmentStore(ABC):
    """Where a store's KV segments live: immutable objects named by the store (``<user>.<segment>.kv.safetensors``).
    ``LocalSegments``: a directory (the default). ``ObjectSegments``: an object store by URL. Writes are whole
    objects, durable before ``put`` returns; readers open a handle per read."""

    url: str

    @abstractmethod
    def put(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
        """Write a segment whole; returns its SHA-256 (hex). Raises OSError (ENOSPC: out of space)."""

    @abstractmethod
    def open(self, name: str) -> SegmentHandle:
        """A handle on a segment. Raises FileNotFoundError if there is none, OSError if it cannot be read."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove a segment (no error if it is gone)."""

    @abstractmethod
    def names(self) -> set[str]:
        """Every segment name present."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every segment present."""

    def local_path(self, name: str):
        """The segment's file on this machine, where there is one (tests and tools), else None."""
        return None

    def read(self, name: str) -> bytes:
        """A whole segment. Raises FileNotFoundError, OSError, SegmentCorrupt (it shrank while being read)."""
        handle = self.open(name)
        try:
            buf = bytearray(handle.size())
            handle.read_into(memoryview(buf), 0)
            return bytes(buf)
        finally:
            handle.close()

    def stats(self) -> dict[str, int]:
        """Counters of a cache in front of the segments (``CachedSegments``); none here."""
        return {}

    def discard(self, name: str) -> None:  # noqa: B027 -- a no-op default: only a cache has copies
        """Forget any local copy of a segment (one that failed its checksum): the next ``open`` fetches it again."""

    def prefetch(self, name: str, spans: list[tuple[int, int]]) -> None:  # noqa: B027 -- a no-op default
        """A hint that token spans ``(token_offset, n)`` of segment ``name`` will be read soon (default: none;
        an object store without a local cache has nowhere to put them). Never raises."""

    def evict(self, name: str) -> None:  # noqa: B027 -- a no-op default: an object store has no tier below
        """Drop every copy of segment ``name`` held below the store's reader (a local file's pages in the page
        cache, a disk cache's copy), so the next read goes to the store itself (load tests). Never raises."""

    def available(self) -> bool:
        """Whether the segments can be reached now (default: always; a remote object store probes)."""
        return True


class CachedSegments(SegmentStore):
    """``inner``'s segments with a byte-bounded local disk cache in front (``tiers.DiskTier``, least recently used
    first): the first ``open`` of a segment fetches it whole into ``cache_dir``, later ones read the local copy by
    ``pread``. Segments are immutable and each is verified against its checksum by the store that reads it, so a
    cached copy is never stale (a corrupt one is refused like any other copy; one the store removed goes at the
    upkeep's sweep, ``upkeep.sweep``). For segments in a remote object store; ``key_prefix``: this store's keys."""

    def __init__(self, inner: SegmentStore, cache_dir, max_bytes: int, key_prefix: str = ""):
        self.inner, self.url, self.prefix = inner, inner.url, key_prefix
        self.tier = DiskTier(cache_dir, max_bytes)
        self._stats = {"disk_hits": 0, "disk_misses": 0, "disk_fetched_bytes": 0, "disk_errors": 0}
        self._fetching: dict[str, threading.Lock] = {}  # segment key -> held while this process fetches it
        self._fetching_lock = threading.Lock()

    def _cached(self, key: str) -> FileHandle | None:
        f = self.tier.get(key)
        if f is None:
            return None
        try:
            return FileHandle(fd=os.dup(f.fileno()))
        finally:
            f.close()

    def open(self, name: str) -> SegmentHandle:
        key = self.prefix + name
        handle = self._cached(key)
        if handle is None:
            # one fetch of a segment at a time in this process: a racing reader (the prefetch thread and the
            # request's) waits for it, then finds the segment cached
            with self._fetching_lock:
                lock = self._fetching.setdefault(key, threading.Lock())
            with lock:
                handle = self._cached(key)
                if handle is None:
                    return self._fetch(name, key)
        self._stats["disk_hits"] += 1
        return handle

    def _fetch(self, name: str, key: str) -> SegmentHandle:
        """Segment ``name`` read from the store below into the disk cache (under ``key``); its handle."""
        self._stats["disk_misses"] += 1
        data = self.inner.read(name)
        self._stats["disk_fetched_bytes"] += len(data)
        try:
            self.tier.put(key, data)
        except Exception:  # a full or unwritable cache disk: the object store serves it, uncached
            self._stats["disk_errors"] += 1
            return self.inner.open(name)
        # evicted at once (larger than the whole cache) or by another process: serve it from the object store
        return self._cached(key) or self.inner.open(name)

    def put(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
        return self.inner.put(name, tensors, metadata)

    def delete(self, name: str) -> None:
        self.discard(name)
        self.inner.delete(name)

    def names(self) -> set[str]:
        return self.inner.names()

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def local_path(self, name: str):
        return self.inner.local_path(name)

    def prefetch(self, name: str, spans: list[tuple[int, int]]) -> None:
        """Fetch the whole segment into the disk cache now, if it is not there (a read then finds it local)."""
        try:
            if not self.tier.contains(self.prefix + name):
                self.open(name).close()
        except Exception:  # a hint: the read that follows reports any error
            pass

    def stats(self) -> dict[str, int]:
        """Counters, with ``disk_evictions``: segments this object cached that the byte bound has since pushed out
        (exact while one process uses the cache directory)."""
        return {**self._stats, "disk_cache_bytes": self.tier.nbytes(), "disk_evictions": self.tier.evictions()}

    def discard(self, name: str) -> None:
        self.tier.remove(self.prefix + name)

    def evict(self, name: str) -> None:
        try:
            self.tier.remove(self.prefix + name, counted=False)
        except Exception:
            pass

    def available(self) -> bool:
        return self.inner.available()


class LocalSegments(SegmentStore):
    """Segments as files in one directory (a store's ``users/``): written, chmod-ed to the umask's mode, fsynced with
    their directory before ``put`` returns; read by ``pread``."""

    def __init__(self, root):
        from pathlib import Path

        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def put(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
        digest = save_file(tensors, self.root / name, metadata)
        fsync_dir(self.root)  # the directory entry is durable too
        return digest

    def open(self, name: str) -> SegmentHandle:
        return FileHandle(self.root / name)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def names(self) -> set[str]:
        return {p.name for p in self.root.iterdir() if p.is_file()}

    def nbytes(self) -> int:
        total = 0
        for p in self.root.iterdir():
            try:
                total += p.stat().st_size if p.is_file() else 0
            except FileNotFoundError:  # removed by a concurrent writer during the walk
                pass
        return total

    def local_path(self, name: str):
        return self.root / name

    def prefetch(self, name: str, spans: list[tuple[int, int]]) -> None:
        """Ask the kernel to read the spans' byte ranges into the page cache in the background
        (``posix_fadvise(WILLNEED)``; the header is parsed for where they lie)."""
        try:
            with FileHandle(self.root / name) as handle:
                layout = read_layout(handle)
                for at, length in byte_ranges(layout, spans):
                    os.posix_fadvise(handle.fd, at, length, os.POSIX_FADV_WILLNEED)
        except Exception:  # a hint: the read that follows reports any error
            pass

    def evict(self, name: str) -> None:
        """The file's pages out of the page cache (``posix_fadvise(DONTNEED)``)."""
        try:
            with FileHandle(self.root / name) as handle:
                os.posix_fadvise(handle.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except Exception:
            pass


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


def open_segments(root, url: str | None, store_id: str = "", cache_dir=None, cache_dir_bytes: int = 0) -> SegmentStore:
    """A store's segments: under ``url``/``store_id`` in an object store (so stores sharing one URL never see, or
    fsck, each other's objects), or, for no URL, the store's own ``users/`` directory ``root``. ``cache_dir``:
    with a URL, a local disk cache of ``cache_dir_bytes`` in front (``CachedSegments``)."""
    if not url:
        return LocalSegments(root)
    if store_id:  # into the path, before any query
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        url = urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{store_id}"))
    objects = ObjectSegments(url)
    if cache_dir is None or cache_dir_bytes <= 0:
        return objects
    return CachedSegments(objects, cache_dir, cache_dir_bytes, key_prefix=f"{store_id}/")


_REACH: dict[str, Reach] = {}
_REACH_LOCK = threading.Lock()


def _reach_of(url: str, probe_store) -> Reach:
    """The one ``Reach`` of a remote object store's URL in this process (a replica's chat path and write path
    hold a store each). Its probe is one HEAD of ``PROBE_NAME`` (never written: "not found" is an answer) on a
    client without retries, bounded by ``PROBE_TIMEOUT_S``."""
    import obstore

    def head() -> bool:
        try:
            obstore.head(probe_store, PROBE_NAME)
            return True
        except FileNotFoundError:
            return True
        except Exception:  # refused, timed out, a 5xx, refused credentials: not usable now
            return False

    with _REACH_LOCK:
        if url not in _REACH:
            _REACH[url] = Reach(head, "the object store", PROBE_EVERY_S, "kvmem-s3-probe")
        return _REACH[url]


class ObjectSegments(SegmentStore):
    """Segments as objects under ``url`` (``file:///mnt/shared/kv``, ``s3://bucket/prefix``, ...), through obstore.
    Credentials come from the environment, as obstore reads them; the URL is never logged with them."""

    def __init__(self, url: str):
        require("s3", "KV segments by URL (--segments)")
        import obstore
        from obstore.store import from_url

        self.url, self._obs, self._probe_store = url, obstore, None
        try:
            if url.startswith("file://"):
                self.store = from_url(url, mkdir=True)
            else:
                from datetime import timedelta

                retry = {"max_retries": OBJECT_RETRIES, "retry_timeout": timedelta(seconds=OBJECT_RETRY_S)}
                client = dict(OBJECT_CLIENT)  # given options replace the environment's: keep its allow_http
                if any(os.environ.get(k, "").lower() in ("1", "true") for k in _ALLOW_HTTP):
                    client["allow_http"] = True
                self.store = from_url(url, client_options=client, retry_config=retry)
                probe = {**client, "connect_timeout": "1s", "timeout": f"{PROBE_TIMEOUT_S:g}s"}
                self._probe_store = from_url(url, client_options=probe, retry_config={"max_retries": 0})
        except Exception as exc:
            raise ValueError(f"segments URL {redact(url)!r} cannot be used ({redact_text(str(exc))})") from None
        self._reach = _reach_of(url, self._probe_store) if self._probe_store is not None else None

    # --- availability (``Reach``, shared by every ``ObjectSegments`` of this URL in the process) -------------

    def _mark_down(self) -> None:
        if self._reach is not None:
            self._reach.mark_down()

    def _check_up(self) -> None:
        if self._reach is not None:
            self._reach.check_up()

    def _down(self) -> bool:
        return self._reach is not None and self._reach.down_since is not None

    def available(self) -> bool:
        """Whether the object store answers: always for ``file://``; for a remote one ``Reach.available``."""
        return self._reach is None or self._reach.available()

    def _failed(self, what: str, exc: Exception, unreachable: bool = True) -> OSError:
        if isinstance(exc, OSError):
            return exc
        try:  # an unreachable store is marked as such either way: the calls after this one fail at once
            _raise_if_unreachable(self.store, exc, self._mark_down)
        except StoreUnavailable:
            if unreachable:
                raise
        why = redact_text(" ".join(str(exc).split()))[:300]
        return OSError(f"segments at {redact(self.url)}: cannot {what} ({why})")

    def put(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
        from safetensors.torch import save

        self._check_up()  # known unreachable: fail now, nothing written
        data = save(tensors, metadata=metadata)
        try:
            self._obs.put(self.store, name, data)  # an object store's put is durable when it returns
        except Exception as exc:  # obstore's errors (no bucket, no credentials, no network) as OSError
            raise self._failed(f"write {name}", exc) from None
        path = self.local_path(name)
        if path is not None:  # a file:// store is a directory: make the file and its entry durable too
            fsync_dir(path)  # (any path: open read-only, fsync)
            fsync_dir(path.parent)
        return hashlib.sha256(data).hexdigest()

    def open(self, name: str) -> SegmentHandle:
        self._check_up()
        return ObjectHandle(self.store, name, self._mark_down)

    def delete(self, name: str) -> None:
        if self._down():  # best effort after a commit (gc): an OSError, logged there
            raise OSError(f"segments at {redact(self.url)}: cannot delete {name} (unreachable)")
        try:
            self._obs.delete(self.store, name)
        except FileNotFoundError:
            pass
        except Exception as exc:  # an OSError even when unreachable: removal is best effort after a commit (gc)
            raise self._failed(f"delete {name}", exc, unreachable=False) from None

    def _objects(self):
        self._check_up()
        try:
            return [m for batch in self._obs.list(self.store) for m in batch]
        except Exception as exc:
            raise self._failed("list the objects", exc) from None

    def names(self) -> set[str]:
        return {m["path"] for m in self._objects()}

    def nbytes(self) -> int:
        return sum(int(m["size"]) for m in self._objects())

    def local_path(self, name: str):
        if self.url.startswith("file://"):
            from pathlib import Path
            from urllib.parse import unquote, urlsplit

            return Path(unquote(urlsplit(self.url).path)) / name  # as obstore reads it: percent-decoded
        return None
