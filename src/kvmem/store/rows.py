"""The ``Rows`` seam: where a store's rows live (its manifest, header KV, facts, tombstones, versions, history, turns
and segment checksums), as named operations at the height of the store's job: what ``read``, ``write``, ``upkeep``
and ``copy`` need, and nothing of how. Callers never branch on the backend they hold; ``backends.open_rows`` picks
one for a location (``backends.BACKENDS``: a URL scheme -> its class; a directory otherwise):

- ``sqlite_rows.SQLiteRows``: a local directory, the embedded default.
- ``postgres_rows.PostgresRows``: a PostgreSQL database that many processes on many machines share.

Both are SQL backends: the operations are written once as SQL for both (``sql_rows.SQLRows``), over the tables
defined once (``schema``); a backend gives its connection's primitives. A backend of another kind implements
``Rows`` itself. ``keyword_terms`` is the one rule, for every backend, of which words of a query a keyword search
looks for.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scopes import IndexQuery
    from .records import FactRecord, Write

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
    """One store's rows. The owning ``Store`` guards the connection its reads share with its lock; a write's
    operations run under the writer lock (``locked``) of its user (``compactions``' and ``reset``'s: the store's).
    Each operation that takes several statements runs them in one transaction (a read: one snapshot) of its own.

    ``location``: what reopens it (a directory, or the full URL); ``name``: the same for messages (no
    credentials). Versions are strings of a store-wide counter that never repeats."""

    location: str | Path
    name: str
    segments_dir: Path | None = None  # where the store keeps its own segments when it names no segments URL
    shared: bool = False  # reached by many machines, so its segments must be shared too (a segments URL)

    # --- the store itself -----------------------------------------------------------------------------

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

    # --- reads ----------------------------------------------------------------------------------------

    @abstractmethod
    def users(self, with_no_live_facts: bool = False) -> list[str]:
        """Users with at least one live fact, sorted (``with_no_live_facts``: every user ever written, too)."""

    @abstractmethod
    def scope_keys(self, q: IndexQuery, live: bool = False) -> list[str] | None:
        """The users the scope index files under ``q`` (``scopes.IndexQuery``), sorted, each found by an index
        range (``live``: with a live fact); None for a store created before the index."""

    @abstractmethod
    def user_page(
        self, prefix: str, contains: str, offset: int, limit: int
    ) -> tuple[int, list[tuple[str, int, int, float]]] | None:
        """(users matching, one page of (head, live facts, their tokens, last commit in Unix s)) of the users under
        key ``prefix`` whose id contains ``contains`` (case-insensitive; ``%``/``_`` are themselves), ordered by
        head, by the scope index; None for a store created before the index."""

    @abstractmethod
    def version(self, user: str) -> str | None:
        """``user``'s current version, or None if never written: one row by primary key."""

    @abstractmethod
    def live_facts(self, user: str) -> tuple[str | None, list[FactRecord], list[bytes], dict[str, str]]:
        """One read snapshot of ``user``: (version, live facts in row order, their embeddings' float32 bytes,
        segment -> SHA-256 of every segment row of the user)."""

    @abstractmethod
    def fact_token_ids(self, user: str, version: str, fact_ids: list[str]) -> dict[str, tuple[int, ...]] | None:
        """In one read snapshot: fact id -> token ids of those of ``fact_ids`` that are live facts of ``user``
        (others left out), by the (user, fact_id) index of live facts; None when ``version`` is not current."""

    @abstractmethod
    def embedding_page(self, user: str, after: int, limit: int) -> list[tuple[int, str, bytes]]:
        """Up to ``limit`` live facts of ``user`` with a row after ``after``, in row order: (row, fact id,
        embedding bytes)."""

    @abstractmethod
    def rows_token_ids(self, user: str, rows: list[int]) -> dict[int, tuple[str, tuple[int, ...]]]:
        """row -> (fact id, token ids) of those ``rows`` that are live facts of ``user``, by primary key."""

    @abstractmethod
    def live_count(self, user: str) -> tuple[int, int]:
        """(live facts, their tokens) of ``user``."""

    @abstractmethod
    def totals(self) -> tuple[int, int]:
        """(live facts, turns) of every user."""

    @abstractmethod
    def encoding(self, user: str) -> dict | None:
        """How ``user``'s latest facts were encoded: version, window, neighbours, history, source; None if never
        written."""

    @abstractmethod
    def facts_with_id(self, fact_id: str, user: str | None = None, within: str | None = None) -> list[FactRecord]:
        """The live facts with id ``fact_id`` (of ``user``; of users whose key starts with ``within``), in row
        order."""

    @abstractmethod
    def events(self, fact_id: str | None = None, user: str | None = None, within: str | None = None) -> list[dict]:
        """History events of ``fact_id`` / of ``user`` / of users whose key starts with ``within`` (each None: any),
        oldest first: id, memory_id, user_id, event, old_memory, new_memory, created_at."""

    @abstractmethod
    def turns(self, user: str, last: int | None = None) -> list[dict]:
        """``user``'s turns, oldest first (the ``last`` n): idx, dia_id, speaker, content, time."""

    @abstractmethod
    def changes(self, user: str, since: int) -> tuple[list[tuple[int, bytes]], list[int]] | None:
        """(added [(row, embedding bytes)] live, removed rows) of ``user`` after version ``since``; None when a
        compaction since then moved rows."""

    @abstractmethod
    def stale(self, user: str | None = None) -> list[tuple[str, str, str, float]]:
        """(user, fact id, segment, re-encode by) of live facts whose KV awaits re-encoding, soonest first."""

    @abstractmethod
    def has_segment(self, user: str, segment: str) -> bool:
        """Whether a segment row names ``user``'s ``segment`` (a commit of it landed)."""

    @abstractmethod
    def segment_rows(self) -> list[tuple[str, str]]:
        """(user, segment) of every segment row."""

    @abstractmethod
    def unused_segments(self, user: str | None = None) -> list[tuple[str, str]]:
        """(user, segment) of the segment rows (of ``user``) that no live fact uses."""

    @abstractmethod
    def retired(self) -> list[tuple[str, float]]:
        """(segment name, when retired) of every retired segment whose file is not yet removed."""

    @abstractmethod
    def derived(self) -> list[tuple[str, str, str]]:
        """(user, segment, fact id), in row order, of KV still held by a segment row's segment that an erasure
        made derived: a stale live fact's, or an erased fact's."""

    @abstractmethod
    def compactions(self) -> list[str]:
        """The users whose dead KV awaits a rewrite (``defer_compaction``), sorted."""

    @abstractmethod
    def dead_segments(self, user: str) -> list[str]:
        """``user``'s segments (still named by a segment row) holding rows of dead facts, sorted."""

    # --- writes, under the writer lock -----------------------------------------------------------------

    @abstractmethod
    def commit(self, write: Write, segment: str, digest: str) -> str:
        """``write``'s rows in one transaction (``write.now`` set): its ``expect`` checked first (StoreConflict),
        its erasure, tombstones, new facts in new segment ``segment`` (SHA-256 ``digest``), turns, history and
        encoding. Returns the new version. Raises StoreError, with nothing written, for an id to delete or erase
        that is not live, or a new id already live."""

    @abstractmethod
    def retire(
        self, dead: list[tuple[str, str]], retiring: list[str], done: list[str], now: float, keep_time: bool = False
    ) -> None:
        """In one transaction: drop the segment rows ``dead`` ((user, segment)), record segment names
        ``retiring`` as retired at ``now`` (``keep_time``: one retired before keeps its time), forget retired
        names ``done`` (their files are gone)."""

    @abstractmethod
    def compact_rows(
        self, user: str, written: list[tuple[str, str, str, int]], moves: list[tuple[str, int, int]],
        segments: list[str] | None, now: float,
    ) -> tuple[str, bool]:  # fmt: skip
        """A compaction's rows: new segment rows ``written`` (user, segment, sha256, tokens), facts moved
        (segment, token offset, row), dead rows of ``segments`` (None: all) dropped, the scope forgotten if
        nothing is left. Returns (new version, whether the scope was forgotten)."""

    @abstractmethod
    def reencode_rows(
        self, user: str, facts: list[FactRecord], embeddings, segment: str, digest: str, now: float
    ) -> str | None:
        """Replace live rows ``facts`` (by ``row``) with new rows in ``segment``; None, with nothing written,
        when any is no longer live. Returns the new version."""

    @abstractmethod
    def defer_compaction(self, user: str, now: float) -> None:
        """Record that ``user``'s dead KV awaits a rewrite."""

    @abstractmethod
    def compacted(self, user: str) -> None:
        """``user``'s deferred rewrite is done."""

    @abstractmethod
    def reset(self) -> None:
        """Delete every user's facts, turns, history and encoding (the version counter moves on)."""

    @abstractmethod
    def carry_stale(self, user: str, marks: dict[str, float | None]) -> None:
        """After a copy's commit: set each live fact's stale mark (fact id -> re-encode by, or None), and keep
        ``user``'s next turn index past every turn its facts' provenance names."""

    # --- the backend ----------------------------------------------------------------------------------

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
