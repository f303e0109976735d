"""The read path of a store: snapshots (``UserKV``, one version of a user's memory from one read transaction), the
facts' KV read by span from their segments, the read tiers in front of them, and prefetch.

A reader takes rows from one read transaction, then reads only the facts it gathers from the segments it names
(``segments.read_spans``: pread or range requests, never a mapping), each segment verified against its SHA-256 once
per process. Reads look in the memory tier first (``tiers.MemoryTier``: facts' KV as stored), then the segments
(through a disk tier, ``tiers.DiskTier``, for a remote object store). A version replaced meanwhile reads as
LookupError once its segments are gone.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch
from cachetools import LRUCache
from safetensors.torch import load

from .. import kvformat
from ..scopes import IndexQuery
from . import segments as seg_files
from .location import StoreError, UnknownUser
from .records import FactRecord, UserKV, segment_name
from .rows import Rows, keyword_terms
from .tiers import MemoryTier, put_bounded

VERIFIED_SEGMENTS = 1 << 16  # segments whose checksum a Store remembers having verified (LRU, by count)


def _fact_key(f: FactRecord) -> tuple:
    """A fact's KV in the memory tier (``Reader.evict`` drops a segment's by the key's user and segment)."""
    return ("fact", f.user, f.segment, f.token_offset, f.num_tokens)


def _ukv_bytes(ukv: UserKV) -> int:
    return ukv.embeddings.nbytes + 256 * (len(ukv.facts) + len(ukv.segments))


