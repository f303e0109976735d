"""Serving: question -> embed -> top-k retrieval -> compose (chunked RoPE) -> inject or prompt -> answer.

One request reads as one straight line: ``prepare`` (embed, retrieve, compose), then the engine call, in ``ask``. Paper §3.3 (serving path) and §5.1 (position policy).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from .compose import ContextOverflow, PromptFormat, check_text, compose, max_facts_that_fit
from .engines.hf import HFEngine
from .hardware import EngineUnavailable, resolve_engine
from .models import REGISTRY, LoadedModel, fingerprint, load, model_dir
from .rope import Rotary
from cachetools import LRUCache

from .retrieve import Embedder, Retrieved, UserIndex, order_reverse_proximity
from .store import Store


@dataclass
class Answer:
    """One answered question. ``timings_ms``: embed, search, compose (incl. prompt assembly), ttft (model call
    start -> first token's logits) and total (question received -> first token); decode is after the first token."""

    answer: str
    mode: str
    k: int
    fact_ids: list[str]
    prompt_tokens: int
    prefilled_tokens: int
    timings_ms: dict[str, float]
    user: str = ""
    question: str = ""
    engine: str = "hf"
    generated_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("prompt_token_ids")
        return d


class MemoryService:
    """A long-lived answerer over one store: model, embedder, per-user indexes and the engine stay loaded.

    ``engine``: "auto" (vLLM where it runs here, else transformers; ``engine_note`` says why), "hf"
    (transformers, the reference) or "vllm" (stock vLLM with the kvmem KV connector; the transformers model
    still gives the tokenizer and the store fingerprint). ``dtype``: None -> this machine's compute dtype
    (``hardware.choose_dtype``); the store must have been computed in the same dtype. ``vllm_options`` go to ``VLLMEngine``;
    ``vllm_engine`` reuses a running one instead (one engine serves any number of stores: the connector reads the
    store named in each request); then, or with ``load_weights=False`` (the caller attaches an engine later), only
    the tokenizer, config and fingerprint load, not the transformers weights. ``index_cache_bytes`` bounds the
    per-user vector indexes (LRU).

    Raises (from the constructor) StoreError/StoreMismatch for a missing store or one built with another model
    (StoreDtypeMismatch: computed in another dtype), ModelError if the store's model is not installed,
    EngineUnavailable if ``engine="vllm"`` cannot run or start here.
    """

    def __init__(self, store_root, model: LoadedModel | str | None = None, device=None, dtype=None,
                 max_context: int | None = None, embedder: Embedder | None = None, engine: str = "hf",
                 vllm_options: dict | None = None, vllm_engine=None, index_cache_bytes: int = 256 << 20,
                 load_weights: bool = True):
        self.engine_note, requested = None, engine
        if vllm_engine is not None:
            engine = "vllm"
        engine, self.engine_note = resolve_engine(engine)
        store = Store.open(store_root)  # read the manifest first: it names the model
        if model is None or isinstance(model, str):
            # with a vLLM engine given, this process needs the tokenizer and fingerprint only, not the weights
            model = load(model or store.fingerprint["model"], dtype=dtype, device=device,
                         weights=vllm_engine is None and load_weights)
        store.close()
        self.lm = model
        self.store = Store.open(store_root, fingerprint(model))
        self.embedder = embedder or Embedder(self.store.manifest["embedder"]["name"])
        self.fmt = PromptFormat.for_tokenizer(model.tokenizer, model.chat)
        eos = model.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if not model.chat:  # completion-style prompts: the answer ends at the line break
            eos += [i for i, t in enumerate(model.tokenizer.convert_ids_to_tokens(range(len(model.tokenizer))))
                    if t is not None and "\n" in model.tokenizer.convert_tokens_to_string([t])]
        self.stop_ids = eos  # one stop rule for both engines (EOS, and the line break for completion models)
        real = model.device.type != "meta"
        self.engine = HFEngine(model.model, eos_token_ids=eos) if real else None
        self.rotary = Rotary.for_model(model.model) if real else None
        self.max_context = max_context or model.config.max_position_embeddings
        # per-user vector indexes, LRU-bounded by bytes (hits/misses counted for /metrics)
        self._indexes = LRUCache(maxsize=max(1, index_cache_bytes), getsizeof=lambda ix: max(1, ix.nbytes))
        self.index_hits = self.index_misses = 0
        self.engine_name, self.vllm = engine, None
        self.tail_recompute = 0  # default r for prepare (see there)
        if engine == "vllm" and vllm_engine is not None:
            self.vllm = vllm_engine
        elif engine == "vllm":
            from .engines.vllm_engine import VLLMEngine

            path = model_dir(model.name) if model.name in REGISTRY else model.name
            opts = {"dtype": str(model.dtype).removeprefix("torch."), "max_model_len": min(self.max_context, 32768),
                    "stores": [self.store.root]}
            try:
                self.vllm = VLLMEngine(path, **{**opts, **(vllm_options or {})})
            except EngineUnavailable as exc:
                if requested != "auto":
                    raise
                self.engine_name, self.engine_note = "hf", f"note: using the transformers engine: {exc}"
        if self.vllm is not None:
            self.max_context = min(self.max_context, self.vllm.max_model_len)

    def index(self, user: str, ukv=None) -> UserIndex:
        """``user``'s vector index, synced to ``ukv`` (default: the current snapshot) incrementally."""
        ukv = ukv or self.store.snapshot(user, kv=False)
        index = self._indexes.get(user)
        if index is None:
            self.index_misses += 1
            index = UserIndex(ukv.embeddings.shape[1])
        else:
            self.index_hits += 1
        index.sync(self.store, ukv)
        self._indexes[user] = index  # (re)insert: its size may have changed
        return index

    def prepare(self, user: str, question: str, top_k: int, mode: str = "kv", max_new_tokens: int = 32,
                messages: list[dict] | None = None, tail_recompute: int | None = None) -> "Prepared":
        """Everything before the model call: embed, retrieve, order, check the budget, compose.

        ``messages``: a multi-turn chat (OpenAI-style, checked) that follows the memory instead of the single
        ``question`` (which is still what retrieval embeds: the last user message).
        ``tail_recompute`` r (default ``self.tail_recompute``, 0): inject the header and all but the last r facts;
        the engine prefills those r facts (the most relevant, nearest the query) with the query, so they attend to
        every injected fact (cross-fact repair). The prompt ids are the same for every r; only what is injected
        changes. Prompt mode is unaffected.
        For the hf engine the composed KV is built here (chunked RoPE); for vLLM only the ids and the memory
        reference, since the connector's worker composes the KV itself.
        Raises ValueError for an empty question, top_k < 1 or an unknown mode; StoreError for an unknown user;
        ContextOverflow when memory + query + ``max_new_tokens`` (room for the answer) exceed the model context
        (the message gives the k that fits, paper Corollary 7).
        """
        if not question or not question.strip():
            raise ValueError("empty question")
        check_text(question, "the question")  # before anything tokenizes or embeds it
        if top_k < 1:
            raise ValueError(f"k must be >= 1, got {top_k}")
        mode, tail_recompute, recompute = parse_mode(
            mode, self.tail_recompute if tail_recompute is None else tail_recompute)
        if recompute and self.vllm is not None:
            raise ValueError("kv-sel (query-aware selective recompute) runs on the transformers engine only: vLLM's "
                             "KV connector can report an injected prefix, not tokens to recompute inside it")
        t0 = time.perf_counter()
        ukv = self.store.snapshot(user, kv=self.vllm is None)  # with vLLM the worker reads the KV, not this process
        index = self.index(user, ukv)
        q_vec = self.embedder.embed([question])[0]
        t1 = time.perf_counter()
        scores, rows = index.search(q_vec, top_k, ukv)
        retrieved = Retrieved([int(r) for r in rows], [float(s) for s in scores])
        t2 = time.perf_counter()
        query_ids = (self.fmt.conversation_ids(self.lm.tokenizer, messages) if messages
                     else self.fmt.query_ids(self.lm.tokenizer, question))
        header_ids = self.store.header_token_ids
        lens = [ukv.facts[r].num_tokens for r in retrieved.rows]
        need = len(header_ids) + sum(lens) + len(query_ids)
        if len(header_ids) + len(query_ids) + max_new_tokens > self.max_context:
            raise ContextOverflow(
                f"the header ({len(header_ids)} tokens), query ({len(query_ids)} tokens) and answer ({max_new_tokens} "
                f"tokens) alone exceed the model context of {self.max_context} tokens; no memory fits")
        if need + max_new_tokens > self.max_context:
            fits = max_facts_that_fit(len(header_ids), lens, len(query_ids) + max_new_tokens, self.max_context)
            raise ContextOverflow(
                f"memory ({len(header_ids) + sum(lens)} tokens for k={len(lens)}) + query ({len(query_ids)} tokens) "
                f"+ answer ({max_new_tokens} tokens) = {need + max_new_tokens} tokens exceeds the model context of "
                f"{self.max_context} tokens; at most k={fits} fits")
        rows = order_reverse_proximity(retrieved)
        r = int(tail_recompute)
        if r < 0:
            raise ValueError(f"tail_recompute must be >= 0, got {r}")
        head, tail = rows[:max(0, len(rows) - r)], rows[max(0, len(rows) - r):]
        tail_ids = [t for row in tail for t in ukv.facts[row].token_ids]
        fact_ids = [ukv.facts[row].fact_id for row in rows]
        memory = ref = None
        if self.vllm is None:
            memory = compose(self.rotary, header_ids, self.store.header_kv(), ukv, head, device=self.lm.device,
                             served_len=need)
            token_ids = memory.token_ids
        else:  # the connector's worker composes the KV itself; here only the ids
            token_ids = header_ids + [t for row in head for t in ukv.facts[row].token_ids]
            if mode == "kv":
                from .engines.vllm_engine import MemoryRef

                ref = MemoryRef(str(self.store.root.resolve()), self.store.manifest["store_id"], user, ukv.version,
                                fact_ids[:len(head)], memory_tokens=len(token_ids) if tail else None)
        query_ids = tail_ids + query_ids  # what follows the injected memory: recomputed tail facts, then the query
        t3 = time.perf_counter()
        timings = {"embed": (t1 - t0) * 1e3, "search": (t2 - t1) * 1e3, "compose": (t3 - t2) * 1e3}
        return Prepared(user, question, mode, query_ids, token_ids + query_ids, fact_ids, memory, ref, timings,
                        recompute, len(header_ids))

    def ask(self, user: str, question: str, top_k: int, mode: str = "kv", max_new_tokens: int = 32) -> Answer:
        """Answer ``question`` from ``user``'s memory with the ``top_k`` most relevant facts (``prepare`` + the
        engine call). Raises what ``prepare`` raises."""
        req = self.prepare(user, question, top_k, mode, max_new_tokens)
        mode = req.mode
        if self.vllm is None:
            gen = self.engine.generate(req.query_ids, req.memory, mode, max_new_tokens, recompute=req.recompute,
                                       header_len=req.header_len)
            expected = len(req.query_ids) if mode == "kv" else len(req.prompt_ids)
            assert gen.prefilled_tokens == expected or req.recompute, (gen.prefilled_tokens, expected)
        else:
            # prompt mode: a fresh salt, so the baseline prefills everything (no prefix-cache reuse)
            gen = self.vllm.generate(req.prompt_ids, req.ref, max_new_tokens,
                                     salt=None if req.ref else self.vllm.cold_salt(), stop_token_ids=self.stop_ids)
        return self.answer(req, gen)

    def answer(self, req: "Prepared", gen) -> Answer:
        """The Answer record for a prepared request and its engine generation."""
        text = self.lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True).strip()
        pre = sum(req.timings_ms.values())
        timings = {**req.timings_ms, "ttft": gen.ttft_ms, "total": pre + gen.ttft_ms, "decode": gen.decode_ms}
        return Answer(text, req.mode, len(req.fact_ids), req.fact_ids, len(req.prompt_ids), gen.prefilled_tokens,
                      {k: round(v, 3) for k, v in timings.items()}, req.user, req.question, self.engine_name,
                      len(gen.token_ids), req.prompt_ids)


