"""One prepared chat request against the engine (``service.MemoryService.prepare_chat`` prepared it): the engine's
deltas turned into text (incremental detokenization, ``detok``; stop strings), counts and timings, and OpenAI's
streaming format (``chat.completion.chunk`` server-sent events)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from ..service import Prepared
from .detok import IncrementalText
from .schemas import APIError, engine_dead, error_of
from .toolcalls import ToolPlan, ToolStream

if TYPE_CHECKING:
    from .runtime import KvmemServer


POLL_S = 0.25  # how often a wait on the engine checks that the engine and the client are still there


async def watched(server: KvmemServer, aw, timeout_s: float, request: Request | None = None):
    """Await ``aw`` (engine output) for at most ``timeout_s``, checking every ``POLL_S`` that the engine is alive
    and, given ``request``, that the client is still connected; otherwise ``aw`` is cancelled (which closes the
    engine stream: vLLM aborts the request) and this raises. A request that reached an engine in its last
    moments would otherwise wait for output that never comes, and be cut off by the server's shutdown with a
    bare 500.

    Raises: APIError 503 ``engine_dead``, APIError 400 ``client_disconnected``, TimeoutError."""
    task = asyncio.ensure_future(aw)
    deadline = time.perf_counter() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(POLL_S, deadline - time.perf_counter())))
            if done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, StopAsyncIteration) and not server.engine.healthy():
                    raise engine_dead() from exc  # the engine's own error for its death (e.g. EngineDeadError)
                return task.result()
            if not server.engine.healthy():
                raise engine_dead()
            if request is not None and await request.is_disconnected():
                raise APIError(400, "the client disconnected", "client_disconnected")
            if time.perf_counter() >= deadline:
                raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
        try:
            await task  # its outcome is retrieved either way (no "exception never retrieved")
        except BaseException:
            pass


class ChatGeneration:
    """One engine request: deltas -> text (incremental detokenization, stop strings), counts and timings."""

    def __init__(self, server: KvmemServer, rid: str, prep: Prepared, stops: list[str], t_arrive: float):
        """``prep``: the service's prepared chat, with its decoding (``MemoryService.prepare_chat``)."""
        self.server, self.rid, self.prep, self.stops, self.t_arrive = server, rid, prep, stops, t_arrive
        self.detok = IncrementalText(server.service.lm.tokenizer)  # each token decoded once
        sampling = prep.sampling
        self._it = server.engine.stream(rid, prep.request())
        self.ids: list[int] = self.detok.ids
        self._longest_stop = max((len(s) for s in stops), default=0)
        self.logprobs = [] if sampling.logprobs is not None else None  # TokenLogprob per generated token
        self._lp_sent = 0
        self.text, self.sent = "", 0
        self.finish_reason, self.final, self.ttft_ms = None, None, None
        self.deadline = t_arrive + server.limits.request_timeout_s

    async def first(self):
        """The first delta (raises the engine's error, e.g. EngineBusy, before any byte is sent)."""
        try:
            return await watched(self.server, self._it.__anext__(), max(0.1, self.deadline - time.perf_counter()))
        except StopAsyncIteration:
            return None

    def _take(self, delta) -> str:
        """Apply a delta; return the new text that may be sent now."""
        if self.ttft_ms is None and (delta.token_ids or delta.finished):
            self.ttft_ms = (time.perf_counter() - self.t_arrive) * 1e3
            self.server.metrics.ttft.labels(self.prep.mode).observe(self.ttft_ms / 1e3)
        added = self.detok.push(delta.token_ids)
        if self.logprobs is not None:
            self.logprobs += delta.logprobs or []
        if delta.finished:
            self.final, self.finish_reason = delta, ("length" if delta.finish_reason == "length" else "stop")
            added += self.detok.finish()
        text = self.detok.text
        # a stop string can only end in the new text: search from where one could begin
        lo = max(0, len(text) - len(added) - self._longest_stop + 1)
        found = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        if found:
            text, self.finish_reason = text[: min(found)], "stop"
            self.final = self.final or delta
        hold = 0 if self.finish_reason else max(0, self._longest_stop - 1)
        self.text = text
        end = max(self.sent, len(text) - hold)
        new, self.sent = text[self.sent : end], end
        return new

    async def deltas(self, first=None):
        """New text pieces until the end; closing it aborts the engine request."""
        try:
            if first is not None:
                piece = self._take(first)
                if piece:
                    yield piece
            while self.finish_reason is None:
                remaining = self.deadline - time.perf_counter()
                if remaining <= 0:
                    raise TimeoutError
                try:
                    d = await watched(self.server, self._it.__anext__(), remaining)
                except StopAsyncIteration:
                    self.finish_reason = self.finish_reason or "stop"
                    break
                piece = self._take(d)
                if piece:
                    yield piece
            tail = self.text[self.sent :]
            if tail:
                self.sent = len(self.text)
                yield tail
        finally:
            await self._it.aclose()
            self._account()

    async def collect(self) -> str:
        first = await self.first()
        async for _ in self.deltas(first):
            pass
        return self.text

    def _account(self):
        if getattr(self, "_accounted", False) or self.final is None:
            return
        self._accounted = True
        m = self.server.metrics
        injected = self.final.prompt_tokens - self.final.prefilled_tokens
        m.tokens.labels("injected").inc(max(0, injected))
        m.tokens.labels("prefilled").inc(self.final.prefilled_tokens)
        if self.prep.mode == "kv" and self.prep.fact_ids and self.final.prefilled_tokens > len(self.prep.query_ids):
            m.fallbacks.labels("prefilled_memory").inc()

    def _tokens_for(self, chars: int) -> int:
        """The fewest leading generated tokens whose text holds ``chars`` characters of the answer: logprobs
        cover the tokens of the text sent, never those cut by a stop string, held back, or special (EOS)."""
        return self.detok.tokens_for(chars)

    def logprobs_json(self, new_only: bool = False) -> dict | None:
        """OpenAI's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for the
        tokens of the text sent; None when not asked. ``new_only``: those not in an earlier chunk (streaming)."""
        if self.logprobs is None:
            return None
        tok = self.server.service.lm.tokenizer
        end = min(self._tokens_for(self.sent), len(self.logprobs))
        start = self._lp_sent if new_only else 0
        if new_only:
            self._lp_sent = max(self._lp_sent, end)

        def one(token_id: int, logprob: float) -> dict:
            text = tok.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                for e in self.logprobs[start:end]
            ]
        }

    def usage(self) -> dict:
        n_prompt = len(self.prep.prompt_ids)
        cached = (self.final.prompt_tokens - self.final.prefilled_tokens) if self.final else 0
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(self.ids),
            "total_tokens": n_prompt + len(self.ids),
            "prompt_tokens_details": {"cached_tokens": max(0, cached)},
        }

    def kvmem(self) -> dict:
        t = dict(self.prep.timings_ms)
        t["ttft"] = self.ttft_ms
        out = {
            "mode": self.prep.mode,
            "k": len(self.prep.fact_ids),
            "fact_ids": self.prep.fact_ids,
            "engine": self.server.engine.name,
            "kv_format": self.server.service.store.kv_format,
            "timings_ms": {k: round(v, 3) for k, v in t.items() if v is not None},
        }
        if self.server.replica is not None:
            out["replica"] = self.server.replica
        return out


