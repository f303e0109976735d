"""Offline ingestion: LoCoMo facts -> context-window encoded pre-RoPE K/V + embeddings -> store.

Paper §3.1-3.2, §5.2. Each fact is encoded as ``[header][w turns before its source turn][fact]`` and only the
fact tokens' K/V are kept; the header is the same one the fact follows at serving time, so the fact's first
token is never an attention sink.
"""

from __future__ import annotations

import dataclasses
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


def build_sequences(tok, header_ids: list[int], contexts: list[str], facts: list[str]):
    """Context-window encoding inputs (paper §3.2): per fact ``[header][context][fact]`` token ids, and the
    (start, end) span of the fact's own tokens in it. ``facts``: rendered fact texts; ``contexts``: rendered turns."""
    sequences, spans = [], []
    for ctx, fact in zip(contexts, facts, strict=True):
        ctx_ids = text_ids(tok, ctx) if ctx else []
        ids = text_ids(tok, fact)
        start = len(header_ids) + len(ctx_ids)
        sequences.append(list(header_ids) + ctx_ids + ids)
        spans.append((start, start + len(ids)))
    return sequences, spans


def conversation_inputs(conv: Conversation, window: int) -> tuple[list[str], list[str]]:
    """(contexts, rendered facts) of a LoCoMo conversation: each observation behind the ``window`` turns
    before its source turn."""
    contexts = ["".join(t.render() for t in conv.turns_before(f.source_turn, window)) for f in conv.facts]
    return contexts, [f.render() for f in conv.facts]


def context_sequences(tok, header_ids: list[int], conv: Conversation, window: int):
    """``build_sequences`` for a LoCoMo conversation's facts (what ``ingest_conversation`` encodes)."""
    return build_sequences(tok, header_ids, *conversation_inputs(conv, window))


def encode_facts(lm: LoadedModel, header_ids: list[int], contexts: list[str], facts: list[str],
                 max_batch_tokens: int = 2048, progress=None):
    """Encode many facts behind their contexts in batched forward passes (``build_sequences``). Returns (token
    ids per fact, SpanKV per fact, tokens run through the model)."""
    sequences, spans = build_sequences(lm.tokenizer, header_ids, contexts, facts)
    kvs = encode_spans(lm.model, sequences, spans, max_batch_tokens, progress=progress) if sequences else []
    return [tuple(seq[s:e]) for seq, (s, e) in zip(sequences, spans)], kvs, sum(map(len, sequences))


def write_facts(lm: LoadedModel, embedder: Embedder, store: Store, user: str, facts: list[FactRecord],
                contexts: list[str], rendered: list[str], delete: list[str] = (), replace: bool = False,
                turns: list[dict] = (), events: list[tuple] = (), window: int = 0, source: str | None = None,
                max_batch_tokens: int = 2048, progress=None, now: float | None = None) -> tuple[str, dict]:
    """The one write path (``ingest-locomo`` and ``Memory.add/update/delete`` both end here): encode the new
    facts behind their contexts in one batched pass, embed them in one call, and commit facts, tombstones, turns
    and history in one store transaction. ``facts[i].token_ids`` is filled from ``rendered[i]``.
    Returns (version, timings {encode_s, embed_s, encoded_tokens})."""
    t0 = time.perf_counter()
    ids, kvs, n_tokens = encode_facts(lm, store.header_token_ids, contexts, rendered, max_batch_tokens, progress)
    t1 = time.perf_counter()
    emb = embedder.embed([f.text for f in facts]) if facts else None
    t2 = time.perf_counter()
    facts = [dataclasses.replace(f, token_ids=i) for f, i in zip(facts, ids)]
    version = store.commit(user, facts, [kv.keys.cpu() for kv in kvs], [kv.values.cpu() for kv in kvs], emb,
                           delete=list(delete), replace=replace, turns=list(turns), events=list(events),
                           window=window, source=source, now=now)
    return version, {"encode_s": t1 - t0, "embed_s": t2 - t1, "encoded_tokens": n_tokens}


def ingest_conversation(lm: LoadedModel, embedder: Embedder, store_root: str | Path, conv: Conversation,
                        window: int = 5, max_batch_tokens: int = 2048, progress: bool = True,
                        source: str = "") -> IngestReport:
    """Encode and store all of ``conv``'s facts for user ``conv.sample_id`` (replacing that user atomically),
    through the one write path (``write_facts``): observations are the facts, their source turns' windows the
    context, and the conversation's turns become the user's stored turns.

    Raises StoreError if the store belongs to another model or the conversation has no facts.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    if not conv.facts:
        raise StoreError(f"sample {conv.sample_id} has no observation facts to ingest")
    t0 = time.perf_counter()
    store, fmt = open_or_create_store(store_root, lm, embedder)
    contexts, rendered = conversation_inputs(conv, window)
    records = [FactRecord(f.fact_id, conv.sample_id, f.text, f.speaker, f.source_turn, f.date, (), 0, window)
               for f in conv.facts]
    bar = None
    if progress:  # by tokens, ticking per decoder layer, so it moves (with an ETA) even on a slow CPU
        import sys

        from tqdm import tqdm

        total = sum(map(len, build_sequences(lm.tokenizer, store.header_token_ids, contexts, rendered)[0]))
        bar = tqdm(total=total, desc=f"encode {conv.sample_id} ({len(records)} facts, w={window})",
                   unit="tok", unit_scale=True, file=sys.stderr, mininterval=1.0)
    turns = [{"dia_id": t.dia_id, "speaker": t.speaker, "content": t.text} for t in conv.turns]
    version, tm = write_facts(lm, embedder, store, conv.sample_id, records, contexts, rendered, replace=True,
                              turns=turns, window=window,
                              source=source, max_batch_tokens=max_batch_tokens,
                              progress=bar.update if bar else None)
    if bar:
        bar.close()
    n_fact = sum(f.num_tokens for f in store.snapshot(conv.sample_id, kv=False).facts)  # rows only: no KV read
    store.close()
    return IngestReport(conv.sample_id, len(records), n_fact, tm["encoded_tokens"], window, tm["encode_s"],
                        tm["embed_s"], time.perf_counter() - t0, version)


