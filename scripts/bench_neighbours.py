"""Peak memory of one write's neighbour choice against a scope of N memories (what each batch of an import runs
before encoding): the scope read as a snapshot and searched whole (``--mode snapshot``, the write path before
``ingest.scope_neighbours``) or a page of embeddings at a time (``--mode paged``, now). No model: the scope is built
through ``Store.commit`` with fake KV, 384-dimension embeddings (MiniLM's) and 25 token ids a memory.

    python scripts/bench_neighbours.py build --memories 10000 --store /dev/shm/nb-10000
    python scripts/bench_neighbours.py measure --store /dev/shm/nb-10000 --mode paged

``measure`` prints one JSON line: memories, mode, seconds, growth (peak RSS minus RSS before, bytes), in a fresh
process after the store is opened and the peak reset (``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DIM, TOKENS, NEW = 384, 25, 32
FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def build(root: str, memories: int) -> None:
    from kvmem.store import FactRecord, Store, Write

    hk = torch.zeros(1, 1, 3, 8)
    st = Store.create(root, FP, "hdr", [1, 2, 3], hk, hk.clone(), {"name": "fake", "dim": DIM})
    g = torch.Generator().manual_seed(0)
    for lo in range(0, memories, 1000):
        n = min(1000, memories - lo)
        facts = [
            FactRecord(f"m{i}", "acme:u", f"Bulk fact number {i} is about topic {i % 97}.", "", "", "",
                       tuple(range(1000 + i, 1000 + i + TOKENS)))
            for i in range(lo, lo + n)
        ]  # fmt: skip
        kv = [torch.zeros(1, 1, TOKENS, 8) for _ in facts]
        st.writes.commit(
            Write("acme:u", facts, kv, kv, torch.nn.functional.normalize(torch.randn(n, DIM, generator=g), dim=1))
        )
    st.close()


def measure(root: str, mode: str) -> None:
    from kvmem.ingest import neighbour_prefixes, scope_neighbours
    from kvmem.store import Store

    st = Store.open(root, FP)
    n = st.reads.user_info("acme:u")["num_facts"]
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.functional.normalize(torch.randn(NEW, DIM, generator=g), dim=1)
    ids = [list(range(900_000 + j * TOKENS, 900_000 + (j + 1) * TOKENS)) for j in range(NEW)]
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = status("VmRSS")
    t0 = time.perf_counter()
    if mode == "snapshot":  # what write_facts did before: the scope's snapshot, searched whole
        ukv = st.reads.snapshot("acme:u")
        pool_emb, pool_ids = ukv.embeddings, [list(f.token_ids) for f in ukv.facts]
        chosen = neighbour_prefixes(emb, ids, pool_emb, pool_ids, 4)[1]
    else:
        chosen = scope_neighbours(st, "acme:u", emb, ids, [f"new{j}" for j in range(NEW)], set(), 4)[1]
    seconds = time.perf_counter() - t0
    peak = status("VmHWM")
    assert all(len(c) == 4 for c in chosen)
    print(json.dumps({"memories": n, "mode": mode, "seconds": round(seconds, 3), "growth": peak - before}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "measure"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--memories", type=int, default=10_000)
    ap.add_argument("--mode", choices=["snapshot", "paged"], default="paged")
    a = ap.parse_args()
    build(a.store, a.memories) if a.what == "build" else measure(a.store, a.mode)


if __name__ == "__main__":
    main()
