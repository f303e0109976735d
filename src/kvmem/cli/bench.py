"""``kvmem bench ...``: thin wrappers over kvmem.bench, imported only when one runs.

kvmem.bench is the ``bench`` extra: ``common.bench_module`` imports it, or says in one line how to install it."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policy import Method
from .common import (
    DEFAULT_MODEL,
    DTYPE,
    ENGINE,
    LOCOMO_DATA,
    LOCOMO_ENV,
    MODEL,
    bench_module,
    check_kv_format_name,
    friendly,
)

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: latency, throughput, footprint, encode, memory, replay, serve (JSON/CSV/PNG).",
)

DATA = typer.Option(LOCOMO_DATA, "--data", envvar=LOCOMO_ENV, help="LoCoMo-format JSON.")
SAMPLES = typer.Option("conv-26", "--samples", help="Comma-separated LoCoMo sample ids ('' = all).")
QUESTIONS = typer.Option(10, "--questions", help="Deterministic subset of N category 1-4 questions (0 = all).")
STORE_DEVICE = typer.Option("host", "--store-device", help="host (pinned, streamed) or device (resident).")
PROGRESS = typer.Option(True, "--progress/--no-progress", help="Show a progress bar.")
RETRIEVAL = typer.Option(
    "hybrid",
    "--retrieval",
    help="hybrid (the default: weighted:0.1), rrf[:K[:W]] or weighted[:W] (cosine fused with BM25), or cosine.",
)


def bench_args(samples: str) -> list[str] | None:
    """--samples as the bench modules take it: the sample ids, or None for all."""
    return bench_module("common").str_list(samples) or None


@bench_app.command("latency")
@friendly
def bench_latency(
    k: str = typer.Option("5,10,20,50", "--k", help="Comma-separated k values."),
    window: str = typer.Option("5", "--window", help="Comma-separated encoding windows."),
    max_new_tokens: int = typer.Option(32, help="Tokens per answer (query-to-full-answer)."),
    store_device: str = STORE_DEVICE,
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/latency"), "--out"),
    show_progress: bool = PROGRESS,
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
    retrieval: str = RETRIEVAL,
):
    """TTFT, query-to-first-token and query-to-full-answer vs k: KV vs prompt injection vs the bare query."""
    latency = bench_module("latency")
    from ..bench.common import int_list, str_list

    tails = int_list(tail_recompute, "--tail-recompute", 1) if tail_recompute else []
    extra = [str(Method("kv", r)) for r in tails]
    for m in str_list(methods):
        method = Method.parse(m)
        if method.mode != "kv" or not (method.tail or method.recompute):
            raise ValueError(f"--methods takes kv-tail<r> and kv-sel<p>, not {m!r}")
        extra.append(str(method))
    latency.run(
        data,
        out,
        int_list(k, "--k", 1),
        int_list(window, "--window"),
        bench_args(samples),
        questions,
        model,
        engine,
        max_new_tokens,
        store_device,
        show_progress,
        typer.echo,
        methods=extra,
        retrieval=retrieval,
    )


@bench_app.command("kvformat")
@friendly
def bench_kvformat(
    k: str = typer.Option("5,20,50", "--k", help="Comma-separated k values (TTFT)."),
    formats: str = typer.Option("native,int8,fp8", "--formats", help="Comma-separated KV formats (native first)."),
    window: int = typer.Option(5, "--window", help="Encoding window of the cached stores."),
    deviation_k: int = typer.Option(20, "--deviation-k", help="k of the logit deviation arm."),
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = typer.Option(20, "--questions", help="Category 1-4 questions (0 = all)."),
    f1_questions: int = typer.Option(0, "--f1-questions", help="Also score LoCoMo F1 per format on N questions."),
    out: Path = typer.Option(Path("runs/bench/kvformat"), "--out"),
    show_progress: bool = PROGRESS,
):
    """Stored KV formats side by side: bytes per fact token, logit deviation and greedy agreement against the
    lossless store, and kv-mode TTFT at each k."""
    kvformat = bench_module("kvformat")
    from ..bench.common import int_list, str_list

    kvformat.run(
        data,
        out,
        int_list(k, "--k", 1),
        str_list(formats),
        bench_args(samples),
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
    data: Path = DATA,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = typer.Option(10, "--questions", help="Category 1-4 questions (0 = all)."),
    out: Path = typer.Option(Path("runs/bench/profile"), "--out"),
    show_progress: bool = PROGRESS,
):
    """One kv-mode request on vLLM, stage by stage (embed, search, plan; the worker's snapshot, read, dequantize,
    rotate, block write; the query's own forward and what the injected tokens add), at each k."""
    profile = bench_module("profile")
    from ..bench.common import int_list

    check_kv_format_name(kv_format)
    profile.run(
        data,
        out,
        int_list(k, "--k", 1),
        bench_args(samples),
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
    store_device: str = STORE_DEVICE,
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = typer.Option(0, "--questions", help="Question pool (0 = all category 1-4)."),
    out: Path = typer.Option(Path("runs/bench/throughput"), "--out"),
    show_progress: bool = PROGRESS,
    retrieval: str = RETRIEVAL,
):
    """Requests per second vs concurrent users (2 questions each), retrieval and composition included."""
    throughput = bench_module("throughput")
    from ..bench.common import int_list

    if k < 1 or tokens < 1:
        raise ValueError("--k and --tokens must be >= 1")
    throughput.run(
        data,
        out,
        int_list(users, "--users", 1),
        k,
        window,
        bench_args(samples),
        questions,
        model,
        engine,
        tokens,
        store_device,
        show_progress,
        typer.echo,
        retrieval,
    )


@bench_app.command("footprint")
@friendly
def bench_footprint(
    window: int = typer.Option(5, "--window"),
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/footprint"), "--out"),
    show_progress: bool = PROGRESS,
):
    """Stored KV bytes per fact token and per conversation vs 2*L*h*d*b, index/metadata bytes, serving RSS."""
    footprint = bench_module("footprint")

    footprint.run(
        data, out, window, bench_args(samples), questions, model, engine, show_progress=show_progress, echo=typer.echo
    )


@bench_app.command("encode")
@friendly
def bench_encode(
    window: str = typer.Option("0,5,20,50", "--window", help="Comma-separated encoding windows."),
    batch_tokens: int = typer.Option(2048, help="Padded tokens per forward pass."),
    data: Path = DATA,
    engine: str = ENGINE,
    model: str = MODEL,
    samples: str = SAMPLES,
    questions: int = QUESTIONS,
    out: Path = typer.Option(Path("runs/bench/encode"), "--out"),
    show_progress: bool = PROGRESS,
):
    """Offline encoding seconds per conversation and tokens/s, vs the plain batched forward on the same tokens."""
    ingest_cost = bench_module("ingest_cost")
    from ..bench.common import int_list

    ingest_cost.run(
        data,
        out,
        int_list(window, "--window"),
        bench_args(samples),
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
    searches: int = typer.Option(50, "--searches", help="Questions searched, each in every arm."),
    deletes: int = typer.Option(20, "--deletes", help="Memories deleted (each re-encodes its neighbours)."),
    window: int = typer.Option(5, "--window"),
    sample: str = typer.Option("conv-26", "--sample"),
    data: Path = DATA,
    model: str = MODEL,
    out: Path = typer.Option(Path("runs/bench/memory"), "--out"),
):
    """Online memory: add latency vs a plain forward over the same tokens, search at N memories, delete."""
    online_memory = bench_module("online_memory")

    if min(turns, facts, searches, deletes) < 1:
        raise ValueError("--turns, --facts, --searches and --deletes must be >= 1")
    online_memory.run(data, out, sample, turns, facts, window, model, searches, deletes, echo=typer.echo)


@bench_app.command("mcp")
@friendly
def bench_mcp(
    rounds: int = typer.Option(30, "--rounds", help="Rounds timed (after one warm-up), each a new MCP session."),
    model: str = typer.Option("smollm2-135m-instruct", "--model"),
    dtype: str = DTYPE,
    out: Path = typer.Option(Path("runs/bench/mcp"), "--out"),
):
    """MCP round trips over streamable HTTP (/mcp): a session, tools/list, add_memories, search_memory, side by
    side with the REST memories API's add and search, against an in-process server (p50 / p95, ms)."""
    from ..extras import require
    from ..hardware import resolve_dtype

    mcp_tools = bench_module("mcp_tools")
    require("mcp", "kvmem bench mcp")
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    mcp_tools.run(out, model, rounds, resolve_dtype(None if dtype == "auto" else dtype), echo=typer.echo)


@bench_app.command("toolcalls")
@friendly
def bench_toolcalls(
    target: list[str] = typer.Option(
        ..., "--target", help="NAME=URL of an OpenAI-compatible server (its /v1); repeat for several."
    ),
    reference: str = typer.Option("vllm", "--reference", help="The result the others are compared with, paired."),
    cases: int = typer.Option(0, "--cases", min=0, help="The first N cases only (0: all)."),
    modes: str = typer.Option("auto,required", "--modes", help="Comma-separated tool_choice modes."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Requests in flight at once."),
    api_key: str = typer.Option("none", "--api-key", envvar="KVMEM_API_KEY"),
    out: Path = typer.Option(Path("runs/bench/toolcalls"), "--out"),
):
    """Function-calling quality on a fixed set of single-turn cases (three tools each, one right; some where none
    fits): schema-valid calls, right function, exact arguments, no call when none fits, per tool_choice; each
    server's result is kept in --out and compared, paired (95% CI, McNemar), with --reference's."""
    toolcalls = bench_module("toolcalls")
    modes_list = bench_module("common").str_list(modes)
    if not modes_list or set(modes_list) - set(toolcalls.MODES):
        raise ValueError(f"--modes: a comma-separated subset of {','.join(toolcalls.MODES)}, not {modes!r}")
    named = []
    for t in target:
        name, sep, url = t.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")) or "/" in name:
            raise ValueError(f"--target: NAME=URL (an http(s) URL), not {t!r}")
        named.append((name, url))
    for name, url in named:
        toolcalls.run_target(
            name, url, out, cases, modes_list, max_tokens, api_key, concurrency=concurrency, echo=typer.echo
        )
    toolcalls.summarize(out, reference, echo=typer.echo)


@bench_app.command("erasure")
@friendly
def bench_erasure(
    data: Path = DATA,
    sample: str = typer.Option("conv-26", help="LoCoMo sample: the memories' text, and the conversation ingested."),
    counts: str = typer.Option(
        "100,1000", "--counts", help="Comma-separated memory counts of the user ('': the LoCoMo part alone)."
    ),
    deletes: int = typer.Option(10, "--deletes", help="Deletes timed per count and mode."),
    check: int = typer.Option(
        5, "--check", help="Erasures run for real on the LoCoMo store to confirm the count (-1: skip that part)."
    ),
    model: str = typer.Option("smollm2-135m-instruct", "--model"),
    copies: int = typer.Option(
        0,
        "--copies",
        min=0,
        help="Memories of the user in the copies part (0: skip it): deletes on a local store "
        "and on an object store read through a disk cache, then upkeep rounds until no file holds the KV.",
    ),
    retire_after: float = typer.Option(2.0, "--retire-after", min=0.0, help="retire_after_s in the copies part, s."),
    round_s: float = typer.Option(1.0, "--round", min=0.01, help="The upkeep's round in the copies part, s."),
    out: Path = typer.Option(Path("runs/bench/erasure"), "--out"),
):
    """Erasure: the time to delete one memory (re-encoding at once, and deferred), the facts re-encoded per
    deleted fact on a LoCoMo conversation (w=5, m=4), and (``--copies``) the time until no copy holds it."""
    from ..bench.common import int_list

    erasure = bench_module("erasure")
    sizes = int_list(counts, "--counts", 1) if counts else []
    erasure.run(data, out, sample, sizes, model, deletes, check=check, echo=typer.echo, copies_n=copies,
                retire_s=retire_after, round_s=round_s)  # fmt: skip


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
    answer_model: str = typer.Option(DEFAULT_MODEL, help="The answering server of the endpoint arm."),
    engine: str = ENGINE,
    answer_engine: str | None = typer.Option(
        None, "--answer-engine", help="The endpoint arm's answering server's engine (default: --engine)."
    ),
    dtype: str = DTYPE,
    cases: int = typer.Option(0, help="The first N cases only (0: all 44)."),
    out: Path = typer.Option(Path("runs/bench/extract"), "--out"),
):
    """Fact extraction on the scripted set: memory-state precision / recall, leaks, forgets, corrections,
    abstention on trap questions, add latency."""
    extraction = bench_module("extraction")

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
    data: Path = DATA,
    model: str = MODEL,
    out: Path = typer.Option(Path("runs/bench/chat-cost"), "--out"),
):
    """kv-mode embed + search + compose per chat at growing memory counts (transformers engine)."""
    chat_cost = bench_module("chat_cost")
    from ..bench.common import int_list

    if fact_tokens < 1 or chats < 1 or k < 1 or cache_bytes < 1:
        raise ValueError("--fact-tokens, --chats, --k and --cache-bytes must be >= 1")
    chat_cost.run(
        data, out, model, int_list(counts, "--counts", 1), fact_tokens, chats, k, cache_bytes, echo=typer.echo
    )


