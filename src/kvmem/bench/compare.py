"""``kvmem eval compare``: two ``kvmem eval locomo`` runs on the same questions, paired question by question.

For every setting both runs answered (model, mode, k, window, neighbours, history: everything but the retrieval
and the order, which are what two runs usually differ in), the token F1 of each run by LoCoMo category and
overall, and B − A with a paired bootstrap 95% CI over the questions both answered (``common.paired_bootstrap``).
It also counts the questions whose two answers used the same facts, and gave the same answer.

``--a KEY=VALUE`` and ``--b KEY=VALUE`` (a setting's key) keep one value of that key on each side and pair across
it: two modes of one run (``--a mode=prompt --b mode=kv``), two windows, two k. A key named on one side is left out of
the pairing on both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import markdown_table, paired_bootstrap, table, write_json
from .eval_locomo import RECORD_DEFAULTS
from .recall import CATEGORY_NAMES

SETTING = ("model", "mode", "k", "window", "neighbours", "history")


def _bad(path: Path, i: int, what: str) -> ValueError:
    return ValueError(f"{path}: record {i} {what}: not the records of a kvmem eval locomo run")


def parse_select(items: list[str] | None, side: str) -> dict[str, str]:
    """``--a``/``--b`` options (``KEY=VALUE``, KEY one of ``SETTING``) as {key: value}. Raises ValueError for any
    other form, key, or a key given twice."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not value or key not in SETTING:
            raise ValueError(f"--{side} {item!r}: give KEY=VALUE with KEY one of {', '.join(SETTING)}")
        if key in out:
            raise ValueError(f"--{side} names {key} twice")
        out[key] = value
    return out


def _value(v) -> str:
    """A setting's value as ``--a``/``--b`` spell it (``history`` as true/false)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def load(run: Path, select: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[tuple, dict[str, dict]]:
    """``run``'s scored answers (its ``records.json``: the last summary's selection) as setting -> {qid: record},
    keeping the records whose setting has ``select``'s values, and keyed by the setting without the keys in
    ``drop``. Raises ValueError, naming the file, when ``run`` holds no eval locomo records or a record is malformed
    (a qid that is not a string, an F1 outside [0, 1], a category other than 1-4, a question twice in one setting),
    when ``select`` keeps none, or when a dropped key holds several values that ``select`` does not choose from."""
    select = select or {}
    keep = [i for i, key in enumerate(SETTING) if key not in drop]
    path = run / "records.json"
    if not path.is_file():
        raise ValueError(f"{run} has no records.json: give the --out directory of a kvmem eval locomo run")
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON's own, and huge integers
        raise ValueError(f"{path} is not JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path} holds no records (a non-empty JSON list of kvmem eval locomo records)")
    out: dict[tuple, dict[str, dict]] = {}
    seen: dict[str, set[str]] = {key: set() for key in select}  # the values a selector could have named
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("qid"), str):
            raise _bad(path, i, "has no question id")
        if missing := [key for key in ("model", "mode", "k", "window") if key not in r]:
            raise _bad(path, i, f"has no {', '.join(missing)}")
        f1 = r.get("f1")
        if isinstance(f1, bool) or not isinstance(f1, (int, float)) or not 0 <= f1 <= 1:
            raise _bad(path, i, f"has F1 {str(f1)[:40]!r}, not a number in [0, 1]")
        if r.get("category") not in (1, 2, 3, 4) or isinstance(r.get("category"), bool):
            raise _bad(path, i, f"has category {str(r.get('category'))[:40]!r}, not 1-4")
        facts = r.get("fact_ids") or []
        if not isinstance(facts, list) or not all(isinstance(f, str) for f in facts):
            raise _bad(path, i, "has fact_ids that are not a list of strings")
        full = tuple(r.get(key, RECORD_DEFAULTS.get(key)) for key in SETTING)
        if not all(v is None or isinstance(v, (str, int, float)) for v in full):
            raise _bad(path, i, f"has a setting ({', '.join(SETTING)}) that is not plain values")
        for key in select:
            seen[key].add(_value(full[SETTING.index(key)]))
        if any(_value(full[SETTING.index(key)]) != v for key, v in select.items()):
            continue
        setting = tuple(full[j] for j in keep)
        dropped = tuple(_value(full[SETTING.index(key)]) for key in drop)
        first = tuple(_side(out[setting], key) for key in drop) if out.get(setting) else dropped
        if first != dropped:  # one side of a pairing holds one value of each key left out of it
            values = ", ".join(f"{k}={a} and {b}" for k, a, b in zip(drop, first, dropped) if a != b)
            raise ValueError(
                f"{path}: {dict(zip([SETTING[j] for j in keep], setting))} holds {values}: choose one with "
                "--a/--b KEY=VALUE"
            )
        if r["qid"] in out.setdefault(setting, {}):
            raise _bad(path, i, f"answers question {r['qid'][:40]!r} twice at {dict(zip(SETTING, full))}")
        out[setting][r["qid"]] = r
    if not out:
        chosen = ", ".join(f"{k}={v}" for k, v in select.items())
        if all(v in seen[k] for k, v in select.items()):
            raise ValueError(f"{path}: no record has {chosen} together")
        there = "; ".join(f"{k} is {', '.join(sorted(seen[k], key=_natural))}" for k in select)
        raise ValueError(f"{path}: no record has {chosen} (in its records, {there})")
    return out


def _natural(v: str) -> tuple:
    """Numbers in numeric order, before words in alphabetical order."""
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def _side(rows: dict[str, dict], key: str) -> str:
    """The value of ``key`` on one side of a pairing (one value: ``load`` refuses more)."""
    return _value(next(iter(rows.values())).get(key, RECORD_DEFAULTS.get(key)))


def _what(rows: dict[str, dict]) -> str:
    """How a run's answers were retrieved and ordered (from its first record)."""
    r = next(iter(rows.values()))
    return f"{r.get('retrieval', 'cosine')}, {r.get('order', 'relevance')}"


