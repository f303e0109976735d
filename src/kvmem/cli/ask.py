"""``kvmem ask``: answer one question from a user's memory."""

from __future__ import annotations

import typer

from .common import DTYPE, ENGINE, emit, friendly, store_option


@friendly
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: str = store_option(),
    user: str = typer.Option(..., help="User id (LoCoMo sample_id for ingest-locomo stores)."),
    k: int = typer.Option(5, "--k", help="Facts to retrieve (top_k)."),
    mode: str = typer.Option("kv", help="kv (KV injection) or prompt (prompt injection baseline)."),
    max_new_tokens: int = typer.Option(32),
    max_context: int | None = typer.Option(None, help="Context limit in tokens (default: the model's)."),
    engine: str = ENGINE,
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per call."),
    tail_recompute: int = typer.Option(
        0,
        "--tail-recompute",
        help="kv mode: prefill the last r retrieved facts "
        "with the question instead of injecting them (cross-fact repair).",
    ),
    selective_recompute: int = typer.Option(
        0,
        "--selective-recompute",
        min=0,
        max=100,
        help="kv mode, transformers engine (--engine hf, or auto where "
        "it picks hf): recompute this percentage of the injected fact tokens, those the question attends to most "
        "(0 = off).",
    ),
):
    """Answer QUESTION from USER's memory."""
    from ..compose import check_text

    if not question.strip():
        raise ValueError("empty question")
    check_text(question, "the question")
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if max_context is not None and max_context < 1:
        raise ValueError(f"--max-context must be >= 1, got {max_context}")
    if mode not in ("kv", "prompt"):
        raise ValueError(f"--mode must be kv or prompt, not {mode!r}")
    if tail_recompute < 0:
        raise ValueError(f"--tail-recompute must be >= 0, got {tail_recompute}")
    if tail_recompute and mode != "kv":
        raise ValueError("--tail-recompute works in --mode kv only")
    if selective_recompute and (mode != "kv" or tail_recompute):
        raise ValueError("--selective-recompute works in --mode kv without --tail-recompute")
    from ..hardware import resolve_dtype
    from ..policy import Method
    from ..service import MemoryService, check_methods
    from ..store import Store

    method = Method.of(mode, None, selective_recompute)
    check_methods([method], engine)  # --selective-recompute where the engine cannot: before anything loads
    dtype = resolve_dtype(dtype)
    with_store = Store.open(store)  # unknown store/user fail here, before any engine starts
    with_store.reads.user_info(user)
    if with_store.fingerprint.get("dtype") != dtype:  # refuse before any model loads (raises StoreDtypeMismatch)
        Store.open(store, {**with_store.fingerprint, "dtype": dtype})
    with_store.close()
    svc = MemoryService.open(store, engine=engine, dtype=dtype, max_context=max_context)
    if svc.engine_note:
        typer.echo(svc.engine_note, err=True)
    engine = svc.engine.name
    svc.tail_recompute = tail_recompute
    try:
        ans = svc.ask(user, question, k, method, max_new_tokens)
    finally:
        svc.engine.close()
    if ans.k < k:
        typer.echo(f"note: {user!r} has only {ans.k} facts; used k={ans.k}, not {k}", err=True)
    if as_json:
        emit({**ans.to_json(), "tail_recompute": tail_recompute, "selective_recompute": selective_recompute}, True)
    else:
        t = ans.timings_ms
        typer.echo(
            f"{ans.answer}\n[{engine} {mode} k={ans.k} prompt={ans.prompt_tokens} prefilled={ans.prefilled_tokens} "
            f"ttft={t['ttft']:.0f} ms total={t['total']:.0f} ms]"
        )
