"""What a store holds and what a write brings, as values: ``FactRecord`` (one stored fact), ``Write`` (one commit's
whole content, passed as one value from ``Memory`` through ``ingest.write_facts`` and ``Writer.commit`` down to the
rows' ``Rows.commit``), and the names of KV segments. No I/O here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..policy import check_store_user
from .location import StoreError

if TYPE_CHECKING:
    import torch

    from .erasure import Erasure

ALL = "\x00all"  # Write(delete=ALL): every fact live at commit time


@dataclass(frozen=True)
class FactRecord:
    """One stored fact. ``token_offset`` indexes its ``segment``'s [.., n, ..] tensors; ``row`` is the store's
    stable row id (the vector index id); times are Unix seconds.

    Provenance (what its KV was computed behind; ``facts.provenance``): ``context_turns``, the turn indexes of its
    window (a negative ``-(i + 1)`` given to a commit names that commit's ``i``-th new turn); ``context_facts``,
    the ids of its neighbour or history facts, in encoding order; ``source_turns``, the turns it came from (what
    erasing it erases). ``context_turns`` None: unknown (a fact written before provenance was recorded)."""

    fact_id: str
    user: str
    text: str
    speaker: str
    source_turn: str
    date: str
    token_ids: tuple[int, ...]
    token_offset: int = 0
    window: int = 0
    segment: str = ""
    row: int = 0
    metadata: str = "{}"  # JSON
    created_at: float = 0.0
    updated_at: float = 0.0
    context_turns: tuple[int, ...] | None = None
    context_facts: tuple[str, ...] = ()
    source_turns: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def provenance(self) -> str | None:
        """The ``facts.provenance`` column's JSON (None: unknown)."""
        if self.context_turns is None:
            return None
        return json.dumps(
            {"turns": list(self.context_turns), "facts": list(self.context_facts), "source": list(self.source_turns)}
        )


@dataclass(frozen=True)
class Write:
    """One commit of ``user``'s memory, whole (``Writer.commit``, the one write path; ``Rows.commit`` its rows):

    - ``add``: new facts, with ``keys`` / ``values`` one [L, H, n_i, D] per fact (n_i its token count) and
      ``embeddings`` [F, E];
    - ``delete``: ids of live facts to tombstone, or ``ALL`` (every fact live at commit time); ``replace``: the
      facts, turns and encoding are replaced whole (every live fact tombstoned, every turn dropped);
    - ``turns``: conversation turns to append ({content, dia_id?, speaker?, time?}); ``events``: history events
      (fact_id, event, old_memory, new_memory), ADD/DELETE of ``add``/``delete`` being recorded by the commit;
    - ``window`` (None, for an erasure alone: unchanged), ``source``, ``neighbours`` and ``history`` (None:
      unchanged): how the user's latest facts were encoded;
    - ``now``: the commit's time (Unix s; None: when it runs);
    - ``expect``: fact id -> the ``row`` of the live fact the caller read, a compare-and-set (StoreConflict);
    - ``erase``: an erasure in the same commit (``erasure.Erasure``, filled in with what it covered).

    Sequences are kept as tuples. ``check`` says what is wrong with one before anything is written."""

    user: str
    add: tuple[FactRecord, ...] = ()
    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()
    embeddings: torch.Tensor | None = None
    delete: tuple[str, ...] | str = ()
    replace: bool = False
    turns: tuple[dict, ...] = ()
    events: tuple[tuple, ...] = ()
    window: int | None = 0
    source: str | None = None
    now: float | None = None
    neighbours: int | None = None
    history: bool | None = None
    expect: dict[str, int] | None = field(default=None, hash=False)
    erase: Erasure | None = field(default=None, hash=False)

    def __post_init__(self):
        for name in ("add", "keys", "values", "turns", "events"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.delete is not ALL:
            object.__setattr__(self, "delete", tuple(self.delete))

    @property
    def everything(self) -> bool:
        """Whether every live fact of the user goes (``replace``, or ``delete`` is ``ALL``)."""
        return self.replace or self.delete is ALL

    @property
    def touched(self) -> set[str]:
        """The fact ids this write deletes or adds (``ALL`` excluded)."""
        return (set() if self.delete is ALL else set(self.delete)) | {f.fact_id for f in self.add}

    def check(self) -> None:
        """Raises StoreError (or ValueError for a bad user name, ``policy.check_store_user``) for a write that
        must not land: an erasure of a fact it also writes or deletes, counts of facts, keys, values and
        embeddings that differ, duplicate new ids, a fact whose KV does not match its token ids."""
        user, add, erase = self.user, self.add, self.erase
        check_store_user(user)
        if erase is not None and (set(erase.facts) & self.touched or erase.everything and (add or self.delete)):
            raise StoreError(f"user {user!r}: a commit erases a memory it also writes or deletes")
        if add:
            emb = self.embeddings
            if emb is None or not (len(self.keys) == len(self.values) == len(add) == emb.shape[0]):
                raise StoreError(
                    f"user {user!r}: {len(add)} facts but {len(self.keys)} keys, {len(self.values)} values and "
                    f"{0 if emb is None else emb.shape[0]} embeddings"
                )
            if len({f.fact_id for f in add}) != len(add):
                raise StoreError(f"user {user!r}: duplicate fact_id")
            for f, k, v in zip(add, self.keys, self.values):
                if k.shape != v.shape or k.shape[2] != f.num_tokens:
                    raise StoreError(
                        f"fact {f.fact_id}: keys {tuple(k.shape)} / values {tuple(v.shape)} for "
                        f"{f.num_tokens} token ids"
                    )


def segment_name(user: str, segment: str) -> str:
    """The object name of ``user``'s KV segment ``segment`` (immutable once committed)."""
    return f"{user_prefix(user)}.{segment}.kv.safetensors"


def user_prefix(user: str) -> str:
    """What every segment name of ``user`` starts with: a file-safe spelling of the name and a hash of it."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:64] + "-" + hashlib.sha256(user.encode()).hexdigest()[:8]


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
