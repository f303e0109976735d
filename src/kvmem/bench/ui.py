"""``kvmem bench ui``: how fast ``/ui``'s pages answer for a user with many memories, in a tenant with many users.

A fresh store gets, in tenant ``acme``, one user (``big``) with ``--memories`` memories (default 10,000) of
one token of random KV each (the pages read rows, never KV; one token keeps the fill to seconds and the store
to megabytes), committed 100 at a time with random unit embeddings, as ``chat_cost.fill`` does, and ``--users``
more users with one memory each. ``kvmem serve`` (transformers engine, fp32, one process) serves it; a client
signs in to ``/ui`` as a browser does (the sign-in form, its cookie) and times each page ``--rounds`` times after
one warm-up request:
the users list (first page, a search, a later page), the big user's memories (first and last page), one memory
with its history, its delete preview, the user's turns, and search with score details and the facts a chat
would inject. Ask is left out: its time is the model's (``bench latency`` measures that).

Writes summary.json under ``--out`` (p50 and p95 per page, ms; the machine). Target: every page p50 <= 300 ms.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..store import FactRecord, Store, Write
from .common import free_port, machine, median, p95, served, table, write_json

KEY = "bench-ui-key-0123456789abcdef"
BATCH = 100  # memories per commit


def fill(root: Path, memories: int, users: int, fact_tokens: int, dim: int) -> None:
    """``memories`` memories for acme:big, one for each of ``users`` more users (acme:user00000...)."""
    store = Store.open(root)
    keys, _ = store.reads.header_kv()  # [L, H, h, D]
    L, H, _, D = keys.shape
    g = torch.Generator().manual_seed(0)
    toks = tuple(range(1, fact_tokens + 1))

    def commit(user: str, ids: list[str]) -> None:
        recs = [FactRecord(i, user, f"memory {i} about topic {n % 97}", "", "", "", toks) for n, i in enumerate(ids)]
        kv = [torch.randn(L, H, fact_tokens, D, generator=g).to(keys.dtype) for _ in ids]
        vecs = torch.nn.functional.normalize(torch.randn(len(ids), dim, generator=g), dim=1)
        store.writes.commit(Write(user, tuple(recs), tuple(kv), tuple(kv), vecs))

    for start in range(0, memories, BATCH):
        commit("acme:big", [f"m{j}" for j in range(start, min(memories, start + BATCH))])
    for u in range(users):
        commit(f"acme:user{u:05d}", [f"u{u}"])
    store.close()


def run(out: Path, model: str, memories: int, users: int, rounds: int, fact_tokens: int = 1, echo=print) -> dict:
    import httpx

    from ..retrieve import Embedder

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-ui-") as tmp:
        root, keys = Path(tmp) / "store", Path(tmp) / "keys.json"
        keys.write_text(json.dumps({KEY: "acme"}))
        cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--store", str(root), "--model", model, "--engine", "hf",
               "--dtype", "float32", "--api-keys", str(keys), "--port", str(port)]  # fmt: skip
        with served(cmd, base, out / "server.log"):
            t0 = time.perf_counter()
            fill(root, memories, users, fact_tokens, Embedder().dim)
            fill_s = time.perf_counter() - t0
            echo(f"filled {memories} memories of one user and {users} more users in {fill_s:.0f} s")
            with httpx.Client(base_url=base, timeout=120) as c:
                form = c.get("/ui/login").text
                token = re.search(r'name="csrf" value="([^"]+)"', form).group(1)
                r = c.post("/ui/login", data={"csrf": token, "api_key": KEY})
                if r.status_code != 303:
                    raise RuntimeError(f"signing in to /ui failed: {r.status_code}")
                last, mid = -(-memories // 50), f"m{memories // 2}"
                pages = {
                    "users": "/ui/users",
                    "users (search)": "/ui/users?q=user0042",
                    "users (page 10)": "/ui/users?page=10",
                    "memories (first page)": "/ui/users/big",
                    "memories (last page)": f"/ui/users/big?page={last}",
                    "memory + history": f"/ui/memories/{mid}",
                    "delete preview": f"/ui/memories/{mid}/delete",
                    "turns": "/ui/users/big/turns",
                    "search (k=5)": f"/ui/search?user_id=big&q=memory+{mid}+about+topic&k=5",
                }
                results = {}
                for name, path in pages.items():
                    if c.get(path).status_code != 200:  # the warm-up, and a check
                        raise RuntimeError(f"{path} did not answer 200")
                    ms = []
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        r = c.get(path)
                        ms.append((time.perf_counter() - t0) * 1e3)
                        r.raise_for_status()
                    results[name] = {"path": path, "p50_ms": round(median(ms), 1), "p95_ms": round(p95(ms), 1)}
                    echo(f"{name}: p50 {results[name]['p50_ms']} ms")
    summary = {
        "command": "bench ui",
        "model": model,
        "memories": memories,
        "users": users + 1,
        "rounds": rounds,
        "fill_s": round(fill_s, 1),
        "pages": results,
        "machine": machine(),
    }
    write_json(out / "summary.json", summary)
    rows = [[name, r["p50_ms"], r["p95_ms"], r["path"]] for name, r in results.items()]
    echo(table(rows, ["page", "p50 ms", "p95 ms", "path"]))
    return summary
