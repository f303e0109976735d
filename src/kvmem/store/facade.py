"""``Store``: one store of users' memory, its rows and its KV segments behind one object, with its read side
(``Store.reads``, ``read.Reader``) and its write side (``Store.writes``, ``write.Writer``); see the package's
docstring for the layout."""

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
from .location import StoreDtypeMismatch, StoreError, StoreMismatch, has_credentials, redact
from .read import Reader
from .records import segment_name
from .rows import Rows
from .upkeep import cache_at, collect, held, sweep
from .write import Writer

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
    ``Store.create`` / ``Store.open``; callers never know which backends they hold.

    Its two sides, which share its lock: ``reads`` (``read.Reader``: snapshots, facts, turns, history, the KV read
    tiers) and ``writes`` (``write.Writer``: ``commit`` of a ``records.Write``, erasure, compaction, ``fsck``).
    The store itself keeps what spans both or neither: opening and creating, the manifest, availability, sizes,
    and the upkeep rounds (``fsck`` with a disk cache, ``collect``, ``sweep_cache``).

    ``root``: the location it was opened at (a ``Path``, or the ``postgresql://`` URL) and reopens it; ``name``:
    the same without credentials, for messages."""

    # no other attribute: a setting of a side (``writes.retire_after_s``) set on the store would be lost silently
    __slots__ = ("rows", "root", "name", "manifest", "_lock", "segments", "reads", "writes")

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

    # --- what it holds ---------------------------------------------------------------------------------

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

    # --- upkeep over both sides ------------------------------------------------------------------------

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
