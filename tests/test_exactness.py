"""KV injection == prompt injection in fp32 on tiny random models (paper Theorems 3, 6, 8)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids, tiny_model
from kvmem.compose import compose_raw
from kvmem.encode import encode_spans
from kvmem.engines.hf import HFEngine
from kvmem.exactness import REL_TOL, check_joint, check_relocated_keys, check_window, run_all
from kvmem.rope import Rotary

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_joint_injection_matches_prompt(family):
    model = tiny_model(family)
    memory, query = random_ids(120, seed=1), random_ids(9, seed=2)
    r = check_joint(model, memory, query, steps=20)
    assert r["rel_logit_diff"] <= REL_TOL
    assert r["max_rel_logit_diff_all_steps"] <= REL_TOL
    assert r["kv_tokens"] == r["prompt_tokens"] and len(r["kv_tokens"]) == 20
    assert len(set(r["kv_tokens"])) > 1, "degenerate greedy path would make the token check vacuous"
    assert r["prefilled_kv"] == len(query) and r["prefilled_prompt"] == len(memory) + len(query)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("start", [1, 37, 500])
def test_relocated_injection_matches_shifted_prefill(family, start):
    model = tiny_model(family)
    memory, query = random_ids(80, seed=3), random_ids(7, seed=4)
    r = check_joint(model, memory, query, steps=20, start=start)
    assert r["max_rel_logit_diff_all_steps"] <= REL_TOL and r["kv_tokens"] == r["prompt_tokens"]
    keys = check_relocated_keys(model, memory, start)
    assert keys["rel_key_diff_rotation"] <= 1e-6 and keys["rel_key_diff_stored"] <= REL_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_context_window_slice_matches_plain_prefill(family):
    model = tiny_model(family)
    header, window, fact = random_ids(12, seed=5), random_ids(40, seed=6), random_ids(15, seed=7)
    r = check_window(model, header, window, fact, distractors=[random_ids(n, seed=n) for n in (5, 30, 90)])
    assert r["rel_key_diff"] <= REL_TOL and r["rel_value_diff"] <= REL_TOL


def test_chunked_composition_equals_prefill_of_the_joint_encoding_only_when_joint():
    """Independently encoded facts are NOT the joint prefill: composing them must differ measurably from
    prompt injection (they never attended to each other), while the joint encoding matches exactly."""
    model = tiny_model("llama")
    header, f1, f2, query = (
        random_ids(10, seed=8),
        random_ids(20, seed=9),
        random_ids(20, seed=10),
        random_ids(6, seed=11),
    )
    kvs = encode_spans(model, [header, header + f1, header + f2], [(0, 10), (10, 30), (10, 30)])
    keys = torch.cat([kvs[0].keys, kvs[1].keys, kvs[2].keys], dim=2)
    values = torch.cat([kvs[0].values, kvs[1].values, kvs[2].values], dim=2)
    memory = compose_raw(Rotary.for_model(model), header + f1 + f2, keys, values)
    engine = HFEngine(model, eos_token_ids=[])
    a = engine.run(query, memory, "kv", 1)
    b = engine.run(query, memory, "prompt", 1)
    assert (a.first_logits - b.first_logits).abs().max() > 1e-3


def test_random_kv_changes_output():
    """Control: the injected cache is really read (random K/V must change the logits)."""
    model = tiny_model("qwen2")
    memory, query = random_ids(60, seed=12), random_ids(6, seed=13)
    (kv,) = encode_spans(model, [memory], [(0, 60)])
    engine = HFEngine(model, eos_token_ids=[])
    good = engine.run(query, compose_raw(Rotary.for_model(model), memory, kv.keys, kv.values), "kv", 1)
    noise = compose_raw(Rotary.for_model(model), memory, torch.randn_like(kv.keys), torch.randn_like(kv.values))
    bad = engine.run(query, noise, "kv", 1)
    ref = engine.run(query, compose_raw(Rotary.for_model(model), memory, kv.keys, kv.values), "prompt", 1)
    assert (good.first_logits - ref.first_logits).abs().max() <= REL_TOL * ref.first_logits.abs().max()
    assert (bad.first_logits - ref.first_logits).abs().max() > 1e-2


def test_run_all_report_passes_on_tiny_llama():
    model = tiny_model("llama")
    facts = [random_ids(12, seed=20 + i) for i in range(6)]
    report = run_all(model, random_ids(10, seed=19), facts, random_ids(30, seed=30), random_ids(8, seed=31))
    assert report["passed"] is True
    assert report["memory_tokens"] == 10 + 6 * 12


def test_off_by_one_rotation_fails_the_bound():
    """Control for the 1e-5 bound: keys rotated one position too far (start + 1, the query where it belongs)
    must fail it, so the exactness checks can see a position bug."""
    from kvmem.compose import ComposedMemory

    model = tiny_model("llama")
    memory, query = random_ids(60, seed=14), random_ids(6, seed=15)
    (kv,) = encode_spans(model, [memory], [(0, 60)])
    rot = Rotary.for_model(model)
    engine = HFEngine(model, eos_token_ids=[])
    ref = engine.run(query, compose_raw(rot, memory, kv.keys, kv.values), "prompt", 1).first_logits
    good = engine.run(query, compose_raw(rot, memory, kv.keys, kv.values), "kv", 1).first_logits
    shifted = compose_raw(rot, memory, kv.keys, kv.values, start=1)
    off = engine.run(query, ComposedMemory(memory, [], 0, shifted.keys, shifted.values), "kv", 1).first_logits
    bound = REL_TOL * ref.abs().max()
    assert (good - ref).abs().max() <= bound
    assert (off - ref).abs().max() > 10 * bound
