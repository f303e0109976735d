"""The write path of a store: ``commit`` (the one write path), compaction, garbage collection of replaced segments,
and ``fsck``.

Writes append: a new segment, durable (fsynced with its directory, or an object store's completed put), then one
transaction that inserts the new fact rows, tombstones deleted ones (``deleted`` = the commit's version), appends
turns and history, and moves the user to a new version taken from a store-wide counter (versions never repeat,
even after ``reset``). A crash or power loss at any point leaves the previous version readable; segments no row
points at are orphans that ``fsck`` removes. ``compact`` rewrites a user's live facts into one segment and drops
dead rows. Writers serialize per user (``Rows.locked``). A segment that a commit replaces stays for
``retire_after_s``, so a reader still working from the snapshot before that commit reads its KV.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from contextlib import contextmanager

import torch

from ..policy import check_store_user
from ..scopes import index_parts
from . import segments as seg_files
from .erasure import Erasure, erase_rows, inherited
from .location import StoreConflict, StoreError, UnknownUser
from .read import FactRecord, Reader, segment_name, user_prefix
from .rows import Rows

RETIRE_AFTER_S = 60.0  # a replaced segment's file is removed this long after its last live fact, s
ALL = "\x00all"  # commit(delete=ALL): every fact live at commit time
logger = logging.getLogger("kvmem.store")


class _Changed(Exception):
    """A re-encoding found a fact changed since it was read."""


class Writer:
    """A store's write path. Shares the store's ``lock`` and reads through its ``Reader`` (a compaction rewrites
    what a snapshot gathers; every write drops the snapshots it made stale). ``retire_after_s``: how long a replaced
    segment's file outlives its last row, s; ``write_timeout_s``: how long a write waits for another writer (None:
    as long as it takes)."""

    def __init__(
        self, rows: Rows, segments: seg_files.SegmentStore, lock: threading.RLock, kv_format: str, reads: Reader
    ):
        self.rows, self.segments, self._lock, self.kv_format, self.reads = rows, segments, lock, kv_format, reads
        self.name = rows.name
        self.retire_after_s = RETIRE_AFTER_S
        self.write_timeout_s: float | None = None

    @contextmanager
    def writer(self, user: str | None = None):
        """The writer lock for ``user`` (None: the whole store, for ``fsck`` and ``reset``), then this object's
        lock. Writers of one user, in any process on any machine, serialize (``Rows.locked``: a file lock for a
        local store, which serializes every writer; advisory locks on PostgreSQL, where different users' writes
        proceed at once). The writer lock is waited for first, without this object's lock, so reads never queue
        behind a writer waiting for another process. Raises StoreBusy after ``write_timeout_s`` (None: wait)."""
        with self.rows.locked(user, self.write_timeout_s), self._lock:
            yield

    def landed(self, user: str, scrub: bool = False) -> None:
        """After a commit of ``user`` landed, under its writer lock: ``scrub`` (an erasure's) and ``gc``, each best
        effort (a failure is logged and leaves work for the next write of the user or ``fsck``: it never turns the
        commit that landed into an error, which a client would take for a write that did not happen), then the
        snapshots the commit made stale are dropped."""
        try:
            if scrub or self.rows.scrub_pending():  # an earlier erasure's scrub that a reader kept from completing
                self.rows.scrub()
            self.gc(user)
        except Exception as exc:
            logger.warning(
                "store %s: the clean-up after a commit of %r failed; the commit stands (%s)", self.name, user, exc
            )
        finally:
            self.reads.forget(user)

    def gc(self, user: str | None = None) -> tuple[list[str], list[str]]:
        """Under ``writer()``: retire segments no live fact uses (of ``user``, after its commit: a few indexed
        queries) and remove the files of those retired more than ``retire_after_s`` ago, so a reader still
        gathering from the snapshot it took before the commit finds its files. With ``user=None`` (``fsck``,
        ``reset``) remove at once every file no segment row names: retired ones and a killed writer's leftovers
        (a directory listing). Returns the removed names: (never retired: leftovers, retired)."""
        scope, args = ('s."user"=? AND ', (user,)) if user is not None else ("", ())
        dead = [
            tuple(r)
            for r in self.rows.execute(
                f'SELECT "user", segment FROM segments s WHERE {scope}NOT EXISTS (SELECT 1 FROM facts f WHERE '
                f'f."user"=s."user" AND f.segment=s.segment AND f.deleted IS NULL)',
                args,
            )
        ]
        now = time.time()
        retiring = ["retired:" + segment_name(u, seg) for u, seg in dead]
        mine = "retired:" + (f"{user_prefix(user)}." if user is not None else "")  # another user's are its writer's
        due = [
            k
            for k, t in self.rows.execute("SELECT key, value FROM meta WHERE key LIKE 'retired:%'")
            if k.startswith(mine) and (user is None or t <= now - self.retire_after_s)
        ]
        if user is None or self.retire_after_s <= 0:
            due, retiring = due + retiring, []
        if dead or due:
            with self.rows.transaction():
                self.rows.executemany('DELETE FROM segments WHERE "user"=? AND segment=?', dead)
                self.rows.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    [(k, now) for k in retiring],
                )
                self.rows.executemany("DELETE FROM meta WHERE key=?", [(k,) for k in due])
        if user is not None:
            doomed = [k.removeprefix("retired:") for k in due]
        else:
            live = {segment_name(u, seg) for u, seg in self.rows.execute('SELECT "user", segment FROM segments')}
            doomed = sorted(self.segments.names() - live)
        retired = {k.removeprefix("retired:") for k in due}
        removed, replaced = [], []
        for name in doomed:
            try:
                self.segments.delete(name)
                (replaced if name in retired else removed).append(name)
            except OSError as exc:  # the commit before this stands; a leftover object only costs space
                logger.warning("store %s: cannot remove %s: %s", self.name, name, exc)
        return removed, replaced

    def fsck(self) -> dict:
        """Check every user (rows, files, KV checksums) and remove orphaned files. Returns a report:
        ``{"users": n, "ok": [...], "bad": {user: why}, "removed": [file names], "replaced": [file names]}``:
        ``removed`` a killed writer's leftovers (no row ever named them), ``replaced`` segments that commits
        replaced, removed now rather than after ``retire_after_s``; ``derived``: the segments still holding KV of
        erased facts or KV computed behind erased text (``{file name: [fact ids]}``; empty once every erasure's
        re-encoding and compaction has run)."""
        with self.writer():
            removed, replaced = self.gc()
            derived: dict[str, list[str]] = {}
            for user, segment, fid in self.rows.execute(
                'SELECT "user", segment, fact_id FROM facts WHERE (deleted IS NULL AND stale IS NOT NULL) OR '
                "(deleted IS NOT NULL AND token_ids='[]') ORDER BY \"row\""
            ).fetchall():
                if self.rows.execute('SELECT 1 FROM segments WHERE "user"=? AND segment=?', (user, segment)).fetchone():
                    derived.setdefault(segment_name(user, segment), []).append(fid)
            ok, bad = [], {}
            for user in self.reads.users():
                self.reads.forget(user, kv=True)
                try:
                    ukv = self.reads.snapshot(user)
                    if ukv.embeddings.shape[0] != len(ukv.facts):
                        raise StoreError("embedding rows do not match the fact rows")
                    self.reads.check_segments(ukv)
                    ok.append(user)
                except (StoreError, LookupError) as exc:
                    bad[user] = str(exc)
        return {
            "users": len(ok) + len(bad),
            "ok": ok,
            "bad": bad,
            "removed": removed,
            "replaced": replaced,
            "derived": derived,
        }

    def commit(
        self,
        user: str,
        add: list[FactRecord] = (),
        keys: list[torch.Tensor] = (),
        values: list[torch.Tensor] = (),
        embeddings: torch.Tensor | None = None,
        delete: list[str] = (),
        replace: bool = False,
        turns: list[dict] = (),
        events: list[tuple] = (),
        window: int | None = 0,
        source: str | None = None,
        now: float | None = None,
        neighbours: int | None = None,
        history: bool | None = None,
        expect: dict[str, int] | None = None,
        erase: Erasure | None = None,
    ) -> str:
        """The one write path: in one commit, tombstone ``delete`` (or, with ``replace``, every live fact of the
        user), carry out ``erase`` (``erasure``: facts erased with the turns they came from; it is filled in with
        what it covered), append ``add`` as a new KV segment, append conversation ``turns`` and history ``events``.
        A fact of ``add`` whose id ``delete`` tombstones (an update) keeps the turns the old row came from in its
        provenance's ``source``, besides its own (``erasure.inherited``).

        keys/values: one [L, H, n_i, D] per added fact (n_i its token count); embeddings: [F, E]. ``events``:
        (fact_id, event, old_memory, new_memory); ADD/DELETE events for ``add``/``delete`` are recorded here.
        ``window`` (None, for an erasure alone: unchanged), ``neighbours`` and ``history`` (None: unchanged)
        record how the user's latest facts were encoded. ``expect``: a compare-and-set, fact id -> the ``row`` of
        the live fact the caller read (a memory's version: every update makes a new row; ids updated, deleted
        or erased alike); StoreConflict, with nothing written, when any of them is no longer that live row
        (updated or deleted by another writer since), checked first inside the commit's transaction under the
        user's writer lock.
        The segment file and its directory are fsynced before the commit that points at them, so a new fact is
        visible to readers only once its KV and embedding are durable. Returns the new memory version.
        Raises StoreError, with nothing written, for bad counts/shapes, duplicate or already-live fact ids,
        a ``delete`` or ``erase`` id that is not a live fact of this user, or an id both deleted and erased.
        """
        check_store_user(user)
        add, keys, values = list(add), list(keys), list(values)
        delete = [ALL] if delete is ALL else list(delete)
        if erase is not None and (
            set(erase.facts) & ({f.fact_id for f in add} | set(delete)) or erase.everything and (add or delete)
        ):
            raise StoreError(f"user {user!r}: a commit erases a memory it also writes or deletes")
        if add:
            if embeddings is None or not (len(keys) == len(values) == len(add) == embeddings.shape[0]):
                raise StoreError(
                    f"user {user!r}: {len(add)} facts but {len(keys)} keys, {len(values)} values and "
                    f"{0 if embeddings is None else embeddings.shape[0]} embeddings"
                )
            if len({f.fact_id for f in add}) != len(add):
                raise StoreError(f"user {user!r}: duplicate fact_id")
            for f, k, v in zip(add, keys, values):
                if k.shape != v.shape or k.shape[2] != f.num_tokens:
                    raise StoreError(
                        f"fact {f.fact_id}: keys {tuple(k.shape)} / values {tuple(v.shape)} for "
                        f"{f.num_tokens} token ids"
                    )
        now = time.time() if now is None else now
        # the writer lock of ``user`` alone while the segment is written or uploaded: this object's lock (which
        # every read takes) only for the checks and the rows' transaction, so reads never wait for an upload
        with self.rows.locked(user, self.write_timeout_s):
            with self._lock:
                if self.rows.replaced():  # its segments would go under the old store's prefix
                    raise StoreError(
                        f"the store at {self.name} was created again since this process opened it; reopen it"
                    )
            segment, digest, name = uuid.uuid4().hex[:12], "", None
            if add:
                name = segment_name(user, segment)
                tensors, meta = seg_files.to_file(
                    torch.cat(keys, dim=2), torch.cat(values, dim=2), self.kv_format, [f.num_tokens for f in add]
                )
                keys = values = None  # this frame's references: the concatenated copy is all the upload needs
                digest = self.segments.put(name, tensors, meta)  # durable before the commit that points at it
                del tensors
            with self._lock:
                try:
                    version = self.commit_rows(
                        user,
                        add,
                        embeddings,
                        segment,
                        digest,
                        delete,
                        replace,
                        list(turns),
                        list(events),
                        window,
                        source,
                        now,
                        neighbours,
                        history,
                        expect,
                        erase,
                    )
                except BaseException:  # also SystemExit from a signal, which can land after the COMMIT itself
                    if name is not None and not self.segment_committed(user, segment):
                        self.segments.delete(name)
                    raise
                self.landed(user, scrub=erase is not None)
        return version

    def segment_committed(self, user: str, segment: str) -> bool:
        """Whether a commit of ``segment`` reached the database (then its file must stay). True when unsure: an
        unreferenced file is only disk space, a referenced file that is gone is a lost memory."""
        try:
            return (
                self.rows.execute('SELECT 1 FROM segments WHERE "user"=? AND segment=?', (user, segment)).fetchone()
                is not None
            )
        except Exception:
            return True

    def commit_rows(
        self,
        user,
        add,
        embeddings,
        segment,
        digest,
        delete,
        replace,
        turns,
        events,
        window,
        source,
        now,
        neighbours=None,
        history=None,
        expect=None,
        erase=None,
    ) -> str:
        db = self.rows
        with db.transaction():
            if expect:
                ids = sorted(expect)
                have = dict(
                    db.execute(
                        f'SELECT fact_id, "row" FROM facts WHERE "user"=? AND deleted IS NULL AND '
                        f"fact_id IN ({','.join('?' * len(ids))})",
                        (user, *ids),
                    )
                )
                changed = [fid for fid in ids if have.get(fid) != expect[fid]]
                if changed:
                    raise StoreConflict(
                        f"memory {changed[0]!r} of {user!r} changed since it was read "
                        f"({'deleted' if changed[0] not in have else 'updated'} by another writer); read it again"
                    )
            version = db.next_version()
            if erase is not None:
                set_meta(db, [(f"turns:{user}", next_turn(db, user))])  # the erased indexes stay taken
                erase_rows(db, user, erase, set(delete) | {f.fact_id for f in add}, version, now)
            everything = replace or delete == [ALL]
            if everything:
                live = dict(db.execute('SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL', (user,)))
            else:  # only the ids this commit touches: a delete costs O(1) rows, not O(user's memory)
                wanted, live = sorted(set(delete) | {f.fact_id for f in add}), {}
                for i in range(0, len(wanted), 500):
                    chunk = wanted[i : i + 500]
                    live.update(
                        db.execute(
                            f'SELECT fact_id, text FROM facts WHERE "user"=? AND deleted IS NULL AND '
                            f"fact_id IN ({','.join('?' * len(chunk))})",
                            (user, *chunk),
                        )
                    )
            gone = list(live) if everything else delete
            for fid in gone:
                if fid not in live:
                    raise StoreError(f"memory {fid!r} is not a live fact of user {user!r}")
            if add and not replace:  # an update keeps the turns its memory came from
                kept = inherited(db, user, [f.fact_id for f in add if f.fact_id in live])
                add = [keep_sources(f, kept.get(f.fact_id, ())) for f in add]
            db.executemany(
                'UPDATE facts SET deleted=?, updated_at=? WHERE "user"=? AND fact_id=? AND deleted IS NULL',
                [(version, now, user, fid) for fid in gone],
            )
            if not replace:
                events = [
                    (fid, "DELETE", live[fid], None) for fid in gone if not any(e[0] == fid for e in events)
                ] + events
            if replace:
                db.execute('DELETE FROM turns WHERE "user"=?', (user,))
            first = next_turn(db, user)  # this commit's first new turn; a new fact's window names it as -1
            if add:
                taken = [f.fact_id for f in add if f.fact_id in live and f.fact_id not in gone]
                if taken:
                    raise StoreError(f"memory id {taken[0]!r} is already in use")
                insert_facts(db, user, add, embeddings, segment, digest, version, now, first)
                events = events + [
                    (f.fact_id, "ADD", None, f.text) for f in add if not any(e[0] == f.fact_id for e in events)
                ]
            if turns:
                db.executemany(
                    'INSERT INTO turns ("user", idx, dia_id, speaker, content, time) VALUES (?,?,?,?,?,?)',
                    [
                        (user, first + i, t.get("dia_id"), t.get("speaker"), t["content"], t.get("time"))
                        for i, t in enumerate(turns)
                    ],
                )
                set_meta(db, [(f"turns:{user}", first + len(turns))])  # turn indexes are never reused
            if add:
                mark_behind_erased(db, user, version, now)
            db.executemany(
                'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) '
                "VALUES (?,?,?,?,?,?,?)",
                [(user, *e, now, version) for e in events],
            )
            if window is None:  # an erasure alone: the encoding stays as it was
                db.execute('UPDATE users SET version=?, updated=? WHERE "user"=?', (version, now, user))
                forget_scope(db, user, self.reads.scopes_indexed)  # nothing was stored but turns: gone now
                return str(version)
            db.execute(
                'INSERT INTO users ("user", version, "window", source, updated) VALUES (?,?,?,?,?) ON CONFLICT("user") '
                'DO UPDATE SET version=excluded.version, "window"=excluded."window", '
                "source=COALESCE(excluded.source, users.source), updated=excluded.updated",
                (user, version, window, source, now),
            )
            if self.reads.scopes_indexed:  # the scope index (``Reader.scope_keys``): once per user, ever
                db.execute(
                    "INSERT INTO scopes (scope, head, agent, run) VALUES (?,?,?,?) ON CONFLICT(scope) DO NOTHING",
                    (user, *index_parts(user)),
                )
            # the encoding is kept in meta: no schema change for stores written before it existed
            db.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                [
                    (f"{key}:{user}", int(val))
                    for key, val in (("neighbours", neighbours), ("history", history))
                    if val is not None
                ],
            )
        return str(version)

    def put_user(
        self,
        user: str,
        facts: list[FactRecord],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        embeddings: torch.Tensor,
        window: int,
        source: str = "",
        neighbours: int = 0,
        history: bool = False,
    ) -> str:
        """Replace ``user``'s memory atomically (``commit(replace=True)``): keys/values one [L, H, n_i, D] per
        fact, embeddings [F, E]. Returns the new version. Raises StoreError, with nothing written, for no facts,
        duplicate ids, or counts/shapes that do not match the facts."""
        if not facts:
            raise StoreError(f"user {user!r}: no facts to store")
        return self.commit(
            user,
            facts,
            keys,
            values,
            embeddings,
            replace=True,
            window=window,
            source=source,
            neighbours=neighbours,
            history=history,
        )

    def compact(self, user: str, segments: list[str] | None = None) -> str:
        """Rewrite ``user``'s live facts into one segment and drop tombstoned rows (history keeps their text).
        ``segments``: only these segments, each into a new one of its own (what an erasure rewrites: the segments
        that held erased or re-encoded KV), and only their dead rows; a segment left without live facts is
        retired by ``gc``.
        What ``search`` and ``get_all`` return is unchanged; the version changes. Returns it. Raises
        UnknownUser (no ``segments``, no live fact)."""
        with self.writer(user):
            try:
                ukv = self.reads.snapshot(user)
                facts = [f for f in ukv.facts if segments is None or f.segment in segments]
            except UnknownUser:
                if segments is None:
                    raise
                ukv, facts = None, []
            db = self.rows
            # one new segment for each one rewritten (all: one in all), so a rewrite costs what it rewrites
            groups: dict[str, list[FactRecord]] = {}
            for f in facts:
                groups.setdefault("" if segments is None else f.segment, []).append(f)
            written, moves = [], []
            for group in groups.values():
                segment = uuid.uuid4().hex[:12]
                keys, values = ukv.gather([ukv.position[f.row] for f in group], dtype=self.reads.rewrite_dtype())
                # lossy formats re-quantise with the same key groups (facts): the same integers and scales come back
                tensors, meta = seg_files.to_file(keys, values, self.kv_format, [f.num_tokens for f in group])
                written.append((user, segment, self.segments.put(segment_name(user, segment), tensors, meta),
                                keys.shape[2]))  # fmt: skip
                offset = 0
                for f in group:
                    moves.append((segment, offset, f.row))
                    offset += f.num_tokens
            with db.transaction():
                version = db.next_version()
                db.executemany(
                    'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)', written
                )
                db.executemany('UPDATE facts SET segment=?, token_offset=? WHERE "row"=?', moves)
                if segments is None:
                    db.execute('DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL', (user,))
                else:
                    db.executemany(
                        'DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL AND segment=?',
                        [(user, s) for s in segments],
                    )
                db.execute(
                    'UPDATE users SET version=?, compacted=?, updated=? WHERE "user"=?',
                    (version, version, time.time(), user),
                )
                purged = forget_scope(db, user, self.reads.scopes_indexed)
            self.landed(user, scrub=purged)
        return str(version)

    def add_text_index(self) -> bool:
        """Give a store created before the full-text index one (``Rows.add_text_index``), over its live facts,
        under the whole store's writer lock. Returns whether it was missing."""
        with self.writer():
            if self.rows.has_text_index():
                return False
            self.rows.add_text_index()
            return True

    def delete_user(self, user: str) -> str:
        """Erase every fact of ``user`` (``erase(user, ALL)``): the facts, their turns and history text.
        Returns the new version; a user with nothing live is a no-op commit."""
        return self.erase(user, ALL)["version"]

    def erase(self, user: str, delete, turns: list[int] = (), now: float | None = None, defer_s: float = 0.0) -> dict:
        """Erase facts ``delete`` (ids of live facts of ``user``, or ``ALL``: with every turn of the user) in one
        commit (``commit(erase=...)``; ``erasure`` says what that erases and marks stale), and turns ``turns``
        (indexes); the stale facts are to be re-encoded (``stale``, ``reencode``) by ``now + defer_s``.

        Returns ``{"version", "erased": [fact ids], "turns": n erased, "stale": [fact ids], "segments":
        [segments that held erased KV]}``. Raises StoreError, with nothing written, for an id that is not a live
        fact of ``user``."""
        everything = delete is ALL
        job = Erasure([] if everything else list(delete), everything, list(turns), defer_s)
        version = self.commit(user, window=None, now=now, erase=job)
        return {
            "version": version, "erased": job.erased, "turns": job.turns_erased, "stale": job.stale,
            "segments": job.segments,
        }  # fmt: skip

    def stale(self, user: str | None = None) -> list[tuple[str, str, str, float]]:
        """Live facts whose KV awaits re-encoding after an erasure: (user, fact_id, segment, re-encode by (Unix
        s)), soonest first; of ``user``, or of every user."""
        q = 'SELECT "user", fact_id, segment, stale FROM facts WHERE deleted IS NULL AND stale IS NOT NULL'
        with self._lock:
            got = self.rows.execute(q + (' AND "user"=?' if user else ""), (user,) if user else ()).fetchall()
        return sorted((tuple(r) for r in got), key=lambda r: r[3])

    def reencode(
        self,
        user: str,
        facts: list[FactRecord],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        embeddings,
        now: float | None = None,
    ) -> str | None:
        """Replace the KV of live facts ``facts`` (as read, ``row`` their current rows; their provenance the
        context they were re-encoded behind) with ``keys`` / ``values`` (one [L, H, n_i, D] each) in one commit:
        each old row is tombstoned and a new row with the same id, text, metadata, times and ``embeddings``
        ([F, E]) added, not stale; history records nothing (the memory did not change). Returns the new version,
        or None (nothing written) when any of them changed since it was read. Raises StoreError for bad shapes."""
        if not facts:
            return None
        for f, k in zip(facts, keys, strict=True):
            if k.shape[2] != f.num_tokens:
                raise StoreError(f"fact {f.fact_id}: keys {tuple(k.shape)} for {f.num_tokens} token ids")
        now = time.time() if now is None else now
        with self.writer(user):
            segment = uuid.uuid4().hex[:12]
            name = segment_name(user, segment)
            tensors, meta = seg_files.to_file(
                torch.cat(keys, dim=2), torch.cat(values, dim=2), self.kv_format, [f.num_tokens for f in facts]
            )
            digest = self.segments.put(name, tensors, meta)
            db = self.rows
            try:
                with db.transaction():
                    rows = [f.row for f in facts]
                    found = set()
                    for i in range(0, len(rows), 500):
                        chunk = rows[i : i + 500]
                        found |= {r[0] for r in db.execute(
                            f'SELECT "row" FROM facts WHERE "user"=? AND deleted IS NULL AND "row" IN '
                            f"({','.join('?' * len(chunk))})", (user, *chunk))}  # fmt: skip
                    if found != set(rows):
                        raise _Changed
                    version = db.next_version()
                    db.executemany('UPDATE facts SET deleted=? WHERE "row"=?', [(version, r) for r in rows])
                    insert_facts(db, user, facts, embeddings, segment, digest, version, now, 0)
                    mark_behind_erased(db, user, version, now)
                    db.execute('UPDATE users SET version=?, updated=? WHERE "user"=?', (version, now, user))
            except _Changed:
                self.segments.delete(name)
                return None
            except BaseException:
                if not self.segment_committed(user, segment):
                    self.segments.delete(name)
                raise
            self.landed(user)
        return str(version)

    def defer_compaction(self, user: str) -> None:
        """Record that ``user``'s segments holding dead KV (erased, or replaced by a re-encoding) await their
        rewrite: an erasure whose cascade failed after its commit landed (an unreachable object store). The
        upkeep finds it (``compactions``) and rewrites them (``dead_segments``, ``compact``, ``compacted``)."""
        with self._lock, self.rows.transaction():
            set_meta(self.rows, [(f"compact:{user}", time.time())])

    def compactions(self) -> list[str]:
        """The users whose dead KV awaits a rewrite (``defer_compaction``)."""
        with self._lock:
            return sorted(k.removeprefix("compact:") for (k,) in self.rows.execute(
                "SELECT key FROM meta WHERE key LIKE 'compact:%'"))  # fmt: skip

    def dead_segments(self, user: str) -> list[str]:
        """``user``'s segments (still named by a segment row) that hold rows of dead facts: what ``compact(user,
        segments)`` rewrites without them."""
        with self._lock:
            return sorted(r[0] for r in self.rows.execute(
                'SELECT DISTINCT f.segment FROM facts f WHERE f."user"=? AND f.deleted IS NOT NULL AND EXISTS '
                '(SELECT 1 FROM segments s WHERE s."user"=f."user" AND s.segment=f.segment)', (user,)))  # fmt: skip

    def compacted(self, user: str) -> None:
        """``user``'s deferred rewrite is done (``defer_compaction``)."""
        with self._lock, self.rows.transaction():
            self.rows.execute("DELETE FROM meta WHERE key=?", (f"compact:{user}",))

    def reset(self) -> None:
        """Delete every user's facts, turns and history (the version counter keeps counting, so no cache
        salt is ever reused)."""
        with self.writer():
            with self.rows.transaction():
                self.rows.next_version()
                for table in ("facts", "history", "turns", "users") + (
                    ("scopes",) if self.reads.scopes_indexed else ()
                ):
                    self.rows.execute(f"DELETE FROM {table}")
                self.rows.execute(
                    "DELETE FROM meta WHERE key LIKE 'neighbours:%' OR key LIKE 'history:%' OR key LIKE 'turns:%'"
                )
            self.rows.scrub()
            self.gc()
            self.reads.forget()


def set_meta(db: Rows, items: list[tuple[str, float]]) -> None:
    db.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", items
    )


