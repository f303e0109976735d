"""``Memory.from_config``: Mem0's config shape (mem0ai 2.2.1's ``MemoryConfig``) or kvmem's own, as keyword
arguments of ``Memory``.

What maps (anything else is refused by name, with the kvmem equivalent):

* ``llm``: an OpenAI-compatible provider (``openai``, ``vllm``, ``lmstudio``, ``litellm``, ``deepseek``, ``xai``,
  ``together``, ``groq``) becomes the extractor endpoint ``{"base_url", "model", "api_key"}``; provider
  ``kvmem`` is the local answer model (the default).
* ``embedder``: ``huggingface`` (or ``kvmem``) with kvmem's embedder, ``all-MiniLM-L6-v2``; any other is refused:
  the store's embeddings are that model's.
* ``vector_store``: ``kvmem`` or ``faiss`` with ``path`` (a store directory) or ``url`` (a store URL) and
  ``segments_url``; kvmem searches with FAISS over its own store.
* ``custom_instructions``: the default ``prompt`` of ``add``; ``version``: ``v1.1`` only.
"""

from __future__ import annotations

import os

KVMEM_KEYS = {
    "store",
    "model",
    "window",
    "neighbours",
    "history",
    "extractor",
    "dtype",
    "segments_url",
    "kv_format",
    "hybrid",
}
MEM0_KEYS = {"vector_store", "llm", "embedder", "history_db_path", "reranker", "version", "custom_instructions"}
OPENAI_COMPATIBLE = {
    "openai": ("openai_base_url", "https://api.openai.com/v1", "OPENAI_API_KEY"),
    "vllm": ("vllm_base_url", "http://localhost:8000/v1", "VLLM_API_KEY"),
    "lmstudio": ("lmstudio_base_url", "http://localhost:1234/v1", "LM_STUDIO_API_KEY"),
    "litellm": ("base_url", None, "LITELLM_API_KEY"),
    "deepseek": ("deepseek_base_url", "https://api.deepseek.com/v1", "DEEPSEEK_API_KEY"),
    "xai": ("xai_base_url", "https://api.x.ai/v1", "XAI_API_KEY"),
    "together": ("base_url", "https://api.together.xyz/v1", "TOGETHER_API_KEY"),
    "groq": ("base_url", "https://api.groq.com/openai/v1", "GROQ_API_KEY"),
}
EMBEDDERS = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}


def _section(config: dict, name: str) -> tuple[str, dict]:
    sec = config[name]
    if not isinstance(sec, dict) or not isinstance(sec.get("provider", ""), str):
        raise ValueError(f"config {name!r} must be an object with 'provider' and 'config'")
    unknown = set(sec) - {"provider", "config"}
    if unknown:
        raise ValueError(f"config {name!r}: unknown keys {', '.join(sorted(unknown))}")
    inner = sec.get("config") or {}
    if not isinstance(inner, dict):
        raise ValueError(f"config {name!r}.config must be an object")
    return sec.get("provider", "kvmem"), inner


def _llm(config: dict) -> dict | None:
    provider, c = _section(config, "llm")
    if provider == "kvmem":
        return None
    if provider not in OPENAI_COMPATIBLE:
        raise ValueError(
            f"llm provider {provider!r} is not supported: kvmem extracts with its own answer model (provider "
            f"'kvmem') or an OpenAI-compatible endpoint ({', '.join(sorted(OPENAI_COMPATIBLE))})"
        )
    url_key, default_url, key_env = OPENAI_COMPATIBLE[provider]
    base_url = c.get(url_key) or c.get("base_url") or os.environ.get("OPENAI_BASE_URL" if provider == "openai" else "")
    base_url = base_url or default_url
    if not base_url or not c.get("model"):
        raise ValueError(f"llm provider {provider!r} needs config 'model' and '{url_key}'")
    return {"base_url": base_url, "model": c["model"], "api_key": c.get("api_key") or os.environ.get(key_env, "none")}


def _embedder(config: dict) -> None:
    provider, c = _section(config, "embedder")
    model = c.get("model", "all-MiniLM-L6-v2")
    if provider not in ("huggingface", "kvmem") or model not in EMBEDDERS:
        raise ValueError(
            f"embedder {provider}/{model} is not supported: kvmem's stores are searched with the "
            "all-MiniLM-L6-v2 sentence-transformers embedder (provider 'huggingface', shipped offline); "
            "leave 'embedder' out"
        )


def _vector_store(config: dict) -> dict:
    provider, c = _section(config, "vector_store")
    if provider not in ("kvmem", "faiss"):
        raise ValueError(
            f"vector_store provider {provider!r} is not supported: kvmem keeps embeddings and KV in its own store "
            "(provider 'kvmem' with 'path': a directory, or 'url': postgresql://..., and 'segments_url' for "
            "a shared store)"
        )
    unknown = set(c) - {"path", "url", "segments_url", "collection_name", "embedding_model_dims", "distance_strategy"}
    if unknown:
        raise ValueError(f"vector_store config: unknown keys {', '.join(sorted(unknown))}")
    if c.get("distance_strategy", "cosine") != "cosine" or c.get("embedding_model_dims", 384) != 384:
        raise ValueError("vector_store: kvmem searches by cosine similarity over 384-dimensional embeddings")
    out = {}
    if c.get("path") or c.get("url"):
        out["store"] = c.get("url") or c["path"]
    if c.get("segments_url"):
        out["segments_url"] = c["segments_url"]
    return out


def config_kwargs(config: dict) -> dict:
    """``Memory`` keyword arguments for ``config``. Raises ValueError naming what is not supported."""
    if not isinstance(config, dict):
        raise ValueError("config must be an object (Mem0's MemoryConfig shape, or kvmem's)")
    unknown = set(config) - KVMEM_KEYS - MEM0_KEYS
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
    out = {k: config[k] for k in KVMEM_KEYS if config.get(k) is not None}
    if config.get("llm") is not None:
        if "extractor" in out:
            raise ValueError("config: give 'llm' or 'extractor', not both")
        out["extractor"] = _llm(config)
    if config.get("embedder") is not None:
        _embedder(config)
    if config.get("vector_store") is not None:
        vs = _vector_store(config)
        if "store" in vs and "store" in out:
            raise ValueError("config: give the store as 'store' or as vector_store's path, not both")
        out.update(vs)
    if config.get("reranker") is not None:
        raise ValueError("reranker is not supported by kvmem (no cross-encoder ships offline); leave it out")
    if config.get("history_db_path") is not None:
        raise ValueError("history_db_path is not used: kvmem keeps each memory's history in its store")
    if config.get("version", "v1.1") != "v1.1":
        raise ValueError("version: kvmem answers in Mem0's v1.1 shapes only")
    if config.get("custom_instructions") is not None:
        out["custom_instructions"] = config["custom_instructions"]
    return out
