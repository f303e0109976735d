"""kv TTFT on vLLM for users with few and with many memories ("crowded users"): the connector's scheduler side
must do the same store work per request whatever the user's memory count.

    flock /tmp/kvmem-heavy.lock .venv/bin/python scripts/crowded_ttft.py \
        [--model qwen2.5-coder-0.5b-instruct] [--counts 64,10000] [--chats 40] [--k 20] [--store DIR] \
        [--distinct N]

One store for the model (kept in ``--store`` when given, so a second run, e.g. of another checkout with
``PYTHONPATH=<it>/src``, reuses it): user ``n<count>`` gets that many memories of ``--fact-tokens`` tokens (random KV
of the model's shape, random unit embeddings, random distinct token ids, through ``Store.commit`` in commits of 100,
in a child process). One vLLM engine (multi-process, as ``kvmem serve`` runs it: the scheduler side in vLLM's engine
core) then answers ``--chats`` LoCoMo questions per user at ``--k`` facts, one new token each, the users alternating
question by question so drift hits both alike, after one warm-up chat per user (the worker's first snapshot of a
version), twice: ``first``, each question's facts read by the worker for the first time (from the page cache or disk:
at 10,000 memories they are not in its read cache); then each user gets a new version holding the same facts (one
memory added and deleted: a new cache salt, so vLLM's prefix cache has none of it) and ``seen`` asks the same
questions again, the facts now in the worker's read cache, so only the per-request work differs between the users.
Per chat: TTFT (engine call -> first token, ``Answer.timings_ms["ttft"]``) and the tokens vLLM prefilled (the query
alone when the memory was injected). Also times, in this process, the scheduler side's per-request check of each
user's memory (``stores.memory_token_ids`` with its cache warm). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

LOCOMO = ("../shared/data/locomo/locomo7.json", "/work/shared/data/locomo/locomo7.json")
CREATE = """
import sys
import torch
from kvmem.engines.select import open_engine
from kvmem.ingest import open_or_create_store
from kvmem.models import head_dim
from kvmem.retrieve import Embedder
from kvmem.store import FactRecord, Store, Write

root, model, dtype, fact_tokens, counts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
lm, emb = open_engine(model, "hf", dtype).lm, Embedder()
st, _ = open_or_create_store(root, lm, emb)
have = {u for u in st.reads.users() if st.reads.user_info(u)["num_facts"] == int(u[1:])}
for u in set(st.reads.users()) - have:  # a fill cut short: written again
    st.writes.delete_user(u)
cfg = lm.config
L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg)
for n in map(int, counts):
    user, g = f"n{n}", torch.Generator().manual_seed(n)
    if user in have:
        continue
    for start in range(0, n, 100):  # distinct token ids per fact: no two prompts share a prefix-cache block
        m = min(100, n - start)
        ids = torch.randint(1000, 20000, (m, fact_tokens), generator=g).tolist()
        recs = [FactRecord(f"m{start + j}", user, f"memory {start + j}", "", "", "", tuple(ids[j])) for j in range(m)]
        keys = [torch.randn(L, H, fact_tokens, D, generator=g).to(lm.dtype) for _ in range(m)]
        vecs = torch.nn.functional.normalize(torch.randn(m, emb.dim, generator=g), dim=1)
        st.writes.commit(Write(user, recs, keys, keys, vecs))
