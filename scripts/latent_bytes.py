"""Stored bytes per fact token: latent attention (DeepSeek V2-Lite and V3 shapes) against the same models' per-head
K/V and against GQA models of similar size, from real segment files (docs/models.md, "Latent attention").

Each model is built with random weights, its real KV shapes (layers, kv_lora_rank, qk_rope_head_dim; KV heads
and head size for GQA) and a tiny hidden size, vocabulary and (for latent attention, whose stored latent does not
depend on it) 2 attention heads; the per-head K/V a latent model would hold expanded is computed for its real
head count. One 24-token fact (about a LoCoMo fact's length) is encoded in bf16 and committed to a fresh store; the
segment file's size is read from disk. Run: ``PYTHONPATH=src .venv/bin/python scripts/latent_bytes.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers as tf

from kvmem.encode import encode_spans
from kvmem.models import LoadedModel, fingerprint, kv_shape
from kvmem.store import FactRecord, Store

TOKENS = 24
SMALL = dict(hidden_size=128, intermediate_size=64, vocab_size=512, max_position_embeddings=4096)


def deepseek(name: str, layers: int, heads: int) -> tuple[str, torch.nn.Module, int]:
    cfg = tf.DeepseekV3Config(
        **SMALL,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=None,
        first_k_dense_replace=layers,  # dense MLPs: the MLP stores nothing
    )
    per_head = layers * heads * (128 + 64 + 128) * 2  # bf16 k_nope|k_pe and v of every head
    return name, tf.DeepseekV3ForCausalLM(cfg), per_head


def gqa(name: str, layers: int, kv_heads: int) -> tuple[str, torch.nn.Module, int]:
    cfg = tf.LlamaConfig(
        **SMALL, num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=128
    )
    return name, tf.LlamaForCausalLM(cfg), 0


def measure(name: str, model: torch.nn.Module, per_head: int, root: Path) -> dict:
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(3, 500, (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    (hkv,) = encode_spans(model, [ids[:1]], [(0, 1)])
    (kv,) = encode_spans(model, [ids], [(0, TOKENS)])
    fp = fingerprint(LoadedModel(name, model, None, False, "-"))
    st = Store.create(root / name, fp, "", ids[:1], hkv.keys, hkv.values, {"name": "none"})
    rec = FactRecord("u/0", "u", "f", "", "", "", tuple(ids), 0, 0)
    st.writes.put_user("u", [rec], [kv.keys], [kv.values], torch.zeros(1, 4), 0)
    (seg,) = st.reads.snapshot("u").segments
    path = st.segment_path("u", seg)
    st.close()
    size = path.stat().st_size
    overhead = 8 + int.from_bytes(path.read_bytes()[:8], "little")  # safetensors: length, JSON header, then data
    per_token = (size - overhead) // TOKENS
    h, d = kv_shape(model.config)
    assert per_token == 2 * model.config.num_hidden_layers * h * d * 2  # keys and values, bf16
    return {"name": name, "file": size, "per_token": per_token, "overhead": overhead, "per_head": per_head}


def main() -> None:
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in (
            deepseek("DeepSeek-V2-Lite shape (MLA: 27 layers, 16 heads)", 27, 16),
            deepseek("DeepSeek-V3 shape (MLA: 61 layers, 128 heads)", 61, 128),
            gqa("Qwen2.5-7B shape (GQA: 28 layers, 4 KV heads x 128)", 28, 4),
            gqa("Llama-3.1-8B shape (GQA: 32 layers, 8 KV heads x 128)", 32, 8),
        ):
            rows.append(measure(*spec, Path(tmp)))
            print(rows[-1], flush=True)
    print(f"\n| model (bf16) | stored B/token | {TOKENS}-token segment file | fixed overhead | per-head K/V B/token |")
    print("|---|---|---|---|---|")
    for r in rows:
        ph = f"{r['per_head']:,} ({r['per_head'] / r['per_token']:.1f}x)" if r["per_head"] else "(is per-head)"
        print(f"| {r['name']} | {r['per_token']:,} | {r['file']:,} B | {r['overhead']:,} B | {ph} |")


if __name__ == "__main__":
    main()
