"""``kvmem bench tools``: time to first token of a tool-using chat with memory, kv against prompt mode.

An agent sends the same system message and tools with every request; the chat template renders them after the
memory, so in prompt mode they are prefilled every time. In kv mode the transformers engine injects them as KV
encoded once (``engines.tools_kv``), and prefills only the turns. One user gets ``--memories`` memories of
``--fact-tokens`` tokens (random KV of the model's shape, as ``bench chat-cost`` writes them: only timing is
measured), and each arm answers ``--chats`` questions (one token each) with k facts and the first n of the twenty
tool definitions in ``tool_schemas`` (0 = the same chat without tools), in kv and in prompt mode, interleaved.

TTFT is the whole first-token time of a chat: embed + search + compose (with the tools block's KV, read from the
cache) + the engine's prefill. Each kv arm with tools runs one chat first that encodes the block (``first_ms``,
reported on its own); the rest give median and p95. Target: kv TTFT with 20 tools within 1.2x kv with none.

Writes summary.json, records.json/csv and tools_ttft.png under ``--out``.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from ..engines.select import open_engine
from ..ingest import open_or_create_store
from ..models import head_dim
from ..retrieve import Embedder
from ..service import MemoryService
from .chat_cost import fill
from .common import machine, median, p95, pyplot, table, write_summary_and_records
from .tool_schemas import TOOLS

SYSTEM = "You are Alice's personal assistant. Use the tools when they help; answer briefly."
QUESTIONS = [
    "What's the weather like where my sister lives?",
    "Remind me to call my brother on his birthday.",
    "Which restaurant did I say I liked last month?",
    "Email my manager that I will be late tomorrow.",
    "What time is my dentist appointment?",
    "How much is my rent in dollars?",
    "Add buying a gift for Ines to my to-do list.",
    "Find the address of my favourite bookshop.",
]
TARGET = 1.2


def run(
    out: Path,
    model: str,
    ks: list[int],
    tool_counts: list[int],
    chats: int = 5,
    memories: int = 40,
    fact_tokens: int = 16,
    dtype: str | None = None,
    echo=print,
) -> dict:
    if max(tool_counts) > len(TOOLS):
        raise ValueError(f"at most {len(TOOLS)} tools")
    if max(ks) > memories:
        raise ValueError(f"k={max(ks)} needs at least that many --memories")
    opened = open_engine(model, "hf", dtype)
    lm, engine, emb = opened.lm, opened.engine, Embedder()
    cfg = lm.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg))
    records, arms = [], {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-tools-") as tmp:
        root = Path(tmp) / "s"
        store, _ = open_or_create_store(root, lm, emb)
        store.close()
        fill(str(root), "alice", memories, fact_tokens, emb.dim, shape, str(lm.dtype).removeprefix("torch."))
        svc = MemoryService(root, engine, lm, emb)
        svc.store.reads.verify("alice")

        def chat(i: int, k: int, n: int, mode: str) -> dict:
            q = QUESTIONS[i % len(QUESTIONS)]
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            t0 = time.perf_counter()
            req = svc.prepare("alice", q, k, mode, 1, messages, tools=TOOLS[:n] or None)
            (gen,) = engine.generate([req.request(svc.sampling(1, ignore_eos=True))])
            ttft = (time.perf_counter() - t0) * 1e3
            block = req.plan.block if req.plan is not None else None
            return {
                "k": k,
                "tools": n,
                "mode": mode,
                "ttft_ms": round(ttft, 2),
                "engine_ttft_ms": round(gen.ttft_ms, 2),
                "compose_ms": round(req.timings_ms["compose"], 2),
                "prompt_tokens": len(req.prompt_ids),
                "prefilled_tokens": gen.prefilled_tokens,
                "tools_block_tokens": len(block.token_ids) if block is not None else 0,
            }

        chat(0, ks[0], 0, "kv")  # first chat: the user's index, the first forward's allocations
        for k in ks:
            for n in tool_counts:
                first = chat(0, k, n, "kv")  # encodes the tools block (a miss), once per tools set
                for i in range(chats):
                    for mode in ("kv", "prompt"):
                        records.append(chat(i + 1, k, n, mode))
                mine = {
                    m: [r for r in records if (r["k"], r["tools"], r["mode"]) == (k, n, m)] for m in ("kv", "prompt")
                }
                for m, rs in mine.items():
                    arms[(k, n, m)] = {
                        "ttft_ms": {"p50": median(r["ttft_ms"] for r in rs), "p95": p95(r["ttft_ms"] for r in rs)},
                        "engine_ttft_ms_p50": median(r["engine_ttft_ms"] for r in rs),
                        "compose_ms_p50": median(r["compose_ms"] for r in rs),
                        "prompt_tokens": rs[-1]["prompt_tokens"],
                        "prefilled_tokens": rs[-1]["prefilled_tokens"],
                        **({"first_ms": first["ttft_ms"]} if m == "kv" and n else {}),
                    }
                kv, pr = arms[(k, n, "kv")], arms[(k, n, "prompt")]
                echo(
                    f"k={k} tools={n}: kv p50 {kv['ttft_ms']['p50']:.0f} ms ({kv['prefilled_tokens']} prefilled), "
                    f"prompt p50 {pr['ttft_ms']['p50']:.0f} ms ({pr['prefilled_tokens']} prefilled)"
                )
        tools_stats = {"entries": len(engine.tools), "bytes": engine.tools.nbytes, "hits": engine.tools.hits}
        svc.close()
    hi = max(tool_counts)
    ratios = {
        str(k): round(arms[(k, hi, "kv")]["ttft_ms"]["p50"] / arms[(k, 0, "kv")]["ttft_ms"]["p50"], 3)
        for k in ks
        if 0 in tool_counts
    }
    summary = {
        "command": "bench tools",
        "model": model,
        "engine": "hf",
        "dtype": str(lm.dtype).removeprefix("torch."),
        "ks": ks,
        "tool_counts": tool_counts,
        "chats_per_arm": chats,
        "memories": memories,
        "fact_tokens": fact_tokens,
        "arms": {f"k{k}/tools{n}/{m}": v for (k, n, m), v in arms.items()},
        f"kv_p50_tools{hi}_over_tools0": ratios,
        "targets": {f"kv_p50_tools{hi}_over_tools0": TARGET},
        "tools_cache": tools_stats,
        "machine": {**machine(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    _plot(out, model, ks, tool_counts, arms)
    rows = [
        [k, n, m, a["ttft_ms"]["p50"], a["ttft_ms"]["p95"], a["prompt_tokens"], a["prefilled_tokens"]]
        for (k, n, m), a in arms.items()
    ]
    echo(table(rows, ["k", "tools", "mode", "TTFT p50 ms", "p95 ms", "prompt tokens", "prefilled"]))
    echo(f"kv TTFT p50 with {hi} tools / none: {ratios} (target <= {TARGET})")
    return summary


def _plot(out: Path, model: str, ks: list[int], tool_counts: list[int], arms: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ks), figsize=(3.4 * len(ks), 3.4), sharey=True, squeeze=False)
    x = torch.arange(len(tool_counts)).tolist()
    for ax, k in zip(axes[0], ks):
        for dx, (mode, color) in zip((-0.2, 0.2), (("kv", "tab:blue"), ("prompt", "tab:orange"))):
            p50 = [arms[(k, n, mode)]["ttft_ms"]["p50"] for n in tool_counts]
            hi = [arms[(k, n, mode)]["ttft_ms"]["p95"] - p for n, p in zip(tool_counts, p50)]
            ax.bar([i + dx for i in x], p50, 0.4, yerr=[[0] * len(hi), hi], color=color, label=f"{mode} (p50, p95)")
        ax.set_xticks(x, [str(n) for n in tool_counts])
        ax.set_xlabel("tools in the request")
        ax.set_yscale("log")
        ax.set_title(f"k = {k}", fontsize=9)
    axes[0][0].set_ylabel("TTFT, ms")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Tool-using chat with memory: TTFT ({model}, transformers engine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "tools_ttft.png", dpi=120)
    plt.close(fig)
