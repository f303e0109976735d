"""Each engine process's own handles on the stores it may read, and the rule of which stores it trusts.

Both connector sides open a store themselves (nothing is shared with the API process but what a request carries);
a process keeps one handle per store root, reopened when the store is re-created at the same path. The trust rule
(allow-listed at engine start, built by this engine's model) is judged once per store instance.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ...store import Store, within
from .params import MemoryRef

_LOCK = threading.Lock()
_STORES: dict[str, Any] = {}
_CACHE_BYTES = [1 << 30]  # each store's cache bound in this process (``configure``)
_CACHE_DIR: list[str | None] = [None]  # this process's disk cache of remote segments (``configure``)
_ANSWER_CAP: list[float | None] = [None]  # this process's bound on a database answer, s (``configure``)
_FACT_TOKENS: dict[tuple[str, str, str], dict[str, tuple[int, ...]]] = {}


def configure(cache_bytes: int | None = None, cache_dir: str | None = None, answer_cap_s: float | None = None) -> None:
    """This process's store read-cache bound (bytes), disk cache folder and bound on a database's answer (s: the
    scheduler side's, whose reads hold the engine core), for stores opened from now on (the connector sets them at
    engine start; None keeps the current value)."""
    if cache_bytes:
        _CACHE_BYTES[0] = int(cache_bytes)
    if cache_dir:
        _CACHE_DIR[0] = str(cache_dir)
    if answer_cap_s:
        _ANSWER_CAP[0] = float(answer_cap_s)


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
            for k in [k for k in _FACT_TOKENS if k[0] == root]:
                del _FACT_TOKENS[k]
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
    """The read caches' counters (hits, misses, bytes: ``Store.cache_stats``) of every store open in this process,
    summed."""
    total: Counter = Counter()
    with _LOCK:
        for st in _STORES.values():
            total.update(st.cache_stats())
    return total


def fact_tokens(root: str, user: str, version: str) -> dict[str, tuple[int, ...]]:
    """fact_id -> token ids for ``user`` at ``version`` (metadata only; no KV is read). The version is checked
    against the store on every call, cached or not: a replaced memory is never served. Raises LookupError."""
    key = (root, user, version)
    st = open_store(root)
    if st.user_info(user)["version"] != version:
        raise LookupError(f"memory version {version} of {user!r} is no longer current")
    got = _FACT_TOKENS.get(key)
    if got is None:
        got = {f.fact_id: f.token_ids for f in st.snapshot(user, version).facts}  # rows only
        with _LOCK:
            for k in [k for k in _FACT_TOKENS if k[:2] == (root, user)]:
                del _FACT_TOKENS[k]
            _FACT_TOKENS[key] = got
    return got


def memory_token_ids(ref: MemoryRef) -> list[int]:
    """The composed memory token ids ``[header][facts]`` ``ref`` names (from the store's metadata). Raises
    LookupError for a fact not in the memory, or a version no longer current."""
    st = open_store(ref.store)
    facts: dict[str, tuple[int, ...]] = {}
    for user, version in ref.scopes():
        facts.update(fact_tokens(ref.store, user, version))
    ids = list(st.header_token_ids)
    for fid in ref.fact_ids:
        if fid not in facts:
            raise LookupError(f"fact {fid!r} is not in memory version {ref.version} of {ref.user!r}")
        ids.extend(facts[fid])
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
