"""The chat route, ``POST /v1/chat/completions``: OpenAI chat completions with memory.

A chat enters each module once, in order: this route checks the whole request (``ChatRequest``'s own checks,
then what depends on this server: ``check_chat``), the service prepares it in one call
(``MemoryService.prepare_chat``: retrieval, the engine's memory, the decoding), and ``streaming`` runs it on the
engine and answers, as server-sent events or one JSON."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request

from ..policy import Method
from ..scopes import Scope, ScopeError
from .responses import ChatCompletion
from .runtime import KvmemServer, server_of, tenant_of
from .schemas import APIError, ChatRequest, MemoryOptions, error_responses
from .streaming import answer
from .toolcalls import ToolPlan

router = APIRouter()
# a whole answer is JSON; with "stream": true it is server-sent events, as OpenAI's
ANSWERS = {"application/json": {}, "text/event-stream": {}}
ERRORS = error_responses(400, 401, 404, 409, 413, 422, 429, 503, 507)


@dataclass
class ChatCall:
    """A checked chat: what the service prepares (``prepare`` keyword arguments) and how it is answered."""

    prepare: dict
    stops: list[str]
    tools: ToolPlan | None
    stream: bool
    include_usage: bool


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    response_model_exclude_unset=True,
    responses={200: {"description": "the answer", "content": ANSWERS}, **ERRORS},
)
async def chat(body: ChatRequest, request: Request):
    t_arrive = time.perf_counter()
    server = server_of(request)
    call = check_chat(server, body, tenant_of(request))
    prep = await asyncio.wait_for(
        server.service.prepare_chat(**call.prepare, run=server.off_loop), server.limits.request_timeout_s
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await answer(server, rid, prep, call.stops, call.tools, call.stream, call.include_usage, t_arrive, request)


def check_chat(server: KvmemServer, body: ChatRequest, tenant: str | None) -> ChatCall:
    """What of a chat depends on this server, checked before any retrieval: the model's name (404), the
    server's ``max_tokens``, fields it does not support, tools its model's template lacks, a memory user, a cold
    read it was not started to allow (400 each); the defaults it fills in (``settings.Limits``). Returns the
    call; raises APIError."""
    limits = server.limits
    if body.model and body.model != server.model_name:
        raise APIError(
            404, f"model {body.model!r} not found; this server serves {server.model_name!r}", "model_not_found", "model"
        )
    opts = body.memory or MemoryOptions()
    mode = opts.mode or limits.default_mode
    max_tokens = body.max_completion_tokens or body.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens: at most {limits.max_tokens} on this server", param="max_tokens")
    body.check_supported()
    tools = tool_plan(body, server.service.fmt.tools)
    user = chat_scopes(tenant, body.user, opts.agent_id, opts.run_id)
    if user is None and opts.mode is None:  # a plain OpenAI client (an extractor, say): no memory to use
        mode = "off"
    if user is None and mode != "off":
        raise APIError(
            400, "the request's 'user' field names whose memory to use (or set memory.mode 'off')", param="user"
        )
    if opts.cache == "cold" and not limits.allow_cold:
        raise APIError(
            400,
            "memory.cache 'cold' bypasses every cache tier, for load tests: this server was not started with "
            "--allow-cold-requests",
            param="memory.cache",
        )
    sel = server.selective_recompute if opts.selective_recompute is None else opts.selective_recompute
    schema = body.response_format.schema_json() if body.response_format is not None else None
    rendered = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in body.tools or []]
    prepare = {
        "user": user,
        "messages": [m.for_template() for m in body.messages],
        "top_k": opts.top_k or limits.default_top_k,
        "method": Method.of(mode, opts.tail_recompute, sel),
        "max_new_tokens": max_tokens,
        "cold": opts.cache == "cold",
        "tools": rendered if tools else None,
        "sampling": {
            "temperature": body.temperature or 0.0,
            "top_p": body.top_p or 1.0,
            "seed": body.seed,
            "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
            "json_schema": tools.grammar() if tools is not None and tools.mode != "auto" else schema,
        },
    }
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return ChatCall(prepare, body.stops(), tools, body.stream, include_usage)


def chat_scopes(tenant: str | None, user, agent_id, run_id) -> list[str] | None:
    """The store users a chat injects from: every scope made of the entities it names (the OpenAI ``user``,
    ``memory.agent_id``, ``memory.run_id``; ``scopes.Scope.subscopes``), so a memory of an agent or a run is
    injected only into chats that name it. None when it names none. Raises APIError 400 for a bad id."""
    if user is None and agent_id is None and run_id is None:
        return None
    try:
        named = Scope.of(user, agent_id, run_id)
    except ScopeError as exc:
        raise APIError(400, str(exc), "invalid_user", "user") from None
    return [s.key(tenant) for s in named.subscopes()]


def tool_plan(body: ChatRequest, template_has_tools: bool) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None: a text answer). APIError 400 for tools or tool messages on a model
    whose chat template has no tools, and for ``tool_choice`` "required" or named with a ``response_format``."""
    in_history = any(m.role == "tool" or m.tool_calls for m in body.messages)
    if (body.tools or in_history) and not template_has_tools:
        raise APIError(
            400,
            "this model's chat template has no tools: tool calls are not available with it (docs/server.md, Tools)",
            "tools_unsupported",
            "tools" if body.tools else "messages",
        )
    plan = ToolPlan.of(body)
    fmt = body.response_format
    if plan is not None and plan.mode != "auto" and fmt is not None and fmt.type != "text":
        raise APIError(
            400, "tool_choice 'required' or a named function excludes a response_format", param="tool_choice"
        )
    return plan