def run(
    a: Path,
    b: Path,
    out: Path | None = None,
    echo=print,
    select_a: dict[str, str] | None = None,
    select_b: dict[str, str] | None = None,
) -> dict:
    """Compare run ``b`` against run ``a``; returns the summary (also ``out/compare.json`` and ``out/compare.md``
    when ``out`` is given: names no eval run writes, so ``out`` may be a run's directory). Settings and questions
    only one run answered are left out, and counted in ``left_out``. ``select_a``/``select_b`` ({key: value} of
    ``SETTING``) keep those records on each side and pair across the keys they name. Raises ValueError for
    malformed records (``load``), runs that share no question in any setting, a question whose category differs
    between them, or an ``out`` that cannot be written."""
    select_a, select_b = select_a or {}, select_b or {}
    drop = tuple(key for key in SETTING if key in select_a or key in select_b)
    shared = [key for key in SETTING if key not in drop]
    ra, rb = load(a, select_a, drop), load(b, select_b, drop)
    if ra == rb and os.path.samefile(a / "records.json", b / "records.json"):
        raise ValueError(f"{a} and {b} keep the same records of one file: every difference would be zero; pair two "
                         "runs, or two settings of one run with --a/--b KEY=VALUE")  # fmt: skip
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    rows: list[dict] = []
    left = {
        "settings_only_in_a": sum(1 for s in ra if s not in rb),
        "settings_only_in_b": sum(1 for s in rb if s not in ra),
        "answers_only_in_a": 0,
        "answers_only_in_b": 0,
    }
    for setting in [s for s in ra if s in rb]:
        qa, qb = ra[setting], rb[setting]
        qids = [q for q in qa if q in qb]
        left["answers_only_in_a"] += len(qa) - len(qids)
        left["answers_only_in_b"] += len(qb) - len(qids)
        for q in qids:
            if qa[q]["category"] != qb[q]["category"]:
                raise ValueError(
                    f"question {q[:40]!r} is category {qa[q]['category']} in {a}, {qb[q]['category']} in {b}"
                )
        for cat in (1, 2, 3, 4, "overall"):
            sel = [q for q in qids if cat == "overall" or qa[q]["category"] == cat]
            if not sel:
                continue
            diff, ci = paired_bootstrap(100 * (qb[q]["f1"] - qa[q]["f1"]) for q in sel)
            rows.append(
                {
                    **dict(zip(shared, setting)),
                    **{key: f"{_side(qa, key)} → {_side(qb, key)}" for key in drop},
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
    if not rows:
        raise ValueError(
            f"{a} and {b} share no question in any setting ({', '.join(shared)}): "
            f"{sorted(map(str, ra))[:2]} against {sorted(map(str, rb))[:2]}"
        )
    summary = {
        "command": "eval compare",
        "a": {"run": str(a), "retrieval_order": _what(next(iter(ra.values()))), "select": select_a},
        "b": {"run": str(b), "retrieval_order": _what(next(iter(rb.values()))), "select": select_b},
        "f1": "LoCoMo token F1 (%); delta_f1 is b minus a, paired by question, with a bootstrap 95% CI",
        "rows": rows,
        "left_out": left,
    }
    extra = [key for key in drop if key not in ("model", "mode", "k")]  # the other keys paired across
    header = ["model", "mode", "k", *extra, "category", "n", "F1 a", "F1 b", "b − a", "95% CI", "same facts",
              "same answer"]  # fmt: skip
    cells = [
        [r["model"], r["mode"], r["k"], *(r[key] for key in extra), r["category"], r["n"], f"{r['f1_a']:.2f}",
         f"{r['f1_b']:.2f}", f"{r['delta_f1']:+.2f}",
         "" if r["ci95"] is None else f"[{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]", r["same_facts"],
         r["same_answer"]]
        for r in rows
    ]  # fmt: skip
    head = f"a: {a} ({summary['a']['retrieval_order']})\nb: {b} ({summary['b']['retrieval_order']})"
    note = (
        ""
        if not any(left.values())
        else "left out (in one run only): " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in left.items() if v)
    )
    echo(head)
    echo(table(cells, header))
    if note:
        echo(note)
    if out is not None:
        write_json(out / "compare.json", summary)
        md = [f"a: `{a}` ({summary['a']['retrieval_order']}); b: `{b}` ({summary['b']['retrieval_order']})", ""]
        (out / "compare.md").write_text(
            "\n".join(md) + markdown_table(cells, header) + (f"\n{note}\n" if note else "\n")
        )
        echo(f"wrote {out}/compare.json, compare.md")
    return summary
