"""``kvmem eval compare``: two ``kvmem eval locomo`` runs on the same questions, paired question by question.

For every setting both runs answered (model, mode, k, window, neighbours, history: everything but the retrieval
and the order, which are what two runs usually differ in), the token F1 of each run by LoCoMo category and
overall, and B − A with a paired bootstrap 95% CI over the questions both answered (``common.paired_bootstrap``).
It also counts the questions whose two answers used the same facts, and gave the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import markdown_table, paired_bootstrap, table, write_json
from .recall import CATEGORY_NAMES

SETTING = ("model", "mode", "k", "window", "neighbours", "history")


def load(run: Path) -> dict[tuple, dict[str, dict]]:
    """``run``'s scored answers (its ``records.json``: the last summary's selection) as setting -> {qid: record}.
    Raises ValueError when ``run`` holds no eval locomo output."""
    path = run / "records.json"
    if not path.is_file():
        raise ValueError(f"{run} has no records.json: give the --out directory of a kvmem eval locomo run")
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or any(not isinstance(r, dict) or "qid" not in r or "f1" not in r for r in rows):
        raise ValueError(f"{path} is not the records of a kvmem eval locomo run")
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(key) for key in SETTING), {})[r["qid"]] = r
    return out


def _what(rows: dict[str, dict]) -> str:
    """How a run's answers were retrieved and ordered (from its first record)."""
    r = next(iter(rows.values()))
    return f"{r.get('retrieval', 'cosine')}, {r.get('order', 'relevance')}"


def run(a: Path, b: Path, out: Path | None = None, echo=print) -> dict:
    """Compare run ``b`` against run ``a``; returns the summary (also ``out/summary.json`` and ``out/compare.md``
    when ``out`` is given). Raises ValueError when the runs share no setting, or no question within one."""
    ra, rb = load(a), load(b)
    common = [s for s in ra if s in rb]
    if not common:
        raise ValueError(
            f"{a} and {b} answered no setting in common (model, mode, k, window, neighbours, history): "
            f"{sorted(map(str, ra))[:3]} against {sorted(map(str, rb))[:3]}"
        )
    rows = []
    for setting in common:
        qa, qb = ra[setting], rb[setting]
        qids = [q for q in qa if q in qb]
        if not qids:
            raise ValueError(f"{a} and {b} share no question at {dict(zip(SETTING, setting))}")
        for cat in (1, 2, 3, 4, "overall"):
            sel = [q for q in qids if cat == "overall" or qa[q].get("category") == cat]
            if not sel:
                continue
            diff, ci = paired_bootstrap(100 * (qb[q]["f1"] - qa[q]["f1"]) for q in sel)
            rows.append(
                {
                    **dict(zip(SETTING, setting)),
                    "category": CATEGORY_NAMES.get(cat, "overall"),
                    "n": len(sel),
                    "f1_a": round(100 * sum(qa[q]["f1"] for q in sel) / len(sel), 2),
                    "f1_b": round(100 * sum(qb[q]["f1"] for q in sel) / len(sel), 2),
                    "delta_f1": diff,
                    "ci95": ci,
                    "same_facts": sum(
                        sorted(qa[q].get("fact_ids") or []) == sorted(qb[q].get("fact_ids") or []) for q in sel
                    ),  # fmt: skip
                    "same_answer": sum(qa[q].get("answer") == qb[q].get("answer") for q in sel),
                }
            )
    first = ra[common[0]]
    summary = {
        "command": "eval compare",
        "a": {"run": str(a), "retrieval_order": _what(first)},
        "b": {"run": str(b), "retrieval_order": _what(rb[common[0]])},
        "f1": "LoCoMo token F1 (%); delta_f1 is b minus a, paired by question, with a bootstrap 95% CI",
        "rows": rows,
    }
    header = ["model", "mode", "k", "category", "n", "F1 a", "F1 b", "b − a", "95% CI", "same facts", "same answer"]
    cells = [
        [r["model"], r["mode"], r["k"], r["category"], r["n"], r["f1_a"], r["f1_b"], f"{r['delta_f1']:+.2f}",
         "" if r["ci95"] is None else f"[{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]", r["same_facts"],
         r["same_answer"]]
        for r in rows
    ]  # fmt: skip
    echo(f"a: {a} ({summary['a']['retrieval_order']})\nb: {b} ({summary['b']['retrieval_order']})")
    echo(table(cells, header))
    if out is not None:
        write_json(out / "summary.json", summary)
        lines = [f"a: `{a}` ({summary['a']['retrieval_order']}); b: `{b}` ({summary['b']['retrieval_order']})", ""]
        (out / "compare.md").write_text("\n".join(lines) + markdown_table(cells, header) + "\n")
        echo(f"wrote {out}/summary.json, compare.md")
    return summary
