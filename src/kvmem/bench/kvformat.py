"""``kvmem bench kvformat``: what each stored KV format costs and changes, side by side in one run.

Each format's stores are ``kvmem store copy --kv-format`` copies of the cached native (lossless) stores, so every
format holds the same facts, embeddings and retrieval order, and differs only in how the KV is kept.

* **bytes**: segment bytes on disk (scales and safetensors headers included) per live fact token, and over what
  the same KV takes in bf16 (``L * H * D * 2 * 2`` bytes per token).
* **deviation** (the transformers model, fp32 or the store's dtype): for each question, the top-k facts of the
  native store are composed from every store, injected, and the query prefilled: max and mean |logit - native
  logit| at the query's last position, and how many of 20 greedy tokens equal the native store's, position by
  position (a divergence counts every later position as differing).
* **ttft**: kv-mode TTFT on the serving engine at each k, the formats interleaved question by question in
  alternating order (drift hits them alike), median and p95, and each format over native.
* **f1** (``f1_questions`` > 0): LoCoMo F1 of kv-mode answers at ``deviation_k`` from every format's stores,
  batched on the serving engine, and each format's F1 minus native's with a paired bootstrap 95% CI
  (``common.paired_bootstrap``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..compose import compose
from ..engines.hf import build_cache
from ..kvformat import check_format
from ..rope import Rotary
from ..store import Store, copy_store
from .common import (
    Setup,
    ensure_store,
    log_err,
    log_k_axis,
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

STEPS = 20  # greedy tokens compared per question


def format_store(native: Path, fmt: str, log=log_err) -> Path:
    """The ``fmt`` copy of the native store at ``native`` (beside it, made once)."""
    if fmt == "native":
        return native
    root = native.with_name(f"{native.name}-{fmt}")
    if Store.exists(root):
        st, src = Store.open(root), Store.open(native)
        try:
            if st.kv_format == fmt and set(st.reads.users()) == set(src.reads.users()):
                return root
        finally:
            st.close()
            src.close()
        shutil.rmtree(root)
    report = copy_store(native, root, kv_format=fmt)
    log(f"copied {report['facts']} facts of {native} into {fmt} -> {root}")
    return root


def footprint(root: Path) -> dict:
    """Segment bytes per live fact token of the store at ``root``, and over bf16's."""
    st = Store.open(root)
    try:
        tokens = sum(f.num_tokens for u in st.reads.users() for f in st.reads.snapshot(u).facts)
        nbytes = st.segments.nbytes()
        fp = st.fingerprint
        bf16 = fp["num_layers"] * fp["num_kv_heads"] * fp["head_dim"] * 2 * 2
        per = nbytes / max(1, tokens)
        return {"segment_bytes": nbytes, "fact_tokens": tokens, "bytes_per_token": round(per, 1),
                "over_bf16": round(per / bf16, 4), "bf16_bytes_per_token": bf16}  # fmt: skip
    finally:
        st.close()


