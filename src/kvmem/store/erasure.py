"""What a commit erases (``Writer.commit(erase=...)``), inside its transaction, and the provenance rules it follows.

A fact's provenance (``facts.provenance``, ``FactRecord``) names the turns its KV was computed behind (``turns``),
the facts it was encoded behind (``facts``) and the turns it came from (``source``). Erasing a fact tombstones it,
blanks the text, token ids, metadata and embedding of every row of its id (an update's older rows too) and the
text of its history, deletes the turns it came from, and marks stale every live fact computed behind an erased
turn or fact (its KV must be re-encoded: ``Writer.reencode``). A fact of unknown provenance (written before it was
recorded) came from the turns that hold its words, or its LoCoMo source turn, and was computed behind every turn
and fact before it.

An update keeps the sources of the memory it replaces (``inherited``): the new row names every turn the memory
came from, so erasing it later erases the original words too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .location import StoreError
from .rows import Rows


@dataclass
class Erasure:
    """An erasure for ``Writer.commit``: ``facts``, ids of live facts of the user (``everything``: every live fact
    and every turn), ``turns``, more turn indexes to erase; the stale facts are to be re-encoded by ``defer_s``
    seconds after the commit. The commit fills in what it covered: ``erased`` ids, ``turns_erased`` (a count),
    ``stale`` ids and ``segments`` (those holding KV of an erased fact, of any of its rows)."""

    facts: list[str] = field(default_factory=list)
    everything: bool = False
    turns: list[int] = field(default_factory=list)
    defer_s: float = 0.0
    erased: list[str] = field(default_factory=list)
    turns_erased: int = 0
    stale: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)


def came_from(provenance: str | None, dia: str, text: str, turns: list[tuple]) -> set[int]:
    """The turn indexes a fact came from: its provenance's ``source`` (the column's JSON); unknown (None): the
    turns of ``turns`` ((idx, dia_id, content) rows) that hold its ``text`` or are its LoCoMo turn ``dia``."""
    if provenance is not None:
        return set(json.loads(provenance).get("source", ()))
    return {i for i, d, c in turns if (dia and d == dia) or (text and text in c)}


def _chunks(ids: list, n: int = 500):
    for i in range(0, len(ids), n):
        yield ids[i : i + n], ",".join("?" * len(ids[i : i + n]))


def inherited(db: Rows, user: str, updated: list[str]) -> dict[str, set[int]]:
    """Inside a transaction: for each id of ``updated`` (live facts a commit replaces by a new row of the same id),
    the turns its live row came from (``came_from``), which the new row keeps."""
    rows = []
    for chunk, marks in _chunks(sorted(updated)):
        rows += db.execute(
            f'SELECT fact_id, provenance, source_turn, text FROM facts WHERE "user"=? AND deleted IS NULL AND '
            f"fact_id IN ({marks})",
            (user, *chunk),
        ).fetchall()
    if not rows:
        return {}
    turns = (
        db.execute('SELECT idx, dia_id, content FROM turns WHERE "user"=?', (user,)).fetchall()
        if any(p is None for _, p, _, _ in rows)
        else []
    )
    return {fid: came_from(p, dia, text, turns) for fid, p, dia, text in rows}


def erase_rows(db: Rows, user: str, erasure: Erasure, keep: set[str], version: int, now: float) -> None:
    """Inside the commit's transaction, at ``version``: ``erasure``'s row work (module docstring), filling in
    what it covered. ``keep``: ids this commit tombstones itself (an update's): never marked stale. Raises
    StoreError for an id that is not a live fact of ``user`` (the transaction then writes nothing)."""
    cols = "fact_id, provenance, segment, added, source_turn, text"
    live = {r[0]: r for r in db.execute(f'SELECT {cols} FROM facts WHERE "user"=? AND deleted IS NULL', (user,))}
    gone = list(live) if erasure.everything else list(dict.fromkeys(erasure.facts))
    missing = [fid for fid in gone if fid not in live]
    if missing:
        raise StoreError(f"memory {missing[0]!r} is not a live fact of user {user!r}")
    all_turns = db.execute('SELECT idx, dia_id, content FROM turns WHERE "user"=?', (user,)).fetchall()
    erased = {t[0] for t in all_turns} if erasure.everything else set(erasure.turns)
    for fid in gone:
        _, prov, _, _, dia, text = live[fid]
        erased |= came_from(prov, dia, text, all_turns)
    erased &= {t[0] for t in all_turns}
    gone_set, first_gone = set(gone), min((live[f][3] for f in gone), default=None)
    stale = []
    for fid, (_, prov, _, added, _, _) in live.items():
        if fid in gone_set or fid in keep:
            continue
        if prov is None:  # unknown: behind every earlier turn and fact
            hit = bool(erased) or (first_gone is not None and first_gone <= added)
        else:
            p = json.loads(prov)
            hit = bool(erased.intersection(p["turns"])) or bool(gone_set.intersection(p["facts"]))
        if hit:
            stale.append(fid)
    segments = set()
    for chunk, marks in _chunks(gone):
        segments |= {r[0] for r in db.execute(  # every row of the id: an update's older rows hold its old KV
            f'SELECT DISTINCT segment FROM facts WHERE "user"=? AND fact_id IN ({marks})', (user, *chunk))}  # fmt: skip
        db.execute(
            "UPDATE facts SET deleted=COALESCE(deleted, ?), updated_at=?, text='', token_ids='[]', "
            f"metadata='{{}}', embedding=?, provenance=NULL, stale=NULL WHERE \"user\"=? AND fact_id IN ({marks})",
            (version, now, b"", user, *chunk),
        )
        db.execute(
            f'UPDATE history SET old_memory=NULL, new_memory=NULL WHERE "user"=? AND fact_id IN ({marks})',
            (user, *chunk),
        )
    db.executemany(
        'INSERT INTO history ("user", fact_id, event, old_memory, new_memory, time, version) VALUES (?,?,?,?,?,?,?)',
        [(user, fid, "DELETE", None, None, now, version) for fid in gone],
    )
    db.executemany('DELETE FROM turns WHERE "user"=? AND idx=?', [(user, t) for t in sorted(erased)])
    by = now + max(erasure.defer_s, 0.0)
    db.executemany(
        'UPDATE facts SET stale=? WHERE "user"=? AND fact_id=? AND deleted IS NULL AND (stale IS NULL OR stale > ?)',
        [(by, user, fid, by) for fid in stale],
    )
    erasure.erased, erasure.turns_erased, erasure.stale = gone, len(erased), stale
    erasure.segments = sorted(s for s in segments if s)
