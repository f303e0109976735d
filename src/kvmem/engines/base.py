"""The seam between kvmem and an inference engine.

kvmem owns retrieval, composition and the memory plan; an engine owns prefill and decode. Two engines implement
the two roles below:

* ``hf``: transformers, the exact reference; one request at a time (``hf.HFEngine`` / ``hf.AsyncHFEngine``);
* ``vllm``: stock vLLM with the kvmem KV connector; continuous batching (``vllm.engine.VLLMEngine`` /
  ``vllm.engine.AsyncVLLMEngine``).

``Engine`` is the synchronous role (``kvmem ask``, benchmarks), ``AsyncEngine`` the one shared by concurrent
requests (the HTTP server). ``engines.select`` builds both; everything else receives one and never asks which
it is. What differs between engines is a method or a capability here:

* how memory reaches it: ``memory(plan)`` turns the service's ``MemoryPlan`` into what ``EngineRequest.memory``
  carries: composed, rotated KV (hf) or a reference the connector's worker reads from the store (vLLM);
* what it can do (``capabilities``: selective recompute, batching, ...), declared once in ``registry``.

Paper §3.3 (serving path).
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..hardware import EngineUnavailable
from . import registry
from .registry import Capabilities

if TYPE_CHECKING:
    import torch

    from ..store import Store, UserKV

__all__ = [
    "AsyncEngine",
    "Capabilities",
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineRequest",
    "EngineUnavailable",
    "Generation",
    "MemoryPlan",
    "Sampling",
    "TokenLogprob",
    "ToolsBlock",
    "check_implements",
    "ends_answer",
]


class EngineBusy(RuntimeError):
    """The engine's queue is full: the request is refused now (HTTP 429), not queued without bound."""


SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy (dividing logits by it would overflow to inf)


@dataclass(frozen=True)
class Sampling:
    """What a request asks of decoding. temperature below ``SAMPLING_EPS`` (0 included) -> greedy, as vLLM does
    (then top_p and seed do not matter);
    ``max_tokens``: new tokens at most; ``stop_token_ids``: end of answer (EOS); ``line_stop_ids``: tokens that
    end it only once it holds another token (completion-style models answer on one line, and may open with a
    line break: ``ends_answer``); ``logprobs``: None, or return each chosen token's log-probability and the
    ``logprobs`` most likely alternatives; ``json_schema``: JSON text of a schema the answer must match (guided
    decoding; line stops then do not apply)."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    line_stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    json_schema: str | None = None


def ends_answer(tokens: list[int], sampling: Sampling | None) -> bool:
    """Whether the last of the generated ``tokens`` ends the answer: an EOS id, or a line stop after at least
    one other token (so a leading line break never gives an empty answer). The one stop rule of both engines."""
    if sampling is None or sampling.ignore_eos or not tokens:
        return False
    last = tokens[-1]
    if last in sampling.stop_token_ids:
        return True
    lines = () if sampling.json_schema is not None else sampling.line_stop_ids
    return last in lines and any(t not in lines for t in tokens[:-1])


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits, before sampling or grammar masks), and
    the ``top`` most likely tokens at that step as (token id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ToolsBlock:
    """A chat's tools block (``compose.PromptFormat.conversation_parts``): what the chat template renders after
    the memory inside the system message, the request's system text and its tools. An engine that can
    (``Capabilities.tools_kv``) injects its KV after the facts, encoded once behind the header and kept (the
    transformers engine's ``ToolsKV``). ``text``: the rendered text (the cache key, with the header, model and
    dtype); ``token_ids``: its ids [b]; ``owner``: the tenant whose chats share the cached KV ("" without
    tenants)."""

    text: str
    token_ids: tuple[int, ...]
    owner: str = ""


@dataclass
class MemoryPlan:
    """What the service retrieved for one request, for the engine to turn into injectable memory.

    ``snapshot``: the user's memory version the rows index (``Store.reads.snapshot``; its KV segments may be absent:
    an engine that needs them reads them, ``Engine.memory``); ``rows``: injected facts in order (rows of
    ``snapshot.facts``); ``header_ids``: the store's header token ids; ``served_len``: tokens of the whole served
    prompt (for length-dependent RoPE); ``recompute``: fraction of fact tokens to recompute (selective recompute,
    0 = off); ``memory_tokens``: set when the prompt goes on with more facts that the engine prefills (tail
    recompute): the injected length. ``block``: the chat's tools block, injected after the facts
    (kv mode on an engine with ``Capabilities.tools_kv``; otherwise its ids are prefilled with the query)."""

    store: Store
    snapshot: UserKV
    rows: list[int]
    header_ids: list[int]
    served_len: int
    recompute: float = 0.0
    memory_tokens: int | None = None
    cold: str | None = None  # a nonce: read from the store, every cache tier below it dropped first (load tests)
    block: ToolsBlock | None = None

    @property
    def token_ids(self) -> list[int]:
        """Header + injected facts' (+ the tools block's) token ids, [m]."""
        block = list(self.block.token_ids) if self.block is not None else []
        return list(self.header_ids) + [t for r in self.rows for t in self.snapshot.facts[r].token_ids] + block

    @property
    def fact_ids(self) -> list[str]:
        return [self.snapshot.facts[r].fact_id for r in self.rows]


@dataclass
class EngineRequest:
    """One generation. ``prompt_ids``: the whole prompt, memory ids first; ``memory``: what ``Engine.memory``
    made (None: prefill every prompt token, as prompt injection and a bare chat do); ``query_len``: how many of
    the last prompt ids follow the injected memory (prefilled in kv mode)."""

    prompt_ids: list[int]
    memory: object | None = None
    query_len: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    prefix_cache: bool = (
        False  # a memory-less prompt may reuse the engine's prefix cache (default: cold, as a baseline)
    )


@dataclass
class Generation:
    """A finished generation. ``token_ids``: generated ids; ``ttft_ms``: engine call start (vLLM: arrival) ->
    first token; ``decode_ms``: first -> last token; ``prefilled_tokens``: prompt tokens the engine computed (the
    rest came from injected memory or the prefix cache); ``first_logits``: [vocab] float32 logits at the last
    prompt position (empty where the engine returns none); ``step_logits``: per generated token, when asked;
    ``extra``: engine counters (vLLM: ``num_cached_tokens``, ``engine_prefill_ms``)."""

    token_ids: list[int]
    ttft_ms: float
    decode_ms: float
    prefilled_tokens: int
    first_logits: torch.Tensor | None = None
    step_logits: list = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None


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
    logprobs: list[TokenLogprob] | None = None


class _Capabilities:
    """What both roles share: ``name`` (a key of ``registry.ENGINES``) and the abilities declared there for it.

    ``capabilities`` and the ``selective_recompute`` / ``batches`` shorthands are filled in from the registry
    when an engine class is defined; a class that states one of them otherwise is refused (TypeError), so an
    engine and the checks made before it starts cannot disagree."""

    name: str = ""
    max_model_len: int = 0
    capabilities: Capabilities = registry.NONE
    selective_recompute: bool = False
    batches: bool = False
    metrics_file: str | None = None  # where the engine writes its own counters (JSON), if it does

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        caps = registry.capabilities(cls.name)
        for attr in ("selective_recompute", "batches"):
            if attr in cls.__dict__ and cls.__dict__[attr] != getattr(caps, attr):
                raise TypeError(f"{cls.__name__}.{attr} disagrees with engines.registry.ENGINES[{cls.name!r}]")
            setattr(cls, attr, getattr(caps, attr))
        cls.capabilities = caps


class Engine(_Capabilities, ABC):
    """The synchronous role: ``kvmem ask``, the benchmarks, the evaluations."""

    @abstractmethod
    def memory(self, plan: MemoryPlan) -> object:
        """The injectable memory for ``plan`` (goes in ``EngineRequest.memory``), or None when its stored KV fails
        its checks (missing, truncated, corrupt segment): the request is then prefilled whole, never served wrong
        KV. Raises ValueError for what this engine cannot do (e.g. ``plan.recompute`` without
        ``selective_recompute``), LookupError if the plan's version was replaced meanwhile."""

    @abstractmethod
    def generate(self, requests: list[EngineRequest]) -> list[Generation]:
        """Generations for ``requests``, in order (batched where the engine batches). Raises ValueError for an
        empty prompt."""

    @abstractmethod
    def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        """Greedy token ids for ``prompt_ids`` constrained to the JSON ``schema`` (fact extraction)."""

    def close(self) -> None:
        """Stop what the engine started (processes, threads). Idempotent."""


