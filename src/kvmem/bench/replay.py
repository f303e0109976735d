"""``kvmem bench replay``: LoCoMo replayed turn by turn through ``Memory.add``, then answered from the result.

Three arms, one fresh store each, over the first ``sessions`` sessions of each sample:
- ``observations``: today's path (``ingest-locomo``): LoCoMo's observation facts, each behind its source turn's window;
- ``infer``: ``Memory.add(turn, infer=True)`` per turn: facts extracted online by the answer model (schema-constrained
  JSON), reconciled with the most similar memories (ADD/UPDATE/DELETE/NONE);
- ``raw``: ``Memory.add(turn, infer=False)`` per turn: every turn is a fact, verbatim (``"<speaker>: <text>"``).

Turns carry their session's date as the timestamp. Then every category 1-4 question whose evidence lies in the
replayed sessions is answered at ``k`` by KV and by prompt injection and scored with LoCoMo's token F1
(``eval_locomo.locomo_f1``). Reported per arm: F1 by mode and category, facts stored, stored bytes (the store
directory), and ``add`` wall time per turn (p50/p95; the observations arm is one batch ingest, reported as its
total divided by the turns).
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from ..bench.eval_locomo import CATEGORY_NAMES, locomo_f1
from ..engines.select import open_engine
from ..locomo import Conversation
from ..locomo_ingest import ingest_conversation
from ..memory import Memory
from ..models import load
from ..retrieve import Embedder
from ..service import MemoryService
from ..store import Store
from .common import answer_batch, check_engine, load_samples, log_err, machine, median, p95, pyplot, table, write_json
from .recall import describe, parse_fusion

ARMS = ("observations", "infer", "raw")
BATCH = 32


def session_timestamp(date: str, fallback: float) -> float:
    """LoCoMo's ``"1:56 pm on 8 May, 2023"`` -> Unix seconds (UTC); ``fallback`` when it does not parse."""
    try:
        return datetime.strptime(date.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return fallback


def _evidence_sessions(q) -> list[int]:
    out = []
    for e in q.evidence:
        e = str(e).strip()
        if e.startswith("D") and ":" in e and e[1:].split(":")[0].isdigit():
            out.append(int(e[1:].split(":")[0]))
    return out


def replay_questions(conv, sessions: int) -> list[tuple[int, object]]:
    """(index in the sample's qa list, question) for category 1-4 questions answerable from sessions 1..``sessions``."""
    out = []
    for i, q in enumerate(conv.questions):
        ev = _evidence_sessions(q)
        if 1 <= q.category <= 4 and ev and max(ev) <= sessions and q.question.strip():
            out.append((i, q))
    return out


def build_arm(arm: str, conv, root: Path, lm, embedder, window: int, log=log_err, engine=None) -> dict:
    """Replay ``conv`` (already cut to the replayed sessions) into a fresh store at ``root``; the arm's figures."""

    if root.exists():
        shutil.rmtree(root)
    add_ms = []
    t0 = time.perf_counter()
    if arm == "observations":
        rep = ingest_conversation(lm, embedder, root, conv, window, progress=False)
        add_ms = [rep.total_s * 1e3 / max(1, len(conv.turns))] * len(conv.turns)
    else:
        mem = Memory(root, model=lm, window=window, embedder=embedder, engine=engine)
        base = time.time()
        for i, t in enumerate(conv.turns):
            ts = session_timestamp(t.date, base) + 60 * i  # turns in order within a session
            a = time.perf_counter()
            mem.add(
                [{"role": "user", "content": f"{t.speaker}: {t.text}"}],
                conv.sample_id,
                infer=arm == "infer",
                timestamp=ts,
            )
            add_ms.append((time.perf_counter() - a) * 1e3)
            if (i + 1) % 20 == 0:
                log(f"  {arm} {conv.sample_id}: {i + 1}/{len(conv.turns)} turns, last add {add_ms[-1]:.0f} ms")
        mem.store.close()

    st = Store.open(root)
    facts, stored_bytes = len(st.reads.snapshot(conv.sample_id).facts), st.disk_bytes()
    st.close()
    return {
        "arm": arm,
        "sample": conv.sample_id,
        "turns": len(conv.turns),
        "facts": facts,
        "stored_bytes": stored_bytes,
        "build_s": round(time.perf_counter() - t0, 2),
        "add_ms_p50": round(median(add_ms), 1),
        "add_ms_p95": round(p95(add_ms), 1),
        "add_ms": add_ms,
    }


def cut(conv, sessions: int):
    """``conv`` with only its first ``sessions`` sessions' turns and observation facts."""

    turns = [t for t in conv.turns if t.session <= sessions]
    facts = [f for f in conv.facts if int(f.fact_id.split("/s")[1].split("/")[0]) <= sessions]
    return Conversation(conv.sample_id, turns, facts, conv.questions)


def run(
    data: Path,
    out: Path,
    samples: list[str],
    arms: list[str],
    sessions: int,
    k: int,
    window: int,
    model: str,
    engine: str,
    max_new_tokens: int = 32,
    reuse: bool = False,
    retrieval: str = "hybrid",
) -> dict:
    """``reuse``: keep a store already built by an earlier run into ``out`` (its figures are in builds.json) and
    only answer. ``retrieval``: what the answers rank by (``recall.parse_fusion``); the summary records it."""

    check_engine(engine)
    fusion = parse_fusion(retrieval)
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    out.mkdir(parents=True, exist_ok=True)
    convs = [cut(c, sessions) for c in load_samples(Path(data), samples)]
    lm, embedder = load(model), Embedder()
    # one engine for extraction and answers
    opened = open_engine(lm, engine, stores=[out / "stores"], vllm_options={"max_model_len": 8192})
    if opened.note:
        log_err(opened.note)
    eng = opened.engine
    engine = eng.name

    done = json.loads((out / "builds.json").read_text()) if reuse and (out / "builds.json").exists() else []
    builds = []
    for conv in convs:
        for arm in arms:
            old = [b for b in done if b["arm"] == arm and b["sample"] == conv.sample_id]
            if old and (out / "stores" / arm / conv.sample_id / "manifest.json").exists():
                builds.append(old[0])
                log_err(f"replay {conv.sample_id} arm {arm}: reusing the store built earlier")
                continue
            log_err(f"replay {conv.sample_id} ({len(conv.turns)} turns, sessions 1-{sessions}) arm {arm} ...")
            b = build_arm(arm, conv, out / "stores" / arm / conv.sample_id, lm, embedder, window, engine=eng)
            log_err(
                f"  -> {b['facts']} facts, {b['stored_bytes'] / 1e6:.1f} MB, add p50 {b['add_ms_p50']} ms "
                f"p95 {b['add_ms_p95']} ms ({b['build_s']} s)"
            )
            builds.append(b)
            write_json(out / "builds.json", builds + [d for d in done if d not in builds])
    records = []  # answer every arm's store through the one engine
    for arm in arms:
        svcs = {}
        for conv in convs:
            root = out / "stores" / arm / conv.sample_id
            svcs[conv.sample_id] = MemoryService(root, eng, lm, embedder, fusion=fusion)
        items = [
            (c.sample_id, i, q, mode)
            for c in convs
            for i, q in replay_questions(c, sessions)
            for mode in ("kv", "prompt")
        ]
        for s in range(0, len(items), BATCH):
            chunk = items[s : s + BATCH]
            answers = answer_batch(svcs, [(c, q.question, k, m) for c, _, q, m in chunk], max_new_tokens)
            for (sample, i, q, mode), a in zip(chunk, answers):
                records.append(
                    {
                        "arm": arm,
                        "sample": sample,
                        "qid": f"{sample}#{i}",
                        "category": q.category,
                        "mode": mode,
                        "question": q.question,
                        "reference": q.answer,
                        "answer": a.answer,
                        "f1": locomo_f1(a.answer, q.answer, q.category),
                        "k": a.k,
                        "fact_ids": a.fact_ids,
                        "ttft_ms": a.timings_ms["ttft"],
                    }
                )
        log_err(f"answered {len(items)} (question, mode) pairs for arm {arm}")
    rows = []
    for arm in arms:
        bs = [b for b in builds if b["arm"] == arm]
        row = {
            "arm": arm,
            "turns": sum(b["turns"] for b in bs),
            "facts": sum(b["facts"] for b in bs),
            "stored_bytes": sum(b["stored_bytes"] for b in bs),
            "add_ms_p50_by_sample": {b["sample"]: b["add_ms_p50"] for b in bs},
            "add_ms_p95_by_sample": {b["sample"]: b["add_ms_p95"] for b in bs},
        }
        for mode in ("kv", "prompt"):
            rs = [r for r in records if r["arm"] == arm and r["mode"] == mode]
            row[f"f1_{mode}"] = round(100 * sum(r["f1"] for r in rs) / max(1, len(rs)), 2)
            row["questions"] = len(rs)
            for cat, name in CATEGORY_NAMES.items():
                rc = [r["f1"] for r in rs if r["category"] == cat]
                row[f"f1_{mode}_{name}"] = round(100 * sum(rc) / len(rc), 2) if rc else None
                row[f"n_{name}"] = len(rc)
        rows.append(row)
    summary = {
        "machine": machine(),
        "model": lm.name,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "engine": engine,
        "data": str(data),
        "samples": [c.sample_id for c in convs],
        "sessions": sessions,
        "k": k,
        "window": window,
        "retrieval": describe(fusion),
        "rows": rows,
        "builds": [{**b, "add_ms": None} for b in builds],
    }
    write_json(out / "replay.json", summary)
    write_json(out / "records.json", records)
    head = ["arm", "facts", "MB", "add p50 ms (per sample)", "add p95 ms", "F1 kv", "F1 prompt"] + [
        f"{n} kv/prompt" for n in CATEGORY_NAMES.values()
    ]
    body = [
        [
            r["arm"],
            r["facts"],
            f"{r['stored_bytes'] / 1e6:.1f}",
            " / ".join(f"{v:.0f}" for v in r["add_ms_p50_by_sample"].values()),
            " / ".join(f"{v:.0f}" for v in r["add_ms_p95_by_sample"].values()),
            r["f1_kv"],
            r["f1_prompt"],
        ]
        + [f"{r[f'f1_kv_{n}']}/{r[f'f1_prompt_{n}']} (n={r[f'n_{n}']})" for n in CATEGORY_NAMES.values()]
        for r in rows
    ]
    (out / "replay.md").write_text(table(body, head) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["f1_kv"] for r in rows], 0.4, label="KV injection")
    ax.bar([x + 0.2 for x in xs], [r["f1_prompt"] for r in rows], 0.4, label="prompt injection")
    ax.set_xticks(list(xs), [f"{r['arm']}\n{r['facts']} facts" for r in rows])
    ax.set_ylabel("token F1 (categories 1-4)")
    ax.set_title(
        f"LoCoMo replay ({', '.join(summary['samples'])}, sessions 1-{sessions}, k={k}, w={window})", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "replay.png", dpi=120)
    print(table(body, head))
    return summary
