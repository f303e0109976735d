"""``PostgresRows``: a store's rows in a PostgreSQL database (psycopg 3) that many processes on many machines
share. The manifest and header are one row of ``kvmem_manifest``; versions come from the sequence
``kvmem_version`` (they never repeat); a reader's snapshot is one REPEATABLE READ READ ONLY transaction; writers
serialize per user on session advisory locks (a store-wide one, shared by every commit and taken exclusively by
``fsck``/``reset``), so writes for different users proceed at once from different processes. Give the database by
URL (``postgresql://user@host:5432/db``; a PostgreSQL schema by ``?options=-csearch_path%3Dname``); credentials
come from the URL or libpq's environment (``PGPASSWORD``, ``~/.pgpass``) and never appear in a message. Every
connection is bounded here and nowhere else (``PG_CONNECT``, ``PG_SESSION``, ``ANSWER_GRACE_S``). The seam it
implements is ``rows.Rows``."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from urllib.parse import quote

from ..extras import require
from .location import StoreBusy, StoreError, StoreUnavailable, redact, secret_params, secrets
from .reach import PROBE_EVERY_S, PROBE_TIMEOUT_S, Reach
from .schema import MIGRATIONS, POSTGRES, SCHEMA_VERSION, migration, render, render_text_index
from .sql_rows import SQLRows

# Every PostgreSQL connection kvmem opens (the server's, the vLLM scheduler's and worker's, the CLI's) is bounded,
# here and nowhere else; a parameter the URL sets (or libpq's environment, e.g. PGCONNECT_TIMEOUT) wins over these
# (docs/operations.md, "A slow or unreachable database").
PG_CONNECT = {  # libpq's own parameters: the client's side
    "connect_timeout": "5",  # s, to open a connection (libpq counts 2 s at least)
    "keepalives": "1",
    "keepalives_idle": "10",  # s idle before the first probe; a probe every 5 s; 3 unanswered: the server is gone
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "25000",  # ms: data unacknowledged this long drops the connection
}
PG_SESSION = {  # the server's settings for each session (libpq's ``options``, -c name=value); the URL's own follow
    "statement_timeout": "10s",  # a statement running longer is cancelled by the server (503 store_unavailable)
    "lock_timeout": "10s",  # a row or table lock waited for longer (a writer's own lock wait is set per write)
    "idle_in_transaction_session_timeout": "60s",  # a client stopped inside a transaction loses it, and its locks
    # the server's side of TCP (ignored on a unix socket): a writer whose machine vanishes is found dead, and its
    # session with every advisory lock it held ends, within 10 + 3 x 5 = 25 s idle, or 25 s of unacknowledged data
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "25000",
}
ANSWER_GRACE_S = 2.0  # no answer within statement_timeout + this: the server is stalled (stopped, cut off, frozen)


PING_AFTER_S = 2.0  # a connection idle this long is checked (one round trip) before a transaction starts on it


def _lock_key(store_id: str, what: str) -> int:
    """An advisory lock key (bigint) for ``what`` of one store: stores sharing a database never share a lock."""
    return int.from_bytes(hashlib.sha256(f"kvmem:{store_id}:{what}".encode()).digest()[:8], "big", signed=True)


def _pg_sql(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]


def connect_params(url: str) -> dict[str, str]:
    """The connection parameters kvmem adds to ``url`` (``PG_CONNECT``, ``PG_SESSION`` as ``options`` ahead of the
    URL's own, credentials from ``location.secret_params``), for ``psycopg.connect(url, **params)``: what the URL
    or libpq's environment sets is left as it is. Raises what ``conninfo_to_dict`` raises for a malformed URL."""
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(url)
    env = {"connect_timeout": "PGCONNECT_TIMEOUT"}
    params = {k: v for k, v in PG_CONNECT.items() if k not in given and not os.environ.get(env.get(k, "-"))}
    theirs = given.get("options", os.environ.get("PGOPTIONS", ""))
    ours = " ".join(f"-c {k}={v}" for k, v in PG_SESSION.items())
    params["options"] = f"{ours} {theirs}".strip()  # later -c settings win: the URL's own
    return {**params, **secret_params(url)}


_CONNECTION_CLASS: list = []


def _connection_class():
    """``psycopg.Connection`` whose every wait for the server is bounded by ``answer_within_s`` (None: unbounded):
    a server that does not answer in time (stopped, frozen, cut off while the kernel still acknowledges) closes the
    connection with an OperationalError instead of holding the caller forever. psycopg bounds only the connect
    (``connect_timeout``); the server's ``statement_timeout`` cannot fire in a server that is not running."""
    if _CONNECTION_CLASS:
        return _CONNECTION_CLASS[0]
    import psycopg

    class BoundedConnection(psycopg.Connection):
        answer_within_s: float | None = None

        def wait(self, gen, interval=0.1, timeout=None):
            bound = timeout if timeout is not None else self.answer_within_s
            started = time.monotonic()
            try:
                return super().wait(gen, interval, bound)
            except psycopg.OperationalError:
                if timeout is None and bound is not None and time.monotonic() - started >= bound:
                    self.pgconn.finish()  # mid-statement: the connection is unusable, and its session goes
                    raise StalledError(f"no answer from the server within {bound:g} s") from None
                raise

    _CONNECTION_CLASS.append(BoundedConnection)
    return BoundedConnection


class StalledError(Exception):
    """A PostgreSQL server gave no answer within a connection's ``answer_within_s``."""


class PostgresRows(SQLRows):
    """A store's rows in a PostgreSQL database (psycopg 3, autocommit connections; transactions explicit).

    Reads and single statements share one connection. Each writer takes a connection of its own from a small pool
    (``locked``): its session advisory locks and every statement of the write run on it, so a write whose
    connection dies fails (StoreUnavailable) rather than going on without its lock, and a writer waiting for another
    machine's lock never blocks this process's reads or its writers of other users. Lock waits queue in PostgreSQL
    (``pg_advisory_lock`` under ``lock_timeout``), so ``fsck``'s exclusive lock is not starved by a stream of
    commits. A connection found dead while idle (a restart, an idle timeout, a network cut) is replaced before the
    next statement or transaction that is not part of a write.

    Every connection is bounded (``connect_params``: connect and statement timeouts, keepalives; ``answer_within_s``
    on the client's side). A lost connection marks the store unavailable: from then on every call raises
    StoreUnavailable at once, without waiting for the database again, until a background probe (every
    ``PROBE_EVERY_S``) gets an answer; ``available`` says which it is."""

    tokens_sql = "json_array_length(token_ids::json)"
    shared = True

    def __init__(self, url: str, answer_cap_s: float | None = None):
        """``answer_cap_s``: a tighter bound on each answer than the session's (the vLLM scheduler side, whose
        reads hold the engine core's thread)."""
        require("postgres", "a postgresql:// store")
        self.location, self.name = url, redact(url)
        self._answer_cap = answer_cap_s
        self._probe_conn = None  # the readiness probe's own connection (used under the probe's lock only)
        self._reach = Reach(self._select_one, f"PostgreSQL at {self.name}", PROBE_EVERY_S, "kvmem-pg-probe")
        self._conn = self._connect()
        self._used = time.monotonic()
        self._idle: list = []  # writer connections not in use
        self._pool_lock = threading.Lock()
        self._local = threading.local()  # .conn: the writer connection this thread holds inside ``locked``
        self._store_id = self._read_store_id()
        self._text = False  # has_text_index, once it is True

    def _connect(self, connect_timeout: float | None = None):
        """A new autocommit connection with ``connect_params``, its waits bounded by the session's
        ``statement_timeout`` + ``ANSWER_GRACE_S``. Raises StoreUnavailable (unreachable, refused, timed out,
        or the database refused the login) or StoreError (a malformed URL)."""
        import psycopg

        try:
            params = connect_params(self.location)
            if connect_timeout is not None:
                params["connect_timeout"] = str(max(2, int(connect_timeout)))
            conn = _connection_class().connect(self.location, autocommit=True, **params)
        except psycopg.Error as exc:
            why = _one_line(exc)
            for pw in secrets(self.location).values():  # keep credentials out of the message, however quoted
                why = why.replace(pw, "***").replace(quote(pw, safe=""), "***")
            raise StoreUnavailable(f"cannot connect to PostgreSQL at {self.name}: {why}") from None
        except Exception as exc:  # a malformed URL (psycopg.ProgrammingError is a psycopg.Error; others are not)
            raise StoreError(f"--store {self.name}: not a usable PostgreSQL URL ({type(exc).__name__})") from None
        try:
            conn.answer_within_s = PROBE_TIMEOUT_S + ANSWER_GRACE_S
            ms = int(conn.execute("SELECT setting FROM pg_settings WHERE name = 'statement_timeout'").fetchone()[0])
        except (psycopg.Error, StalledError) as exc:
            conn.close()
            raise StoreUnavailable(f"PostgreSQL at {self.name}: {_one_line(exc)}") from None
        bound = ms / 1e3 + ANSWER_GRACE_S if ms > 0 else None
        if self._answer_cap is not None:
            bound = self._answer_cap if bound is None else min(bound, self._answer_cap)
        conn.answer_within_s = bound
        return conn

    # --- availability: a lost database is noticed once, then answered at once until it is back ---------------

    def _select_one(self) -> bool:
        """The readiness probe (``Reach``): one ``SELECT 1`` on the probe connection (opened again if it broke),
        bounded by ``PROBE_TIMEOUT_S`` (and the connect's 2 s); whether the database answered."""
        import psycopg

        try:
            if self._probe_conn is None or self._probe_conn.closed:
                self._probe_conn = self._connect(connect_timeout=PROBE_TIMEOUT_S)
                self._probe_conn.answer_within_s = PROBE_TIMEOUT_S
            self._probe_conn.execute("SELECT 1")
            return True
        except (psycopg.Error, StalledError, StoreError):
            if self._probe_conn is not None:
                self._probe_conn.close()
            return False

    def available(self) -> bool:
        """Whether the database answers: False at once while it is marked unavailable; else a ``SELECT 1`` on a
        connection of its own (at most once per ``PROBE_EVERY_S``, one at a time: a caller meanwhile gets the last
        answer), which marks it unavailable when it gets no answer (``Reach.available``)."""
        return self._reach.available()

    @property
    def conn(self):
        """This thread's connection: its write's (inside ``locked``), else the shared one, opened again if it broke."""
        pinned = getattr(self._local, "conn", None)
        if pinned is not None:
            if pinned.broken or pinned.closed:
                raise StoreUnavailable(
                    f"lost the connection to PostgreSQL at {self.name} that held this write's lock; the write stops"
                )
            return pinned
        if self._conn.broken or self._conn.closed:
            self._reach.check_up()
            try:
                self._conn = self._connect()
            except StoreUnavailable:
                self._reach.mark_down()
                raise
        return self._conn

    def _alive(self) -> None:
        """Before a transaction on the shared connection: replace it if it died while idle."""
        import psycopg

        if getattr(self._local, "conn", None) is not None or time.monotonic() - self._used < PING_AFTER_S:
            return
        try:
            self.conn.execute("SELECT 1")
        except (psycopg.OperationalError, StalledError):
            self._conn.close()
            self.conn  # noqa: B018 -- opens it again (or raises StoreUnavailable)

    @contextmanager
    def _errors(self):
        import psycopg

        self._reach.check_up()
        try:
            yield
        except StalledError as exc:
            self._reach.mark_down()
            raise StoreUnavailable(f"PostgreSQL at {self.name}: {exc}") from None
        except psycopg.OperationalError as exc:  # the connection, not the statement
            if self._conn.closed or getattr(self._local, "conn", None) is not None:
                self._reach.mark_down()  # lost (a writer's own connection too: probed before the next call)
            raise StoreUnavailable(f"PostgreSQL at {self.name}: {_one_line(exc)}") from None
        except psycopg.Error as exc:  # a dropped table, a missing schema, no permission, a NUL in text, ...
            raise StoreError(f"PostgreSQL at {self.name}: {_one_line(exc)}") from None
        finally:
            self._used = time.monotonic()

    def _read_store_id(self) -> str | None:
        m = self._row_of_manifest()
        return json.loads(m[1]).get("store_id") if m and m[1] else None

    def _row_of_manifest(self):
        import psycopg

        with self._errors():
            try:
                return self.conn.execute("SELECT schema_version, manifest FROM kvmem_manifest WHERE id=1").fetchone()
            except psycopg.errors.UndefinedTable:
                return None

    def exists(self) -> bool:
        m = self._row_of_manifest()
        return m is not None and m[1] is not None

    def check_new(self) -> None:
        if self._row_of_manifest() is not None:
            raise StoreError(f"{self.name} already holds a kvmem store (or a half-created one: drop its tables)")

    def create(self, manifest: dict, header: bytes) -> None:
        self.check_new()
        with self._errors(), self.conn.transaction():  # DDL is transactional here: all of it, or none
            self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key("", "create"),))  # racing creators
            if self.conn.execute("SELECT to_regclass('kvmem_manifest')").fetchone()[0] is not None:
                raise StoreError(f"{self.name} already holds a kvmem store (created just now by another process)")
            if self.conn.execute("SELECT current_schema()").fetchone()[0] is None:  # ?options=-csearch_path=NEW
                first = self.conn.execute("SHOW search_path").fetchone()[0].split(",")[0].strip().strip('"')
                self.conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{first.replace(chr(34), "")}"')
            # versions start at the creation time in microseconds: a store created again at this location never
            # reuses a version that a process still holding the old one has cached
            self.conn.execute(render(POSTGRES, start=int(time.time() * 1e6)) + render_text_index(POSTGRES))
            self.conn.execute(
                "INSERT INTO kvmem_manifest (id, schema_version, manifest, header) VALUES (1, %s, %s, %s)",
                (SCHEMA_VERSION, json.dumps(manifest), header),
            )
        self._store_id = manifest.get("store_id")

    def manifest(self) -> dict:
        m = self._row_of_manifest()
        if m is None or m[1] is None:
            raise StoreError(
                f"no kvmem store at {self.name} (the database is reachable but holds no store; `kvmem memory add`, "
                f"`kvmem serve` or `kvmem ingest-locomo` with --store {self.name} --segments URL create one)"
            )
        if m[0] in MIGRATIONS:
            self._migrate(m[0])
        elif m[0] != SCHEMA_VERSION:
            raise StoreError(f"{self.name}: schema version {m[0]} is not {SCHEMA_VERSION}; re-ingest into a new store")
        try:
            return json.loads(m[1])
        except json.JSONDecodeError as exc:
            raise StoreError(f"{self.name}: the manifest is corrupt: {exc}") from None

    def _migrate(self, got: int) -> None:
        """Bring an older schema to ``SCHEMA_VERSION`` in one transaction, serialized with other migrators."""
        with self._errors(), self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(self._store_id or "", "migrate"),))
            if self.conn.execute("SELECT schema_version FROM kvmem_manifest WHERE id=1").fetchone()[0] == got:
                for stmt in migration(POSTGRES, got):
                    self.conn.execute(stmt)
                self.conn.execute("UPDATE kvmem_manifest SET schema_version=%s WHERE id=1", (SCHEMA_VERSION,))

    def header(self) -> bytes:
        with self._errors():
            return bytes(self.conn.execute("SELECT header FROM kvmem_manifest WHERE id=1").fetchone()[0])

    def execute(self, sql: str, args=()):
        import psycopg

        query, params = (sql, None) if not args else (_pg_sql(sql), tuple(args))
        with self._errors():
            conn = self.conn
            try:
                return conn.execute(query, params)
            except psycopg.OperationalError:
                # a statement outside any transaction and write, on a connection that died while idle: again, once
                if conn is not self._conn or not conn.broken or getattr(self._local, "depth", 0):
                    raise
                return self.conn.execute(query, params)

    def executemany(self, sql: str, rows) -> None:
        rows = [tuple(r) for r in rows]
        if rows:
            with self._errors(), self.conn.cursor() as cur:
                cur.executemany(_pg_sql(sql), rows)

    @contextmanager
    def _transaction(self, read_only: bool):
        with self._errors():
            self._alive()
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            with self._errors(), self.conn.transaction():
                if read_only:
                    self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                yield
        finally:
            self._local.depth -= 1

    def snapshot(self):
        return self._transaction(read_only=True)

    def transaction(self):
        return self._transaction(read_only=False)

    def next_version(self) -> int:
        return self.execute("SELECT nextval('kvmem_version')").fetchone()[0]

    def _writer_connection(self):
        import psycopg

        self._reach.check_up()
        with self._pool_lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                conn.execute("SELECT 1")
                return conn
            except (psycopg.Error, StalledError):
                conn.close()
        try:
            return self._connect()
        except StoreUnavailable:
            self._reach.mark_down()
            raise

    @contextmanager
    def locked(self, user: str | None, timeout_s: float | None):
        import psycopg

        if getattr(self._local, "conn", None) is not None:
            raise StoreError("a write inside a write of the same thread")
        busy = f"store {self.name} is busy: another writer held the lock of {user or 'the store'!r} for {timeout_s} s"
        conn = self._writer_connection()
        wanted = [(_lock_key(self._store_id or "", "store"), user is None)]
        if user is not None:
            wanted.append((_lock_key(self._store_id or "", f"user:{user}"), True))
        ms = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
        bound = conn.answer_within_s
        try:
            with self._errors():
                # the lock wait is bounded by lock_timeout alone (StoreBusy), so the statement's own bound follows it
                conn.answer_within_s = None if timeout_s is None else ms / 1e3 + 1 + ANSWER_GRACE_S
                conn.execute(f"SET lock_timeout = {ms}; SET statement_timeout = {ms + 1000 if ms else 0}")
                for key, exclusive in wanted:
                    try:
                        conn.execute(f"SELECT pg_advisory_lock{'' if exclusive else '_shared'}(%s)", (key,))
                    except psycopg.errors.LockNotAvailable:
                        raise StoreBusy(busy) from None
                conn.answer_within_s = bound
                conn.execute("RESET lock_timeout; RESET statement_timeout")  # the session's own, from PG_SESSION
        except BaseException:
            conn.close()  # its session locks go with it
            raise
        self._local.conn = conn
        try:
            yield
        finally:
            self._local.conn = None
            try:
                conn.execute("SELECT pg_advisory_unlock_all()")
                with self._pool_lock:
                    self._idle.append(conn)
            except Exception:  # a lost connection has released its locks already
                conn.close()

    def has_text_index(self) -> bool:
        if not self._text:  # as SQLiteRows: only its absence is checked again
            self._text = self.execute("SELECT to_regclass('facts_text')").fetchone()[0] is not None
        return self._text

    def add_text_index(self) -> None:
        with self.transaction():
            self.execute(render_text_index(POSTGRES))
        self._text = True

    def keyword(self, user: str, terms: list[str], limit: int) -> list[tuple[int, float]]:
        if not terms:
            return []
        # websearch_to_tsquery reads any text safely; " or " between the words is its OR
        return [
            (int(r), float(s))
            for r, s in self.execute(
                "SELECT \"row\", ts_rank(to_tsvector('english', text), q) AS score FROM facts, "
                "websearch_to_tsquery('english', ?) q WHERE \"user\" = ? AND deleted IS NULL AND "
                "to_tsvector('english', text) @@ q ORDER BY score DESC, \"row\" LIMIT ?",
                (" or ".join(terms), user, limit),
            )
            if s > 0
        ]

    def nbytes(self) -> int:
        q = (
            "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n ON "
            "n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname IN "
            "('kvmem_manifest', 'meta', 'users', 'segments', 'facts', 'history', 'turns', 'scopes')"
        )
        return int(self.execute(q).fetchone()[0])

    def has_table(self, name: str) -> bool:
        return self.execute("SELECT to_regclass(?)", (name,)).fetchone()[0] is not None

    def replaced(self) -> bool:
        try:
            return self._read_store_id() != self._store_id
        except StoreError:  # the database cannot be reached: that is not a new store
            return False

    def close(self) -> None:
        self._reach.close()  # no probe after this: the probe connection is closed below with the rest
        with self._pool_lock:
            conns, self._idle = [self._conn, *self._idle], []
        conns.append(self._probe_conn)
        for conn in conns:
            if conn is not None:
                conn.close()
