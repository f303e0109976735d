"""``kvmem serve``: the OpenAI-compatible chat server with KV-injected memory."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policy import Encoding
from .common import (
    DTYPE,
    ENGINE,
    EXTRACTOR_MODEL,
    EXTRACTOR_URL,
    KV_FORMAT,
    SEGMENTS,
    USER_HISTORY,
    USER_NEIGHBOURS,
    USER_WINDOW,
    check_kv_format_name,
    extractor,
    friendly,
    store_option,
)


@friendly
def serve_cmd(
    store: str = store_option("Created for --model if missing."),
    model: str | None = typer.Option(None, "--model", help="Registry name (default: the store's model)."),
    engine: str = ENGINE,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_keys: Path | None = typer.Option(
        None, "--api-keys", help="JSON {key: tenant}; without it the server binds to loopback only."
    ),
    dtype: str = DTYPE,
    top_k: int = typer.Option(5, "--top-k", help="Default memory.top_k (the frontier's best k on the default model)."),
    mode: str = typer.Option("kv", "--mode", help="Default memory.mode: kv, prompt or off."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Default max_tokens."),
    window: int | None = USER_WINDOW,
    neighbours: int | None = USER_NEIGHBOURS,
    history: bool | None = USER_HISTORY,
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
    send_timeout: float = typer.Option(
        30.0,
        "--send-timeout",
        help="A client that takes none of a response's bytes for this long, s, is cut off: its request ends (a "
        "streamed chat's engine request is aborted) and its connection is closed.",
    ),
    body_timeout: float = typer.Option(
        30.0,
        "--body-timeout",
        help="A request whose body has not all arrived this long after its headers, s, gets HTTP 408 and its "
        "connection is closed (a client that trickles its body holds nothing longer).",
    ),
    send_buffer: int | None = typer.Option(
        None,
        "--send-buffer",
        min=1024,
        help="Each client connection's kernel send buffer, bytes (fixed, not autotuned; the kernel doubles it). "
        "Small: a client that stops reading stalls within a few KB (then --send-timeout cuts it off) instead of "
        "megabytes. Default: the kernel's.",
    ),
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
    segments: str | None = SEGMENTS,
    kv_format: str | None = KV_FORMAT,
    cache_dir: str | None = typer.Option(
        None,
        "--cache-dir",
        help="A local disk cache of a shared store's KV segments (byte-bounded, least recently used first), in the "
        "server and the vLLM worker. Segments are immutable and checksummed: a cached copy is never stale; each upkeep "
        "round (30 s) drops the copies of segments the store removed (an erasure's, after 60 s).",
    ),
    replicas: int = typer.Option(
        1,
        "--replicas",
        min=1,
        help="Serving replicas, each with its own engine, on Ray Serve behind one ingress; each user is routed to "
        "the same replica. 1 (without --ray or --ray-address): one process, no Ray.",
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="Join this Ray cluster (e.g. auto, or the GCS address host:6379) instead of starting one; needs "
        "--api-keys. The replicas read the keys file (same path) and the store's password (PGPASSWORD, a passfile) "
        "on their own nodes: nothing secret goes through Ray.",
    ),
    use_ray: bool = typer.Option(False, "--ray", help="Serve through Ray even with one replica."),
    extractor_url: str | None = EXTRACTOR_URL,
    extractor_model: str | None = EXTRACTOR_MODEL,
    defer_reencode: float | None = typer.Option(
        None,
        "--defer-reencode",
        min=1.0,
        help="Seconds: an erasure (a deleted memory, user or expiry, a request to forget) leaves re-encoding the "
        "memories computed behind the erased text to a background task, which runs within this bound (the derived "
        "KV is served until then). Default: re-encode at once, in the erasing request.",
    ),
    mcp_infer: bool = typer.Option(
        True,
        "--mcp-infer/--no-mcp-infer",
        help="The MCP tool add_memories (/mcp) extracts facts with the model, as a REST add does by default "
        "(Mem0's infer=True), or stores the text verbatim.",
    ),
    hybrid: bool = typer.Option(
        True,
        "--hybrid/--no-hybrid",
        help="Chats and memory searches rank by cosine fused with the store's keyword (BM25) scores (the default); "
        "--no-hybrid: cosine alone. A search's keyword_search overrides it.",
    ),
):
    """An OpenAI-compatible chat server with KV-injected memory, plus the memories REST API and /metrics."""
    from ..hardware import resolve_dtype
    from ..server import Limits, serve

    if mode not in ("kv", "prompt", "off"):
        raise ValueError(f"--mode must be kv, prompt or off, not {mode!r}")
    if (
        min(top_k, max_tokens, max_queue, max_body_bytes, cache_bytes, kv_cache_bytes) < 1
        or timeout <= 0
        or send_timeout <= 0
        or body_timeout <= 0
        or write_timeout <= 0
        or (window or 0) < 0
        or tail_recompute < 0
        or not 0 < port < 65536
    ):
        raise ValueError(
            "--top-k, --max-tokens, --max-queue, --max-body-bytes, --cache-bytes, --kv-cache-bytes and --timeout, "
            "--send-timeout, --body-timeout, --write-timeout must be positive, --window >= 0, --port in 1-65535"
        )
    if window is not None or neighbours is not None or history is not None:
        Encoding.of(window, neighbours, history)
    check_kv_format_name(kv_format)
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
            max_body_bytes,
            timeout,
            top_k,
            mode,
            max_tokens,
            max_tokens=max(4096, max_tokens),
            allow_cold=allow_cold,
            send_timeout_s=send_timeout,
            mcp_infer=mcp_infer,
            body_timeout_s=body_timeout,
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
        send_buffer=send_buffer,
        extractor=extractor(extractor_url, extractor_model),
        defer_reencode_s=defer_reencode,
        hybrid=hybrid,
    )
