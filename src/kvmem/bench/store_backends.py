"""``kvmem bench store``: the local store and the shared store (rows in PostgreSQL, KV segments in an object
store) side by side in one run, on one machine.

Both stores are created for the same model; every step runs on both, interleaved where it can be:

* ``add``: ``Memory.add(turn, infer=False)`` of LoCoMo turns, one turn per add, window 5 (context encoding,
  embedding, one commit), alternating which backend goes first;
* ``delete``: ``Memory.delete`` of some of them;
* ``search``: ``Memory.search`` at ``--memories`` memories of one user (written in commits of 100 with random KV,
  as ``bench chat-cost`` does; the first search, which builds the index, is left out);
* ``gather``: ``snapshot`` plus ``UserKV.gather`` of k = 20 and k = 50 random facts of that user, from a cold
  cache (``drop_caches`` first: rows, KV and checksums read again) and from a warm one (the same facts again);
* ``ttft``: kv-mode time to the first streamed token at k = 20 through ``kvmem serve`` (the transformers
  engine; three servers up at once, one request at a time, the order rotating, so each arm gets the same CPU):
  on the local store; on the shared store with a warm cache (``--cache-dir``, the in-memory cache at its
  default); on the shared store with a cold one (``--cache-bytes 1``: every request reads its facts' KV from the
  object store again).

PostgreSQL is the one at ``--postgres`` (``scripts/postgres.sh start DIR`` runs a local one, fsync on); the store
goes into a fresh schema there, dropped afterwards. The object store is ``--segments`` (default: a ``file://``
directory under the run's temp dir, through obstore). Targets: warm shared TTFT <= 1.10x local, shared add p50
<= 1.25x local, search p50 <= 20 ms at 10,000 memories. Writes summary.json, records.json/csv and
store_backends.png under ``--out``.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx

from ..extras import require
from ..locomo import get_conversation
from ..memory import Memory
from ..models import head_dim, load
from ..retrieve import Embedder
from ..store import Store
from .common import (
    first_token_ms,
    free_port,
    machine,
    median,
    p95,
    pyplot,
    served_together,
    table,
    write_summary_and_records,
)

BACKENDS = ("local", "shared")
TTFT_ARMS = ("local", "shared-warm", "shared-cold")


def schema_url(postgres: str, schema: str) -> str:
    """``postgres`` with its connections' search_path set to ``schema`` (libpq's ``options``)."""
    parts = urlsplit(postgres)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"] + [("options", f"-csearch_path={schema}")]
    return urlunsplit(parts._replace(query=urlencode(query)))


def _pg(postgres: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute(sql)


def _timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - t0) * 1e3


def run(
    data: Path,
    out: Path,
    model: str,
    postgres: str,
    segments: str | None = None,
    adds: int = 40,
    deletes: int = 10,
    memories: int = 10_000,
    searches: int = 40,
    gathers: int = 20,
    chats: int = 20,
    k: int = 20,
    sample: str = "conv-26",
    echo=print,
) -> dict:
    """Raises MissingExtra without psycopg or obstore (the shared store's rows and segments)."""
    require("postgres", "kvmem bench store")
    require("s3", "kvmem bench store")
    conv = get_conversation(data, sample)
    turns = [t.text for t in conv.turns][:adds]
    questions = [q.question for q in conv.questions]
    tmp = Path(tempfile.mkdtemp(prefix="kvmem-bench-store-"))
    schema = f"kvmem_bench_{uuid.uuid4().hex[:8]}"
    _pg(postgres, f'CREATE SCHEMA "{schema}"')
    where = {"local": str(tmp / "local"), "shared": schema_url(postgres, schema)}
    seg_url = segments or (tmp / "objects").as_uri()
    records: list[dict] = []
    try:
        lm, emb = load(model), Embedder()
        mems = {
            b: Memory(where[b], model=lm, embedder=emb, window=5, segments_url=seg_url if b == "shared" else None)
            for b in BACKENDS
        }
        ids: dict[str, list[str]] = {b: [] for b in BACKENDS}
        for i, text in enumerate(turns[:adds]):
            for b in BACKENDS if i % 2 else BACKENDS[::-1]:
                t0 = time.perf_counter()
                r = mems[b].add(text, "u", infer=False)
                records.append({"op": "add", "backend": b, "ms": (time.perf_counter() - t0) * 1e3})
                ids[b] += [m["id"] for m in r["results"]]
        for i in range(deletes):
            for b in BACKENDS if i % 2 else BACKENDS[::-1]:
                records.append({"op": "delete", "backend": b, "ms": _timed(mems[b].delete, ids[b][i])})
        echo(f"bench store: {adds} adds and {deletes} deletes on each backend")
        cfg = lm.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg))
        dtype = str(lm.dtype).removeprefix("torch.")
        t0 = time.perf_counter()
        fills = {}  # both stores at once: set-up, not timed
        for b in BACKENDS:
            args = (where[b], "big", memories, 16, emb.dim, shape, dtype)
            code = f"from kvmem.bench.chat_cost import fill; fill(*{args!r})"
            fills[b] = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        for b, child in fills.items():
            err = child.communicate()[1]
            if child.returncode != 0:
                raise RuntimeError(f"filling the {b} store failed: {err[-500:]}")
        echo(f"bench store: {memories:,} memories into each store in {time.perf_counter() - t0:.0f} s")
        for i in range(searches + 1):
            for b in BACKENDS if i % 2 else BACKENDS[::-1]:
                ms = _timed(mems[b].search, questions[i % len(questions)], "big", limit=k)
                if i:
                    records.append({"op": "search", "backend": b, "ms": ms})
        rng = random.Random(0)
        readers = {b: Store.open(where[b]) for b in BACKENDS}
        for n in (20, 50):
            for i in range(gathers):
                rows = rng.sample(range(memories), n)
                for b in BACKENDS if i % 2 else BACKENDS[::-1]:
                    st = readers[b]
                    st.reads.forget()
                    for cache in ("cold", "warm"):
                        t0 = time.perf_counter()
                        st.reads.snapshot("big").gather(rows)
                        records.append(
                            {"op": f"gather{n}-{cache}", "backend": b, "ms": (time.perf_counter() - t0) * 1e3}
                        )
        for st in readers.values():
            st.close()
        for m in mems.values():
            m.store.close()
        del mems, lm
        echo("bench store: search and gather done; TTFT through kvmem serve, three servers, requests alternating")
        arms = {
            "local": (where["local"], []),
            "shared-warm": (where["shared"], ["--cache-dir", str(tmp / "cache")]),
            "shared-cold": (where["shared"], ["--cache-bytes", "1"]),
        }
        ports = {arm: free_port() for arm in arms}
        bases = {arm: f"http://127.0.0.1:{port}" for arm, port in ports.items()}
        serve = [sys.executable, "-m", "kvmem.cli", "serve", "--engine", "hf"]
        specs = [
            (serve + ["--store", store, "--port", str(ports[arm]), *extra], bases[arm], out / f"server-{arm}.log")
            for arm, (store, extra) in arms.items()
        ]
        with ExitStack() as stack:
            stack.enter_context(served_together(specs))  # started at once: their model loads overlap
            clients = {
                arm: stack.enter_context(httpx.Client(base_url=base, timeout=600)) for arm, base in bases.items()
            }
            for i in range(chats + 1):  # one request at a time, the arms' order rotating: the same CPU for each
                order = list(TTFT_ARMS[i % 3 :] + TTFT_ARMS[: i % 3])
                for arm in order:
                    ms = first_token_ms(clients[arm], model, "u", questions[i % len(questions)], k)
                    if i:  # the first chat builds the user's index and opens every segment: left out
                        records.append({"op": "ttft", "backend": arm, "ms": ms})
    finally:
        _pg(postgres, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        shutil.rmtree(tmp, ignore_errors=True)

    def stat(op: str, backend: str) -> dict:
        xs = [r["ms"] for r in records if r["op"] == op and r["backend"] == backend]
        return {"p50": round(median(xs), 2), "p95": round(p95(xs), 2), "n": len(xs)}

    ops = ["add", "delete", "search", "gather20-cold", "gather20-warm", "gather50-cold", "gather50-warm"]
    per_op = {op: {b: stat(op, b) for b in BACKENDS} for op in ops}
    per_op["ttft"] = {a: stat("ttft", a) for a in TTFT_ARMS}
    ratio = lambda op, a, b: round(per_op[op][a]["p50"] / per_op[op][b]["p50"], 3)
    summary = {
        "command": "bench store",
        "model": model,
        "engine": "hf",
        "k": k,
        "memories": memories,
        "segments": "file:// (obstore)" if segments is None else urlsplit(segments).scheme + "://",
        "postgres": "fsync per the server's settings, unix socket" if "host=/" in postgres else "network",
        "per_op": per_op,
        "ratios": {
            "add_shared_over_local_p50": ratio("add", "shared", "local"),
            "ttft_shared_warm_over_local_p50": ratio("ttft", "shared-warm", "local"),
            "ttft_shared_cold_over_local_p50": ratio("ttft", "shared-cold", "local"),
        },
        "targets": {
            "ttft_shared_warm_over_local_p50": 1.10,
            "add_shared_over_local_p50": 1.25,
            "search_p50_ms_at_10k": 20.0,
        },
        "machine": {**machine(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = ops + [f"ttft ({a})" for a in TTFT_ARMS]
    xs = range(len(names))
    loc = [per_op[op]["local"]["p50"] for op in ops] + [per_op["ttft"]["local"]["p50"], 0, 0]
    sh = [per_op[op]["shared"]["p50"] for op in ops] + [0] + [per_op["ttft"][a]["p50"] for a in TTFT_ARMS[1:]]
    ax.bar([x - 0.2 for x in xs], loc, width=0.4, color="tab:blue", label="local (SQLite + files)")
    ax.bar([x + 0.2 for x in xs], sh, width=0.4, color="tab:orange", label="shared (PostgreSQL + obstore)")
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("p50, ms (log)")
    ax.set_title(f"local vs shared store ({model}, k={k}, {memories:,} memories for search/gather)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "store_backends.png", dpi=120)
    plt.close(fig)
    rows = [[op, per_op[op]["local"]["p50"], per_op[op]["shared"]["p50"], per_op[op]["shared"]["p95"]] for op in ops]
    rows += [[f"ttft {a}", per_op["ttft"][a]["p50"], "", per_op["ttft"][a]["p95"]] for a in TTFT_ARMS]
    echo(table(rows, ["op", "local p50 ms", "shared p50 ms", "shared p95 ms"]))
    echo(f"ratios: {summary['ratios']}")
    return summary
