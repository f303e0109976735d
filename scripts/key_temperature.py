"""Key temperature at injection: does scaling the injected facts' keys close the KV-vs-prompt gap?

Separately encoded facts lose attention mass to one another (APE, Yang et al. 2025, scales the attention of
parallel-encoded contexts by a temperature). RoPE is linear, so multiplying a fact's stored key by ``s`` multiplies
every query's logit on that token by ``s``: ``s > 1`` sharpens the attention on the facts, ``s < 1`` flattens it.
The header's keys (encoded in place, the shared prefix) and the query's stay as they are. Nothing else changes:
same stores, same retrieval, same prompt.

This is an experiment on the transformers engine (one process, so the scaling is a wrapper around the engine's
``compose``); it answers LoCoMo's category 1-4 questions in kv mode at each scale on the eval's cached stores
(w=5, m=4) and reports token F1 per scale with the paired-bootstrap difference against s=1. It is not a serving
option: one that helps would go into composition for both engines.

    .venv/bin/python scripts/key_temperature.py --scales 1,0.9,1.1 --k 20 --out runs/eval/key-temperature
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="key_temperature.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1,0.9,1.1", help="comma-separated key scales; the first is the baseline")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--samples", default="conv-26,conv-49")
    ap.add_argument("--questions", type=int, default=0, help="0: every category 1-4 question of the samples")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", default="../shared/data/locomo/locomo7.json")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="runs/eval/key-temperature")
    a = ap.parse_args(argv)
    try:
        scales = [float(x) for x in a.scales.split(",")]
    except ValueError:
        ap.error(f"--scales: comma-separated numbers, not {a.scales!r}")
    if not scales or any(s <= 0 for s in scales):
        ap.error("--scales: positive numbers")
    if not Path(a.data).exists():
        ap.error(f"LoCoMo file not found: {a.data}")

    import kvmem.engines.hf as hf
    from kvmem.bench.common import Setup, answer_batch, log_err, machine, paired_bootstrap, select_questions, table
    from kvmem.bench.eval_locomo import locomo_f1
    from kvmem.policy import Encoding

    enc = Encoding.of(None, None, False)  # the eval's defaults: w=5, m=4
    setup = Setup.load(Path(a.data), a.samples.split(","), a.model, "hf", show_progress=False)
    svcs = setup.services(enc.window, log_err, enc.neighbours, False)
    qs = select_questions(setup.convs, a.questions)
    compose = hf.compose
    scale = {"s": 1.0}

    def scaled(rotary, header_ids, *args, **kw):
        memory = compose(rotary, header_ids, *args, **kw)
        if scale["s"] != 1.0:
            memory.keys[:, :, len(header_ids) :, :] *= scale["s"]  # [L, H, m, D]: the facts, not the header
        return memory

    hf.compose = scaled
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for s in scales:
        scale["s"] = s
        t0 = time.perf_counter()
        for q in qs:
            (ans,) = answer_batch(svcs, [(q.sample, q.question, a.k, "kv")], a.max_new_tokens)
            f1 = round(locomo_f1(ans.answer, q.answer, q.category), 4)
            records.append({"scale": s, "qid": q.qid, "category": q.category, "answer": ans.answer, "f1": f1})
        log_err(f"scale {s}: {len(qs)} questions in {time.perf_counter() - t0:.0f} s")
    base = {r["qid"]: r["f1"] for r in records if r["scale"] == scales[0]}
    rows, summary = [], {}
    for s in scales:
        got = {r["qid"]: r["f1"] for r in records if r["scale"] == s}
        mean, ci = paired_bootstrap(100 * (got[q] - base[q]) for q in base)
        f1 = round(100 * sum(got.values()) / len(got), 2)
        summary[str(s)] = {"f1": f1, "delta_vs_first": mean, "ci95": ci, "n": len(got)}
        rows.append([s, f1, mean, ci])
    result = {
        "command": "scripts/key_temperature.py " + " ".join(argv),
        "model": a.model,
        "engine": "hf",
        "k": a.k,
        "window": enc.window,
        "neighbours": enc.neighbours,
        "samples": a.samples.split(","),
        "scales": summary,
        "machine": machine(),
    }
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(table(rows, ["key scale", "F1", f"F1 - F1 at {scales[0]}", "95% CI"]))
    print(f"wrote {out}/summary.json, records.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
