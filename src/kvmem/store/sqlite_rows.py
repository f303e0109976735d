"""``SQLiteRows``: a store's rows in a local directory (``manifest.json``, ``header.safetensors``, ``meta.sqlite``
in WAL mode, a ``.writer.lock`` file lock). The embedded default; its format is unchanged. The seam it implements
is ``rows.Rows``."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

from .location import StoreBusy, StoreError
from .schema import MIGRATIONS, SCHEMA_VERSION, SQLITE, migration, render, render_text_index
from .segments import fsync_dir
from .sql_rows import SQLRows

BUSY_TIMEOUT_S = 30.0
# an erasure's WAL checkpoint waits this long per try for readers of older snapshots, this many tries, so a long
# read never holds the erasing writer for BUSY_TIMEOUT_S; then it is recorded and retried by the next commit
SCRUB_WAIT_S, SCRUB_TRIES = 0.2, 5
SCRUB_PENDING = "scrub:pending"  # meta key: the time of the erasure whose WAL checkpoint did not complete

logger = logging.getLogger("kvmem.store")


class SQLiteRows(SQLRows):
    """A store directory: ``manifest.json``, ``header.safetensors``, ``meta.sqlite`` (WAL, busy timeout)."""

    tokens_sql = "json_array_length(token_ids)"

    def __init__(self, root: str | Path):
        self.location = self.root = Path(root)
        self.name = str(root)
        self.segments_dir = self.root / "users"
        self._db: sqlite3.Connection | None = None
        self._ino = self._manifest_ino()
        self._text = False  # has_text_index, once it is True

    def _manifest_ino(self) -> int | None:
        try:
            return (self.root / "manifest.json").stat().st_ino
        except OSError:
            return None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            db = self.root / "meta.sqlite"
            if not db.exists():
                raise StoreError(f"store {self.root} has no meta.sqlite (corrupt)")
            self._db = self._connect()
            try:
                got = self._db.execute("PRAGMA user_version").fetchone()[0]
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"{db} is corrupt: {exc}") from None
            if got in MIGRATIONS:
                self._migrate(got)
            elif got != SCHEMA_VERSION:
                raise StoreError(f"{db}: schema version {got} is not {SCHEMA_VERSION}; re-ingest into a new store")
        return self._db

    def _migrate(self, got: int) -> None:
        """Bring an older schema to ``SCHEMA_VERSION`` in one transaction (the only write an open makes; another
        process migrating at once finds the new version inside the lock and does nothing)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if self._db.execute("PRAGMA user_version").fetchone()[0] == got:
                for stmt in migration(SQLITE, got):
                    self._db.execute(stmt)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.root / "meta.sqlite", isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
        )
        db.execute("PRAGMA secure_delete=ON")  # freed content is zeroed: an erased text leaves no bytes behind
        return db

    def scrub(self) -> bool:
        if self.has_text_index():  # FTS5 keeps a deleted row's terms in older index segments until they merge
            self.db.execute("INSERT INTO facts_text (facts_text) VALUES ('optimize')")
        pending = self.scrub_pending()
        done = self._checkpoint()
        if done and pending:
            with self.transaction():
                self.db.execute("DELETE FROM meta WHERE key=?", (SCRUB_PENDING,))
            done = self._checkpoint()  # that delete's own frames: no erased text, but leave the WAL empty
        elif not done:
            logger.warning(
                "store %s: the WAL still holds erased text (a reader holds an older snapshot); the next commit "
                "checkpoints it again",
                self.root,
            )
            if not pending:
                with self.transaction():
                    self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (SCRUB_PENDING, time.time()))
        return done

    def _checkpoint(self) -> bool:
        """``PRAGMA wal_checkpoint(TRUNCATE)``, each try bounded by ``SCRUB_WAIT_S`` (not the busy timeout), up to
        ``SCRUB_TRIES`` tries. Whether it completed (its first column, busy, is 0: every frame was copied back and
        the WAL truncated; a reader of an older snapshot keeps it busy)."""
        self.db.execute(f"PRAGMA busy_timeout={int(SCRUB_WAIT_S * 1e3)}")
        try:
            for _ in range(SCRUB_TRIES):
                if self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0:
                    return True
            return False
        finally:
            self.db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1e3)}")

    def scrub_pending(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key=?", (SCRUB_PENDING,)).fetchone() is not None

    def exists(self) -> bool:
        return (self.root / "manifest.json").exists()

    def check_new(self) -> None:
        if self.exists():
            raise StoreError(f"{self.root} already holds a store")
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"--store {self.root} is a file, not a directory")
        if (self.root / "meta.sqlite").exists() or any((self.root / "users").glob("*.safetensors")):
            raise StoreError(f"store {self.root} has data but no manifest.json (corrupt); refusing to overwrite it")

    def create(self, manifest: dict, header: bytes) -> None:
        self.check_new()
        (self.root / "users").mkdir(parents=True, exist_ok=True)
        _write_durably(self.root / "header.safetensors", header)
        db = self._connect()
        try:
            db.execute("PRAGMA journal_mode=WAL")  # first: it cannot change inside a transaction
            # one transaction: one fsync for the whole schema, not one per statement
            db.executescript(f"BEGIN;\n{render(SQLITE)}{render_text_index(SQLITE)}COMMIT;\n")
        finally:
            db.close()
        _write_durably(self.root / "manifest.json", json.dumps(manifest, indent=2).encode())
        fsync_dir(self.root)
        self._ino = self._manifest_ino()

    def manifest(self) -> dict:
        path = self.root / "manifest.json"
        if not path.exists():
            raise StoreError(
                f"no kvmem store at {self.root} (check the path; `kvmem memory add`, `kvmem serve` or "
                f"`kvmem ingest-locomo` with --store {self.root} create one)"
            )
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path} is corrupt: {exc}") from None
        self.db  # noqa: B018 -- opens meta.sqlite and checks its schema version
        return manifest

    def header(self) -> bytes:
        return (self.root / "header.safetensors").read_bytes()

    def execute(self, sql: str, args=()):
        return self.db.execute(sql, args)

    def executemany(self, sql: str, rows) -> None:
        self.db.executemany(sql, rows)

    @contextmanager
    def snapshot(self):
        self.db.execute("BEGIN")  # WAL: the first read fixes the snapshot until COMMIT
        try:
            yield
        finally:
            self.db.execute("COMMIT")

    @contextmanager
    def transaction(self):
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            yield

    def next_version(self) -> int:
        return self.db.execute("UPDATE meta SET value=value+1 WHERE key='version' RETURNING value").fetchone()[0]

    @contextmanager
    def locked(self, user: str | None, timeout_s: float | None):
        # one lock for the whole store: a file lock, so writers in any process (and thread) serialize
        with open(self.root / ".writer.lock", "a") as f:
            if timeout_s is None:
                fcntl.flock(f, fcntl.LOCK_EX)
            else:
                deadline = time.monotonic() + timeout_s
                while not _try_flock(f):
                    if time.monotonic() >= deadline:
                        raise StoreBusy(
                            f"store {self.root} is busy: another writer (a compaction, fsck or ingest?) held its "
                            f"lock for {timeout_s:g} s"
                        )
                    time.sleep(0.02)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @property
    def busy_timeout_s(self) -> float:
        """How long the SQLite connection waits for another process's write lock, s."""
        return self.db.execute("PRAGMA busy_timeout").fetchone()[0] / 1e3

    def has_text_index(self) -> bool:
        if not self._text:  # once there, it stays: only its absence is checked again (another process may add it)
            q = "SELECT 1 FROM sqlite_master WHERE type='table' AND name='facts_text'"
            self._text = self.db.execute(q).fetchone() is not None
        return self._text

    def add_text_index(self) -> None:
        self.db.executescript(f"BEGIN IMMEDIATE;\n{render_text_index(SQLITE)}COMMIT;\n")
        self._text = True

    def keyword(self, user: str, terms: list[str], limit: int) -> list[tuple[int, float]]:
        if not terms:
            return []
        # the user's hex name narrows the match to its postings (the index holds live rows only: triggers); the
        # exact name is checked after the ranking, on the few rows it kept (a join before it cost 40% more)
        words = " OR ".join(f'"{t}"' for t in terms)
        match = f'owner : "{user.encode().hex().upper()}" AND text : ({words})'
        ranked = self.db.execute(
            "SELECT rowid, -bm25(facts_text, 1.0, 0.0) FROM facts_text WHERE facts_text MATCH ? "
            "ORDER BY bm25(facts_text, 1.0, 0.0), rowid LIMIT ?",
            (match, limit + 16),  # room for another name whose hex stems alike (never seen)
        ).fetchall()
        if not ranked:
            return []
        marks = ",".join("?" * len(ranked))
        mine = {r for (r,) in self.db.execute(
            f"SELECT row FROM facts WHERE row IN ({marks}) AND user = ? AND deleted IS NULL",
            (*(r for r, _ in ranked), user),
        )}  # fmt: skip
        return [(int(r), float(s)) for r, s in ranked if r in mine][:limit]

    def holds_other_data(self) -> bool:
        """A non-empty directory without a manifest."""
        return not self.exists() and self.root.is_dir() and any(self.root.iterdir())

    def nbytes(self) -> int:
        def size(p: Path) -> int:
            try:
                return p.stat().st_size if p.is_file() else 0
            except FileNotFoundError:  # removed by a concurrent writer during the walk
                return 0

        return sum(size(p) for p in self.root.rglob("*") if p.parent != self.root / "users")

    def replaced(self) -> bool:
        return self._manifest_ino() != self._ino

    def has_table(self, name: str) -> bool:
        q = "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?"
        return self.db.execute(q, (name,)).fetchone() is not None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _try_flock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
