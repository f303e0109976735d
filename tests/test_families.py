"""Model coverage: every supported RoPE family and scaling type is exact; unsupported architectures are refused.

fp32, tiny random models built here (no downloads). Memory lengths exceed the scaled models'
``original_max_position_embeddings`` (64) so length-dependent RoPE really switches frequencies, and exceed
Gemma's sliding window (24) so both window and global layers are exercised. Latent attention (DeepSeek V2 / V3)
is stored as its latent row [k_pe | c_kv] (``models.split_latent``): V2 without ``q_lora_rank`` (complex
rotation), V3 with it (interleaved rotation), V3 without it under YaRN with ``mscale`` and half-split rotation;
each has a dense first layer and MoE layers after it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import random_ids, tiny_model
from kvmem.exactness import REL_TOL, check_joint, check_relocated_keys, check_window
from kvmem.models import ModelError, check_injectable


def rope_parameters(kind: str, rotary_half: int = 8) -> dict:
    base = {"rope_theta": 10000.0}
    return {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "longrope": {
            "rope_type": "longrope",
            "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
        },
    }[kind] | base


CASES = {
    "llama": dict(),
    "llama-linear": dict(rope_parameters=rope_parameters("linear")),
    "llama-dynamic": dict(rope_parameters=rope_parameters("dynamic"), common={"max_position_embeddings": 64}),
    "llama-yarn": dict(rope_parameters=rope_parameters("yarn")),
    "llama-llama3": dict(rope_parameters=rope_parameters("llama3")),
    "mistral": dict(),
    "qwen2": dict(),
    "qwen3": dict(),
    "phi3": dict(),
    "phi3-partial-longrope": dict(
        partial_rotary_factor=0.5,
        rope_parameters=rope_parameters("longrope", rotary_half=4),
        common={"max_position_embeddings": 4096},
    ),
    "gemma2": dict(),
    "gemma3": dict(),
    "deepseek_v2": dict(q_lora_rank=None),
    "deepseek_v3": dict(),
    "deepseek_v3-yarn": dict(
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters=rope_parameters("yarn") | {"mscale": 1.0, "mscale_all_dim": 1.0},
        common={"max_position_embeddings": 256},
    ),
}
LATENT = [c for c in CASES if c.startswith("deepseek")]


def _model(case: str):
    family = case.split("-")[0]
    kw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CASES[case].items()}
    return tiny_model(family, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_joint_exact(case):
    model = _model(case)
    memory, query = random_ids(110, seed=41), random_ids(9, seed=42)
    r = check_joint(model, memory, query, steps=20)
    assert r["max_rel_logit_diff_all_steps"] <= REL_TOL, r["max_rel_logit_diff_all_steps"]
    assert r["kv_tokens"] == r["prompt_tokens"] and len(set(r["kv_tokens"])) > 1
    assert r["prefilled_kv"] == len(query)


@pytest.mark.parametrize("case", list(CASES))
def test_relocation_exact(case):
    model = _model(case)
    memory, query = random_ids(90, seed=43), random_ids(7, seed=44)
    r = check_joint(model, memory, query, steps=20, start=29)
    assert r["max_rel_logit_diff_all_steps"] <= REL_TOL and r["kv_tokens"] == r["prompt_tokens"]
    if "dynamic" not in case and "longrope" not in case:
        # Length-dependent types rotate with the served length's frequencies, not the memory's alone.
        keys = check_relocated_keys(model, memory, 29)
        assert keys["rel_key_diff_rotation"] <= 1e-6 and keys["rel_key_diff_stored"] <= REL_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_context_window_slice_exact(case):
    model = _model(case)
    r = check_window(
        model,
        random_ids(10, seed=45),
        random_ids(30, seed=46),
        random_ids(12, seed=47),
        distractors=[random_ids(n, seed=n) for n in (4, 20, 70)],
    )
    assert r["rel_key_diff"] <= REL_TOL and r["rel_value_diff"] <= REL_TOL


def test_gemma3_memory_longer_than_sliding_window_is_masked_like_prompt():
    """A fact beyond the sliding window is invisible to sliding layers in prompt injection; KV injection must
    match that exactly. Control: the same weights with every layer global give different logits, so the
    window is really in effect over this memory."""
    model = _model("gemma3")
    assert model.config.sliding_window == 24
    memory, query = random_ids(150, seed=48), random_ids(5, seed=49)
    r = check_joint(model, memory, query, steps=20)
    assert r["max_rel_logit_diff_all_steps"] <= REL_TOL and r["kv_tokens"] == r["prompt_tokens"]
    full = tiny_model("gemma3", layer_types=["full_attention"] * 4)
    full.load_state_dict(model.state_dict())
    assert check_joint(full, memory, query, steps=20)["max_rel_logit_diff_all_steps"] <= REL_TOL
    assert (_first_logits(model, memory, query) - _first_logits(full, memory, query)).abs().max() > 1e-3


def _first_logits(model, memory, query):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([memory + query]), logits_to_keep=1).logits[0, -1]


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda tf: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)), "absolute"),
        (lambda tf: tf.BloomForCausalLM(tf.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64)), "ALiBi"),
        (
            lambda tf: tf.MambaForCausalLM(tf.MambaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=64)),
            "recurrent",
        ),
        (
            lambda tf: tf.JambaForCausalLM(
                tf.JambaConfig(
                    num_hidden_layers=2,
                    hidden_size=32,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    intermediate_size=64,
                    vocab_size=64,
                    num_experts=2,
                    expert_layer_period=2,
                    attn_layer_period=2,
                    attn_layer_offset=1,
                    use_mamba_kernels=False,
                )
            ),
            "recurrent",
        ),
        (lambda tf: tf.DeepseekV3ForCausalLM(_deepseek_config(tf, kv_lora_rank=15)), "kv_lora_rank=15"),
    ],
)
def test_refuses_what_cannot_be_injected(make, needle):
    import transformers as tf

    with pytest.raises(ModelError, match=needle):
        check_injectable(make(tf))


def _deepseek_config(tf, **kw):
    return tf.DeepseekV3Config(
        **{
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "vocab_size": 64,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 2,
            "num_experts_per_tok": 1,
            "first_k_dense_replace": 1,
        }
        | kw
    )


def test_latent_attention_is_injectable_and_fingerprinted_by_its_layout():
    """DeepSeek V3 (formerly refused) is accepted; its fingerprint records the latent layout and the stored
    shape (one head of (kv_lora_rank + qk_rope_head_dim) / 2), so its stores are served to no other layout."""
    import transformers as tf

    from kvmem.models import LoadedModel, fingerprint, kv_shape

    model = tf.DeepseekV3ForCausalLM(_deepseek_config(tf))
    check_injectable(model)
    assert kv_shape(model.config) == (1, 12)
    fp = fingerprint(LoadedModel("d", model, None, False, "w"))
    assert fp["kv_layout"] == {"latent": "k_pe|c_kv", "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    assert (fp["num_kv_heads"], fp["head_dim"]) == (1, 12)
    wider = fingerprint(LoadedModel("d", tf.DeepseekV3ForCausalLM(_deepseek_config(tf, kv_lora_rank=24)), None, 0, "w"))
    assert wider["kv_layout"]["kv_lora_rank"] == 24 and wider["head_dim"] == 16
    llama = fingerprint(LoadedModel("l", tiny_model("llama"), None, False, "w"))
    assert "kv_layout" not in llama and (llama["num_kv_heads"], llama["head_dim"]) == (2, 16)


@pytest.mark.parametrize("case", [c for c in CASES if c not in LATENT])
def test_fused_rotation_is_the_familys_own(case):
    """The fused half-split rotation equals the family's ``apply_rotary_pos_emb`` on every family; partial rotary
    takes the family's function itself, and so does a family whose rotation is another form (interleaved pairs)."""
    from kvmem.rope import Rotary

    model = _model(case)
    rot = Rotary.for_model(model)
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    keys = torch.randn(L, H, 200, D)
    pos = torch.arange(7, 207)
    t = rot.layer_types[0]
    cos, sin = rot.cos_sin(pos, t, keys.dtype, keys.device)
    ref = rot.apply(keys[:1], keys, cos[None], sin[None])[1]
    assert rot._half_split(keys, cos, sin, t) == ("partial" not in case)
    assert torch.allclose(rot.rotate(keys, cos, sin, t), ref, rtol=1e-6, atol=1e-6)

    def interleaved(q, k, cos, sin):  # GPT-J style pairs (x0, x1), (x2, x3), ...: not the half-split form
        k2 = torch.stack([-k[..., 1::2], k[..., ::2]], -1).flatten(-2)
        return q, k * cos.unsqueeze(1) + k2 * sin.unsqueeze(1)

    if "partial" in case:
        return
    other = Rotary(model.config, rot.module, interleaved)
    assert not other._half_split(keys, cos, sin, t)
    assert torch.equal(other.rotate(keys, cos, sin, t), interleaved(None, keys, cos[None], sin[None])[1])


