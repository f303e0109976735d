"""``kvmem bench chat-cost``: what one kv-mode chat costs before the engine runs, as a user's memory grows.

For each count N (default 64, 1,000, 10,000) one user gets N memories of ``--fact-tokens`` tokens each, written
in commits of 100 (so N/100 segments) with random KV of the model's shape and random unit embeddings; only
retrieval and composition read them, so their content does not matter. Then ``--chats`` LoCoMo questions are
planned and composed for that user on the transformers engine, side by side in one run:

* ``plan``: embed the question, search the user's index, order and budget the top-k;
* ``compose``: read the k facts' KV (``UserKV.gather``: only their spans), rotate and concatenate them.

Before the chats, every segment is verified against its checksum (``Store.reads.verify``: once per segment per process,
which a reader otherwise pays on its first read of each); that time is reported on its own, as is the first chat
(it builds the user's index). The rest give median and p95. Resident memory is read after each N: it must stay
within the model plus ``--cache-bytes`` (the store's byte-bounded cache), not grow with N. Target: p50 at 10,000
<= 1.5x at 64.

Writes summary.json, records.json/csv and chat_cost.png under ``--out``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engines.select import open_engine
from ..ingest import open_or_create_store
from ..locomo import get_conversation
from ..models import head_dim
from ..retrieve import Embedder
from ..service import MemoryService
from ..store import FactRecord, Store, Write
from .common import machine, median, p95, pyplot, rss_bytes, table, write_summary_and_records

BATCH = 100  # memories per commit (one segment each)


def fill(root: str, user: str, n: int, fact_tokens: int, dim: int, shape: tuple[int, int, int], dtype: str) -> None:
    """Commit ``n`` memories of ``fact_tokens`` tokens with random KV [L, H, fact_tokens, D] (``dtype``, e.g.
    "float32") and random unit embeddings [dim] to the store at ``root``. Runs in a child process, so the
    serving process's resident memory holds only what serving reads."""
    store, dtype = Store.open(root), getattr(torch, dtype)
    g = torch.Generator().manual_seed(n)
    L, H, D = shape
    for start in range(0, n, BATCH):
        m = min(BATCH, n - start)
        recs = [
            FactRecord(f"m{start + j}", user, f"memory {start + j}", "", "", "", tuple(range(1, fact_tokens + 1)))
            for j in range(m)
        ]
        keys = [torch.randn(L, H, fact_tokens, D, generator=g).to(dtype) for _ in range(m)]
        vecs = torch.nn.functional.normalize(torch.randn(m, dim, generator=g), dim=1)
        store.writes.commit(Write(user, recs, keys, keys, vecs))
    store.close()


