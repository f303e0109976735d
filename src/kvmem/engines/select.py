"""The one place engines are built: which engine runs here, the answer model it needs, and its start-up.

``open_engine`` resolves ``--engine`` (``auto``: vLLM where it runs, else transformers, with a one-line note),
loads the answer model (with its weights only where this process computes with them: the transformers engine;
vLLM loads its own) and starts the engine in the synchronous (``Engine``) or the concurrent (``AsyncEngine``)
role. Everything else receives the engine and never asks which one it is: what an engine can do is declared in
``registry`` (which imports no engine), and checked by the service (``service.check_methods``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..hardware import resolve_engine
from ..models import REGISTRY, LoadedModel, is_latent, load, model_dir, stop_token_ids
from ..settings import KV_CACHE_BYTES, MAX_QUEUE
from .base import AsyncEngine, Engine, EngineUnavailable
from .registry import latent_refusal

VLLM_MAX_MODEL_LEN = 32768  # vLLM's context is capped here (and then to what its KV cache holds)


@dataclass
class Opened:
    """What ``open_engine`` started: the answer model (``lm``: tokenizer, config, fingerprint; weights only for
    the transformers engine), the engine, and ``note``: why ``auto`` fell back to transformers (None otherwise)."""

    lm: LoadedModel
    engine: Engine | AsyncEngine
    note: str | None = None


def open_engine(
    model: str | LoadedModel,
    engine: str = "auto",
    dtype: str | None = None,
    *,
    serving: bool = False,
    stores: list[str | Path] = (),
    max_model_len: int | None = None,
    max_queue: int = MAX_QUEUE,
    kv_cache_memory_bytes: int = KV_CACHE_BYTES,
    metrics_file: str | None = None,
    pool=None,
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    vllm_options: dict | None = None,
) -> Opened:
    """Start the engine for ``model`` (registry name, folder, or a loaded model).

    ``engine``: auto | vllm | hf. ``serving``: the ``AsyncEngine`` role (the HTTP server) instead of ``Engine``.
    ``stores``: the store directories (or folders of stores) the vLLM connector may inject from, fixed at start.
    ``max_model_len``: context limit (default: the model's; vLLM lowers it to what its KV cache holds).
    ``max_queue``: requests waiting at most (serving). ``kv_cache_memory_bytes``, ``metrics_file`` and
    ``vllm_options``: vLLM's KV cache, the connector's counters file, other ``VLLMEngine`` arguments. ``pool``:
    the one-thread executor the transformers engine shares with other work on its model (serving).
    ``cache_bytes``: the LRU bound of the vLLM worker's store caches (its own process); ``cache_dir``: its disk
    cache of segments in an object store.

    Raises EngineUnavailable (``engine="vllm"`` where it cannot run or start, or for a latent-attention model),
    ModelError (not installed), ValueError (unknown engine or dtype).
    """
    name, note = resolve_engine(engine)
    if name == "vllm":
        lm = model if isinstance(model, LoadedModel) else load(model, dtype=dtype, weights=False)
        try:
            why = latent_refusal("vllm") if is_latent(lm.config) else None
            if why:
                raise EngineUnavailable(why)
            return Opened(
                lm,
                _vllm(
                    lm,
                    serving,
                    stores,
                    max_model_len,
                    max_queue,
                    kv_cache_memory_bytes,
                    metrics_file,
                    {"cache_bytes": cache_bytes, "cache_dir": cache_dir, **(vllm_options or {})},
                ),
                note,
            )
        except EngineUnavailable as exc:
            if engine not in (None, "auto"):
                raise
            note = f"note: using the transformers engine: {exc}"
            model = lm.name if lm.model.device.type == "meta" else lm
    lm = (
        model
        if isinstance(model, LoadedModel) and model.model.device.type != "meta"
        else load(model.name if isinstance(model, LoadedModel) else model, dtype=dtype)
    )
    return Opened(lm, _hf(lm, serving, max_model_len, max_queue, pool), note)


def engine_name(engine: str | None = "auto") -> str:
    """The engine ``open_engine`` starts for ``engine`` (auto | vllm | hf): ``auto`` as it resolves on this
    machine (it may still fall back to transformers if vLLM then fails to start)."""
    return resolve_engine(engine)[0] if engine in (None, "auto") else engine


def reference_engine(model, eos_token_ids: list[int] | None = None, tokenizer=None):
    """The transformers engine on a loaded ``torch`` model, in the ``Engine`` role: the exact reference the
    exactness checks and local fact extraction run on."""
    from .hf import HFEngine

    return HFEngine(model, eos_token_ids=eos_token_ids, tokenizer=tokenizer)


def _hf(lm: LoadedModel, serving: bool, max_model_len: int | None, max_queue: int, pool):
    from .hf import AsyncHFEngine, HFEngine  # transformers: imported where this engine runs

    eng = HFEngine(
        lm.model,
        eos_token_ids=stop_token_ids(lm),
        max_model_len=max_model_len or lm.max_context,
        tokenizer=lm.tokenizer,
    )
    return AsyncHFEngine(eng, max_queue=max_queue, pool=pool) if serving else eng


def _vllm(
    lm: LoadedModel,
    serving: bool,
    stores,
    max_model_len: int | None,
    max_queue: int,
    kv_cache_memory_bytes: int,
    metrics_file: str | None,
    options: dict,
):
    try:  # vLLM imports in ~5 s: only where it is the engine
        from .vllm.engine import AsyncVLLMEngine, VLLMEngine
    except ImportError as exc:
        raise EngineUnavailable(f"vLLM does not import ({type(exc).__name__}: {exc})") from exc

    path = model_dir(lm.name) if lm.name in REGISTRY else lm.name
    opts = {
        "dtype": str(lm.dtype).removeprefix("torch."),
        "stores": list(stores),
        "max_model_len": min(max_model_len or lm.max_context, VLLM_MAX_MODEL_LEN),
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "metrics_file": metrics_file,
        **options,
    }
    return AsyncVLLMEngine(path, max_queue=max_queue, **opts) if serving else VLLMEngine(path, **opts)
