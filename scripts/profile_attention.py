"""Where the KV path's TTFT grows with k: profile one query prefill behind m injected positions.

Runs the default model (bf16) on a 20-token query behind random injected KV of m = 0, 230 and 1880 positions
(no memory, k=5 and k=50 on conv-26 at w=5) and prints, per m, the median forward time and the part spent in
attention (SDPA) and in appending to the cache (cat). Used by docs/benchmarks.md to explain the k-scaling targets.

    python scripts/profile_attention.py [--reps 7]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import profile
from transformers import DynamicCache

from kvmem import models
from kvmem.engines.hf import use_gqa_sdpa


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--query-tokens", type=int, default=20)
    args = ap.parse_args()
    lm = models.load(args.model)
    model, cfg = lm.model, lm.model.config
    use_gqa_sdpa(model)
    n_layers, n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = models.head_dim(cfg)
    ids = torch.randint(100, 1000, (1, args.query_tokens))
    gen = torch.Generator().manual_seed(0)

    def cache_of(m: int) -> DynamicCache:
        cache = DynamicCache(config=cfg)
        if m:
            for layer in range(n_layers):
                kv = torch.randn(2, 1, n_kv, m, head_dim, generator=gen).to(torch.bfloat16)
                cache.update(kv[0], kv[1], layer)
        return cache

    @torch.inference_mode()
    def forward(m: int, cache: DynamicCache) -> None:
        model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=torch.arange(m, m + ids.shape[1])[None],
        )

    print(f"{args.model}, {torch.get_num_threads()} threads, query {args.query_tokens} tokens, median of {args.reps}")
    print(f"{'m':>6} {'forward ms':>11} {'sdpa ms':>8} {'cat ms':>7}")
    for m in (0, 230, 1880):
        forward(m, cache_of(m))  # warm-up
        times = []
        for _ in range(args.reps):
            cache = cache_of(m)
            t0 = time.perf_counter()
            forward(m, cache)
            times.append((time.perf_counter() - t0) * 1e3)
        with profile() as prof:
            forward(m, cache_of(m))
        self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        sdpa = sum(v for k, v in self_ms.items() if "scaled_dot_product" in k)
        print(f"{m:>6} {statistics.median(times):>11.1f} {sdpa:>8.1f} {self_ms.get('aten::cat', 0.0):>7.1f}")


if __name__ == "__main__":
    main()
