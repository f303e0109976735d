"""Search latency against the store's size in users: one user's search (naming only ``user_id``, so the scopes
are looked up) on a store of 1 user and on one of U users, each with M memories, all in one tenant.

The stores are built through the store's public write path (``Store.commit``, one commit per user) with fake KV
(2 tokens, [1, 1, 2, 8] per fact) and 16-dimension embeddings from a fixed fake embedder, in a directory (say
under /dev/shm). What grows with U is the scope lookup; the vector search is over the caller's M memories.

    python scripts/bench_scopes.py build --users 10000 --memories 100 --store /dev/shm/scopes-10000
    python scripts/bench_scopes.py search --store /dev/shm/scopes-10000 [--n 300]

``search`` prints one JSON line: p50 and p95 of ``Memory.search`` and ``Memory.get_all`` (ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

DIM = 16
FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}


class FakeEmbedder:
    """Deterministic unit vectors of ``DIM`` floats from a text's hash (what a search embeds its query with)."""

    name = "fake-16"

    def describe(self) -> dict:
        return {"name": self.name, "dim": DIM}

    def embed(self, texts: list[str]) -> torch.Tensor:
        out = []
        for t in texts:
            g = torch.Generator().manual_seed(hash(t) & 0xFFFFFFFF)
            out.append(torch.randn(DIM, generator=g))
        return torch.nn.functional.normalize(torch.stack(out), dim=1)


def build(root: str, users: int, memories: int) -> None:
    from kvmem.store import FactRecord, Store, Write

    header = torch.zeros(1, 1, 3, 8)
    st = Store.create(root, FP, "hdr", [1, 2, 3], header, header.clone(), FakeEmbedder().describe())
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for u in range(users):
        user = f"acme:u{u}"
        facts = [FactRecord(f"u{u}-m{i}", user, f"memory {i} of user {u}", "", "", "", (1, 2)) for i in range(memories)]
        kv = [torch.zeros(1, 1, 2, 8) for _ in facts]
        emb = torch.nn.functional.normalize(torch.randn(memories, DIM, generator=g), dim=1)
        st.writes.commit(Write(user, facts, kv, kv, emb))
        if u % 1000 == 999:
            print(f"{u + 1} users, {time.perf_counter() - t0:.0f} s", flush=True)
    st.close()


def search(root: str, n: int) -> None:
    from kvmem import Memory

    m = Memory(root, embedder=FakeEmbedder())

    def timed(fn) -> dict:
        for _ in range(10):
            fn()
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        ms.sort()
        return {"p50": round(statistics.median(ms), 3), "p95": round(ms[int(0.95 * (len(ms) - 1))], 3)}

    out = {
        "users": len(m.store.reads.users()),
        "search_ms": timed(lambda: m.search("what do I like?", user_id="u0", namespace="acme", top_k=5)),
        "get_all_ms": timed(lambda: m.get_all(user_id="u0", namespace="acme", top_k=100)),
    }
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "search"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--memories", type=int, default=100)
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    if args.what == "build":
        build(args.store, args.users, args.memories)
    else:
        search(args.store, args.n)


if __name__ == "__main__":
    main()
