"""``kvmem bench scale``: a capacity model of many replicas over one shared store, on paper, from measured
per-request costs. Nothing runs a model; every input is an option with its default and its source below.

Model (every assumption is also in the JSON the command writes):

* **Users and activity.** U users; request popularity is Zipf with exponent ``zipf`` (user i is asked with
  probability proportional to 1 / i^zipf), independent requests (the independent reference model).
* **KV per fact token** from each model's config: 2 (K and V) x layers x KV heads x head dim x bytes per value
  (bf16: 2). The 0.5B and 1.5B are Qwen2.5's configs (the registry's models); the 8B is Llama 3.1 8B's (32
  layers, 8 KV heads, head dim 128). A user holds ``facts`` facts of ``tokens_per_fact`` tokens.
* **Shared store size** = users x facts x (tokens x KV bytes per token + an embedding of ``embed_dim`` fp32 +
  ``row_bytes`` of row).
* **Caches.** Each replica keeps an LRU of whole users' KV, ``cache_bytes`` per replica. With user affinity
  (kvmem's router) each replica sees only its 1/R of the users; without it every replica sees every user. LRU
  hit rates use Che's approximation: the characteristic time T solves sum_i (1 - exp(-p_i T)) = C (users that
  fit), and the hit rate is sum_i p_i (1 - exp(-p_i T)).
* **Replicas for a target QPS** = ceil(QPS / (utilisation x QPS per replica)); QPS per replica is measured on
  one engine (``qps_per_replica``) and scaled by ``gpu_speedup`` for a GPU replica (an assumption, stated).
* **TTFT.** A hit costs the measured hot TTFT (lognormal through its p50 and p95); a miss adds the cold read of
  k facts' KV from the shared store: ``cold_ms`` (measured: snapshot + gather of 20 facts from PostgreSQL +
  ``file://`` segments, first read) plus k x fact bytes / ``store_gbps``. TTFT p95 is the 95th percentile of
  that mixture. Queueing is not modelled beyond the utilisation cap.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from .common import pyplot, table, write_json

# (layers, KV heads, head dim): Qwen2.5-0.5B / 1.5B configs, Llama 3.1 8B's config
MODELS = {"0.5B": (24, 2, 64), "1.5B": (28, 2, 128), "8B": (32, 8, 128)}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def zipf_p(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def lru_hit_rate(p: np.ndarray, capacity: float) -> float:
    """Che's approximation of an LRU cache's hit rate for items of popularity ``p`` (sums to 1), ``capacity``
    items."""
    if capacity >= len(p):
        return 1.0
    if capacity <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while np.sum(-np.expm1(-p * hi)) < capacity:
        hi *= 2
    for _ in range(60):
        t = (lo + hi) / 2
        lo, hi = (t, hi) if np.sum(-np.expm1(-p * t)) < capacity else (lo, t)
    return float(np.sum(p * -np.expm1(-p * hi)))


def affinity_hit_rate(p: np.ndarray, replicas: int, capacity: float) -> float:
    """Users split over ``replicas`` by hash (every R-th by popularity rank: an even split of the head)."""
    rates = []
    for r in range(replicas):
        part = p[r::replicas]
        rates.append(part.sum() * lru_hit_rate(part / part.sum(), capacity))
    return float(sum(rates))


def _lognormal_quantile_mix(w_hot: float, hot: tuple[float, float], cold: tuple[float, float], q: float) -> float:
    """The ``q`` quantile of a mixture of two lognormals, each given by its (p50, p95)."""
    from statistics import NormalDist

    z95 = NormalDist().inv_cdf(0.95)

    def cdf(x, p50, p95):
        sigma = max(1e-9, math.log(p95 / p50) / z95)
        return NormalDist().cdf((math.log(x) - math.log(p50)) / sigma)

    lo, hi = 1e-3, 1e7
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        f = w_hot * cdf(mid, *hot) + (1 - w_hot) * cdf(mid, *cold)
        lo, hi = (mid, hi) if f < q else (lo, mid)
    return hi


def run(
    out: Path,
    users_list: tuple[int, ...] = (10_000, 100_000, 1_000_000),
    facts: int = 200,
    tokens_per_fact: int = 32,
    k: int = 20,
    zipf: float = 1.0,
    cache_bytes: int = 64 << 30,
    target_qps: float = 100.0,
    qps_per_replica: float = 5.5,
    gpu_speedup: float = 1.0,
    utilisation: float = 0.7,
    hot_ttft_ms: tuple[float, float] = (135.0, 186.0),
    cold_ms: float = 1264.0,
    store_gbps: float = 1.0,
    embed_dim: int = 384,
    row_bytes: int = 200,
) -> dict:
    """Writes scale.json, scale.md and scale.png under ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, cfg in MODELS.items():
        per_tok = kv_bytes_per_token(*cfg)
        user_bytes = facts * tokens_per_fact * per_tok
        for users in users_list:
            p = zipf_p(users, zipf)
            replicas = math.ceil(target_qps / (utilisation * qps_per_replica * gpu_speedup))
            fit = cache_bytes / user_bytes
            hit = affinity_hit_rate(p, replicas, fit)
            hit_random = lru_hit_rate(p, fit)
            fetch = cold_ms + k * tokens_per_fact * per_tok / (store_gbps * 1e9) * 1e3
            cold = (hot_ttft_ms[0] + fetch, hot_ttft_ms[1] + fetch)
            rows.append(
                {
                    "model": model,
                    "kv_bytes_per_token": per_tok,
                    "users": users,
                    "store_bytes": users * facts * (tokens_per_fact * per_tok + 4 * embed_dim + row_bytes),
                    "replicas": replicas,
                    "cache_hit_rate_affinity": round(hit, 4),
                    "cache_hit_rate_random_routing": round(hit_random, 4),
                    "ttft_ms_p95_affinity": round(_lognormal_quantile_mix(hit, hot_ttft_ms, cold, 0.95), 1),
                    "ttft_ms_p95_random_routing": round(
                        _lognormal_quantile_mix(hit_random, hot_ttft_ms, cold, 0.95), 1
                    ),
                }
            )
    curve_users = 100_000
    sizes = [2**i for i in range(28, 38)]
    p = zipf_p(curve_users, zipf)
    curves = {}
    for model, cfg in MODELS.items():
        user_bytes = facts * tokens_per_fact * kv_bytes_per_token(*cfg)
        replicas = rows[0]["replicas"]
        curves[model] = {
            "affinity": [affinity_hit_rate(p, replicas, c / user_bytes) for c in sizes],
            "random": [lru_hit_rate(p, c / user_bytes) for c in sizes],
        }
    assumptions = {
        "facts_per_user": facts,
        "tokens_per_fact": tokens_per_fact,
        "k": k,
        "zipf_exponent": zipf,
        "cache_bytes_per_replica": cache_bytes,
        "target_qps": target_qps,
        "qps_per_replica_measured": qps_per_replica,
        "gpu_speedup_assumed": gpu_speedup,
        "utilisation": utilisation,
        "hot_ttft_ms_p50_p95": hot_ttft_ms,
        "cold_read_ms": cold_ms,
        "store_gbps": store_gbps,
        "kv_dtype_bytes": 2,
        "models": {m: dict(zip(("layers", "kv_heads", "head_dim"), c, strict=True)) for m, c in MODELS.items()},
    }
    summary = {"assumptions": assumptions, "rows": rows, "curve_users": curve_users, "curve_cache_bytes": sizes,
               "curves": curves, "command": " ".join(sys.argv)}  # fmt: skip
    write_json(out / "scale.json", summary)
    head = ["model", "users", "shared store", "replicas", "hit rate (affinity)", "hit rate (random)",
            "TTFT p95 ms (affinity)", "TTFT p95 ms (random)"]  # fmt: skip
    body = [
        [r["model"], f"{r['users']:,}", _size(r["store_bytes"]), r["replicas"], r["cache_hit_rate_affinity"],
         r["cache_hit_rate_random_routing"], r["ttft_ms_p95_affinity"], r["ttft_ms_p95_random_routing"]]
        for r in rows
    ]  # fmt: skip
    md = table(body, head)
    (out / "scale.md").write_text(md + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for model, c in curves.items():
        (line,) = ax.plot([s / 2**30 for s in sizes], c["affinity"], marker="o", label=f"{model}, affinity")
        ax.plot([s / 2**30 for s in sizes], c["random"], ls="--", color=line.get_color(), label=f"{model}, random")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache bytes per replica (GiB)")
    ax.set_ylabel("segment-cache hit rate")
    ax.set_title(f"{curve_users:,} users, Zipf {zipf}, {rows[0]['replicas']} replicas, {facts} facts/user", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=120)
    print(md)
    return summary


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"
