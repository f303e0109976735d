"""Issue 13's table and plot from one `kvmem eval locomo` run (methods kv, prompt, kv-tail<r>) and one
`kvmem bench latency --tail-recompute ...` run: F1 and gap to prompt injection by category, and TTFT relative
to plain KV injection and to prompt injection.

    python scripts/tail_table.py runs/s4/eval-tail runs/s4/latency-tail docs/img/tail_s4.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ev = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
lat = json.loads((Path(sys.argv[2]) / "summary.json").read_text()) if len(sys.argv) > 2 else None
w, k = str(ev["windows"][0]), str(ev["k"][0])
f1 = ev["f1"][w][k]
cats = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "overall": "overall"}
methods = [m for m in ev["modes"] if m != "prompt"]


def bootstrap_ci(method: str, n: int = 2000) -> tuple[float, float]:
    """95% paired bootstrap CI of the overall F1 gap (prompt - method), resampling questions."""
    import random

    recs = [json.loads(x) for x in (Path(sys.argv[1]) / "records.jsonl").read_text().splitlines() if x.strip()]
    by = {}
    for r in recs:
        by.setdefault(r["mode"], {})[r["qid"]] = r["f1"]
    qids = sorted(set(by["prompt"]) & set(by[method]))
    d = [by["prompt"][q] - by[method][q] for q in qids]
    rng = random.Random(0)
    bs = sorted(100 * sum(d[rng.randrange(len(d))] for _ in d) / len(d) for _ in range(n))
    return bs[int(0.025 * n)], bs[int(0.975 * n) - 1]

head = ["method"] + [f"F1 {n}" for n in cats.values()] + [f"gap {n}" for n in cats.values()] + ["gap 95% CI"]
if lat:
    head += [f"TTFT / kv k={kk}" for kk in ("5", "20", "50")] + ["prompt / method k=50"]
print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
pts = []
for m in ["prompt"] + methods:
    row = [m] + [f"{f1[m][c]:.2f}" for c in cats]
    row += ["" if m == "prompt" else f"{f1['prompt'][c] - f1[m][c]:+.2f}" for c in cats]
    row += ["" if m == "prompt" else "{:.1f} to {:.1f}".format(*bootstrap_ci(m))]
    if lat:
        by = lat["by_window"][str(lat["window"])]
        if m == "prompt":
            row += [f"{by['ratios']['prompt_over_kv'][kk]:.2f}" if kk in by['ratios']['prompt_over_kv'] else ""
                    for kk in ("5", "20", "50")] + ["1.00"]
        elif m == "kv":
            row += ["1.00"] * 3 + [f"{by['ratios']['prompt_over_kv'].get('50', float('nan')):.2f}"]
        else:
            r = by["ratios"]["method_over_kv"][m]
            row += [f"{r.get(kk, float('nan')):.2f}" for kk in ("5", "20", "50")] + \
                   [f"{by['ratios']['prompt_over_method'][m].get('50', float('nan')):.2f}"]
        if m != "prompt":
            ratio = 1.0 if m == "kv" else by["ratios"]["method_over_kv"][m].get(k, float("nan"))
            pts.append((m, ratio, f1["prompt"]["overall"] - f1[m]["overall"]))
    print("| " + " | ".join(row) + " |")
if lat and len(sys.argv) > 3:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for m, x, y in pts:
        ax.scatter([x], [y])
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, ls="--", color="gray", lw=1, label="target gap 1.0")
    ax.axvline(1.3, ls=":", color="gray", lw=1, label="target TTFT 1.3x")
    ax.set_xlabel(f"TTFT / plain KV injection (k={k})")
    ax.set_ylabel("F1 gap to prompt injection (points)")
    ax.set_title(f"{ev['model']}, {ev['questions']} questions, w={w}, k={k}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[3], dpi=120)
