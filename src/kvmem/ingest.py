"""Offline ingestion: LoCoMo facts -> context-window encoded pre-RoPE K/V + embeddings -> store.

Paper §3.1-3.2, §5.2. Each fact is encoded as ``[header][w turns before its source turn][fact]`` and only the
fact tokens' K/V are kept; the header is the same one the fact follows at serving time, so the fact's first
token is never an attention sink.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .compose import PromptFormat, text_ids
from .encode import encode_spans
from .locomo import Conversation
from .models import LoadedModel, fingerprint
from .retrieve import Embedder
from .store import FactRecord, Store, StoreError


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


def open_or_create_store(root: str | Path, lm: LoadedModel, embedder: Embedder) -> tuple[Store, PromptFormat]:
    """Open the store at ``root`` for ``lm`` (refusing another model's store) or create it with the header KV."""
    fmt = PromptFormat.for_tokenizer(lm.tokenizer, lm.chat)
    header_ids = fmt.header_ids(lm.tokenizer)
    fp = fingerprint(lm)
    if (Path(root) / "manifest.json").exists():
        store = Store.open(root, fp)
        if store.header_token_ids != header_ids:
            raise StoreError(f"store {root} was built with a different instruction header")
        if store.manifest["embedder"]["name"] != embedder.name:
            raise StoreError(f"store {root} uses embedder {store.manifest['embedder']['name']!r}, not {embedder.name!r}")
        return store, fmt
    if Path(root).exists() and not Path(root).is_dir():
        raise StoreError(f"--store {root} is a file, not a directory")
    (hkv,) = encode_spans(lm.model, [header_ids], [(0, len(header_ids))])
    store = Store.create(root, fp, fmt.header, header_ids, hkv.keys.cpu(), hkv.values.cpu(), embedder.describe())
    return store, fmt


def context_sequences(tok, header_ids: list[int], conv: Conversation, window: int):
    """Context-window encoding inputs (paper §3.2): per fact, ``[header][window turns before its source turn]
    [fact]`` token ids, and the (start, end) span of the fact's own tokens in it."""
    sequences, spans = [], []
    for f in conv.facts:
        ctx = "".join(t.render() for t in conv.turns_before(f.source_turn, window))
        ctx_ids = text_ids(tok, ctx) if ctx else []
        ids = text_ids(tok, f.render())
        start = len(header_ids) + len(ctx_ids)
        sequences.append(list(header_ids) + ctx_ids + ids)
        spans.append((start, start + len(ids)))
    return sequences, spans


def ingest_conversation(lm: LoadedModel, embedder: Embedder, store_root: str | Path, conv: Conversation,
                        window: int = 5, max_batch_tokens: int = 2048, progress: bool = True,
                        source: str = "") -> IngestReport:
    """Encode and store all of ``conv``'s facts for user ``conv.sample_id`` (replacing that user atomically).

    Raises StoreError if the store belongs to another model or the conversation has no facts.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    if not conv.facts:
        raise StoreError(f"sample {conv.sample_id} has no observation facts to ingest")
    t0 = time.perf_counter()
    store, fmt = open_or_create_store(store_root, lm, embedder)
    sequences, spans = context_sequences(lm.tokenizer, store.header_token_ids, conv, window)
    records = [FactRecord(f.fact_id, conv.sample_id, f.text, f.speaker, f.source_turn, f.date,
                          tuple(seq[s:e]), 0, window) for f, seq, (s, e) in zip(conv.facts, sequences, spans)]
    bar = None
    if progress:  # by tokens, ticking per decoder layer, so it moves (with an ETA) even on a slow CPU
        import sys

        from tqdm import tqdm

        bar = tqdm(total=sum(map(len, sequences)), desc=f"encode {conv.sample_id} ({len(records)} facts, w={window})",
                   unit="tok", unit_scale=True, file=sys.stderr, mininterval=1.0)
    t1 = time.perf_counter()
    kvs = encode_spans(lm.model, sequences, spans, max_batch_tokens, progress=bar.update if bar else None)
    encode_s = time.perf_counter() - t1
    if bar:
        bar.close()
    t2 = time.perf_counter()
    emb = embedder.embed([f.text for f in conv.facts])
    embed_s = time.perf_counter() - t2
    version = store.put_user(conv.sample_id, records, [kv.keys.cpu() for kv in kvs], [kv.values.cpu() for kv in kvs],
                             emb, window, source)
    store.close()
    return IngestReport(conv.sample_id, len(records), sum(r.num_tokens for r in records),
                        sum(len(s) for s in sequences), window, encode_s, embed_s, time.perf_counter() - t0, version)
