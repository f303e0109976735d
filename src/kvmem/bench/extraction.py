"""``kvmem bench extract``: what ``add(infer=True)`` leaves in memory, on the scripted set (``extraction_cases``).

Each arm is one ``kvmem serve`` (the engine that extracts is the serving engine, with its batching and guided
decoding), or, for ``--endpoint MODEL``, a server whose extraction goes to a second ``kvmem serve`` running
MODEL through its OpenAI-compatible chat API (``--extractor-url``), all offline. Per case: the seed memories
verbatim, the scripted turn with ``infer=True`` (timed), the memory state, then each question in kv and prompt
mode. Scored per arm:

* precision and recall of the memory state: the expected facts present (recall), the live memories that are an
  expected fact or a seed that should stay (precision);
* leaks: memories with a 4-word run of kvmem's own prompts, or today's date;
* forgets honoured (the memory gone, its words nowhere), corrections turned into an UPDATE of the seed;
* adds that report an empty extraction (``message``) and chit-chat adds that stored nothing;
* abstentions on trap questions (the answer says it does not know), answers on answerable ones, kv and prompt;
* ``add`` latency p50 / p95.

Writes summary.json, records.json/csv and extraction.png under ``--out``.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

from ..compose import HEADER_TEXT
from ..memory.extract import DECISIONS_PROMPT, FACTS_PROMPT
from .common import free_port, machine, median, p95, pyplot, served, table, write_summary_and_records
from .extraction_cases import CASES, Case

ABSTAIN = re.compile(
    r"(don'?t know|do not know|not sure|no (?:information|record|memory|mention|details?)|not (?:mentioned|stored|"
    r"in (?:my|the) memory|specified|provided|available)|unknown|can(?:'|no)t (?:say|tell)|cannot (?:say|tell)|"
    r"doesn'?t (?:say|mention|hold|contain)|does not (?:say|mention|hold|contain)|i have no)",
    re.IGNORECASE,
)


def _grams(text: str, n: int = 4) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


PROMPT_GRAMS = (
    _grams(FACTS_PROMPT.split("{messages}")[0]) | _grams(DECISIONS_PROMPT.split("{existing}")[0]) | _grams(HEADER_TEXT)
)


def leaked(text: str, today: str) -> bool:
    """A memory that holds a 4-word run of kvmem's own prompts, or today's date (the prompt gives it)."""
    return bool(_grams(text) & PROMPT_GRAMS) or today.lower() in text.lower()


def has(text: str, words) -> bool:
    return all(w.lower() in text.lower() for w in words)


def score_case(case: Case, seeds: list[str], result: dict, state: list[dict], today: str) -> dict:
    """The scores of one case from its seed ids, the add's result and the live memories after it."""
    texts = [m["memory"] for m in state]
    live = {m["id"] for m in state}
    gone = {case.update, case.delete} - {None}
    keep_seeds = [sid for i, sid in enumerate(seeds) if i not in gone]
    found = [any(has(t, e) for t in texts) for e in case.expect]
    good = sum(
        1
        for m in state
        if (m["id"] in keep_seeds or any(has(m["memory"], e) for e in case.expect))
        and not any(f.lower() in m["memory"].lower() for f in case.forbid)
    )
    events = result.get("results", [])
    out = {
        "expected": len(case.expect) + len(keep_seeds),
        "recalled": sum(found) + sum(1 for s in keep_seeds if s in live),
        "stored": len(state),
        "correct": good,
        "leaks": sum(1 for t in texts if leaked(t, today)),
        "forbidden_present": sum(1 for f in case.forbid for t in texts if f.lower() in t.lower()),
        "added": sum(1 for e in events if e["event"] == "ADD"),
        "reported_empty": not events and bool(result.get("message")),
    }
    if case.delete is not None:
        target = seeds[case.delete]
        out["forget_honoured"] = target not in live and out["forbidden_present"] == 0
    if case.update is not None:
        target = seeds[case.update]
        out["correction_update"] = any(
            e["event"] == "UPDATE" and e["id"] == target and all(has(e["memory"], x) for x in case.expect)
            for e in events
        )
    return out