@bench_app.command("tools")
@friendly
def bench_tools(
    k: str = typer.Option("5,20", "--k", help="Comma-separated k values."),
    tools: str = typer.Option("0,3,20", "--tools", help="Comma-separated tool counts (0-20; 0 = no tools)."),
    chats: int = typer.Option(5, "--chats", help="Chats timed per arm (k, tools, mode)."),
    memories: int = typer.Option(40, "--memories", help="Memories of the user (random KV)."),
    fact_tokens: int = typer.Option(16, "--fact-tokens"),
    dtype: str = DTYPE,
    model: str = MODEL,
    out: Path = typer.Option(Path("runs/bench/tools"), "--out"),
):
    """TTFT of a tool-using chat with memory, kv (tools block injected) against prompt mode (transformers engine)."""
    tools_cost = bench_module("tools_cost")
    from ..bench.common import int_list

    if min(chats, memories, fact_tokens) < 1:
        raise ValueError("--chats, --memories and --fact-tokens must be >= 1")
    ks, counts = int_list(k, "--k", 1), int_list(tools, "--tools", 0)
    tools_cost.run(
        out, model, ks, counts, chats, memories, fact_tokens, None if dtype == "auto" else dtype, echo=typer.echo
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
    searches: int = typer.Option(40, "--searches", help="Searches timed per backend."),
    gathers: int = typer.Option(20, "--gathers", help="Gathers timed per backend, size (20, 50) and cache state."),
    chats: int = typer.Option(20, "--chats", help="kv-mode chats timed per TTFT arm."),
    k: int = typer.Option(20, "--k"),
    data: Path = DATA,
    model: str = MODEL,
    out: Path = typer.Option(Path("runs/bench/store"), "--out"),
):
    """The local and the shared store side by side: add, delete, search, gather (cold / warm), TTFT via serve."""
    store_backends = bench_module("store_backends")

    if min(adds, searches, gathers, chats, k) < 1 or memories < 50 or not 0 <= deletes <= adds:
        raise ValueError(
            "--adds, --searches, --gathers, --chats and --k must be >= 1, --memories >= 50 (gathers of 50), "
            "--deletes <= --adds"
        )
    store_backends.run(data, out, model, postgres, segments, adds, deletes, memories, searches, gathers, chats, k,
                       echo=typer.echo)  # fmt: skip