async def answer(
    server: KvmemServer,
    rid: str,
    prep: Prepared,
    stops: list[str],
    tools: ToolPlan | None,
    stream: bool,
    include_usage: bool,
    t_arrive: float,
    request: Request,
):
    """A prepared chat (``MemoryService.prepare_chat``) run on the engine and answered whole: with ``stream``, a
    ``ChatStream`` of server-sent events (``sse``; the first delta awaited here, so an engine error is a status,
    not a broken stream); else OpenAI's ``chat.completion`` JSON (``answer_json``), collected while the client
    stays connected. ``tools``: the request's ``ToolPlan``. Raises APIError (busy, a dead engine, a client
    gone), TimeoutError."""
    gen = ChatGeneration(server, rid, prep, stops, t_arrive)
    if stream:
        first = await gen.first()
        return ChatStream(sse(gen, first, include_usage, tools), media_type="text/event-stream")
    text = await watched(server, gen.collect(), server.limits.request_timeout_s, request)
    return answer_json(gen, text, tools)


def answer_json(gen: ChatGeneration, text: str, tools: ToolPlan | None) -> dict:
    """A whole answer (``chat.completion``, ``schemas.ChatCompletion``) of a collected generation: its text,
    or the tool calls it holds (then ``finish_reason`` "tool_calls"), with ``usage`` and ``kvmem``."""
    message = {"role": "assistant", "content": text}
    parsed = tools.parse(text) if tools is not None else None
    if parsed is not None:
        message = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
        gen.finish_reason = "tool_calls"
    return {
        "id": gen.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": gen.server.model_name,
        "choices": [
            {"index": 0, "message": message, "logprobs": gen.logprobs_json(), "finish_reason": gen.finish_reason}
        ],
        "usage": gen.usage(),
        "kvmem": gen.kvmem(),
    }


