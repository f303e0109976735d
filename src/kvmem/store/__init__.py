"""A memory store: fact rows, tombstones, history and turns, KV segments, behind one facade (``Store``).

Two backends, chosen by location; callers never know which they hold:

* a local directory (the embedded default)::

    manifest.json            format, store_id, model fingerprint, header text + token ids, embedder
    header.safetensors       header pre-RoPE keys / raw values, [L, H, h, D]
    meta.sqlite              meta (the version counter; per-user encoding neighbours, history), users, segments
                             (sha256), facts (rows, embeddings, added/deleted versions), history (events),
                             turns (the raw conversation), scopes (the scope index: each user by tenant and
                             entity ids, ``scope_keys``)
    users/<user>.<segment>.kv.safetensors    keys / values of the facts one commit added, [n, L, H, D]
                                             (token-major: a fact is one byte range; ``segments``)

* a shared store: the same rows in PostgreSQL (``postgresql://…``; ``postgres_rows.PostgresRows``, the manifest and
  header in ``kvmem_manifest``), and the segments as objects in an object store. With ``segments_url`` in the manifest
  (required for PostgreSQL) the segments are objects there (obstore: file://, s3://, gs://), under the same names.

The parts, each with one job (``Store`` composes them; nothing outside this package needs them):

* ``write``: ``commit`` (the one write path), compaction, garbage collection, ``fsck``;
* ``read``: snapshots (``UserKV``), the facts' KV read by span, the read tiers, prefetch;
* ``copy``: ``copy_store``;
* ``upkeep``: the collection of retired segments and the sweep of disk caches (what bounds erased KV's copies);
* ``location``: store locations (URLs, redaction) and the errors a store raises;
* ``rows``: the ``Rows`` seam over SQLite and PostgreSQL (every backend-specific ability is there);
* ``schema``: the tables, defined once and rendered to both SQL dialects;
* ``segments``: KV segment files and where they live; ``tiers``: the read tiers (memory, disk).

One ``Store`` object may be shared by threads (a lock guards its connection). Stored KV carries the model
fingerprint; opening a store with another model is refused (``StoreMismatch``). Opening never writes (no DDL), but for
one thing: a schema of an older version is migrated (``schema.MIGRATIONS``: columns added) when it is opened; the
schema is made by ``create`` and its version checked on open.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save

from .. import kvformat
from . import backends
from . import segments as seg_files
from .copy import copy_store
from .erasure import Erasure, came_from
from .location import (
    StoreBusy,
    StoreConflict,
    StoreDtypeMismatch,
    StoreError,
    StoreMismatch,
    StoreUnavailable,
    UnknownUser,
    canonical,
    has_credentials,
    is_url,
    password,
    redact,
    redact_text,
    secrets,
    within,
)
from .read import VERIFIED_SEGMENTS, FactRecord, Reader, UserKV, segment_name
from .rows import Rows
from .schema import SCHEMA_VERSION
from .tiers import CountingLRU
from .upkeep import cache_at, collect, held, sweep
from .write import ALL, RETIRE_AFTER_S, Writer

__all__ = [
    "ALL",
    "Erasure",
    "came_from",
    "CACHE_BYTES",
    "DISK_CACHE_BYTES",
    "FORMAT_VERSION",
    "RETIRE_AFTER_S",
    "SCHEMA_VERSION",
    "VERIFIED_SEGMENTS",
    "CountingLRU",
    "FactRecord",
    "Rows",
    "Store",
    "StoreBusy",
    "StoreConflict",
    "StoreDtypeMismatch",
    "StoreError",
    "StoreMismatch",
    "StoreUnavailable",
    "UnknownUser",
    "UserKV",
    "canonical",
    "check_kv_format",
    "check_segments_url",
    "copy_store",
    "fingerprint_diff",
    "is_url",
    "password",
    "redact",
    "redact_text",
    "has_credentials",
    "secrets",
    "within",
]

FORMAT_VERSION = 3  # manifest format; 3: incremental segments (older stores must be re-ingested)
DISK_CACHE_BYTES = 16 << 30  # default bound of a reader's local disk cache of remote segments (--cache-dir), bytes
CACHE_BYTES = 1 << 30  # default LRU bound of each of a Store's caches (snapshots, KV segments), bytes


def check_segments_url(store: Store, url: str | None) -> None:
    """``--segments URL`` given for an existing store must be where its segments are. Raises StoreError."""
    have = store.manifest.get("segments_url")
    if url is not None and url != have:
        raise StoreError(
            f"store {store.name} keeps its KV segments {'at ' + repr(redact(have)) if have else 'in its own directory'}"
            "; "
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
    ``Store.create`` / ``Store.open``; callers never know which backends they hold. A facade: reads go to its
    ``reads`` (``read.Reader``), writes to its ``writes`` (``write.Writer``); both share its lock.

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
        self.reads = Reader(rows, self.segments, self._lock, self.kv_format, cache_bytes)
        self.writes = Writer(rows, self.segments, self._lock, self.kv_format, self.reads)

    # --- lifecycle -----------------------------------------------------------------------------------

    @staticmethod
    def exists(root: str | Path) -> bool:
        """Whether a store is at ``root`` (a directory or a ``postgresql://`` URL). Raises StoreError for a URL
        of another kind, or a database that cannot be reached."""
        rows = backends.open_rows(root)
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
        rows = backends.open_rows(root)
        if has_credentials(segments_url):  # the manifest records the URL, and every reader opens it from there
            rows.close()
            raise StoreError(
                f"--segments {redact(segments_url)} carries credentials, which the store would record in its "
                "manifest: remove them from the URL and give them in the environment (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_KEY, ...)"
            )
        if segments_url is None and rows.shared:
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
        answer_cap_s: float | None = None,
    ) -> Store:
        """Open an existing store (a directory or a ``postgresql://`` URL). If ``fingerprint`` is given it must
        equal the store's. ``cache_bytes``: this object's in-memory caches (snapshots, facts' KV), each;
        ``cache_dir``: a local disk cache of up to ``cache_dir_bytes`` for segments in an object store;
        ``answer_cap_s``: on PostgreSQL, give up on a statement unanswered this long, s (default: the session's
        ``statement_timeout`` + 2 s; ``postgres_rows.PostgresRows``).

        Raises:
            StoreError: no store at ``root``, or a database that cannot be reached.
            StoreMismatch: the store was produced by another model/tokenizer/dtype/RoPE config.
        """
        rows = backends.open_rows(root, answer_cap_s)
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
        self.reads.close()
        self.rows.close()

    def replaced(self) -> bool:
        """Whether the store at ``root`` was deleted or created anew since this object opened it."""
        with self._lock:
            return self.rows.replaced()

    def available(self) -> bool:
        """Whether the store answers now, its rows and its segments: always for a local directory; for PostgreSQL
        False at once while the database is known to be unreachable, else one probe on a connection of its own
        (``postgres_rows.PostgresRows``); for segments in a remote object store the same, by one HEAD without retries
        (``segments.ObjectSegments``). Each probe is bounded by a few seconds and made at most once a second (a
        caller meanwhile gets the last answer). Takes no lock, so it never waits behind a read or a write."""
        return self.rows.available() and self.segments.available()

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

    @property
    def retire_after_s(self) -> float:
        """How long a replaced segment's file outlives its last row, s (``write.RETIRE_AFTER_S``)."""
        return self.writes.retire_after_s

    @retire_after_s.setter
    def retire_after_s(self, value: float) -> None:
        self.writes.retire_after_s = value

    @property
    def write_timeout_s(self) -> float | None:
        """How long a write waits for another writer's lock, s (None: as long as it takes); then StoreBusy."""
        return self.writes.write_timeout_s

    @write_timeout_s.setter
    def write_timeout_s(self, value: float | None) -> None:
        self.writes.write_timeout_s = value

    @property
    def busy_timeout_s(self) -> float | None:
        """How long this store's connection waits for another process's write lock, s (``Rows.busy_timeout_s``;
        None where the backend has no such wait)."""
        with self._lock:
            return self.rows.busy_timeout_s

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of fact KV this Store object holds in its memory tier."""
        return self.reads.memory.nbytes()

    def disk_bytes(self) -> int:
        """Bytes of the store: its rows (the directory, or the PostgreSQL tables) and its segments, wherever they
        live. A file a concurrent writer removes during the walk counts 0."""
        with self._lock:
            rows = self.rows.nbytes()
        return rows + self.segments.nbytes()

    def segment_name(self, user: str, segment: str) -> str:
        """The object name of ``user``'s KV segment ``segment`` in ``self.segments`` (immutable once committed)."""
        return segment_name(user, segment)

    def segment_path(self, user: str, segment: str) -> Path | None:
        """The file of ``user``'s KV segment on this machine (tools, tests), or None in an object store."""
        return self.segments.local_path(segment_name(user, segment))

    # --- reads (``read.Reader``) -----------------------------------------------------------------------

    def header_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Header pre-RoPE keys and raw values, [L, H, h, D] each."""
        return self.reads.header_kv()

    def drop_caches(self) -> None:
        """Forget cached snapshots and segments: the next read goes to disk (tests of what a cold reader sees)."""
        self.reads.forget()

    def cache_stats(self) -> dict[str, int]:
        """``Reader.cache_stats``: the memory tier's and the disk tier's counters."""
        return self.reads.cache_stats()

    def users(self, with_no_live_facts: bool = False) -> list[str]:
        """Users with at least one live fact (``with_no_live_facts``: every user ever written, too)."""
        return self.reads.users(with_no_live_facts)

    def scope_keys(self, query, live: bool = False) -> list[str] | None:
        """``Reader.scope_keys``: the store users the scope index files under ``query`` (``scopes.IndexQuery``),
        found by index (``live``: with a live fact); None for a store created before the index."""
        return self.reads.scope_keys(query, live)

    def user_page(
        self, prefix: str, contains: str = "", offset: int = 0, limit: int = 50
    ) -> tuple[int, list[tuple[str, int, int, float]]] | None:
        """``Reader.user_page``: (users matching, one page of (head, live facts, their tokens, last commit)) of
        the users under key ``prefix`` whose id contains ``contains``; None without the scope index."""
        return self.reads.user_page(prefix, contains, offset, limit)

    def version(self, user: str) -> str | None:
        """The user's current memory version (changes on every committed write), or None if never written: one
        row read by the users table's primary key, whatever the user's or the store's fact count."""
        return self.reads.version(user)

    def fact_token_ids(self, user: str, version: str, fact_ids: list[str]) -> dict[str, tuple[int, ...]]:
        """``Reader.fact_token_ids``: token ids of the named live facts of ``user`` at ``version`` (rows of those
        facts only, one read transaction); LookupError if ``version`` is not current."""
        return self.reads.fact_token_ids(user, version, fact_ids)

    def embedding_page(self, user: str, after: int, limit: int) -> tuple[list[int], list[str], torch.Tensor]:
        """``Reader.embedding_page``: up to ``limit`` live facts of ``user`` after store row ``after``, in row
        order: (rows, fact ids, embeddings [n, E] float32)."""
        return self.reads.embedding_page(user, after, limit)

    def rows_token_ids(self, user: str, rows: list[int]) -> dict[int, tuple[str, tuple[int, ...]]]:
        """``Reader.rows_token_ids``: row -> (fact id, token ids) of those ``rows`` that are live facts of
        ``user``."""
        return self.reads.rows_token_ids(user, rows)

    def user_info(self, user: str) -> dict:
        """``Reader.user_info``: version, window, neighbours, history, num_facts, num_tokens, source."""
        return self.reads.user_info(user)

    def encoding_of(self, user: str) -> dict | None:
        """``Reader.encoding_of``: how ``user``'s latest facts were encoded; None if never written."""
        return self.reads.encoding_of(user)

    def facts(self, user: str) -> list[FactRecord]:
        return self.reads.snapshot(user).facts

    def fact(self, fact_id: str, user: str | None = None, within: str | None = None) -> FactRecord | None:
        """``Reader.fact``: the live fact with this id (of ``user``; of a user key starting ``within``), or None."""
        return self.reads.fact(fact_id, user, within)

    def history(self, fact_id: str, within: str | None = None) -> list[dict]:
        """Every event of a fact (of user keys starting ``within``), oldest first: id, memory_id, user_id, event,
        old_memory, new_memory, created_at."""
        return self.reads.history(fact_id, within)

    def events(self, user: str) -> list[dict]:
        """Every history event of ``user``'s facts, oldest first (``history``'s fields)."""
        return self.reads.events(user)

    def turns(self, user: str, last: int | None = None) -> list[dict]:
        """The user's stored conversation turns (oldest first; the ``last`` n): idx, dia_id, speaker, content, time."""
        return self.reads.turns(user, last)

    def snapshot(self, user: str, version: str | None = None) -> UserKV:
        """``Reader.snapshot``: one consistent version of ``user``'s memory (LookupError if ``version`` was
        replaced, UnknownUser for a user with no live memories)."""
        return self.reads.snapshot(user, version)

    def user_kv(self, user: str) -> UserKV:
        """A user's current memory (``snapshot(user)``)."""
        return self.reads.snapshot(user)

    def snapshots(self, versions: list[tuple[str, str | None]]) -> UserKV:
        """``Reader.snapshots``: the union of several users' snapshots."""
        return self.reads.snapshots(versions)

    def cached(self, versions: list[tuple[str, str]], fact_ids: list[str]) -> tuple[UserKV, list[int], list] | None:
        """``Reader.cached``: the memory and spans of ``fact_ids`` when all of it is in memory, else None; no I/O,
        never waits."""
        return self.reads.cached(versions, fact_ids)

    def watch(self, callback) -> None:
        """``Reader.watch``: ``callback(user, live rows or None)`` whenever a read finds a user's memory changed."""
        self.reads.watch(callback)

    def changes(self, user: str, since: str) -> tuple[list[tuple[int, torch.Tensor]], list[int]] | None:
        """``Reader.changes``: (added [(row, embedding [E])], removed rows) since version ``since``, or None."""
        return self.reads.changes(user, since)

    @property
    def has_text_index(self) -> bool:
        """Whether the store has its full-text index (stores created before hybrid search do not:
        ``add_text_index``)."""
        with self._lock:
            return self.rows.has_text_index()

    def keyword_search(self, user: str, query: str, limit: int) -> list[tuple[int, float]] | None:
        """``Reader.keyword``: ``user``'s ``limit`` live facts best matching ``query``'s words in the store's
        full-text index, ``[(row, score)]`` best first; None for a store without one."""
        return self.reads.keyword(user, query, limit)

    def prefetch(self, ukv: UserKV, rows: list[int]) -> list:
        """``Reader.prefetch``: start reading ``ukv.facts[rows]``' KV in the background; a future per segment."""
        return self.reads.prefetch(ukv, rows)

    def evict(self, ukv: UserKV, rows: list[int], memory_only: bool = False) -> None:
        """``Reader.evict``: drop ``ukv.facts[rows]``' KV from the read tiers (load tests). Never raises."""
        self.reads.evict(ukv, rows, memory_only)

    def verify(self, user: str) -> int:
        """``Reader.verify``: check every KV segment of ``user``'s current version now; returns how many."""
        return self.reads.verify(user)

    # --- writes (``write.Writer``) ---------------------------------------------------------------------

    def writer(self, user: str | None = None):
        """``Writer.writer``: the writer lock for ``user`` (None: the whole store), then this object's lock."""
        return self.writes.writer(user)

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
        expect: dict[str, int] | None = None,
        erase: Erasure | None = None,
    ) -> str:
        """``Writer.commit``, the one write path: in one commit, tombstone ``delete`` (or, with ``replace``, every
        live fact), carry out ``erase`` (``erasure.Erasure``, filled in with what it covered), append ``add`` as a
        new KV segment, append ``turns`` and history ``events``; ``expect`` (fact id -> the row read) makes it a
        compare-and-set, checked before anything else. Returns the new memory version. Raises StoreError, with
        nothing written, for bad input; StoreConflict when an ``expect``ed memory changed."""
        return self.writes.commit(
            user, add, keys, values, embeddings, delete, replace, turns, events, window, source, now, neighbours,
            history, expect, erase,
        )  # fmt: skip

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
        """``Writer.put_user``: replace ``user``'s memory atomically. Returns the new version."""
        return self.writes.put_user(user, facts, keys, values, embeddings, window, source, neighbours, history)

    def compact(self, user: str, segments: list[str] | None = None) -> str:
        """``Writer.compact``: rewrite ``user``'s live facts (of ``segments`` only, if given) into one segment.
        Returns the new version."""
        return self.writes.compact(user, segments)

    def add_text_index(self) -> bool:
        """``Writer.add_text_index``: the full-text index (hybrid search's keyword part) for a store created
        before it; returns whether it was missing."""
        return self.writes.add_text_index()

    def delete_user(self, user: str) -> str:
        """``Writer.delete_user``: erase every fact of ``user``, its turns and history text. Returns the new
        version."""
        return self.writes.delete_user(user)

    def erase(self, user: str, delete, turns: list[int] = (), now: float | None = None, defer_s: float = 0.0) -> dict:
        """``Writer.erase``: erase facts (ids or ``ALL``), the turns they came from and their history text, and
        mark the facts computed behind them stale. Returns ``{"version", "erased", "turns", "stale",
        "segments"}``."""
        return self.writes.erase(user, delete, turns, now, defer_s)

    def stale(self, user: str | None = None) -> list[tuple[str, str, str, float]]:
        """``Writer.stale``: (user, fact_id, segment, re-encode by) of facts whose KV awaits re-encoding."""
        return self.writes.stale(user)

    def reencode(self, user: str, facts: list[FactRecord], keys, values, embeddings, now=None) -> str | None:
        """``Writer.reencode``: replace live facts' KV (versioned; None when any changed meanwhile)."""
        return self.writes.reencode(user, facts, keys, values, embeddings, now)

    def defer_compaction(self, user: str) -> None:
        """``Writer.defer_compaction``: ``user``'s dead KV awaits a rewrite by the upkeep."""
        self.writes.defer_compaction(user)

    def compactions(self) -> list[str]:
        """``Writer.compactions``: users whose dead KV awaits a rewrite."""
        return self.writes.compactions()

    def dead_segments(self, user: str) -> list[str]:
        """``Writer.dead_segments``: ``user``'s segments holding rows of dead facts."""
        return self.writes.dead_segments(user)

    def compacted(self, user: str) -> None:
        """``Writer.compacted``: ``user``'s deferred rewrite is done."""
        self.writes.compacted(user)

    def reset(self) -> None:
        """``Writer.reset``: delete every user's facts, turns and history."""
        self.writes.reset()

    def fsck(self, cache_dir: str | Path | None = None) -> dict:
        """``Writer.fsck``: check every user and remove orphaned files; returns the report. ``cache_dir``: a disk
        cache of this store's segments (``kvmem serve --cache-dir``) to sweep too: the report's ``cache_removed``
        names the cached segments the store no longer holds, removed from it (``upkeep.sweep``). Raises
        StoreError for a ``cache_dir`` that is no such cache."""
        tier = None if cache_dir is None else cache_at(cache_dir)  # a bad path fails before anything is removed
        try:
            report = self.writes.fsck()
            if tier is not None:
                report["cache_removed"] = sweep(tier, f"{self.manifest['store_id']}/", held(self.writes))
        finally:
            if tier is not None:
                tier.cache.close()
        return report

    def collect(self, now: float | None = None) -> list[str]:
        """``upkeep.collect``: remove every user's segments retired ``retire_after_s`` or more ago (a user erased
        whole never commits again), without a writer lock. Returns the removed names. The upkeep's round."""
        return collect(self.writes, now)

    def sweep_cache(self) -> list[str]:
        """``upkeep.sweep``: drop from this object's disk cache (``cache_dir``) every segment the store no longer
        holds for readers (neither a segment row nor retired less than ``retire_after_s`` ago); [] without a disk
        cache. Returns the dropped names. The upkeep's round, on every server with a cache directory."""
        tier = getattr(self.segments, "tier", None)
        if tier is None:
            return []
        return sweep(tier, self.segments.prefix, held(self.writes))
