"""A memory store: fact rows, tombstones, history and turns (``rows``), KV segments (``segments``), one interface.

Two backends, chosen by location; callers never know which they hold:

* a local directory (the embedded default)::

    manifest.json            format, store_id, model fingerprint, header text + token ids, embedder
    header.safetensors       header pre-RoPE keys / raw values, [L, H, h, D]
    meta.sqlite              meta (the version counter; per-user encoding neighbours, history), users, segments
                             (sha256), facts (rows, embeddings, added/deleted versions), history (events),
                             turns (the raw conversation)
    users/<user>.<segment>.kv.safetensors    keys / values of the facts one commit added, [n, L, H, D]
                                             (token-major: a fact is one byte range; ``segments``)

* a shared store: the same rows in PostgreSQL (``postgresql://…``; ``rows.PostgresRows``, the manifest and header
  in ``kvmem_manifest``), and the segments as objects in an object store. With ``segments_url`` in the manifest
  (required for PostgreSQL) the segments are objects there (obstore: file://, s3://, gs://), under the same names.

Writes (``commit``, the one write path) append: a new segment, durable (fsynced with its directory, or an object
store's completed put), then one transaction that inserts the new fact rows, tombstones deleted ones (``deleted``
= the commit's version), appends turns and history, and moves the user to a new version taken from a store-wide
counter (a sequence on PostgreSQL; versions never repeat, even after ``reset``). A crash or power loss at any
point leaves the previous version readable; segments no row points at are orphans that ``fsck`` removes.
``compact`` rewrites a user's live facts into one segment and drops dead rows. Writers serialize per user
(``Rows.locked``: the directory's file lock, which serializes all writers; PostgreSQL advisory locks, so writes
for different users proceed at once); one ``Store`` object may be shared by threads (a lock guards its
connection). Readers take rows from one read transaction (one snapshot), then read only the facts they gather
from the segments it names (``segments.read_spans``: pread or range requests, never a mapping), each segment
verified against its SHA-256 once per process. A segment that a commit replaces stays for ``retire_after_s``
(60 s), so a reader still working from the snapshot before that commit reads its KV; past that, it gets
LookupError and takes a new snapshot. Stored KV carries the model fingerprint; opening a store with another model
is refused (``StoreMismatch``). Opening never writes (no DDL): the schema is made by ``create`` and its version
checked on open.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from cachetools import LRUCache
from safetensors.torch import load, save

from . import kvformat
from . import rows as rows_db
from . import segments as seg_files
from .policy import check_store_user
from .rows import (  # noqa: F401 -- re-exported
    SCHEMA_VERSION,
    Rows,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    is_url,
    redact,
)

FORMAT_VERSION = 3  # manifest format; 3: incremental segments (older stores must be re-ingested)
DISK_CACHE_BYTES = 16 << 30  # default bound of a reader's local disk cache of remote segments (--cache-dir), bytes
CACHE_BYTES = 1 << 30  # default LRU bound of each of a Store's caches (snapshots, KV segments), bytes
VERIFIED_SEGMENTS = 1 << 16  # segments whose checksum a Store remembers having verified (LRU, by count)
RETIRE_AFTER_S = 60.0  # a replaced segment's file is removed this long after its last live fact, s
ALL = "\x00all"  # commit(delete=ALL): every fact live at commit time
logger = logging.getLogger("kvmem.store")


class UnknownUser(StoreError):
    """The user has no live memories in this store (never written, or every fact deleted)."""


class StoreMismatch(StoreError):
    """The store's KV was produced by a different model, tokenizer, dtype or RoPE config."""


class StoreDtypeMismatch(StoreMismatch):
    """Same model, but the store's KV was computed in another dtype than the one serving it."""


@dataclass(frozen=True)
class FactRecord:
    """One stored fact. ``token_offset`` indexes its ``segment``'s [.., n, ..] tensors; ``row`` is the store's
    stable row id (the vector index id); times are Unix seconds."""

    fact_id: str
    user: str
    text: str
    speaker: str
    source_turn: str
    date: str
    token_ids: tuple[int, ...]
    token_offset: int = 0
    window: int = 0
    segment: str = ""
    row: int = 0
    metadata: str = "{}"  # JSON
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class UserKV:
    """One version of a user's memory: its live facts (row order), their embeddings, and its KV segments.

    ``segments``: segment name -> SHA-256 of the file; fact ``i`` owns tokens ``token_offset .. +num_tokens`` of
    its segment. ``embeddings``: [F, E] float32, L2-normalised, row ``i`` = ``facts[i]``. KV is read lazily, by
    fact (``gather``), through the store that took the snapshot."""

    user: str
    version: str
    facts: list[FactRecord]
    segments: dict[str, str]
    embeddings: torch.Tensor
    reader: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    span_reader: Callable[..., list] | None = field(default=None, repr=False)  # ``read``'s: spans as stored
    parts: tuple[UserKV, ...] = ()  # a union's partitions (``union``); () for one user's snapshot

    @classmethod
    def union(cls, parts: list[UserKV]) -> UserKV:
        """Several users' snapshots (entity scopes, ``scopes``) read as one memory: facts and embeddings in
        ``parts`` order, positions offset by the parts before. ``user`` (a JSON list of the users) and ``version``
        (their versions, comma-joined) name exactly this set of versions, so a cache salt over them covers every
        scope it used. One part is returned as it is."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ValueError("a union needs at least one snapshot")
        return cls(
            json.dumps([p.user for p in parts]),
            ",".join(p.version for p in parts),
            [f for p in parts for f in p.facts],
            {(p.user, s): sha for p in parts for s, sha in p.segments.items()},
            torch.cat([p.embeddings for p in parts]),
            parts[0].reader,
            parts[0].span_reader,
            tuple(parts),
        )

    def versions(self) -> list[tuple[str, str]]:
        """(user, version) of each partition: [(self.user, self.version)] for one user's snapshot."""
        return [(p.user, p.version) for p in self.parts] or [(self.user, self.version)]

    def segment_sha(self, user: str, segment: str) -> str:
        return self.segments[(user, segment) if self.parts else segment]

    def row_of(self) -> dict[str, int]:
        """fact_id -> position in ``facts`` (and in ``embeddings``)."""
        return {f.fact_id: i for i, f in enumerate(self.facts)}

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """store row id -> position in ``facts`` (what the vector index returns -> what compose takes)."""
        return {f.row: i for i, f in enumerate(self.facts)}

    def fact_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and raw values of ``facts[i]``: [L, H, n_i, D] each."""
        return self.gather([i])

    def read(self, rows: list[int], timings: dict | None = None) -> list:
        """The stored KV of ``facts[rows]``, as stored (``kvformat.SpanKV`` each, not dequantised): ``gather``'s
        reads alone, from the read cache or the segments, for a caller that assembles them elsewhere (the vLLM
        worker reads on a loader thread and assembles on the engine's). ``timings`` gets ``read`` (ms). Raises
        as ``gather`` does."""
        if self.span_reader is None:
            raise StoreError(f"this snapshot of {self.user!r} has no store to read its KV from")
        return self.span_reader(self, [self.facts[r] for r in rows], timings)

    def gather(
        self,
        rows: list[int],
        timings: dict | None = None,
        dtype: torch.dtype | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        empty=None,
        spans: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``facts[rows]`` concatenated in that order: [L, H, sum n_i, D] each, in the model
        dtype. Reads only those facts' bytes (``segments.read_spans``), each segment verified once per process.
        ``timings``: gets ``read`` (cache and segment reads; not when ``spans`` are given) and ``dequantize``
        (assembly) in ms. ``dtype``: of the result (default the model's; rewrites of a lossy store take fp32, where
        dequantisation is exact).
        ``prefix``: keys, values [L, H, h, D] (the header) put first, in the same single copy. ``empty``: where
        the result goes (``kvformat.assemble``). ``spans``: what ``read(rows)`` returned, assembled without
        reading again.

        Raises LookupError if this version was replaced and its files removed meanwhile, StoreError if a
        segment is missing, truncated or corrupt."""
        if self.reader is None:
            raise StoreError(f"this snapshot of {self.user!r} has no store to read its KV from")
        if spans is not None and len(spans) != len(rows):
            raise ValueError(f"{len(spans)} spans for {len(rows)} rows")
        return self.reader(self, [self.facts[r] for r in rows], timings, dtype, prefix, empty, spans)

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self.facts)

    @functools.cached_property
    def expiring(self) -> dict[int, str]:
        """store row id -> ``expiration_date`` (YYYY-MM-DD, Mem0's metadata field) of the facts that have one."""
        if self.parts:  # each part's map is cached with its snapshot
            return {r: d for p in self.parts for r, d in p.expiring.items()}
        out = {}
        for f in self.facts:
            if '"expiration_date"' in f.metadata:
                exp = json.loads(f.metadata).get("expiration_date")
                if isinstance(exp, str):
                    out[f.row] = exp
        return out

    def unexpired(self, today: str | None = None) -> set[int] | None:
        """Store row ids of the facts not expired on ``today`` (YYYY-MM-DD, default the current UTC date; a fact
        expires after its date), or None when none has expired (every row may be served)."""
        today = today or datetime.now(UTC).date().isoformat()
        gone = {r for r, d in self.expiring.items() if d < today}
        return None if not gone else {f.row for f in self.facts} - gone


