"""``kvmem bench profile``: one kv-mode request on vLLM, stage by stage, at each k.

Stages (median ms over the questions, each request alone on the engine):

* API process: ``embed`` (the question), ``search`` (the user's FAISS index), ``plan`` (snapshot rows, prompt ids,
  the memory reference);
* the vLLM worker's load of the request's memory (the connector's own timings, ``<metrics_file>.loads``):
  ``snapshot`` (rows and checks), ``read`` (fact KV from the read cache or the segments), ``dequantize``
  (assembly into the model dtype; a copy for native KV), ``rotate`` (chunked RoPE of header and facts),
  ``block_write`` (into the paged KV cache), ``load`` (all of it);
* ``ttft`` (vLLM's first-token latency for the kv request), ``bare`` (the same query ids with no memory: the
  query's own forward) and ``rest = ttft - load - bare``: what the injected tokens add inside vLLM's forward
  (attention over them) plus scheduling and the asynchronous load's hand-off.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .common import (
    Setup,
    bare,
    ensure_store,
    log_err,
    machine,
    median,
    p95,
    progress,
    pyplot,
    ratio,
    select_questions,
    table,
    write_summary_and_records,
)
from .kvformat import format_store

API = ("embed", "search", "plan")
WORKER = ("snapshot", "read", "dequantize", "rotate", "block_write", "load")


def _loads(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def run(
    data: Path,
    out: Path,
    ks: list[int],
    samples: list[str] | None,
    questions: int | None,
    model: str,
    kv_format: str = "native",
    window: int = 5,
    async_load: bool = True,
    show_progress: bool = True,
    echo=print,
) -> dict:
    """Profile kv-mode requests at each k in ``ks`` over ``questions`` of ``samples``' cached stores (or their
    ``kv_format`` copies) on vLLM. Writes summary.json, records.csv/json and profile.png; returns the summary."""
    metrics = Path(tempfile.mkdtemp(prefix="kvmem-profile-")) / "connector.json"
    setup = Setup.load(data, samples, model, "vllm", show_progress)
    setup.engine_options = {
        "metrics_file": str(metrics),
        "vllm_options": {"profile": True, "async_load": async_load},
    }
    qs = select_questions(setup.convs, questions)
    if not qs:
        raise ValueError("no category 1-4 questions in the chosen samples")
    roots = {
        c.sample_id: format_store(
            ensure_store(setup.data, c, setup.lm, setup.embedder, window, log_err, show_progress), kv_format
        )
        for c in setup.convs
    }
    svcs = {s: setup.service(r) for s, r in roots.items()}
    loads_file = Path(f"{metrics}.loads")
    info = machine()
    q0 = qs[0]
    svcs[q0.sample].ask(q0.sample, q0.question, min(ks), "kv", 1)  # warm-up, not recorded
    records = []
    bar = progress(len(qs) * len(ks), "profile", show_progress)
    for q in qs:
        svc = svcs[q.sample]
        b = bare(svc, q.question, 1)
        for k in ks:
            before = (_loads(loads_file) or [{"seq": -1}])[-1]["seq"]
            prep = svc.prepare(q.sample, q.question, k, "kv", 1)
            (gen,) = svc.engine.generate([prep.request(svc.sampling(1))])
            loads = _loads(loads_file)
            stages = loads[-1] if loads and loads[-1]["seq"] > before else {}  # this request's load, if any
            t = prep.timings_ms
            rec = {"qid": q.qid, "sample": q.sample, "k": k, "k_used": len(prep.fact_ids),
                   "embed": t["embed"], "search": t["search"], "plan": t["compose"],
                   **{s: stages.get(s, float("nan")) for s in WORKER},
                   "ttft": gen.ttft_ms, "bare": b["ttft"], "tokens": stages.get("tokens", 0),
                   "cached_tokens": getattr(gen, "num_cached_tokens", 0)}  # fmt: skip
            rec["rest"] = rec["ttft"] - rec["load"] - rec["bare"]
            records.append(rec)
            bar.update(1)
    bar.close()
    setup.close()
    cols = (*API, *WORKER, "bare", "rest", "ttft")
    per_k = {}
    for k in ks:
        sel = [r for r in records if r["k"] == k]
        per_k[str(k)] = {c: round(median(r[c] for r in sel), 3) for c in cols}
        per_k[str(k)]["ttft_p95"] = round(p95(r["ttft"] for r in sel), 3)
        per_k[str(k)]["memory_tokens"] = median(r["tokens"] for r in sel)
    kmin, kmax = str(min(ks)), str(max(ks))
    summary = {
        "command": "bench profile",
        "machine": info,
        "model": model,
        "dtype": str(setup.lm.dtype).removeprefix("torch."),
        "engine": "vllm",
        "async_load": async_load,
        "kv_format": kv_format,
        "window": window,
        "samples": sorted(roots),
        "questions": len(qs),
        "ks": ks,
        "stages_ms": per_k,
        "ttft_kmax_over_kmin": ratio(per_k[kmax]["ttft"], per_k[kmin]["ttft"]),
    }
    write_summary_and_records(out, summary, records)
    plot(out / "profile.png", summary)
    echo(f"vllm, {summary['dtype']}, {kv_format}, async_load={async_load}, {info.get('cpu', '')}; {len(qs)} questions")
    echo(table([[k, per_k[k]["memory_tokens"], *(per_k[k][c] for c in cols)] for k in per_k], ["k", "tokens", *cols]))
    echo(f"ttft k={kmax} / k={kmin}: {summary['ttft_kmax_over_kmin']}")
    return summary


def plot(path: Path, s: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ks = s["ks"]
    bottom = [0.0] * len(ks)
    for stage in (*API, "snapshot", "read", "dequantize", "rotate", "block_write", "bare", "rest"):
        ys = [max(0.0, s["stages_ms"][str(k)][stage]) for k in ks]
        ax.bar([str(k) for k in ks], ys, bottom=bottom, label=stage)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xlabel("k (retrieved facts)")
    ax.set_ylabel("median ms")
    ax.set_title(f"One kv-mode request on vLLM, by stage ({s['dtype']}, {s['kv_format']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
