"""Import of a Mem0 export: the records checked, all of them before anything is written, and grouped by scope.

An export is what ``MemoryClient.get_all`` or the OSS ``get_all`` returns: a ``{"results": [...]}`` page or a
list of items. ``Memory.import_memories`` writes each scope's memories in one commit (``read_export`` says what).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from .. import scopes
from . import mem0
from .mem0 import MemoryInputError

Item = tuple[float, str, str, dict]  # (created_at, Unix seconds; text; memory id; metadata)


def read_export(export, namespace: str | None, exists: Callable[[str], bool]) -> dict[str, list[Item]]:
    """The export's memories by store user (scope key in ``namespace``), each scope's in creation order, with
    their ids (a new uuid where a record has none), metadata, role, actor, categories and expiration date kept.
    ``exists(id)``: whether the store holds that memory live already. Raises MemoryInputError naming up to five
    bad records by index (not an object, a bad scope or text, an id that is not a string, repeated or live
    already, a bad time or date): then nothing may be written."""
    records = export.get("results") if isinstance(export, dict) else export
    if not isinstance(records, list) or not records:
        raise MemoryInputError("an export is a non-empty list of memories, or an object with 'results'")
    by_scope: dict[str, list[Item]] = {}
    errors, seen = [], set()
    for i, rec in enumerate(records):
        try:
            if not isinstance(rec, dict):
                raise MemoryInputError("is not an object")
            scope = mem0.scope_of(rec.get("user_id"), rec.get("agent_id"), rec.get("run_id"))
            text = mem0.check_text(rec.get("memory"), "'memory'")
            fid = rec.get("id") or str(uuid.uuid4())
            if not isinstance(fid, str) or fid in seen:
                raise MemoryInputError(f"id {fid!r} is not a string or appears twice")
            seen.add(fid)
            if exists(fid):
                raise MemoryInputError(f"memory {fid!r} already exists")
            meta = mem0.user_metadata(rec.get("metadata"))
            for key in ("role", "actor_id", "categories"):
                if rec.get(key) is not None:
                    meta[key] = rec[key]
            if rec.get("expiration_date") is not None:
                meta["expiration_date"] = mem0.check_expiration(rec["expiration_date"], past=True)
            created = mem0.parse_time(rec.get("created_at"))
            by_scope.setdefault(scope.key(namespace), []).append((created, text, fid, meta))
        except MemoryInputError as exc:
            errors.append(f"record {i}: {exc}")
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise MemoryInputError("nothing imported: " + "; ".join(errors[:5]) + more)
    for items in by_scope.values():
        items.sort(key=lambda x: x[0])
    return by_scope


def scope_label(user: str, namespace: str | None) -> str:
    """A scope key as the import's count names it, e.g. ``user_id=alice&agent_id=travel``."""
    return "&".join(f"{k}={v}" for k, v in scopes.parse_key(user, namespace).ids().items())
