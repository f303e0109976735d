"""The transformers engine: inject composed KV into a ``DynamicCache``, prefill only the query, decode greedily.

Paper §3.3 / Theorem 3: under causal attention, injecting the KV computed for a token sequence is exactly
equivalent to prefilling that sequence, so the query positions see the same logits. ``prompt`` mode (the
Mem0-style baseline) prefills the whole identical token sequence instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from cachetools import LRUCache
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..compose import ComposedMemory, compose
from ..models import to_cache
from ..rope import Rotary, reset_rope_state, served_length
from ..settings import MAX_QUEUE
from ..store import StoreError
from .base import (
    SAMPLING_EPS,
    AsyncEngine,
    Delta,
    Engine,
    EngineBusy,
    EngineRequest,
    Generation,
    MemoryPlan,
    Sampling,
    TokenLogprob,
    ends_answer,
)
from .tools_kv import ToolsKV

logger = logging.getLogger("kvmem.engines.hf")


@dataclass
class HFMemory:
    """What the transformers engine injects: the composed, rotated KV, and the selective-recompute fraction of
    its fact tokens (after ``header_len`` header tokens) to recompute first."""

    composed: ComposedMemory
    recompute: float = 0.0
    header_len: int = 0


GQA_SDPA = "kvmem_gqa_sdpa"


class AttentionProbe:
    """Attention mass that a forward pass's queries put on each of the first ``n_keys`` cached positions, summed
    over layers, heads and query tokens: ``scores`` [n_keys] float32. ``gqa_sdpa_attention_forward`` feeds the
    probe set in ``_probe.active`` (one forward, one thread)."""

    def __init__(self, n_keys: int):
        self.n_keys, self.scores = n_keys, None

    def add(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scale: float | None) -> None:
        """query [1, Hq, T, D], key [1, Hkv, S, D]; mask: bool (True = attend) or additive, [1, 1, T, S], or None
        (causal: query i sees keys up to S - T + i)."""
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        w = (query.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else query.shape[-1] ** -0.5)
        t, s = w.shape[-2:]
        if mask is None:
            mask = torch.ones(t, s, dtype=torch.bool, device=w.device).tril(s - t)
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask.float()
        mass = torch.softmax(w, dim=-1)[0, :, :, : self.n_keys].sum((0, 1))
        self.scores = mass if self.scores is None else self.scores + mass


_probe = threading.local()


def gqa_sdpa_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' SDPA attention, but grouped-query K/V stay un-expanded (``enable_gqa``) also under a mask.

    transformers expands K/V to every query head (``repeat_kv``) whenever a mask is present on CPU, i.e. for every
    query prefilled after an injected memory: a copy of the whole cache per layer, the one cost that grows with
    the memory length. The result is the same attention; only that copy is gone. Shapes: query [B, Hq, T, D],
    key/value [B, Hkv, S, D]; returns [B, T, Hq, D]."""
    probe = getattr(_probe, "active", None)
    if probe is not None:
        probe.add(query, key, attention_mask, scaling)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model) -> None:
    """Switch a model on transformers' plain ``sdpa`` attention to ``gqa_sdpa_attention_forward`` (same masks),
    through transformers' own attention registry and ``set_attn_implementation``."""
    if model.config._attn_implementation != "sdpa" or getattr(model.config, "attn_logit_softcapping", None):
        return
    if GQA_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
        AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(GQA_SDPA)


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from ``logits`` [vocab] float32: softmax at ``temperature``, then nucleus (``top_p``) sampling."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p, idx = probs.sort(descending=True)
        keep = p.cumsum(-1) - p < top_p  # the smallest prefix whose mass reaches top_p (always the top token)
        probs = torch.zeros_like(probs).scatter(0, idx[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def build_cache(model, memory: ComposedMemory) -> DynamicCache:
    """A transformers cache holding the composed memory's rotated keys and values, [1, H, m, D] per layer (for
    latent attention ``c_kv`` and the rotated ``k_pe``, as the model caches them: ``models.to_cache``).

    Sliding-window layers (Gemma 3) keep their last ``window - 1`` positions, exactly as after a prefill.
    """
    cache = DynamicCache(config=model.config)
    for layer in range(memory.keys.shape[0]):
        k, v = to_cache(model.config, memory.keys[layer][None], memory.values[layer][None])
        cache.update(k, v, layer)
    return cache


@torch.inference_mode()
def selective_recompute(
    model,
    memory: ComposedMemory,
    query_ids: list[int],
    fraction: float,
    header_len: int = 0,
    cache: DynamicCache | None = None,
) -> tuple[DynamicCache, torch.Tensor, int]:
    """Query-aware selective recompute (the idea of CacheBlend, EuroSys'25, with a query-driven choice
    as in ProphetKV, arXiv 2602.02579): inject ``memory``, let the query pick the fact tokens it attends to most,
    and recompute those tokens' K/V in every layer on top of the injected cache.

    1. Probe: prefill ``query_ids`` after the injected memory and sum the attention its tokens give each memory
       position (all layers and heads); the query's own K/V are then dropped.
    2. Select the ``ceil(fraction x fact tokens)`` highest-scoring positions after the ``header_len`` header
       tokens (the header is exact as stored: it is the prompt's own prefix).
    3. Recompute: one forward over the selected tokens at their own positions, each attending causally by
       position to the injected memory, where selected tokens' stale K/V are masked out and replaced by the fresh
       ones of this pass (layer by layer, so later layers see repaired inputs). Their new K/V overwrite the stale.

    ``fraction`` = 1 recomputes every fact token: the cache is then a prefill of the whole memory (prompt
    injection's). ``cache``: ``build_cache(model, memory)`` made by the caller (default: made here); it is
    repaired in place. Returns (cache [memory only], selected memory offsets [S] int64 ascending, tokens run through
    the model: query + S). Raises ValueError for a fraction outside (0, 1], an empty query, or a model whose
    attention is not kvmem's SDPA (the probe reads it) or that has sliding-window layers.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"selective recompute fraction must be in (0, 1], got {fraction}")
    if model.config._attn_implementation != GQA_SDPA or "sliding_attention" in (
        getattr(model.config, "layer_types", None) or ()
    ):
        raise ValueError("selective recompute needs plain SDPA attention without sliding-window layers")
    if not query_ids:
        raise ValueError("empty query")
    device = next(model.parameters()).device
    m, n_fact = len(memory), len(memory) - header_len
    cache = build_cache(model, memory) if cache is None else cache
    probe = AttentionProbe(m)
    _probe.active = probe
    try:
        model(
            input_ids=torch.tensor([query_ids], device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=torch.arange(memory.end, memory.end + len(query_ids), device=device)[None],
        )
    finally:
        _probe.active = None
    cache.crop(-len(query_ids))  # drop the probe's query K/V
    if n_fact == 0:
        return cache, torch.zeros(0, dtype=torch.long), len(query_ids)
    n_sel = min(n_fact, max(1, math.ceil(round(fraction * n_fact, 9))))  # round: 0.07 * 100 is 7.000000000000001
    sel = (header_len + probe.scores[header_len:].topk(n_sel).indices).sort().values.to(device)
    pos = torch.arange(m, device=device)
    allowed = torch.zeros(n_sel, m + n_sel, dtype=torch.bool, device=device)
    allowed[:, :m] = pos[None, :] <= sel[:, None]  # causal by position over the injected memory ...
    allowed[:, sel] = False  # ... without the selected tokens' stale K/V
    allowed[:, m:] = sel[None, :] <= sel[:, None]  # ... and with their fresh K/V from this pass
    ids = torch.tensor(memory.token_ids, device=device)[sel]
    # Positions stop before the query, so length-dependent RoPE (dynamic) would pick shorter-prompt frequencies.
    with served_length(model, memory.end + len(query_ids)):
        model(
            input_ids=ids[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=(memory.start + sel)[None],
            attention_mask=allowed[None, None],
        )
    for layer in cache.layers:  # clone: source and target are views of one tensor
        layer.keys[:, :, sel] = layer.keys[:, :, m:].clone()
        layer.values[:, :, sel] = layer.values[:, :, m:].clone()
    cache.crop(-n_sel)
    return cache, sel, len(query_ids) + n_sel


class HFEngine(Engine):
    """The transformers reference engine: injects composed KV into a ``DynamicCache`` and prefills the query, one
    request at a time, on the model's device. ``eos_token_ids``: where answers end (default: the model's EOS);
    ``max_model_len``: context limit (default: the model's)."""

    name = "hf"  # its abilities: engines.registry.ENGINES["hf"]

    def __init__(
        self,
        model,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
        tokenizer=None,
        tools_cache: ToolsKV | None = None,
    ):
        use_gqa_sdpa(model)
        self.model, self.tokenizer = model, tokenizer  # the tokenizer: JSON grammars (complete_json) only
        self.tools = tools_cache or ToolsKV(model)  # tools blocks' KV, encoded once (``MemoryPlan.block``)
        self._grammars = LRUCache(maxsize=64)  # compiled JSON-schema grammars (complete_json, response_format)
        self._compiler = None  # xgrammar's GrammarCompiler over this model's vocabulary
        self.device = next(model.parameters()).device
        self.rotary = Rotary.for_model(model)
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        eos = eos_token_ids if eos_token_ids is not None else model.generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))

    def memory(self, plan: MemoryPlan) -> HFMemory | None:
        """Compose ``[header][facts]`` with chunked RoPE on this engine's device (paper §3.3), reading only the
        rows' KV, then the plan's tools block (``ToolsKV``: encoded behind the header once, then kept).
        LookupError if that version was replaced meanwhile (the caller plans again). None if a segment fails its
        checks (missing, truncated, corrupt): the request is then prefilled whole, as vLLM's worker recomputes
        blocks whose load failed."""
        suffix = None
        if plan.block is not None:
            keys, values = self.tools.kv(plan.block, plan.header_ids, plan.served_len)
            suffix = (list(plan.block.token_ids), keys, values)
        try:
            composed = compose(
                self.rotary,
                plan.header_ids,
                plan.store.reads.header_kv(),
                plan.snapshot,
                plan.rows,
                device=self.device,
                served_len=plan.served_len,
                suffix=suffix,
            )
        except StoreError as exc:
            logger.warning("memory of %r not injected, prefilled instead: %s", plan.snapshot.user, exc)
            return None
        return HFMemory(composed, plan.recompute, len(plan.header_ids))

    def generate(self, requests: list[EngineRequest]) -> list[Generation]:
        return [self.run_request(r) for r in requests]

    def run_request(self, request: EngineRequest, on_token=None, cancel=None) -> Generation:
        """One ``EngineRequest``: kv mode with an ``HFMemory``, else the whole prompt prefilled from position 0."""
        mem = request.memory
        if mem is None:
            return self.run(
                list(request.prompt_ids), None, "prompt", sampling=request.sampling, on_token=on_token, cancel=cancel
            )
        query = list(request.prompt_ids[len(request.prompt_ids) - request.query_len :])
        return self.run(
            query,
            mem.composed,
            "kv",
            sampling=request.sampling,
            on_token=on_token,
            cancel=cancel,
            recompute=mem.recompute,
            header_len=mem.header_len,
        )

    def _grammar(self, schema_json: str):
        """xgrammar's compiled grammar for a JSON schema (JSON text), cached per schema (LRU, bounded). Raises
        ValueError for a schema xgrammar cannot compile (HTTP 400)."""
        import xgrammar as xgr

        compiled = self._grammars.get(schema_json)
        if compiled is None:
            if self.tokenizer is None:
                raise ValueError("JSON-constrained decoding needs the engine's tokenizer (HFEngine(..., tokenizer=))")
            if self._compiler is None:  # the vocabulary is read once per engine, not per schema
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.model.config.vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
            try:
                compiled = self._compiler.compile_json_schema(schema_json)
            except RuntimeError as exc:
                raise ValueError(f"response_format: this JSON schema cannot be used ({str(exc)[:200]})") from None
            self._grammars[schema_json] = compiled
        return compiled

    def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        """Greedy ids under xgrammar's JSON-schema logits processor (transformers ``generate``)."""
        from xgrammar.contrib.hf import LogitsProcessor

        compiled = self._grammar(json.dumps(schema, sort_keys=True))
        tok = self.tokenizer
        x = torch.tensor([prompt_ids], device=self.device)
        pad = tok.pad_token_id or tok.eos_token_id
        with torch.inference_mode():
            out = self.model.generate(
                x,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=[LogitsProcessor(compiled)],
            )
        return out[0, x.shape[1] :].tolist()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        query_ids: list[int],
        memory: ComposedMemory | None = None,
        mode: str = "kv",
        max_new_tokens: int = 32,
        keep_step_logits: bool = False,
        sampling: Sampling | None = None,
        on_token=None,
        cancel=None,
        recompute: float = 0.0,
        header_len: int = 0,
    ) -> Generation:
        """Answer ``query_ids`` after ``memory``: the reference call the exactness checks use.
        mode "kv": inject ``memory`` (already rotated) and prefill only ``query_ids`` at positions memory.end...
        mode "prompt": prefill ``memory.token_ids + query_ids`` at positions memory.start...
        Without memory both modes prefill the bare query at position 0.
        ``sampling``: temperature / top_p / seed / stop ids / max_tokens (overrides ``max_new_tokens``); default
        greedy. ``on_token(id)`` is called per generated token (streaming); a set ``cancel`` event stops decoding.
        ``recompute`` > 0 (kv mode): ``selective_recompute`` of that fraction of the fact tokens (after the
        ``header_len`` header tokens) before the query's prefill, inside the timed TTFT; ``prefilled_tokens``
        then counts the probe, the recomputed tokens and the query.
        Raises ValueError for an unknown mode or an empty query.
        """
        if sampling is None:
            sampling = Sampling(max_tokens=max_new_tokens, stop_token_ids=tuple(self.eos))
        else:
            max_new_tokens = sampling.max_tokens
            if not sampling.ignore_eos:
                sampling = replace(sampling, stop_token_ids=tuple(self.eos | set(sampling.stop_token_ids)))
        grammar = _Grammar(self._grammar(sampling.json_schema)) if sampling.json_schema is not None else None
        gen = None
        if sampling.temperature >= SAMPLING_EPS:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(
                sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
        if mode not in ("kv", "prompt"):
            raise ValueError(f"mode must be 'kv' or 'prompt', not {mode!r}")
        if not query_ids:
            raise ValueError("empty query")
        start = memory.start if memory is not None else 0
        if memory is None or mode == "prompt":
            # KV mode keeps the state the composition set (frequencies for the served length).
            reset_rope_state(getattr(self.model, "model", self.model).rotary_emb)
        if memory is not None and mode == "kv":
            cache, ids, pos0 = build_cache(self.model, memory), list(query_ids), memory.end
        else:
            cache = DynamicCache(config=self.model.config)
            ids = (memory.token_ids if memory is not None else []) + list(query_ids)
            pos0 = start
        self._sync()
        t0 = time.perf_counter()
        extra = 0
        if recompute and memory is not None and mode == "kv":
            cache, _, extra = selective_recompute(self.model, memory, ids, recompute, header_len, cache)
        x = torch.tensor([ids], device=self.device)
        out = self.model(
            input_ids=x,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=torch.arange(pos0, pos0 + len(ids), device=self.device)[None],
        )
        logits = out.logits[0, -1].float()
        self._sync()
        ttft_ms = (time.perf_counter() - t0) * 1e3
        first_logits = logits
        steps = [logits] if keep_step_logits else []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
        pos = pos0 + len(ids)
        t1 = time.perf_counter()
        while True:
            raw = logits
            if grammar is not None:
                logits = grammar.mask(logits)
            nxt = int(logits.argmax()) if gen is None else sample(logits, sampling.temperature, sampling.top_p, gen)
            tokens.append(nxt)
            entry = token_logprob(raw, nxt, sampling.logprobs) if logprobs is not None else None
            if entry is not None:
                logprobs.append(entry)
            if on_token is not None:
                on_token(nxt, entry)
            done = grammar is not None and grammar.accept(nxt)
            if (
                done
                or ends_answer(tokens, sampling)
                or len(tokens) >= max_new_tokens
                or (cancel is not None and cancel.is_set())
            ):
                break
            out = self.model(
                input_ids=torch.tensor([[nxt]], device=self.device),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[pos]], device=self.device),
            )
            logits = out.logits[0, -1].float()
            if keep_step_logits:
                steps.append(logits)
            pos += 1
        self._sync()
        stopped = done or ends_answer(tokens, sampling)
        return Generation(
            tokens,
            ttft_ms,
            (time.perf_counter() - t1) * 1e3,
            len(ids) + extra,
            first_logits,
            steps,
            prompt_tokens=len(memory or ()) + len(query_ids),
            finish_reason="stop" if stopped else "length",
            logprobs=logprobs,
        )


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """The log-probability of ``token_id`` under ``logits`` [vocab] and the ``top`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = lp.topk(top) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token_id, float(lp[token_id]), pairs)


class _Grammar:
    """One request's xgrammar matcher over a compiled JSON-schema grammar: masks logits to what may follow."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self.xgr, self.matcher = xgr, xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with every token the grammar forbids next set to -inf (a copy)."""
        out = logits.clone()[None]
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(out, self.bitmask.to(out.device))
        return out[0]

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; True once the JSON is complete (the grammar accepted its stop token), or if
        the grammar refuses the token (only sampling around the mask could pick one): the answer ends there."""
        return not self.matcher.accept_token(token_id) or self.matcher.is_terminated()


class AsyncHFEngine(AsyncEngine):
    """``HFEngine`` in the ``AsyncEngine`` role: one request at a time on one worker thread (the reference engine
    does not batch), at most ``max_queue`` waiting (then EngineBusy -> HTTP 429). Closing a stream sets its cancel
    event: decoding stops at the next token. ``pool``: a one-thread executor shared with other work on the same
    model (the server's writes), so the model and its RoPE state serve one caller at a time; default: its own."""

    name = "hf"  # its abilities: engines.registry.ENGINES["hf"]

    def __init__(self, engine: HFEngine, max_queue: int = MAX_QUEUE, pool: ThreadPoolExecutor | None = None):
        self.engine, self.max_model_len, self.max_queue = engine, engine.max_model_len, max_queue
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-hf")
        self._pending, self._closed = 0, False

    def queue_depth(self) -> int:
        return self._pending

    def healthy(self) -> bool:
        return not self._closed

    async def memory(self, plan: MemoryPlan) -> HFMemory:
        """``HFEngine.memory`` on the model thread (composition uses the model's RoPE state)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.memory, plan)

    def _submit(self, fn):
        if self._pending >= self.max_queue:
            raise EngineBusy(f"{self._pending} requests are waiting for the engine (limit {self.max_queue})")
        self._pending += 1
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, fn)
        fut.add_done_callback(lambda _: setattr(self, "_pending", self._pending - 1))
        return fut

    async def stream(self, request_id: str, request: EngineRequest):
        """A Delta per generated token, the last with the counts (``HFEngine.run_request``)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)

        def run():
            if cancel.is_set():  # the request was abandoned while it waited
                put(("err", asyncio.CancelledError()))
                return
            try:
                gen = self.engine.run_request(request, on_token=lambda t, lp: put(("tok", (t, lp))), cancel=cancel)
                put(("done", gen))
            except BaseException as exc:  # reaches the request, not the worker thread
                put(("err", exc))

        self._submit(run)
        try:
            while True:
                kind, x = await q.get()
                if kind == "tok":
                    yield Delta([x[0]], logprobs=None if x[1] is None else [x[1]])
                elif kind == "err":
                    raise x
                else:
                    yield Delta([], True, x.finish_reason, len(request.prompt_ids), x.prefilled_tokens, x.ttft_ms)
                    return
        finally:
            cancel.set()

    def sync_json(self, loop) -> HFEngine:
        """The transformers engine itself: writes already run on its model thread."""
        return self.engine

    async def complete_json(self, prompt_ids: list[int], schema: dict, max_tokens: int = 256) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.engine.complete_json, prompt_ids, schema, max_tokens
        )

    async def shutdown(self) -> None:
        self._closed = True
        if self._own_pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
