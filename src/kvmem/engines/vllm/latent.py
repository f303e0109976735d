"""The connector's write of latent attention memory (MLA: DeepSeek V2 / V3) into vLLM's MLA paged cache.

vLLM's MLA cache holds, per layer and token, one row ``[c_kv | k_pe]`` (``kv_lora_rank + qk_rope_head_dim``
channels, ``k_pe`` rotated) written by the MLA backend's ``impl.do_kv_cache_update(kv_c_normed, k_pe, kv_cache,
slot_mapping, kv_cache_dtype, k_scale)`` with ``slot = block_id * block_size + offset`` (on a CPU,
``v1/attention/backends/mla/cpu_mla.py``: a plain [blocks * block_size, W] row store). kvmem's store holds the
latent row ``[k_pe | c_kv]`` with ``k_pe`` pre-RoPE (``models.split_latent``). vLLM rotates ``k_pe`` with its own
rotary (``model_executor/models/deepseek_v2.py`` ``DeepseekV2MLAAttention``: ``get_rope(qk_rope_head_dim, ...,
is_neox_style=False)``, GPT-J pairs in the projection's own channel order, YaRN as ``deepseek_yarn`` with its
``mscale`` in the cos/sin cache), whatever transformers' ``rope_interleave`` says; the same module, taken from
vLLM's rotary cache with the model's arguments, rotates the memory's ``k_pe`` here, so the cache holds exactly
what vLLM's prefill of those tokens writes. On a CPU that holds only where vLLM's prefill rotates with that
module's PyTorch ``forward_native`` too (``config.CPU_ROTARY``: its CPU kernel is wrong for this call).
"""

from __future__ import annotations

import time

import torch


def vllm_rotary(vllm_config, cfg) -> torch.nn.Module:
    """vLLM's rotary module for ``cfg``'s MLA ``k_pe``, built (or found in ``get_rope``'s cache) with the arguments
    ``DeepseekV2MLAAttention`` gives it; its ``forward_native(positions [T], query [T, h, r], key [T, H, r])``
    returns the rotated ``(query, key)``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(cfg.rope_parameters)
    if params.get("rope_type", "default") != "default":  # the rename deepseek_v2.py makes (idempotent)
        params["rope_type"] = "deepseek_llama_scaling" if params.get("attention_factor") == 1.0 else "deepseek_yarn"
    with set_current_vllm_config(vllm_config):
        return get_rope(
            cfg.qk_rope_head_dim,
            max_position=getattr(cfg, "max_position_embeddings", 8192),
            rope_parameters=params,
            is_neox_style=False,
            dtype=vllm_config.model_config.dtype,
        )


@torch.inference_mode()
def write_latent(
    rotary: torch.nn.Module, cfg, memory, sl: slice, layers: list, slots: torch.Tensor, stages: dict
) -> None:
    """Tokens ``sl`` of the pre-RoPE composed ``memory`` (keys, values [L, 1, m, W/2], ``models.split_latent``'s
    halves) into each layer's MLA cache at ``slots`` [T]: ``c_kv`` as stored, ``k_pe`` rotated by ``rotary``
    (``vllm_rotary``) at the memory's positions, every layer in one call (the layers as its heads). ``layers``:
    (attention layer, its KV cache) per layer index, in order. ``stages`` gets ``rotate`` and ``block_write``
    (ms). Raises whatever the backend's cache update raises."""
    t0 = time.perf_counter()
    r = cfg.qk_rope_head_dim
    kv_cache0 = layers[0][1]
    device, dtype = kv_cache0.device, kv_cache0.dtype
    rows = torch.cat([memory.keys[:, 0, sl], memory.values[:, 0, sl]], dim=-1).to(device, dtype)  # [L, T, W]
    k_pe = rows[..., :r].transpose(0, 1).contiguous()  # [T, L, r]
    positions = memory.positions[sl].to(device)
    query = torch.zeros(k_pe.shape[0], 1, r, dtype=dtype, device=device)
    _, k_pe = rotary.forward_native(positions, query, k_pe)  # the rotation vLLM's prefill applies (config.CPU_ROTARY)
    t1 = time.perf_counter()
    for i, (layer, kv_cache) in enumerate(layers):
        c_kv, pe = rows[i, :, r:].contiguous(), k_pe[:, i : i + 1].contiguous()
        layer.impl.do_kv_cache_update(c_kv, pe, kv_cache, slots, layer.kv_cache_dtype, layer._k_scale)
    if device.type == "cuda":  # queued writes: done means written
        torch.cuda.current_stream(device).synchronize()
    stages["rotate"], stages["block_write"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
