"""Where a store is: its location (a directory or a ``postgresql://`` URL), spelled without credentials for
messages and engine configs, and the errors a store raises.

``redact`` / ``canonical`` never return a password; ``password`` is the one place that reads it back out of a URL
(libpq then gets it from ``PGPASSWORD``).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")


class StoreError(RuntimeError):
    """Missing or unreadable store, unknown user, unreachable database."""


class StoreBusy(StoreError):
    """A write waited longer than the store's ``write_timeout_s`` for another writer's lock."""


class StoreUnavailable(StoreError):
    """The store's database cannot be reached (down, restarting, a network cut): try again later."""


class StoreConflict(StoreError):
    """A compare-and-set commit found a memory changed since it was read (another writer, maybe on another
    machine, updated or deleted it first). Nothing was written; read it again and retry."""


class UnknownUser(StoreError):
    """The user has no live memories in this store (never written, or every fact deleted)."""


class StoreMismatch(StoreError):
    """The store's KV was produced by a different model, tokenizer, dtype or RoPE config."""


class StoreDtypeMismatch(StoreMismatch):
    """Same model, but the store's KV was computed in another dtype than the one serving it."""


def is_url(location: str | Path) -> bool:
    return bool(_URL.match(str(location)))


def redact(url: str) -> str:
    """``url`` without its password (``user:pw@`` or ``?password=``), for messages and engine configs:
    ``postgresql://kv@db:5432/kvmem?options=...``."""
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = user.split(":", 1)[0] + "@" + host
    kept = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"]
    query = urlencode(kept, safe="/:,")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def canonical(location: str | Path) -> str:
    """One spelling per store: a URL without its password (libpq reads it from ``PGPASSWORD`` or ``~/.pgpass``;
    see ``password``), a directory as its absolute resolved path. What goes into an engine's configuration,
    which engines log."""
    return redact(str(location)) if is_url(location) else str(Path(location).resolve())


def password(location: str | Path) -> str | None:
    """The password in a store URL (``user:pw@`` or ``?password=``), decoded, if it has one."""
    if not is_url(location):
        return None
    parts = urlsplit(str(location))
    if parts.password is not None:
        return unquote(parts.password)
    return dict(parse_qsl(parts.query)).get("password")


def within(location: str | Path, allowed: list[str]) -> bool:
    """Whether ``location`` is one of the ``allowed`` (canonical) locations, or a directory below one."""
    loc = canonical(location)
    if is_url(loc):
        return loc in allowed
    return any(loc == a or Path(a) in Path(loc).parents for a in allowed if not is_url(a))