_FACT_COLS = (
    'fact_id, "user", text, speaker, source_turn, date, token_ids, token_offset, "window", segment, "row", '
    "metadata, created_at, updated_at"
)


def _fact(r) -> FactRecord:
    return FactRecord(
        r[0],
        r[1],
        r[2],
        r[3] or "",
        r[4] or "",
        r[5] or "",
        tuple(json.loads(r[6])),
        r[7],
        r[8],
        r[9],
        r[10],
        r[11],
        r[12],
        r[13],
    )


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


def _fact_key(f: FactRecord) -> tuple:
    """A fact's KV in the read cache (``Store.evict`` drops a segment's by the key's user and segment)."""
    return ("fact", f.user, f.segment, f.token_offset, f.num_tokens)


def _cache_put(cache: LRUCache, key, value) -> None:
    try:
        cache[key] = value
    except ValueError:  # larger than the whole cache: served, not cached
        cache.pop(key, None)


def _ukv_bytes(ukv: UserKV) -> int:
    return ukv.embeddings.nbytes + 256 * (len(ukv.facts) + len(ukv.segments))


def _safe(user: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:64] + "-" + hashlib.sha256(user.encode()).hexdigest()[:8]


def _locked(method):
    """Run a Store method under the store object's lock (its SQLite connection is shared across threads)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def check_segments_url(store: Store, url: str | None) -> None:
    """``--segments URL`` given for an existing store must be where its segments are. Raises StoreError."""
    have = store.manifest.get("segments_url")
    if url is not None and url != have:
        raise StoreError(
            f"store {store.name} keeps its KV segments {'at ' + repr(have) if have else 'in its own directory'}; "
            f"--segments applies only when a store is created"
        )


def check_kv_format(store: Store, kv_format: str | None) -> None:
    """``--kv-format`` given for an existing store must be its format (fixed at creation). Raises StoreError."""
    if kv_format is not None and kvformat.check_format(kv_format) != store.kv_format:
        raise StoreError(
            f"store {store.name} holds KV in format {store.kv_format}; --kv-format applies only when a store is "
            f"created (`kvmem store copy --kv-format {kv_format}` makes a copy in that format)"
        )


def fingerprint_diff(a: dict, b: dict) -> list[str]:
    return [
        f"{k}: store has {a.get(k)!r}, model has {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


class Store:
    """One store of users' memory: its rows (``rows.Rows``: a local directory's SQLite, or PostgreSQL) and its KV
    segments (``segments.SegmentStore``: the directory's ``users/``, or an object store by URL). Use
    ``Store.create`` / ``Store.open``; callers never know which backends they hold.

    ``root``: the location it was opened at (a ``Path``, or the ``postgresql://`` URL) and reopens it; ``name``:
    the same without credentials, for messages."""

    def __init__(
        self,
        rows: Rows,
        manifest: dict,
        cache_bytes: int = CACHE_BYTES,
        cache_dir: str | Path | None = None,
        cache_dir_bytes: int = DISK_CACHE_BYTES,
    ):
        self.rows = rows
        self.root = rows.location
        self.name = rows.name
        self.manifest = manifest
        self._lock = threading.RLock()  # one connection, shared by threads: one transaction at a time
        # caches, LRU-bounded by bytes: snapshots (rows, embeddings); facts' KV and verified segment layouts
        size = max(1, int(cache_bytes))
        self._user_cache: LRUCache = LRUCache(maxsize=size, getsizeof=_ukv_bytes)
        self._kv = CountingLRU(size, getsizeof=lambda kv: kv.nbytes)  # facts' ``kvformat.SpanKV``, as stored
        # segments verified against their SHA-256 (identity -> layout), outside the byte budget: evicting one
        # would cost a whole-file re-hash on the next miss
        self._verified: LRUCache = LRUCache(maxsize=VERIFIED_SEGMENTS)
        self._header: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefetcher = None  # one thread for ``prefetch``, made on first use
        self._stats = {"kv_hits": 0, "kv_misses": 0, "kv_read_bytes": 0}  # facts served from the LRU / read
        try:
            self.segments = seg_files.open_segments(
                rows.segments_dir,
                manifest.get("segments_url"),
                manifest.get("store_id", ""),
                cache_dir,
                cache_dir_bytes,
            )
        except Exception as exc:  # a bad segments URL, a --cache-dir that is a file or unwritable
            where = f" (--cache-dir {cache_dir})" if cache_dir is not None else ""
            raise StoreError(f"{' '.join(str(exc).split())[:300]}{where}") from None
        self.retire_after_s = RETIRE_AFTER_S  # how long a replaced segment's file outlives its last row, s
        self.write_timeout_s: float | None = (
            None  # how long a write waits for another writer (None: as long as it takes)
        )

    # --- lifecycle -----------------------------------------------------------------------------------

    @staticmethod
    def exists(root: str | Path) -> bool:
        """Whether a store is at ``root`` (a directory or a ``postgresql://`` URL). Raises StoreError for a URL
        of another kind, or a database that cannot be reached."""
        rows = rows_db.open_rows(root)
        try:
            return rows.exists()
        finally:
            rows.close()

    @classmethod
    def create(
        cls,
        root: str | Path,
        fingerprint: dict,
        header_text: str,
        header_token_ids: list[int],
        header_keys: torch.Tensor,
        header_values: torch.Tensor,
        embedder: dict,
        cache_bytes: int = CACHE_BYTES,
        segments_url: str | None = None,
        kv_format: str | None = None,
    ) -> Store:
        """Create a new store at ``root``: a directory that must not hold one, or a ``postgresql://`` URL of a
        database (or schema) without one. Header K/V: [L, H, h, D] pre-RoPE / raw (always kept lossless).
        ``segments_url``: keep the KV segments in that object store (``file://…``, ``s3://…``; obstore) instead of
        the directory's ``users/``; required for a PostgreSQL store. ``kv_format``: how segments hold KV
        (``kvformat``; None: as ``fingerprint`` says, else ``native``); recorded in the fingerprint when lossy.
        Raises StoreError, ValueError (an unknown format)."""
        kv_format = kvformat.check_format(kv_format or kvformat.format_of(fingerprint))
        fingerprint = {k: v for k, v in fingerprint.items() if k != "kv_format"}
        if kv_format != "native":
            fingerprint["kv_format"] = kv_format
        rows = rows_db.open_rows(root)
        if segments_url is None and is_url(root):
            rows.close()
            raise StoreError(
                f"a store on {rows.name} is shared, so its KV segments must be too: give --segments URL "
                f"(s3://bucket/prefix, gs://…, or file:///mnt/shared/kv on a mounted volume)"
            )
        manifest = {
            "format": FORMAT_VERSION,
            "store_id": uuid.uuid4().hex,  # in the vLLM cache salt: no two stores share prefix-cache blocks
            "created": time.time(),
            "fingerprint": fingerprint,
            "header": {"text": header_text, "token_ids": list(header_token_ids)},
            "embedder": embedder,
            "segments_url": segments_url,
        }
        try:
            rows.check_new()
            if segments_url is not None:  # reachable before anything is written
                try:
                    seg_files.open_segments(None, segments_url, manifest["store_id"]).names()
                except Exception as exc:  # obstore's errors: a bad URL, a missing bucket, no credentials, no network
                    why = " ".join(str(exc).split())[:300]
                    raise StoreError(f"--segments {redact(segments_url)} cannot be used: {why}") from None
            rows.create(manifest, save({"keys": header_keys.contiguous(), "values": header_values.contiguous()}))
        except BaseException:
            rows.close()
            raise
        return cls(rows, manifest, cache_bytes=cache_bytes)

    @classmethod
    def open(
        cls,
        root: str | Path,
        fingerprint: dict | None = None,
        cache_bytes: int = CACHE_BYTES,
        cache_dir: str | Path | None = None,
        cache_dir_bytes: int = DISK_CACHE_BYTES,
    ) -> Store:
        """Open an existing store (a directory or a ``postgresql://`` URL). If ``fingerprint`` is given it must
        equal the store's. ``cache_bytes``: this object's in-memory caches (snapshots, facts' KV), each;
        ``cache_dir``: a local disk cache of up to ``cache_dir_bytes`` for segments in an object store.

        Raises:
            StoreError: no store at ``root``, or a database that cannot be reached.
            StoreMismatch: the store was produced by another model/tokenizer/dtype/RoPE config.
        """
        rows = rows_db.open_rows(root)
        try:
            manifest = rows.manifest()
            cls._check_manifest(rows.name, manifest, fingerprint)
            return cls(rows, manifest, cache_bytes, cache_dir, cache_dir_bytes)
        except BaseException:
            rows.close()
            raise

    @staticmethod
    def _check_manifest(name: str, manifest, fingerprint: dict | None) -> None:
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise StoreError(f"{name}: store format {got} is not {FORMAT_VERSION}; re-ingest it into a new store")
        if (
            not isinstance(manifest.get("fingerprint"), dict)
            or not isinstance(manifest.get("header"), dict)
            or not isinstance(manifest.get("embedder"), dict)
            or not isinstance(manifest.get("store_id"), str)
        ):
            raise StoreError(f"{name}: the manifest is corrupt: fingerprint, header, embedder or store_id missing")
        if fingerprint is None:
            return
        theirs, ours = dict(manifest["fingerprint"]), dict(fingerprint)
        if "kv_format" in ours:  # a store's fingerprint: the KV format must match too
            theirs["kv_format"], ours["kv_format"] = kvformat.format_of(theirs), kvformat.format_of(ours)
        else:  # a model's fingerprint: the model reads any format
            theirs.pop("kv_format", None)
        if theirs != ours:
            differ = {k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)}
            if differ == {"kv_format"}:
                raise StoreMismatch(
                    f"store {name} holds KV in format {theirs['kv_format']}, not {ours['kv_format']}; a store's KV "
                    f"format is fixed when it is created (`kvmem store copy --kv-format` makes a quantised copy)"
                )
            if differ == {"dtype"}:
                raise StoreDtypeMismatch(
                    f"store {name} holds KV computed in {theirs['dtype']}, but this run computes in {ours['dtype']}; "
                    f"KV is never served in another dtype than it was computed in. Either pass "
                    f"--dtype {theirs['dtype']} (see `kvmem doctor` for what is fast here), or re-encode the memories "
                    f"into a new store: `kvmem ingest-locomo` or `kvmem memory add` again, with --store NEW_DIR "
                    f"--dtype {ours['dtype']}"
                )
            diff = fingerprint_diff(theirs, ours)
            raise StoreMismatch(
                f"store {name} was built with model {theirs.get('model')!r} and does not match "
                f"the loaded model {ours.get('model')!r}; refusing to inject its KV ({'; '.join(diff[:3])})"
            )

    def check_serves(self, model: str | None = None, dtype: str | None = None) -> None:
        """What opening with the model's fingerprint would refuse, checked before the model loads: another model
        name, or another dtype than the stored KV's (the rest of the fingerprint is checked once it loads).
        Raises StoreMismatch, StoreDtypeMismatch."""
        expected = dict(self.fingerprint)
        if model is not None:
            expected["model"] = model
        if dtype is not None and "dtype" in expected:
            expected["dtype"] = dtype
        self._check_manifest(self.name, self.manifest, expected)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)
        self.rows.close()

    def replaced(self) -> bool:
        """Whether the store at ``root`` was deleted or created anew since this object opened it."""
        with self._lock:
            return self.rows.replaced()

    # --- reads ----------------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> dict:
        """What produced the stored KV: the model's fingerprint (``models.fingerprint``), plus ``kv_format`` for a
        lossy store."""
        return self.manifest["fingerprint"]

    @property
    def kv_format(self) -> str:
        """How the segments hold KV (``kvformat``): ``native`` (lossless), ``int8`` or ``fp8``."""
        return kvformat.format_of(self.manifest["fingerprint"])

    @property
    def header_token_ids(self) -> list[int]:
        return list(self.manifest["header"]["token_ids"])

    def header_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Header pre-RoPE keys and raw values, [L, H, h, D] each."""
        if self._header is None:
            with self._lock:
                t = load(self.rows.header())
            self._header = (t["keys"], t["values"])
        return self._header

    @property
    @_locked
    def busy_timeout_s(self) -> float:
        """How long this store's SQLite connection waits for another process's write lock, s (local stores)."""
        return self.rows.busy_timeout_s

    def drop_caches(self) -> None:
        """Forget cached snapshots and segments: the next read goes to disk (tests of what a cold reader sees)."""
        with self._lock:
            self._user_cache.clear()
            self._kv.clear()
            self._verified.clear()

    def cache_stats(self) -> dict[str, int]:
        """This object's read counters: facts' KV served from its memory cache (``kv_hits``) or read from segments
        (``kv_misses``, ``kv_read_bytes``), the cache's size and evictions (``kv_cache_bytes``, ``kv_evictions``,
        ``kv_evicted_bytes``; stored bytes, so a quantised store holds more facts in the same bound), and the disk
        cache's, if any (``disk_hits``, ``disk_misses``, ``disk_fetched_bytes``, ``disk_errors``,
        ``disk_cache_bytes``, ``disk_evictions``)."""
        with self._lock:
            return {
                **self._stats,
                "kv_cache_bytes": int(self._kv.currsize),
                "kv_evictions": self._kv.evictions,
                "kv_evicted_bytes": self._kv.evicted_bytes,
                **self.segments.stats(),
            }

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of fact KV (and verified segment layouts) this Store object holds in its LRU cache."""
        return int(self._kv.currsize)

    def disk_bytes(self) -> int:
        """Bytes of the store: its rows (the directory, or the PostgreSQL tables) and its segments, wherever they
        live. A file a concurrent writer removes during the walk counts 0."""
        with self._lock:
            rows = self.rows.nbytes()
        return rows + self.segments.nbytes()

    @_locked
    def users(self, with_no_live_facts: bool = False) -> list[str]:
        """Users with at least one live fact (``with_no_live_facts``: every user ever written, too)."""
        q = 'SELECT DISTINCT "user" FROM facts WHERE deleted IS NULL ORDER BY "user"'
        if with_no_live_facts:
            q = 'SELECT "user" FROM users ORDER BY "user"'
        return [r[0] for r in self.rows.execute(q)]

    @_locked
    def version(self, user: str) -> str | None:
        """The user's current memory version (changes on every committed write), or None if never written."""
        row = self.rows.execute('SELECT version FROM users WHERE "user"=?', (user,)).fetchone()
        return None if row is None else str(row[0])

    @_locked
    def user_info(self, user: str) -> dict:
        """version, window, neighbours, history (history encoding), num_facts, num_tokens (live), source. Raises
        StoreError for an unknown user."""
        enc = self.encoding_of(user)
        n = self.rows.execute(
            f'SELECT COUNT(*), COALESCE(SUM({self.rows.tokens_sql}), 0) FROM facts WHERE "user"=? AND deleted IS NULL',
            (user,),
        ).fetchone()
        if enc is None or n[0] == 0:
            known = ", ".join(self.users()[:20]) or "none"
            raise UnknownUser(f"unknown user {user!r} in store {self.name} (users: {known})")
        return {**enc, "num_facts": int(n[0]), "num_tokens": int(n[1])}

    @_locked
    def encoding_of(self, user: str) -> dict | None:
        """How ``user``'s latest facts were encoded: version, window, neighbours, history, source; None if the
        user was never written (live facts or not)."""
        row = self.rows.execute('SELECT version, "window", source FROM users WHERE "user"=?', (user,)).fetchone()
        if row is None:
            return None
        m = self.rows.execute("SELECT value FROM meta WHERE key=?", (f"neighbours:{user}",)).fetchone()
        h = self.rows.execute("SELECT value FROM meta WHERE key=?", (f"history:{user}",)).fetchone()
        return {
            "version": str(row[0]),
            "window": row[1],
            "neighbours": int(m[0]) if m else 0,
            "history": bool(h[0]) if h else False,
            "source": row[2],
        }

    def facts(self, user: str) -> list[FactRecord]:
        return self.snapshot(user).facts

    @_locked
    def fact(self, fact_id: str, user: str | None = None) -> FactRecord | None:
        """The live fact with this id (of ``user``, if given), or None. Ids are unique per user (``Memory`` ids
        are UUIDs); an id live for several users without ``user`` raises LookupError."""
        rows = self.rows.execute(
            f"SELECT {_FACT_COLS} FROM facts WHERE fact_id=? AND deleted IS NULL "
            + ('AND "user"=? ' if user is not None else "")
            + 'ORDER BY "row"',
            (fact_id, user) if user is not None else (fact_id,),
        ).fetchall()
        if len(rows) > 1:
            raise LookupError(f"memory id {fact_id!r} belongs to several users; name the user")
        return _fact(rows[0]) if rows else None

    def history(self, fact_id: str) -> list[dict]:
        """Every event of a fact, oldest first: id, memory_id, user_id, event, old_memory, new_memory, created_at."""
        return self._events("fact_id", fact_id)

    def events(self, user: str) -> list[dict]:
        """Every history event of ``user``'s facts, oldest first (``history``'s fields)."""
        return self._events('"user"', user)

    @_locked
    def _events(self, column: str, value: str) -> list[dict]:
        q = 'SELECT id, fact_id, "user", event, old_memory, new_memory, time FROM history WHERE '
        q += f"{column}=? ORDER BY id"
        return [
            dict(zip(("id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at"), r))
            for r in self.rows.execute(q, (value,))
        ]

    @_locked
    def turns(self, user: str, last: int | None = None) -> list[dict]:
        """The user's stored conversation turns (oldest first; the ``last`` n): idx, dia_id, speaker, content, time."""
        q = 'SELECT idx, dia_id, speaker, content, time FROM turns WHERE "user"=? ORDER BY idx DESC LIMIT ?'
        rows = self.rows.execute(q, (user, 1 << 62 if last is None else max(last, 0))).fetchall()
        return [dict(zip(("idx", "dia_id", "speaker", "content", "time"), r)) for r in reversed(rows)]

    def segment_name(self, user: str, segment: str) -> str:
        """The object name of ``user``'s KV segment ``segment`` in ``self.segments`` (immutable once committed)."""
        return f"{_safe(user)}.{segment}.kv.safetensors"

    def segment_path(self, user: str, segment: str) -> Path | None:
        """The file of ``user``'s KV segment on this machine (tools, tests), or None in an object store."""
        return self.segments.local_path(self.segment_name(user, segment))

    def _segment_layout(self, user: str, segment: str, sha: str, handle) -> seg_files.SegmentLayout:
        """The layout of an open segment, verified against ``sha`` the first time this process reads it (and
        again whenever its identity changed since). Raises SegmentCorrupt."""
        ident = handle.identity()
        key = (user, segment)
        with self._lock:
            known = self._verified.get(key)
        if known is not None and known[0] == (sha, ident):
            return known[1]
        seg_files.verify(handle, sha)
        layout = seg_files.read_layout(handle)
        if layout.kv_format != self.kv_format:
            raise seg_files.SegmentCorrupt(f"holds {layout.kv_format} KV in a {self.kv_format} store")
        with self._lock:
            self._verified[key] = ((sha, ident), layout)
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
            self._prefetcher.submit(self.segments.prefetch, self.segment_name(user, segment), s)
            for (user, segment), s in spans.items()
        ]

    def evict(self, ukv: UserKV, rows: list[int], memory_only: bool = False) -> None:
        """Drop the KV of ``ukv.facts[rows]`` from this process's read cache (the memory tier) and, unless
        ``memory_only``, their segments from the tiers below it (``SegmentStore.evict``: page cache, disk cache),
        so the next read of them is a cold one (load tests). Never raises."""
        segs = {(ukv.facts[r].user, ukv.facts[r].segment) for r in rows}
        with self._lock:
            for key in [k for k in self._kv if k[0] == "fact" and (k[1], k[2]) in segs]:
                self._kv.pop(key, None)
        if not memory_only:
            for user, segment in segs:
                self.segments.evict(self.segment_name(user, segment))

    def verify(self, user: str) -> int:
        """Verify every KV segment of ``user``'s current version against its checksum now (a reader otherwise
        verifies each on its first read); returns how many. Raises StoreError, UnknownUser."""
        ukv = self.snapshot(user)
        self._check_segments(ukv)
        return len(ukv.segments)

    def _check_segments(self, ukv: UserKV) -> None:
        """Verify every segment of ``ukv`` against its checksum, and that each fact's span lies inside it (fsck:
        no KV is loaded). Raises StoreError."""
        for segment, sha in ukv.segments.items():
            try:
                handle = self.segments.open(self.segment_name(ukv.user, segment))
            except OSError as exc:
                raise StoreError(f"KV segment {segment} is missing or unreadable ({exc.strerror or exc})") from None
            try:
                layout = self._segment_layout(ukv.user, segment, sha, handle)
            except (seg_files.SegmentCorrupt, OSError) as exc:
                self.segments.discard(self.segment_name(ukv.user, segment))
                raise StoreError(f"KV segment {segment} {exc}") from None
            finally:
                handle.close()
            if any(f.token_offset + f.num_tokens > layout.num_tokens for f in ukv.facts if f.segment == segment):
                raise StoreError(f"KV segment {segment} is shorter than its fact rows say")

    def _read_facts(
        self,
        ukv: UserKV,
        facts: list[FactRecord],
        timings: dict | None = None,
        dtype: torch.dtype | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        empty=None,
        spans: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``UserKV.gather``'s reader: the facts as stored (``_read_spans``, unless given), dequantised together
        into the store's dtype."""
        parts = self._read_spans(ukv, facts, timings) if spans is None else spans
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

    def _read_spans(self, ukv: UserKV, facts: list[FactRecord], timings: dict | None = None) -> list:
        """``UserKV.read``'s reader: cached facts from the LRU, the rest by span from their segment files, each
        kept as stored (``kvformat.SpanKV``) and put in the LRU."""
        t0 = time.perf_counter()
        parts: list = [None] * len(facts)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, f in enumerate(facts):
                parts[i] = self._kv.get(_fact_key(f))
                if parts[i] is None:
                    missing.setdefault((f.user, f.segment), []).append(i)
            n_missing = sum(map(len, missing.values()))
            self._stats["kv_misses"] += n_missing
            self._stats["kv_hits"] += len(facts) - n_missing
        versions = dict(ukv.versions())
        for (user, segment), idx in missing.items():
            where = f"store {self.name}: KV segment {segment} of user {user!r}"
            try:
                handle = self.segments.open(self.segment_name(user, segment))
            except FileNotFoundError:
                if self.version(user) != versions[user]:
                    raise LookupError(f"memory version {versions[user]} of {user!r} is no longer current") from None
                raise StoreError(f"{where} is missing (run `kvmem store fsck --store {self.name}`)") from None
            except OSError as exc:
                raise StoreError(f"{where} cannot be opened ({exc})") from None
            try:
                layout = self._segment_layout(user, segment, ukv.segment_sha(user, segment), handle)
                kvs = seg_files.read_spans(handle, layout, [(facts[i].token_offset, facts[i].num_tokens) for i in idx])
            except seg_files.SegmentCorrupt as exc:
                self.segments.discard(self.segment_name(user, segment))  # a cached copy: fetched again next time
                raise StoreError(f"{where} {exc}") from None
            except OSError as exc:  # EIO and the like: that read fails, the reader prefills instead
                raise StoreError(f"{where} cannot be read ({exc})") from None
            finally:
                handle.close()
            with self._lock:
                self._stats["kv_read_bytes"] += sum(kv.nbytes for kv in kvs)
                for i, kv in zip(idx, kvs):
                    parts[i] = kv
                    f = facts[i]
                    _cache_put(self._kv, _fact_key(f), kv)
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
        cached = self._user_cache.get(user)
        if cached is not None and cached.version == current:
            return cached
        with self.rows.snapshot():
            current = self.version(user)
            facts, emb = [], []
            for r in self.rows.execute(
                f'SELECT {_FACT_COLS}, embedding FROM facts WHERE "user"=? AND deleted IS NULL ORDER BY "row"',
                (user,),
            ):
                facts.append(_fact(r))
                emb.append(r[-1])
            shas = dict(self.rows.execute('SELECT segment, kv_sha256 FROM segments WHERE "user"=?', (user,)))
        if not facts:
            raise UnknownUser(f"unknown user {user!r} in store {self.name} (no live memories)")
        if version is not None and current != version:
            raise LookupError(f"memory version {version} of {user!r} is no longer current")
        try:
            segments = {s: shas[s] for s in {f.segment for f in facts}}
        except KeyError:
            raise StoreError(f"store {self.name}: user {user!r} names a segment with no checksum row") from None
        embeddings = torch.frombuffer(bytearray(b"".join(emb)), dtype=torch.float32).reshape(len(facts), -1)
        ukv = UserKV(user, current, facts, segments, embeddings, self._read_facts, self._read_spans)
        _cache_put(self._user_cache, user, ukv)
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
            parts = [self._user_cache.get(user) for user, _ in versions]
            if not parts or any(p is None or p.version != v for p, (_, v) in zip(parts, versions)):
                return None
            ukv = UserKV.union(parts)
            rows_of = ukv.row_of()
            if any(f not in rows_of for f in fact_ids):
                return None
            rows = [rows_of[f] for f in fact_ids]
            spans = [self._kv.get(_fact_key(ukv.facts[r])) for r in rows]
            if any(s is None for s in spans):
                return None
            self._stats["kv_hits"] += len(spans)
        finally:
            self._lock.release()
        return ukv, rows, spans

    def user_kv(self, user: str) -> UserKV:
        """A user's current memory (``snapshot(user)``)."""
        return self.snapshot(user)

    @_locked
    def changes(self, user: str, since: str) -> tuple[list[tuple[int, torch.Tensor]], list[int]] | None:
        """What changed in ``user``'s live facts after version ``since``: (added [(row, embedding [E])], removed
        rows), for incremental index updates; None if a compaction since then requires a full rebuild."""
        since_v = int(since)
        row = self.rows.execute('SELECT compacted FROM users WHERE "user"=?', (user,)).fetchone()
        if row is None or row[0] > since_v:
            return None
        added = [
            (r[0], torch.frombuffer(bytearray(r[1]), dtype=torch.float32))
            for r in self.rows.execute(
                'SELECT "row", embedding FROM facts WHERE "user"=? AND added>? AND deleted IS NULL ORDER BY "row"',
                (user, since_v),
            )
        ]
        removed = [
            r[0]
            for r in self.rows.execute(
                'SELECT "row" FROM facts WHERE "user"=? AND added<=? AND deleted>?', (user, since_v, since_v)
            )
        ]
        return added, removed

    # --- writes ---------------------------------------------------------------------------------------

    @contextmanager
    def writer(self, user: str | None = None):
        """The writer lock for ``user`` (None: the whole store, for ``fsck`` and ``reset``), then this object's
        lock. Writers of one user, in any process on any machine, serialize (``Rows.locked``: a file lock for a
        local store, which serializes every writer; advisory locks on PostgreSQL, where different users' writes
        proceed at once). The writer lock is waited for first, without this object's lock, so reads never queue
        behind a writer waiting for another process. Raises StoreBusy after ``write_timeout_s`` (None: wait)."""
        with self.rows.locked(user, self.write_timeout_s), self._lock:
            yield

    def _gc(self, user: str | None = None) -> tuple[list[str], list[str]]:
        """Under ``writer()``: retire segments no live fact uses (of ``user``, after its commit: a few indexed
        queries) and remove the files of those retired more than ``retire_after_s`` ago, so a reader still
        gathering from the snapshot it took before the commit finds its files. With ``user=None`` (``fsck``,
        ``reset``) remove at once every file no segment row names: retired ones and a killed writer's leftovers
        (a directory listing). Returns the removed names: (never retired: leftovers, retired)."""
        scope, args = ('s."user"=? AND ', (user,)) if user is not None else ("", ())
        dead = [
            tuple(r)
            for r in self.rows.execute(
                f'SELECT "user", segment FROM segments s WHERE {scope}NOT EXISTS (SELECT 1 FROM facts f WHERE '
                f'f."user"=s."user" AND f.segment=s.segment AND f.deleted IS NULL)',
                args,
            )
        ]
        now = time.time()
        retiring = ["retired:" + self.segment_name(u, seg) for u, seg in dead]
        mine = "retired:" + (f"{_safe(user)}." if user is not None else "")  # another user's are its writer's
        due = [
            k
            for k, t in self.rows.execute("SELECT key, value FROM meta WHERE key LIKE 'retired:%'")
            if k.startswith(mine) and (user is None or t <= now - self.retire_after_s)
        ]
        if user is None or self.retire_after_s <= 0:
            due, retiring = due + retiring, []
        if dead or due:
            with self.rows.transaction():
                self.rows.executemany('DELETE FROM segments WHERE "user"=? AND segment=?', dead)
                self.rows.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    [(k, now) for k in retiring],
                )
                self.rows.executemany("DELETE FROM meta WHERE key=?", [(k,) for k in due])
        if user is not None:
            doomed = [k.removeprefix("retired:") for k in due]
        else:
            live = {self.segment_name(u, seg) for u, seg in self.rows.execute('SELECT "user", segment FROM segments')}
            doomed = sorted(self.segments.names() - live)
        retired = {k.removeprefix("retired:") for k in due}
        removed, replaced = [], []
        for name in doomed:
            try:
                self.segments.delete(name)
                (replaced if name in retired else removed).append(name)
            except OSError as exc:  # the commit before this stands; a leftover object only costs space
                logger.warning("store %s: cannot remove %s: %s", self.name, name, exc)
        return removed, replaced

    def fsck(self) -> dict:
        """Check every user (rows, files, KV checksums) and remove orphaned files. Returns a report:
        ``{"users": n, "ok": [...], "bad": {user: why}, "removed": [file names], "replaced": [file names]}``:
        ``removed`` a killed writer's leftovers (no row ever named them), ``replaced`` segments that commits
        replaced, removed now rather than after ``retire_after_s``."""
        with self.writer():
            removed, replaced = self._gc()
            ok, bad = [], {}
            for user in self.users():
                self._user_cache.pop(user, None)
                with self._lock:
                    for k in [k for k in self._kv if k[1] == user]:
                        self._kv.pop(k, None)
                try:
                    ukv = self.snapshot(user)
                    if ukv.embeddings.shape[0] != len(ukv.facts):
                        raise StoreError("embedding rows do not match the fact rows")
                    self._check_segments(ukv)
                    ok.append(user)
                except (StoreError, LookupError) as exc:
                    bad[user] = str(exc)
        return {
            "users": len(ok) + len(bad),
            "ok": ok,
            "bad": bad,
            "removed": removed,
            "replaced": replaced,
        }

    def commit(
        self,
        user: str,
        add: list[FactRecord] = (),
        keys: list[torch.Tensor] = (),
        values: list[torch.Tensor] = (),
        embeddings: torch.Tensor | None = None,
        delete: list[str] = (),
        replace: bool = False,
        turns: list[dict] = (),
        events: list[tuple] = (),
        window: int = 0,
        source: str | None = None,
        now: float | None = None,
        neighbours: int | None = None,
        history: bool | None = None,
    ) -> str:
        """The one write path: in one commit, tombstone ``delete`` (or, with ``replace``, every live fact of the
        user), append ``add`` as a new KV segment, append conversation ``turns`` and history ``events``.

        keys/values: one [L, H, n_i, D] per added fact (n_i its token count); embeddings: [F, E]. ``events``:
        (fact_id, event, old_memory, new_memory); ADD/DELETE events for ``add``/``delete`` are recorded here.
        ``window``, ``neighbours`` and ``history`` (None: unchanged) record how the user's latest facts were
        encoded.
        The segment file and its directory are fsynced before the commit that points at them, so a new fact is
        visible to readers only once its KV and embedding are durable. Returns the new memory version.
        Raises StoreError, with nothing written, for bad counts/shapes, duplicate or already-live fact ids,
        or a ``delete`` id that is not a live fact of this user.
        """
        check_store_user(user)
        add, keys, values = list(add), list(keys), list(values)
        delete = [ALL] if delete is ALL else list(delete)
        if add:
            if embeddings is None or not (len(keys) == len(values) == len(add) == embeddings.shape[0]):
                raise StoreError(
                    f"user {user!r}: {len(add)} facts but {len(keys)} keys, {len(values)} values and "
                    f"{0 if embeddings is None else embeddings.shape[0]} embeddings"
                )
            if len({f.fact_id for f in add}) != len(add):
                raise StoreError(f"user {user!r}: duplicate fact_id")
            for f, k, v in zip(add, keys, values):
                if k.shape != v.shape or k.shape[2] != f.num_tokens:
                    raise StoreError(
                        f"fact {f.fact_id}: keys {tuple(k.shape)} / values {tuple(v.shape)} for "
                        f"{f.num_tokens} token ids"
                    )
        now = time.time() if now is None else now
        with self.writer(user):
            if self.rows.replaced():  # its segments would go under the old store's prefix
                raise StoreError(f"the store at {self.name} was created again since this process opened it; reopen it")
            segment, digest, name = uuid.uuid4().hex[:12], "", None
            if add:
                name = self.segment_name(user, segment)
                tensors, meta = seg_files.to_file(
                    torch.cat(keys, dim=2), torch.cat(values, dim=2), self.kv_format, [f.num_tokens for f in add]
                )
                digest = self.segments.put(name, tensors, meta)  # durable before the commit that points at it
            try:
                version = self._commit_rows(
                    user,
                    add,
                    embeddings,
                    segment,
                    digest,
                    delete,
                    replace,
                    list(turns),
                    list(events),
                    window,
                    source,
                    now,
                    neighbours,
                    history,
                )
            except BaseException:  # also SystemExit from a signal, which can land after the COMMIT itself
                if name is not None and not self._segment_committed(user, segment):
                    self.segments.delete(name)
                raise
            self._gc(user)
            self._user_cache.pop(user, None)
        return version

    def _segment_committed(self, user: str, segment: str) -> bool:
        """Whether a commit of ``segment`` reached the database (then its file must stay). True when unsure: an
        unreferenced file is only disk space, a referenced file that is gone is a lost memory."""
        try:
            return (
                self.rows.execute('SELECT 1 FROM segments WHERE "user"=? AND segment=?', (user, segment)).fetchone()
                is not None
            )
        except Exception:
            return True

    def _commit_rows(
        self,
        user,
        add,
        embeddings,
        segment,
        digest,
        delete,
        replace,
        turns,
        events,
        window,
        source,
        now,
        neighbours=None,
        history=None,
    ) -> str:
        db = self.rows
        with db.transaction():
            version = db.next_version()
            everything = replace or delete == [ALL]
            if everything:
                live = dict(db.execute('SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL', (user,)))
            else:  # only the ids this commit touches: a delete costs O(1) rows, not O(user's memory)
                wanted, live = sorted(set(delete) | {f.fact_id for f in add}), {}
                for i in range(0, len(wanted), 500):
                    chunk = wanted[i : i + 500]
                    live.update(
                        db.execute(
                            f'SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL AND '
                            f"fact_id IN ({','.join('?' * len(chunk))})",
                            (user, *chunk),
                        )
                    )
            gone = list(live) if everything else delete
            for fid in gone:
                if fid not in live:
                    raise StoreError(f"memory {fid!r} is not a live fact of user {user!r}")
            db.executemany(
                'UPDATE facts SET deleted=?, updated_at=? WHERE "user"=? AND fact_id=? AND deleted IS NULL',
                [(version, now, user, fid) for fid in gone],
            )
            if not replace:
                events = [
                    (fid, "DELETE", live[fid], None) for fid in gone if not any(e[0] == fid for e in events)
                ] + events
            if add:
                taken = [f.fact_id for f in add if f.fact_id in live and f.fact_id not in gone]
                if taken:
                    raise StoreError(f"memory id {taken[0]!r} is already in use")
                db.execute(
                    'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
                    (user, segment, digest, sum(f.num_tokens for f in add)),
                )
                offset, rows = 0, []
                emb = embeddings.float().contiguous()
                for i, f in enumerate(add):
                    rows.append(
                        (
                            user,
                            f.fact_id,
                            f.text,
                            f.speaker,
                            f.source_turn,
                            f.date,
                            f.metadata,
                            json.dumps(list(f.token_ids)),
                            segment,
                            offset,
                            f.window,
                            emb[i].numpy().tobytes(),
                            version,
                            f.created_at or now,
                            now,
                        )
                    )
                    offset += f.num_tokens
                db.executemany(
                    'INSERT INTO facts ("user", fact_id, text, speaker, source_turn, date, metadata, token_ids, '
                    'segment, token_offset, "window", embedding, added, created_at, updated_at) '
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
                events = events + [
                    (f.fact_id, "ADD", None, f.text) for f in add if not any(e[0] == f.fact_id for e in events)
                ]
            if replace:
                db.execute('DELETE FROM turns WHERE "user"=?', (user,))
            if turns:
                first = db.execute('SELECT COALESCE(MAX(idx), -1) + 1 FROM turns WHERE "user"=?', (user,)).fetchone()[0]
                db.executemany(
                    'INSERT INTO turns ("user", idx, dia_id, speaker, content, time) VALUES (?,?,?,?,?,?)',
                    [
                        (user, first + i, t.get("dia_id"), t.get("speaker"), t["content"], t.get("time"))
                        for i, t in enumerate(turns)
                    ],
                )
            db.executemany(
                'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) '
                "VALUES (?,?,?,?,?,?,?)",
                [(user, *e, now, version) for e in events],
            )
            db.execute(
                'INSERT INTO users ("user", version, "window", source, updated) VALUES (?,?,?,?,?) ON CONFLICT("user") '
                'DO UPDATE SET version=excluded.version, "window"=excluded."window", '
                "source=COALESCE(excluded.source, users.source), updated=excluded.updated",
                (user, version, window, source, now),
            )
            # the encoding is kept in meta: no schema change for stores written before it existed
            db.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                [
                    (f"{key}:{user}", int(val))
                    for key, val in (("neighbours", neighbours), ("history", history))
                    if val is not None
                ],
            )
        return str(version)

    def put_user(
        self,
        user: str,
        facts: list[FactRecord],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        embeddings: torch.Tensor,
        window: int,
        source: str = "",
        neighbours: int = 0,
        history: bool = False,
    ) -> str:
        """Replace ``user``'s memory atomically (``commit(replace=True)``): keys/values one [L, H, n_i, D] per
        fact, embeddings [F, E]. Returns the new version. Raises StoreError, with nothing written, for no facts,
        duplicate ids, or counts/shapes that do not match the facts."""
        if not facts:
            raise StoreError(f"user {user!r}: no facts to store")
        return self.commit(
            user,
            facts,
            keys,
            values,
            embeddings,
            replace=True,
            window=window,
            source=source,
            neighbours=neighbours,
            history=history,
        )

    def compact(self, user: str) -> str:
        """Rewrite ``user``'s live facts into one segment and drop tombstoned rows (history keeps their text).
        What ``search`` and ``get_all`` return is unchanged; the version changes. Returns it."""
        with self.writer(user):
            ukv = self.snapshot(user)
            segment = uuid.uuid4().hex[:12]
            keys, values = ukv.gather(list(range(len(ukv.facts))), dtype=self._rewrite_dtype())
            # lossy formats re-quantise with the same key groups (facts): the same integers and scales come back
            tensors, meta = seg_files.to_file(keys, values, self.kv_format, [f.num_tokens for f in ukv.facts])
            digest = self.segments.put(self.segment_name(user, segment), tensors, meta)
            db = self.rows
            with db.transaction():
                version = db.next_version()
                db.execute(
                    'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
                    (user, segment, digest, keys.shape[2]),
                )
                offset, moves = 0, []
                for f in ukv.facts:
                    moves.append((segment, offset, f.row))
                    offset += f.num_tokens
                db.executemany('UPDATE facts SET segment=?, token_offset=? WHERE "row"=?', moves)
                db.execute('DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL', (user,))
                db.execute(
                    'UPDATE users SET version=?, compacted=?, updated=? WHERE "user"=?',
                    (version, version, time.time(), user),
                )
            self._gc(user)
            self._user_cache.pop(user, None)
        return str(version)

    def _rewrite_dtype(self) -> torch.dtype | None:
        """The dtype a rewrite of this store's KV reads it in: fp32 for a lossy format (exact dequantisation, so
        the same integers come back), else the stored dtype."""
        return torch.float32 if self.kv_format != "native" else None

    def delete_user(self, user: str) -> str:
        """Tombstone every live fact of ``user``, whatever is live when the commit runs (history records each
        DELETE; the turns stay). Returns the new version; a user with nothing live is a no-op commit."""
        return self.commit(user, delete=ALL)

    def reset(self) -> None:
        """Delete every user's facts, turns and history (the version counter keeps counting, so no cache
        salt is ever reused)."""
        with self.writer():
            with self.rows.transaction():
                self.rows.next_version()
                for table in ("facts", "history", "turns", "users"):
                    self.rows.execute(f"DELETE FROM {table}")
                self.rows.execute("DELETE FROM meta WHERE key LIKE 'neighbours:%' OR key LIKE 'history:%'")
            self._gc()
            self._user_cache.clear()
            self._kv.clear()
            self._verified.clear()


def copy_store(
    src: str | Path,
    dst: str | Path,
    segments_url: str | None = None,
    force: bool = False,
    users: list[str] | None = None,
    kv_format: str | None = None,
) -> dict:
    """Copy the store at ``src`` to ``dst`` (either a directory or a ``postgresql://`` URL; ``segments_url`` as in
    ``Store.create``, required for a PostgreSQL ``dst``): every user's live facts with their KV (each source
    segment verified against its checksum first), embeddings, turns, history events and encoding, one commit per
    user. The copy is a new store (its own ``store_id``) for the same model. Afterwards every user's fact, turn
    and event counts are compared and every new segment is verified. History keeps each fact's events in order;
    their times become the copy's.

    ``force``: copy into a store already at ``dst`` (same model) that has users, none of them a user copied
    (histories are not merged); without it a store with users is refused, as is a non-empty directory that is not
    a store. ``users``: only these (default: every user, those whose facts are all deleted too). ``kv_format``:
    the copy's KV format (``kvformat``; default the source's): a lossless store may be copied into any format, a
    lossy one only into its own, so dequantised KV is never stored as lossless. Returns
    ``{"users", "facts", "turns", "events", "kv_bytes"}`` (``kv_bytes``: KV read, in the model dtype). Raises
    StoreError, StoreMismatch."""
    source = Store.open(src)
    try:
        kv_format = kvformat.check_format(kv_format or source.kv_format)
        if source.kv_format != "native" and kv_format != source.kv_format:
            raise StoreError(
                f"store {source.name} holds lossy {source.kv_format} KV; it can only be copied as {source.kv_format} "
                f"(re-encode the memories to get {kv_format})"
            )
        fingerprint = {**source.fingerprint, "kv_format": kv_format}
        if not is_url(dst) and Path(dst).is_dir() and any(Path(dst).iterdir()) and not Store.exists(dst):
            raise StoreError(f"{dst} is a non-empty directory that holds no store; copy into a new one")
        if Store.exists(dst):
            target = Store.open(dst, fingerprint)
            if target.users() and not force:
                target.close()
                raise StoreError(f"{target.name} already holds a store with users; pass --force to copy into it")
            check_segments_url(target, segments_url)
        else:
            hk, hv = source.header_kv()
            m = source.manifest
            target = Store.create(
                dst, fingerprint, m["header"]["text"], m["header"]["token_ids"], hk, hv, m["embedder"],
                segments_url=segments_url,
            )  # fmt: skip
        report = {"users": 0, "facts": 0, "turns": 0, "events": 0, "kv_bytes": 0}
        try:
            todo = source.users(with_no_live_facts=True) if users is None else users
            taken = [u for u in todo if target.version(u) is not None]
            if taken:
                raise StoreError(
                    f"user {taken[0]!r} is already in {target.name}; copy does not merge histories (copy into a "
                    f"new store, or leave that user out with --user)"
                )
            for user in todo:
                info = source.encoding_of(user)
                if info is None:
                    raise UnknownUser(f"unknown user {user!r} in store {source.name}")
                try:
                    ukv = source.snapshot(user)
                except UnknownUser:  # every fact deleted: its turns and history still go
                    ukv = UserKV(user, info["version"], [], {}, torch.zeros(0, 1))
                source._check_segments(ukv)
                turns, events = source.turns(user), source.events(user)
                parts = [ukv.gather([i], dtype=source._rewrite_dtype()) for i in range(len(ukv.facts))]
                had = len(target.events(user))
                facts = [FactRecord(**{**f.__dict__, "row": 0, "segment": "", "token_offset": 0}) for f in ukv.facts]
                target.commit(
                    user,
                    facts,
                    [k for k, _ in parts],
                    [v for _, v in parts],
                    ukv.embeddings,
                    replace=True,
                    turns=turns,
                    events=[(e["memory_id"], e["event"], e["old_memory"], e["new_memory"]) for e in events],
                    window=info["window"],
                    source=info["source"],
                    neighbours=info["neighbours"],
                    history=info["history"],
                )
                n_facts = 0
                if ukv.facts:
                    copied = target.snapshot(user)
                    target._check_segments(copied)
                    n_facts = len(copied.facts)
                got = (n_facts, len(target.turns(user)), len(target.events(user)) - had)
                if got != (len(ukv.facts), len(turns), len(events)):
                    raise StoreError(
                        f"copy of user {user!r} has {got} facts/turns/events, the source "
                        f"{(len(ukv.facts), len(turns), len(events))}"
                    )
                report["users"] += 1
                report["facts"] += got[0]
                report["turns"] += got[1]
                report["events"] += got[2]
                report["kv_bytes"] += sum(k.nbytes + v.nbytes for k, v in parts)
        finally:
            target.close()
        return report
    finally:
        source.close()
