"""The server's settings, one value per bundle: each default is written here once, and each bundle checks its own
values when it is built, so a library caller (``KvmemServer.start``, ``Replicas.start``) gets the same checks
as ``kvmem serve``, whose options take their defaults from these fields.

* ``Limits``: what each request may ask and how long it may take (the HTTP layer's bounds and the chat
  defaults a request leaves out);
* ``ServeOptions``: how the server's parts are built (caches, the engine's queue, how writes encode and wait).

``MAX_QUEUE`` is the engine's admission bound (requests waiting for or running in it; one more gets
``EngineBusy``, HTTP 429) for every engine and role: vLLM batches what it admits, transformers runs it in turn.
No heavy imports (pydantic only), so the CLI reads the defaults before torch loads. Raises (when built)
pydantic's ``ValidationError``, a ValueError; ``one_line`` renders it as one sentence naming each bad field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from .policy import Encoding

MAX_QUEUE = 64  # requests in an engine at most (waiting or running); more get EngineBusy (HTTP 429)
MAX_BODY_BYTES = 1 << 20  # a request body's bytes at most (HTTP 413)
KV_CACHE_BYTES = 1 << 30  # vLLM's KV cache, bytes (every engine start: the server's, a bench's)

Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
_CONFIG = ConfigDict(validate_assignment=True, extra="forbid", arbitrary_types_allowed=True)


@dataclass(config=_CONFIG)
class Limits:
    """Per-request bounds and defaults of the HTTP server. ``max_body_bytes``: a larger body gets 413;
    ``request_timeout_s``: a request's whole time, s (then 503); ``default_top_k`` / ``default_mode`` /
    ``default_max_tokens``: what a chat that leaves ``memory.top_k``, ``memory.mode`` or ``max_tokens`` out
    gets; ``max_tokens``: the most new tokens a chat may ask for (more: 400); ``allow_cold``: accept
    ``memory.cache`` "cold" (load tests); ``send_timeout_s``: a send the client has not drained by then ends its
    request (``server.stalls``); ``mcp_infer``: MCP add_memories extracts facts (False: verbatim);
    ``body_timeout_s``: a body not all there this long after its headers gets 408."""

    max_body_bytes: Positive = MAX_BODY_BYTES
    request_timeout_s: Seconds = 120.0
    default_top_k: Positive = 5  # the default model scores best at k=5 with every method (docs/benchmarks.md)
    default_mode: Literal["kv", "prompt", "off"] = "kv"
    default_max_tokens: Positive = 64
    max_tokens: Positive = 4096
    allow_cold: bool = False
    send_timeout_s: Seconds = 30.0
    mcp_infer: bool = True
    body_timeout_s: Seconds = 30.0

    @model_validator(mode="after")
    def _default_within_max(self):
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} exceeds max_tokens {self.max_tokens}")
        return self


@dataclass(config=_CONFIG)
class ServeOptions:
    """How ``KvmemServer.start`` builds the server's parts. ``cache_bytes``: the LRU bound of each per-user
    cache (indexes, KV segments), bytes, here and in the vLLM worker; ``kv_cache_memory_bytes``: vLLM's KV
    cache; ``max_queue``: requests in the engine at most; ``window`` / ``neighbours`` / ``history``: how writes
    encode new memories (None: each user's recorded encoding; ``policy.Encoding``); ``tail_recompute`` /
    ``selective_recompute`` (%): the default ``memory`` options of chats; ``write_timeout_s``: how long a write
    waits for another process's writer lock (None: forever); ``segments_url``: a new store's object store;
    ``cache_dir``: a disk cache of a shared store's segments; ``extractor``: ``{"base_url", "model",
    "api_key"}`` of an OpenAI-compatible endpoint for fact extraction (None: the server's engine);
    ``kv_format``: how a new store keeps KV; ``defer_reencode_s``: an erasure's re-encoding is left to the
    upkeep task within this bound (None: at once); ``measure_store``: measure the store's size for /metrics
    here; ``hybrid``: rank by cosine fused with keyword scores; ``vllm_options``: other ``VLLMEngine``
    arguments."""

    cache_bytes: Positive = 512 << 20
    kv_cache_memory_bytes: Positive = KV_CACHE_BYTES
    max_queue: Positive = MAX_QUEUE
    window: Annotated[int, Field(ge=0)] | None = None
    neighbours: Annotated[int, Field(ge=0)] | None = None
    history: bool | None = None
    tail_recompute: Annotated[int, Field(ge=0)] = 0
    selective_recompute: Annotated[int, Field(ge=0, le=100)] = 0
    write_timeout_s: Seconds | None = 30.0
    segments_url: str | None = None
    cache_dir: str | None = None
    extractor: dict | None = None
    kv_format: str | None = None
    defer_reencode_s: Annotated[float, Field(ge=1.0)] | None = None
    measure_store: bool = True
    hybrid: bool = True
    vllm_options: dict | None = None

    @model_validator(mode="after")
    def _encoding(self):
        if self.window is not None or self.neighbours is not None or self.history is not None:
            Encoding.of(self.window, self.neighbours, self.history)  # e.g. history with neighbours
        return self


def default(bundle: type, name: str):
    """The default of field ``name`` of ``bundle`` (``Limits``, ``ServeOptions``): what the CLI shows."""
    return bundle.__dataclass_fields__[name].default


def one_line(exc: ValidationError, names: dict[str, str] | None = None) -> str:
    """A ``ValidationError`` of a bundle as one sentence: each bad field (renamed by ``names``, e.g. to its
    command-line option) and what it must be."""
    parts = []
    for e in exc.errors():
        field = ".".join(str(x) for x in e.get("loc", ())) or "settings"
        parts.append(f"{(names or {}).get(field, field)}: {e.get('msg', 'invalid value')}")
    return "; ".join(parts)
