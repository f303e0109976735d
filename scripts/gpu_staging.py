"""The injection path on a GPU: staged layer by layer (``LayerStager``) against one whole copy, then inject.

For each k, a composed memory of the 1.5B model's shape (28 layers, 2 KV heads, head_dim 128, bf16; header of 40
tokens plus k facts of 24) sits in pinned host memory, pre-RoPE. Each arm moves it into a paged KV cache on the
device (block_size 16, slots in a random block order) with its keys rotated to positions 0..m-1:

- ``whole``: one host-to-device copy of all layers, then rotate and write them;
- ``staged``: ``LayerStager`` copies layer l+1 on its side stream while layer l is rotated and written.

Both arms are checked equal to each other and to a CPU fp32 reference (bf16 tolerance). Timed with CUDA events
around the whole injection, median and p95 of ``--reps``; written to ``--out`` as JSON. On a CPU (``--device
cpu``) the same code runs with no streams, which is how CI's machine exercises it.

    python scripts/gpu_staging.py --out $OUT/gpu_staging.json [--device cuda] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmem.rope import Rotary
from kvmem.staging import LayerStager

L, H, D, BLOCK = 28, 2, 128, 16


def rotary() -> Rotary:
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        num_hidden_layers=L, num_attention_heads=12, num_key_value_heads=H, hidden_size=12 * D, rope_theta=1e6
    )
    return Rotary.from_config(cfg)


def inject(rot, stager, keys, values, cache, slots, cos, sin, staged: bool) -> None:
    """Rotate and write every layer of host ``keys``/``values`` [L, H, m, D] into ``cache`` [L, 2, slots, H, D]."""
    dev = cache.device
    chunks = stager.chunks(keys, values) if staged else [(0, keys.to(dev), values.to(dev))]
    for l0, k, v in chunks:
        out = torch.empty((k.shape[0], k.shape[2], H, D), dtype=k.dtype, device=dev)
        rot.rotate(k, cos, sin, out=out.transpose(1, 2))
        cache[l0 : l0 + k.shape[0], 0, slots] = out
        cache[l0 : l0 + k.shape[0], 1, slots] = v.transpose(1, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--ks", default="5,20,50")
    ap.add_argument("--out", type=Path, default=Path("gpu_staging.json"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rot, stager = rotary(), LayerStager(dev, chunk=1)
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        m = 40 + 24 * k
        g = torch.Generator().manual_seed(k)
        keys = stager.pin(torch.randn((L, H, m, D), generator=g).to(dtype))
        values = stager.pin(torch.randn((L, H, m, D), generator=g).to(dtype))
        blocks = torch.randperm(4 * (m // BLOCK + 1), generator=g)[: m // BLOCK + 1]
        pos = torch.arange(m)
        slots = (blocks[pos // BLOCK] * BLOCK + pos % BLOCK).to(dev)
        cos, sin = rot.cos_sin(pos, None, dtype, dev)
        caches = {a: torch.zeros((L, 2, blocks.max().item() * BLOCK + BLOCK, H, D), dtype=dtype, device=dev)
                  for a in ("whole", "staged")}  # fmt: skip
        for arm, cache in caches.items():
            inject(rot, stager, keys, values, cache, slots, cos, sin, arm == "staged")
        ref_cos, ref_sin = rot.cos_sin(pos, None, torch.float32, "cpu")
        ref = rot.rotate(keys.float(), ref_cos, ref_sin)
        got = caches["staged"][:, 0, slots.cpu()].cpu().float().permute(0, 2, 1, 3)
        assert torch.equal(caches["staged"], caches["whole"]), "staged and whole injections differ"
        assert torch.allclose(got, ref, atol=0.05, rtol=0.02), float((got - ref).abs().max())
        assert torch.equal(caches["staged"][:, 1, slots].permute(0, 2, 1, 3).cpu(), values)
        row = {"k": k, "memory_tokens": m, "bytes": 2 * keys.nbytes}
        for arm, cache in caches.items():
            times = []
            for rep in range(args.reps + 3):
                if cuda:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                inject(rot, stager, keys, values, cache, slots, cos, sin, arm == "staged")
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    ms = start.elapsed_time(end)
                else:
                    ms = (time.perf_counter() - t0) * 1e3
                if rep >= 3:
                    times.append(ms)
            times.sort()
            row[f"{arm}_ms_p50"] = round(statistics.median(times), 3)
            row[f"{arm}_ms_p95"] = round(times[int(0.95 * (len(times) - 1))], 3)
        row["staged_over_whole"] = round(row["staged_ms_p50"] / row["whole_ms_p50"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or platform.machine()
    args.out.write_text(json.dumps({"device": name, "dtype": str(dtype), "torch": torch.__version__, "rows": rows},
                                   indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
