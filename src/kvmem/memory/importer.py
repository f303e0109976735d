"""Import of a Mem0 export: the records checked, all of them before anything is written, grouped by scope and cut
into bounded batches.

An export is what ``MemoryClient.get_all`` or the OSS ``get_all`` returns: a ``{"results": [...]}`` page or a
list of items, of at most ``MAX_IMPORT_RECORDS`` records (``ImportTooLarge``; HTTP 413). ``Memory`` commits each
scope's records in creation order, ``IMPORT_BATCH`` at a time (one commit each), so an import's memory does not
grow with its size and the model thread is free between batches.

Semantics (docs/server.md): an import is acknowledged when it answers, and it is idempotent by record, so one
cut short (a crash, a lost connection, a 503) is completed by running it again. A record whose id is already live
in the same scope with the same text is counted under ``existing`` and skipped; a record without an id gets one
derived from its scope, creation time, text and occurrence (``record_id``), so it is recognised the same way. A
record whose id is live with another scope or text is refused, and then nothing is written.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import scopes
from ..store import FactRecord
from . import mem0
from .mem0 import MemoryInputError

MAX_IMPORT_RECORDS = 10_000  # records per import (a request over it: HTTP 413); split a bigger export
IMPORT_BATCH = 32  # records per commit: what one batch holds in memory (their KV, about 3 copies) and on the model
_IDS = uuid.UUID("8a3c1f0e-6b1d-4c9a-9d7e-4b2f0c5e7a11")  # uuid5 namespace of derived record ids

Item = tuple[float, str, str, dict]  # (created_at, Unix seconds; text; memory id; metadata)


class ImportTooLarge(MemoryInputError):
    """An export of more than ``MAX_IMPORT_RECORDS`` records; nothing was written (HTTP 413)."""


@dataclass
class ImportPlan:
    """A checked import: ``batches`` of (store user, items) in commit order, each scope's in creation order;
    ``existing``: records already live as given (skipped); ``counts``: records to write per scope label."""

    batches: list[tuple[str, list[Item]]] = field(default_factory=list)
    existing: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def result(self) -> dict:
        """What the import answers: ``{"count": written, "scopes": {label: n}, "existing": skipped}``."""
        return {"count": sum(self.counts.values()), "scopes": dict(self.counts), "existing": self.existing}


def record_id(user: str, created, text: str, nth: int) -> str:
    """The id of a record that has none, from its scope key, ``created_at`` as given (None when absent: the time
    it gets is the import's), text and occurrence among records alike: the same for the same export, so running
    an import again skips it."""
    return str(uuid.uuid5(_IDS, json.dumps([user, created, text, nth])))


def check_size(export) -> list:
    """The export's records (a list). Raises MemoryInputError for no records, ImportTooLarge for too many."""
    records = export.get("results") if isinstance(export, dict) else export
    if not isinstance(records, list) or not records:
        raise MemoryInputError("an export is a non-empty list of memories, or an object with 'results'")
    if len(records) > MAX_IMPORT_RECORDS:
        raise ImportTooLarge(
            f"an import takes at most {MAX_IMPORT_RECORDS} records, got {len(records)}; split the export"
        )
    return records


def read_export(
    export, namespace: str | None, live: Callable[[str], FactRecord | None], batch: int = IMPORT_BATCH
) -> ImportPlan:
    """The export's memories by store user (scope key in ``namespace``), each scope's in creation order and cut
    into batches of ``batch``, with their ids (derived, ``record_id``, where a record has none), metadata, role,
    actor, categories and expiration date kept. ``live(id)``: the store's live memory with that id, or None.
    Raises ImportTooLarge, or MemoryInputError naming up to five bad records by index (not an object, a bad
    scope or text, an id that is not a string, repeated, or live with another scope or text; a bad time or
    date; a ``role`` or ``actor_id`` that is not a short string, ``categories`` not a list of strings, metadata
    that is not JSON or too long with them): every check a commit makes, so nothing may be written."""
    records = check_size(export)
    by_scope: dict[str, list[Item]] = {}
    errors, seen, occurrences = [], set(), {}
    plan = ImportPlan()
    for i, rec in enumerate(records):
        try:
            if not isinstance(rec, dict):
                raise MemoryInputError("is not an object")
            scope = mem0.scope_of(rec.get("user_id"), rec.get("agent_id"), rec.get("run_id"))
            user = scope.key(namespace)
            text = mem0.check_text(rec.get("memory"), "'memory'")
            created = mem0.parse_time(rec.get("created_at"))
            fid = rec.get("id")
            if not fid:
                alike = (user, json.dumps(rec.get("created_at")), text)
                nth = occurrences[alike] = occurrences.get(alike, -1) + 1
                fid = record_id(user, rec.get("created_at"), text, nth)
            if not isinstance(fid, str) or fid in seen:
                raise MemoryInputError(f"id {fid!r} is not a string or appears twice")
            seen.add(fid)
            have = live(fid)
            if have is not None:
                if have.user != user or have.text != text:
                    raise MemoryInputError(f"memory {fid!r} already exists, with another scope or text")
                plan.existing += 1  # imported before (an import run again): skipped
                continue
            meta = mem0.user_metadata(rec.get("metadata"))
            for key in ("role", "actor_id"):
                if rec.get(key) is not None:
                    meta[key] = mem0.check_text(rec[key], f"'{key}'", mem0.MAX_NAME_CHARS)
            cats = rec.get("categories")
            if cats is not None:
                if not isinstance(cats, list) or not all(isinstance(c, str) for c in cats):
                    raise MemoryInputError("'categories' must be a list of strings")
                meta["categories"] = cats
            if rec.get("expiration_date") is not None:
                meta["expiration_date"] = mem0.check_expiration(rec["expiration_date"], past=True)
            mem0.check_metadata(meta)  # as the commit will: every check before the first batch is written
            by_scope.setdefault(user, []).append((created, text, fid, meta))
        except MemoryInputError as exc:
            errors.append(f"record {i}: {exc}")
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise MemoryInputError("nothing imported: " + "; ".join(errors[:5]) + more)
    for user, items in by_scope.items():
        items.sort(key=lambda x: x[0])
        plan.batches += [(user, items[i : i + batch]) for i in range(0, len(items), batch)]
        plan.counts[scope_label(user, namespace)] = len(items)
    return plan


def scope_label(user: str, namespace: str | None) -> str:
    """A scope key as the import's count names it, e.g. ``user_id=alice&agent_id=travel``."""
    return "&".join(f"{k}={v}" for k, v in scopes.parse_key(user, namespace).ids().items())


class Importing:
    """``Memory``'s import of a Mem0 export (``import_memories``, in batches: ``plan_import``, ``import_batch``); a
    mixin of ``facade.Memory``, whose ``_fact``, ``_context`` and ``_write`` it uses."""

    def import_memories(self, export, namespace: str | None = None) -> dict:
        """Write memories exported from Mem0 (what ``MemoryClient.get_all`` or the OSS ``get_all`` returns: a
        ``{"results": [...]}`` page or a list of at most ``MAX_IMPORT_RECORDS`` items) verbatim, keeping
        their ids, scopes, metadata, role, expiration date and creation times; each scope's memories are encoded
        and committed in creation order, ``import_batch_size`` (``IMPORT_BATCH``) at a time
        (``plan_import``, then ``import_batch`` for each batch), so memory stays bounded whatever the export's
        size. Every record is checked first: a malformed one (by index), an id repeated or live here with another
        scope or text, and nothing is written. Idempotent by record: one already live as given is skipped, so an
        import cut short is completed by running it again (this module says how). Returns ``{"count": n, "scopes":
        {"user_id=alice": 3, ...}, "existing": skipped}``. Raises MemoryInputError, ImportTooLarge (a subclass)."""
        plan = self.plan_import(export, namespace)
        for batch in plan.batches:
            self.import_batch(batch)
        return plan.result()

    def plan_import(self, export, namespace: str | None = None) -> ImportPlan:
        """``import_memories``' checks, without writing: the export's batches (``read_export``). Reads
        the store only (one indexed lookup per record), so it need not run on the model thread."""
        return read_export(export, namespace, lambda i: self._fact(i, namespace), self.import_batch_size)

    def import_batch(self, batch: tuple[str, list]) -> str:
        """Encode and commit one batch of a ``plan_import``: (store user, items), in one commit. Returns the
        scope's new version. Raises StoreError when an id became live since the plan was made (nothing of this
        batch is written)."""
        user, items = batch
        new = [(text, fid, meta) for _, text, fid, meta in items]
        ctx, refs = self._context(user, [], 0)
        version, _ = self._write(
            user, new, [], [], [ctx] * len(new), [], time.time(), {fid: t for t, _, fid, _ in items}, True,
            provenance=[(refs, ())] * len(new),
        )  # fmt: skip
        return version