TENANT_HEAD = re.compile(r"^[A-Za-z0-9_-]{1,64}:")  # a namespaced scope key's "<tenant>:" (``server.tenants``)


def forget_scope(db: Rows, user: str, scopes: bool) -> bool:
    """Inside a transaction: when scope ``user`` keeps no fact row (live or tombstone: an erasure's compaction
    has run) and no turn, drop every row that names it: its ``users`` and ``scopes`` rows and its ``meta`` keys
    (turn counter, encoding, deferred compaction). Its history events stay, for ``history(fact_id)``, filed under
    its tenant's ``<tenant>:`` alone (``""`` for a key without one), so a user id (an email, say) is stored
    nowhere once its scope is erased. Versions come from the store-wide counter, so a scope written again gets a
    newer one and a reader of the old version still sees it replaced. Returns whether it dropped the scope."""
    if db.execute('SELECT 1 FROM facts WHERE "user"=? LIMIT 1', (user,)).fetchone() is not None:
        return False
    if db.execute('SELECT 1 FROM turns WHERE "user"=? LIMIT 1', (user,)).fetchone() is not None:
        return False
    head = TENANT_HEAD.match(user)
    db.execute('UPDATE history SET "user"=? WHERE "user"=?', (head.group(0) if head else "", user))
    db.execute('DELETE FROM users WHERE "user"=?', (user,))
    if scopes:
        db.execute("DELETE FROM scopes WHERE scope=?", (user,))
    db.executemany("DELETE FROM meta WHERE key=?", [(f"{k}:{user}",) for k in ("turns", "neighbours", "history",
                                                                              "compact")])  # fmt: skip
    return True