class AsyncEngine(_Capabilities, ABC):
    """The role shared by many concurrent requests (the HTTP server). ``stream`` yields ``Delta``s; closing the
    iterator (a client that disconnects) aborts the request. Raises EngineBusy when it cannot take more."""

    @abstractmethod
    async def memory(self, plan: MemoryPlan) -> object:
        """As ``Engine.memory``, without blocking the event loop."""

    @abstractmethod
    def stream(self, request_id: str, request: EngineRequest) -> AsyncIterator[Delta]:
        """Deltas of one request, the last with ``finished`` and the counts."""

    @abstractmethod
    async def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        """As ``Engine.complete_json``."""

    def queue_depth(self) -> int:
        """Requests waiting for or running in the engine."""
        return 0

    def healthy(self) -> bool:
        """Whether the engine can still serve (False once its process or thread has died)."""
        return True

    def sync_json(self, loop) -> object:
        """An object with a blocking ``complete_json`` for code on a worker thread (fact extraction during a
        write): by default it runs this engine's coroutine on ``loop`` (the server's event loop) and waits."""
        return _LoopJSON(self, loop)

    async def shutdown(self) -> None:
        """Stop what the engine started. Idempotent."""


class _LoopJSON:
    def __init__(self, engine: AsyncEngine, loop):
        self.engine, self.loop = engine, loop

    def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:

        return asyncio.run_coroutine_threadsafe(
            self.engine.complete_json(prompt_ids, schema, max_tokens), self.loop
        ).result()


def check_implements(impl: type, role: type) -> list[str]:
    """What ``impl`` lacks to satisfy ``role`` (``Engine`` or ``AsyncEngine``): abstract methods left
    unimplemented, and methods whose parameters differ from the role's. Empty when it satisfies it."""
    problems = [f"{impl.__name__}.{m} is not implemented" for m in getattr(impl, "__abstractmethods__", ())]
    for name, member in inspect.getmembers(role, inspect.isfunction):
        if name.startswith("_"):
            continue
        if not hasattr(impl, name):
            problems.append(f"{impl.__name__}.{name} is missing")
            continue
        want = list(inspect.signature(member).parameters)
        params = inspect.signature(getattr(impl, name)).parameters
        got = list(params)
        if got[: len(want)] != want or any(params[p].default is inspect.Parameter.empty for p in got[len(want) :]):
            problems.append(f"{impl.__name__}.{name}{tuple(got)} does not match {role.__name__}.{name}{tuple(want)}")
    if not issubclass(impl, role):
        problems.append(f"{impl.__name__} is not a {role.__name__}")
    return problems
