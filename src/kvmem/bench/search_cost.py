"""``kvmem bench search``: what one memory search costs at a large memory, by cosine alone and hybrid.

One user gets ``--memories`` memories (default 10,000) whose texts are LoCoMo's observations (every sample of
``--data``, repeated as often as needed, so the full-text index holds real English) with their real MiniLM
embeddings; their KV is a placeholder (one layer, one head, eight channels of zeros): search never reads KV.
Then ``--queries`` LoCoMo questions are searched through ``Memory.search`` (what ``POST /v1/memories/search``
runs: snapshot, filters, embedding the query, the top-k), each once per retrieval, alternating which goes first.
The first search of each retrieval (it builds the user's index) is reported apart; the rest give median and p95.
Target: hybrid's p50 within 1.3x of cosine's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from ..locomo import load_locomo
from ..memory import Memory
from ..retrieve import Embedder
from ..store import FactRecord, Store, Write
from .common import machine, median, p95, table, write_summary_and_records

BATCH = 1000  # memories per commit


def fill(root, n: int, embedder: Embedder, texts: list[str]) -> None:
    """A new store at ``root`` whose user ``u`` has ``n`` memories: ``texts`` cycled, their embeddings, KV zeros."""
    zeros = torch.zeros(1, 1, 1, 8)
    store = Store.create(
        root, {"model": "search-bench", "dtype": "float32"}, "", [], zeros[:, :, :0], zeros[:, :, :0],
        embedder.describe(),
    )  # fmt: skip
    vecs = embedder.embed(texts)
    for start in range(0, n, BATCH):
        idx = [i % len(texts) for i in range(start, min(n, start + BATCH))]
        recs = [FactRecord(f"m{start + j}", "u", texts[i], "", "", "", (1,)) for j, i in enumerate(idx)]
        store.writes.commit(Write("u", recs, [zeros] * len(recs), [zeros] * len(recs), vecs[idx]))
    store.close()


def run(data: Path, out: Path, memories: int, queries: int, k: int, echo=print) -> dict:
    convs = load_locomo(data)
    texts = list(dict.fromkeys(f.text for c in convs for f in c.facts))
    questions = [q.question for c in convs for q in c.questions if q.question.strip()][: queries + 1]
    embedder = Embedder()
    modes = {"cosine": False, "hybrid": True}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-search-") as tmp:
        root = Path(tmp) / "s"
        t0 = time.perf_counter()
        fill(root, memories, embedder, texts)
        fill_s = time.perf_counter() - t0
        mem = Memory(root, embedder=embedder)
        first = {}
        for name, hybrid in modes.items():
            t0 = time.perf_counter()
            mem.search(questions[0], user_id="u", top_k=k, keyword_search=hybrid)
            first[name] = (time.perf_counter() - t0) * 1e3
        records = []
        for i, q in enumerate(questions[1:]):
            order = list(modes.items()) if i % 2 == 0 else list(reversed(modes.items()))
            for name, hybrid in order:
                t0 = time.perf_counter()
                got = mem.search(q, user_id="u", top_k=k, keyword_search=hybrid, threshold=None)
                ms = (time.perf_counter() - t0) * 1e3
                records.append({"retrieval": name, "query": i, "ms": round(ms, 3), "results": len(got["results"])})
        mem.close()
    stats = {
        name: {
            "p50_ms": round(median(r["ms"] for r in records if r["retrieval"] == name), 2),
            "p95_ms": round(p95(r["ms"] for r in records if r["retrieval"] == name), 2),
            "first_ms": round(first[name], 1),
        }
        for name in modes
    }
    ratio = round(stats["hybrid"]["p50_ms"] / stats["cosine"]["p50_ms"], 3)
    summary = {
        "command": "bench search",
        "memories": memories,
        "queries": len(questions) - 1,
        "k": k,
        "fill_s": round(fill_s, 1),
        "search": stats,
        "hybrid_over_cosine_p50": ratio,
        "target": "hybrid p50 <= 1.3x cosine p50",
        "machine": machine(),
    }
    write_summary_and_records(out, summary, records)
    rows = [[name, s["p50_ms"], s["p95_ms"], s["first_ms"]] for name, s in stats.items()]
    echo(table(rows, ["retrieval", "p50 ms", "p95 ms", "first ms"]))
    echo(f"{memories} memories: hybrid p50 / cosine p50 = {ratio}x; wrote {out}/summary.json")
    return summary