def next_turn(db: Rows, user: str) -> int:
    """Inside a transaction: the index ``user``'s next turn gets. Indexes are never reused (an erased last turn's
    index stays taken: ``meta`` keeps ``turns:<user>``), so a fact's provenance never names another turn."""
    top = db.execute('SELECT COALESCE(MAX(idx), -1) + 1 FROM turns WHERE "user"=?', (user,)).fetchone()[0]
    kept = db.execute("SELECT value FROM meta WHERE key=?", (f"turns:{user}",)).fetchone()
    return max(int(top), int(kept[0]) if kept else 0)


def keep_sources(f: FactRecord, sources) -> FactRecord:
    """``f`` with the turns ``sources`` (indexes) added to the turns it came from; one of unknown provenance
    records none."""
    extra = tuple(sorted(set(sources) - set(f.source_turns)))
    return f if not extra or f.context_turns is None else dataclasses.replace(f, source_turns=(*f.source_turns, *extra))


def resolve(f: FactRecord, first: int) -> str | None:
    """``f``'s provenance JSON with its references to the commit's new turns (``-(i + 1)``) made indexes."""
    if f.context_turns is None:
        return None
    fix = lambda ts: [first - t - 1 if t < 0 else t for t in ts]
    return dataclasses.replace(f, context_turns=fix(f.context_turns), source_turns=fix(f.source_turns)).provenance()