@pytest.mark.parametrize("case", LATENT)
def test_latent_rotation_is_the_familys_own(case):
    """Latent attention: chunked RoPE rotates only the first qk_rope_head_dim channels of the stored keys (k_pe)
    with the family's own rotation (V2's complex one, V3's interleaved or half-split one) and leaves the c_kv
    channels as they are; ``Rotary.from_config`` (the vLLM worker's, no weights) rotates identically."""
    from kvmem.models import kv_shape
    from kvmem.rope import Rotary

    model = _model(case)
    cfg = model.config
    rot = Rotary.for_model(model)
    H, D = kv_shape(cfg)
    r = cfg.qk_rope_head_dim
    keys = torch.randn(cfg.num_hidden_layers, H, 150, D)
    pos = torch.arange(11, 161)
    out = rot.rotate_keys(keys, pos)
    cos, sin = rot.cos_sin(pos, None, keys.dtype, keys.device)
    assert torch.equal(out[..., r:], keys[..., r:])
    own = rot.apply(keys[:1, ..., :r], keys[..., :r].contiguous(), cos[None], sin[None])[1]
    assert torch.allclose(out[..., :r], own, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[..., :r], keys[..., :r])
    assert torch.equal(Rotary.from_config(cfg).rotate_keys(keys, pos), out)
    # what the attention forward itself does to k_pe [1, 1, T, r] at these positions (its modeling file's choice)
    mod = sys.modules[type(model.model).__module__]
    k_pe = keys[0, :, :, :r][None]
    with torch.no_grad():
        pe = model.model.rotary_emb(k_pe, pos[None])
        if "v2" in case:
            cached = mod.apply_rotary_emb(k_pe, k_pe, pe)[1]
        elif cfg.rope_interleave:
            cached = mod.apply_rotary_pos_emb_interleave(k_pe, k_pe, *pe)[1]
        else:
            cached = mod.apply_rotary_pos_emb(k_pe, k_pe, *pe)[1]
    assert torch.allclose(out[0, :, :, :r], cached[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_latent_store_serves_its_own_layout(tmp_path, kv_format):
    """A DeepSeek V3 store holds the latent row, (kv_lora_rank + qk_rope_head_dim) x layers values per token, and
    its segment is served back: natively, [header][fact] composed from the store equals a prefill of the same
    tokens (max |dlogit| <= 1e-5 x max |logit|, 20 identical greedy tokens); in int8 within int8's error. The
    store refuses a fingerprint of another layout."""
    from safetensors import safe_open

    from kvmem.compose import compose
    from kvmem.encode import encode_spans
    from kvmem.engines.hf import HFEngine
    from kvmem.models import LoadedModel, fingerprint
    from kvmem.rope import Rotary
    from kvmem.store import FactRecord, Store, StoreMismatch

    model = _model("deepseek_v3")
    cfg = model.config
    fp = fingerprint(LoadedModel("tiny-deepseek", model, None, False, "w"))
    header, fact, query = random_ids(8, seed=50), random_ids(40, seed=51), random_ids(6, seed=52)
    hkv, fkv = encode_spans(model, [header, header + fact], [(0, 8), (8, 48)])
    st = Store.create(tmp_path / "s", fp, "hdr", header, hkv.keys, hkv.values, {"name": "e"}, kv_format=kv_format)
    rec = FactRecord("u/0", "u", "fact", "A", "D1:1", "d", tuple(fact), 0, 0)
    st.writes.put_user("u", [rec], [fkv.keys], [fkv.values], torch.ones(1, 4), window=0)
    ukv = st.reads.snapshot("u")
    (seg,) = ukv.segments
    with safe_open(st.segment_path("u", seg), "pt") as f:
        k, v = f.get_tensor("keys"), f.get_tensor("values")
    assert k.shape == v.shape == (40, cfg.num_hidden_layers, 1, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) // 2)
    per_token = (k.nbytes + v.nbytes) // 40
    itemsize = 4 if kv_format == "native" else 1
    assert per_token == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * itemsize
    memory = compose(Rotary.for_model(model), header, st.reads.header_kv(), ukv, [0])
    assert memory.token_ids == header + fact
    engine = HFEngine(model, eos_token_ids=[])
    steps = 20 if kv_format == "native" else 1
    kv = engine.run(query, memory, "kv", steps, keep_step_logits=True)
    ref = engine.run(query, memory, "prompt", steps, keep_step_logits=True)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(kv.step_logits, ref.step_logits))
    if kv_format == "native":
        assert worst <= REL_TOL and kv.token_ids == ref.token_ids and len(set(kv.token_ids)) > 1
    else:
        got_k, got_v = ukv.fact_kv(0)
        for got, want in ((got_k, fkv.keys), (got_v, fkv.values)):
            assert 0 < float((got - want).abs().amax() / want.abs().amax()) < 0.01
        assert 0 < worst < 0.05
    other = {k: v for k, v in fp.items() if k != "kv_layout"}
    with pytest.raises(StoreMismatch, match="kv_layout"):
        Store.open(tmp_path / "s", fingerprint=other)


def test_latent_selective_recompute_of_every_fact_token_is_a_prefill():
    """kv-sel100 on latent attention: independently encoded facts, recomputed whole on the injected latent cache,
    give prompt injection's logits; without the recompute they differ (the facts never saw each other)."""
    from kvmem.compose import compose_raw
    from kvmem.encode import encode_spans
    from kvmem.engines.hf import HFEngine
    from kvmem.rope import Rotary

    model = _model("deepseek_v2")
    model.set_attn_implementation("sdpa")
    h, f1, f2, q = random_ids(8, seed=60), random_ids(20, seed=61), random_ids(20, seed=62), random_ids(6, seed=63)
    kvs = encode_spans(model, [h, h + f1, h + f2], [(0, 8), (8, 28), (8, 28)])
    keys, values = torch.cat([k.keys for k in kvs], 2), torch.cat([k.values for k in kvs], 2)
    engine = HFEngine(model, eos_token_ids=[])
    memory = compose_raw(Rotary.for_model(model), h + f1 + f2, keys, values)
    ref = engine.run(q, memory, "prompt", 1).first_logits
    sel = engine.run(q, memory, "kv", 1, recompute=1.0, header_len=8).first_logits
    plain = engine.run(q, memory, "kv", 1).first_logits
    assert (sel - ref).abs().max() <= REL_TOL * ref.abs().max()
    assert (plain - ref).abs().max() > 1e-3 * ref.abs().max()
