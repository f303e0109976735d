"""``SQLRows``: the named row operations of ``rows.Rows`` as SQL, written once for both SQL backends
(``sqlite_rows.SQLiteRows``, ``postgres_rows.PostgresRows``), each of which supplies a connection's primitives
(``execute``, ``executemany``, ``snapshot``, ``transaction``, ``next_version``) and its dialect's bits
(``tokens_sql``).

Statements: ``?`` placeholders, ``"user"``/``"window"``/``"row"`` quoted (reserved words in PostgreSQL),
``ON CONFLICT`` upserts. The tables are defined in ``schema``. Every multi-statement operation runs in one
transaction (or, for a read, one snapshot) of its own; the caller holds the writer lock a write needs
(``Rows.locked``) and the store object's lock.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod

from ..scopes import IndexQuery, index_parts
from .erasure import Erasure, came_from
from .location import StoreConflict, StoreError
from .records import ALL, FactRecord, Write, keep_sources, resolve
from .rows import Rows

ID_BATCH = 500  # ids bound into one statement (SQLite allows 32,766 parameters)
TENANT_HEAD = re.compile(r"^[A-Za-z0-9_-]{1,64}:")  # a namespaced scope key's "<tenant>:" (``server.tenants``)
FACT_COLS = (
    'fact_id, "user", text, speaker, source_turn, date, token_ids, token_offset, "window", segment, "row", '
    "metadata, created_at, updated_at, provenance"
)
UPSERT_META = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
DEAD = (
    'SELECT "user", segment FROM segments s WHERE {scope}NOT EXISTS (SELECT 1 FROM facts f WHERE f."user"=s."user" '
    "AND f.segment=s.segment AND f.deleted IS NULL)"
)
RETIRED = "retired:"  # meta key prefix: a retired segment's name -> when it was retired (Unix s)


class _Changed(Exception):
    """A re-encoding found a fact changed since it was read."""


def fact_of_row(r) -> FactRecord:
    """A ``FACT_COLS`` row as a ``FactRecord``."""
    prov = None if r[14] is None else json.loads(r[14])
    return FactRecord(
        r[0], r[1], r[2], r[3] or "", r[4] or "", r[5] or "", tuple(json.loads(r[6])), r[7], r[8], r[9], r[10],
        r[11], r[12], r[13],
        *((None, (), ()) if prov is None else (tuple(prov["turns"]), tuple(prov["facts"]),
                                               tuple(prov.get("source", ())))),
    )  # fmt: skip


def _chunks(ids: list, n: int = ID_BATCH):
    """``ids`` in slices of ``n``, each with its ``?,?,…`` placeholders."""
    for i in range(0, len(ids), n):
        yield ids[i : i + n], ",".join("?" * len(ids[i : i + n]))


def _owner(user: str | None, within: str | None) -> tuple[str, tuple]:
    """The SQL conditions (each followed by AND) and arguments of rows of ``user`` and of users whose key starts
    with ``within``; either may be None (no condition)."""
    parts, args = [], []
    if user is not None:
        parts, args = ['"user"=?'], [user]
    if within is not None:
        parts, args = [*parts, 'substr("user", 1, ?)=?'], [*args, len(within), within]
    return "".join(p + " AND " for p in parts), tuple(args)


class SQLRows(Rows):
    """``Rows``' named operations over a SQL connection. A SQL backend subclasses it and gives the primitives
    below; the operations above them are the same statements on every SQL backend."""

    tokens_sql: str  # SQL expression: the token count of a facts row
    _scopes: bool | None = None

    # --- a connection's primitives (each SQL backend) ---------------------------------------------------

    @abstractmethod
    def execute(self, sql: str, args=()):
        """Run one statement (``?`` placeholders); returns its cursor (``fetchone``, ``fetchall``, iteration).
        Tests and query-plan checks use it; the store goes through the named operations."""

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

    def scopes_indexed(self) -> bool:
        if self._scopes is None:  # a store created before the scope index has none; one made since keeps it
            self._scopes = self.has_table("scopes")
        return self._scopes

    # --- reads ----------------------------------------------------------------------------------------

    def users(self, with_no_live_facts: bool = False) -> list[str]:
        q = 'SELECT DISTINCT "user" FROM facts WHERE deleted IS NULL ORDER BY "user"'
        if with_no_live_facts:
            q = 'SELECT "user" FROM users ORDER BY "user"'
        return [r[0] for r in self.execute(q)]

    def user_page(self, prefix: str, contains: str, offset: int, limit: int):
        if not self.scopes_indexed():
            return None
        where, args = ["head>?"], [prefix]  # the bare prefix is the head of scopes without a user id
        if prefix:
            where.append("head<?")
            args.append(prefix[:-1] + chr(ord(prefix[-1]) + 1))
        if contains:
            like = contains.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append("LOWER(head) LIKE ? ESCAPE '\\'")
            args.append(f"{prefix.lower()}%{like}%")
        where.append('EXISTS (SELECT 1 FROM facts f WHERE f."user"=s.scope AND f.deleted IS NULL)')
        cond = " AND ".join(where)
        total = self.execute(f"SELECT COUNT(DISTINCT head) FROM scopes s WHERE {cond}", args).fetchone()[0]
        heads = [
            r[0]
            for r in self.execute(
                f"SELECT DISTINCT head FROM scopes s WHERE {cond} ORDER BY head LIMIT ? OFFSET ?",
                (*args, limit, offset),
            )
        ]
        if not heads:
            return int(total), []
        marks = ",".join("?" * len(heads))
        facts = {
            r[0]: (int(r[1]), int(r[2]))
            for r in self.execute(
                f"SELECT s.head, COUNT(*), COALESCE(SUM({self.tokens_sql}), 0) FROM scopes s JOIN facts f ON "
                f'f."user"=s.scope AND f.deleted IS NULL WHERE s.head IN ({marks}) GROUP BY s.head',
                heads,
            )
        }
        last = {
            r[0]: float(r[1])
            for r in self.execute(
                f'SELECT s.head, MAX(u.updated) FROM scopes s JOIN users u ON u."user"=s.scope '
                f"WHERE s.head IN ({marks}) GROUP BY s.head",
                heads,
            )
        }
        return int(total), [(h, *facts.get(h, (0, 0)), last.get(h, 0.0)) for h in heads]

    def scope_keys(self, q: IndexQuery, live: bool = False) -> list[str] | None:
        if not self.scopes_indexed():
            return None
        where, args = [], []
        if q.head is not None:
            where.append("head=?")
            args.append(q.head)
        elif q.prefix is not None:  # every head that starts with the prefix: one range, bytewise (KEY columns)
            where.append("head>=? AND head<?")
            args += [q.prefix, q.prefix[:-1] + chr(ord(q.prefix[-1]) + 1)]
        for column, value in (("agent", q.agent), ("run", q.run)):
            if value is not None:
                where.append(f"{column}=?")
                args.append(value)
        sql = "SELECT scope FROM scopes s" + (" WHERE " + " AND ".join(where) if where else "")
        if live:
            sql += (" AND " if where else " WHERE ") + (
                'EXISTS (SELECT 1 FROM facts f WHERE f."user"=s.scope AND f.deleted IS NULL)'
            )
        return sorted(r[0] for r in self.execute(sql, args))

    def version(self, user: str) -> str | None:
        row = self.execute('SELECT version FROM users WHERE "user"=?', (user,)).fetchone()
        return None if row is None else str(row[0])

    def live_facts(self, user: str) -> tuple[str | None, list[FactRecord], list[bytes], dict[str, str]]:
        with self.snapshot():
            version = self.version(user)
            facts, emb = [], []
            for r in self.execute(
                f'SELECT {FACT_COLS}, embedding FROM facts WHERE "user"=? AND deleted IS NULL ORDER BY "row"', (user,)
            ):
                facts.append(fact_of_row(r))
                emb.append(bytes(r[-1]))
            shas = dict(self.execute('SELECT segment, kv_sha256 FROM segments WHERE "user"=?', (user,)))
        return version, facts, emb, shas

    def fact_token_ids(self, user: str, version: str, fact_ids: list[str]) -> dict[str, tuple[int, ...]] | None:
        wanted, out = list(dict.fromkeys(fact_ids)), {}
        with self.snapshot():
            if self.version(user) != version:
                return None
            for chunk, _ in _chunks(wanted):
                # a join on the ids' VALUES, not ``fact_id IN (...)``: with IN, SQLite's planner takes the (user,
                # deleted) index and walks every live row of the user; an equality join probes live_fact per id
                q = (
                    f"WITH w(id) AS (VALUES {', '.join(['(?)'] * len(chunk))}) SELECT f.fact_id, f.token_ids "
                    'FROM w JOIN facts f ON f."user"=? AND f.fact_id=w.id AND f.deleted IS NULL'
                )
                for fid, ids in self.execute(q, (*chunk, user)):
                    out[fid] = tuple(json.loads(ids))
        return out

    def embedding_page(self, user: str, after: int, limit: int) -> list[tuple[int, str, bytes]]:
        return [
            (r, fid, bytes(e))
            for r, fid, e in self.execute(
                'SELECT "row", fact_id, embedding FROM facts WHERE "user"=? AND deleted IS NULL AND "row">? '
                'ORDER BY "row" LIMIT ?',
                (user, after, limit),
            )
        ]

    def rows_token_ids(self, user: str, rows: list[int]) -> dict[int, tuple[str, tuple[int, ...]]]:
        out = {}
        for chunk, marks in _chunks(sorted(set(rows))):
            q = f'SELECT "row", fact_id, token_ids FROM facts WHERE "user"=? AND deleted IS NULL AND "row" IN ({marks})'
            for r, fid, ids in self.execute(q, (user, *chunk)):
                out[r] = (fid, tuple(json.loads(ids)))
        return out

    def live_count(self, user: str) -> tuple[int, int]:
        n = self.execute(
            f'SELECT COUNT(*), COALESCE(SUM({self.tokens_sql}), 0) FROM facts WHERE "user"=? AND deleted IS NULL',
            (user,),
        ).fetchone()
        return int(n[0]), int(n[1])

    def totals(self) -> tuple[int, int]:
        facts = self.execute("SELECT COUNT(*) FROM facts WHERE deleted IS NULL").fetchone()[0]
        turns = self.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
        return int(facts), int(turns)

    def encoding(self, user: str) -> dict | None:
        row = self.execute('SELECT version, "window", source FROM users WHERE "user"=?', (user,)).fetchone()
        if row is None:
            return None
        m = self.execute("SELECT value FROM meta WHERE key=?", (f"neighbours:{user}",)).fetchone()
        h = self.execute("SELECT value FROM meta WHERE key=?", (f"history:{user}",)).fetchone()
        return {
            "version": str(row[0]),
            "window": row[1],
            "neighbours": int(m[0]) if m else 0,
            "history": bool(h[0]) if h else False,
            "source": row[2],
        }

    def facts_with_id(self, fact_id: str, user: str | None = None, within: str | None = None) -> list[FactRecord]:
        where, args = _owner(user, within)
        rows = self.execute(
            f'SELECT {FACT_COLS} FROM facts WHERE {where}fact_id=? AND deleted IS NULL ORDER BY "row"',
            (*args, fact_id),
        ).fetchall()
        return [fact_of_row(r) for r in rows]

    def events(self, fact_id: str | None = None, user: str | None = None, within: str | None = None) -> list[dict]:
        where, args = _owner(user, within)
        if fact_id is not None:
            where, args = where + "fact_id=? AND ", (*args, fact_id)
        q = f'SELECT id, fact_id, "user", event, old_memory, new_memory, time FROM history WHERE {where}1=1 ORDER BY id'
        return [
            dict(zip(("id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at"), r))
            for r in self.execute(q, args)
        ]

    def turns(self, user: str, last: int | None = None) -> list[dict]:
        q = 'SELECT idx, dia_id, speaker, content, time FROM turns WHERE "user"=? ORDER BY idx DESC LIMIT ?'
        rows = self.execute(q, (user, 1 << 62 if last is None else max(last, 0))).fetchall()
        return [dict(zip(("idx", "dia_id", "speaker", "content", "time"), r)) for r in reversed(rows)]

    def changes(self, user: str, since: int) -> tuple[list[tuple[int, bytes]], list[int]] | None:
        row = self.execute('SELECT compacted FROM users WHERE "user"=?', (user,)).fetchone()
        if row is None or row[0] > since:
            return None
        added = [
            (r, bytes(e))
            for r, e in self.execute(
                'SELECT "row", embedding FROM facts WHERE "user"=? AND added>? AND deleted IS NULL ORDER BY "row"',
                (user, since),
            )
        ]
        removed = [
            r[0]
            for r in self.execute(
                'SELECT "row" FROM facts WHERE "user"=? AND added<=? AND deleted>?', (user, since, since)
            )
        ]
        return added, removed

    def stale(self, user: str | None = None) -> list[tuple[str, str, str, float]]:
        q = 'SELECT "user", fact_id, segment, stale FROM facts WHERE deleted IS NULL AND stale IS NOT NULL'
        got = self.execute(q + (' AND "user"=?' if user else ""), (user,) if user else ()).fetchall()
        return sorted((tuple(r) for r in got), key=lambda r: r[3])

    def has_segment(self, user: str, segment: str) -> bool:
        return (
            self.execute('SELECT 1 FROM segments WHERE "user"=? AND segment=?', (user, segment)).fetchone() is not None
        )

    def segment_rows(self) -> list[tuple[str, str]]:
        return [tuple(r) for r in self.execute('SELECT "user", segment FROM segments').fetchall()]

    def unused_segments(self, user: str | None = None) -> list[tuple[str, str]]:
        scope, args = ('s."user"=? AND ', (user,)) if user is not None else ("", ())
        return [tuple(r) for r in self.execute(DEAD.format(scope=scope), args).fetchall()]

    def retired(self) -> list[tuple[str, float]]:
        rows = self.execute(f"SELECT key, value FROM meta WHERE key LIKE '{RETIRED}%'").fetchall()
        return [(k.removeprefix(RETIRED), t) for k, t in rows]

    def derived(self) -> list[tuple[str, str, str]]:
        out = []
        for user, segment, fid in self.execute(
            'SELECT "user", segment, fact_id FROM facts WHERE (deleted IS NULL AND stale IS NOT NULL) OR '
            "(deleted IS NOT NULL AND token_ids='[]') ORDER BY \"row\""
        ).fetchall():
            if self.has_segment(user, segment):
                out.append((user, segment, fid))
        return out

    def compactions(self) -> list[str]:
        return sorted(k.removeprefix("compact:") for (k,) in self.execute(
            "SELECT key FROM meta WHERE key LIKE 'compact:%'"))  # fmt: skip

    def dead_segments(self, user: str) -> list[str]:
        return sorted(r[0] for r in self.execute(
            'SELECT DISTINCT f.segment FROM facts f WHERE f."user"=? AND f.deleted IS NOT NULL AND EXISTS '
            '(SELECT 1 FROM segments s WHERE s."user"=f."user" AND s.segment=f.segment)', (user,)))  # fmt: skip

    # --- writes ---------------------------------------------------------------------------------------

    def commit(self, write: Write, segment: str, digest: str) -> str:
        user, now, add, events = write.user, write.now, list(write.add), list(write.events)
        delete = [ALL] if write.delete is ALL else list(write.delete)
        with self.transaction():
            if write.expect:
                ids = sorted(write.expect)
                have = {}
                for chunk, marks in _chunks(ids):
                    have.update(self.execute(
                        f'SELECT fact_id, "row" FROM facts WHERE "user"=? AND deleted IS NULL AND fact_id IN ({marks})',
                        (user, *chunk)))  # fmt: skip
                changed = [fid for fid in ids if have.get(fid) != write.expect[fid]]
                if changed:
                    raise StoreConflict(
                        f"memory {changed[0]!r} of {user!r} changed since it was read "
                        f"({'deleted' if changed[0] not in have else 'updated'} by another writer); read it again"
                    )
            version = self.next_version()
            if write.erase is not None:
                self._set_meta([(f"turns:{user}", self._next_turn(user))])  # the erased indexes stay taken
                self._erase_rows(user, write.erase, set(delete) | {f.fact_id for f in add}, version, now)
            everything = write.everything
            if everything:
                live = dict(self.execute('SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL', (user,)))
            else:  # only the ids this commit touches: a delete costs O(1) rows, not O(user's memory)
                live = {}
                for chunk, marks in _chunks(sorted(set(delete) | {f.fact_id for f in add})):
                    live.update(self.execute(
                        f'SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL AND fact_id IN ({marks})',
                        (user, *chunk)))  # fmt: skip
            gone = list(live) if everything else delete
            for fid in gone:
                if fid not in live:
                    raise StoreError(f"memory {fid!r} is not a live fact of user {user!r}")
            if add and not write.replace:  # an update keeps the turns its memory came from
                kept = self.inherited(user, [f.fact_id for f in add if f.fact_id in live])
                add = [keep_sources(f, kept.get(f.fact_id, ())) for f in add]
            self.executemany(
                'UPDATE facts SET deleted=?, updated_at=? WHERE "user"=? AND fact_id=? AND deleted IS NULL',
                [(version, now, user, fid) for fid in gone],
            )
            if not write.replace:
                events = [
                    (fid, "DELETE", live[fid], None) for fid in gone if not any(e[0] == fid for e in events)
                ] + events
            if write.replace:
                self.execute('DELETE FROM turns WHERE "user"=?', (user,))
            first = self._next_turn(user)  # this commit's first new turn; a new fact's window names it as -1
            if add:
                taken = [f.fact_id for f in add if f.fact_id in live and f.fact_id not in gone]
                if taken:
                    raise StoreError(f"memory id {taken[0]!r} is already in use")
                self._insert_facts(user, add, write.embeddings, segment, digest, version, now, first)
                events = events + [
                    (f.fact_id, "ADD", None, f.text) for f in add if not any(e[0] == f.fact_id for e in events)
                ]
            if write.turns:
                self.executemany(
                    'INSERT INTO turns ("user", idx, dia_id, speaker, content, time) VALUES (?,?,?,?,?,?)',
                    [
                        (user, first + i, t.get("dia_id"), t.get("speaker"), t["content"], t.get("time"))
                        for i, t in enumerate(write.turns)
                    ],
                )
                self._set_meta([(f"turns:{user}", first + len(write.turns))])  # turn indexes are never reused
            if add:
                self._mark_behind_erased(user, version, now)
            self.executemany(
                'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) '
                "VALUES (?,?,?,?,?,?,?)",
                [(user, *e, now, version) for e in events],
            )
            if write.window is None:  # an erasure alone: the encoding stays as it was
                self.execute('UPDATE users SET version=?, updated=? WHERE "user"=?', (version, now, user))
                self._forget_scope(user)  # nothing was stored but turns: gone now
                return str(version)
            self.execute(
                'INSERT INTO users ("user", version, "window", source, updated) VALUES (?,?,?,?,?) ON CONFLICT("user") '
                'DO UPDATE SET version=excluded.version, "window"=excluded."window", '
                "source=COALESCE(excluded.source, users.source), updated=excluded.updated",
                (user, version, write.window, write.source, now),
            )
            if self.scopes_indexed():  # the scope index (``scope_keys``): once per user, ever
                self.execute(
                    "INSERT INTO scopes (scope, head, agent, run) VALUES (?,?,?,?) ON CONFLICT(scope) DO NOTHING",
                    (user, *index_parts(user)),
                )
            # the encoding is kept in meta: no schema change for stores written before it existed
            self._set_meta([
                (f"{key}:{user}", int(val))
                for key, val in (("neighbours", write.neighbours), ("history", write.history))
                if val is not None
            ])  # fmt: skip
        return str(version)

    def retire(self, dead: list[tuple[str, str]], retiring: list[str], done: list[str], now: float,
               keep_time: bool = False) -> None:  # fmt: skip
        if not (dead or retiring or done):
            return
        upsert = (
            UPSERT_META if not keep_time else "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING"
        )
        with self.transaction():
            self.executemany('DELETE FROM segments WHERE "user"=? AND segment=?', dead)
            self.executemany(upsert, [(RETIRED + n, now) for n in retiring])
            self.executemany("DELETE FROM meta WHERE key=?", [(RETIRED + n,) for n in done])

    def compact_rows(
        self, user: str, written: list[tuple[str, str, str, int]], moves: list[tuple[str, int, int]],
        segments: list[str] | None, now: float,
    ) -> tuple[str, bool]:  # fmt: skip
        with self.transaction():
            version = self.next_version()
            self.executemany('INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)', written)
            self.executemany('UPDATE facts SET segment=?, token_offset=? WHERE "row"=?', moves)
            if segments is None:
                self.execute('DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL', (user,))
            else:
                self.executemany(
                    'DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL AND segment=?',
                    [(user, s) for s in segments],
                )
            self.execute(
                'UPDATE users SET version=?, compacted=?, updated=? WHERE "user"=?', (version, version, now, user)
            )
            purged = self._forget_scope(user)
        return str(version), purged

    def reencode_rows(
        self, user: str, facts: list[FactRecord], embeddings, segment: str, digest: str, now: float
    ) -> str | None:
        try:
            with self.transaction():
                rows, found = [f.row for f in facts], set()
                for chunk, marks in _chunks(rows):
                    found |= {r[0] for r in self.execute(
                        f'SELECT "row" FROM facts WHERE "user"=? AND deleted IS NULL AND "row" IN ({marks})',
                        (user, *chunk))}  # fmt: skip
                if found != set(rows):
                    raise _Changed
                version = self.next_version()
                self.executemany('UPDATE facts SET deleted=? WHERE "row"=?', [(version, r) for r in rows])
                self._insert_facts(user, facts, embeddings, segment, digest, version, now, 0)
                self._mark_behind_erased(user, version, now)
                self.execute('UPDATE users SET version=?, updated=? WHERE "user"=?', (version, now, user))
        except _Changed:
            return None
        return str(version)

    def defer_compaction(self, user: str, now: float) -> None:
        with self.transaction():
            self._set_meta([(f"compact:{user}", now)])

    def compacted(self, user: str) -> None:
        with self.transaction():
            self.execute("DELETE FROM meta WHERE key=?", (f"compact:{user}",))

    def reset(self) -> None:
        with self.transaction():
            self.next_version()
            for table in ("facts", "history", "turns", "users") + (("scopes",) if self.scopes_indexed() else ()):
                self.execute(f"DELETE FROM {table}")
            self.execute("DELETE FROM meta WHERE key LIKE 'neighbours:%' OR key LIKE 'history:%' OR key LIKE 'turns:%'")

    def carry_stale(self, user: str, marks: dict[str, float | None]) -> None:
        with self.transaction():
            self.executemany(
                'UPDATE facts SET stale=? WHERE "user"=? AND fact_id=? AND deleted IS NULL',
                [(by, user, fid) for fid, by in marks.items()],
            )
            named = [0]
            for (prov,) in self.execute(
                'SELECT provenance FROM facts WHERE "user"=? AND deleted IS NULL AND provenance IS NOT NULL', (user,)
            ).fetchall():
                p = json.loads(prov)
                named += [t + 1 for t in (*p["turns"], *p["source"])]
            self._set_meta([(f"turns:{user}", max(self._next_turn(user), *named))])

    # --- the parts of a write, inside its transaction ----------------------------------------------------

    def _set_meta(self, items: list[tuple[str, float]]) -> None:
        self.executemany(UPSERT_META, items)

    def _next_turn(self, user: str) -> int:
        """The index ``user``'s next turn gets. Indexes are never reused (an erased last turn's index stays taken:
        ``meta`` keeps ``turns:<user>``), so a fact's provenance never names another turn."""
        top = self.execute('SELECT COALESCE(MAX(idx), -1) + 1 FROM turns WHERE "user"=?', (user,)).fetchone()[0]
        kept = self.execute("SELECT value FROM meta WHERE key=?", (f"turns:{user}",)).fetchone()
        return max(int(top), int(kept[0]) if kept else 0)

    def _forget_scope(self, user: str) -> bool:
        """When scope ``user`` keeps no fact row (live or tombstone: an erasure's compaction has run) and no turn,
        drop every row that names it: its ``users`` and ``scopes`` rows and its ``meta`` keys (turn counter,
        encoding, deferred compaction). Its history events stay, for ``events(fact_id)``, filed under its tenant's
        ``<tenant>:`` alone (``""`` for a key without one), so a user id (an email, say) is stored nowhere once its
        scope is erased. Versions come from the store-wide counter, so a scope written again gets a newer one and a
        reader of the old version still sees it replaced. Returns whether it dropped the scope."""
        if self.execute('SELECT 1 FROM facts WHERE "user"=? LIMIT 1', (user,)).fetchone() is not None:
            return False
        if self.execute('SELECT 1 FROM turns WHERE "user"=? LIMIT 1', (user,)).fetchone() is not None:
            return False
        head = TENANT_HEAD.match(user)
        self.execute('UPDATE history SET "user"=? WHERE "user"=?', (head.group(0) if head else "", user))
        self.execute('DELETE FROM users WHERE "user"=?', (user,))
        if self.scopes_indexed():
            self.execute("DELETE FROM scopes WHERE scope=?", (user,))
        self.executemany("DELETE FROM meta WHERE key=?", [(f"{k}:{user}",) for k in ("turns", "neighbours", "history",
                                                                                    "compact")])  # fmt: skip
        return True

    def _insert_facts(
        self, user: str, add: list[FactRecord], embeddings, segment: str, digest: str, version: int, now: float,
        first: int,
    ) -> None:  # fmt: skip
        """``add``'s rows (embeddings [F, E]) in new segment ``segment`` (its SHA-256 ``digest``), added at
        ``version``; ``first``: the index the commit's first new turn gets."""
        self.execute(
            'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
            (user, segment, digest, sum(f.num_tokens for f in add)),
        )
        offset, rows = 0, []
        emb = embeddings.float().contiguous()
        for i, f in enumerate(add):
            rows.append(
                (
                    user, f.fact_id, f.text, f.speaker, f.source_turn, f.date, f.metadata,
                    json.dumps(list(f.token_ids)), segment, offset, f.window, emb[i].numpy().tobytes(), version,
                    f.created_at or now, now, resolve(f, first),
                )
            )  # fmt: skip
            offset += f.num_tokens
        self.executemany(
            'INSERT INTO facts ("user", fact_id, text, speaker, source_turn, date, metadata, token_ids, '
            'segment, token_offset, "window", embedding, added, created_at, updated_at, provenance) '
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )

    def _mark_behind_erased(self, user: str, version: int, now: float) -> None:
        """In the transaction that added facts at ``version``: a fact encoded behind a turn or fact that an erasure
        removed while it was being encoded (its provenance names a turn that is gone, or a fact with no live row)
        is marked stale at once, so it is re-encoded like the facts the erasure found."""
        rows = self.execute(
            'SELECT "row", provenance FROM facts WHERE "user"=? AND added=? AND provenance IS NOT NULL', (user, version)
        ).fetchall()
        prov = {r: json.loads(p) for r, p in rows}
        turns = sorted({t for p in prov.values() for t in p["turns"]})
        facts = sorted({f for p in prov.values() for f in p["facts"]})
        have_turns, have_facts = set(), set()
        for chunk, marks in _chunks(turns):
            have_turns |= {r[0] for r in self.execute(
                f'SELECT idx FROM turns WHERE "user"=? AND idx IN ({marks})', (user, *chunk))}  # fmt: skip
        for chunk, marks in _chunks(facts):
            have_facts |= {r[0] for r in self.execute(
                f'SELECT fact_id FROM facts WHERE "user"=? AND deleted IS NULL AND fact_id IN ({marks})',
                (user, *chunk))}  # fmt: skip
        gone = lambda p: not have_turns.issuperset(p["turns"]) or not have_facts.issuperset(p["facts"])
        self.executemany('UPDATE facts SET stale=? WHERE "row"=?', [(now, r) for r, p in prov.items() if gone(p)])

    def inherited(self, user: str, updated: list[str]) -> dict[str, set[int]]:
        """Inside a transaction: for each id of ``updated`` (live facts a commit replaces by a new row of the same
        id), the turns its live row came from (``erasure.came_from``), which the new row keeps."""
        rows = []
        for chunk, marks in _chunks(sorted(updated)):
            rows += self.execute(
                f'SELECT fact_id, provenance, source_turn, text FROM facts WHERE "user"=? AND deleted IS NULL AND '
                f"fact_id IN ({marks})",
                (user, *chunk),
            ).fetchall()
        if not rows:
            return {}
        turns = (
            self.execute('SELECT idx, dia_id, content FROM turns WHERE "user"=?', (user,)).fetchall()
            if any(p is None for _, p, _, _ in rows)
            else []
        )
        return {fid: came_from(p, dia, text, turns) for fid, p, dia, text in rows}

    def _erase_rows(self, user: str, erasure: Erasure, keep: set[str], version: int, now: float) -> None:
        """In the commit's transaction, at ``version``: ``erasure``'s row work (``erasure``'s docstring), filling
        in what it covered. ``keep``: ids this commit tombstones itself (an update's): never marked stale. Raises
        StoreError for an id that is not a live fact of ``user`` (the transaction then writes nothing)."""
        cols = "fact_id, provenance, segment, added, source_turn, text"
        live = {r[0]: r for r in self.execute(f'SELECT {cols} FROM facts WHERE "user"=? AND deleted IS NULL', (user,))}
        all_turns = self.execute('SELECT idx, dia_id, content FROM turns WHERE "user"=?', (user,)).fetchall()
        gone, erased, stale = erasure.plan(user, live, all_turns, keep)
        segments = set()
        for chunk, marks in _chunks(gone):
            # every row of the id: an update's older rows hold its old KV
            q = f'SELECT DISTINCT segment FROM facts WHERE "user"=? AND fact_id IN ({marks})'
            segments |= {r[0] for r in self.execute(q, (user, *chunk))}
            self.execute(
                "UPDATE facts SET deleted=COALESCE(deleted, ?), updated_at=?, text='', token_ids='[]', "
                f"metadata='{{}}', embedding=?, provenance=NULL, stale=NULL WHERE \"user\"=? AND fact_id IN ({marks})",
                (version, now, b"", user, *chunk),
            )
            self.execute(
                f'UPDATE history SET old_memory=NULL, new_memory=NULL WHERE "user"=? AND fact_id IN ({marks})',
                (user, *chunk),
            )
        self.executemany(
            'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) '
            "VALUES (?,?,?,?,?,?,?)",
            [(user, fid, "DELETE", None, None, now, version) for fid in gone],
        )
        self.executemany('DELETE FROM turns WHERE "user"=? AND idx=?', [(user, t) for t in sorted(erased)])
        by = now + max(erasure.defer_s, 0.0)
        self.executemany(
            'UPDATE facts SET stale=? WHERE "user"=? AND fact_id=? AND deleted IS NULL AND '
            "(stale IS NULL OR stale > ?)",
            [(by, user, fid, by) for fid in stale],
        )
        erasure.erased, erasure.turns_erased, erasure.stale = gone, len(erased), stale
        erasure.segments = sorted(s for s in segments if s)
