"""``kvmem bench latency``: TTFT, query-to-first-token and query-to-full-answer vs k, KV vs prompt injection.

Modes are interleaved question by question (and their order alternates), so drift on a noisy machine hits both
equally. The bare query (same query tokens, no memory at all) is the physical floor for injection.

Metrics per request (ms): ``ttft`` = engine call start -> first token's logits; ``q2ft`` = question received ->
first token (embed + search + compose/prompt assembly + ttft); ``q2fa`` = q2ft + decode of the rest.
"""

from __future__ import annotations

from pathlib import Path

from ..policy import Encoding, Method
from ..service import check_methods, same_prompt
from .common import (
    Setup,
    bare,
    log_err,
    log_k_axis,
    machine,
    median,
    p95,
    progress,
    pyplot,
    ratio,
    select_questions,
    store_device_note,
    table,
    write_csv,
    write_summary_and_records,
)
from .recall import describe, parse_fusion

MODES = ("kv", "prompt")
METRICS = ("ttft", "q2ft", "q2fa")
STAGES = ("embed", "search", "compose", "ttft", "decode")


def bare_generate(svc, question: str, max_new_tokens: int) -> dict:
    """The query alone, no memory: the same query token ids the memory modes see, prefilled at position 0."""
    return bare(svc, question, max_new_tokens)


def _record(ans, q, window) -> dict:
    t = ans.timings_ms
    return {
        "qid": q.qid,
        "sample": q.sample,
        "category": q.category,
        "window": window,
        "mode": ans.mode,
        "k": ans.k,
        "ttft": t["ttft"],
        "q2ft": t["total"],
        "q2fa": t["total"] + t["decode"],
        "embed": t["embed"],
        "search": t["search"],
        "compose": t["compose"],
        "decode": t["decode"],
        "prompt_tokens": ans.prompt_tokens,
        "prefilled_tokens": ans.prefilled_tokens,
        "generated_tokens": ans.generated_tokens,
        "answer": ans.answer,
    }


def summarize(records: list[dict], ks: list[int], window: int, modes=MODES) -> dict:
    recs = [r for r in records if r["window"] == window]
    bare = [r for r in recs if r["mode"] == "bare"]
    out: dict = {
        "window": window,
        "n_questions": len({r["qid"] for r in recs}),
        "ttft_ms": {**{m: {} for m in modes}, "bare": round(median(r["ttft"] for r in bare), 3)},
        "p95_ms": {},
        "median_ms": {},
        "stages_ms": {},
    }
    out["p95_ms"]["bare"] = {
        "ttft": round(p95(r["ttft"] for r in bare), 3),
        "q2fa": round(p95(r["ttft"] + r["decode"] for r in bare), 3),
    }
    out["median_ms"]["bare"] = {
        "ttft": out["ttft_ms"]["bare"],
        "q2fa": round(median(r["ttft"] + r["decode"] for r in bare), 3),
    }
    for mode in modes:
        out["median_ms"][mode], out["p95_ms"][mode], out["stages_ms"][mode] = {}, {}, {}
        for k in ks:
            sel = [r for r in recs if r["mode"] == mode and r["k_asked"] == k]
            key = str(k)
            out["ttft_ms"][mode][key] = round(median(r["ttft"] for r in sel), 3)
            out["median_ms"][mode][key] = {m: round(median(r[m] for r in sel), 3) for m in METRICS}
            out["p95_ms"][mode][key] = {m: round(p95(r[m] for r in sel), 3) for m in METRICS}
            out["stages_ms"][mode][key] = {s: round(median(r[s] for r in sel), 3) for s in STAGES}
            out["stages_ms"][mode][key]["prompt_tokens"] = median(r["prompt_tokens"] for r in sel)
            out["stages_ms"][mode][key]["prefilled_tokens"] = median(r["prefilled_tokens"] for r in sel)
    kmin, kmax = str(min(ks)), str(max(ks))
    kv, pr = out["ttft_ms"]["kv"], out["ttft_ms"]["prompt"]
    out["ratios"] = {
        "prompt_over_kv": {str(k): ratio(pr[str(k)], kv[str(k)]) for k in ks},
        "kv_kmax_over_kmin": ratio(kv[kmax], kv[kmin]),
        "kv_over_bare": ratio(kv[kmax], out["ttft_ms"]["bare"]),
        "kmin": int(kmin),
        "kmax": int(kmax),
        # tail recompute: TTFT of each method over plain KV injection, and prompt over the method
        "method_over_kv": {
            m: {str(k): ratio(out["ttft_ms"][m][str(k)], kv[str(k)]) for k in ks} for m in modes if m not in MODES
        },
        "prompt_over_method": {
            m: {str(k): ratio(pr[str(k)], out["ttft_ms"][m][str(k)]) for k in ks} for m in modes if m not in MODES
        },
    }
    sel = [r for r in recs if r["mode"] == "kv" and r["k_asked"] == int(kmax)]
    over = [(r["embed"] + r["search"] + r["compose"]) / r["q2ft"] for r in sel if r["q2ft"] > 0]
    out["overhead_fraction"] = round(median(over), 4) if over else None
    out["overhead_fraction_of_medians"] = ratio(
        sum(median(r[s] for r in sel) for s in ("embed", "search", "compose")), median(r["q2ft"] for r in sel)
    )
    return out


