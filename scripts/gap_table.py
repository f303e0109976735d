"""The KV-method table and plot: every KV method against one prompt-injection reference, on the same questions.

Rows are methods, one per (encoding window w, neighbours m, serving mode); columns are F1 and the gap to prompt
injection by LoCoMo category, the paired bootstrap 95% CI of the overall gap, the ingest cost (tokens run
through the model per stored fact token) and TTFT relative to plain KV injection (from one
`kvmem bench latency --tail-recompute ...` run; window and neighbours change what the stored KV holds, not
what is injected, so their TTFT ratio is 1 by construction, checked by tests/test_neighbours.py).

    python scripts/gap_table.py --ref runs/eval-tail --latency runs/latency-tail \
        --plot docs/img/f1_gap_vs_ttft_0.5b.png runs/eval-tail runs/eval-w0 runs/eval-w20-50 runs/eval-w5-n4 ...

Pairing: a method's records are paired with the reference's prompt records by question id (a run on a subset of
at least 50 questions is compared on that subset: column n); the table says for how many questions both
retrieved the same facts (retrieval embeds fact text only, so it should be all).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CATS = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", "overall": "overall"}
KS = ("5", "20", "50")


def load(dirs: list[Path], k: int, variants: dict | None = None) -> dict:
    """(window, neighbours, mode, engine, variant) -> {qid: record} at ``k``; later directories win on repeats.
    ``variants``: {dir: label} for experiment runs whose (w, m) repeat another run's (kept as their own rows)."""
    out: dict = {}
    for d in dirs:
        for line in (d / "records.jsonl").read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if int(r["k"]) == k:
                    variant = (variants or {}).get(d, "history" if r.get("history") else "")
                    key = (r["window"], r.get("neighbours", 0), r["mode"], r["engine"], variant)
                    out.setdefault(key, {})[r["qid"]] = r
    return out


def ingest_costs(logs: list[Path]) -> dict:
    """(window, neighbours, sample, history) -> (encoded tokens, seconds) from eval logs' ingest lines (the last
    one wins: a store ingested once is reused by later runs)."""
    pat = re.compile(
        r"ingested (\d+) facts of (\S+) \(w=(\d+)(?:, m=(\d+))?(, history)?\) in ([\d.]+) s"
        r"(?: \((\d+) tokens encoded)?"
    )
    out: dict = {}
    for log in logs:
        for m in pat.finditer(log.read_text(errors="replace")):
            out[(int(m[3]), int(m[4] or 0), m[2], bool(m[5]))] = (int(m[7] or 0), float(m[6]))
    return out


def f1(recs: list[dict]) -> float:
    return 100 * sum(r["f1"] for r in recs) / len(recs) if recs else float("nan")