def insert_facts(
    db: Rows,
    user: str,
    add: list[FactRecord],
    embeddings,
    segment: str,
    digest: str,
    version: int,
    now: float,
    first: int,
) -> None:
    """Inside a transaction: ``add``'s rows (embeddings [F, E]) in new segment ``segment`` (its SHA-256
    ``digest``), added at ``version``; ``first``: the index the commit's first new turn gets."""
    db.execute(
        'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
        (user, segment, digest, sum(f.num_tokens for f in add)),
    )
    offset, rows = 0, []
    emb = embeddings.float().contiguous()
    for i, f in enumerate(add):
        rows.append(
            (
                user, f.fact_id, f.text, f.speaker, f.source_turn, f.date, f.metadata, json.dumps(list(f.token_ids)),
                segment, offset, f.window, emb[i].numpy().tobytes(), version, f.created_at or now, now,
                resolve(f, first),
            )
        )  # fmt: skip
        offset += f.num_tokens
    db.executemany(
        'INSERT INTO facts ("user", fact_id, text, speaker, source_turn, date, metadata, token_ids, '
        'segment, token_offset, "window", embedding, added, created_at, updated_at, provenance) '
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )


def mark_behind_erased(db: Rows, user: str, version: int, now: float) -> None:
    """Inside the transaction that added facts at ``version``: a fact encoded behind a turn or fact that an
    erasure removed while it was being encoded (its provenance names a turn that is gone, or a fact with no live
    row) is marked stale at once, so it is re-encoded like the facts the erasure found."""
    rows = db.execute(
        'SELECT "row", provenance FROM facts WHERE "user"=? AND added=? AND provenance IS NOT NULL', (user, version)
    ).fetchall()
    prov = {r: json.loads(p) for r, p in rows}
    turns = sorted({t for p in prov.values() for t in p["turns"]})
    facts = sorted({f for p in prov.values() for f in p["facts"]})
    have_turns, have_facts = set(), set()
    for i in range(0, len(turns), 500):
        chunk = turns[i : i + 500]
        marks = ",".join("?" * len(chunk))
        have_turns |= {r[0] for r in db.execute(
            f'SELECT idx FROM turns WHERE "user"=? AND idx IN ({marks})', (user, *chunk))}  # fmt: skip
    for i in range(0, len(facts), 500):
        chunk = facts[i : i + 500]
        have_facts |= {r[0] for r in db.execute(
            f'SELECT fact_id FROM facts WHERE "user"=? AND deleted IS NULL AND fact_id IN '
            f'({",".join("?" * len(chunk))})', (user, *chunk))}  # fmt: skip
    gone = lambda p: not have_turns.issuperset(p["turns"]) or not have_facts.issuperset(p["facts"])
    stale = [(now, r) for r, p in prov.items() if gone(p)]
    db.executemany('UPDATE facts SET stale=? WHERE "row"=?', stale)
