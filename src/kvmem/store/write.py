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
import logging
import threading
import time
import uuid
from contextlib import contextmanager

import torch

from . import segments as seg_files
from .erasure import Erasure
from .location import StoreError, UnknownUser
from .read import Reader
from .records import ALL, FactRecord, Write, segment_name, user_prefix
from .rows import Rows

RETIRE_AFTER_S = 60.0  # a replaced segment's file is removed this long after its last live fact, s
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
        dead = self.rows.unused_segments(user)
        now = time.time()
        retiring = [segment_name(u, seg) for u, seg in dead]
        mine = f"{user_prefix(user)}." if user is not None else ""  # another user's are its writer's
        due = [
            n for n, t in self.rows.retired() if n.startswith(mine) and (user is None or t <= now - self.retire_after_s)
        ]
        if user is None or self.retire_after_s <= 0:
            due, retiring = due + retiring, []
        self.rows.retire(dead, retiring, due, now)
        if user is not None:
            doomed = due
        else:
            live = {segment_name(u, seg) for u, seg in self.rows.segment_rows()}
            doomed = sorted(self.segments.names() - live)
        retired = set(due)
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
            for user, segment, fid in self.rows.derived():
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

    def commit(self, write: Write) -> str:
        """The one write path: in one commit, ``write`` (``records.Write``): tombstone its ``delete`` (or, with
        ``replace``, every live fact of the user), carry out its ``erase`` (``erasure``: facts erased with the
        turns they came from; it is filled in with what it covered), append ``add`` as a new KV segment, append
        its conversation ``turns`` and history ``events``. A fact of ``add`` whose id ``delete`` tombstones (an
        update) keeps the turns the old row came from in its provenance's ``source``, besides its own. ``expect``
        is checked first inside the commit's transaction under the user's writer lock (StoreConflict, with
        nothing written, when any of them is no longer that live row).
        The segment file and its directory are fsynced before the commit that points at them, so a new fact is
        visible to readers only once its KV and embedding are durable. Returns the new memory version.
        Raises StoreError, with nothing written, for bad counts/shapes (``Write.check``), duplicate or
        already-live fact ids, a ``delete`` or ``erase`` id that is not a live fact of this user, or an id both
        deleted and erased.
        """
        write.check()
        user, add, keys, values = write.user, write.add, list(write.keys), list(write.values)
        # the rows take the write without its KV: the segment holds that, and this frame drops it once uploaded
        write = dataclasses.replace(write, keys=(), values=(), now=time.time() if write.now is None else write.now)
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
                    version = self.rows.commit(write, segment, digest)
                except BaseException:  # also SystemExit from a signal, which can land after the COMMIT itself
                    if name is not None and not self.segment_committed(user, segment):
                        self.segments.delete(name)
                    raise
                self.landed(user, scrub=write.erase is not None)
        return version

    def segment_committed(self, user: str, segment: str) -> bool:
        """Whether a commit of ``segment`` reached the database (then its file must stay). True when unsure: an
        unreferenced file is only disk space, a referenced file that is gone is a lost memory."""
        try:
            return self.rows.has_segment(user, segment)
        except Exception:
            return True

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
            Write(user, facts, keys, values, embeddings, replace=True, window=window, source=source,
                  neighbours=neighbours, history=history)
        )  # fmt: skip

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
            version, purged = self.rows.compact_rows(user, written, moves, segments, time.time())
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
        version = self.commit(Write(user, window=None, now=now, erase=job))
        return {
            "version": version, "erased": job.erased, "turns": job.turns_erased, "stale": job.stale,
            "segments": job.segments,
        }  # fmt: skip

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
            try:
                version = self.rows.reencode_rows(user, facts, embeddings, segment, digest, now)
            except BaseException:
                if not self.segment_committed(user, segment):
                    self.segments.delete(name)
                raise
            if version is None:
                self.segments.delete(name)
                return None
            self.landed(user)
        return version

    def defer_compaction(self, user: str) -> None:
        """Record that ``user``'s segments holding dead KV (erased, or replaced by a re-encoding) await their
        rewrite: an erasure whose cascade failed after its commit landed (an unreachable object store). The
        upkeep finds it (``compactions``) and rewrites them (``dead_segments``, ``compact``, ``compacted``)."""
        with self._lock:
            self.rows.defer_compaction(user, time.time())

    def compactions(self) -> list[str]:
        """The users whose dead KV awaits a rewrite (``defer_compaction``)."""
        with self._lock:
            return self.rows.compactions()

    def dead_segments(self, user: str) -> list[str]:
        """``user``'s segments (still named by a segment row) that hold rows of dead facts: what ``compact(user,
        segments)`` rewrites without them."""
        with self._lock:
            return self.rows.dead_segments(user)

    def compacted(self, user: str) -> None:
        """``user``'s deferred rewrite is done (``defer_compaction``)."""
        with self._lock:
            self.rows.compacted(user)

    def reset(self) -> None:
        """Delete every user's facts, turns and history (the version counter keeps counting, so no cache
        salt is ever reused)."""
        with self.writer():
            self.rows.reset()
            self.rows.scrub()
            self.gc()
            self.reads.forget()
