"""Copying a store: every user's live facts with their KV, embeddings, turns, history and encoding, into a new
store (or one without those users) at another location, on either backend, optionally in another KV format.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import torch

from .. import kvformat
from .backends import open_rows
from .facade import Store, check_segments_url
from .location import StoreError, UnknownUser
from .records import FactRecord, UserKV, Write


def copy_store(
    src: str | Path,
    dst: str | Path,
    segments_url: str | None = None,
    force: bool = False,
    users: list[str] | None = None,
    kv_format: str | None = None,
) -> dict:
    """Copy the store at ``src`` to ``dst`` (either a directory or a ``postgresql://`` URL; ``segments_url`` as in
    ``Store.create``, required for a PostgreSQL ``dst``): every user's live facts with their KV (each source
    segment verified against its checksum first), embeddings, turns, history events and encoding, one commit per
    user. The copy is a new store (its own ``store_id``) for the same model. Afterwards every user's fact, turn
    and event counts are compared and every new segment is verified. History keeps each fact's events in order;
    their times become the copy's. What an erasure left to re-encode stays so: each fact's provenance (an erased
    turn it names is named in the copy too, by an index no turn gets) and its stale mark with its deadline, so the
    copy's ``fsck`` reports the same ``derived`` facts and its upkeep re-encodes them; the erased facts' own KV
    and text are not copied. Each user is read under its writer lock (its facts, marks and turns of one version).

    ``force``: copy into a store already at ``dst`` (same model) that has users, none of them a user copied
    (histories are not merged); without it a store with users is refused, as is a non-empty directory that is not
    a store. ``users``: only these (default: every user, those whose facts are all deleted too). ``kv_format``:
    the copy's KV format (``kvformat``; default the source's): a lossless store may be copied into any format, a
    lossy one only into its own, so dequantised KV is never stored as lossless. Returns
    ``{"users", "facts", "turns", "events", "kv_bytes", "stale"}`` (``kv_bytes``: KV read, in the model dtype;
    ``stale``: facts copied with their stale mark). Raises
    StoreError, StoreMismatch."""
    source = Store.open(src)
    try:
        kv_format = kvformat.check_format(kv_format or source.kv_format)
        if source.kv_format != "native" and kv_format != source.kv_format:
            raise StoreError(
                f"store {source.name} holds lossy {source.kv_format} KV; it can only be copied as {source.kv_format} "
                f"(re-encode the memories to get {kv_format})"
            )
        fingerprint = {**source.fingerprint, "kv_format": kv_format}
        with closing(open_rows(dst)) as rows:
            if rows.holds_other_data():
                raise StoreError(f"{dst} is a non-empty directory that holds no store; copy into a new one")
        if Store.exists(dst):
            target = Store.open(dst, fingerprint)
            if target.reads.users() and not force:
                target.close()
                raise StoreError(f"{target.name} already holds a store with users; pass --force to copy into it")
            check_segments_url(target, segments_url)
        else:
            hk, hv = source.reads.header_kv()
            m = source.manifest
            target = Store.create(
                dst, fingerprint, m["header"]["text"], m["header"]["token_ids"], hk, hv, m["embedder"],
                segments_url=segments_url,
            )  # fmt: skip
        report = {"users": 0, "facts": 0, "turns": 0, "events": 0, "kv_bytes": 0, "stale": 0}
        try:
            todo = source.reads.users(with_no_live_facts=True) if users is None else users
            taken = [u for u in todo if target.reads.version(u) is not None]
            if taken:
                raise StoreError(
                    f"user {taken[0]!r} is already in {target.name}; copy does not merge histories (copy into a "
                    f"new store, or leave that user out with --user)"
                )
            for user in todo:
                info = source.reads.encoding_of(user)
                if info is None:
                    raise UnknownUser(f"unknown user {user!r} in store {source.name}")
                with source.writes.writer(user):  # its facts, stale marks, turns and events as of one version
                    stale = {fid: by for _, fid, _, by in source.reads.stale(user)}
                    try:
                        ukv = source.reads.snapshot(user)
                    except UnknownUser:  # every fact deleted: its turns and history still go
                        ukv = UserKV(user, info["version"], [], {}, torch.zeros(0, 1))
                    source.reads.check_segments(ukv)
                    turns, events = source.reads.turns(user), source.reads.events(user)
                    parts = [ukv.gather([i], dtype=source.reads.rewrite_dtype()) for i in range(len(ukv.facts))]
                had = len(target.reads.events(user))
                pos = _positions(turns, ukv.facts)
                facts = [
                    FactRecord(**{
                        **f.__dict__, "row": 0, "segment": "", "token_offset": 0,
                        "context_turns": None if f.context_turns is None else _refs(f.context_turns, pos),
                        "source_turns": _refs(f.source_turns, pos),
                    })
                    for f in ukv.facts
                ]  # fmt: skip
                target.writes.commit(
                    Write(
                        user,
                        facts,
                        [k for k, _ in parts],
                        [v for _, v in parts],
                        ukv.embeddings,
                        replace=True,
                        turns=turns,
                        events=[(e["memory_id"], e["event"], e["old_memory"], e["new_memory"]) for e in events],
                        window=info["window"],
                        source=info["source"],
                        neighbours=info["neighbours"],
                        history=info["history"],
                    )
                )
                report["stale"] += _carry_stale(target, user, [f.fact_id for f in ukv.facts], stale)
                n_facts = 0
                if ukv.facts:
                    copied = target.reads.snapshot(user)
                    target.reads.check_segments(copied)
                    n_facts = len(copied.facts)
                got = (n_facts, len(target.reads.turns(user)), len(target.reads.events(user)) - had)
                if got != (len(ukv.facts), len(turns), len(events)):
                    raise StoreError(
                        f"copy of user {user!r} has {got} facts/turns/events, the source "
                        f"{(len(ukv.facts), len(turns), len(events))}"
                    )
                report["users"] += 1
                report["facts"] += got[0]
                report["turns"] += got[1]
                report["events"] += got[2]
                report["kv_bytes"] += sum(k.nbytes + v.nbytes for k, v in parts)
        finally:
            target.close()
        return report
    finally:
        source.close()


def _positions(turns: list[dict], facts: list[FactRecord]) -> dict[int, int]:
    """Source turn index -> the copy commit's new turn it becomes (``i``: the ``i``-th copied turn). A turn that
    provenance names but that is gone (erased) becomes one past the copied turns, never written, so the copy's
    provenance names a turn it lacks, as the source's does (``erase`` and ``reencode_stale`` read it so)."""
    pos = {t["idx"]: i for i, t in enumerate(turns)}
    named = {t for f in facts for t in (*(f.context_turns or ()), *f.source_turns)}
    for t in sorted(named - set(pos)):
        pos[t] = len(pos)
    return pos


def _refs(turns, pos: dict[int, int]) -> tuple[int, ...]:
    """Turn indexes of the source as references to the copy commit's new turns (``-(i + 1)``)."""
    return tuple(-(pos[t] + 1) for t in turns)


def _carry_stale(target: Store, user: str, fact_ids: list[str], stale: dict[str, float]) -> int:
    """After the commit that copied ``user``: each copied fact's stale mark set as the source's (``stale``: fact id
    -> re-encode by; the commit marked those whose provenance names a gone turn or fact at once, but not one of
    unknown provenance, nor with the source's deadline), and the user's turn indexes kept past every one its
    provenance names (an erased turn's index is never given to a new turn). Returns the marks carried."""
    with target.writes.writer(user):
        target.rows.carry_stale(user, {fid: stale.get(fid) for fid in fact_ids})
        target.reads.forget(user)
    return sum(fid in stale for fid in fact_ids)
