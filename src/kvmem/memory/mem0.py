"""Mem0's surface, in one place: its input checks (each raising ``MemoryInputError`` with the sentence a caller
sees) and its output shapes (memory items, history rows, filter fields), as mem0ai 2.2.1's ``Memory`` has them.

Nothing here reads or writes a store: ``Memory`` (the facade) checks its arguments here, then does the work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from datetime import UTC, date, datetime

from .. import compose, scopes
from ..policy import check_user
from ..scopes import Scope, ScopeError
from ..store import FactRecord

logger = logging.getLogger("kvmem.memory")

MAX_MESSAGE_CHARS = 8000
MAX_MESSAGES = 64
MAX_NAME_CHARS = 64
PROMOTED = ("role", "actor_id", "expiration_date")  # stored in a memory's metadata, shown beside it (as Mem0)
IDENTITY = frozenset({"user_id", "agent_id", "run_id", "actor_id"})  # set by the scope, never by metadata


class MemoryInputError(ValueError):
    """Bad input (unknown memory id, empty or oversized message, malformed message list, bad user_id, empty
    update, a malformed filter): nothing is changed. The CLI prints it as one ``error:`` line and exits 2.
    ``param``: the request field at fault where one is (``filters``), which the server names in its 400."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class MemoryConflict(RuntimeError):
    """A write lost a race: the memory it read was updated or deleted by another writer (another replica, another
    process) before it committed, so it changed nothing rather than overwrite that change. Read it again and retry.
    Over HTTP: 409 ``memory_conflict``."""


# --- input checks -----------------------------------------------------------------------------------------------


def check_messages(messages) -> list[dict]:
    """A string or an OpenAI-style list of {role, content} -> checked messages. Raises MemoryInputError."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list) or not messages:
        raise MemoryInputError("messages must be a non-empty string or a list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise MemoryInputError(f"at most {MAX_MESSAGES} messages per add, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("content"), str)
            or not isinstance(m.get("role", "user"), str)
        ):
            raise MemoryInputError(f"message {i} must be an object with a string 'content' (and 'role')")
        for key in ("role", "name"):
            v = m.get(key)
            if v is not None and (not isinstance(v, str) or not v.strip() or len(v) > MAX_NAME_CHARS):
                raise MemoryInputError(
                    f"message {i}: '{key}' must be a non-empty string of at most {MAX_NAME_CHARS} characters"
                )
            if v is not None:
                check_text(v, f"message {i} {key}", MAX_NAME_CHARS)
        if not m["content"].strip():
            raise MemoryInputError(f"message {i} is empty")
        text = check_text(m["content"], f"message {i}")
        out.append({"role": m.get("role", "user"), "content": text, "name": m.get("name")})
    return out


def check_user_id(user_id) -> str:
    try:
        return check_user(user_id)
    except ValueError as exc:
        raise MemoryInputError(str(exc)) from None


def check_text(text, what: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A non-empty, valid-Unicode string of at most ``limit`` characters, stripped. Raises MemoryInputError."""
    if not isinstance(text, str) or not text.strip():
        raise MemoryInputError(f"{what} must be a non-empty string")
    if len(text) > limit:
        raise MemoryInputError(f"{what} has {len(text)} characters; at most {limit}")
    try:
        return compose.check_text(text.strip(), what)
    except ValueError as exc:
        raise MemoryInputError(str(exc)) from None


def check_metadata(metadata) -> str:
    """Metadata as JSON: an object of JSON values. Raises MemoryInputError."""
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise MemoryInputError("metadata must be an object")

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from strings(k)
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)

    try:
        for text in strings(metadata):  # a lone surrogate would be stored, then break every read
            compose.check_text(text, "metadata")
        out = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MemoryInputError(f"metadata must hold JSON values only ({exc})") from None
    if len(out) > MAX_MESSAGE_CHARS:
        raise MemoryInputError(f"metadata is {len(out)} characters of JSON; at most {MAX_MESSAGE_CHARS}")
    return out


def user_metadata(metadata) -> dict:
    """The caller's metadata, checked (``check_metadata``), without identity keys (a scope is set by ids only)."""
    check_metadata(metadata)
    out = {k: v for k, v in (metadata or {}).items() if k not in IDENTITY}
    if len(out) < len(metadata or {}):
        logger.warning("ignoring identity keys in metadata: scopes are set by user_id, agent_id and run_id")
    return out