@bench_app.command("replay")
@friendly
def bench_replay(
    samples: str = typer.Option("conv-26,conv-30", "--samples"),
    arms: str = typer.Option("observations,infer,raw", "--arms", help="Comma-separated: observations, infer, raw."),
    sessions: int = typer.Option(3, "--sessions", help="Replay sessions 1..N of each sample."),
    k: int = typer.Option(20, "--k"),
    window: int = typer.Option(5, "--window"),
    data: Path = DATA,
    model: str = MODEL,
    engine: str = ENGINE,
    out: Path = typer.Option(Path("runs/bench/replay"), "--out"),
    reuse: bool = typer.Option(False, "--reuse", help="Keep stores an earlier run built in --out; only answer."),
    retrieval: str = RETRIEVAL,
):
    """Online memory on real input: LoCoMo replayed turn by turn through Memory.add in three arms, then answered."""
    replay = bench_module("replay")
    from ..bench.common import str_list

    if sessions < 1 or k < 1 or window < 0:
        raise ValueError("--sessions and --k must be >= 1, --window >= 0")
    replay.run(data, out, str_list(samples), str_list(arms), sessions, k, window, model, engine, reuse=reuse,
               retrieval=retrieval)  # fmt: skip


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
    scale_sim = bench_module("scale_sim")
    from ..bench.common import int_list

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
    engine: str = ENGINE,
    data: Path = DATA,
    model: str = MODEL,
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
    bench_module("common")
    from ..bench.common import int_list, str_list

    if servers is not None and cold_every:
        raise ValueError("--cold-every measures one server: leave out --servers")
    if users < 1 or duration <= 0 or sweep_duration <= 0 or k < 1 or facts < k or max_tokens < 1 or cold_every < 0:
        raise ValueError(
            "--users, --duration, --k, --max-tokens must be positive, --facts >= --k and --cold-every >= 0"
        )
    if servers is not None:
        replicas_load = bench_module("replicas_load")

        replicas_load.run(data, out, str_list(servers), users, duration, k, facts, engine, model, max_tokens, window,
                          postgres, fault)  # fmt: skip
        return
    serve_load = bench_module("serve_load")

    points = sorted(set(int_list(sweep, "--sweep", 1) + [users])) if sweep else [users]
    serve_load.run(
        data, out, points, duration, k, facts, engine, model, max_tokens, window, sweep_duration, cold_every=cold_every
    )


