"""Which ``Rows`` backend holds the rows at a location: ``BACKENDS`` by URL scheme, or a directory."""

from __future__ import annotations

from pathlib import Path

from .location import POSTGRES_SCHEMES, StoreError, is_url
from .postgres_rows import PostgresRows
from .rows import Rows
from .sqlite_rows import SQLiteRows

# a URL scheme -> the class of its rows, made as ``cls(url, answer_cap_s)``: a new backend's one registration
BACKENDS: dict[str, type[Rows]] = dict.fromkeys(POSTGRES_SCHEMES, PostgresRows)


def open_rows(location: str | Path, answer_cap_s: float | None = None) -> Rows:
    """The rows at ``location``: a URL of a scheme in ``BACKENDS`` (``postgresql://…``: ``PostgresRows``, each
    answer bounded by ``answer_cap_s`` too) or a directory (``SQLiteRows``). Raises StoreError for any other URL
    (it would otherwise become a directory named after its scheme)."""
    text = str(location)
    if is_url(text):
        scheme = text.split(":", 1)[0].lower()
        if scheme in BACKENDS:
            return BACKENDS[scheme](text, answer_cap_s)
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
