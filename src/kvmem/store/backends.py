"""Which ``Rows`` backend holds the rows at a location: a PostgreSQL URL or a directory."""

from __future__ import annotations

from pathlib import Path

from .location import StoreError, is_postgres, is_url
from .postgres_rows import PostgresRows
from .rows import Rows
from .sqlite_rows import SQLiteRows


def open_rows(location: str | Path, answer_cap_s: float | None = None) -> Rows:
    """The rows at ``location``: ``postgresql://…`` (``PostgresRows``, each answer bounded by ``answer_cap_s`` too)
    or a directory (``SQLiteRows``). Raises StoreError for any other URL (it would otherwise become a directory
    named after its scheme)."""
    text = str(location)
    if is_url(text):
        scheme = text.split(":", 1)[0].lower()
        if is_postgres(text):
            return PostgresRows(text, answer_cap_s)
        hint = (
            " (KV segments go by --segments URL; their rows by --store postgresql://…)"
            if scheme in ("s3", "gs", "az", "file", "http", "https")
            else ""
        )
        raise StoreError(
            f"--store {scheme}://… is not a store location: give a directory, or a PostgreSQL URL "
            f"postgresql://user@host:5432/db{hint}"
        )
    return SQLiteRows(location)