def check_timestamp(timestamp) -> float:
    """Unix seconds (now if None), between 1970 and the year 3000. Raises MemoryInputError."""
    if timestamp is None:
        return time.time()
    try:
        ts = float(timestamp)
    except (TypeError, ValueError):
        raise MemoryInputError(f"timestamp must be Unix seconds, not {timestamp!r}") from None
    if not 0 <= ts < 32503680000:  # year 3000
        raise MemoryInputError(f"timestamp {timestamp!r} is out of range (Unix seconds)")
    return ts


def parse_time(value) -> float:
    """An export's ``created_at`` (ISO 8601, naive read as UTC; or Unix seconds) as Unix seconds; now if absent."""
    if value is None:
        return time.time()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_timestamp(value)
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise MemoryInputError(f"created_at {value!r} is not an ISO 8601 time") from None
    return check_timestamp((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp())


def today() -> str:
    """Today's UTC date, YYYY-MM-DD: what expiry is checked against."""
    return datetime.now(UTC).date().isoformat()


def check_expiration(value, past: bool = False) -> str | None:
    """An expiration date as YYYY-MM-DD (a ``date``, ``datetime`` or ISO string), today or later (``past``: or
    earlier, as an imported memory that has expired already). Raises MemoryInputError."""
    if value is None:
        return None
    if isinstance(value, datetime):
        value = value.date()
    if isinstance(value, date):
        value = value.isoformat()
    try:
        out = date.fromisoformat(value).isoformat() if isinstance(value, str) else None
    except ValueError:
        out = None
    if out is None:
        raise MemoryInputError(f"expiration_date must be a date in YYYY-MM-DD format, not {value!r}")
    if out < today() and not past:
        raise MemoryInputError(f"expiration_date {out} is in the past (today is {today()} UTC)")
    return out


def check_count(value, name: str, default: int) -> int:
    """A non-negative integer (``default`` if None). Raises MemoryInputError."""
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MemoryInputError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_threshold(threshold) -> None:
    """A search's score threshold: a number in [0, 1], or None. Raises MemoryInputError."""
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise MemoryInputError(f"threshold must be a number between 0 and 1, got {threshold!r}")
    if threshold is not None and not 0 <= threshold <= 1:
        raise MemoryInputError(f"Invalid threshold: {threshold}. Must be between 0 and 1 (inclusive).")


def refuse(unsupported: dict, method: str) -> None:
    """Mem0 arguments kvmem does not implement, and unknown ones: one sentence naming them."""
    if not unsupported:
        return
    names = ", ".join(sorted(unsupported))
    raise MemoryInputError(
        f"{method}() does not support {names} (kvmem scores by cosine similarity alone; see docs/mem0.md)"
    )


def check_memory_type(memory_type) -> None:
    """Mem0's ``memory_type`` (procedural memory): refused unless None."""
    if memory_type is not None:
        raise MemoryInputError(
            f"memory_type {memory_type!r} is not supported: kvmem stores facts (procedural memory, an agent's "
            "summarised run, is not kept); add without memory_type"
        )


def check_update(text, metadata, expiration_given: bool) -> None:
    """An update must change something. Raises MemoryInputError."""
    if text is None and metadata is None and not expiration_given:
        raise MemoryInputError("At least one of text, metadata, or expiration_date must be provided.")


def check_delete_all(user_id, agent_id, run_id) -> None:
    """``delete_all`` needs at least one entity id (``reset`` deletes everything). Raises MemoryInputError."""
    if user_id is None and agent_id is None and run_id is None:
        raise MemoryInputError(
            "At least one filter is required to delete all memories. If you want to delete all memories, "
            "use the `reset()` method."
        )


def scope_of(user_id=None, agent_id=None, run_id=None) -> Scope:
    """The entity scope of these ids (``scopes.Scope.of``). Raises MemoryInputError."""
    try:
        return Scope.of(user_id, agent_id, run_id)
    except ScopeError as exc:
        raise MemoryInputError(str(exc)) from None


def read_filters(filters, ids: dict) -> tuple[dict, Scope]:
    """A read's ``filters`` with the top-level entity ``ids`` merged in, checked, and the scope they name (its
    entity ids, each checked). Raises MemoryInputError for conflicting ids, no entity id, or a malformed filter."""
    if filters is not None and not isinstance(filters, dict):
        raise MemoryInputError("filters must be an object", "filters")
    filters = dict(filters or {})
    try:
        for name, value in ids.items():
            if value is None:
                continue
            have = scopes.entity_constraints(filters).get(name)
            if name in filters and have is None or have is not None and str(have) != str(value):
                raise MemoryInputError(f"conflicting scopes: {name}={value!r} and filters say {have!r}")
            filters[name] = value
        want = scopes.entity_constraints(filters)
    except ScopeError as exc:
        raise MemoryInputError(str(exc), "filters") from None
    if not want:
        raise MemoryInputError(
            "filters must contain at least one of: user_id, agent_id, run_id (e.g. filters={'user_id': 'u1'})"
        )
    named = scope_of(**want)
    for name in want:
        filters[name] = getattr(named, name)
    return filters, named


def compile_filters(filters: dict):
    """``scopes.compile_filters``: (predicate over ``filter_fields``, the field names it reads). Raises
    MemoryInputError (``param`` "filters") for an unknown operator, a bad operand or a malformed filter."""
    try:
        return scopes.compile_filters(filters)
    except ScopeError as exc:
        raise MemoryInputError(str(exc), "filters") from None


def by_ids_only(filters: dict) -> bool:
    """Whether ``filters`` are exactly entity ids (the scopes they pick need no further filtering)."""
    return all(k in scopes.ENTITIES and not isinstance(v, dict) and v != "*" for k, v in filters.items())


def check_fields(used: set[str], known: set[str]) -> None:
    """A filter may only name a field some memory of the scope has. Raises MemoryInputError."""
    unknown = sorted(used - known)
    if unknown:
        raise MemoryInputError(f"filter on {unknown[0]!r}: no memory in this scope has that field", "filters")


# --- output shapes ----------------------------------------------------------------------------------------------


def date_label(ts: float) -> str:
    """Unix seconds as a fact's date label, e.g. "3 December, 2026" (UTC)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%-d %B, %Y")


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def actor(message: dict) -> dict:
    """A message's sender name as Mem0's ``actor_id`` metadata."""
    return {"actor_id": message["name"]} if message.get("name") else {}


def filter_fields(f: FactRecord, scope: Scope) -> dict:
    """A memory's fields as a filter sees them: its metadata, entity ids, text and times."""
    return {**json.loads(f.metadata or "{}"), **scope.ids(), "memory": f.text, **_times(f)}


def _times(f: FactRecord) -> dict:
    return {"created_at": iso(f.created_at), "updated_at": iso(f.updated_at)}


def item(f: FactRecord, namespace=None, score: float | None = None) -> dict:
    """Mem0's memory item (``MemoryItem`` plus the promoted entity ids, role and expiration date)."""
    meta = json.loads(f.metadata or "{}")
    s = scopes.parse_key(f.user, namespace) or Scope(user_id=f.user)
    out = {
        "id": f.fact_id,
        "memory": f.text,
        "hash": hashlib.md5(f.text.encode()).hexdigest(),
        "metadata": {k: v for k, v in meta.items() if k not in PROMOTED} or None,
        "created_at": iso(f.created_at),
        "updated_at": iso(f.updated_at),
        **s.ids(),
        **{k: meta[k] for k in PROMOTED if k in meta},
    }
    if score is not None:
        out["score"] = round(float(score), 6)
    return out


def history_rows(events: list[dict], memory_id) -> list[dict]:
    """The store's history events of one memory as Mem0's history rows (id, memory_id, old_memory, new_memory,
    event, created_at, updated_at, is_deleted, actor_id, role; plus the store's user_id), in place. Raises
    MemoryInputError for an id that never existed, or one that several scopes used."""
    if not events:
        raise MemoryInputError(f"memory {memory_id!r} not found")
    if len({e["user_id"] for e in events}) > 1:
        raise MemoryInputError(f"memory id {memory_id!r} belongs to several scopes")
    for e in events:
        e["created_at"] = e["updated_at"] = iso(e["created_at"])
        e.update(is_deleted=e["event"] == "DELETE", actor_id=None, role=None)
    return events


def added(records) -> list[dict]:
    """ADD results, one per new memory: ``{"id", "memory", "event": "ADD"}``."""
    return [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in records]
