"""Numerical exactness of KV injection against prompt injection (paper Theorems 3, 6 and 8).

Three checks, each returning plain numbers so the CLI can print them and tests can assert them:
  * joint:     memory encoded in one prefill, stored pre-RoPE, re-rotated at 0..m-1 and injected, vs prefilling
               the same tokens (Theorem 3), over ``steps`` greedy decode steps;
  * relocated: memory encoded at positions from 0, injected at virtual positions from d > 0, vs a plain prefill
               whose position_ids start at d (Theorem 6: only relative position matters);
  * window:    the fact slice kept by batched context-window encoding vs the same slice of a plain prefill
               of [header][window][fact] (Theorem 8).
Run in fp32: the tolerance is fp32 rounding, max |dlogit| <= 1e-5 x max |logit|.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .compose import compose_raw
from .encode import capture_kv, encode_spans
from .engines.select import reference_engine
from .models import from_cache
from .rope import Rotary

REL_TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.float() - b.float()).abs().max().item()
    return diff, diff / max(b.float().abs().max().item(), 1e-30)


def _cached(model, cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's cache layer in kvmem's stored form: rotated keys, values [1, H, T, D] (``models.from_cache``)."""
    return from_cache(model.config, cache.layers[layer].keys, cache.layers[layer].values)


def check_joint(model, memory_ids: list[int], query_ids: list[int], steps: int = 20, start: int = 0) -> dict:
    """Joint-encoded KV injection (at virtual positions from ``start``) vs prompt injection of the same ids."""
    served_len = start + len(memory_ids) + len(query_ids)
    (kv,) = encode_spans(model, [memory_ids], [(0, len(memory_ids))], served_len=served_len)
    memory = compose_raw(Rotary.for_model(model), memory_ids, kv.keys, kv.values, start=start, served_len=served_len)
    engine = reference_engine(model, eos_token_ids=[])
    a = engine.run(query_ids, memory, "kv", steps, keep_step_logits=True)
    b = engine.run(query_ids, memory, "prompt", steps, keep_step_logits=True)
    diffs = [_rel(x, y) for x, y in zip(a.step_logits, b.step_logits)]
    return {
        "max_abs_logit_diff": diffs[0][0],
        "rel_logit_diff": diffs[0][1],
        "max_rel_logit_diff_all_steps": max(d[1] for d in diffs),
        "greedy_match": a.token_ids == b.token_ids,
        "kv_tokens": a.token_ids,
        "prompt_tokens": b.token_ids,
        "prefilled_kv": a.prefilled_tokens,
        "prefilled_prompt": b.prefilled_tokens,
    }


@torch.inference_mode()
def check_relocated_keys(model, memory_ids: list[int], start: int) -> dict:
    """Keys at virtual positions ``start..`` vs the keys a plain prefill at those positions caches.

    ``rotation``: the prefill's own pre-RoPE keys rotated by ``Rotary`` (chunked RoPE alone, Theorem 6).
    ``stored``: keys stored from an encoding at positions 0.. and rotated to ``start..``; this adds the fp32
    rounding by which deeper layers' inputs differ between the two forwards.
    Only positions every layer still holds are compared (sliding-window layers keep their last window-1).
    """
    rotary = Rotary.for_model(model)
    positions = torch.arange(start, start + len(memory_ids))
    (stored,) = encode_spans(model, [memory_ids], [(0, len(memory_ids))])
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with capture_kv(model) as (own_keys, _):
        model(
            input_ids=torch.tensor([memory_ids], device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=positions.to(device)[None],
        )
        own = torch.stack([k[0] for k in own_keys])
    out = {}
    for name, keys in (("rotation", own), ("stored", stored.keys)):
        rotated = rotary.rotate_keys(keys, positions)
        worst = (0.0, 0.0)
        for layer in range(rotated.shape[0]):
            ref = _cached(model, cache, layer)[0][0]
            worst = max(worst, _rel(rotated[layer, :, -ref.shape[1] :], ref))
        out[f"max_abs_key_diff_{name}"], out[f"rel_key_diff_{name}"] = worst
    return out


@torch.inference_mode()
def check_window(
    model, header_ids: list[int], window_ids: list[int], fact_ids: list[int], distractors: list[list[int]] = ()
) -> dict:
    """Context-window slice from batched ``encode_spans`` vs a plain prefill of [header][window][fact].

    ``distractors`` are encoded in the same batch so padding and batching are exercised."""
    seq = header_ids + window_ids + fact_ids
    s = len(header_ids) + len(window_ids)
    seqs = [seq] + [list(d) for d in distractors]
    spans = [(s, len(seq))] + [(0, len(d)) for d in distractors]
    kv = encode_spans(model, seqs, spans)[0]
    rotated = Rotary.for_model(model).rotate_keys(kv.keys, torch.arange(s, len(seq)))
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    model(input_ids=torch.tensor([seq], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    n = len(fact_ids)
    k_worst, v_worst = (0.0, 0.0), (0.0, 0.0)
    for layer in range(rotated.shape[0]):
        keys, values = _cached(model, cache, layer)
        k_worst = max(k_worst, _rel(rotated[layer], keys[0, :, -n:]))
        v_worst = max(v_worst, _rel(kv.values[layer], values[0, :, -n:]))
    return {
        "max_abs_key_diff": k_worst[0],
        "rel_key_diff": k_worst[1],
        "max_abs_value_diff": v_worst[0],
        "rel_value_diff": v_worst[1],
    }


def run_all(
    model,
    header_ids: list[int],
    fact_ids: list[list[int]],
    window_ids: list[int],
    query_ids: list[int],
    start: int = 37,
    steps: int = 20,
) -> dict:
    """The report printed by ``kvmem check-exactness``; ``passed`` applies the fp32 tolerance."""
    memory_ids = list(header_ids) + [t for f in fact_ids for t in f]
    joint = check_joint(model, memory_ids, query_ids, steps)
    reloc = check_joint(model, memory_ids, query_ids, steps, start=start)
    keys = check_relocated_keys(model, memory_ids, start)
    win = check_window(model, header_ids, window_ids, fact_ids[-1], distractors=fact_ids[:-1])
    report = {
        "memory_tokens": len(memory_ids),
        "query_tokens": len(query_ids),
        "max_abs_logit_diff_joint": joint["max_abs_logit_diff"],
        "rel_logit_diff_joint": joint["max_rel_logit_diff_all_steps"],
        "greedy_match_joint": joint["greedy_match"],
        "relocation_start": start,
        "max_abs_logit_diff_relocated": reloc["max_abs_logit_diff"],
        "rel_logit_diff_relocated": reloc["max_rel_logit_diff_all_steps"],
        "greedy_match_relocated": reloc["greedy_match"],
        "max_abs_key_diff_relocated": keys["max_abs_key_diff_stored"],
        "rel_key_diff_relocated": keys["rel_key_diff_stored"],
        "rel_key_diff_rotation_only": keys["rel_key_diff_rotation"],
        "max_abs_key_diff_window": win["max_abs_key_diff"],
        "rel_key_diff_window": win["rel_key_diff"],
        "max_abs_value_diff_window": win["max_abs_value_diff"],
        "tolerance_rel": REL_TOL,
    }
    report["passed"] = bool(
        report["rel_logit_diff_joint"] <= REL_TOL
        and report["greedy_match_joint"]
        and report["rel_logit_diff_relocated"] <= REL_TOL
        and report["greedy_match_relocated"]
        and keys["rel_key_diff_rotation"] <= REL_TOL
        and win["rel_key_diff"] <= REL_TOL
        and win["rel_value_diff"] <= REL_TOL
    )
    return report
