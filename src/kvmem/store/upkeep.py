"""Bounding the copies of a store's KV that outlive their rows: the collection of retired segments, whatever their
user does next (``collect``), and the sweep of a local disk cache of segments (``sweep``; fsck's: ``cache_at``).

A segment no live fact uses is retired (a ``retired:<name>`` key in ``meta`` with the time) and its file or object
stays ``retire_after_s``, so a reader still working from a snapshot taken before the commit that retired it reads
its KV. A commit's ``gc`` removes the due ones of its own user; ``collect`` removes every user's, so a user erased
with ``delete_all`` (who never writes again) loses its files too. A disk cache (``CachedSegments``, one per server,
shared by its processes) holds whole segments; ``sweep`` drops the ones the store no longer holds. The server's
upkeep round runs both (``Memory.collect``, ``Store.sweep_cache``), so every copy of a segment an erasure
retired is gone within ``retire_after_s`` plus one round.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .location import StoreError
from .records import segment_name
from .tiers import DiskTier
from .write import Writer

logger = logging.getLogger("kvmem.store")


def collect(writes: Writer, now: float | None = None) -> list[str]:
    """Retire every segment no live fact uses (of any user: one a commit's clean-up missed) and remove the file
    or object of every segment retired ``writes.retire_after_s`` or more ago. Takes no writer lock: a segment
    without live facts never gets one again (facts only move into new segments, names are never reused), and a
    retired one has no row, so no writer needs either. A file that cannot be removed (an unreachable object
    store) keeps its ``retired:`` key and is tried again next time. Returns the removed segment names."""
    now = time.time() if now is None else now
    db = writes.rows
    with writes._lock:
        dead = db.unused_segments()
        db.retire(dead, [segment_name(u, s) for u, s in dead], [], now, keep_time=True)  # an earlier one keeps its time
        due = [n for n, t in db.retired() if t <= now - writes.retire_after_s]
    removed = []
    for name in due:
        try:
            writes.segments.delete(name)
            removed.append(name)
        except OSError as exc:
            logger.warning("store %s: cannot remove retired segment %s (tried again next round): %s", writes.name,
                           name, exc)  # fmt: skip
    if removed:
        with writes._lock:
            db.retire([], [], removed, now)
    return removed


def held(writes: Writer, now: float | None = None) -> set[str]:
    """The segment names the store still holds for its readers: every segment row's, and every retired one's not
    yet due for removal (retired less than ``writes.retire_after_s`` ago)."""
    now = time.time() if now is None else now
    after = writes.retire_after_s
    with writes._lock:
        live = {segment_name(u, s) for u, s in writes.rows.segment_rows()}
        retired = writes.rows.retired()
    return live | {n for n, t in retired if t > now - after}


def sweep(tier: DiskTier, prefix: str, keep: set[str]) -> list[str]:
    """Drop from disk cache ``tier`` every segment of one store (keys ``prefix`` + name) whose name is not in
    ``keep`` (``held``); another store's entries (another prefix) stay. Returns the dropped names, sorted. A
    segment fetched meanwhile that ``keep`` did not know yet is only fetched again."""
    gone = []
    for key in tier.held():
        name = key[len(prefix) :] if isinstance(key, str) and key.startswith(prefix) else None
        if name is not None and name not in keep and tier.remove(key):
            gone.append(name)
    return sorted(gone)


def cache_at(cache_dir: str | Path) -> DiskTier:
    """The disk cache in ``cache_dir``, one that ``kvmem serve --cache-dir`` made, opened with its own settings
    (its bound is left as its server set it); close it with ``tier.cache.close()``. Raises StoreError for a path
    that is not such a cache (nothing is created there)."""
    path = Path(cache_dir)
    if not (path / "cache.db").is_file():
        raise StoreError(f"--cache-dir {cache_dir}: not a segment cache directory (it has no cache.db)")
    try:
        return DiskTier(path, None)
    except Exception as exc:  # diskcache's sqlite3 errors: an unreadable or corrupt cache.db
        raise StoreError(f"--cache-dir {cache_dir}: cannot be opened ({exc})") from None