def bootstrap(d: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    bs = sorted(100 * sum(d[rng.randrange(len(d))] for _ in d) / len(d) for _ in range(n))
    return bs[int(0.025 * n)], bs[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "dirs",
        nargs="+",
        help="eval locomo output directories; DIR=LABEL keeps an experiment run "
        "with the same w and m as another as its own row, named by LABEL",
    )
    ap.add_argument("--ref", type=Path, required=True, help="the run whose prompt records are the reference")
    ap.add_argument("--ref-window", type=int, default=5)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--latency-hf", type=Path, help="bench latency --engine hf output with kv-sel methods")
    ap.add_argument("--latency", type=Path, help="bench latency output with --tail-recompute")
    ap.add_argument(
        "--fact-tokens",
        default="conv-26:6652,conv-49:8411",
        help="sample:stored fact tokens (the Qwen2.5 tokenizer), for the ingest cost per fact token",
    )
    ap.add_argument(
        "--base-tokens",
        default="0:29479,5:106452,20:332731,50:765391",
        help="w:tokens encoded at m=0 for conv-26 + conv-49, for logs without token counts",
    )
    ap.add_argument("--plot", type=Path)
    ap.add_argument(
        "--point",
        action="append",
        default=[],
        metavar="LABEL:TTFT:GAP",
        help="an extra plot point from a run whose records are gone (e.g. 'kv w=20 (s3):1:5.16')",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--x-ingest",
        action="store_true",
        help="plot the gap against the ingest cost instead of TTFT "
        "(for offline methods, whose TTFT is plain KV injection's)",
    )
    a = ap.parse_args()

    variants = {Path(d.split("=", 1)[0]): d.split("=", 1)[1] for d in a.dirs if "=" in d}
    a.dirs = [Path(d.split("=", 1)[0]) for d in a.dirs]
    recs = load(a.dirs, a.k, variants)
    # the prompt ids do not depend on w or m; the window only names which of the ref run's prompt records to use
    ref = next(v for (w, m, mode, *_), v in load([a.ref], a.k).items() if (w, mode) == (a.ref_window, "prompt"))
    logs = sorted(
        {Path(str(d) + ".log") for d in [a.ref, *a.dirs] if d not in variants and Path(str(d) + ".log").exists()}
    )
    costs = ingest_costs(logs)
    variant_costs = {
        v: ingest_costs([Path(str(d) + ".log")]) for d, v in variants.items() if Path(str(d) + ".log").exists()
    }
    base = {int(w): int(t) for w, t in (x.split(":") for x in a.base_tokens.split(","))}
    fact_tokens = {s: int(t) for s, t in (x.split(":") for x in a.fact_tokens.split(","))}

    def ratios(path):
        if not path:
            return None
        s = json.loads((path / "summary.json").read_text())
        return s["by_window"][str(s["window"])]["ratios"]

    lat, lat_hf = ratios(a.latency), ratios(a.latency_hf)
    qids = sorted(ref)
    head = (
        ["method", "w", "m"]
        + [f"F1 {n}" for n in CATS.values()]
        + [f"gap {n}" for n in CATS.values()]
        + ["gap 95% CI", "n", "same facts", "encoded tok / fact tok", "ingest s", "TTFT/kv k=20", "prompt/method k=50"]
    )
    rows = [
        ["prompt (ref)", "", ""]
        + [f"{f1([ref[q] for q in qids if c == 'overall' or ref[q]['category'] == c]):.2f}" for c in CATS]
        + [""] * (len(head) - 8)
    ]
    out, pts = [], []
    for (w, m, mode, engine, variant), by in sorted(
        recs.items(), key=lambda kv: (kv[0][3], kv[0][2] != "kv", kv[0][4], kv[0][1], kv[0][0], kv[0][2])
    ):
        if mode == "prompt":
            continue
        common = [q for q in qids if q in by]
        if len(common) < min(50, len(qids)):
            continue  # an unfinished run
        cells, gaps = [], []
        for c in CATS:
            sel = [q for q in common if c == "overall" or ref[q]["category"] == c]
            x, y = f1([by[q] for q in sel]), f1([ref[q] for q in sel])
            cells.append(x)
            gaps.append(y - x)
        lo, hi = bootstrap([ref[q]["f1"] - by[q]["f1"] for q in common])
        same = sum(by[q]["fact_ids"] == ref[q]["fact_ids"] for q in common)
        samples = sorted({by[q]["sample"] for q in common})
        if variant in variant_costs:  # an experiment run: its own log, whatever it calls the method
            own = {key[:3]: v for key, v in variant_costs[variant].items()}
        else:
            own = {key[:3]: v for key, v in costs.items() if key[3] == (variant == "history")}
        got = [own[(w, m, smp)] for smp in samples if (w, m, smp) in own]
        tok = sum(t for t, _ in got) if len(got) == len(samples) and all(t for t, _ in got) else 0
        sec = sum(x for _, x in got) if len(got) == len(samples) else float("nan")
        tok = tok or (base.get(w) if m == 0 and samples == ["conv-26", "conv-49"] else 0)
        n_fact = sum(fact_tokens[smp] for smp in samples)
        src = lat_hf if engine == "hf" else lat
        if mode != "kv":  # a serving method: its own TTFT ratio, from the latency run of its engine
            r = (src or {}).get("method_over_kv", {}).get(mode, {})
            r20 = r.get(str(a.k), float("nan"))
            p50 = (src or {}).get("prompt_over_method", {}).get(mode, {}).get("50", float("nan"))
        else:  # window and neighbours change the stored KV, not what is injected
            r20, p50 = 1.0, ((src or {}).get("prompt_over_kv", {}).get("50", float("nan")))
        label = (
            f"kv w={w}"
            + (f" m={m}" if m else "")
            + (f" {mode.removeprefix('kv-')}" if mode != "kv" else "")
            + (f" ({engine})" if engine != "vllm" else "")
            + (f" {variant}" if variant else "")
        )
        rows.append(
            [label, w, m]
            + [f"{x:.2f}" for x in cells]
            + [f"{g:+.2f}" for g in gaps]
            + [
                f"{lo:.1f} to {hi:.1f}",
                len(common),
                f"{same}/{len(common)}",
                f"{tok / n_fact:.1f}" if tok else "",
                f"{sec:.0f}" if sec == sec else "",
                f"{r20:.2f}",
                f"{p50:.1f}",
            ]
        )
        out.append(
            {
                "method": label,
                "window": w,
                "neighbours": m,
                "mode": mode,
                "engine": engine,
                "variant": variant,
                "f1": dict(zip(map(str, CATS), cells)),
                "gap": dict(zip(map(str, CATS), gaps)),
                "gap_ci95": [lo, hi],
                "same_facts": same,
                "n": len(common),
                "encoded_tokens": tok,
                "ingest_s": sec,
                "ttft_over_kv_k20": r20,
                "prompt_over_method_k50": p50,
            }
        )
        pts.append((label, r20, gaps[-1], tok / n_fact if tok else float("nan")))
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.plot:
        pts += [(label, float(x), float(y), float("nan")) for label, x, y in (p.rsplit(":", 2) for p in a.point)]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for label, ttft, y, cost in pts:
            x = cost if a.x_ingest else ttft
            if x != x:
                continue  # no ingest cost for this point
            ax.scatter(
                [x],
                [y],
                color="tab:green"
                if " m=" in label
                else "tab:orange"
                if "tail" in label
                else "tab:purple"
                if "sel" in label
                else "tab:red"
                if "history" in label
                else "tab:blue",
            )
            ax.annotate(label.removeprefix("kv "), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.axhline(1.0, ls="--", color="gray", lw=1, label="target gap 1.0")
        if not a.x_ingest:
            ax.axvline(1.3, ls=":", color="gray", lw=1, label="target TTFT 1.3x")
        ax.axhline(0.0, color="black", lw=0.5)
        ax.set_xscale("log")
        ax.set_xticks([1, 2, 4, 8, 16] if a.x_ingest else [1, 1.3, 2, 4, 8])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(
            "ingest tokens per stored fact token (TTFT: plain KV injection's)"
            if a.x_ingest
            else f"TTFT / plain KV injection (k={a.k})"
        )
        ax.set_ylabel("F1 gap to prompt injection (points)")
        ax.set_title(
            f"{ref[qids[0]]['model']}, {len(qids)} questions, k={a.k}\n(blue: window, green: "
            f"neighbours, red: history, orange: tail recompute, purple: selective recompute)",
            fontsize=8,
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
