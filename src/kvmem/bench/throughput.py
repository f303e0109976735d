"""``kvmem bench throughput``: completed requests per second vs number of users, KV vs prompt injection.

Each user issues 2 distinct questions at once (all users together: 2·U requests submitted at t=0), greedy,
exactly ``--tokens`` output tokens (EOS does not stop generation). QPS = completed requests / wall time from
submission to the last completion, **including** embedding, retrieval and composition.

The transformers (hf) engine serves one request at a time (batch size 1, FIFO): concurrency only queues, it is
not batched. That is what is measured and reported as such; the vLLM engine batches.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .common import (
    Setup,
    answer_batch,
    log_err,
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
SEQUENTIAL_NOTE = (
    "hf engine: requests are served one at a time in arrival order (batch size 1, no continuous "
    "batching); the 2·U requests of a round are all queued at t=0 and drained sequentially, so QPS "
    "here is the single-stream rate including retrieval and composition, not a batched one"
)


BATCHED_NOTE = (
    "vllm engine: each round's 2·U requests are retrieved and composed, then submitted together in one "
    "generate call (continuous batching, ignore_eos); QPS includes retrieval and composition"
)


def _sequential_round(svcs, reqs, k: int, mode: str, tokens: int, t0: float) -> list[tuple[object, float]]:
    """FIFO, for an engine that serves one request at a time. Returns (Answer, completion ms since t0) per
    request."""
    out = []
    for _, q in reqs:
        (a,) = answer_batch(svcs, [(q.sample, q.question, k, mode)], tokens, ignore_eos=True)
        out.append((a, (time.perf_counter() - t0) * 1e3))
    return out


def _batched_round(svcs, reqs, k: int, mode: str, tokens: int, t0: float) -> list[tuple[object, float]]:
    """All requests of a round go to the engine in one batch (``answer_batch``); completion time is the batch's
    end."""
    answers = answer_batch(svcs, [(q.sample, q.question, k, mode) for _, q in reqs], tokens, ignore_eos=True)
    t_done = (time.perf_counter() - t0) * 1e3
    return [(a, t_done) for a in answers]


def user_requests(qs, convs, users: int) -> list[tuple[int, object]]:
    """User ``u`` talks to conversation ``u mod n`` and asks 2 distinct questions of it."""
    by_sample: dict[str, list] = {}
    for q in qs:
        by_sample.setdefault(q.sample, []).append(q)
    order = [c.sample_id for c in convs if c.sample_id in by_sample]
    reqs = []
    for u in range(users):
        s = order[u % len(order)]
        pool = by_sample[s]
        n = u // len(order)
        reqs += [(u, pool[(2 * n) % len(pool)]), (u, pool[(2 * n + 1) % len(pool)])]
    return reqs


def run(
    data: Path,
    out: Path,
    users: list[int],
    k: int,
    window: int,
    samples: list[str] | None,
    questions: int | None,
    model: str,
    engine: str,
    tokens: int = 50,
    store_device: str = "host",
    show_progress: bool = True,
    echo=print,
    retrieval: str = "hybrid",
) -> dict:
    """``retrieval``: what the services rank by (``recall.parse_fusion``); the summary records it."""
    note = store_device_note(store_device)
    setup = Setup.load(data, samples, model, engine, show_progress, parse_fusion(retrieval))
    qs = select_questions(setup.convs, questions)
    per_sample = {}
    for q in qs:
        per_sample[q.sample] = per_sample.get(q.sample, 0) + 1
    if not qs or max(per_sample.values()) < 2:
        raise ValueError("throughput needs at least 2 category 1-4 questions per sample (raise --questions)")
    info = machine()
    svcs = setup.services(window, log_err)
    eng = setup.start()
    engine, batches = eng.name, eng.batches
    run_round = _batched_round if batches else _sequential_round
    q0 = qs[0]
    for mode in MODES:  # warm-up
        svcs[q0.sample].ask(q0.sample, q0.question, k, mode, tokens)
    records: list[dict] = []
    qps: dict = {m: {} for m in MODES}
    lat: dict = {m: {} for m in MODES}
    bar = progress(sum(2 * u for u in users) * len(MODES), "throughput", show_progress)
    for ui, u in enumerate(users):
        reqs = user_requests(qs, setup.convs, u)
        for mode in MODES if ui % 2 == 0 else MODES[::-1]:
            t0 = time.perf_counter()
            done = []
            served = run_round(svcs, reqs, k, mode, tokens, t0)
            for ri, ((user, q), (a, t_done)) in enumerate(zip(reqs, served)):
                if a.generated_tokens != tokens:
                    raise AssertionError(f"expected exactly {tokens} output tokens, got {a.generated_tokens}")
                done.append(t_done)
                records.append(
                    {
                        "users": u,
                        "mode": mode,
                        "user": user,
                        "request": ri,
                        "qid": q.qid,
                        "sample": q.sample,
                        "k": a.k,
                        "completed_ms": round(t_done, 3),
                        "service_ms": round(a.timings_ms["total"] + a.timings_ms["decode"], 3),
                        "ttft": a.timings_ms["ttft"],
                        "embed": a.timings_ms["embed"],
                        "search": a.timings_ms["search"],
                        "compose": a.timings_ms["compose"],
                        "decode": a.timings_ms["decode"],
                        "generated_tokens": a.generated_tokens,
                        "prompt_tokens": a.prompt_tokens,
                        "prefilled_tokens": a.prefilled_tokens,
                    }
                )
                bar.update(1)
            wall = time.perf_counter() - t0
            qps[mode][str(u)] = round(len(reqs) / wall, 4)
            lat[mode][str(u)] = {
                "median_completion_ms": round(median(done), 3),
                "p95_completion_ms": round(p95(done), 3),
                "wall_s": round(wall, 3),
                "requests": len(reqs),
            }
    bar.close()
    ratios = {"kv_over_prompt": {str(u): ratio(qps["kv"][str(u)], qps["prompt"][str(u)]) for u in users}}
    summary = {
        "command": "bench throughput",
        "engine": engine,
        "model": model,
        "data": str(data),
        "samples": [c.sample_id for c in setup.convs],
        "users": users,
        "k": k,
        "window": window,
        "retrieval": describe(setup.fusion),
        "output_tokens": tokens,
        "requests_per_user": 2,
        "qps": qps,
        "ratios": ratios,
        "latency": lat,
        "includes_retrieval_and_composition": True,
        "concurrency_note": BATCHED_NOTE if batches else SEQUENTIAL_NOTE,
        "store_device": store_device,
        "store_device_note": note,
        "machine": {**info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    write_summary_and_records(out, summary, records)
    rows = [
        [
            u,
            qps["kv"][str(u)],
            qps["prompt"][str(u)],
            ratios["kv_over_prompt"][str(u)],
            lat["kv"][str(u)]["p95_completion_ms"],
            lat["prompt"][str(u)]["p95_completion_ms"],
        ]
        for u in users
    ]
    header = ["users", "kv_qps", "prompt_qps", "kv/prompt", "kv_p95_ms", "prompt_p95_ms"]
    write_csv(out / "summary.csv", [dict(zip(header, r)) for r in rows])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode, c in (("kv", "tab:blue"), ("prompt", "tab:red")):
        ax.plot(users, [qps[mode][str(u)] for u in users], "o-", color=c, label=f"{mode} injection")
    ax.set_xscale("log", base=2)
    ax.set_xticks(users)
    ax.set_xticklabels([str(u) for u in users])
    ax.set_xlabel("concurrent users (2 requests each)")
    ax.set_ylabel("QPS (incl. retrieval + composition)")
    ax.set_title(f"Throughput, k={k}, {tokens} output tokens ({engine})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "qps_vs_users.png", dpi=120)
    plt.close(fig)
    echo(table(rows, header))
    if not batches:
        echo(SEQUENTIAL_NOTE)
    echo(note)
    echo(f"wrote {out}/summary.json, records.json, records.csv, summary.csv, qps_vs_users.png")
    return summary
