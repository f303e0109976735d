"""The reading half of a load on the connector's worker side: the worker's own checks, then the facts' KV as stored.

A read runs on a loader thread (store and disk I/O), or at once when this process holds all of it in memory
(``read_from_memory``). It composes and writes nothing (``worker`` does), and imports nothing of vLLM, so it can be
checked on its own (``LoadReader(settings)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import Settings
from .metadata import KvmemLoad
from .stores import Trust, open_store, open_store_now

if TYPE_CHECKING:
    from ...store import Store, UserKV


@dataclass
class FactsRead:
    """What a read gives the write: the store, the memory (``UserKV``: the snapshot of the admitted versions), the
    rows of the load's facts in it and their stored spans (``UserKV.read``). ``stages``: the read's stages (ms:
    ``snapshot``, ``read``; ``in_memory``: 1 when nothing was read); compose and write add theirs. ``ms``: the
    read's wall time."""

    store: Store
    user_kv: UserKV
    rows: list[int]
    spans: list
    stages: dict
    ms: float


class LoadReader:
    """Reads loads for one worker: only from trusted stores (``stores.Trust``: the allow-list and fingerprint of
    ``settings``), with ``settings.load_delay_s`` added to each read of a delayed user's memory."""

    def __init__(self, settings: Settings):
        self.trust = Trust(settings.stores, settings.identity)
        self.load_delay_s = dict(settings.load_delay_s)

    def read(self, ld: KvmemLoad) -> FactsRead:
        """``ld``'s facts, after the worker's own checks: allowed store, matching fingerprint, the store the
        scheduler verified (not one re-created since), the KV format, the exact versions (one snapshot); then the
        gathered facts as stored (``UserKV.read``: the read cache, the disk cache or the store). Raises
        PermissionError (untrusted store), LookupError (re-created store, replaced version), ValueError (another
        KV format) or the store's error on a failed read."""
        t0 = time.perf_counter()
        ref = ld.ref
        delay = self.load_delay_s.get(ref.user)
        if delay:
            time.sleep(delay)
        why = self.trust.why_untrusted(ref.store)
        if why:
            raise PermissionError(why)
        st = open_store(ref.store)
        if ref.store_id and st.manifest["store_id"] != ref.store_id:
            raise LookupError(f"store {ref.store} was re-created since the scheduler checked the request")
        ref.check_store_kv_format(st)
        st.reads.header_kv()  # read once per store, here rather than on the engine's thread
        t1 = time.perf_counter()
        ukv = st.reads.snapshots(ref.scopes())  # raises if replaced; only the gathered facts are read
        rows_of = ukv.row_of()
        rows = [rows_of[f] for f in ref.fact_ids]
        if ref.cold:  # a load test's cold request: this process's read cache must not have it either
            st.reads.evict(ukv, rows, memory_only=True)
        stages: dict = {"in_memory": 0}
        spans = ukv.read(rows, stages)
        stages["snapshot"] = (time.perf_counter() - t1) * 1e3 - stages["read"]
        return FactsRead(st, ukv, rows, spans, stages, (time.perf_counter() - t0) * 1e3)

    def read_from_memory(self, ld: KvmemLoad) -> FactsRead | None:
        """``read(ld)`` without I/O or waiting on a lock, when this process holds all of it in memory: the very
        store the scheduler checked, open and judged trusted, the snapshot of exactly the admitted versions, and
        every fact in the read cache (``Store.reads.cached``). A version replaced since the scheduler admitted the
        request is served as admitted: its KV never changes, and the prompt carries its ids. None when anything
        must be read or waited for (then ``read`` on a loader thread), for a cold request, or for a delayed
        user."""
        ref, t0 = ld.ref, time.perf_counter()
        if ref.cold or self.load_delay_s.get(ref.user):  # a cold request, or a read held back on purpose
            return None
        st = open_store_now(ref.store)  # another thread opening a store: never wait on its I/O here
        if st is None or st.manifest["store_id"] != ref.store_id:
            return None
        if not self.trust.judged_trusted(ref.store, ref.store_id):
            return None
        try:
            ref.check_store_kv_format(st)
            got = st.reads.cached(ref.scopes(), list(ref.fact_ids))
        except Exception:  # the loader's read raises it properly
            return None
        if got is None:
            return None
        ukv, rows, spans = got
        ms = (time.perf_counter() - t0) * 1e3
        return FactsRead(st, ukv, rows, spans, {"snapshot": 0.0, "read": ms, "in_memory": 1}, ms)
