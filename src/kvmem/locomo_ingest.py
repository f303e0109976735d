"""LoCoMo conversations into a store: each observation fact encoded behind the turns before its source turn,
through the one write path (``ingest.write_facts``). Paper §5.2."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .ingest import build_sequences, open_or_create_store, write_facts
from .locomo import Conversation
from .models import LoadedModel
from .policy import Encoding
from .retrieve import Embedder
from .store import FactRecord, StoreError, Write


@dataclass
class IngestReport:
    user: str
    num_facts: int
    num_fact_tokens: int
    num_encoded_tokens: int  # header + window + fact tokens run through the model
    window: int
    encode_s: float
    embed_s: float
    total_s: float
    version: str
    neighbours: int = 0
    history: bool = False


def conversation_inputs(conv: Conversation, window: int) -> tuple[list[str], list[str]]:
    """(contexts, rendered facts) of a LoCoMo conversation: each observation behind the ``window`` turns
    before its source turn."""
    contexts = ["".join(t.render() for t in conv.turns_before(f.source_turn, window)) for f in conv.facts]
    return contexts, [f.render() for f in conv.facts]


def provenance(conv: Conversation, fact, window: int) -> dict:
    """A LoCoMo fact's provenance (``FactRecord``): its window's turns and its source turn, as references to the
    ingest commit's new turns (``-(i + 1)`` for ``conv.turns[i]``)."""
    pos = {t.dia_id: i for i, t in enumerate(conv.turns)}
    at = pos.get(fact.source_turn)
    ctx = () if at is None or window <= 0 else tuple(-(i + 1) for i in range(max(0, at - window), at))
    return {"context_turns": ctx, "source_turns": () if at is None else (-(at + 1),)}


def context_sequences(tok, header_ids: list[int], conv: Conversation, window: int):
    """``build_sequences`` for a LoCoMo conversation's facts (what ``ingest_conversation`` encodes)."""
    return build_sequences(tok, header_ids, *conversation_inputs(conv, window))


def ingest_conversation(
    lm: LoadedModel,
    embedder: Embedder,
    store_root: str | Path,
    conv: Conversation,
    window: int | None = None,
    max_batch_tokens: int = 2048,
    progress: bool = True,
    source: str = "",
    neighbours: int | None = None,
    history: bool = False,
    segments_url: str | None = None,
    kv_format: str | None = None,
) -> IngestReport:
    """Encode and store all of ``conv``'s facts for user ``conv.sample_id`` (replacing that user atomically),
    through the one write path (``write_facts``): observations are the facts, their source turns' windows the
    context, and the conversation's turns become the user's stored turns. ``neighbours=m``: neighbour-aware
    encoding, each fact also behind its m most similar other facts of the conversation (default 4).
    ``history``: history encoding, each fact behind all the conversation's facts before it (default
    neighbours 0). Defaults and checks: ``policy.Encoding``. ``segments_url``: for a new store, the object store
    its KV segments go to.

    Raises StoreError if the store belongs to another model or the conversation has no facts; ValueError for a
    negative window, neighbours outside 0..MAX_NEIGHBOURS, or history with neighbours.
    """
    encoding = Encoding.of(window, neighbours, history)
    window, neighbours = encoding.window, encoding.neighbours
    if not conv.facts:
        raise StoreError(f"sample {conv.sample_id} has no observation facts to ingest")
    t0 = time.perf_counter()
    store, fmt = open_or_create_store(store_root, lm, embedder, segments_url=segments_url, kv_format=kv_format)
    contexts, rendered = conversation_inputs(conv, window)
    records = [
        FactRecord(
            f.fact_id,
            conv.sample_id,
            f.text,
            f.speaker,
            f.source_turn,
            f.date,
            (),
            0,
            window,
            **provenance(conv, f, window),
        )
        for f in conv.facts
    ]
    bar = None
    if progress:  # by tokens, ticking per decoder layer, so it moves (with an ETA) even on a slow CPU
        label = encoding.describe()
        bar = tqdm(
            total=None,
            desc=f"encode {conv.sample_id} ({len(records)} facts, {label})",
            unit="tok",
            unit_scale=True,
            file=sys.stderr,
            mininterval=1.0,
        )
    turns = [{"dia_id": t.dia_id, "speaker": t.speaker, "content": t.text} for t in conv.turns]
    version, tm = write_facts(
        lm,
        embedder,
        store,
        Write(conv.sample_id, records, replace=True, turns=turns, source=source),
        contexts,
        rendered,
        encoding=encoding,
        max_batch_tokens=max_batch_tokens,
        progress=bar,
    )
    if bar:
        bar.close()
    n_fact = sum(f.num_tokens for f in store.reads.snapshot(conv.sample_id).facts)
    store.close()
    return IngestReport(
        conv.sample_id,
        len(records),
        n_fact,
        tm["encoded_tokens"],
        window,
        tm["encode_s"],
        tm["embed_s"],
        time.perf_counter() - t0,
        version,
        neighbours,
        history,
    )
