"""The write path: facts -> context-window encoded pre-RoPE K/V + embeddings -> store (``write_facts``).

Paper §3.1-3.2, §5.2. Each fact is encoded as ``[header][w turns before its source turn][fact]`` and only the
fact tokens' K/V are kept; the header is the same one the fact follows at serving time, so the fact's first
token is never an attention sink.

Neighbour-aware encoding (``neighbours=m``, ``policy.DEFAULT_NEIGHBOURS`` = 4): ``[header][m most similar other facts of
the same user][w turns][fact]``, so a fact's values already mix in the facts it is likely to be retrieved with.
This is the offline half of FusionRAG (arXiv 2601.12904); it costs m fact lengths more per encoded fact and
nothing at serving time (the stored KV has the same shape).

History encoding (``history=True``): ``[header][the user's earlier facts, in write order][w turns][fact]``,
as a prompt listing every memory would compute the fact. At w=0 it is one forward over all of a user's facts
(1 encoded token per fact token, against 11 for w=5, m=4), at w>0 one pass over the chain plus each fact's turns
on its cache (``encode.encode_chain``). A run covers at most ``MAX_HISTORY_TOKENS`` positions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from .compose import PromptFormat, text_ids
from .encode import encode_chain, encode_spans
from .models import LoadedModel, fingerprint
from .policy import Encoding
from .retrieve import Embedder
from .store import (
    ALL,
    CACHE_BYTES,
    Erasure,
    Store,
    StoreError,
    StoreUnavailable,
    Write,
    check_kv_format,
    check_segments_url,
)

logger = logging.getLogger("kvmem.ingest")

MAX_HISTORY_TOKENS = 16384  # history encoding: positions per encoding run (earlier facts + new facts + turns)
MAX_NEIGHBOUR_TOKENS = 1024  # neighbour prefix per fact: one write's encoding cost stays bounded
NEIGHBOUR_PAGE = 2048  # a write's neighbour choice scores the scope's facts this many embeddings at a time
MAX_CONTEXT_CHARS = 4000  # the encoding window's text, nearest turns kept: one add's cost stays bounded


def render_turns(turns: list[dict]) -> str:
    """A window's turns as the encoder reads them (``speaker: content`` lines, LoCoMo's rendering), the last
    ``MAX_CONTEXT_CHARS`` characters. ``turns``: dicts with ``content`` and ``speaker`` (None: ``user``)."""
    text = "".join(f"{t.get('speaker') or 'user'}: {t['content']}\n" for t in turns)
    return text[-MAX_CONTEXT_CHARS:]


def open_or_create_store(
    root: str | Path,
    lm: LoadedModel,
    embedder: Embedder,
    cache_bytes: int = CACHE_BYTES,
    segments_url: str | None = None,
    kv_format: str | None = None,
) -> tuple[Store, PromptFormat]:
    """Open the store at ``root`` for ``lm`` (refusing another model's store) or create it with the header KV.
    ``cache_bytes``: the store's cache bound (``Store``); ``segments_url``: for a new store, the object store its
    KV segments go to (``Store.create``); an existing store must have been created with the same one. ``kv_format``:
    how a new store keeps KV (``kvformat``; default native); an existing store must already hold that format."""
    fmt = PromptFormat.for_tokenizer(lm.tokenizer, lm.chat)
    header_ids = fmt.header_ids(lm.tokenizer)
    fp = fingerprint(lm)
    for attempt in (0, 1):
        if Store.exists(root):
            store = Store.open(root, fp, cache_bytes=cache_bytes)
            if store.header_token_ids != header_ids:
                raise StoreError(f"store {store.name} was built with a different instruction header")
            if store.manifest["embedder"]["name"] != embedder.name:
                raise StoreError(
                    f"store {store.name} uses embedder {store.manifest['embedder']['name']!r}, not {embedder.name!r}"
                )
            check_segments_url(store, segments_url)
            check_kv_format(store, kv_format)
            return store, fmt
        (hkv,) = encode_spans(lm.model, [header_ids], [(0, len(header_ids))])
        try:
            store = Store.create(
                root,
                fp,
                fmt.header,
                header_ids,
                hkv.keys.cpu(),
                hkv.values.cpu(),
                embedder.describe(),
                cache_bytes,
                segments_url,
                kv_format,
            )
            return store, fmt
        except StoreError:
            if attempt or not Store.exists(root):  # not a creator that raced another one: the error stands
                raise
    raise AssertionError("unreachable")


def build_sequences(
    tok, header_ids: list[int], contexts: list[str], facts: list[str], prefixes: list[list[int]] | None = None
):
    """Context-window encoding inputs (paper §3.2): per fact ``[header][prefix][context][fact]`` token ids, and the
    (start, end) span of the fact's own tokens in it. ``facts``: rendered fact texts; ``contexts``: rendered turns;
    ``prefixes``: token ids before the turns (neighbour facts, ``neighbour_prefixes``), default none."""
    sequences, spans = [], []
    prefixes = prefixes or [[] for _ in facts]
    for ctx, fact, pre in zip(contexts, facts, prefixes, strict=True):
        ctx_ids = text_ids(tok, ctx) if ctx else []
        ids = text_ids(tok, fact)
        start = len(header_ids) + len(pre) + len(ctx_ids)
        sequences.append(list(header_ids) + list(pre) + ctx_ids + ids)
        spans.append((start, start + len(ids)))
    return sequences, spans


def pick_neighbours(candidates, own: list[int], neighbours: int, max_tokens: int) -> list:
    """The neighbour rule: from ``candidates`` ((key, token ids) pairs, most similar first), the first
    ``neighbours`` that fit within ``max_tokens`` prefix tokens together and are not exact copies of the fact
    (``own``: its token ids) or of a neighbour already kept (a copy adds no context). Returns their keys, most
    similar first."""
    kept, used, seen = [], 0, {tuple(own)}
    for key, ids in candidates:
        if len(kept) == neighbours:
            break
        ids = tuple(ids)
        if ids not in seen and used + len(ids) <= max_tokens:
            kept.append(key)
            used += len(ids)
            seen.add(ids)
    return kept


def neighbour_prefixes(
    embeddings: torch.Tensor,
    token_ids: list[list[int]],
    pool_embeddings: torch.Tensor | None,
    pool_token_ids: list[list[int]],
    neighbours: int,
    max_tokens: int = MAX_NEIGHBOUR_TOKENS,
) -> tuple[list[list[int]], list[list[int]]]:
    """Neighbour-aware encoding inputs: for each new fact, the ``neighbours`` most similar *other* facts among the
    pool (the user's live facts this write keeps) and the other new facts, by retrieval-embedding inner product.
    Exact copies (same token ids as the fact or as a neighbour already chosen) are skipped: they add no context.

    Args:
        embeddings: [F, E] float32, L2-normalised, the new facts'.
        token_ids: the new facts' rendered token ids (what serving injects), one list per fact.
        pool_embeddings: [P, E] float32 or None; pool_token_ids: P lists.
        max_tokens: at most this many prefix tokens per fact: neighbours are taken most similar first while
            they fit (long memories cannot blow up one write's encoding).
    Returns:
        (prefixes, chosen): per new fact the neighbours' token ids concatenated, least similar first so the most
        similar one sits next to the fact; and the chosen candidate indices in that order (pool rows are
        ``0..P-1``, new fact ``j`` is ``P + j``).
    """
    if neighbours == 0 or not token_ids:
        return [[] for _ in token_ids], [[] for _ in token_ids]
    pool = 0 if pool_embeddings is None else pool_embeddings.shape[0]
    cands = embeddings if pool == 0 else torch.cat([pool_embeddings.float(), embeddings.float()])
    ids = list(pool_token_ids[:pool]) + list(token_ids)
    sim = embeddings.float() @ cands.T  # [F, P + F]: F is one write's (an import's batch), P the scope's
    sim[torch.arange(len(token_ids)), pool + torch.arange(len(token_ids))] = float("-inf")  # never itself
    n = sim.shape[1]
    top = []
    for j in range(len(token_ids)):
        # a top-k search, not a sort of every candidate: k grows only while skipped copies or the token budget
        # leave fewer than ``neighbours`` chosen
        k = min(n, 4 * neighbours + 4)
        while True:
            top_k = torch.topk(sim[j], k).indices.tolist()  # most similar first
            kept = pick_neighbours(((c, ids[c]) for c in top_k if c != pool + j), token_ids[j], neighbours, max_tokens)
            if len(kept) == neighbours or k == n:
                break
            k = min(n, 4 * k)
        top.append(kept[::-1])  # ascending similarity
    return [[t for c in row for t in ids[c]] for row in top], top


def scope_neighbours(
    store: Store | None,
    user: str,
    embeddings: torch.Tensor,
    token_ids: list[list[int]],
    fact_ids: list[str],
    gone: set[str],
    neighbours: int,
    max_tokens: int = MAX_NEIGHBOUR_TOKENS,
    page: int = NEIGHBOUR_PAGE,
) -> tuple[list[list[int]], list[list[str]]]:
    """``neighbour_prefixes`` with the pool read from the store: ``user``'s live facts (less the ids in ``gone``;
    ``store`` None: no pool) and the new facts, the store read ``page`` embeddings at a time (``Store.
    embedding_page``) while each new fact keeps its best pool candidates, then only those candidates' token ids
    read (``Store.reads.rows_token_ids``). The same choice as ``neighbour_prefixes`` over the whole scope (ties aside),
    in memory that follows the write and the page, never the scope: no snapshot, no scope-sized matrix. A fact
    whose candidates run out (exact copies, the token budget) before it has ``neighbours`` is searched again
    with four times as many.

    Args as ``neighbour_prefixes``; ``fact_ids``: the new facts' ids. Returns (prefixes, least similar first; the
    chosen facts' ids in that order)."""
    n_new = len(token_ids)
    if neighbours == 0 or not n_new:
        return [[] for _ in token_ids], [[] for _ in token_ids]
    emb = embeddings.float()
    among = emb @ emb.T  # the new facts as each other's candidates
    among.fill_diagonal_(float("-inf"))  # never itself
    chosen: list[list[tuple[int, int]] | None] = [None] * n_new  # (0, store row) or (1, new fact index)
    info: dict[int, tuple[str, tuple[int, ...]]] = {}
    todo, k = list(range(n_new)), 4 * neighbours + 4
    while todo:
        q = emb[todo]
        best_v, best_r, pool, after = q.new_empty(len(todo), 0), torch.empty(len(todo), 0, dtype=torch.long), 0, -1
        while store is not None:
            rows, fids, e = store.reads.embedding_page(user, after, page)
            if not rows:
                break
            after = rows[-1]
            keep = [i for i, f in enumerate(fids) if f not in gone]
            if not keep:
                continue
            pool += len(keep)
            v = torch.cat([best_v, q @ e[keep].T], dim=1)
            r = torch.cat([best_r, torch.tensor([rows[i] for i in keep]).expand(len(todo), -1)], dim=1)
            top = torch.topk(v, min(k, v.shape[1]), dim=1)  # sorted, most similar first
            best_v, best_r = top.values, r.gather(1, top.indices)
        whole = best_v.shape[1] == pool  # every pool fact is a candidate: nothing beyond them was left out
        info.update(
            store.reads.rows_token_ids(user, [r for r in best_r.flatten().tolist() if r not in info]) if pool else {}
        )
        again = []
        for t, j in enumerate(todo):
            cands = [(v, 0, r) for v, r in zip(best_v[t].tolist(), best_r[t].tolist())]
            floor = cands[-1][0] if cands and not whole else float("-inf")  # below it, pool facts are unknown
            cands += [(v, 1, i) for i, v in enumerate(among[j].tolist()) if i != j and v >= floor]
            cands.sort(key=lambda c: -c[0])  # stable: a pool fact before a new one it ties with
            kept = pick_neighbours(
                (((kind, x), info[x][1] if kind == 0 else token_ids[x]) for _, kind, x in cands
                 if kind == 1 or x in info),  # a pool fact not in info: deleted since its page was read
                token_ids[j], neighbours, max_tokens,
            )  # fmt: skip
            if len(kept) < neighbours and not whole:
                again.append(j)  # its candidates ran out with pool facts left unread: more of them
            else:
                chosen[j] = kept[::-1]  # ascending similarity
        todo, k = again, 4 * k
    prefixes = [[t for kind, x in row for t in (info[x][1] if kind == 0 else token_ids[x])] for row in chosen]
    return prefixes, [[info[x][0] if kind == 0 else fact_ids[x] for kind, x in row] for row in chosen]


def history_runs(
    header_len: int, history: list[list[int]], facts: list[list[int]], contexts: list[list[int]], budget: int
) -> list[tuple[list[int], list[int]]]:
    """Split a history-encoded write into runs that fit ``budget`` positions: ``[(earlier-fact ids, new-fact
    indices)]``. Each run starts behind the newest earlier facts (written before it, whole facts, oldest first)
    that fit half the budget, so a long-lived user's facts see their recent history, not all of it.
    Raises ValueError when one fact with its context does not fit."""
    runs, earlier, i = [], list(history), 0
    while i < len(facts):
        # at most half the budget, and never so much that the next fact with its turns does not fit
        prefix, room = [], min((budget - header_len) // 2, budget - header_len - len(facts[i]) - len(contexts[i]))
        for ids in reversed(earlier):
            if len(ids) > room:
                break
            prefix, room = list(ids) + prefix, room - len(ids)
        used, idx = header_len + len(prefix), []
        while (
            i < len(facts)
            and used + sum(map(len, (facts[j] for j in idx))) + len(facts[i]) + len(contexts[i]) <= budget
        ):
            idx.append(i)
            i += 1
        if not idx:
            raise ValueError(
                f"a fact of {len(facts[i])} tokens with {len(contexts[i])} context tokens does not fit "
                f"the {budget}-position history budget"
            )
        runs.append((prefix, idx))
        earlier += [facts[j] for j in idx]
    return runs


def encode_facts(
    lm: LoadedModel,
    header_ids: list[int],
    contexts: list[str],
    facts: list[str],
    max_batch_tokens: int = 2048,
    progress=None,
    prefixes: list[list[int]] | None = None,
    history: list[list[int]] | None = None,
):
    """Encode many facts behind their contexts in batched forward passes (``build_sequences``). ``progress``: a
    tqdm-like bar (its ``total`` is set to the tokens to run) or None. Returns (token ids per fact, SpanKV per
    fact, tokens run through the model).

    ``history``: history encoding (``encode.encode_chain``). Each fact is encoded as ``[header][earlier
    facts][facts written before it in this call][its turns][fact]``; ``history`` holds the earlier facts' token
    ids, oldest first (``[]`` for a user's first write). At most ``MAX_HISTORY_TOKENS`` positions (or the
    model's context) per run: ``history_runs``. Not with ``prefixes`` (neighbours)."""
    if history is not None:
        if prefixes is not None:
            raise ValueError("history encoding and neighbours do not combine; use one of them")
        ids = [text_ids(lm.tokenizer, f) for f in facts]
        ctx = [text_ids(lm.tokenizer, c) if c else [] for c in contexts]
        budget = min(MAX_HISTORY_TOKENS, getattr(lm.model.config, "max_position_embeddings", MAX_HISTORY_TOKENS))
        runs = history_runs(len(header_ids), history, ids, ctx, budget)
        # per run: the chain once (all its facts at w=0; all but the last with turns), then each fact's turns + fact
        n_tokens = sum(
            len(header_ids)
            + len(p)
            + sum(len(ids[i]) for i in idx)
            + (sum(len(ctx[i]) + len(ids[i]) for i in idx) - len(ids[idx[-1]]) if any(ctx[i] for i in idx) else 0)
            for p, idx in runs
        )
        if progress is not None:
            progress.total = n_tokens
            progress.refresh()
        kvs = [None] * len(ids)
        for prefix, idx in runs:
            out = encode_chain(
                lm.model,
                list(header_ids) + prefix,
                [ids[i] for i in idx],
                [ctx[i] for i in idx],
                None if progress is None else progress.update,
            )
            for i, kv in zip(idx, out):
                kvs[i] = kv
        return [tuple(i) for i in ids], kvs, n_tokens
    sequences, spans = build_sequences(lm.tokenizer, header_ids, contexts, facts, prefixes)
    n_tokens = sum(map(len, sequences))
    if progress is not None:
        progress.total = n_tokens
        progress.refresh()
    tick = None if progress is None else progress.update
    kvs = encode_spans(lm.model, sequences, spans, max_batch_tokens, progress=tick) if sequences else []
    return [tuple(seq[s:e]) for seq, (s, e) in zip(sequences, spans)], kvs, n_tokens


def write_facts(
    lm: LoadedModel | None,
    embedder: Embedder | None,
    store: Store,
    write: Write,
    contexts: list[str],
    rendered: list[str],
    encoding: Encoding = Encoding(0, 0),
    max_batch_tokens: int = 2048,
    progress=None,
) -> tuple[str, dict]:
    """The one write path (``ingest-locomo`` and every ``Memory`` commit end here): ``write`` (``store.Write``),
    whole, with its new facts (``write.add``, token ids not yet filled) encoded here. Embed the new facts in one call,
        encode them behind their contexts (and, with ``neighbours=m``, behind their m most similar other facts of the
        user: ``scope_neighbours``; or, with ``history``, behind every live fact of the user written before them:
        ``encode_facts``) in one batched pass, and commit it (``Writer.commit``: facts, tombstones, turns and history
        in one store transaction). ``facts[i].token_ids`` is filled from ``rendered[i]``; ``progress``: a tqdm-like bar
        or None; ``encoding``: window, neighbours and history (``policy.Encoding``; the window's turns are already in
        ``contexts``), recorded in the write (its ``window``; ``neighbours`` and ``history`` when it adds facts).
        Provenance: each fact's ``context_turns`` and ``source_turns`` are the caller's (None: unknown); its
        ``context_facts`` are set here, the neighbour or earlier facts it is encoded behind. With no new facts (a
        delete, or turns alone) nothing is encoded and ``lm`` and ``embedder`` may be None; the commit then records
        the window alone. ``write.expect``: a compare-and-set (StoreConflict). ``write.erase``: an erasure in the same
        commit (the new facts are never encoded behind its facts; the caller leaves its turns out of ``contexts``;
        its cascade is the caller's, ``finish_erasure``). Returns (version, timings {encode_s, embed_s,
        encoded_tokens, neighbour_s})."""
    user, facts, delete, erase = write.user, list(write.add), write.delete, write.erase
    window, neighbours, history = encoding.window, encoding.neighbours, encoding.history
    t0 = time.perf_counter()
    emb = embedder.embed([f.text for f in facts]) if facts else None
    t1 = time.perf_counter()
    prefixes, earlier, behind = None, None, [() for _ in facts]  # behind: each fact's context facts' ids
    pooled = (
        not write.replace and delete is not ALL and store.reads.version(user) is not None
    )  # live facts to encode behind
    gone = set() if delete is ALL else set(delete) | set(erase.facts if erase is not None else ())
    if erase is not None and erase.everything:
        pooled = False
    if history and facts:
        pool_ids, pool_fids = [], []
        if pooled:
            try:
                ukv = store.reads.snapshot(user)  # rows and embeddings, in write order
            except StoreUnavailable:  # the database, not the user: never encode behind a guessed pool
                raise
            except StoreError:  # a user whose every fact was deleted
                ukv = None
            if ukv is not None:
                keep = [i for i, f in enumerate(ukv.facts) if f.fact_id not in gone]
                pool_ids = [list(ukv.facts[i].token_ids) for i in keep]
                pool_fids = [ukv.facts[i].fact_id for i in keep]
        earlier = pool_ids
        behind = [tuple(pool_fids + [f.fact_id for f in facts[:j]]) for j in range(len(facts))]
    elif neighbours and facts:  # the scope read a page of embeddings at a time: memory does not follow its size
        new_ids = [text_ids(lm.tokenizer, r) for r in rendered]
        prefixes, chosen = scope_neighbours(
            store if pooled else None, user, emb, new_ids, [f.fact_id for f in facts], gone, neighbours
        )
        behind = [tuple(row) for row in chosen]
    t2 = time.perf_counter()
    ids, kvs, n_tokens = (
        encode_facts(lm, store.header_token_ids, contexts, rendered, max_batch_tokens, progress, prefixes, earlier)
        if facts
        else ([], [], 0)
    )
    t3 = time.perf_counter()
    facts = [
        dataclasses.replace(f, token_ids=i, context_facts=() if f.context_turns is None else b)
        for f, i, b in zip(facts, ids, behind)
    ]
    version = store.writes.commit(
        dataclasses.replace(
            write,
            add=facts,
            keys=[kv.keys.cpu() for kv in kvs],
            values=[kv.values.cpu() for kv in kvs],
            embeddings=emb,
            window=window,
            neighbours=neighbours if facts else None,
            history=history if facts else None,
        )
    )
    return version, {"encode_s": t3 - t2, "embed_s": t1 - t0, "neighbour_s": t2 - t1, "encoded_tokens": n_tokens}


def reencode_stale(
    lm: LoadedModel, store: Store, user: str, only: set[str] | None = None, max_batch_tokens: int = 2048
) -> tuple[int, list[str]]:
    """Re-encode ``user``'s stale facts (``Store.reads.stale``; of ``only``, if given) behind what is left of their
    context after an erasure: the window turns and neighbour or history facts of their provenance that still
    exist, in the same order, so each is encoded as it would have been had the erased text never been there. A
    fact of unknown provenance is encoded behind its ``window`` latest turns said before it was written and its
    scope's ``neighbours`` most similar other live facts. One batched pass, one versioned commit
    (``Store.writes.reencode``; tried again, up to 3 times, when a fact changed meanwhile).

    Returns (facts re-encoded, the segments that held their old KV: ``Store.writes.compact`` them). Raises
    StoreError."""
    for _ in range(3):
        pending = {fid: seg for u, fid, seg, _ in store.reads.stale(user) if only is None or fid in only}
        if not pending:
            return 0, []
        ukv = store.reads.snapshot(user)
        todo = [f for f in ukv.facts if f.fact_id in pending]
        live = {f.fact_id: f for f in ukv.facts}
        turns = {t["idx"]: t for t in store.reads.turns(user)}
        header = store.header_token_ids
        m = store.reads.user_info(user).get("neighbours", 0)
        seqs, spans, recs = [], [], []
        for f in todo:
            if f.context_turns is None:  # unknown: its window before it was written, its nearest facts now
                said = [t for t in turns.values() if t["time"] is None or t["time"] <= f.updated_at]
                ctx = [t["idx"] for t in said[len(said) - f.window :]] if f.window else []
                i = ukv.position[f.row]
                others = [j for j, g in enumerate(ukv.facts) if g.fact_id != f.fact_id]
                _, chosen = neighbour_prefixes(
                    ukv.embeddings[i : i + 1], [list(f.token_ids)], ukv.embeddings[others],
                    [list(ukv.facts[j].token_ids) for j in others], m,
                )  # fmt: skip
                behind = [ukv.facts[others[c]].fact_id for c in chosen[0]]
            else:
                ctx = [t for t in f.context_turns if t in turns]
                behind = [b for b in f.context_facts if b in live and b != f.fact_id]
            prefix = [t for b in behind for t in live[b].token_ids]
            if len(prefix) > MAX_HISTORY_TOKENS // 2:  # a history-encoded fact: its newest earlier facts
                prefix = prefix[-(MAX_HISTORY_TOKENS // 2) :]
            text = render_turns([turns[t] for t in ctx]) if ctx else ""
            ctx_ids = text_ids(lm.tokenizer, text) if text else []
            start = len(header) + len(prefix) + len(ctx_ids)
            seqs.append(list(header) + prefix + ctx_ids + list(f.token_ids))
            spans.append((start, start + f.num_tokens))
            recs.append(dataclasses.replace(f, context_turns=tuple(ctx), context_facts=tuple(behind)))
        kvs = encode_spans(lm.model, seqs, spans, max_batch_tokens)
        emb = ukv.embeddings[[ukv.position[f.row] for f in todo]]
        version = store.writes.reencode(user, recs, [kv.keys.cpu() for kv in kvs], [kv.values.cpu() for kv in kvs], emb)
        if version is not None:
            return len(recs), sorted({pending[f.fact_id] for f in todo})
    raise StoreError(f"user {user!r}: facts kept changing while they were re-encoded; try again")


def erase_facts(lm, store: Store, user: str, delete, turns: list[int] = (), defer_s: float | None = None) -> dict:
    """Erasure (``Store.writes.erase``: one commit), then its cascade (``finish_erasure``). ``lm``: a callable returning
    the ``LoadedModel`` (called only when there is something to re-encode); ``defer_s``: None, re-encode at once;
    else leave it to a background job that must run within ``defer_s`` seconds.

    Returns ``{"version", "erased": n facts, "turns": n turns, "reencoded": n, "deferred": n}``."""
    got = store.writes.erase(user, delete, turns, defer_s=defer_s or 0.0)
    job = Erasure(erased=got["erased"], turns_erased=got["turns"], stale=got["stale"], segments=got["segments"])
    return finish_erasure(lm, store, user, job, got["version"], defer_s)


def finish_erasure(lm, store: Store, user: str, job: Erasure, version: str, defer_s: float | None = None) -> dict:
    """The cascade after an erasure ``job`` landed in the commit that made ``version``: unless deferred
    (``defer_s`` not None), every fact whose KV was computed behind the erased text is re-encoded without it
    (``reencode_stale``), and the segments that held erased or replaced KV are rewritten without it
    (``Store.writes.compact``; the erased facts' own KV either way), so once ``gc`` runs no file holds it. ``lm``: a
    callable returning the ``LoadedModel``.

    The cascade is best effort: when it fails (an object store that cannot be reached, where the new KV would go)
    the erasure still stands and is reported (a client told otherwise would take the memory for one that is still
    there), its facts are never served again, and what is left (stale facts, segments still holding erased KV) is
    recorded for the upkeep (``Store.writes.defer_compaction``; ``Memory.reencode_pending``), counted in ``deferred``.

    Returns ``{"version", "erased": n facts, "turns": n turns, "reencoded": n, "deferred": n}``."""
    segments, n = set(job.segments), 0
    try:
        if job.stale and defer_s is None:
            n, old = reencode_stale(lm(), store, user)  # and any a concurrent write left behind erased text
            segments |= set(old)
        if segments:
            version = store.writes.compact(user, sorted(segments))
    except Exception as exc:  # the erasure landed: the rest is the upkeep's
        logger.warning("erasure of %r landed; its re-encoding and rewrite are left to the upkeep (%s)", user, exc)
        try:
            store.writes.defer_compaction(user)
        except Exception as again:  # the database too: the next erasure of the user, or fsck, finds it
            logger.warning("erasure of %r: cannot record its deferred rewrite (%s)", user, again)
    return {
        "version": version,
        "erased": len(job.erased),
        "turns": job.turns_erased,
        "reencoded": n,
        "deferred": len(job.stale) - n,
    }
