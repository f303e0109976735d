"""What the inspector's pages show, read through the ``Memory`` facade and the ``Store`` facade (no second
implementation of either): the bytes of stored KV, a memory's row with its provenance, and the preview of what
erasing a memory will remove and re-encode."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...store import FactRecord, Store
from ...store.erasure import Erasure


@dataclass(frozen=True)
class KvSize:
    """Bytes of stored KV per (layer, head) pair: ``layers`` x ``heads`` pairs, head dim ``dim``, ``elem`` bytes
    per element (native), for ``fmt`` (``kvformat``: int8 and fp8 keep 1-byte elements plus fp16 scales per fact
    and channel (keys) and per token (values))."""

    fmt: str
    layers: int
    heads: int
    dim: int
    elem: int

    @classmethod
    def of(cls, store: Store) -> KvSize:
        keys, _ = store.reads.header_kv()  # [L, H, h, D]
        return cls(store.kv_format, keys.shape[0], keys.shape[1], keys.shape[3], keys.element_size())

    def nbytes(self, tokens: int, facts: int) -> int:
        """Bytes of ``facts`` facts' KV holding ``tokens`` tokens in all."""
        pairs = self.layers * self.heads
        if self.fmt == "native":
            return pairs * tokens * 2 * self.dim * self.elem
        return pairs * (tokens * (2 * self.dim + 2) + facts * 2 * self.dim)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def provenance(f: FactRecord) -> dict:
    """A fact's provenance for the page: ``turns`` (indexes of the window turns its KV was computed behind),
    ``facts`` (ids of the facts it was encoded behind), ``source`` (the turns it came from); ``known`` False for a
    fact written before provenance was recorded."""
    return {
        "known": f.context_turns is not None,
        "turns": [t for t in (f.context_turns or ()) if t >= 0],
        "facts": list(f.context_facts),
        "source": list(f.source_turns),
    }


def erasure_preview(store: Store, f: FactRecord) -> dict:
    """What erasing ``f`` will do, by the rules the commit follows (``store.erasure``): ``turns``, the stored
    turns it came from (erased with it), and ``reencode``, the live facts of its scope whose KV was computed
    behind it or behind one of those turns (re-encoded without them). A preview: the erasure report of the
    delete itself is what the commit did."""
    turns = store.reads.turns(f.user)
    rows = [(t["idx"], t["dia_id"], t["content"]) for t in turns]
    facts = store.reads.snapshot(f.user).facts
    # the commit's own rule (``Erasure.plan``); the creation time orders facts as the rows' version does
    live = {g.fact_id: (g.fact_id, g.provenance(), g.segment, g.created_at, g.source_turn, g.text) for g in facts}
    _, erased, stale_ids = Erasure([f.fact_id]).plan(f.user, live, rows, set())
    stale = [g for g in facts if g.fact_id in set(stale_ids)]
    return {"turns": [t for t in turns if t["idx"] in erased], "reencode": stale}


def metadata_text(f: FactRecord) -> str:
    meta = json.loads(f.metadata or "{}")
    return json.dumps(meta, ensure_ascii=False, sort_keys=True) if meta else ""
