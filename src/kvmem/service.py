"""The one chat pipeline: question -> embed -> top-k retrieval -> compose (chunked RoPE) -> inject or prompt.

One request reads as one straight line: ``plan`` (embed, retrieve, order, check the budget), the engine's
``memory`` (composition, by the engine: rotated KV or a connector reference), then the engine call, in ``ask``.
The rules every caller shares live here and only here: the method a request asks for (``policy.Method``) and
whether the engine can serve it (``check_methods`` before an engine starts, ``plan`` after), the retry when a
write replaces the memory between retrieval and the KV read, and the plain chat a server request falls back to
(mode off, an empty question, a user without memories). ``ask`` / ``prepare`` serve synchronous engines,
``prepare_chat`` the server's (one call: retrieval, the engine's memory and the decoding); both run ``_pipeline``.
Paper §3.3 (serving path) and §5.1 (position policy).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .compose import ContextOverflow, PromptFormat, check_text, max_facts_that_fit
from .engines.base import AsyncEngine, Engine, EngineRequest, Generation, MemoryPlan, Sampling, ToolsBlock
from .engines.registry import refusal
from .engines.select import engine_name, open_engine
from .models import LoadedModel, fingerprint, line_stop_ids, stop_token_ids
from .policy import Method
from .retrieve import HYBRID, Embedder, Fusion, IndexCache, Retrieved, check_order, order_facts, search
from .store import Store, StoreError, UnknownUser

PLANS = 3  # a request is planned at most this often while writes keep replacing its memory (then StoreError)


def check_methods(methods: Iterable[str | Method], engine: str | None = "auto") -> list[Method]:
    """``methods`` (spellings or ``Method``s) as ``Method``s, checked before any engine starts: ValueError for
    a bad one or one that ``engine`` (auto | vllm | hf; ``auto`` as it resolves on this machine) cannot serve
    (``engines.registry.refusal``), e.g. selective recompute off the transformers engine."""
    name = engine_name(engine)
    parsed = [Method.parse(m) for m in methods]
    for m in parsed:
        why = refusal(m, name, started=False)
        if why is not None:
            raise ValueError(why)
    return parsed


def owner_of(user: str) -> str:
    """The tenant of a store user (``scopes.Scope.key``: ``<tenant>:<user>/...``; "" without one): whose chats
    share a cached tools block. A user id with a ':' on a server without tenants only splits the cache further."""
    head = user.split("/", 1)[0]
    return head.partition(":")[0] if ":" in head else ""


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
    engine: str = ""
    generated_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("prompt_token_ids")
        return d


class MemoryService:
    """A long-lived answerer over one store: the embedder, the per-user indexes and the engine stay loaded.

    ``engine``: an ``Engine`` or ``AsyncEngine`` (``engines.select.open_engine``); one engine may serve several
    services (stores). ``lm``: the answer model the engine runs (its tokenizer, config and fingerprint; the
    store must have been built by it). ``max_context``: context limit (default: the engine's).
    ``index_cache_bytes`` bounds the per-user vector indexes (LRU); ``tail_recompute``: the default r of ``plan``;
    ``fusion``: hybrid retrieval (cosine fused with the store's keyword scores, ``retrieve.Fusion``; the default
    ``retrieve.HYBRID``; None: cosine alone); ``order``: how the retrieved facts are composed, first to last
    (``retrieve.order_facts``: "relevance", the default, or "time").

    Raises (from the constructor) StoreError/StoreMismatch for a missing store or one built with another model
    (StoreDtypeMismatch: computed in another dtype).
    """

    def __init__(
        self,
        store_root: str | Path,
        engine: Engine | AsyncEngine,
        lm: LoadedModel,
        embedder: Embedder | None = None,
        max_context: int | None = None,
        index_cache_bytes: int = 256 << 20,
        tail_recompute: int = 0,
        store_cache_bytes: int | None = None,
        store_cache_dir: str | Path | None = None,
        fusion: Fusion | None = HYBRID,
        order: str = "relevance",
    ):
        self.engine, self.lm = engine, lm
        self.fusion = fusion
        self.order = check_order(order)
        cache = {} if store_cache_bytes is None else {"cache_bytes": store_cache_bytes}
        self.store = Store.open(store_root, fingerprint(lm), cache_dir=store_cache_dir, **cache)
        self.embedder = embedder or Embedder(self.store.manifest["embedder"]["name"])
        self.fmt = PromptFormat.for_tokenizer(lm.tokenizer, lm.chat)
        self.stop_ids, self.line_stop_ids = stop_token_ids(lm), line_stop_ids(lm)  # one stop rule (ends_answer)
        self.max_context = min(max_context or lm.max_context, engine.max_model_len)
        self.indexes = IndexCache(index_cache_bytes)
        self.tail_recompute = tail_recompute
        self.engine_note: str | None = None

    @classmethod
    def open(
        cls,
        store_root: str | Path,
        model: LoadedModel | str | None = None,
        engine: str = "auto",
        dtype: str | None = None,
        embedder: Embedder | None = None,
        max_context: int | None = None,
        **engine_options,
    ) -> MemoryService:
        """A service with its own engine (``engines.select.open_engine``; ``engine_options`` go there), for the
        store's model unless ``model`` is given. ``engine_note`` says why ``auto`` fell back to transformers.
        Raises what the constructor and ``open_engine`` raise."""
        if model is None:
            st = Store.open(store_root)  # the manifest names the model
            model = st.fingerprint["model"]
            st.close()
        opened = open_engine(model, engine, dtype, stores=[store_root], max_model_len=max_context, **engine_options)
        svc = cls(store_root, opened.engine, opened.lm, embedder, max_context)
        svc.engine_note = opened.note
        return svc

    def close(self) -> None:
        self.store.close()

    def plan(
        self,
        user: str | list[str],
        question: str,
        top_k: int,
        mode: str | Method = "kv",
        max_new_tokens: int = 32,
        messages: list[dict] | None = None,
        tail_recompute: int | None = None,
        cold: bool = False,
        tools: list[dict] | None = None,
    ) -> Prepared:
        """Everything before composition: embed, retrieve, order, check the budget.

        ``mode``: a serving method (``policy.Method``, or its spelling). ``messages``: a multi-turn chat (OpenAI-style,
        checked) that follows the memory instead of the single ``question`` (which is still what retrieval
        embeds: the last user message). ``tail_recompute`` r (default ``self.tail_recompute``): inject the header
        and all but the last r facts; the engine prefills those r facts (nearest the query: the most relevant
        under the default order) with the query, so they attend to every injected fact (cross-fact repair). The
        prompt ids are the same for every r; only what is injected changes. Prompt mode is unaffected.
        ``user``: a store user, or several (entity scopes: ``scopes.Scope.subscopes``), whose memories are
        retrieved as one; users without memories are left out, and expired memories are never retrieved.
        ``cold`` (load tests): the retrieved facts are dropped from every cache tier first (``Store.reads.evict``; the
        engine's prefix cache and the vLLM worker's read cache by the plan's nonce), then prefetched as usual.
        ``tools``: OpenAI tool definitions the chat template renders after the memory (``messages`` only); in kv
        mode without tail recompute, on an engine that can (``Capabilities.tools_kv``), the system text and tools
        (``PromptFormat.conversation_parts``) are the plan's ``block``, injected after the facts from KV
        encoded once, so only the turns are prefilled; the prompt ids are the same either way.
        Raises ValueError for an empty question, top_k < 1, an unknown mode or one this engine cannot serve;
        StoreError (UnknownUser) when no user has memories; ContextOverflow when memory + query +
        ``max_new_tokens`` exceed the model context (the message gives the k that fits, paper Corollary 7).
        """
        if not question or not question.strip():
            raise ValueError("empty question")
        check_text(question, "the question")  # before anything tokenizes or embeds it
        if top_k < 1:
            raise ValueError(f"k must be >= 1, got {top_k}")
        method = self.method(mode, tail_recompute)
        mode, recompute = method.mode, method.recompute
        r = int(method.tail or 0)
        if r < 0:
            raise ValueError(f"tail_recompute must be >= 0, got {r}")
        t0 = time.perf_counter()
        users = [user] if isinstance(user, str) else list(user)
        # rows only: the engine reads the KV it injects (Engine.memory); several scopes are read as one memory
        ukv = self.store.reads.snapshots([(u, None) for u in users])
        q_vec = self.embedder.embed([question])[0]
        t1 = time.perf_counter()
        hits = search(self.indexes, self.store, ukv, q_vec, question, top_k, ukv.unexpired(), self.fusion)
        retrieved = Retrieved([h.position for h in hits], [h.score for h in hits])
        if mode == "kv" and cold:
            self.store.reads.evict(ukv, retrieved.rows)
        if mode == "kv":  # the facts' KV starts moving up the tiers while the prompt is built and scheduled
            self.store.reads.prefetch(ukv, retrieved.rows)
        t2 = time.perf_counter()
        block_text, block_ids, query_ids = (
            self.fmt.conversation_parts(self.lm.tokenizer, messages, tools)
            if messages
            else ("", [], self.fmt.query_ids(self.lm.tokenizer, question))
        )
        block = None
        if block_ids and mode == "kv" and r == 0 and self.engine.capabilities.tools_kv:
            block = ToolsBlock(block_text, tuple(block_ids), owner_of(users[0]))
        else:  # prefilled with the turns: the same ids
            query_ids = block_ids + query_ids
        header_ids = self.store.header_token_ids
        lens = [ukv.facts[r].num_tokens for r in retrieved.rows]
        after = len(query_ids) + (len(block.token_ids) if block is not None else 0)  # the block counts once
        need = self.check_budget(len(header_ids), lens, after, max_new_tokens)
        rows = order_facts(retrieved, ukv.facts, self.order)
        head, tail = rows[: max(0, len(rows) - r)], rows[max(0, len(rows) - r) :]
        tail_ids = [t for row in tail for t in ukv.facts[row].token_ids]
        plan = MemoryPlan(
            self.store,
            ukv,
            head,
            header_ids,
            need,
            recompute,
            memory_tokens=None if not tail else len(header_ids) + sum(ukv.facts[h].num_tokens for h in head),
            cold=uuid.uuid4().hex if cold else None,
            block=block,
        )
        memory_ids = plan.token_ids
        query_ids = tail_ids + query_ids  # after the injected memory: recomputed tail facts, then the query
        # compose: prompt assembly and the budget here, plus the engine's composition (``prepare``)
        timings = {"embed": (t1 - t0) * 1e3, "search": (t2 - t1) * 1e3, "compose": (time.perf_counter() - t2) * 1e3}
        return Prepared(
            user,
            question,
            mode,
            query_ids,
            memory_ids + query_ids,
            [ukv.facts[row].fact_id for row in rows],
            plan if mode == "kv" else None,
            timings,
        )

    def check_budget(self, header_len: int, fact_lens: list[int], query_len: int, max_new_tokens: int) -> int:
        """Tokens of the served prompt (header + facts + query); ContextOverflow when it and ``max_new_tokens``
        (room for the answer) exceed the context, with the k that fits (paper Corollary 7)."""
        need = header_len + sum(fact_lens) + query_len
        if header_len + query_len + max_new_tokens > self.max_context:
            what = f"the header ({header_len} tokens), query" if header_len else "the conversation"
            raise ContextOverflow(
                f"{what} ({query_len} tokens) and answer ({max_new_tokens} tokens) alone exceed the model context "
                f"of {self.max_context} tokens" + ("; no memory fits" if header_len else "")
            )
        if need + max_new_tokens > self.max_context:
            fits = max_facts_that_fit(header_len, fact_lens, query_len + max_new_tokens, self.max_context)
            raise ContextOverflow(
                f"memory ({header_len + sum(fact_lens)} tokens for k={len(fact_lens)}) + query ({query_len} tokens) "
                f"+ answer ({max_new_tokens} tokens) = {need + max_new_tokens} tokens exceeds the model context of "
                f"{self.max_context} tokens; at most k={fits} fits"
            )
        return need

    def bare(
        self,
        question: str | None = None,
        max_new_tokens: int = 32,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> Prepared:
        """A request without memory (``mode`` "off"): the bare question, or the chat ``messages`` (with
        ``tools``). Raises ContextOverflow when it and the answer exceed the context."""
        ids = (
            self.fmt.conversation_ids(self.lm.tokenizer, messages, memory=False, tools=tools)
            if messages
            else self.fmt.query_ids(self.lm.tokenizer, question)
        )
        self.check_budget(0, [], len(ids), max_new_tokens)
        return Prepared("", question or "", "off", ids, ids, [], None, {})

    def method(self, mode: str | Method, tail_recompute: int | None = None) -> Method:
        """``mode`` as a ``Method`` this service's engine serves; ``tail_recompute``: the r a plain ``kv`` gets
        (default ``self.tail_recompute``). Raises ValueError for a bad method, selective with tail recompute,
        or one the engine cannot serve (``engines.registry.refusal``)."""
        method = Method.parse(mode, self.tail_recompute if tail_recompute is None else tail_recompute)
        why = refusal(method, self.engine.name)
        if why is not None:
            raise ValueError(why)
        return method

    def prepare(
        self,
        user: str,
        question: str,
        top_k: int,
        mode: str | Method = "kv",
        max_new_tokens: int = 32,
        messages: list[dict] | None = None,
        tail_recompute: int | None = None,
        tools: list[dict] | None = None,
    ) -> Prepared:
        """``plan``, then the engine's memory (synchronous engines); ``tools`` with ``messages`` as in ``plan``.
        Raises what ``plan`` raises."""
        return _run_now(
            self._pipeline(
                user,
                question,
                top_k,
                mode,
                max_new_tokens,
                messages,
                tail_recompute,
                False,
                plain_fallback=False,
                run=_call,
                memory=_returning(self.engine.memory),
                tools=tools,
            )
        )

    async def prepare_chat(
        self,
        user: str | list[str] | None,
        messages: list[dict],
        top_k: int,
        method: Method,
        max_new_tokens: int,
        cold: bool = False,
        *,
        run: Callable[..., Awaitable],
        tools: list[dict] | None = None,
        sampling: dict | None = None,
    ) -> Prepared:
        """One chat request of the server (an ``AsyncEngine``), everything before the engine call: retrieval for
        the last user message (tool results after it are conversation, not the question), then the engine's
        memory, and the request's decoding (``sampling``: other ``Sampling`` fields, under this service's stop
        rule), so the returned ``Prepared.request()`` is what the engine runs. ``method`` "off", an empty or
        missing user message, or a user with no memories yet: the plain chat (``bare``). ``tools``: OpenAI tool
        definitions for the chat template. ``run(fn, *args)``: awaits blocking work (retrieval) off the event
        loop. Raises what ``plan`` raises (ValueError, ContextOverflow, StoreError)."""
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        prep = await self._pipeline(
            user,
            question,
            top_k,
            method,
            max_new_tokens,
            messages,
            None,
            cold,
            plain_fallback=True,
            run=run,
            memory=self.engine.memory,
            tools=tools,
        )
        prep.sampling = self.sampling(max_new_tokens, **(sampling or {}))
        return prep

    async def _pipeline(
        self,
        user,
        question: str,
        top_k: int,
        method: str | Method,
        max_new_tokens: int,
        messages: list[dict] | None,
        tail_recompute: int | None,
        cold: bool,
        *,
        plain_fallback: bool,
        run: Callable[..., Awaitable],
        memory: Callable[[MemoryPlan], Awaitable],
        tools: list[dict] | None = None,
    ) -> Prepared:
        """``plan``, then the engine's ``memory``; planned again (at most ``PLANS`` times, then StoreError) when
        a write replaced the memory version between retrieval and the KV read (LookupError). With
        ``plain_fallback`` (the server's chats), method "off", an empty question or a user without memories
        is the plain chat instead (``bare``)."""
        bare = lambda: self.bare(max_new_tokens=max_new_tokens, messages=messages, tools=tools)
        if plain_fallback and (str(method) == "off" or not question.strip()):
            return await run(bare)
        for attempt in range(PLANS):
            try:
                req = await run(
                    self.plan, user, question, top_k, method, max_new_tokens, messages, tail_recompute, cold, tools
                )
            except UnknownUser:  # no memories yet: answer without any
                if not plain_fallback:
                    raise
                return await run(bare)
            if req.plan is None:
                return req
            t = time.perf_counter()
            try:
                req.attach(await memory(req.plan))
            except LookupError:  # a write replaced the version between retrieval and the KV read: again
                if attempt == PLANS - 1:
                    raise StoreError(f"the memory of {user!r} kept changing while being read") from None
                continue
            req.timings_ms["compose"] += (time.perf_counter() - t) * 1e3
            return req
        raise AssertionError("unreachable")

    def sampling(self, max_new_tokens: int, ignore_eos: bool = False, **options) -> Sampling:
        """Decoding to ``max_new_tokens`` with this service's stop rule; ``options``: other ``Sampling`` fields
        (default greedy)."""
        return Sampling(
            max_tokens=max_new_tokens,
            stop_token_ids=tuple(self.stop_ids),
            line_stop_ids=self.line_stop_ids,
            ignore_eos=ignore_eos,
            **options,
        )

    def ask(self, user: str, question: str, top_k: int, mode: str | Method = "kv", max_new_tokens: int = 32) -> Answer:
        """Answer ``question`` from ``user``'s memory with the ``top_k`` most relevant facts (``prepare`` + the
        engine call). Raises what ``prepare`` raises."""
        req = self.prepare(user, question, top_k, mode, max_new_tokens)
        (gen,) = self.engine.generate([req.request(self.sampling(max_new_tokens))])
        return self.answer(req, gen)

    def answer(self, req: Prepared, gen: Generation) -> Answer:
        """The Answer record for a prepared request and its engine generation."""
        text = self.lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True).strip()
        pre = sum(req.timings_ms.values())
        timings = {**req.timings_ms, "ttft": gen.ttft_ms, "total": pre + gen.ttft_ms, "decode": gen.decode_ms}
        return Answer(
            text,
            req.mode,
            len(req.fact_ids),
            req.fact_ids,
            len(req.prompt_ids),
            gen.prefilled_tokens,
            {k: round(v, 3) for k, v in timings.items()},
            req.user,
            req.question,
            self.engine.name,
            len(gen.token_ids),
            req.prompt_ids,
        )


@dataclass
class Prepared:
    """A request after retrieval (and, once ``memory`` is set, composition), before the model call.

    ``query_ids``: what follows the injected memory (recomputed tail facts, then the conversation);
    ``prompt_ids``: the whole prompt, identical in every mode; ``plan``: what to inject (kv mode; None
    otherwise); ``memory``: the engine's injectable memory for ``plan``; ``timings_ms``: embed, search, compose."""

    user: str
    question: str
    mode: str
    query_ids: list[int]
    prompt_ids: list[int]
    fact_ids: list[str]
    plan: MemoryPlan | None
    timings_ms: dict[str, float]
    memory: object | None = None
    sampling: Sampling | None = None  # the decoding ``request`` uses when given none (``prepare_chat``)

    def attach(self, memory: object | None) -> None:
        """Set the engine's memory for ``plan``; None (its KV failed the store's checks: ``Engine.memory``) makes
        this a plain prefill of the same prompt."""
        self.memory = memory
        if memory is None:
            self.plan = None

    def request(self, sampling: Sampling | None = None) -> EngineRequest:
        """The engine request: kv mode injects ``memory`` and prefills ``query_ids``; otherwise all is prefilled.
        ``sampling``: the decoding (default: ``self.sampling``, set by ``prepare_chat``)."""
        if self.plan is not None and self.memory is None:
            raise ValueError("a kv-mode request needs its memory (MemoryService.prepare, or the engine's memory)")
        sampling = sampling if sampling is not None else self.sampling
        if sampling is None:
            raise ValueError("no sampling given, and none prepared (MemoryService.prepare_chat)")
        return EngineRequest(self.prompt_ids, self.memory, len(self.query_ids), sampling)


async def _call(fn, *args):
    """``run`` of the synchronous pipeline: blocking work, here and now."""
    return fn(*args)


def _returning(fn):
    """A synchronous engine's ``memory`` in the pipeline's awaitable shape."""

    async def call(plan):
        return fn(plan)

    return call


def _run_now(coro: Coroutine):
    """The result of a coroutine that never suspends (the pipeline over a synchronous engine): its awaits all
    finish at once, so it runs to its end on this thread without an event loop, and raises what it raises."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the synchronous pipeline waited on something")


def same_prompt(a: Answer, b: Answer) -> None:
    """Both modes must see exactly the same prompt token ids (and so the same facts in the same order)."""
    if a.prompt_token_ids != b.prompt_token_ids or a.fact_ids != b.fact_ids:
        raise AssertionError("kv and prompt modes saw different prompts")
