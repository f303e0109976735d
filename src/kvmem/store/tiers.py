"""Read tiers: the caches a store's reader looks in before it reads a segment, behind one small interface.

``ReadTier`` (``contains`` / ``get`` / ``put`` / ``remove``, as LMCache's storage backends have) is implemented by
``MemoryTier``, this process's facts' KV (``kvformat.SpanKV``, as stored, bounded in bytes), and ``DiskTier``, a
local disk copy of whole segments from a remote object store (diskcache, bounded in bytes, shared by processes).
The read path composes them: the memory tier first, then the segments (through a disk tier, for an object store).
Both keep the least recently used entries. Stored KV never changes, so nothing held is ever stale; a segment that
leaves the store (an erasure retired it) is dropped from a disk tier by the upkeep's sweep (``upkeep``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator

from cachetools import LRUCache


class ReadTier(ABC):
    """One tier of read cache: immutable values by key, bounded. A value larger than the whole tier is served by
    the tier below and not kept. Never raises for a key it does not hold."""

    @abstractmethod
    def contains(self, key: Hashable) -> bool:
        """Whether the tier holds ``key`` now."""

    @abstractmethod
    def get(self, key: Hashable):
        """What the tier holds for ``key`` (``MemoryTier``: the value; ``DiskTier``: its local copy as an open binary
        file, which the caller closes), or None."""

    @abstractmethod
    def put(self, key: Hashable, value) -> bool:
        """Keep ``value`` under ``key``, evicting the least recently used; False when it is not kept (larger than
        the tier). Raises OSError when the tier cannot be written (``DiskTier``: a full or unwritable disk)."""

    @abstractmethod
    def remove(self, key: Hashable) -> bool:
        """Drop ``key``; whether it was held."""

    @abstractmethod
    def held(self) -> Iterator:
        """The keys held now (a copy: safe to ``remove`` while iterating)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held."""

    def clear(self) -> None:
        for key in self.held():
            self.remove(key)


class CountingLRU(LRUCache):
    """An LRU cache bounded by ``getsizeof`` that counts what it evicts (``evictions``, ``evicted_bytes``)."""

    def __init__(self, maxsize, getsizeof=None):
        super().__init__(maxsize=maxsize, getsizeof=getsizeof)
        self.evictions = self.evicted_bytes = 0

    def popitem(self):
        key, value = super().popitem()
        self.evictions += 1
        self.evicted_bytes += self.getsizeof(value)
        return key, value


def put_bounded(cache: LRUCache, key, value) -> bool:
    """``cache[key] = value`` unless it is larger than the whole cache (then served, not cached)."""
    try:
        cache[key] = value
        return True
    except ValueError:
        cache.pop(key, None)
        return False


class MemoryTier(ReadTier):
    """Facts' KV in this process's memory (``kvformat.SpanKV``, as stored, so a quantised store holds more facts in
    the same bound), least recently used first, bounded by ``max_bytes`` of stored KV. Not thread-safe: the store's
    lock guards it."""

    def __init__(self, max_bytes: int):
        self._lru = CountingLRU(max(1, int(max_bytes)), getsizeof=lambda kv: kv.nbytes)

    def contains(self, key) -> bool:
        return key in self._lru

    def get(self, key):
        return self._lru.get(key)

    def put(self, key, value) -> bool:
        return put_bounded(self._lru, key, value)

    def remove(self, key) -> bool:
        return self._lru.pop(key, None) is not None

    def held(self) -> list:
        return list(self._lru)

    def nbytes(self) -> int:
        return int(self._lru.currsize)

    def clear(self) -> None:
        self._lru.clear()

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    @property
    def evicted_bytes(self) -> int:
        return self._lru.evicted_bytes


class DiskTier(ReadTier):
    """Whole segments (bytes) in a local directory (diskcache, least recently used first, ``max_bytes``), shared
    by the processes that open it; ``get`` returns the local copy as an open file. ``stored`` / ``discarded``
    count what this object put in and took out (``evictions``: what the bound pushed out besides). ``max_bytes``
    None: the directory's own settings, as its server set them (``kvmem store fsck --cache-dir``).

    Stored KV never changes, but a segment an erasure retired leaves the store: ``upkeep.sweep`` drops it here."""

    def __init__(self, directory, max_bytes: int | None):
        import diskcache

        settings = {"eviction_policy": "least-recently-used", "disk_min_file_size": 0}
        own = {} if max_bytes is None else {"size_limit": int(max_bytes), **settings}
        self.cache = diskcache.Cache(str(directory), **own)
        self.stored = self.discarded = 0

    def contains(self, key) -> bool:
        return key in self.cache

    def get(self, key):
        return self.cache.get(key, read=True)

    def put(self, key, value: bytes) -> bool:
        self.cache.set(key, value)  # diskcache evicts at once what is larger than the whole cache
        self.stored += 1
        return key in self.cache

    def remove(self, key, counted: bool = True) -> bool:
        """``counted=False``: not counted as this object's discard (a load test's ``evict`` then reads as an
        eviction in ``evictions``, as it always has)."""
        if self.cache.delete(key):
            self.discarded += counted
            return True
        return False

    def held(self) -> list:
        return list(self.cache.iterkeys())

    def nbytes(self) -> int:
        return int(self.cache.volume())

    def evictions(self) -> int:
        """Segments this object kept that the byte bound has since pushed out (exact while one process uses the
        directory)."""
        return max(0, self.stored - self.discarded - len(self.cache))
