"""What the engine fixes at start for both connector sides: the settings, the engine's identity, and what is refused.

``Settings`` is read from ``kv_connector_extra_config`` (written by ``engine.engine_kwargs``); each side gets one
at construction. Imports nothing of vLLM at import time (only ``native_rotary`` asks vLLM which platform it runs
on): its configuration arrives as an argument.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...models import MANIFEST, is_latent, kv_identity, weights_hash
from ...rope import LENGTH_DEPENDENT, rope_type
from ...store import canonical
from ..registry import latent_refusal


@dataclass(frozen=True)
class Settings:
    """The connector's settings, the same on both sides.

    stores: the store directories (or folders holding stores) this engine may inject from, canonical.
    identity: the engine model's side of the store fingerprint (``engine_identity``); a store whose fingerprint
        differs in any of these keys is not injected.
    metrics_file: where the scheduler side writes its counters (and the worker side ``.loads`` and ``.worker``).
    async_load: loads run asynchronously (vLLM's ``load_kv_async``); False: inside the step that needs them.
    profile: the worker writes each load's stages to ``<metrics_file>.loads``.
    load_delay_s: ``{user: seconds}`` added to each read of that user's memory (a slow store, for tests).
    cache_bytes, cache_dir: each process's store read cache bound (bytes) and its disk cache of remote segments.
    """

    stores: tuple[str, ...] = ()
    identity: Mapping[str, object] = field(default_factory=dict)
    metrics_file: str | None = None
    async_load: bool = True
    profile: bool = False
    load_delay_s: Mapping[str, float] = field(default_factory=dict)
    cache_bytes: int | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        set_ = object.__setattr__  # a frozen dataclass normalises its own fields this way
        set_(self, "stores", tuple(canonical(p) for p in self.stores))
        set_(self, "identity", dict(self.identity))
        set_(self, "load_delay_s", {str(u): float(s) for u, s in self.load_delay_s.items()})

    @classmethod
    def of(cls, vllm_config) -> Settings:
        """The settings vLLM's config carries (``kv_transfer_config.kv_connector_extra_config``), with the engine's
        identity."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return cls(
            stores=tuple(extra.get("stores") or ()),
            identity=engine_identity(vllm_config),
            metrics_file=extra.get("metrics_file"),
            async_load=bool(extra.get("async_load", True)),
            profile=bool(extra.get("profile", False)),
            load_delay_s=extra.get("load_delay_s") or {},
            cache_bytes=int(extra["cache_bytes"]) if extra.get("cache_bytes") else None,
            cache_dir=str(extra["cache_dir"]) if extra.get("cache_dir") else None,
        )


def engine_identity(vllm_config) -> dict:
    """The engine model's side of the store fingerprint: weights hash, dtype and KV shapes."""
    mc = vllm_config.model_config
    folder = Path(mc.model)
    manifest = folder / MANIFEST
    weights = json.loads(manifest.read_text())["weights_sha256"] if manifest.exists() else weights_hash(folder)
    cfg = getattr(mc.hf_config, "text_config", None) or mc.hf_config
    return {
        "weights_sha256": weights,
        "dtype": str(mc.dtype).removeprefix("torch."),
        **kv_identity(cfg),
    }


NATIVE_ROTARY = "-rotary_embedding"  # vLLM's custom_ops entry that turns its rotary kernel off (PyTorch instead)
CPU_ROTARY = (
    "on a CPU, vLLM's rotary kernel (torch.ops._C.rotary_embedding, from RotaryEmbedding.forward_cpu) rotates "
    "DeepSeek's strided k_pe and its multi-head q_pe wrongly, so vLLM's own prefill is not the model's; start "
    f"vLLM with compilation_config={{'custom_ops': ['{NATIVE_ROTARY}']}} (kvmem's engine does)"
)


def native_rotary(vllm_config) -> bool:
    """Whether vLLM rotates with its PyTorch rotary (``forward_native``) where its kernel is wrong: on an
    accelerator always; on a CPU only with ``custom_ops`` holding ``-rotary_embedding`` (or ``none``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    ops = list(getattr(vllm_config.compilation_config, "custom_ops", None) or [])
    return NATIVE_ROTARY in ops or ("none" in ops and "+rotary_embedding" not in ops)


def check_engine_config(vllm_config, kv_cache_config=None) -> None:
    """Refuse, with one clear error (ValueError) at engine start, what the connector does not implement: tensor or
    pipeline parallelism > 1, fp8 KV caches, more than one KV-cache group, latent attention where the registry
    says vLLM cannot take it (``registry.latent_refusal``) or on a CPU with vLLM's rotary kernel (``CPU_ROTARY``),
    and length-dependent RoPE (keys rotated for one served length would enter the
    prefix cache and be reused at another)."""
    par = vllm_config.parallel_config
    if getattr(par, "tensor_parallel_size", 1) > 1 or getattr(par, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvmem connector: tensor/pipeline parallelism > 1 is not supported yet")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype.startswith("fp8"):
        raise ValueError(
            f"kvmem connector: kv_cache_dtype={cache_dtype!r} is not supported yet (its scale would "
            f"be skipped); use the model dtype"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(
            f"kvmem connector: {len(groups)} KV-cache groups (hybrid/sliding-window manager) are not supported yet"
        )
    cfg = vllm_config.model_config.hf_config
    latent = is_latent(getattr(cfg, "text_config", None) or cfg)
    why = latent_refusal("vllm") if latent else None
    if why:
        raise ValueError(f"kvmem connector: {why}")
    if latent and not native_rotary(vllm_config):
        raise ValueError(f"kvmem connector: {CPU_ROTARY}")
    rt = rope_type(getattr(cfg, "text_config", None) or cfg)
    if any(x in rt for x in LENGTH_DEPENDENT):
        raise ValueError(
            f"kvmem connector: RoPE scaling {rt!r} depends on the served length, and injected blocks "
            f"enter vLLM's prefix cache keyed by tokens only; use the transformers engine (--engine hf)"
        )