class ChatStream(StreamingResponse):
    """A streamed chat's response: its body (``sse``) is closed however the response ends (finished, the client
    gone, or cut off by ``stalls.SendTimeout``), shielded from the cancellation that ended it, so the engine
    request is aborted and its slot freed at once, never when the generator is garbage-collected."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def sse(gen: ChatGeneration, first, include_usage: bool, tools: ToolPlan | None = None):
    """OpenAI's chat.completion.chunk stream: a role delta, content deltas, the finish chunk (with ``kvmem``),
    an optional usage chunk, then ``[DONE]``. A mid-stream error ends the stream with an error event. With
    ``tools``, text that may be a call is held back (``toolcalls.ToolStream``); each call goes out once whole:
    a delta with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` ""), then one with its
    ``arguments``; the finish reason is then "tool_calls"."""
    base = {
        "id": gen.rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": gen.server.model_name,
    }

    def chunk(delta: dict, finish=None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if gen.logprobs is not None:
            choice["logprobs"] = gen.logprobs_json(new_only=True)
        return "data: " + json.dumps({**base, "choices": [choice], **extra}) + "\n\n"

    held = ToolStream(tools) if tools is not None else None
    yield chunk({"role": "assistant", "content": "" if held is None else None})
    pieces = gen.deltas(first)  # closed here, however the stream ends: that aborts the engine request at once
    try:
        async for piece in pieces:
            piece = held.feed(piece) if held is not None else piece
            if piece:
                yield chunk({"content": piece})
        if held is not None:
            rest, calls = held.finish()
            if rest:
                yield chunk({"content": rest})
            for i, call in enumerate(calls):
                fn = call["function"]
                head = {"index": i, "id": call["id"], "type": "function"}
                yield chunk({"tool_calls": [{**head, "function": {"name": fn["name"], "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
            if calls:
                gen.finish_reason = "tool_calls"
    except Exception as exc:
        err = error_of(exc) if gen.server.engine.healthy() else engine_dead()
        yield (
            "data: "
            + json.dumps(
                {
                    "error": {
                        "message": err.message,
                        "type": APIError.TYPES.get(err.status, "api_error"),
                        "code": err.code,
                    }
                }
            )
            + "\n\n"
        )
        return
    finally:
        await pieces.aclose()
    yield chunk({}, gen.finish_reason, kvmem=gen.kvmem())
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": gen.usage()}) + "\n\n"
    yield "data: [DONE]\n\n"
