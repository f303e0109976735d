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

import json
import logging
import threading
import time
import uuid
from contextlib import contextmanager

import torch

from ..policy import check_store_user
from ..scopes import index_parts
from . import segments as seg_files
from .location import StoreConflict, StoreError
from .read import FactRecord, Reader, segment_name, user_prefix
from .rows import Rows

RETIRE_AFTER_S = 60.0  # a replaced segment's file is removed this long after its last live fact, s
ALL = "\x00all"  # commit(delete=ALL): every fact live at commit time
logger = logging.getLogger("kvmem.store")


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
        replaced, removed now rather than after ``retire_after_s``."""
        with self.writer():
            removed, replaced = self.gc()
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
        window: int = 0,
        source: str | None = None,
        now: float | None = None,
        neighbours: int | None = None,
        history: bool | None = None,
        expect: dict[str, int] | None = None,
    ) -> str:
        """The one write path: in one commit, tombstone ``delete`` (or, with ``replace``, every live fact of the
        user), append ``add`` as a new KV segment, append conversation ``turns`` and history ``events``.

        keys/values: one [L, H, n_i, D] per added fact (n_i its token count); embeddings: [F, E]. ``events``:
        (fact_id, event, old_memory, new_memory); ADD/DELETE events for ``add``/``delete`` are recorded here.
        ``window``, ``neighbours`` and ``history`` (None: unchanged) record how the user's latest facts were
        encoded. ``expect``: a compare-and-set, fact id -> the ``row`` of the live fact the caller read (a memory's
        version: every update makes a new row); StoreConflict, with nothing written, when any of them is no
        longer that live row (updated or deleted by another writer since), checked inside the commit's
        transaction under the user's writer lock.
        The segment file and its directory are fsynced before the commit that points at them, so a new fact is
        visible to readers only once its KV and embedding are durable. Returns the new memory version.
        Raises StoreError, with nothing written, for bad counts/shapes, duplicate or already-live fact ids,
        or a ``delete`` id that is not a live fact of this user.
        """
        check_store_user(user)
        add, keys, values = list(add), list(keys), list(values)
        delete = [ALL] if delete is ALL else list(delete)
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
                    )
                except BaseException:  # also SystemExit from a signal, which can land after the COMMIT itself
                    if name is not None and not self.segment_committed(user, segment):
                        self.segments.delete(name)
                    raise
                self.gc(user)
                self.reads.forget(user)
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
            db.executemany(
                'UPDATE facts SET deleted=?, updated_at=? WHERE "user"=? AND fact_id=? AND deleted IS NULL',
                [(version, now, user, fid) for fid in gone],
            )
            if not replace:
                events = [
                    (fid, "DELETE", live[fid], None) for fid in gone if not any(e[0] == fid for e in events)
                ] + events
            if add:
                taken = [f.fact_id for f in add if f.fact_id in live and f.fact_id not in gone]
                if taken:
                    raise StoreError(f"memory id {taken[0]!r} is already in use")
                db.execute(
                    'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
                    (user, segment, digest, sum(f.num_tokens for f in add)),
                )
                offset, rows = 0, []
                emb = embeddings.float().contiguous()
                for i, f in enumerate(add):
                    rows.append(
                        (
                            user,
                            f.fact_id,
                            f.text,
                            f.speaker,
                            f.source_turn,
                            f.date,
                            f.metadata,
                            json.dumps(list(f.token_ids)),
                            segment,
                            offset,
                            f.window,
                            emb[i].numpy().tobytes(),
                            version,
                            f.created_at or now,
                            now,
                        )
                    )
                    offset += f.num_tokens
                db.executemany(
                    'INSERT INTO facts ("user", fact_id, text, speaker, source_turn, date, metadata, token_ids, '
                    'segment, token_offset, "window", embedding, added, created_at, updated_at) '
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
                events = events + [
                    (f.fact_id, "ADD", None, f.text) for f in add if not any(e[0] == f.fact_id for e in events)
                ]
            if replace:
                db.execute('DELETE FROM turns WHERE "user"=?', (user,))
            if turns:
                first = db.execute('SELECT COALESCE(MAX(idx), -1) + 1 FROM turns WHERE "user"=?', (user,)).fetchone()[0]
                db.executemany(
                    'INSERT INTO turns ("user", idx, dia_id, speaker, content, time) VALUES (?,?,?,?,?,?)',
                    [
                        (user, first + i, t.get("dia_id"), t.get("speaker"), t["content"], t.get("time"))
                        for i, t in enumerate(turns)
                    ],
                )
            db.executemany(
                'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) '
                "VALUES (?,?,?,?,?,?,?)",
                [(user, *e, now, version) for e in events],
            )
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

    def compact(self, user: str) -> str:
        """Rewrite ``user``'s live facts into one segment and drop tombstoned rows (history keeps their text).
        What ``search`` and ``get_all`` return is unchanged; the version changes. Returns it."""
        with self.writer(user):
            ukv = self.reads.snapshot(user)
            segment = uuid.uuid4().hex[:12]
            keys, values = ukv.gather(list(range(len(ukv.facts))), dtype=self.reads.rewrite_dtype())
            # lossy formats re-quantise with the same key groups (facts): the same integers and scales come back
            tensors, meta = seg_files.to_file(keys, values, self.kv_format, [f.num_tokens for f in ukv.facts])
            digest = self.segments.put(segment_name(user, segment), tensors, meta)
            db = self.rows
            with db.transaction():
                version = db.next_version()
                db.execute(
                    'INSERT INTO segments ("user", segment, kv_sha256, num_tokens) VALUES (?,?,?,?)',
                    (user, segment, digest, keys.shape[2]),
                )
                offset, moves = 0, []
                for f in ukv.facts:
                    moves.append((segment, offset, f.row))
                    offset += f.num_tokens
                db.executemany('UPDATE facts SET segment=?, token_offset=? WHERE "row"=?', moves)
                db.execute('DELETE FROM facts WHERE "user"=? AND deleted IS NOT NULL', (user,))
                db.execute(
                    'UPDATE users SET version=?, compacted=?, updated=? WHERE "user"=?',
                    (version, version, time.time(), user),
                )
            self.gc(user)
            self.reads.forget(user)
        return str(version)

    def delete_user(self, user: str) -> str:
        """Tombstone every live fact of ``user``, whatever is live when the commit runs (history records each
        DELETE; the turns stay). Returns the new version; a user with nothing live is a no-op commit."""
        return self.commit(user, delete=ALL)

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
                self.rows.execute("DELETE FROM meta WHERE key LIKE 'neighbours:%' OR key LIKE 'history:%'")
            self.gc()
            self.reads.forget()