@torch.inference_mode()
def _greedy(model, mem, query_ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Inject ``mem``, prefill ``query_ids``: (the last position's logits [V] fp32, ``steps`` greedy tokens)."""
    cache = build_cache(model, mem)
    dev = next(model.parameters()).device
    pos = mem.end
    ids = torch.tensor([query_ids], device=dev)
    logits = model(ids, past_key_values=cache, position_ids=torch.arange(pos, pos + len(query_ids), device=dev)[None])
    last = logits.logits[0, -1].float()
    first, tokens, pos = last.cpu(), [], pos + len(query_ids)
    for _ in range(steps):
        t = int(last.argmax())
        tokens.append(t)
        out = model(
            torch.tensor([[t]], device=dev), past_key_values=cache, position_ids=torch.tensor([[pos]], device=dev)
        )
        last, pos = out.logits[0, -1].float(), pos + 1
    return first, tokens


def _agreement(a: list[int], b: list[int]) -> int:
    """Positions of ``a`` equal to ``b`` up to their first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(
    data: Path,
    out: Path,
    ks: list[int],
    formats: list[str],
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    window: int = 5,
    deviation_k: int = 20,
    show_progress: bool = True,
    echo=print,
    f1_questions: int = 0,
    max_new_tokens: int = 32,
) -> dict:
    """Bytes, deviation and TTFT of each format in ``formats`` (native first, added if missing) over the cached
    stores of ``samples``; ``questions`` of category 1-4. Writes summary.json, records.csv/json and
    kvformat.png to ``out``; returns the summary."""
    formats = ["native"] + [check_format(f) for f in formats if f != "native"]
    setup = Setup.load(data, samples, model, engine, show_progress)
    qs = select_questions(setup.convs, questions)
    if not qs:
        raise ValueError("no category 1-4 questions in the chosen samples")
    lm = setup.lm
    roots = {
        c.sample_id: ensure_store(setup.data, c, lm, setup.embedder, window, log_err, show_progress)
        for c in setup.convs
    }
    stores = {fmt: {s: format_store(r, fmt) for s, r in roots.items()} for fmt in formats}
    sizes = {fmt: footprint(next(iter(stores[fmt].values()))) for fmt in formats}
    info = machine()
    records: list[dict] = []

    # deviation: the transformers model on each store's composed memory, native's fact ids for all
    rot = Rotary.for_model(lm.model)
    opened = {fmt: {s: Store.open(r) for s, r in by.items()} for fmt, by in stores.items()}
    svcs = {fmt: {s: setup.service(r) for s, r in by.items()} for fmt, by in stores.items()}
    bar = progress(len(qs), "kvformat deviation", show_progress)
    for q in qs:
        prep = svcs["native"][q.sample].prepare(q.sample, q.question, deviation_k, "kv", 1)
        got = {}
        for fmt in formats:
            st = opened[fmt][q.sample]
            ukv = st.reads.snapshot(q.sample)
            rows = ukv.row_of()
            mem = compose(rot, st.header_token_ids, st.reads.header_kv(), ukv, [rows[f] for f in prep.fact_ids])
            got[fmt] = _greedy(lm.model, mem, list(prep.prompt_ids[len(mem.token_ids) :]), STEPS)
        for fmt in formats[1:]:
            d = (got[fmt][0] - got["native"][0]).abs()
            records.append({"arm": "deviation", "kv_format": fmt, "qid": q.qid, "sample": q.sample,
                            "k": len(prep.fact_ids), "max_abs_dlogit": round(float(d.max()), 5),
                            "mean_abs_dlogit": round(float(d.mean()), 6),
                            "greedy_agree": _agreement(got[fmt][1], got["native"][1]), "steps": STEPS})  # fmt: skip
        bar.update(1)
    bar.close()
    for by in opened.values():
        for st in by.values():
            st.close()

    # ttft on the serving engine, formats interleaved
    q0 = qs[0]
    for fmt in formats:  # warm-up (not recorded)
        svcs[fmt][q0.sample].ask(q0.sample, q0.question, min(ks), "kv", 1)
    bar = progress(len(qs) * len(ks) * len(formats), "kvformat ttft", show_progress)
    for qi, q in enumerate(qs):
        order = formats if qi % 2 == 0 else formats[::-1]
        for k in ks:
            for fmt in order:
                a = svcs[fmt][q.sample].ask(q.sample, q.question, k, "kv", 1)
                records.append({"arm": "ttft", "kv_format": fmt, "qid": q.qid, "sample": q.sample, "k": k,
                                "k_used": a.k, "ttft": a.timings_ms["ttft"], "q2ft": a.timings_ms["total"],
                                "prefilled_tokens": a.prefilled_tokens})  # fmt: skip
                bar.update(1)
    bar.close()
    f1 = _f1_arm(setup, svcs, formats, f1_questions, deviation_k, max_new_tokens, records, show_progress)
    engine_name = setup.engine_name
    setup.close()

    dev = {}
    for fmt in formats[1:]:
        sel = [r for r in records if r["arm"] == "deviation" and r["kv_format"] == fmt]
        dev[fmt] = {
            "max_abs_dlogit": max(r["max_abs_dlogit"] for r in sel),
            "median_max_abs_dlogit": round(median(r["max_abs_dlogit"] for r in sel), 5),
            "mean_abs_dlogit": round(sum(r["mean_abs_dlogit"] for r in sel) / len(sel), 6),
            "greedy_agree_mean": round(sum(r["greedy_agree"] for r in sel) / len(sel), 2),
            "greedy_all_20": sum(r["greedy_agree"] == STEPS for r in sel),
            "questions": len(sel),
        }
    ttft = {fmt: {} for fmt in formats}
    for fmt in formats:
        for k in ks:
            sel = [r["ttft"] for r in records if r["arm"] == "ttft" and r["kv_format"] == fmt and r["k"] == k]
            ttft[fmt][str(k)] = {"p50": round(median(sel), 2), "p95": round(p95(sel), 2)}
    ratios = {
        fmt: {str(k): ratio(ttft[fmt][str(k)]["p50"], ttft["native"][str(k)]["p50"]) for k in ks} for fmt in formats[1:]
    }
    summary = {
        "command": "bench kvformat",
        "machine": info,
        "model": model,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "engine": engine_name,
        "window": window,
        "samples": sorted(roots),
        "questions": len(qs),
        "ks": ks,
        "deviation_k": deviation_k,
        "bytes": sizes,
        "deviation": dev,
        "ttft_ms": ttft,
        "ttft_over_native": ratios,
        "f1": f1,
    }
    write_summary_and_records(out, summary, records)
    plot(out / "kvformat.png", summary)
    rows = [[fmt, sizes[fmt]["bytes_per_token"], sizes[fmt]["over_bf16"],
             *(dev.get(fmt, {}).get(x, "-") for x in ("max_abs_dlogit", "mean_abs_dlogit", "greedy_agree_mean")),
             *(f"{ttft[fmt][str(k)]['p50']:.0f}" + (f" ({ratios[fmt][str(k)]:.2f}x)" if fmt in ratios else "")
               for k in ks)] for fmt in formats]  # fmt: skip
    echo(f"{engine_name}, {summary['dtype']}, {info.get('cpu', '')}; {len(qs)} questions")
    echo(table(rows, ["format", "B/token", "/bf16", "max|dlogit|", "mean|dlogit|", "greedy/20",
                      *(f"ttft k={k}" for k in ks)]))  # fmt: skip
    for fmt, v in f1.items():
        extra = f", delta {v['delta']} (95% CI {v['ci95']}), same answer {v['same_answer']}" if "delta" in v else ""
        echo(f"F1 {fmt}: {v['f1']} on {v['questions']} questions{extra}")
    return summary


def _f1_arm(setup, svcs, formats, n, k, max_new_tokens, records, show_progress) -> dict:
    """LoCoMo F1 per format on ``n`` questions (kv mode, top ``k``), and the paired difference to native."""
    if n <= 0:
        return {}
    import numpy as np

    from .common import answer_batch, paired_bootstrap
    from .eval_locomo import BATCH, locomo_f1

    qs = select_questions(setup.convs, n)
    scores = {fmt: [] for fmt in formats}
    bar = progress(len(qs) * len(formats), "kvformat f1", show_progress)
    for fmt in formats:
        for i in range(0, len(qs), BATCH):
            chunk = qs[i : i + BATCH]
            answers = answer_batch(svcs[fmt], [(q.sample, q.question, k, "kv") for q in chunk], max_new_tokens)
            for q, a in zip(chunk, answers):
                f = locomo_f1(a.answer, q.answer, q.category)
                scores[fmt].append(f)
                records.append({"arm": "f1", "kv_format": fmt, "qid": q.qid, "sample": q.sample, "k": k,
                                "answer": a.answer, "reference": q.answer, "f1": round(f, 4)})  # fmt: skip
            bar.update(len(chunk))
    bar.close()
    out = {fmt: {"f1": round(100 * float(np.mean(v)), 2), "questions": len(v)} for fmt, v in scores.items()}
    answers = {fmt: [r["answer"] for r in records if r["arm"] == "f1" and r["kv_format"] == fmt] for fmt in formats}
    base = np.array(scores["native"])
    for fmt in formats[1:]:
        out[fmt]["delta"], out[fmt]["ci95"] = paired_bootstrap(100 * (np.array(scores[fmt]) - base))
        out[fmt]["same_answer"] = sum(a == b for a, b in zip(answers[fmt], answers["native"]))
    return out


def plot(path: Path, s: dict) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    fmts = list(s["bytes"])
    a.bar(fmts, [s["bytes"][f]["over_bf16"] for f in fmts], color=["tab:gray", "tab:blue", "tab:green"][: len(fmts)])
    a.axhline(0.53, ls="--", color="tab:red", lw=1, label="target 0.53x (int8)")
    a.set_ylabel("segment bytes per fact token / bf16")
    a.set_title("Stored KV size (scales included)")
    a.legend(fontsize=8)
    for f in fmts:
        ks = s["ks"]
        b.plot(ks, [s["ttft_ms"][f][str(k)]["p50"] for k in ks], marker="o", label=f"{f} p50")
    log_k_axis(b, s["ks"], plt)
    b.set_xlabel("k (retrieved facts)")
    b.set_ylabel("kv-mode TTFT (ms)")
    b.set_title(f"TTFT by KV format ({s['engine']}, {s['dtype']})")
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
