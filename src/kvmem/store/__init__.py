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

The parts, each with one job (nothing outside this package needs them):

* ``facade``: ``Store``, which composes the parts: its read side ``Store.reads`` and write side ``Store.writes``;
* ``records``: values without I/O: ``FactRecord``, ``UserKV``, ``Write`` (one commit, whole);
* ``write``: ``Writer.commit`` (the one write path), compaction, garbage collection, ``fsck``;
* ``read``: ``Reader``: snapshots (``UserKV``), facts, turns, history, the facts' KV read by span, the read tiers;
* ``erasure``: what an erasure erases and marks stale (``Erasure``);
* ``copy``: ``copy_store``;
* ``upkeep``: the collection of retired segments and the sweep of disk caches (what bounds erased KV's copies);
* ``location``: store locations (URLs, redaction) and the errors a store raises;
* ``rows``: the ``Rows`` seam, named row operations; ``sql_rows``: their SQL, shared by ``sqlite_rows`` and
  ``postgres_rows``; ``backends``: which backend a location names;
* ``schema``: the tables, defined once and rendered to both SQL dialects;
* ``kvfile``: the KV segment file format; ``segments``: where segments live; ``tiers``: the read tiers (memory,
  disk).

One ``Store`` object may be shared by threads (a lock guards its connection). Stored KV carries the model
fingerprint; opening a store with another model is refused (``StoreMismatch``). Opening never writes (no DDL), but for
one thing: a schema of an older version is migrated (``schema.MIGRATIONS``: columns added) when it is opened; the
schema is made by ``create`` and its version checked on open.
"""

from __future__ import annotations

from .copy import copy_store
from .erasure import Erasure, came_from
from .facade import (
    CACHE_BYTES,
    DISK_CACHE_BYTES,
    FORMAT_VERSION,
    Store,
    check_kv_format,
    check_segments_url,
    fingerprint_diff,
)
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
from .read import VERIFIED_SEGMENTS
from .records import ALL, FactRecord, UserKV, Write
from .rows import Rows
from .schema import SCHEMA_VERSION
from .tiers import CountingLRU
from .write import RETIRE_AFTER_S

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
    "Write",
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