def parse_mode(mode: str, tail_recompute: int | None = None) -> tuple[str, int | None, float]:
    """A serving method -> (mode, tail recompute r, selective-recompute fraction):
    "kv", "prompt", "kv-tail<r>" (tail recompute r) or "kv-sel<p>" (query-aware selective recompute of p% of
    the fact tokens, transformers engine; ``engines.hf.selective_recompute``). Raises ValueError otherwise."""
    tail = re.fullmatch(r"kv-tail(0|[1-9][0-9]*)", mode) if isinstance(mode, str) else None
    if tail:
        return "kv", int(tail[1]), 0.0
    sel = re.fullmatch(r"kv-sel([1-9][0-9]?|100)", mode) if isinstance(mode, str) else None
    if sel:
        if tail_recompute:
            raise ValueError("kv-sel (selective recompute) and tail recompute do not combine; use one of them")
        return "kv", 0, int(sel[1]) / 100
    if mode not in ("kv", "prompt"):
        raise ValueError(f"mode must be 'kv', 'prompt', 'kv-tail<r>' or 'kv-sel<1-100>', not {mode!r}")
    return mode, tail_recompute, 0.0


def check_methods_engine(modes, engine: str) -> None:
    """ValueError (before any store or engine is built) when a ``kv-sel`` method is asked of an engine other than
    the transformers one; ``modes`` must already parse (``parse_mode``)."""
    if engine != "hf" and any(parse_mode(m)[2] for m in modes):
        raise ValueError("kv-sel (selective recompute) runs on the transformers engine only: add --engine hf")


@dataclass
class Prepared:
    """A request after retrieval and composition, before the model call. ``memory``: composed KV (hf engine);
    ``ref``: the connector's memory reference (vLLM, kv mode); ``timings_ms``: embed, search, compose;
    ``recompute``: the selective-recompute fraction the engine applies; ``header_len``: header tokens in memory."""

    user: str
    question: str
    mode: str
    query_ids: list[int]
    prompt_ids: list[int]
    fact_ids: list[str]
    memory: object | None
    ref: object | None
    timings_ms: dict[str, float]
    recompute: float = 0.0  # selective recompute fraction (hf engine, kv mode)
    header_len: int = 0


def same_prompt(a: Answer, b: Answer) -> None:
    """Both modes must see exactly the same prompt token ids (and so the same facts in the same order)."""
    if a.prompt_token_ids != b.prompt_token_ids or a.fact_ids != b.fact_ids:
        raise AssertionError("kv and prompt modes saw different prompts")
