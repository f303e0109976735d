"""Each engine process's own handles on the stores it may read, and the rule of which stores it trusts.

Both connector sides open a store themselves (nothing is shared with the API process but what a request carries);
a process keeps one handle per store root, reopened when the store is re-created at the same path. The trust rule
(allow-listed at engine start, built by this engine's model) is judged once per store instance.

The scheduler side checks every kv request's prompt against the token ids of the facts it names
(``memory_token_ids``). That costs O(1) store work per request, whatever the user's or the store's size: one
version read per scope (``Store.reads.version``, one row by primary key), and the rows of the named facts only
(``Store.reads.fact_token_ids``) for those not in this process's token cache. The cache is an LRU bounded by
``TOKEN_CACHE_TOKENS`` token ids (about 40 MB of Python ints at most), keyed by store instance, user, version and
fact id, so it holds what recent requests named, never every user served.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from cachetools import LRUCache

from ...store import Store, within
from .params import MemoryRef

_LOCK = threading.Lock()
_STORES: dict[str, Any] = {}
_CACHE_BYTES = [1 << 30]  # each store's cache bound in this process (``configure``)
_CACHE_DIR: list[str | None] = [None]  # this process's disk cache of remote segments (``configure``)
TOKEN_CACHE_TOKENS = 1 << 20  # token ids the token cache holds, at most (module docstring)
_TOKENS_LOCK = threading.Lock()


def _token_cache(max_tokens: int) -> LRUCache:
    # (root, store_id, user, version, fact_id) -> the fact's token ids, or None: not a live fact of that version
    return LRUCache(maxsize=max(1, int(max_tokens)), getsizeof=lambda ids: 1 + len(ids or ()))


_TOKENS = [_token_cache(TOKEN_CACHE_TOKENS)]


_ANSWER_CAP: list[float | None] = [None]  # this process's bound on a database answer, s (``configure``)


def configure(
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    token_cache_tokens: int | None = None,
    answer_cap_s: float | None = None,
) -> None:
    """This process's store read-cache bound (bytes), disk cache folder and bound on a database's answer (s: the
    scheduler side's, whose reads hold the engine core), for stores opened from now on (the connector sets them
    at engine start from ``Settings``), and its token cache's bound (token ids; the cache starts empty). None
    keeps the current value."""
    if cache_bytes:
        _CACHE_BYTES[0] = int(cache_bytes)
    if cache_dir:
        _CACHE_DIR[0] = str(cache_dir)
    if answer_cap_s:
        _ANSWER_CAP[0] = float(answer_cap_s)
    if token_cache_tokens:
        with _TOKENS_LOCK:
            _TOKENS[0] = _token_cache(token_cache_tokens)


def token_cache_stats() -> dict[str, int]:
    """The token cache's size: ``facts`` (entries, a fact of one version each), ``tokens`` (its weight: token ids
    plus one per entry) and ``max_tokens`` (its bound)."""
    with _TOKENS_LOCK:
        cache = _TOKENS[0]
        return {"facts": len(cache), "tokens": int(cache.currsize), "max_tokens": int(cache.maxsize)}


def open_store(root: str) -> Store:
    """This process's handle on the store at ``root``, reopened if the store was re-created there."""
    with _LOCK:
        st = _STORES.get(root)
        if st is None or st.replaced():
            if st is not None:
                st.close()
            st = _STORES[root] = Store.open(
                root, cache_bytes=_CACHE_BYTES[0], cache_dir=_CACHE_DIR[0], answer_cap_s=_ANSWER_CAP[0]
            )
        return st


def open_store_now(root: str) -> Store | None:
    """The handle on ``root`` this process already holds, without waiting: None if none is open, or if another
    thread holds the lock (it may be opening a store, and its I/O must not hold up the caller)."""
    if not _LOCK.acquire(blocking=False):
        return None
    try:
        return _STORES.get(root)
    finally:
        _LOCK.release()


def cache_stats() -> Counter:
    """The read caches' counters (hits, misses, bytes: ``Store.reads.cache_stats``) of every store open in this process,
    summed."""
    total: Counter = Counter()
    with _LOCK:
        for st in _STORES.values():
            total.update(st.reads.cache_stats())
    return total


def memory_token_ids(ref: MemoryRef, st: Store | None = None) -> list[int]:
    """The composed memory token ids ``[header][facts]`` ``ref`` names, from the metadata of ``st`` (default: this
    process's handle on ``ref.store``). O(1) store work (module docstring): each scope's version is read, and the
    rows of the named facts that the token cache lacks. Where scopes share a fact id the last scope's fact is the
    one named, as in ``UserKV.union``. Raises LookupError for a fact not in the memory, or a version no longer
    current."""
    st = st if st is not None else open_store(ref.store)
    scopes = ref.scopes()
    sid, wanted = st.manifest["store_id"], list(dict.fromkeys(ref.fact_ids))
    found: dict[str, tuple[int, ...]] = {}
    for user, version in scopes:
        keys = {fid: (ref.store, sid, user, version, fid) for fid in wanted}
        with _TOKENS_LOCK:
            cache = _TOKENS[0]
            known = {fid: cache[key] for fid, key in keys.items() if key in cache}
        missing = [fid for fid in wanted if fid not in known]
        if missing:  # the version read and these facts' rows, in one read transaction
            got = st.reads.fact_token_ids(user, version, missing)
            with _TOKENS_LOCK:
                for fid in missing:
                    known[fid] = got.get(fid)
                    try:
                        cache[keys[fid]] = known[fid]  # None too: not a live fact of this version
                    except ValueError:  # a fact longer than the whole bound: served, not cached
                        pass
        elif st.reads.version(user) != version:
            raise LookupError(f"memory version {version} of {user!r} is no longer current")
        found.update({fid: ids for fid, ids in known.items() if ids is not None})
    ids = list(st.header_token_ids)
    for fid in ref.fact_ids:
        if fid not in found:
            raise LookupError(f"fact {fid!r} is not in memory version {ref.version} of {ref.user!r}")
        ids.extend(found[fid])
    return ids


class Trust:
    """Which stores one connector side may inject from: those under ``allowed`` (fixed at engine start) whose
    fingerprint matches ``identity`` (the engine model's ``weights_sha256``, ``dtype``, KV shapes). Judged once per
    store instance: a store re-created at the same path is judged again."""

    def __init__(self, allowed, identity):
        self.allowed = list(allowed)
        self.identity = dict(identity)
        self._judged: dict[tuple[str, str], str | None] = {}  # (root, store_id) -> None if trusted, else why not

    def why_untrusted(self, root: str) -> str | None:
        """Why the store at ``root`` may not be injected into this engine (not allow-listed at engine start, or
        built by another model/dtype), or None. Opens the store (``open_store``) unless its path is not
        allowed."""
        if not within(root, self.allowed):
            return f"store {root} is not among the engine's allowed stores"
        st = open_store(root)
        key = (root, st.manifest["store_id"])
        if key not in self._judged:
            bad = [k for k, v in self.identity.items() if st.fingerprint.get(k) != v]
            self._judged[key] = f"store {root} was built by another model ({', '.join(bad)} differ)" if bad else None
        return self._judged[key]

    def judged_trusted(self, root: str, store_id: str) -> bool:
        """Whether this store instance was judged already, and trusted (no I/O)."""
        return self._judged.get((root, store_id), "not judged") is None
