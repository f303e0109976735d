"""Where a store's KV segments live (``SegmentStore``): a local directory (``LocalSegments``), an object store by URL
(``ObjectSegments``: obstore, file://, s3://, gs://, az://), optionally behind a local disk cache
(``CachedSegments``); ``open_segments`` picks one. The file format itself is ``kvfile``'s (re-exported here: what
is outside the store imports it from this module)."""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABC, abstractmethod

import torch

from ..extras import require
from .kvfile import (  # noqa: F401 -- the format, re-exported: what is outside the store imports it from here
    DTYPES,
    TOKEN_MAJOR,
    FileHandle,
    SegmentCorrupt,
    SegmentHandle,
    SegmentLayout,
    byte_ranges,
    fsync_dir,
    read_layout,
    read_spans,
    save_file,
    to_file,
    verify,
)
from .location import StoreUnavailable, redact, redact_text
from .reach import PROBE_EVERY_S, PROBE_TIMEOUT_S, Reach
from .tiers import DiskTier

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