st.close()
"""


def stats(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 2), "p95": round(float(np.percentile(xs, 95)), 2), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--counts", default="64,10000")
    ap.add_argument("--fact-tokens", type=int, default=16)
    ap.add_argument("--chats", type=int, default=40)
    ap.add_argument(
        "--distinct",
        type=int,
        default=0,
        help="Cycle through this many questions (0: all). Few keep the facts a user's requests touch (its working"
        " set: ~20 x distinct facts) alike whatever the user's memory count, so only the count differs.",
    )
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--store", default="", help="Keep the store here (reused if it exists).")
    ap.add_argument("--data", default="", help="LoCoMo file (default: $KVMEM_LOCOMO, or the team's shared data).")
    ap.add_argument("--fill-only", action="store_true", help="Write the store's users, then stop.")
    args = ap.parse_args()

    import kvmem
    from kvmem.bench.common import machine, paired_bootstrap
    from kvmem.engines.vllm import stores
    from kvmem.engines.vllm.params import MemoryRef
    from kvmem.locomo import get_conversation
    from kvmem.service import MemoryService
    from kvmem.store import FactRecord, Write

    counts = [int(c) for c in args.counts.split(",")]
    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="kvmem-crowded-")
    root = str(Path(args.store).resolve() if args.store else Path(tmp.name, "s"))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", CREATE, root, args.model, args.dtype, str(args.fact_tokens), *map(str, counts)],
        check=True,
    )
    fill_s = time.perf_counter() - t0
    if args.fill_only:
        print(json.dumps({"store": root, "fill_s": round(fill_s, 1)}))
        return
    data = next(p for p in [args.data, os.environ.get("KVMEM_LOCOMO"), *LOCOMO] if p and Path(p).exists())
    questions = [q.question for q in get_conversation(Path(data), "conv-26").questions]
    svc = MemoryService.open(root, args.model, engine="vllm", dtype=args.dtype)
    users = [f"n{n}" for n in counts]
    cycle = args.distinct or len(questions)
    asked = [questions[(i % cycle + 1) % len(questions)] for i in range(args.chats)]
    ttft: dict[str, dict[str, list[float]]] = {p: {u: [] for u in users} for p in ("first", "seen")}
    prefilled: dict[str, list[int]] = {u: [] for u in users}

    def ask_all(phase: str) -> None:
        for i, q in enumerate(asked):
            for u in users if i % 2 == 0 else reversed(users):
                ans = svc.ask(u, q, args.k, "kv", max_new_tokens=1)
                ttft[phase][u].append(ans.timings_ms["ttft"])
                prefilled[u].append(ans.prefilled_tokens)

    for u in users:  # warm-up: the worker's snapshot of this version, the index
        svc.ask(u, questions[0], args.k, "kv", max_new_tokens=1)
    ask_all("first")  # each question's facts read by the worker for the first time
    st = svc.store
    for u in users:  # a new version with the same facts: a new cache salt, so no prefix-cache hit follows
        ukv = st.reads.snapshot(u)
        f, (keys, values) = ukv.facts[0], ukv.fact_kv(0)
        bump = FactRecord(f"bump-{uuid.uuid4().hex}", u, f.text, "", "", "", f.token_ids)
        st.writes.commit(Write(u, [bump], [keys], [values], ukv.embeddings[:1].clone()))
        st.writes.commit(Write(u, delete=[bump.fact_id]))
        svc.ask(u, questions[0], args.k, "kv", max_new_tokens=1)  # the worker's snapshot of the new version
    ask_all("seen")  # the same facts again: in the worker's read cache, injected anew under the new salt
    # the scheduler side's check alone, in this process (its token cache warm after the first call)
    check_ms = {}
    st = svc.store
    for u in users:
        ukv = st.reads.snapshot(u)
        ids = [f.fact_id for f in ukv.facts[: args.k]]
        ref = MemoryRef(root, st.manifest["store_id"], u, ukv.version, ids)
        stores.memory_token_ids(ref)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            stores.memory_token_ids(ref)
            times.append((time.perf_counter() - t) * 1e3)
        check_ms[u] = stats(times)
    ratios = {p: round(statistics.median(t[users[-1]]) / statistics.median(t[users[0]]), 3) for p, t in ttft.items()}
    # the same question, asked of both users back to back: the per-question difference and its 95% CI; a CI
    # that holds 0 is "equal within noise"
    paired = {}
    for p, t in ttft.items():
        mean, ci = paired_bootstrap(b - a for a, b in zip(t[users[0]], t[users[-1]]))
        paired[p] = {"mean_ms": mean, "ci95_ms": ci, "equal_within_noise": ci is not None and ci[0] <= 0 <= ci[1]}
    out = {
        "kvmem": str(Path(kvmem.__file__).parent),
        "model": args.model,
        "dtype": args.dtype,
        "k": args.k,
        "fact_tokens": args.fact_tokens,
        "distinct_questions": min(cycle, args.chats),
        "fill_s": round(fill_s, 1),
        "ttft_ms": {p: {u: stats(t[u]) for u in users} for p, t in ttft.items()},
        "prefilled_tokens_p50": {u: statistics.median(prefilled[u]) for u in users},
        "largest_over_smallest_p50": ratios,
        "largest_minus_smallest_paired": paired,
        "scheduler_check_ms": check_ms,
        "machine": machine(),
    }
    svc.engine.close()
    svc.close()
    print(json.dumps(out, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
