"""Query-aware selective recompute (transformers engine): the query picks the fact tokens it attends
to most and their K/V are recomputed on top of the injected cache. In fp32: recomputing every fact token turns
per-fact encoded KV into exactly a prefill of the whole memory; a partial recompute changes the selected tokens'
K/V and nothing else; the selection depends on the query; end to end, kv-sel100 answers with prompt injection's
logits while kv-sel20 prefills 2 x query + 20% of the fact tokens."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from conftest import random_ids, tiny_model
from kvmem.compose import compose_raw
from kvmem.encode import encode_spans
from kvmem.engines.hf import build_cache, selective_recompute, use_gqa_sdpa
from kvmem.rope import Rotary


def _memory(model, header, facts):
    """[header][facts...] with each fact encoded behind the header alone (what the store holds at w=0)."""
    kvs = encode_spans(model, [header + f for f in facts], [(len(header), len(header) + len(f)) for f in facts])
    (hkv,) = encode_spans(model, [header], [(0, len(header))])
    keys = torch.cat([hkv.keys] + [kv.keys for kv in kvs], dim=2)
    values = torch.cat([hkv.values] + [kv.values for kv in kvs], dim=2)
    ids = header + [t for f in facts for t in f]
    return compose_raw(Rotary.for_model(model), ids, keys, values)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("qwen2")
    model.set_attn_implementation("sdpa")
    use_gqa_sdpa(model)
    header, facts = random_ids(6, seed=10), [random_ids(n, seed=20 + n) for n in (9, 14, 7, 11)]
    return model, header, facts, _memory(model, header, facts)


def test_full_recompute_is_a_prefill_of_the_memory(tiny):
    model, header, facts, memory = tiny
    cache, sel, run = selective_recompute(model, memory, random_ids(5, seed=3), 1.0, header_len=len(header))
    assert sel.tolist() == list(range(len(header), len(memory))) and run == 5 + len(memory) - len(header)
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([memory.token_ids]), past_key_values=ref, use_cache=True)
    plain = build_cache(model, memory)
    for layer, (a, b, p) in enumerate(zip(cache.layers, ref.layers, plain.layers)):
        assert a.keys.shape == b.keys.shape  # the probe's query K/V were dropped
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        if layer > 0:  # per-fact encoding really differs from the prefill beyond layer 0
            assert (p.values - b.values).abs().max() > 1e-3


def test_partial_recompute_changes_only_the_selected_tokens(tiny):
    model, header, facts, memory = tiny
    n_fact = len(memory) - len(header)
    query = random_ids(5, seed=3)
    cache, sel, run = selective_recompute(model, memory, query, 0.25, header_len=len(header))
    assert len(sel) == math.ceil(0.25 * n_fact) and run == len(query) + len(sel)
    assert sel.min() >= len(header) and sel.tolist() == sorted(set(sel.tolist()))
    plain = build_cache(model, memory)
    rest = torch.ones(len(memory), dtype=torch.bool)
    rest[sel] = False
    # the first fact was encoded behind the header alone, exactly its context here: recomputing it may change
    # nothing; every later fact's selected tokens now see the facts before them
    later = sel[sel >= len(header) + len(facts[0])]
    assert len(later) > 0
    for layer, (a, p) in enumerate(zip(cache.layers, plain.layers)):
        assert torch.equal(a.values[:, :, rest], p.values[:, :, rest])  # the rest, header included, untouched
        assert torch.equal(a.keys[:, :, rest], p.keys[:, :, rest])
        if layer > 0:
            assert (a.values[:, :, later] - p.values[:, :, later]).abs().amax(dim=(0, 1, 3)).min() > 0
    # query-aware: another query picks other tokens
    other = selective_recompute(model, memory, random_ids(5, seed=99, vocab=200), 0.25, len(header))[1]
    assert other.tolist() != sel.tolist()
    with pytest.raises(ValueError, match="fraction"):
        selective_recompute(model, memory, query, 0.0, len(header))


def test_one_kv_head_and_a_shifted_memory():
    """Multi-query attention (one KV head) and a memory that starts at position 13: still a prefill."""
    model = tiny_model("llama", common={"num_key_value_heads": 1})
    model.set_attn_implementation("sdpa")
    use_gqa_sdpa(model)
    header, facts = random_ids(5, seed=11), [random_ids(n, seed=40 + n) for n in (8, 6)]
    kvs = encode_spans(model, [header + f for f in facts], [(len(header), len(header) + len(f)) for f in facts])
    (hkv,) = encode_spans(model, [header], [(0, len(header))])
    ids = header + [t for f in facts for t in f]
    memory = compose_raw(
        Rotary.for_model(model),
        ids,
        torch.cat([hkv.keys] + [kv.keys for kv in kvs], dim=2),
        torch.cat([hkv.values] + [kv.values for kv in kvs], dim=2),
        start=13,
    )
    cache, _, _ = selective_recompute(model, memory, [7], 1.0, header_len=0)
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(
            input_ids=torch.tensor([ids]),
            past_key_values=ref,
            use_cache=True,
            position_ids=torch.arange(13, 13 + len(ids))[None],
        )
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)


def test_dynamic_rope_recompute_uses_the_served_length():
    """Dynamic RoPE, memory (42 tokens) shorter than the original context (64) but memory + query (82) longer:
    the recomputed tokens take the served prompt's frequencies, so the cache equals a prefill of memory + query
    (transformers would otherwise reset to the base frequencies for the shorter recompute pass)."""
    from kvmem.rope import reset_rope_state
    from test_families import rope_parameters

    model = tiny_model("llama", rope_parameters=rope_parameters("dynamic"), common={"max_position_embeddings": 64})
    model.set_attn_implementation("sdpa")
    use_gqa_sdpa(model)
    header, facts, query = random_ids(6, seed=10), [random_ids(n, seed=20 + n) for n in (12, 14, 10)], random_ids(40)
    ids = header + [t for f in facts for t in f]
    served = len(ids) + len(query)
    kvs = encode_spans(
        model, [header + f for f in facts], [(len(header), len(header) + len(f)) for f in facts], served_len=served
    )
    (hkv,) = encode_spans(model, [header], [(0, len(header))], served_len=served)
    memory = compose_raw(
        Rotary.for_model(model),
        ids,
        torch.cat([hkv.keys] + [kv.keys for kv in kvs], dim=2),
        torch.cat([hkv.values] + [kv.values for kv in kvs], dim=2),
        served_len=served,
    )
    cache, _, _ = selective_recompute(model, memory, query, 1.0, header_len=len(header))
    reset_rope_state(model.model.rotary_emb)
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids + query]), past_key_values=ref, use_cache=True)
    ref.crop(len(ids))
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_fraction_rounding():
    """p% of n fact tokens is ceil(p * n / 100) exactly: 7% of 100 tokens is 7, not 8 (0.07 * 100 > 7 in floats)."""
    model = tiny_model("qwen2")
    model.set_attn_implementation("sdpa")
    use_gqa_sdpa(model)
    header, facts = random_ids(4, seed=1), [random_ids(50, seed=2), random_ids(50, seed=3)]
    memory = _memory(model, header, facts)
    for p in (7, 14, 28, 55):
        _, sel, run = selective_recompute(model, memory, [5, 6], p / 100, header_len=len(header))
        assert len(sel) == p and run == 2 + p


FAST = "smollm2-135m-instruct"


def test_kv_sel_end_to_end(tmp_path, monkeypatch):
    from kvmem.memory import Memory
    from kvmem.models import MANIFEST, load, model_dir
    from kvmem.retrieve import Embedder
    from kvmem.service import MemoryService

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    lm, emb = load(FAST, dtype="float32"), Embedder()
    mem = Memory(tmp_path / "s", model=lm, embedder=emb, window=0)
    for f in [
        "Maya moved to Lisbon in 2021.",
        "Maya's brother Tom is a pilot.",
        "Tom flies to Tokyo every month.",
        "Maya adopted a dog named Biscuit.",
    ]:
        mem.add(f, user_id="maya", infer=False)
    svc = MemoryService.open(tmp_path / "s", model=lm, embedder=emb, engine="hf")
    q = "Where does Maya's brother fly to?"
    out = {}
    for mode in ("prompt", "kv", "kv-sel100", "kv-sel20"):
        p = svc.prepare("maya", q, 4, mode, 8)
        (g,) = svc.engine.generate([p.request(svc.sampling(8))])
        out[mode] = (p, g)
    p, _ = out["kv"]
    n_fact = len(p.plan.token_ids) - len(p.plan.header_ids)
    torch.testing.assert_close(out["kv-sel100"][1].first_logits, out["prompt"][1].first_logits, rtol=1e-4, atol=1e-4)
    assert (out["kv"][1].first_logits - out["prompt"][1].first_logits).abs().max() > 1e-3
    assert (out["kv-sel20"][1].first_logits - out["kv"][1].first_logits).abs().max() > 1e-3
    assert out["kv-sel20"][1].prefilled_tokens == 2 * len(p.query_ids) + math.ceil(0.2 * n_fact)
    a = svc.ask("maya", q, 4, "kv-sel20", 8)
    assert a.mode == "kv" and a.prefilled_tokens == out["kv-sel20"][1].prefilled_tokens
    with pytest.raises(ValueError, match="do not combine"):
        svc.prepare("maya", q, 4, "kv-sel20", 8, tail_recompute=1)
    # the CLI refuses it off the transformers engine, before loading anything
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmem.cli",
            "ask",
            "--store",
            str(tmp_path / "s"),
            "--user",
            "maya",
            "--engine",
            "vllm",
            "--selective-recompute",
            "10",
            q,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "--engine hf" in r.stderr and "Traceback" not in r.stderr

    # --engine auto is refused only where it resolves to vLLM (as serve does), still before a model loads
    from typer.testing import CliRunner

    import kvmem.engines.select
    import kvmem.service
    from kvmem.cli import app

    class Reached(Exception):
        pass

    def service(*args, engine, **kwargs):
        raise Reached(engine)

    monkeypatch.setattr(kvmem.service.MemoryService, "open", service)
    args = [
        "ask",
        "--store",
        str(tmp_path / "s"),
        "--user",
        "maya",
        "--dtype",
        "float32",
        "--selective-recompute",
        "10",
        q,
    ]
    for resolved in ("vllm", "hf"):
        monkeypatch.setattr(kvmem.engines.select, "resolve_engine", lambda engine, facts=None, r=resolved: (r, None))
        res = CliRunner().invoke(app, args)
        if resolved == "vllm":
            assert res.exit_code == 2 and "--engine hf" in res.output
        else:  # accepted: reaches the service, on the transformers engine
            assert isinstance(res.exception, Reached), res.output