def _locked(method):
    """Run a method under the store object's lock (its SQLite connection is shared across threads)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class Reader:
    """A store's read path: its rows' read queries, snapshots (cached per version), the facts' KV read through the
    memory tier and the segments, each segment verified once, and prefetch. Shares the store's ``lock`` (one
    connection, one transaction at a time); ``Store`` exposes it. Caches, each bounded by ``cache_bytes``:
    snapshots (rows, embeddings) and the memory tier (facts' KV as stored)."""

    def __init__(
        self, rows: Rows, segments: seg_files.SegmentStore, lock: threading.RLock, kv_format: str, cache_bytes: int
    ):
        self.rows, self.segments, self._lock, self.kv_format = rows, segments, lock, kv_format
        self.name = rows.name
        size = max(1, int(cache_bytes))
        self.snapshot_cache: LRUCache = LRUCache(maxsize=size, getsizeof=_ukv_bytes)
        self.memory = MemoryTier(size)  # facts' ``kvformat.SpanKV``, as stored
        # segments verified against their SHA-256 (identity -> layout), outside the byte budget: evicting one
        # would cost a whole-file re-hash on the next miss
        self.verified: LRUCache = LRUCache(maxsize=VERIFIED_SEGMENTS)
        self._header: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefetcher = None  # one thread for ``prefetch``, made on first use
        self._stats = {"kv_hits": 0, "kv_misses": 0, "kv_read_bytes": 0}  # facts served from the LRU / read
        self.watchers: list[Callable[[str, set[int] | None], None]] = []  # ``watch``

    def watch(self, callback: Callable[[str, set[int] | None], None]) -> None:
        """Call ``callback(user, live rows)`` whenever a snapshot finds ``user``'s memory changed since this object
        last read it (another process's commit, or this one's), with its live facts' store row ids, or None when
        it has none left: what a cache kept beside this store (``retrieve.IndexCache``) drops. Once per callback."""
        with self._lock:
            if callback not in self.watchers:
                self.watchers.append(callback)

    def _changed(self, user: str, live: list[FactRecord] | None) -> None:
        """Under the lock, as a snapshot finds ``user``'s memory changed: drop from this process's caches what is
        no longer live, the erased facts' KV (memory tier) and text and embeddings (the old snapshot), so an erasure
        by any process leaves nothing here past this process's next read of the user; then tell ``watchers``."""
        keep = {_fact_key(f) for f in live or ()}
        for key in self.memory.held():
            if key[0] == "fact" and key[1] == user and key not in keep:
                self.memory.remove(key)
        if live is None:
            self.snapshot_cache.pop(user, None)
        rows = None if live is None else {f.row for f in live}
        for callback in self.watchers:
            callback(user, rows)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)

    def rewrite_dtype(self) -> torch.dtype | None:
        """The dtype a rewrite of this store's KV reads it in: fp32 for a lossy format (exact dequantisation, so
        the same integers come back), else the stored dtype."""
        return torch.float32 if self.kv_format != "native" else None

    def forget(self, user: str | None = None, kv: bool = False) -> None:
        """Drop ``user``'s cached snapshot (None: every cache, and which segments were verified); ``kv``: its facts'
        KV too. After a write, fsck or reset."""
        with self._lock:
            if user is None:
                self.snapshot_cache.clear()
                self.memory.clear()
                self.verified.clear()
                return
            self.snapshot_cache.pop(user, None)
            if kv:
                for key in self.memory.held():
                    if key[1] == user:
                        self.memory.remove(key)

    def header_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Header pre-RoPE keys and raw values, [L, H, h, D] each."""
        if self._header is None:
            with self._lock:
                t = load(self.rows.header())
            self._header = (t["keys"], t["values"])
        return self._header

    def cache_stats(self) -> dict[str, int]:
        """This object's read counters: facts' KV served from its memory cache (``kv_hits``) or read from segments
        (``kv_misses``, ``kv_read_bytes``), the cache's size and evictions (``kv_cache_bytes``, ``kv_evictions``,
        ``kv_evicted_bytes``; stored bytes, so a quantised store holds more facts in the same bound), and the disk
        cache's, if any (``disk_hits``, ``disk_misses``, ``disk_fetched_bytes``, ``disk_errors``,
        ``disk_cache_bytes``, ``disk_evictions``)."""
        with self._lock:
            return {
                **self._stats,
                "kv_cache_bytes": self.memory.nbytes(),
                "kv_evictions": self.memory.evictions,
                "kv_evicted_bytes": self.memory.evicted_bytes,
                **self.segments.stats(),
            }

    @_locked
    def users(self, with_no_live_facts: bool = False) -> list[str]:
        """Users with at least one live fact (``with_no_live_facts``: every user ever written, too)."""
        return self.rows.users(with_no_live_facts)

    @_locked
    def user_page(
        self, prefix: str, contains: str = "", offset: int = 0, limit: int = 50
    ) -> tuple[int, list[tuple[str, int, int, float]]] | None:
        """One page of the users whose scope keys start with ``prefix`` (a tenant's ``"<tenant>:"``, or ``""``)
        and hold a live fact, by the scope index: each user's head (``scopes.index_parts``) with its live facts,
        their tokens and its last commit (Unix s), summed over its scopes (agent, run), ordered by head. Only
        ``contains`` (a substring of the user id, case-insensitive) is listed. Returns (how many users match,
        the page), or None for a store without the scope index. Costs the matching heads' index probes plus the
        page's own facts, whatever the rest of the store holds."""
        return self.rows.user_page(prefix, contains, offset, limit)

    @_locked
    def scope_keys(self, q: IndexQuery, live: bool = False) -> list[str] | None:
        """The store users the scope index files under ``q`` (``scopes.IndexQuery``; candidates, sorted), each
        by an index range, so the cost follows the matching scopes, not the store's size. ``live``: only those
        with a live fact (one indexed probe each). None when this store has no scope index (created before it):
        the caller lists ``users`` instead."""
        return self.rows.scope_keys(q, live)

    @_locked
    def version(self, user: str) -> str | None:
        """The user's current memory version (changes on every committed write), or None if never written: one
        row read by the users table's primary key, whatever the user's or the store's fact count."""
        return self.rows.version(user)

    @_locked
    def fact_token_ids(self, user: str, version: str, fact_ids: list[str]) -> dict[str, tuple[int, ...]]:
        """fact_id -> token ids of those of ``fact_ids`` that are live facts of ``user`` at ``version`` (ids not
        found are left out). One read transaction: the version's row, then these facts' rows alone, by the
        (user, fact_id) index of live facts, so the cost follows ``len(fact_ids)``, never the user's or the store's
        fact count. Raises LookupError if ``version`` is not the user's current one."""
        out = self.rows.fact_token_ids(user, version, fact_ids)
        if out is None:
            raise LookupError(f"memory version {version} of {user!r} is no longer current")
        return out

    @_locked
    def embedding_page(self, user: str, after: int, limit: int) -> tuple[list[int], list[str], torch.Tensor]:
        """Up to ``limit`` live facts of ``user`` whose store row is after ``after``, in row order: (rows, fact
        ids, embeddings [n, E] float32). Paging by row (the (user, deleted) index keeps each user's rows in row
        order), so a caller scoring a whole scope holds one page at a time, not the scope (``ingest``'s
        neighbour choice)."""
        page = self.rows.embedding_page(user, after, limit)
        if not page:
            return [], [], torch.empty(0, 0)
        emb = b"".join(e for _, _, e in page)
        return [r for r, _, _ in page], [f for _, f, _ in page], _floats(emb, len(page))

    @_locked
    def rows_token_ids(self, user: str, rows: list[int]) -> dict[int, tuple[str, tuple[int, ...]]]:
        """row -> (fact id, token ids) of those store ``rows`` that are live facts of ``user`` (rows not found
        are left out), read by primary key: the cost follows ``len(rows)``."""
        return self.rows.rows_token_ids(user, rows)

    @_locked
    def user_info(self, user: str) -> dict:
        """version, window, neighbours, history (history encoding), num_facts, num_tokens (live), source. Raises
        UnknownUser for an unknown user."""
        enc = self.encoding_of(user)
        n_facts, n_tokens = self.rows.live_count(user)
        if enc is None or n_facts == 0:
            known = ", ".join(self.users()[:20]) or "none"
            raise UnknownUser(f"unknown user {user!r} in store {self.name} (users: {known})")
        return {**enc, "num_facts": n_facts, "num_tokens": n_tokens}

    @_locked
    def encoding_of(self, user: str) -> dict | None:
        """How ``user``'s latest facts were encoded: version, window, neighbours, history, source; None if the
        user was never written (live facts or not)."""
        return self.rows.encoding(user)

    @_locked
    def fact(self, fact_id: str, user: str | None = None, within: str | None = None) -> FactRecord | None:
        """The live fact with this id (of ``user``, if given; of a user whose key starts with ``within``, a
        tenant's ``"<tenant>:"``, if given), or None. Ids are unique per user (``Memory`` ids are UUIDs, and
        tenants look ids up ``within`` their own keys, so an id one tenant holds is no sign to another); an id
        live for several users without ``user`` raises LookupError."""
        rows = self.rows.facts_with_id(fact_id, user, within)
        if len(rows) > 1:
            raise LookupError(f"memory id {fact_id!r} belongs to several users; name the user")
        return rows[0] if rows else None

    @_locked
    def history(self, fact_id: str, within: str | None = None) -> list[dict]:
        """Every event of a fact (of users whose key starts with ``within``, if given), oldest first: id,
        memory_id, user_id, event, old_memory, new_memory, created_at."""
        return self.rows.events(fact_id=fact_id, within=within)

    @_locked
    def events(self, user: str) -> list[dict]:
        """Every history event of ``user``'s facts, oldest first (``history``'s fields)."""
        return self.rows.events(user=user)

    @_locked
    def turns(self, user: str, last: int | None = None) -> list[dict]:
        """The user's stored conversation turns (oldest first; the ``last`` n): idx, dia_id, speaker, content, time."""
        return self.rows.turns(user, last)

    @_locked
    def stale(self, user: str | None = None) -> list[tuple[str, str, str, float]]:
        """Live facts whose KV awaits re-encoding after an erasure: (user, fact_id, segment, re-encode by (Unix
        s)), soonest first; of ``user``, or of every user."""
        return self.rows.stale(user)

    @_locked
    def totals(self) -> tuple[int, int]:
        """(live facts, turns) of the whole store."""
        return self.rows.totals()

    def segment_layout(self, user: str, segment: str, sha: str, handle) -> seg_files.SegmentLayout:
        """The layout of an open segment, verified against ``sha`` the first time this process reads it (and
        again whenever its identity changed since). Raises SegmentCorrupt."""
        ident = handle.identity()
        key = (user, segment)
        with self._lock:
            known = self.verified.get(key)
        if known is not None and known[0] == (sha, ident):
            return known[1]
        seg_files.verify(handle, sha)
        layout = seg_files.read_layout(handle)
        if layout.kv_format != self.kv_format:
            raise seg_files.SegmentCorrupt(f"holds {layout.kv_format} KV in a {self.kv_format} store")
        with self._lock:
            self.verified[key] = ((sha, ident), layout)
        return layout

    def prefetch(self, ukv: UserKV, rows: list[int]) -> list:
        """Start reading the KV of ``ukv.facts[rows]`` in the background ("prefetch along the retrieval path"): the
        segments' tier below this process (the page cache of a local file, the disk cache of a remote store) is
        warmed while the request goes on to the engine, whose reader (this store or the vLLM worker's) then
        finds them there. Returns at once, with a future per segment; never raises."""
        spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for r in rows:
            f = ukv.facts[r]
            spans.setdefault((f.user, f.segment), []).append((f.token_offset, f.num_tokens))
        if not spans:
            return []
        with self._lock:
            if self._prefetcher is None:
                from concurrent.futures import ThreadPoolExecutor

                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-prefetch")
        return [
            self._prefetcher.submit(self.segments.prefetch, segment_name(user, segment), s)
            for (user, segment), s in spans.items()
        ]

    def evict(self, ukv: UserKV, rows: list[int], memory_only: bool = False) -> None:
        """Drop the KV of ``ukv.facts[rows]`` from this process's read cache (the memory tier) and, unless
        ``memory_only``, their segments from the tiers below it (``SegmentStore.evict``: page cache, disk cache),
        so the next read of them is a cold one (load tests). Never raises."""
        segs = {(ukv.facts[r].user, ukv.facts[r].segment) for r in rows}
        with self._lock:
            for key in self.memory.held():
                if key[0] == "fact" and (key[1], key[2]) in segs:
                    self.memory.remove(key)
        if not memory_only:
            for user, segment in segs:
                self.segments.evict(segment_name(user, segment))

    def verify(self, user: str) -> int:
        """Verify every KV segment of ``user``'s current version against its checksum now (a reader otherwise
        verifies each on its first read); returns how many. Raises StoreError, UnknownUser."""
        ukv = self.snapshot(user)
        self.check_segments(ukv)
        return len(ukv.segments)

    def check_segments(self, ukv: UserKV) -> None:
        """Verify every segment of ``ukv`` against its checksum, and that each fact's span lies inside it (fsck:
        no KV is loaded). Raises StoreError."""
        for segment, sha in ukv.segments.items():
            try:
                handle = self.segments.open(segment_name(ukv.user, segment))
            except OSError as exc:
                raise StoreError(f"KV segment {segment} is missing or unreadable ({exc.strerror or exc})") from None
            try:
                layout = self.segment_layout(ukv.user, segment, sha, handle)
            except (seg_files.SegmentCorrupt, OSError) as exc:
                self.segments.discard(segment_name(ukv.user, segment))
                raise StoreError(f"KV segment {segment} {exc}") from None
            finally:
                handle.close()
            if any(f.token_offset + f.num_tokens > layout.num_tokens for f in ukv.facts if f.segment == segment):
                raise StoreError(f"KV segment {segment} is shorter than its fact rows say")

    def read_facts(
        self,
        ukv: UserKV,
        facts: list[FactRecord],
        timings: dict | None = None,
        dtype: torch.dtype | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        empty=None,
        spans: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``UserKV.gather``'s reader: the facts as stored (``read_spans``, unless given), dequantised together
        into the store's dtype."""
        parts = self.read_spans(ukv, facts, timings) if spans is None else spans
        if not parts and prefix is not None:
            return prefix
        if not parts:
            k, _ = self.header_kv()
            empty = k.new_zeros((*k.shape[:2], 0, k.shape[3]))
            return empty, empty.clone()
        t1 = time.perf_counter()
        kv = kvformat.assemble(parts, dtype or self.header_kv()[0].dtype, prefix, empty)
        if timings is not None:
            timings["dequantize"] = (time.perf_counter() - t1) * 1e3
        return kv

    def read_spans(self, ukv: UserKV, facts: list[FactRecord], timings: dict | None = None) -> list:
        """``UserKV.read``'s reader: cached facts from the LRU, the rest by span from their segment files, each
        kept as stored (``kvformat.SpanKV``) and put in the LRU."""
        t0 = time.perf_counter()
        parts: list = [None] * len(facts)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, f in enumerate(facts):
                parts[i] = self.memory.get(_fact_key(f))
                if parts[i] is None:
                    missing.setdefault((f.user, f.segment), []).append(i)
            n_missing = sum(map(len, missing.values()))
            self._stats["kv_misses"] += n_missing
            self._stats["kv_hits"] += len(facts) - n_missing
        versions = dict(ukv.versions())
        for (user, segment), idx in missing.items():
            where = f"store {self.name}: KV segment {segment} of user {user!r}"
            try:
                handle = self.segments.open(segment_name(user, segment))
            except FileNotFoundError:
                if self.version(user) != versions[user]:
                    raise LookupError(f"memory version {versions[user]} of {user!r} is no longer current") from None
                raise StoreError(f"{where} is missing (run `kvmem store fsck --store {self.name}`)") from None
            except OSError as exc:
                raise StoreError(f"{where} cannot be opened ({exc})") from None
            try:
                layout = self.segment_layout(user, segment, ukv.segment_sha(user, segment), handle)
                kvs = seg_files.read_spans(handle, layout, [(facts[i].token_offset, facts[i].num_tokens) for i in idx])
            except seg_files.SegmentCorrupt as exc:
                self.segments.discard(segment_name(user, segment))  # a cached copy: fetched again next time
                raise StoreError(f"{where} {exc}") from None
            except OSError as exc:  # EIO and the like: that read fails, the reader prefills instead
                raise StoreError(f"{where} cannot be read ({exc})") from None
            finally:
                handle.close()
            with self._lock:
                self._stats["kv_read_bytes"] += sum(kv.nbytes for kv in kvs)
                newer = self.snapshot_cache.get(user)  # read from a version since replaced: served, not kept
                keep = newer is None or newer.version == versions[user]
                for i, kv in zip(idx, kvs):
                    parts[i] = kv
                    if keep:
                        self.memory.put(_fact_key(facts[i]), kv)
        if timings is not None:
            timings["read"] = (time.perf_counter() - t0) * 1e3
        return parts

    @_locked
    def snapshot(self, user: str, version: str | None = None) -> UserKV:
        """One consistent version of ``user``'s memory: rows, embeddings and segment checksums from one read
        transaction. KV is not read here: ``UserKV.gather`` reads the facts it is asked for.

        ``version``: that exact version or LookupError (it was replaced); None: the current one. Cached per
        version. Raises UnknownUser for a user with no live memories.
        """
        current = self.version(user)
        if version is not None and current != version:
            raise LookupError(f"memory version {version} of {user!r} is no longer current")
        cached = self.snapshot_cache.get(user)
        if cached is not None and cached.version == current:
            return cached
        current, facts, emb, shas = self.rows.live_facts(user)
        if not facts:
            self._changed(user, None)
            raise UnknownUser(f"unknown user {user!r} in store {self.name} (no live memories)")
        if version is not None and current != version:
            raise LookupError(f"memory version {version} of {user!r} is no longer current")
        try:
            segments = {s: shas[s] for s in {f.segment for f in facts}}
        except KeyError:
            raise StoreError(f"store {self.name}: user {user!r} names a segment with no checksum row") from None
        embeddings = _floats(b"".join(emb), len(facts))
        ukv = UserKV(user, current, facts, segments, embeddings, self.read_facts, self.read_spans)
        self._changed(user, facts)
        put_bounded(self.snapshot_cache, user, ukv)
        return ukv

    def snapshots(self, versions: list[tuple[str, str | None]]) -> UserKV:
        """The union (``UserKV.union``) of several users' snapshots: ``(user, version)`` pairs, a version of
        None meaning the current one, where a user with no live memories is left out. Raises UnknownUser when
        none is left, LookupError when a given version was replaced."""
        parts = []
        for user, version in versions:
            try:
                parts.append(self.snapshot(user, version))
            except UnknownUser:
                if version is not None:
                    raise
        if not parts:
            raise UnknownUser(f"no live memories for {[u for u, _ in versions]!r} in store {self.name}")
        return UserKV.union(parts)

    def cached(self, versions: list[tuple[str, str]], fact_ids: list[str]) -> tuple[UserKV, list[int], list] | None:
        """The memory of exactly these (user, version) pairs and the stored spans of ``fact_ids`` (as ``snapshots``
        and ``read`` give them), when this object holds all of it in memory: each snapshot and every fact in the
        read cache. It does no I/O, not even the version check (a version's facts and KV never change; unlike
        ``snapshots`` it serves a version since replaced, whether that may be served is the caller's to know), and
        never waits: while another thread holds the store's lock (a read or a write under way) it returns None.
        Returns (memory, its rows of ``fact_ids``, their spans), or None when anything is missing; counts the hits
        only when it returns them."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            parts = [self.snapshot_cache.get(user) for user, _ in versions]
            if not parts or any(p is None or p.version != v for p, (_, v) in zip(parts, versions)):
                return None
            ukv = UserKV.union(parts)
            rows_of = ukv.row_of()
            if any(f not in rows_of for f in fact_ids):
                return None
            rows = [rows_of[f] for f in fact_ids]
            spans = [self.memory.get(_fact_key(ukv.facts[r])) for r in rows]
            if any(s is None for s in spans):
                return None
            self._stats["kv_hits"] += len(spans)
        finally:
            self._lock.release()
        return ukv, rows, spans

    @_locked
    def has_text_index(self) -> bool:
        """Whether the store has its full-text index (stores created before hybrid search do not:
        ``Writer.add_text_index``)."""
        return self.rows.has_text_index()

    @_locked
    def keyword(self, user: str, query: str, limit: int) -> list[tuple[int, float]] | None:
        """The ``limit`` live facts of ``user`` whose text best matches the words of ``query`` (full-text index,
        ``Rows.keyword``): ``[(row, score)]``, best first, as of the latest commit; None when the store has no
        full-text index (created before it)."""
        if not self.rows.has_text_index():
            return None
        return self.rows.keyword(user, keyword_terms(query), limit)

    @_locked
    def changes(self, user: str, since: str) -> tuple[list[tuple[int, torch.Tensor]], list[int]] | None:
        """What changed in ``user``'s live facts after version ``since``: (added [(row, embedding [E])], removed
        rows), for incremental index updates; None if a compaction since then requires a full rebuild."""
        got = self.rows.changes(user, int(since))
        if got is None:
            return None
        added, removed = got
        return [(r, torch.frombuffer(bytearray(e), dtype=torch.float32)) for r, e in added], removed


def _floats(data: bytes, n: int) -> torch.Tensor:
    """``n`` float32 embeddings stored back to back: [n, E]."""
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(n, -1)