def run(
    data: Path,
    out: Path,
    model: str,
    counts: list[int],
    fact_tokens: int = 16,
    chats: int = 60,
    k: int = 20,
    cache_bytes: int = 256 << 20,
    sample: str = "conv-26",
    echo=print,
) -> dict:
    questions = [q.question for q in get_conversation(data, sample).questions]
    opened = open_engine(model, "hf", None)
    lm, engine, emb = opened.lm, opened.engine, Embedder()
    cfg = lm.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg))
    kv_per_memory = 2 * shape[0] * shape[1] * shape[2] * fact_tokens * torch.empty(0, dtype=lm.dtype).element_size()
    base_rss = rss_bytes()["rss"]
    records, per_count = [], {}
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="kvmem-bench-chat-") as tmp:
            root = Path(tmp) / "s"
            store, _ = open_or_create_store(root, lm, emb)
            store.close()
            t0 = time.perf_counter()
            dtype = str(lm.dtype).removeprefix("torch.")
            args = (str(root), "u", n, fact_tokens, emb.dim, shape, dtype)
            code = f"from kvmem.bench.chat_cost import fill; fill(*{args!r})"
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"filling the store with {n} memories failed: {child.stderr[-500:]}")
            fill_s = time.perf_counter() - t0
            rss_before = rss_bytes()["rss"]
            svc = MemoryService(root, engine, lm, emb, store_cache_bytes=cache_bytes)
            t0 = time.perf_counter()
            svc.store.reads.verify("u")  # once per segment per process: what a long-running server has paid
            verify_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            svc.prepare("u", questions[0], k)
            first_ms = (time.perf_counter() - t0) * 1e3
            for i in range(chats):
                q = questions[(i + 1) % len(questions)]
                t0 = time.perf_counter()
                req = svc.plan("u", q, k)
                t1 = time.perf_counter()
                engine.memory(req.plan)
                t2 = time.perf_counter()
                records.append(
                    {
                        "memories": n,
                        "plan_ms": round((t1 - t0) * 1e3, 3),
                        "compose_ms": round((t2 - t1) * 1e3, 3),
                        "chat_ms": round((t2 - t0) * 1e3, 3),
                    }
                )
            rss = rss_bytes()["rss"]
            mine = [r for r in records if r["memories"] == n]
            per_count[n] = {
                "kv_bytes": n * kv_per_memory,
                "segments": -(-n // BATCH),
                "fill_s": round(fill_s, 1),
                "verify_s": round(verify_s, 2),
                "first_chat_ms": round(first_ms, 1),
                "chat_ms": {"p50": median(r["chat_ms"] for r in mine), "p95": p95(r["chat_ms"] for r in mine)},
                "plan_ms_p50": median(r["plan_ms"] for r in mine),
                "compose_ms_p50": median(r["compose_ms"] for r in mine),
                "store_cache_bytes": svc.store.kv_cache_bytes,
                "rss_over_model_bytes": rss - base_rss,
                "rss_growth_serving_bytes": rss - rss_before,
            }
            svc.close()
            echo(f"{n} memories: chat p50 {per_count[n]['chat_ms']['p50']:.1f} ms, first {first_ms:.0f} ms")
    lo, hi = per_count[counts[0]]["chat_ms"]["p50"], per_count[counts[-1]]["chat_ms"]["p50"]
    summary = {
        "command": "bench chat-cost",
        "model": model,
        "engine": "hf",
        "dtype": str(lm.dtype).removeprefix("torch."),
        "k": k,
        "fact_tokens": fact_tokens,
        "chats_per_count": chats,
        "cache_bytes": cache_bytes,
        "per_count": {str(n): v for n, v in per_count.items()},
        "largest_over_smallest_p50": round(hi / lo, 3),
        "targets": {"largest_over_smallest_p50": 1.5},
        "machine": {**machine(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(counts))
    plan = [per_count[n]["plan_ms_p50"] for n in counts]
    comp = [per_count[n]["compose_ms_p50"] for n in counts]
    ax.bar(xs, plan, color="tab:blue", label="plan (embed + search)")
    ax.bar(xs, comp, bottom=plan, color="tab:orange", label="compose (read k facts + RoPE)")
    ax.set_xticks(list(xs), [f"{n:,}" for n in counts])
    ax.set_xlabel("memories of the user")
    ax.set_ylabel("ms per chat (p50)")
    ax.set_title(f"kv-mode cost before the engine runs ({model}, k={k})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "chat_cost.png", dpi=120)
    plt.close(fig)
    rows = [
        [
            f"{n:,}",
            f"{per_count[n]['kv_bytes'] / 2**20:,.0f} MiB",
            per_count[n]["chat_ms"]["p50"],
            per_count[n]["chat_ms"]["p95"],
            per_count[n]["first_chat_ms"],
            f"{per_count[n]['rss_growth_serving_bytes'] / 2**20:,.0f} MiB",
        ]
        for n in counts
    ]
    echo(table(rows, ["memories", "KV", "p50 ms", "p95 ms", "first ms", "RSS growth serving"]))
    echo(f"10k/64 p50 ratio: {summary['largest_over_smallest_p50']} (target <= 1.5)")
    return summary
