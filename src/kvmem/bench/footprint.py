"""``kvmem bench footprint``: stored KV bytes per fact token and per conversation vs 2·L·h·d·b, index and
metadata bytes, and the resident memory of the serving process."""

from __future__ import annotations

import os
from pathlib import Path

import faiss

from ..models import head_dim
from ..retrieve import UserIndex
from ..store.segments import read_layout
from .common import (
    Setup,
    log_err,
    machine,
    pyplot,
    rss_bytes,
    select_questions,
    table,
    write_csv,
    write_summary_and_records,
)


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else 0


def run(
    data: Path,
    out: Path,
    window: int,
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    k: int = 10,
    show_progress: bool = True,
    echo=print,
) -> dict:
    rss0 = rss_bytes()
    setup = Setup.load(data, samples, model, engine, show_progress)
    rss_model = rss_bytes()
    info = machine()
    cfg = setup.lm.config

    L, h, d = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg)
    b = setup.lm.dtype.itemsize
    theory = 2 * L * h * d * b
    svcs = setup.services(window, log_err)
    engine = setup.engine_name
    qs = select_questions(setup.convs, questions)
    records = []
    for c in setup.convs:
        svc = svcs[c.sample_id]
        st = svc.store
        ukv = st.reads.snapshot(c.sample_id)
        index = UserIndex(ukv.embeddings.shape[1]).sync(st, ukv)
        index_bytes = int(faiss.serialize_index(index.index).nbytes)
        layouts = []
        for seg in ukv.segments:  # wherever the segments live (a directory or an object store)
            with st.segments.open(st.segment_name(c.sample_id, seg)) as h:
                layouts.append(read_layout(h))
        n_tok = ukv.num_tokens
        kv_bytes, file_bytes = sum(x.nbytes for x in layouts), sum(x.size for x in layouts)
        hk, hv = st.reads.header_kv()
        records.append(
            {
                "sample": c.sample_id,
                "window": window,
                "num_facts": len(ukv.facts),
                "fact_tokens": n_tok,
                "tokens_per_fact": round(n_tok / max(1, len(ukv.facts)), 2),
                "kv_bytes": kv_bytes,
                "kv_file_bytes": file_bytes,
                "kv_bytes_per_token": round(kv_bytes / n_tok, 2),
                "theory_bytes_per_token": theory,
                "measured_over_theory": round(kv_bytes / n_tok / theory, 4),
                "kv_file_bytes_per_token": round(file_bytes / n_tok, 2),
                "header_tokens": int(hk.shape[2]),
                "header_kv_bytes": hk.nbytes + hv.nbytes,
                "embeddings_bytes": ukv.embeddings.numel() * 4,
                "index_bytes": index_bytes,
                "metadata_sqlite_bytes": _size(st.root / "meta.sqlite"),
                "manifest_bytes": _size(st.root / "manifest.json"),
                "store_dir": str(st.root),
            }
        )
    # serve one question per sample so the process holds what serving holds
    for q in qs[: max(1, len(setup.convs))]:
        svcs[q.sample].ask(q.sample, q.question, k, "kv", 8)
    rss_serving = rss_bytes()
    tot_kv = sum(r["kv_bytes"] for r in records)
    summary = {
        "command": "bench footprint",
        "engine": engine,
        "model": model,
        "data": str(data),
        "window": window,
        "samples": [c.sample_id for c in setup.convs],
        "formula": "2 * L * h * d * b",
        "L": L,
        "h": h,
        "d": d,
        "b": b,
        "theory_bytes_per_token": theory,
        "kv_bytes_per_token": round(tot_kv / sum(r["fact_tokens"] for r in records), 2),
        "kv_bytes_per_conversation": {r["sample"]: r["kv_bytes"] for r in records},
        "index_bytes": {r["sample"]: r["index_bytes"] for r in records},
        "metadata_bytes": {r["sample"]: r["metadata_sqlite_bytes"] + r["manifest_bytes"] for r in records},
        "rss_bytes": {
            "before_load": rss0["rss"],
            "model_loaded": rss_model["rss"],
            "serving": rss_serving["rss"],
            "peak": rss_serving["peak_rss"],
        },
        "rss_note": "RSS of this process (model + embedder + every chosen user's KV, index and metadata loaded, "
        "one question answered per user); peak includes ingestion when the store cache was cold",
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    names = [r["sample"] for r in records]
    xs = range(len(records))
    a1.bar(xs, [r["kv_bytes_per_token"] for r in records], color="tab:blue", label="stored KV / fact token")
    a1.axhline(theory, color="k", ls="--", label=f"2·L·h·d·b = {theory} B")
    a1.set_xticks(list(xs), names, rotation=30)
    a1.set_ylabel("bytes per fact token")
    a1.legend(fontsize=8)
    a1.set_title("KV bytes per token")
    w = 0.27
    for i, (key, lab, col) in enumerate(
        (
            ("kv_bytes", "KV", "tab:blue"),
            ("index_bytes", "index", "tab:orange"),
            ("metadata_sqlite_bytes", "metadata", "tab:green"),
        )
    ):
        a2.bar([x + (i - 1) * w for x in xs], [r[key] for r in records], w, label=lab, color=col)
    a2.set_yscale("log")
    a2.set_xticks(list(xs), names, rotation=30)
    a2.set_ylabel("bytes per conversation")
    a2.legend(fontsize=8)
    a2.set_title(f"Per conversation (w={window})")
    fig.tight_layout()
    fig.savefig(out / "footprint.png", dpi=120)
    plt.close(fig)
    header = ["sample", "facts", "tokens", "kv_MB", "B/token", "theory", "index_KB", "meta_KB"]
    rows = [
        [
            r["sample"],
            r["num_facts"],
            r["fact_tokens"],
            r["kv_bytes"] / 2**20,
            r["kv_bytes_per_token"],
            theory,
            r["index_bytes"] / 1024,
            r["metadata_sqlite_bytes"] / 1024,
        ]
        for r in records
    ]
    write_csv(out / "summary.csv", [dict(zip(header, r)) for r in rows])
    echo(table(rows, header))
    rs = summary["rss_bytes"]
    echo(
        f"RSS: {rs['before_load'] / 2**20:.0f} MiB before load, {rs['model_loaded'] / 2**20:.0f} MiB with model, "
        f"{rs['serving'] / 2**20:.0f} MiB serving (peak {rs['peak'] / 2**20:.0f} MiB)"
    )
    echo(f"wrote {out}/summary.json, records.json, records.csv, summary.csv, footprint.png")
    return summary
