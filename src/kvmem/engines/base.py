"""The seam between kvmem and an inference engine.

kvmem owns retrieval, composition and the memory reference; an engine owns prefill and decode. Two engines
implement the same two protocols: ``hf.HFEngine`` / ``hf.AsyncHFEngine`` (transformers, the exact reference; one
request at a time) and ``vllm_engine.VLLMEngine`` / ``vllm_engine.AsyncVLLMEngine`` (stock vLLM with the kvmem
connector; continuous batching). ``serve.MemoryService`` and the HTTP server (``server``) receive an engine and
never ask which one it is.

``memory`` is what ``MemoryService.prepare`` made for that engine: a ``compose.ComposedMemory`` (hf: the rotated
KV itself) or a ``vllm_engine.MemoryRef`` (vLLM: the store, user, version and fact ids the connector reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


class EngineBusy(RuntimeError):
    """The engine's queue is full: the request is refused now (HTTP 429), not queued without bound."""


@dataclass(frozen=True)
class Sampling:
    """What a request asks of decoding. temperature 0 -> greedy (then top_p and seed do not matter);
    ``max_tokens``: new tokens at most; ``stop_token_ids``: end of answer (EOS and the service's own rule)."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Delta:
    """One streamed step: new token ids; on the last one ``finished`` and the request's counts and timings.
    ``prefilled_tokens``: prompt tokens the engine computed (the rest came from the injected memory or the
    prefix cache); ``ttft_ms``: engine arrival -> first token."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    ttft_ms: float = float("nan")
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    """A synchronous engine (benchmarks, ``kvmem ask``)."""

    name: str
    max_model_len: int

    def generate(self, prompt_ids: list[int], memory, sampling: Sampling, mode: str = "kv"): ...

    def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]: ...


class AsyncEngine(Protocol):
    """An engine shared by many concurrent requests (the HTTP server). ``stream`` yields ``Delta``s; closing the
    iterator (a client that disconnects) aborts the request. Raises EngineBusy when it cannot take more."""

    name: str
    max_model_len: int

    def stream(self, request_id: str, prompt_ids: list[int], memory, sampling: Sampling, mode: str = "kv",
               query_len: int = 0) -> AsyncIterator[Delta]: ...

    async def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]: ...

    def queue_depth(self) -> int: ...

    async def shutdown(self) -> None: ...
