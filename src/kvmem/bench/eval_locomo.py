"""``kvmem eval locomo``: answer category 1-4 LoCoMo questions by KV and by prompt injection and score them.

Scoring follows LoCoMo's own evaluation (task_eval/evaluation.py of the benchmark):
- normalise: drop commas, lowercase, strip punctuation, drop the words a/an/the/and, whitespace-tokenise;
- token F1 over the token multisets;
- category 1 (multi-hop): the reference is split on ',' into sub-answers (and so is the prediction); each
  sub-answer scores the F1 of its best-matching predicted part, and the scores are averaged;
- category 3: only the part of the reference before the first ';' is used;
- categories 2, 3, 4: plain token F1.
One deliberate difference: the official script Porter-stems tokens with NLTK; NLTK is not a dependency here, so
tokens are not stemmed (scores can be slightly lower than with stemming, equally for both modes).

Exact match: the normalised prediction equals the normalised reference. The optional LLM judge asks an
OpenAI-compatible chat endpoint for CORRECT/WRONG; anything unparseable (or an HTTP failure) counts as wrong.

Resumable: each scored answer is appended to ``records.jsonl`` at once; a rerun skips (question, mode, k, window)
rows already there for the same model.

``--engine vllm`` answers 32 requests per ``generate`` call (one engine for all samples), which is several times
faster for long runs. Batch shapes can change bf16 rounding and so, rarely, a greedy token, for both modes alike;
the records' ``ttft_ms`` then comes from inside a batch and is not a latency figure (``kvmem bench latency`` is).
"""

from __future__ import annotations

import json
import os
import re
import string
import urllib.request
from collections import Counter
from pathlib import Path

from ..policy import MODES_HELP, Encoding, Method
from ..retrieve import IndexCache, check_order
from ..service import check_methods
from ..store import Store
from .common import (
    Setup,
    answer_batch,
    ensure_store,
    log_err,
    log_k_axis,
    machine,
    progress,
    pyplot,
    select_questions,
    table,
    write_csv,
    write_json,
)
from .recall import CATEGORY_NAMES, KS, describe, evidence_recall, parse_fusion
from .recall import rows as recall_rows

BATCH = 32  # requests per vLLM generate call: batched decode; results are written after each batch
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")


def normalize_answer(s: str) -> str:
    s = str(s).replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token F1 between normalised prediction and reference (multiset overlap)."""
    p, r = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(p) & Counter(r)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


def f1_multi(prediction: str, reference: str) -> float:
    """Multi-hop F1: mean over the reference's ','-separated sub-answers of the best F1 against any predicted part."""
    preds = [x.strip() for x in str(prediction).split(",")]
    refs = [x.strip() for x in str(reference).split(",")]
    return sum(max(f1_score(p, r) for p in preds) for r in refs) / len(refs)


def locomo_f1(prediction: str, reference: str, category: int) -> float:
    if category == 3:
        reference = str(reference).split(";")[0].strip()
    if category == 1:
        return f1_multi(prediction, reference)
    return f1_score(prediction, reference)


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


JUDGE_PROMPT = (
    "You grade answers to questions about a long conversation. Given the question, the gold answer and a "
    "generated answer, say whether the generated answer is correct: it is CORRECT if it refers to the same "
    "thing as the gold answer (be generous with wording, length and date formats), otherwise WRONG.\n\n"
    "Question: {question}\nGold answer: {gold}\nGenerated answer: {answer}\n\n"
    'Reply with JSON only: {{"label": "CORRECT"}} or {{"label": "WRONG"}}.'
)


def parse_verdict(text: str) -> int | None:
    """1 for CORRECT, 0 for WRONG, None when the text says neither (or both)."""
    try:
        obj = json.loads(text.strip().strip("`").removeprefix("json").strip())
        if isinstance(obj, dict) and str(obj.get("label", "")).upper() in ("CORRECT", "WRONG"):
            return int(str(obj["label"]).upper() == "CORRECT")
    except (json.JSONDecodeError, AttributeError):
        pass
    up = text.upper()
    has_c, has_w = bool(re.search(r"\bCORRECT\b", up)), bool(re.search(r"\b(WRONG|INCORRECT)\b", up))
    if has_c != has_w:
        return int(has_c)
    return None


