"""``kvmem serve``: the OpenAI-compatible chat server with KV-injected memory."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from pydantic import ValidationError

from ..settings import Limits, ServeOptions, one_line
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

L, S = Limits, ServeOptions  # each option's default is the field's (settings: written once)
# a field of the bundles -> its option, for one-line errors
OPTION_OF = {
    "max_body_bytes": "--max-body-bytes",
    "request_timeout_s": "--timeout",
    "default_top_k": "--top-k",
    "default_mode": "--mode",
    "default_max_tokens": "--max-tokens",
    "send_timeout_s": "--send-timeout",
    "body_timeout_s": "--body-timeout",
    "cache_bytes": "--cache-bytes",
    "kv_cache_memory_bytes": "--kv-cache-bytes",
    "max_queue": "--max-queue",
    "window": "--window",
    "neighbours": "--neighbours",
    "tail_recompute": "--tail-recompute",
    "selective_recompute": "--selective-recompute",
    "write_timeout_s": "--write-timeout",
    "defer_reencode_s": "--defer-reencode",
}


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
    top_k: int = typer.Option(
        L.default_top_k, "--top-k", help="Default memory.top_k (the frontier's best k on the default model)."
    ),
    mode: str = typer.Option(L.default_mode, "--mode", help="Default memory.mode: kv, prompt or off."),
    max_tokens: int = typer.Option(L.default_max_tokens, "--max-tokens", help="Default max_tokens."),
    window: int | None = USER_WINDOW,
    neighbours: int | None = USER_NEIGHBOURS,
    history: bool | None = USER_HISTORY,
    cache_bytes: int = typer.Option(
        S.cache_bytes,
        "--cache-bytes",
        help="LRU bound of each per-user cache (indexes, KV segments), bytes, in the server and the vLLM worker.",
    ),
    kv_cache_bytes: int = typer.Option(S.kv_cache_memory_bytes, "--kv-cache-bytes", help="vLLM's KV cache, bytes."),
    max_queue: int = typer.Option(
        S.max_queue, "--max-queue", help="Requests in the engine at most; more get HTTP 429."
    ),
    allow_cold: bool = typer.Option(
        L.allow_cold,
        "--allow-cold-requests",
        help="Accept memory.cache 'cold' (load tests: the request's facts are read past every cache tier).",
    ),
    timeout: float = typer.Option(L.request_timeout_s, "--timeout", help="Per-request timeout, s (then HTTP 503)."),
    send_timeout: float = typer.Option(
        L.send_timeout_s,
        "--send-timeout",
        help="A client that takes none of a response's bytes for this long, s, is cut off: its request ends (a "
        "streamed chat's engine request is aborted) and its connection is closed.",
    ),
    body_timeout: float = typer.Option(
        L.body_timeout_s,
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
        S.write_timeout_s,
        "--write-timeout",
        help="How long a write waits for another process's writer lock (compaction, fsck, ingest), s; then HTTP 503.",
    ),
    max_body_bytes: int = typer.Option(
        L.max_body_bytes, "--max-body-bytes", help="A larger body gets HTTP 413, bytes."
    ),
    tail_recompute: int = typer.Option(
        S.tail_recompute,
        "--tail-recompute",
        help="Default memory.tail_recompute: kv mode prefills the last r retrieved facts with the conversation.",
    ),
    selective_recompute: int = typer.Option(
        S.selective_recompute,
        "--selective-recompute",
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
        S.defer_reencode_s,
        "--defer-reencode",
        help="Seconds: an erasure (a deleted memory, user or expiry, a request to forget) leaves re-encoding the "
        "memories computed behind the erased text to a background task, which runs within this bound (the derived "
        "KV is served until then). Default: re-encode at once, in the erasing request.",
    ),
    mcp_infer: bool = typer.Option(
        L.mcp_infer,
        "--mcp-infer/--no-mcp-infer",
        help="The MCP tool add_memories (/mcp) extracts facts with the model, as a REST add does by default "
        "(Mem0's infer=True), or stores the text verbatim.",
    ),
    hybrid: bool = typer.Option(
        S.hybrid,
        "--hybrid/--no-hybrid",
        help="Chats and memory searches rank by cosine fused with the store's keyword (BM25) scores (the default); "
        "--no-hybrid: cosine alone. A search's keyword_search overrides it.",
    ),
):
    """An OpenAI-compatible chat server with KV-injected memory, plus the memories REST API and /metrics."""
    from ..hardware import resolve_dtype
    from ..server import serve

    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1-65535, not {port}")
    check_kv_format_name(kv_format)
    try:  # the bundles check their own values (a library caller gets the same checks)
        limits = Limits(
            max_body_bytes=max_body_bytes,
            request_timeout_s=timeout,
            default_top_k=top_k,
            default_mode=mode,
            default_max_tokens=max_tokens,
            max_tokens=max(L.max_tokens, max_tokens),
            allow_cold=allow_cold,
            send_timeout_s=send_timeout,
            mcp_infer=mcp_infer,
            body_timeout_s=body_timeout,
        )
        options = ServeOptions(
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
            extractor=extractor(extractor_url, extractor_model),
            defer_reencode_s=defer_reencode,
            hybrid=hybrid,
        )
    except ValidationError as exc:
        raise ValueError(one_line(exc, OPTION_OF)) from None
    serve(
        store,
        host,
        port,
        str(api_keys) if api_keys else None,
        log=lambda m: typer.echo(m, err=True),
        model=model,
        engine=engine,
        dtype=resolve_dtype(None if dtype == "auto" else dtype),
        limits=limits,
        replicas=replicas,
        ray_address=ray_address,
        use_ray=use_ray,
        send_buffer=send_buffer,
        **asdict(options),
    )