def _arm_summary(rows: list[dict], answers: list[dict]) -> dict:
    tot = {k: sum(r[k] for r in rows) for k in ("expected", "recalled", "stored", "correct", "leaks")}
    forgets = [r["forget_honoured"] for r in rows if "forget_honoured" in r]
    fixes = [r["correction_update"] for r in rows if "correction_update" in r]
    chit = [r for r in rows if r["kind"] == "chitchat"]
    adds = [r["add_ms"] for r in rows]
    out = {
        "cases": len(rows),
        "precision": round(tot["correct"] / tot["stored"], 3) if tot["stored"] else None,
        "recall": round(tot["recalled"] / tot["expected"], 3) if tot["expected"] else None,
        "leaks": tot["leaks"],
        "forgets_honoured": f"{sum(forgets)}/{len(forgets)}",
        "forget_rate": round(sum(forgets) / len(forgets), 3) if forgets else None,
        "corrections_as_update": f"{sum(fixes)}/{len(fixes)}",
        "correction_rate": round(sum(fixes) / len(fixes), 3) if fixes else None,
        "chitchat_stored_nothing": f"{sum(1 for r in chit if r['added'] == 0)}/{len(chit)}",
        "empty_reported": sum(1 for r in rows if r["reported_empty"]),
        "add_ms": {"p50": median(adds), "p95": p95(adds)},
    }
    for mode in ("kv", "prompt"):
        traps = [a for a in answers if a["mode"] == mode and a["trap"]]
        real = [a for a in answers if a["mode"] == mode and not a["trap"]]
        out[f"abstained_{mode}"] = f"{sum(a['abstained'] for a in traps)}/{len(traps)}"
        out[f"answered_{mode}"] = f"{sum(a['correct'] for a in real)}/{len(real)}"
    return out


def run_arm(base: str, model: str, name: str, cases: list[Case], echo=print) -> tuple[dict, list, list]:
    """Every case against the server at ``base`` (serving ``model``): records of adds and of answers."""
    import httpx

    from ..memory.mem0 import date_label

    today = date_label(time.time())
    rows, answers = [], []
    with httpx.Client(base_url=base, timeout=900) as c:
        for case in cases:
            user = f"{name}-{case.id}"
            seeds = []
            for text in case.seed:
                r = c.post("/v1/memories", json={"messages": text, "user_id": user, "infer": False})
                r.raise_for_status()
                seeds.append(r.json()["results"][0]["id"])
            msgs = [{"role": role, "content": text} for role, text in case.turn]
            t0 = time.perf_counter()
            r = c.post("/v1/memories", json={"messages": msgs, "user_id": user, "infer": True})
            add_ms = (time.perf_counter() - t0) * 1e3
            r.raise_for_status()
            result = r.json()
            state = c.get("/v1/memories", params={"user_id": user}).json()["results"]
            row = {"arm": name, "case": case.id, "kind": case.kind, "add_ms": round(add_ms, 1)}
            row.update(score_case(case, seeds, result, state, today))
            row["memories"] = [m["memory"] for m in state]
            row["events"] = [f"{e['event']}: {e['memory']}" for e in result.get("results", [])]
            rows.append(row)
            for q, want in case.questions:
                for mode in ("kv", "prompt"):
                    r = c.post(
                        "/v1/chat/completions",
                        json={"model": model, "user": user, "temperature": 0, "max_tokens": 24,
                              "messages": [{"role": "user", "content": q}], "memory": {"mode": mode, "top_k": 5}},
                    )  # fmt: skip
                    r.raise_for_status()
                    text = r.json()["choices"][0]["message"]["content"]
                    answers.append(
                        {"arm": name, "case": case.id, "question": q, "mode": mode, "answer": text,
                         "trap": want is None, "abstained": bool(ABSTAIN.search(text)),
                         "correct": want is not None and has(text, want)}
                    )  # fmt: skip
            echo(f"  {name} {case.id}: add {add_ms:.0f} ms, {row['events']}")
    return _arm_summary(rows, answers), rows, answers


