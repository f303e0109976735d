"""``kvmem eval ...``: accuracy evaluations (LoCoMo, comparisons, the accuracy-latency frontier, recall), thin
wrappers over kvmem.bench, imported only when one runs."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policy import MODES_HELP, Encoding
from .bench import DATA, PROGRESS, RETRIEVAL, bench_args
from .common import (
    DEFAULT_MODEL,
    ENGINE,
    LOCOMO_HISTORY,
    LOCOMO_NEIGHBOURS,
    MODEL,
    WINDOW_HELP,
    bench_module,
    friendly,
)

eval_app = typer.Typer(no_args_is_help=True, help="Accuracy evaluations.")


@eval_app.command("locomo")
@friendly
def eval_locomo(
    k: str = typer.Option("20", "--k", help="Comma-separated k values."),
    window: str | None = typer.Option(None, "--window", help="Comma-separated. " + WINDOW_HELP),
    mode: str = typer.Option(
        "kv,prompt", "--mode", help=f"Comma-separated: {MODES_HELP}; kv-sel on the transformers engine."
    ),
    neighbours: int | None = LOCOMO_NEIGHBOURS,
    history: bool = LOCOMO_HISTORY,
    max_new_tokens: int = typer.Option(32),
    judge_url: str | None = typer.Option(None, "--judge-url", help="OpenAI-compatible base URL for an LLM judge."),
    judge_model: str | None = typer.Option(None, "--judge-model"),
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = typer.Option(
        "conv-26,conv-49",
        "--samples",
        help="Comma-separated LoCoMo sample ids (the conversations of docs/benchmarks.md's headline F1).",
    ),
    questions: int = typer.Option(
        40,
        "--questions",
        help="Deterministic subset of N category 1-4 questions (0 = all; the headline uses 0, 300 questions).",
    ),
    out: Path = typer.Option(Path("runs/eval/locomo"), "--out"),
    show_progress: bool = PROGRESS,
    retrieval: str = RETRIEVAL,
    order: str = typer.Option(
        "relevance",
        "--order",
        help="How the retrieved facts are composed: relevance (the most relevant next to the query) or time "
        "(write order, oldest first).",
    ),
):
    """LoCoMo categories 1-4: token F1, exact match (and an LLM judge), KV vs prompt; resumable (records.jsonl);
    evidence recall@k per category."""
    ev = bench_module("eval_locomo")
    from ..bench.common import int_list, str_list

    window = window if window is not None else str(Encoding.of(None, neighbours, history).window)
    ev.run(
        data,
        out,
        int_list(k, "--k", 1),
        int_list(window, "--window"),
        str_list(mode),
        bench_args(samples),
        questions,
        model,
        engine,
        max_new_tokens,
        judge_url,
        judge_model,
        show_progress,
        typer.echo,
        neighbours=neighbours,
        history=history,
        retrieval=retrieval,
        order=order,
    )


@eval_app.command("compare")
@friendly
def eval_compare(
    a: Path = typer.Argument(..., metavar="A", help="The --out directory of a kvmem eval locomo run (the reference)."),
    b: Path = typer.Argument(..., metavar="B", help="The --out directory of another, on the same questions."),
    out: Path | None = typer.Option(None, "--out", help="Also write compare.json and compare.md here."),
    select_a: list[str] = typer.Option(
        [],
        "--a",
        help="KEY=VALUE: A's records with this setting (model, mode, k, window, neighbours, history); "
        "the key is paired across. Repeatable.",
    ),
    select_b: list[str] = typer.Option([], "--b", help="KEY=VALUE: B's records with this setting, as --a."),
):
    """Two eval locomo runs paired question by question: F1 by category for every setting both answered, and B
    minus A with a paired bootstrap 95% CI (e.g. --order time against relevance, hybrid against cosine; with
    --a mode=prompt --b mode=kv, two modes of one run; with --a window=0 --b window=5, two encodings)."""
    compare = bench_module("compare")
    sel_a, sel_b = compare.parse_select(select_a, "a"), compare.parse_select(select_b, "b")
    compare.run(a, b, out, typer.echo, sel_a, sel_b)


@eval_app.command("frontier")
@friendly
def eval_frontier(
    models: str = typer.Option(
        f"{DEFAULT_MODEL},qwen2.5-coder-1.5b-instruct",
        "--models",
        help="Comma-separated answer models (registry names).",
    ),
    methods: str = typer.Option(
        "prompt,kv,kv-tail2,kv-tail4,kv-tail8",
        "--methods",
        help=f"Comma-separated serving methods: prompt and at least one of {MODES_HELP}.",
    ),
    k: str = typer.Option("5,10,20,50,100", "--k", help="Comma-separated k values."),
    window: int | None = typer.Option(None, "--window", help=WINDOW_HELP),
    neighbours: int | None = LOCOMO_NEIGHBOURS,
    history: bool = LOCOMO_HISTORY,
    data: Path = DATA,
    engine: str = ENGINE,
    samples: str = typer.Option(
        "conv-26,conv-49", "--samples", help="Comma-separated LoCoMo sample ids (the held-out pair of the headline)."
    ),
    questions: int = typer.Option(0, "--questions", help="Category 1-4 questions scored per point (0 = all)."),
    latency_questions: int = typer.Option(
        20, "--latency-questions", help="The first N of them timed one request at a time for each point's TTFT."
    ),
    max_new_tokens: int = typer.Option(32),
    judge_url: str | None = typer.Option(None, "--judge-url", help="OpenAI-compatible base URL for an LLM judge."),
    judge_model: str | None = typer.Option(None, "--judge-model"),
    out: Path = typer.Option(Path("runs/eval/frontier"), "--out"),
    plot: Path | None = typer.Option(None, "--plot", help="Also write the plot here (e.g. docs/img/<name>.png)."),
    add_run: list[Path] = typer.Option(
        [],
        "--add-run",
        help="An earlier eval frontier --out (same questions, encoding and machine kind) whose other models join the "
        "tables, targets and plot; repeatable.",
    ),
    show_progress: bool = PROGRESS,
    retrieval: str = typer.Option(
        "hybrid",
        "--retrieval",
        help="What the latency run and the answers rank by: hybrid (the default), rrf[:K[:W]], weighted[:W] or cosine "
        "(runs before 2026-12-07 ranked by cosine).",
    ),
):
    """The accuracy-latency frontier: LoCoMo F1 (batched eval) against median TTFT (a separate one-at-a-time
    latency run) of every model, method and k, and for each prompt-injection point the best kvmem point with no
    higher TTFT, with a paired bootstrap 95% CI; resumable."""
    frontier = bench_module("frontier")
    from ..bench.common import int_list, str_list

    frontier.run(data, out, str_list(models), str_list(methods), int_list(k, "--k", 1), bench_args(samples),
                 questions, latency_questions, engine, window, neighbours, history, max_new_tokens, judge_url,
                 judge_model, plot, show_progress, typer.echo, add_run, retrieval)  # fmt: skip


@eval_app.command("recall")
@friendly
def eval_recall(
    retrieval: str = typer.Option(
        "cosine,hybrid",
        "--retrieval",
        help="Comma-separated: cosine, hybrid (the default fusion), rrf[:K[:W]], weighted[:W]; the first is the "
        "baseline of the gains.",
    ),
    k: str = typer.Option("5,10,20,50,100", "--k", help="Comma-separated k values."),
    data: Path = DATA,
    samples: str = typer.Option(
        "conv-26,conv-49", "--samples", help="Comma-separated LoCoMo sample ids ('' = all; the held-out pair)."
    ),
    model: str = typer.Option(
        "smollm2-135m-instruct",
        "--model",
        help="The model the stores are built with (retrieval reads no KV, so the smallest will do).",
    ),
    out: Path = typer.Option(Path("runs/eval/recall"), "--out"),
    show_progress: bool = PROGRESS,
):
    """LoCoMo evidence recall@k per category: the share of questions' evidence turns whose facts are retrieved
    (retrieval only, no answer model: minutes on a CPU)."""
    recall = bench_module("recall")
    from ..bench.common import int_list, str_list

    recall.run(data, out, bench_args(samples), str_list(retrieval), int_list(k, "--k", 1), model, show_progress,
               typer.echo)  # fmt: skip