def judge(url: str, model: str, question: str, gold: str, answer: str, timeout: float = 60.0) -> dict:
    """Ask an OpenAI-compatible chat endpoint. Returns {"judge": 0|1, "judge_raw": text, ...}; failures -> 0."""
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/chat/completions"):
        endpoint += "/chat/completions"
    body = {
        "model": model,
        "temperature": 0,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": JUDGE_PROMPT.format(question=question, gold=gold, answer=answer)}],
    }
    headers = {"Content-Type": "application/json"}
    if os.environ.get("KVMEM_JUDGE_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['KVMEM_JUDGE_API_KEY']}"
    try:
        req = urllib.request.Request(endpoint, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = json.loads(resp.read())["choices"][0]["message"]["content"] or ""
    except Exception as exc:  # network, HTTP or shape errors: counted as wrong, never dropped
        return {"judge": 0, "judge_raw": "", "judge_error": f"{type(exc).__name__}: {exc}"[:300]}
    v = parse_verdict(text)
    return {"judge": 0 if v is None else v, "judge_raw": text[:300], "judge_parsed": v is not None}


# what a record written before a setting was recorded ran with (``eval compare`` reads old records the same way)
RECORD_DEFAULTS = {"neighbours": 0, "history": False, "retrieval": "cosine", "order": "relevance"}


def _key(r: dict) -> tuple:
    d = RECORD_DEFAULTS
    return (
        r["model"],
        r["qid"],
        r["mode"],
        int(r["k"]),
        int(r["window"]),
        int(r.get("neighbours", d["neighbours"])),
        bool(r.get("history", d["history"])),
        r.get("retrieval", d["retrieval"]),
        r.get("order", d["order"]),
    )


def load_done(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash: that row is simply redone
    return rows


def aggregate(rows: list[dict], ks, windows, modes, with_judge: bool) -> list[dict]:
    out = []
    metrics = ["f1", "em"] + (["judge"] if with_judge else [])
    for w in windows:
        for k in ks:
            for mode in modes:
                sel = [r for r in rows if r["window"] == w and r["k"] == k and r["mode"] == mode]
                for cat in [1, 2, 3, 4, "overall"]:
                    cs = sel if cat == "overall" else [r for r in sel if r["category"] == cat]
                    row = {
                        "window": w,
                        "k": k,
                        "mode": mode,
                        "category": cat,
                        "category_name": CATEGORY_NAMES.get(cat, "overall"),
                        "n": len(cs),
                    }
                    for m in metrics:
                        row[m] = round(100 * sum(r[m] for r in cs) / len(cs), 2) if cs else None
                    out.append(row)
    return out


def run(
    data: Path,
    out: Path,
    ks: list[int],
    windows: list[int],
    modes: list[str],
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    max_new_tokens: int = 32,
    judge_url: str | None = None,
    judge_model: str | None = None,
    show_progress: bool = True,
    echo=print,
    neighbours: int | None = None,
    history: bool = False,
    retrieval: str = "hybrid",
    setup: Setup | None = None,
    order: str = "relevance",
) -> dict:
    """Answer and score; ``neighbours=m`` answers from stores built with neighbour-aware encoding, ``history``
    from stores built with history encoding (each its own cache directory; records carry ``neighbours`` and
    ``history``); ``retrieval``: ``cosine`` or a hybrid fusion (``recall.parse_fusion``; records carry it);
    ``order``: how the retrieved facts are composed (``retrieve.order_facts``: relevance or time; records carry
    it). The summary also gives evidence recall@k per category (``recall.evidence_recall``, k in 5..100) of
    every category 1-4 question of the samples under that retrieval. Returns the summary (also written to
    ``out/summary.json``). ``setup``: an already loaded one for ``data``, ``samples`` and ``model`` (its engine
    is left running)."""

    neighbours = Encoding.of(None, neighbours, history).neighbours
    fusion = parse_fusion(retrieval)
    retrieval = describe(fusion) if fusion is not None else "cosine"
    order = check_order(order)
    try:
        for m in modes:
            Method.parse(m)
    except ValueError:
        raise ValueError(
            f"--mode must be a comma-separated subset of {MODES_HELP}, not {','.join(modes) or '(empty)'}"
        ) from None
    check_methods(modes, engine)
    if not modes:
        raise ValueError("--mode is empty")
    if bool(judge_url) != bool(judge_model):
        raise ValueError("--judge-url and --judge-model go together")
    setup = setup or Setup.load(data, samples, model, engine, show_progress)
    engine = setup.engine_name
    qs = select_questions(setup.convs, questions)
    if not qs:
        raise ValueError("no category 1-4 questions in the chosen samples")
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "records.jsonl"
    done_rows = load_done(jsonl)
    done = {_key(r) for r in done_rows}
    n, h, rt, od = neighbours, history, retrieval, order
    todo = [
        (w, q, k, m)
        for w in windows
        for q in qs
        for k in ks
        for m in modes
        if (model, q.qid, m, k, w, n, h, rt, od) not in done
    ]
    asked = {(model, q.qid, m, k, w, n, h, rt, od) for w in windows for q in qs for k in ks for m in modes}
    echo(
        f"{len(qs)} questions x {len(ks)} k x {len(windows)} windows x {len(modes)} modes: "
        f"{len(todo)} to answer, {len(done & asked)} already in {jsonl}"
    )
    info = machine()
    bar = progress(len(todo), "eval locomo", show_progress)
    with open(jsonl, "a") as fh:
        for w in windows:
            todo_w = [t for t in todo if t[0] == w]
            if not todo_w:
                continue
            setup.fusion = fusion  # every service the setup builds ranks by it (the latency run's too)
            svcs = setup.services(w, log_err, neighbours, history)
            for svc in svcs.values():
                svc.order = order
            engine = setup.engine_name
            step = BATCH if setup.start().batches else 1  # one at a time: resumable per answer
            for i in range(0, len(todo_w), step):
                chunk = todo_w[i : i + step]
                answers = answer_batch(
                    svcs, [(q.sample, q.question, k, mode) for _, q, k, mode in chunk], max_new_tokens
                )
                for (_, q, k, mode), a in zip(chunk, answers):
                    rec = {
                        "model": model,
                        "engine": engine,
                        "qid": q.qid,
                        "sample": q.sample,
                        "category": q.category,
                        "window": w,
                        "neighbours": n,
                        "history": h,
                        "retrieval": rt,
                        "order": od,
                        "k": k,
                        "k_used": a.k,
                        "mode": mode,
                        "question": q.question,
                        "reference": q.answer,
                        "answer": a.answer,
                        "f1": round(locomo_f1(a.answer, q.answer, q.category), 4),
                        "em": exact_match(a.answer, q.answer),
                        "ttft_ms": a.timings_ms["ttft"],
                        "prompt_tokens": a.prompt_tokens,
                        "fact_ids": a.fact_ids,
                    }
                    if judge_url:
                        rec.update(judge(judge_url, judge_model, q.question, q.answer, a.answer))
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    fh.flush()
                    done_rows.append(rec)
                    bar.update(1)
    bar.close()
    rows = [r for r in done_rows if _key(r) in asked]  # this run's answers: every setting it asked for
    with_judge = bool(judge_url) or any("judge" in r for r in rows)
    if with_judge:
        for r in rows:
            r.setdefault("judge", 0)
    agg = aggregate(rows, ks, windows, modes, with_judge)
    by = {(a["window"], a["k"], a["mode"], a["category"]): a for a in agg}
    f1 = {
        str(w): {
            str(k): {m: {str(c): by[(w, k, m, c)]["f1"] for c in [1, 2, 3, 4, "overall"]} for m in modes} for k in ks
        }
        for w in windows
    }
    gap = {}
    if set(modes) >= {"kv", "prompt"}:
        gap = {
            str(w): {
                str(k): {
                    str(c): (
                        None
                        if by[(w, k, "prompt", c)]["f1"] is None or by[(w, k, "kv", c)]["f1"] is None
                        else round(by[(w, k, "prompt", c)]["f1"] - by[(w, k, "kv", c)]["f1"], 2)
                    )
                    for c in [1, 2, 3, 4, "overall"]
                }
                for k in ks
            }
            for w in windows
        }
    methods = [m for m in modes if m != "prompt"]
    gaps = {}  # prompt - method, for every KV method (kv, kv-tail<r>)
    if "prompt" in modes:
        gaps = {
            m: {
                str(w): {
                    str(k): {
                        str(c): (
                            None
                            if by[(w, k, "prompt", c)]["f1"] is None or by[(w, k, m, c)]["f1"] is None
                            else round(by[(w, k, "prompt", c)]["f1"] - by[(w, k, m, c)]["f1"], 2)
                        )
                        for c in [1, 2, 3, 4, "overall"]
                    }
                    for k in ks
                }
                for w in windows
            }
            for m in methods
        }
    recall = measure_recall(setup, windows[0], neighbours, history, fusion, show_progress)
    summary = {
        "command": "eval locomo",
        "engine": engine,
        "model": model,
        "data": str(data),
        "samples": [c.sample_id for c in setup.convs],
        "questions": len(qs),
        "questions_per_category": {str(c): sum(1 for q in qs if q.category == c) for c in (1, 2, 3, 4)},
        "k": ks,
        "windows": windows,
        "neighbours": n,
        "history": h,
        "retrieval": rt,
        "order": od,
        "modes": modes,
        "max_new_tokens": max_new_tokens,
        "scoring": "LoCoMo token F1 (official normalisation, category 1 split on ',', category 3 before ';'; "
        "no Porter stemming), exact match" + (", LLM judge" if with_judge else ""),
        "judge_model": judge_model,
        "f1": f1,
        "f1_gap_prompt_minus_kv": gap,
        "f1_gap_prompt_minus_method": gaps,
        "table": agg,
        "evidence_recall": recall,
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_json(out / "summary.json", summary)
    write_json(out / "records.json", rows)
    write_csv(out / "records.csv", rows)
    write_csv(out / "summary.csv", agg)
    # side-by-side table
    metrics = ["f1", "em"] + (["judge"] if with_judge else [])
    header = ["w", "k", "category", "n"] + [f"{m}_{mode}" for m in metrics for mode in modes]
    if gap:
        header.append("f1_gap")
    trows = []
    for w in windows:
        for k in ks:
            for c in [1, 2, 3, 4, "overall"]:
                row = [w, k, CATEGORY_NAMES.get(c, "overall"), by[(w, k, modes[0], c)]["n"]]
                row += [by[(w, k, mode, c)][m] for m in metrics for mode in modes]
                if gap:
                    row.append(gap[str(w)][str(k)][str(c)])
                trows.append(row)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = {"kv": "tab:blue", "prompt": "tab:red"}
    styles = ["-", "--", ":", "-."]
    for wi, w in enumerate(windows):
        for mode in modes:
            ys = [by[(w, k, mode, "overall")]["f1"] for k in ks]
            ax.plot(ks, ys, styles[wi % 4], marker="o", color=colors.get(mode), label=f"{mode} w={w}")
    log_k_axis(ax, ks, plt)
    ax.set_xlabel("k (retrieved facts)")
    ax.set_ylabel("LoCoMo token F1 (%)")
    ax.set_title(f"Accuracy vs k ({model}, {len(qs)} questions)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_k.png", dpi=120)
    plt.close(fig)
    echo(table(trows, header))
    echo(f"evidence recall@k, {rt}, every category 1-4 question of {', '.join(summary['samples'])}:")
    echo(table(recall_rows(recall), ["category", "questions", "turns", "coverage"] + [f"R@{k}" for k in recall["k"]]))
    echo(f"wrote {out}/records.jsonl, summary.json, records.json, records.csv, summary.csv, accuracy_vs_k.png")
    return summary


def measure_recall(setup: Setup, window: int, neighbours: int, history: bool, fusion, show_progress: bool) -> dict:
    """``recall.evidence_recall`` over the setup's samples, from their cached stores at ``window``."""
    roots = [
        ensure_store(setup.data, c, setup.lm, setup.embedder, window, log_err, show_progress, neighbours, history)
        for c in setup.convs
    ]
    stores = [Store.open(r) for r in roots]
    try:
        items = [(c, st, IndexCache(256 << 20)) for c, st in zip(setup.convs, stores)]
        return evidence_recall(items, setup.embedder, KS, fusion)
    finally:
        for st in stores:
            st.close()