def plot(path: Path, per_window: dict, ks: list[int]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"kv": "tab:blue", "prompt": "tab:red"}
    styles = {"ttft": "-", "q2ft": "--", "q2fa": ":"}
    markers = ["o", "s", "^", "D", "v"]
    for wi, (w, s) in enumerate(per_window.items()):
        for mode in MODES:
            for m in METRICS:
                ys = [s["median_ms"][mode][str(k)][m] for k in ks]
                ax.plot(
                    ks,
                    ys,
                    styles[m],
                    color=colors[mode],
                    marker=markers[wi % len(markers)],
                    label=f"{mode} {m}" + (f" w={w}" if len(per_window) > 1 else ""),
                )
        ax.axhline(
            s["ttft_ms"]["bare"],
            color="gray",
            lw=1,
            ls="-.",
            label="bare query ttft" + (f" w={w}" if len(per_window) > 1 else ""),
        )
    log_k_axis(ax, ks, plt)
    ax.set_xlabel("k (retrieved facts)")
    ax.set_ylabel("median latency (ms)")
    ax.set_title("Latency vs k: KV injection vs prompt injection")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(
    data: Path,
    out: Path,
    ks: list[int],
    windows: list[int],
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    max_new_tokens: int = 32,
    store_device: str = "host",
    show_progress: bool = True,
    echo=print,
    tails: list[int] = (),
    methods: list[str] = (),
    neighbours: int | None = None,
    history: bool = False,
    setup: Setup | None = None,
    retrieval: str = "hybrid",
) -> dict:
    """``tails``: also time KV injection with tail recompute r (method ``kv-tail<r>``) for each r; ``methods``:
    any further serving methods (``policy.Method``: ``kv-tail<r>``, ``kv-sel<p>``); all interleaved.
    ``neighbours``, ``history``: the stores' encoding (``policy.Encoding``; the defaults when not given).
    ``setup``: an already loaded one for ``data``, ``samples`` and ``model`` (its engine is left running; it
    ranks by its own ``fusion``); ``retrieval``: what a setup loaded here ranks by (``recall.parse_fusion``)."""

    note = store_device_note(store_device)
    modes = MODES + tuple(dict.fromkeys([str(Method("kv", r)) for r in tails if r > 0] + list(methods)))
    check_methods(modes, engine)
    neighbours = Encoding.of(windows[0], neighbours, history).neighbours
    setup = setup or Setup.load(data, samples, model, engine, show_progress, parse_fusion(retrieval))
    qs = select_questions(setup.convs, questions)
    if not qs:
        raise ValueError("no category 1-4 questions in the chosen samples")
    info = machine()
    records: list[dict] = []
    per_window: dict = {}
    for w in windows:
        svcs = setup.services(w, log_err, neighbours, history)
        # warm-up: one call per mode (not recorded)
        q0 = qs[0]
        for mode in modes:
            svcs[q0.sample].ask(q0.sample, q0.question, min(ks), mode, max_new_tokens)
        bare_generate(svcs[q0.sample], q0.question, max_new_tokens)
        bar = progress(len(qs) * (1 + len(modes) * len(ks)), f"latency w={w}", show_progress)
        for qi, q in enumerate(qs):
            svc = svcs[q.sample]
            order = modes if qi % 2 == 0 else modes[::-1]
            units = [("bare", None)] + [(m, k) for k in ks for m in order]
            if qi % 2:
                units = units[1:] + units[:1]
            answers = {}
            for mode, k in units:
                if mode == "bare":
                    b = bare_generate(svc, q.question, max_new_tokens)
                    records.append(
                        {
                            "qid": q.qid,
                            "sample": q.sample,
                            "category": q.category,
                            "window": w,
                            "mode": "bare",
                            "k": 0,
                            "k_asked": 0,
                            "ttft": b["ttft"],
                            "q2ft": b["ttft"],
                            "q2fa": b["ttft"] + b["decode"],
                            "embed": 0.0,
                            "search": 0.0,
                            "compose": 0.0,
                            "decode": b["decode"],
                            "prompt_tokens": b["prefilled_tokens"],
                            "prefilled_tokens": b["prefilled_tokens"],
                            "generated_tokens": b["generated_tokens"],
                            "answer": "",
                        }
                    )
                else:
                    a = svc.ask(q.sample, q.question, k, mode, max_new_tokens)
                    answers[(mode, k)] = a
                    records.append({**_record(a, q, w), "mode": mode, "k_asked": k})
                bar.update(1)
            for k in ks:
                same_prompt(answers[("kv", k)], answers[("prompt", k)])
        bar.close()
        per_window[str(w)] = summarize(records, ks, w, modes)

    head = per_window[str(windows[0])]
    engine = setup.engine_name
    summary = {
        "command": "bench latency",
        "engine": engine,
        "model": model,
        "data": str(data),
        "samples": [c.sample_id for c in setup.convs],
        "questions": len(qs),
        "k": ks,
        "windows": windows,
        "neighbours": neighbours,
        "history": history,
        "retrieval": describe(setup.fusion),
        "max_new_tokens": max_new_tokens,
        "store_device": store_device,
        "store_device_note": note,
        "engine_note": "" if setup.start().batches else f"{engine} engine: one request at a time, greedy, batch size 1",
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in __import__("os").getloadavg()]},
        "window": windows[0],
        "ttft_ms": head["ttft_ms"],
        "ratios": head["ratios"],
        "overhead_fraction": head["overhead_fraction"],
        "by_window": per_window,
    }
    write_summary_and_records(out, summary, records)
    rows = []
    for w, s in per_window.items():
        for k in ks:
            kk = str(k)
            rows.append(
                [
                    w,
                    k,
                    s["median_ms"]["kv"][kk]["ttft"],
                    s["median_ms"]["prompt"][kk]["ttft"],
                    s["ratios"]["prompt_over_kv"][kk],
                    s["median_ms"]["kv"][kk]["q2ft"],
                    s["median_ms"]["prompt"][kk]["q2ft"],
                    s["p95_ms"]["kv"][kk]["ttft"],
                    s["p95_ms"]["prompt"][kk]["ttft"],
                    s["median_ms"]["kv"][kk]["q2fa"],
                    s["median_ms"]["prompt"][kk]["q2fa"],
                ]
            )
    header = [
        "w",
        "k",
        "kv_ttft",
        "pr_ttft",
        "pr/kv",
        "kv_q2ft",
        "pr_q2ft",
        "kv_ttft_p95",
        "pr_ttft_p95",
        "kv_q2fa",
        "pr_q2fa",
    ]
    write_csv(out / "summary.csv", [dict(zip(header, r)) for r in rows])
    plot(out / "latency_vs_k.png", per_window, ks)
    echo(table(rows, header))
    for w, s in per_window.items():
        r = s["ratios"]
        echo(
            f"w={w}: bare ttft {s['ttft_ms']['bare']:.1f} ms | kv k{r['kmax']}/k{r['kmin']} "
            f"{r['kv_kmax_over_kmin']} | kv/bare {r['kv_over_bare']} | overhead at k={r['kmax']} "
            f"{s['overhead_fraction']}"
        )
        for m, by_k in r["method_over_kv"].items():
            echo(f"w={w}: {m} ttft / kv ttft by k: {by_k}; prompt / {m}: {r['prompt_over_method'][m]}")
    echo(note)
    echo(f"wrote {out}/summary.json, records.json, records.csv, summary.csv, latency_vs_k.png")
    return summary
