"""``kvmem bench memory``: the online-memory write and read paths against their targets.

* ``add`` with ``infer=False``, one LoCoMo turn per call, encoding at window ``w``: latency per call, side by side
  with the model's plain forward over exactly the same ``[header][w turns][fact]`` tokens, in the same run
  (target: p50 <= 1.25x the plain forward).
* ``add`` to an entity scope (the same turns, to user ``u`` with agent ``a``), side by side with the plain add.
* ``search`` for a user with ``--facts`` memories (target: p50 <= 20 ms at 10,000). The filler memories get
  random unit embeddings and one-token KV: search reads neither their text nor their KV. Side by side: the same
  size in an agent scope of another user (``filters={"user_id", "agent_id"}``), that user's search across both of
  its scopes (``filters={"user_id"}``), and a metadata filter that keeps half the memories (applied before the
  top-k).
* ``delete`` (target: <= 50 ms), and the deleted memory is absent from the very next ``search``.

Writes summary.json, records.json/csv and memory.png (latency distributions) under ``--out``.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from ..locomo import get_conversation
from ..memory import Memory
from ..models import head_dim, load
from ..retrieve import Embedder
from ..store import FactRecord, Write
from .common import machine, median, p95, pyplot, table, write_summary_and_records


def run(
    data: Path,
    out: Path,
    sample: str,
    turns: int,
    facts: int,
    window: int,
    model: str,
    searches: int = 50,
    deletes: int = 20,
    echo=print,
) -> dict:

    conv = get_conversation(data, sample)
    lm, emb = load(model), Embedder()
    records = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-mem-") as tmp:
        mem = Memory(Path(tmp) / "s", model=lm, embedder=emb, window=window)
        base = getattr(lm.model, "model", lm.model)
        for i, t in enumerate(conv.turns[: turns + 2]):
            msg = [{"role": "user", "name": t.speaker, "content": t.text}]
            t0 = time.perf_counter()
            mem.add(msg, "u", agent_id="a", infer=False)
            scoped_ms = (time.perf_counter() - t0) * 1e3
            context = mem.encoding_context("u", [], 0)
            t0 = time.perf_counter()
            mem.add(msg, "u", infer=False)
            add_ms = (time.perf_counter() - t0) * 1e3
            fact = mem.store.reads.snapshot("u").facts[-1]
            ctx_ids = lm.tokenizer(context, add_special_tokens=False)["input_ids"] if context else []
            ids = torch.tensor([mem.store.header_token_ids + ctx_ids + list(fact.token_ids)])
            with torch.inference_mode():
                t0 = time.perf_counter()
                base(input_ids=ids, use_cache=False)
                plain_ms = (time.perf_counter() - t0) * 1e3
            if i >= 2:  # the first two are warm-up
                records.append(
                    {
                        "op": "add",
                        "ms": round(add_ms, 3),
                        "plain_forward_ms": round(plain_ms, 3),
                        "tokens": ids.shape[1],
                    }
                )
                records.append({"op": "add_scoped", "ms": round(scoped_ms, 3)})
        # a user with `facts` memories: filler rows in batches, then real ones to search and delete. The fillers'
        # KV is computed behind nothing (provenance known and empty), so a delete re-encodes only real neighbours
        g = torch.Generator().manual_seed(0)
        cfg = lm.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 1, head_dim(cfg))
        kv = torch.zeros(shape, dtype=lm.dtype)
        for user in ("big", "big2/agent:a"):  # a user; an agent scope of another user
            for start in range(0, facts, 1000):
                n = min(1000, facts - start)
                recs = [
                    FactRecord(f"filler-{start + j}", user, f"filler memory {start + j}", "", "", "", (0,),
                               metadata='{"kind": "%s"}' % ("even" if j % 2 == 0 else "odd"), context_turns=())
                    for j in range(n)
                ]  # fmt: skip
                vecs = torch.nn.functional.normalize(torch.randn(n, emb.dim, generator=g), dim=1)
                mem.store.writes.commit(Write(user, recs, [kv] * n, [kv] * n, vecs, window=window))
        real = mem.add([{"role": "user", "content": t.text} for t in conv.turns[:deletes]], "big", infer=False)
        mem.add([{"role": "user", "content": t.text} for t in conv.turns[:deletes]], "big2", infer=False)
        arms = {
            "search": {"user_id": "big"},
            "search_scoped": {"user_id": "big2", "agent_id": "a"},
            "search_two_scopes": {"user_id": "big2"},
            "search_filtered": {"user_id": "big", "kind": "even"},
        }
        for f in arms.values():
            mem.search("warm up", filters=f, top_k=10)
        qs = [q.question for q in conv.questions[:searches]]
        for q in qs:
            for op, f in arms.items():  # side by side, query by query
                t0 = time.perf_counter()
                mem.search(q, filters=f, top_k=10, threshold=None)
                records.append({"op": op, "ms": round((time.perf_counter() - t0) * 1e3, 3), "facts": facts})
        gone_from_next_search = True
        for r in real["results"]:
            t0 = time.perf_counter()
            mem.delete(r["id"])
            records.append({"op": "delete", "ms": round((time.perf_counter() - t0) * 1e3, 3)})
            hits = mem.search(r["memory"], "big", limit=10)["results"]
            gone_from_next_search &= all(h["id"] != r["id"] for h in hits)
    ops = ("add", "add_scoped", "search", "search_scoped", "search_two_scopes", "search_filtered", "delete")
    by = {op: [r["ms"] for r in records if r["op"] == op] for op in ops}
    plain = [r["plain_forward_ms"] for r in records if r["op"] == "add"]
    summary = {
        "command": "bench memory",
        "model": model,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "window": window,
        "sample": sample,
        "facts_for_search": facts,
        "add_ms": {"p50": median(by["add"]), "p95": p95(by["add"])},
        "plain_forward_ms": {"p50": median(plain), "p95": p95(plain)},
        "add_over_plain_forward_p50": round(median(by["add"]) / median(plain), 3),
        "search_ms": {"p50": median(by["search"]), "p95": p95(by["search"])},
        **{f"{op}_ms": {"p50": median(by[op]), "p95": p95(by[op])} for op in ops if op not in ("add", "search")},
        "delete_ms": {"p50": median(by["delete"]), "p95": p95(by["delete"])},
        "deleted_absent_from_next_search": gone_from_next_search,
        "targets": {"add_over_plain_forward_p50": 1.25, "search_p50_ms": 20, "delete_ms": 50},
        "machine": {**machine(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (op, vals) in zip(
        axes, [("add (infer=False)", by["add"]), ("search", by["search"]), ("delete", by["delete"])]
    ):
        ax.hist(vals, bins=20, color="tab:blue")
        ax.set_title(f"{op}: p50 {median(vals):.1f} ms")
        ax.set_xlabel("ms")
    axes[0].axvline(median(plain), color="tab:gray", ls="--", label="plain forward p50")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Online memory latency ({model}, w={window}, search over {facts} memories)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    plt.close(fig)
    rows = [
        ["add", summary["add_ms"]["p50"], summary["add_ms"]["p95"], f"{summary['add_over_plain_forward_p50']}x plain"],
        ["add, agent scope", summary["add_scoped_ms"]["p50"], summary["add_scoped_ms"]["p95"], "user u + agent a"],
        ["search", summary["search_ms"]["p50"], summary["search_ms"]["p95"], f"{facts} memories"],
        ["search, agent scope", *summary["search_scoped_ms"].values(), f"{facts} memories, user + agent"],
        ["search, user over 2 scopes", *summary["search_two_scopes_ms"].values(), f"{facts + deletes} memories"],
        ["search, metadata filter", *summary["search_filtered_ms"].values(), "half the memories pass"],
        [
            "delete",
            summary["delete_ms"]["p50"],
            summary["delete_ms"]["p95"],
            f"gone from next search: {gone_from_next_search}",
        ],
    ]
    echo(table(rows, ["op", "p50 ms", "p95 ms", "note"]))
    echo(f"wrote {out}/summary.json, records.json, records.csv, memory.png")
    return summary
