"""The ``Rows`` seam: where a store's rows live (its manifest, header KV, facts, tombstones, versions, history, turns
and segment checksums). ``Store`` runs one set of SQL statements on either backend, and callers never branch on the
backend they hold; ``backends.open_rows`` picks one for a location:

- ``sqlite_rows.SQLiteRows``: a local directory, the embedded default.
- ``postgres_rows.PostgresRows``: a PostgreSQL database that many processes on many machines share.

Statements are written once, for both: ``?`` placeholders, ``"user"``/``"window"``/``"row"`` quoted (reserved
words in PostgreSQL), ``ON CONFLICT`` upserts, ``Rows.tokens_sql`` for a fact's token count. The tables are
defined once too (``schema``), rendered to each backend's dialect. ``keyword_terms`` is the one rule, for both,
of which words of a query a keyword search looks for.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

# Snowball's English stop words, the list PostgreSQL's 'english' configuration drops: a keyword query keeps the
# same words on both backends, and a question's "what did ... the ..." does not match every fact
_STOP = (
    "i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her hers "
    "herself it its itself they them their theirs themselves what which who whom this that these those am is are "
    "was were be been being have has had having do does did doing a an the and but if or because as until while "
    "of at by for with about against between into through during before after above below to from up down in out "
    "on off over under again further then once here there when where why how all any both each few more most "
    "other some such no nor not only own same so than too very s t can will just don should now"
)
STOP_WORDS = frozenset(_STOP.split())


def keyword_terms(query: str, limit: int = 32) -> list[str]:
    """The words of ``query`` a keyword search looks for: lowercased runs of letters and digits, stop words
    (``STOP_WORDS``) and repeats dropped, at most ``limit``. Only these reach the full-text query, so no input can
    inject its syntax."""
    words = [w for w in re.findall(r"\w+", query.lower()) if w not in STOP_WORDS and w != "_"]
    return list(dict.fromkeys(words))[:limit]


class Rows(ABC):
    """One store's rows. The owning ``Store`` guards the connection its reads share with its lock.

    ``location``: what reopens it (a directory, or the full URL); ``name``: the same for messages (no
    credentials). Cursors returned by ``execute`` support ``fetchone``, ``fetchall`` and iteration."""

    location: str | Path
    name: str
    tokens_sql: str  # SQL expression: the token count of a facts row
    segments_dir: Path | None = None  # where the store keeps its own segments when it names no segments URL
    shared: bool = False  # reached by many machines, so its segments must be shared too (a segments URL)

    @abstractmethod
    def exists(self) -> bool:
        """Whether a store (its manifest) is here."""

    @abstractmethod
    def check_new(self) -> None:
        """Raises StoreError unless a new store can be created here (nothing of a store is here yet)."""

    @abstractmethod
    def create(self, manifest: dict, header: bytes) -> None:
        """``check_new``, then make the schema, then the header, then the manifest (last: it is what makes a store)."""

    @abstractmethod
    def manifest(self) -> dict:
        """The manifest as stored (any JSON value; ``Store.open`` checks it). Raises StoreError."""

    @abstractmethod
    def header(self) -> bytes:
        """The header KV, a safetensors file's bytes."""

    @abstractmethod
    def execute(self, sql: str, args=()):
        """Run one statement (``?`` placeholders); returns its cursor."""

    @abstractmethod
    def executemany(self, sql: str, rows) -> None: ...

    @abstractmethod
    def snapshot(self):
        """Context: one read transaction; every statement inside sees one committed state."""

    @abstractmethod
    def transaction(self):
        """Context: one write transaction, committed on exit, rolled back on an exception."""

    @abstractmethod
    def next_version(self) -> int:
        """Inside ``transaction``: a new store-wide version, larger than every one before (never reused)."""

    @abstractmethod
    def locked(self, user: str | None, timeout_s: float | None):
        """Context: the writer lock for ``user`` (None: the whole store). Raises StoreBusy after ``timeout_s``
        (None: wait as long as it takes)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the rows take (files or tables)."""

    @abstractmethod
    def has_text_index(self) -> bool:
        """Whether the store has the full-text index of its facts (``schema.TEXT_INDEX``; stores created before it
        do not)."""

    @abstractmethod
    def add_text_index(self) -> None:
        """Create the full-text index (``schema.render_text_index``) over the live facts already here, if missing
        (a store created before it). DDL: only under the whole store's writer lock."""

    @abstractmethod
    def keyword(self, user: str, terms: list[str], limit: int) -> list[tuple[int, float]]:
        """The ``limit`` live facts of ``user`` that best match any of ``terms`` (``keyword_terms``) in the
        full-text index: ``[(row, score)]``, best first, score > 0 (SQLite: BM25, FTS5's ``bm25`` negated;
        PostgreSQL: ``ts_rank``). Only call it when ``has_text_index``."""

    @abstractmethod
    def has_table(self, name: str) -> bool:
        """Whether the schema holds table ``name`` (one added after a store was created is absent there)."""

    def replaced(self) -> bool:
        """Whether the store here was deleted or created again since this object opened it."""
        return False

    def scrub(self) -> bool:
        """After an erasure: leave no copy of erased rows' bytes in the backend's own files where it can (SQLite:
        deleted content is zeroed as it is freed, ``secure_delete``; the WAL, which still holds the old pages, is
        checkpointed and truncated). PostgreSQL's dead tuples go at its next (auto)vacuum. Returns whether it
        completed; when it did not (SQLite: a reader of an older snapshot kept the WAL busy past a few short
        tries) it is logged and recorded, and ``scrub_pending`` says so until a later scrub completes."""
        return True

    def scrub_pending(self) -> bool:
        """Whether an earlier ``scrub`` did not complete (recorded in the store: any process's next commit retries
        it)."""
        return False

    def available(self) -> bool:
        """Whether the rows can be read and written now (a database that answers); never waits long."""
        return True

    @property
    def busy_timeout_s(self) -> float | None:
        """How long a statement waits for another process's write lock, s; None where the backend has no such
        wait (PostgreSQL: writers wait on advisory locks, under ``locked``'s timeout)."""
        return None

    def holds_other_data(self) -> bool:
        """Whether something that is not a store is here, so that no store may be made or copied into it."""
        return False

    @abstractmethod
    def close(self) -> None: ...