def run(out: Path, models: list[str], endpoint: str | None, answer_model: str, engine: str, dtype: str,
        cases: int = 0, echo=print, answer_engine: str | None = None) -> dict:  # fmt: skip
    import sys

    chosen = CASES[:cases] if cases else CASES
    answer_engine = answer_engine or engine
    summary: dict = {"command": "bench extract", "engine": engine, "cases": len(chosen), "arms": {}}
    records, answers = [], []
    kvmem = [sys.executable, "-m", "kvmem.cli", "serve"]
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-extract-") as tmp:
        for model in models:
            port = free_port()
            cmd = kvmem + ["--store", f"{tmp}/{model}", "--model", model, "--engine", engine, "--dtype", dtype,
                           "--port", str(port), "--max-tokens", "24"]  # fmt: skip
            echo(f"arm {model}: extraction on its own serving engine")
            with served(cmd, f"http://127.0.0.1:{port}", out / f"serve-{model}.log") as (_, ready):
                s, rows, ans = run_arm(f"http://127.0.0.1:{port}", model, model, chosen, echo)
            summary["arms"][model] = {**s, "extractor": f"{model} ({ready['engine']})"}
            records += rows
            answers += ans
        if endpoint:
            ext_port, port = free_port(), free_port()
            # two servers at once: the extractor's KV cache is kept small (its prompts are short), and the
            # answering server may run on the transformers engine (one process), so both fit in memory
            ext = kvmem + ["--store", f"{tmp}/ext-{endpoint}", "--model", endpoint, "--engine", engine, "--dtype",
                           dtype, "--port", str(ext_port), "--max-tokens", "512",
                           "--kv-cache-bytes", str(256 << 20)]  # fmt: skip
            via = ["--extractor-url", f"http://127.0.0.1:{ext_port}/v1", "--extractor-model", endpoint]
            cmd = kvmem + ["--store", f"{tmp}/via-{answer_model}", "--model", answer_model, "--engine", answer_engine,
                           "--dtype", dtype, "--port", str(port), "--max-tokens", "24", *via]  # fmt: skip
            name = f"{answer_model}+endpoint:{endpoint}"
            echo(f"arm {name}: extraction through kvmem serve's chat API")
            with (
                served(ext, f"http://127.0.0.1:{ext_port}", out / "serve-extractor.log"),
                served(cmd, f"http://127.0.0.1:{port}", out / "serve-via-endpoint.log"),
            ):
                s, rows, ans = run_arm(f"http://127.0.0.1:{port}", answer_model, name, chosen, echo)
            summary["arms"][name] = {**s, "extractor": f"{endpoint} over HTTP"}
            records += rows
            answers += ans
    summary["answers"] = answers
    summary["machine"] = machine()
    write_summary_and_records(out, summary, records)
    head = ["arm", "precision", "recall", "leaks", "forgets", "corrections", "empty", "abstain kv", "abstain prompt",
            "add p50 ms", "add p95 ms"]  # fmt: skip
    rows = [
        [name, a["precision"], a["recall"], a["leaks"], a["forgets_honoured"], a["corrections_as_update"],
         a["empty_reported"], a["abstained_kv"], a["abstained_prompt"], a["add_ms"]["p50"], a["add_ms"]["p95"]]
        for name, a in summary["arms"].items()
    ]  # fmt: skip
    echo(table(rows, head))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(summary["arms"])
    for i, key in enumerate(("precision", "recall", "forget_rate", "correction_rate")):
        ax.bar([j + i * 0.2 for j in range(len(names))], [summary["arms"][n][key] or 0 for n in names], 0.2,
               label=key)  # fmt: skip
    ax.set_xticks([j + 0.3 for j in range(len(names))], names, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.set_title(f"Extraction on the scripted set ({len(chosen)} cases)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "extraction.png", dpi=120)
    plt.close(fig)
    echo(f"wrote {out}/summary.json, records.json, records.csv, extraction.png")
    return summary
