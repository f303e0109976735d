"""``kvmem bench encode``: offline encoding cost per conversation and window, against the model's plain batched
forward over exactly the same token sequences and batches (the limit: encoding is a forward pass plus taps).

Encoding always runs fresh into a temporary store (it is what is being timed), never from the store cache.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from ..compose import PromptFormat
from ..encode import length_batches
from ..hardware import gemm_gflops
from ..locomo_ingest import context_sequences, ingest_conversation
from ..rope import is_length_dependent
from .common import Setup, machine, progress, pyplot, table, write_csv, write_summary_and_records


def fact_sequences(lm, conv, window: int) -> list[list[int]]:
    """The sequences ``ingest_conversation`` encodes: header + ``window`` turns before the fact + the fact."""

    tok = lm.tokenizer
    return context_sequences(tok, PromptFormat.for_tokenizer(tok, lm.chat).header_ids(tok), conv, window)[0]


@torch.inference_mode()
def plain_forward(model, sequences: list[list[int]], max_batch_tokens: int = 2048) -> float:
    """Seconds for the model's plain forward (no hooks, no KV kept) over ``sequences`` batched exactly as
    ``encode.encode_spans`` batches them."""
    device = next(model.parameters()).device
    base = getattr(model, "model", model)
    t0 = time.perf_counter()
    for _, ids in length_batches(sequences, max_batch_tokens, is_length_dependent(base.rotary_emb)):
        base(input_ids=ids.to(device), use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(
    data: Path,
    out: Path,
    windows: list[int],
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    batch_tokens: int = 2048,
    show_progress: bool = True,
    echo=print,
) -> dict:

    setup = Setup.load(data, samples, model, engine, show_progress)
    engine = "hf"  # encoding runs on the transformers model, whatever serves
    info = machine()
    lm = setup.lm
    # warm-up: one small batched forward
    plain_forward(lm.model, fact_sequences(lm, setup.convs[0], 0)[:8], batch_tokens)
    records = []
    bar = progress(len(windows) * len(setup.convs), "encode", show_progress)
    for w in windows:
        for c in setup.convs:
            seqs = fact_sequences(lm, c, w)
            with tempfile.TemporaryDirectory(prefix="kvmem-enc-") as tmp:
                rep = ingest_conversation(
                    lm,
                    setup.embedder,
                    Path(tmp) / "s",
                    c,
                    w,
                    batch_tokens,
                    progress=False,
                    source=str(data),
                    neighbours=0,
                )  # the window's cost alone
            plain_s = plain_forward(lm.model, seqs, batch_tokens)
            n_tok = sum(len(s) for s in seqs)
            assert n_tok == rep.num_encoded_tokens, (n_tok, rep.num_encoded_tokens)
            records.append(
                {
                    "sample": c.sample_id,
                    "window": w,
                    "num_facts": rep.num_facts,
                    "fact_tokens": rep.num_fact_tokens,
                    "encoded_tokens": n_tok,
                    "encode_s": round(rep.encode_s, 4),
                    "embed_s": round(rep.embed_s, 4),
                    "ingest_total_s": round(rep.total_s, 4),
                    "plain_forward_s": round(plain_s, 4),
                    "encode_tokens_per_s": round(n_tok / rep.encode_s, 2),
                    "fact_tokens_per_s": round(rep.num_fact_tokens / rep.encode_s, 2),
                    "plain_tokens_per_s": round(n_tok / plain_s, 2),
                    "fraction_of_plain_forward": round(plain_s / rep.encode_s, 4),
                }
            )
            bar.update(1)
    bar.close()
    # The yardstick: this machine's GEMM rate in the model's dtype, and the linear-layer FLOPs per token
    # (2 x decoder weights; attention scores are small at these lengths and left out, so the fraction is a floor).

    gemm = gemm_gflops(str(lm.dtype).removeprefix("torch."))
    flop_per_token = 2 * sum(
        p.numel() for p in getattr(lm.model, "model", lm.model).layers.parameters() if p.dim() == 2
    )
    per_window = {}
    for w in windows:
        sel = [r for r in records if r["window"] == w]
        enc_s, pl_s = sum(r["encode_s"] for r in sel), sum(r["plain_forward_s"] for r in sel)
        toks = sum(r["encoded_tokens"] for r in sel)
        per_window[str(w)] = {
            "seconds_per_conversation": round(sum(r["ingest_total_s"] for r in sel) / len(sel), 3),
            "encode_seconds_per_conversation": round(enc_s / len(sel), 3),
            "encoded_tokens": toks,
            "fact_tokens": sum(r["fact_tokens"] for r in sel),
            "tokens_per_s": round(toks / enc_s, 2),
            "plain_tokens_per_s": round(toks / pl_s, 2),
            "fraction_of_plain_forward": round(pl_s / enc_s, 4),
            "fraction_of_gemm_rate": round(toks / enc_s * flop_per_token / 1e9 / gemm, 4),
        }
    summary = {
        "dtype": str(lm.dtype).removeprefix("torch."),
        "gemm_gflops": round(gemm, 2),
        "decoder_gflop_per_token": round(flop_per_token / 1e9, 4),
        "command": "bench encode",
        "engine": engine,
        "model": model,
        "data": str(data),
        "windows": windows,
        "samples": [c.sample_id for c in setup.convs],
        "batch_tokens": batch_tokens,
        "by_window": per_window,
        "note": "seconds_per_conversation = full ingest (encode + embed + store write); tokens_per_s counts every "
        "token run through the model (header + window turns + fact); plain forward = same sequences and "
        "batches with no taps and nothing kept (hf engine: encoding always uses transformers)",
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    header = ["window", "s/conv", "encode_s/conv", "tokens", "tok/s", "plain tok/s", "fraction", "of GEMM rate"]
    rows = [
        [
            w,
            s["seconds_per_conversation"],
            s["encode_seconds_per_conversation"],
            s["encoded_tokens"],
            s["tokens_per_s"],
            s["plain_tokens_per_s"],
            s["fraction_of_plain_forward"],
            s["fraction_of_gemm_rate"],
        ]
        for w, s in per_window.items()
    ]
    write_csv(out / "summary.csv", [dict(zip(header, r)) for r in rows])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = list(range(len(windows)))
    ax.bar(
        [x - 0.2 for x in xs],
        [per_window[str(w)]["tokens_per_s"] for w in windows],
        0.4,
        label="kvmem encode (taps + gather)",
        color="tab:blue",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [per_window[str(w)]["plain_tokens_per_s"] for w in windows],
        0.4,
        label="plain batched forward",
        color="tab:gray",
    )
    for x, w in zip(xs, windows):
        ax.text(
            x - 0.2,
            per_window[str(w)]["tokens_per_s"],
            f"{per_window[str(w)]['fraction_of_plain_forward']:.2f}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs, [f"w={w}" for w in windows])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Offline encoding throughput ({model})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "encode.png", dpi=120)
    plt.close(fig)
    echo(table(rows, header))
    echo(f"{summary['dtype']} GEMM rate here: {gemm:.1f} GFLOP/s; decoder {flop_per_token / 1e9:.3f} GFLOP/token")
    echo(f"wrote {out}/summary.json, records.json, records.csv, summary.csv, encode.png")
    return summary