@bench_app.command("search")
@friendly
def bench_search(
    memories: int = typer.Option(10_000, "--memories", help="Memories of the one user searched."),
    queries: int = typer.Option(200, "--queries", help="LoCoMo questions searched per retrieval (after a first)."),
    k: int = typer.Option(20, "--k"),
    data: Path = DATA,
    out: Path = typer.Option(Path("runs/bench/search"), "--out"),
):
    """Memory.search's cost at a large memory (default 10,000), cosine alone against hybrid: median and p95."""
    search_cost = bench_module("search_cost")

    if min(memories, queries, k) < 1:
        raise ValueError("--memories, --queries and --k must be >= 1")
    search_cost.run(data, out, memories, queries, k, echo=typer.echo)


@bench_app.command("ui")
@friendly
def bench_ui(
    memories: int = typer.Option(10_000, "--memories", help="Memories of the one big user."),
    users: int = typer.Option(1_000, "--users", help="More users of the tenant, one memory each."),
    rounds: int = typer.Option(20, "--rounds", help="Requests timed per page (after a warm-up)."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", help="The server's model (pages read no KV)."),
    out: Path = typer.Option(Path("runs/bench/ui"), "--out"),
):
    """/ui's page latency for a user with many memories in a tenant with many users: p50 and p95 per page."""
    ui = bench_module("ui")

    if min(memories, rounds) < 1 or users < 0:
        raise ValueError("--memories and --rounds must be >= 1, --users >= 0")
    ui.run(out, model, memories, users, rounds, echo=typer.echo)
