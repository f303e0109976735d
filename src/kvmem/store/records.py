"""What a store holds and what a write brings, as values: ``FactRecord`` (one stored fact), ``UserKV`` (one
version of a user's memory; its KV is read lazily, through the reader that made it), ``Write`` (one commit's whole
content, passed as one value from ``Memory`` through ``ingest.write_facts`` and ``Writer.commit`` down to the
rows' ``Rows.commit``), and the names of KV segments. No I/O here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import torch

from ..policy import check_store_user
from .location import StoreError

if TYPE_CHECKING:
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


@dataclass
class UserKV:
    """One version of a user's memory: its live facts (row order), their embeddings, and its KV segments.

    ``segments``: segment name -> SHA-256 of the file; fact ``i`` owns tokens ``token_offset .. +num_tokens`` of
    its segment. ``embeddings``: [F, E] float32, L2-normalised, row ``i`` = ``facts[i]``. KV is read lazily, by
    fact (``gather``), through the store that took the snapshot."""

    user: str
    version: str
    facts: list[FactRecord]
    segments: dict[str, str]
    embeddings: torch.Tensor
    reader: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    span_reader: Callable[..., list] | None = field(default=None, repr=False)  # ``read``'s: spans as stored
    parts: tuple[UserKV, ...] = ()  # a union's partitions (``union``); () for one user's snapshot

    @classmethod
    def union(cls, parts: list[UserKV]) -> UserKV:
        """Several users' snapshots (entity scopes, ``scopes``) read as one memory: facts and embeddings in
        ``parts`` order, positions offset by the parts before. ``user`` (a JSON list of the users) and ``version``
        (their versions, comma-joined) name exactly this set of versions, so a cache salt over them covers every
        scope it used. One part is returned as it is."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ValueError("a union needs at least one snapshot")
        return cls(
            json.dumps([p.user for p in parts]),
            ",".join(p.version for p in parts),
            [f for p in parts for f in p.facts],
            {(p.user, s): sha for p in parts for s, sha in p.segments.items()},
            torch.cat([p.embeddings for p in parts]),
            parts[0].reader,
            parts[0].span_reader,
            tuple(parts),
        )

    def versions(self) -> list[tuple[str, str]]:
        """(user, version) of each partition: [(self.user, self.version)] for one user's snapshot."""
        return [(p.user, p.version) for p in self.parts] or [(self.user, self.version)]

    def segment_sha(self, user: str, segment: str) -> str:
        return self.segments[(user, segment) if self.parts else segment]

    def row_of(self) -> dict[str, int]:
        """fact_id -> position in ``facts`` (and in ``embeddings``); built once per snapshot (a snapshot's facts never
        change), so a request that looks up its k facts costs O(k), not O(facts). Read-only."""
        return self._row_of

    @functools.cached_property
    def _row_of(self) -> dict[str, int]:
        return {f.fact_id: i for i, f in enumerate(self.facts)}

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """store row id -> position in ``facts`` (what the vector index returns -> what compose takes)."""
        return {f.row: i for i, f in enumerate(self.facts)}

    def fact_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and raw values of ``facts[i]``: [L, H, n_i, D] each."""
        return self.gather([i])

    def read(self, rows: list[int], timings: dict | None = None) -> list:
        """The stored KV of ``facts[rows]``, as stored (``kvformat.SpanKV`` each, not dequantised): ``gather``'s
        reads alone, from the read cache or the segments, for a caller that assembles them elsewhere (the vLLM
        worker reads on a loader thread and assembles on the engine's). ``timings`` gets ``read`` (ms). Raises
        as ``gather`` does."""
        if self.span_reader is None:
            raise StoreError(f"this snapshot of {self.user!r} has no store to read its KV from")
        return self.span_reader(self, [self.facts[r] for r in rows], timings)

    def gather(
        self,
        rows: list[int],
        timings: dict | None = None,
        dtype: torch.dtype | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        empty=None,
        spans: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``facts[rows]`` concatenated in that order: [L, H, sum n_i, D] each, in the model
        dtype. Reads only those facts' bytes (``segments.read_spans``), each segment verified once per process.
        ``timings``: gets ``read`` (cache and segment reads; not when ``spans`` are given) and ``dequantize``
        (assembly) in ms. ``dtype``: of the result (default the model's; rewrites of a lossy store take fp32, where
        dequantisation is exact).
        ``prefix``: keys, values [L, H, h, D] (the header) put first, in the same single copy. ``empty``: where
        the result goes (``kvformat.assemble``). ``spans``: what ``read(rows)`` returned, assembled without
        reading again.

        Raises LookupError if this version was replaced and its files removed meanwhile, StoreError if a
        segment is missing, truncated or corrupt."""
        if self.reader is None:
            raise StoreError(f"this snapshot of {self.user!r} has no store to read its KV from")
        if spans is not None and len(spans) != len(rows):
            raise ValueError(f"{len(spans)} spans for {len(rows)} rows")
        return self.reader(self, [self.facts[r] for r in rows], timings, dtype, prefix, empty, spans)

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self.facts)

    @functools.cached_property
    def expiring(self) -> dict[int, str]:
        """store row id -> ``expiration_date`` (YYYY-MM-DD, Mem0's metadata field) of the facts that have one."""
        if self.parts:  # each part's map is cached with its snapshot
            return {r: d for p in self.parts for r, d in p.expiring.items()}
        out = {}
        for f in self.facts:
            if '"expiration_date"' in f.metadata:
                exp = json.loads(f.metadata).get("expiration_date")
                if isinstance(exp, str):
                    out[f.row] = exp
        return out

    def unexpired(self, today: str | None = None) -> set[int] | None:
        """Store row ids of the facts not expired on ``today`` (YYYY-MM-DD, default the current UTC date; a fact
        expires after its date), or None when none has expired (every row may be served)."""
        today = today or datetime.now(UTC).date().isoformat()
        gone = {r for r, d in self.expiring.items() if d < today}
        return None if not gone else {f.row for f in self.facts} - gone


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
