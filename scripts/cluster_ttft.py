"""kv TTFT through the one-machine cluster against one ``kvmem serve`` process on the same machine.

    sudo .venv/bin/python scripts/cluster_ttft.py [--chats 20] [--k 20] [--memories 30] [--out runs/bench/cluster-ttft]

Builds the cluster of ``tests/cluster.py`` (namespaces head, w1, w2, db, s3; PostgreSQL over TCP with a password,
``rclone serve s3``, a Ray head and two workers, ``kvmem serve --replicas 2 --ray-address`` with the small model on
the transformers engine), and beside it, in the head's namespace, one ``kvmem serve`` process on a local store
(same model, engine, API key and ``--max-tokens``). A client in the head's namespace gives one user the same
``--memories`` LoCoMo facts on both (``POST /v1/memories``, ``infer: false``), then asks ``--chats`` questions
of each, one request at a time and alternating (the same CPU for both), each a streamed kv-mode chat at
``--k``: the time to the first content token, as a client sees it. Two warm-up chats each are left out (the
user's index, the replica's first snapshot). Prints the table (markdown) and writes ``--out/summary.json``;
always takes the cluster down. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
SINGLE_PORT = 8100
USER = "ttft-user"
LOCOMO = ("../shared/data/locomo/locomo7.json", "/work/shared/data/locomo/locomo7.json")


def measure(cluster_url: str, single_url: str, key: str, model: str, data: str, memories: int, chats: int, k: int,
            out: str):  # fmt: skip
    """In the head's namespace: seed both, then time the chats alternating; writes ``out`` (JSON)."""
    import httpx

    from kvmem.bench.common import first_token_ms
    from kvmem.locomo import get_conversation

    conv = get_conversation(Path(data), "conv-26")
    facts, questions = [f.text for f in conv.facts[:memories]], [q.question for q in conv.questions]
    arms = {
        name: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)
        for name, url in (("cluster", cluster_url), ("single", single_url))
    }
    for c in arms.values():
        for text in facts:
            body = {"messages": text, "user_id": USER, "infer": False}
            c.post("/v1/memories", json=body).raise_for_status()
    ttft: dict[str, list[float]] = {a: [] for a in arms}
    for i in range(chats + 2):
        names = list(arms) if i % 2 == 0 else list(arms)[::-1]
        for a in names:
            ms = first_token_ms(arms[a], model, USER, questions[i % len(questions)], k)
            if ms != ms:
                raise RuntimeError(f"{a}: the stream ended without content")
            if i >= 2:
                ttft[a].append(ms)
    Path(out).write_text(json.dumps(ttft))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "measure":
        a = sys.argv[2:]
        measure(a[0], a[1], a[2], a[3], a[4], int(a[5]), int(a[6]), int(a[7]), a[8])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--memories", type=int, default=30)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/cluster-ttft"))
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/kvmc-ttft"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("error: needs root (network namespaces)", file=sys.stderr)
        return 2
    if a.memories < a.k:
        print("error: --memories must be >= --k", file=sys.stderr)
        return 2
    data = next((p for p in [os.environ.get("KVMEM_LOCOMO"), *LOCOMO] if p and Path(p).exists()), None)
    if data is None:
        print("error: LoCoMo data not found (set KVMEM_LOCOMO)", file=sys.stderr)
        return 2
    from cluster import INGRESS_PORT, NODES, Cluster
    from kvmem.bench.common import machine, markdown_table, median, p95

    a.out.mkdir(parents=True, exist_ok=True)
    raw = (a.out / "ttft_ms.json").resolve()
    c = Cluster(a.run_dir)
    try:
        c.up(a.model)
        keys = c.run / "keys.json"
        single = c.run / "single-store"
        c.spawn("single", "head", [Path(sys.executable).with_name("kvmem"), "serve", "--store", single, "--model",
                                   a.model, "--engine", "hf", "--host", "127.0.0.1", "--port", SINGLE_PORT,
                                   "--api-keys", keys, "--max-tokens", 8])  # fmt: skip
        c.wait_port("head", "127.0.0.1", SINGLE_PORT, timeout=600, proc="single")
        cluster_url = f"http://{NODES['head']}:{INGRESS_PORT}"
        p = c.spawn("measure", "head", [sys.executable, __file__, "measure", cluster_url,
                                        f"http://127.0.0.1:{SINGLE_PORT}", c.api_key, a.model, Path(data).resolve(),
                                        a.memories, a.chats, a.k, raw])  # fmt: skip
        if p.wait(timeout=1800) != 0:
            print(f"error: the measurement failed; see {c.run}/logs/measure.log", file=sys.stderr)
            return 1
        placement = c.placement()
    finally:
        c.down()
    ttft = json.loads(raw.read_text())

    def stat(xs):
        return {"p50": round(median(xs), 1), "p95": round(p95(xs), 1), "n": len(xs)}

    summary = {
        "model": a.model,
        "engine": "hf",
        "k": a.k,
        "memories": a.memories,
        "chats": a.chats,
        "placement": placement,
        "ttft_ms": {arm: stat(xs) for arm, xs in ttft.items()},
        "cluster_over_single_p50": round(median(ttft["cluster"]) / median(ttft["single"]), 3),
        "machine": machine(),
    }
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    t = summary["ttft_ms"]
    arms = (("single", "one kvmem serve process, local store"), ("cluster", "the cluster's ingress"))
    rows = [[what, f"{t[arm]['p50']} / {t[arm]['p95']}", t[arm]["n"]] for arm, what in arms]
    print(markdown_table(rows, ["arm", "kv TTFT p50 / p95, ms", "chats"]))
    print(f"cluster / single at p50: {summary['cluster_over_single_p50']}x; wrote {a.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
