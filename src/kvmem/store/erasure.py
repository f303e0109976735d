"""What a commit erases (``Write.erase``; its rows: ``Rows.commit``), and the provenance rules it follows.

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

    def plan(self, user: str, live: dict[str, tuple], turns: list[tuple], keep: set[str]) -> tuple[list, set, list]:
        """What this erasure covers (the module docstring's rules), given ``user``'s ``live`` facts (fact id ->
        (fact_id, provenance, segment, added, source_turn, text)) and ``turns`` ((idx, dia_id, content)).
        ``keep``: ids the commit tombstones itself (an update's): never marked stale. Returns (ids erased, turn
        indexes erased, ids marked stale). Raises StoreError for an id that is not a live fact."""
        gone = list(live) if self.everything else list(dict.fromkeys(self.facts))
        missing = [fid for fid in gone if fid not in live]
        if missing:
            raise StoreError(f"memory {missing[0]!r} is not a live fact of user {user!r}")
        erased = {t[0] for t in turns} if self.everything else set(self.turns)
        for fid in gone:
            _, prov, _, _, dia, text = live[fid]
            erased |= came_from(prov, dia, text, turns)
        erased &= {t[0] for t in turns}
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
        return gone, erased, stale


def came_from(provenance: str | None, dia: str, text: str, turns: list[tuple]) -> set[int]:
    """The turn indexes a fact came from: its provenance's ``source`` (the column's JSON); unknown (None): the
    turns of ``turns`` ((idx, dia_id, content) rows) that hold its ``text`` or are its LoCoMo turn ``dia``."""
    if provenance is not None:
        return set(json.loads(provenance).get("source", ()))
    return {i for i, d, c in turns if (dia and d == dia) or (text and text in c)}
