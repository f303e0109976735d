"""The HTTP routes of ``kvmem serve``: OpenAI chat completions with KV-injected memory, the memories REST API
in Mem0's platform shapes, health, readiness, models and metrics. Each route checks its input, maps the caller
to a tenant, and hands the work to the service, the ``Memory`` facade or the engine (``runtime.KvmemServer``);
blocking work runs off the event loop."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..policy import Method
from ..scopes import Scope, ScopeError
from .mcp import mount_mcp
from .memories import memory_routes
from .runtime import KvmemServer, logger
from .schemas import APIError, ChatRequest, MemoryOptions, engine_dead, error_of, error_responses, store_unavailable
from .stalls import BodyTimeout, SendTimeout
from .streaming import ChatGeneration, ChatStream, prepare_chat, sse, watched
from .toolcalls import ToolPlan
from .ui import mount_ui

READY_PROBE_S = 3.0  # /ready answers 503 store_unavailable when the store's probe takes longer


def create_app(server: KvmemServer) -> FastAPI:
    """The FastAPI app over a started ``KvmemServer``: errors and limits, then the routes by group."""
    app = FastAPI(title="kvmem", version="0.1", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.kvmem = server
    _errors_and_limits(app, server)

    def tenant_of(request: Request) -> str | None:
        return server.tenants.tenant(request.headers.get("authorization"))

    _service_routes(app, server, tenant_of)
    memory_routes(app, server, tenant_of)
    _chat_route(app, server, tenant_of)
    mount_mcp(app, server)  # /mcp: the memory tools over the Model Context Protocol
    mount_ui(app, server)  # /ui: the memory inspector in the browser
    app.add_middleware(BodyTimeout, timeout_s=lambda: server.limits.body_timeout_s)  # a trickled body: 408
    # outermost: a client that stops reading never holds its request (a streamed chat's engine slot) past the bound
    app.add_middleware(
        SendTimeout, timeout_s=lambda: server.limits.send_timeout_s, on_stall=server.metrics.send_timeouts.inc
    )
    return app


def _errors_and_limits(app: FastAPI, server: KvmemServer) -> None:
    """OpenAI-shaped errors for every exception; body limits, a dead engine and request metrics per request."""
    limits = server.limits

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "nul_character" for e in errs):
            return APIError(400, "NUL characters (\\u0000) are not allowed in a body", "invalid_request").response()
        if any(e.get("type") in ("json_invalid", "json_type") or tuple(e.get("loc", ())) == ("body",) for e in errs):
            return APIError(400, "the body is not a valid JSON object", "invalid_json").response()
        e = errs[0] if errs else {}
        loc = ".".join(str(x) for x in e.get("loc", ())[1:]) or None
        if e.get("type") == "bad_request":  # a check of the request models (tools, tool messages): 400
            return APIError(400, f"{loc}: {e.get('msg')}", "invalid_request", loc).response()
        if e.get("type") == "extra_forbidden":  # e.g. a Mem0 v1/v2 field a v3 client would not send
            return APIError(400, f"field {loc!r} is not supported by this server", "unsupported_field", loc).response()
        return APIError(422, f"{loc or 'body'}: {e.get('msg', 'invalid value')}", "invalid_value", loc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _any(request, exc: Exception):
        if not server.engine.healthy():  # the engine died under this request
            return engine_dead().response()
        err = error_of(exc)
        if err.status >= 500:
            logger.exception("unhandled error on %s", request.url.path)
        return err.response()

    @app.middleware("http")
    async def _limits_and_metrics(request: Request, call_next):
        server.start_upkeep(asyncio.get_running_loop())  # a server that never writes sweeps its disk cache too
        too_big = body_limit_error(request.headers, limits.max_body_bytes)
        if too_big is not None:
            resp = too_big.response()
        elif "\x00" in request.url.path or "%00" in request.url.query:  # no store can hold a NUL (PostgreSQL)
            resp = APIError(400, "NUL characters are not allowed in a path or query", "invalid_request").response()
        elif request.url.path.startswith("/v1/") and not server.engine.healthy():
            resp = engine_dead().response()
        else:
            try:
                resp = await call_next(request)
            except Exception as exc:
                err = error_of(exc) if server.engine.healthy() else engine_dead()  # the engine died under it
                if err.status >= 500 and err.code == "internal_error":
                    logger.exception("unhandled error on %s", request.url.path)
                resp = err.response()
        matched = request.scope.get("route")  # the route template, never the raw path (bounded label values)
        server.metrics.requests.labels(getattr(matched, "path", "other"), str(resp.status_code)).inc()
        if server.replica is not None:
            resp.headers["x-kvmem-replica"] = server.replica
        return resp


def body_limit_error(headers, max_body_bytes: int) -> APIError | None:
    """413 for a body over ``max_body_bytes`` (by Content-Length) or one without a length (chunked: unbounded
    otherwise); None when the body may be read."""
    n = headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > max_body_bytes):
        return APIError(413, f"the body exceeds {max_body_bytes} bytes", "body_too_large")
    if n is None and "chunked" in headers.get("transfer-encoding", "").lower():
        return APIError(413, "a body must come with Content-Length", "length_required")
    return None


def _service_routes(app: FastAPI, server: KvmemServer, tenant_of) -> None:
    """Health, readiness, metrics and the model list."""

    @app.get("/health", responses=error_responses(400, 413))
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses=error_responses(400, 413, 503))
    async def ready():
        """200 while the engine runs and the store answers; else 503 ``engine_dead``, ``not_ready`` or
        ``store_unavailable`` (the store's database has not answered a probe: ``Store.available``)."""
        if not server.engine.healthy():
            raise engine_dead()
        if not server.ready:
            raise APIError(503, "the engine is not ready", "not_ready")
        try:  # bounded in the store too; this bound only keeps /ready itself prompt
            up = await asyncio.wait_for(server.off_loop(server.service.store.available), READY_PROBE_S)
        except TimeoutError:
            up = False
        if not up:
            raise store_unavailable()
        out = {"status": "ready", "engine": server.engine.name, "model": server.model_name}
        if server.replica is not None:
            out.update(replica=server.replica, pid=os.getpid())
        return out

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **error_responses(400, 413)},
    )
    async def metrics():
        """Prometheus text exposition format."""
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(400, 401, 413, 503))
    async def models(request: Request):
        tenant_of(request)
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "kvmem"}],
        }


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


def _chat_route(app: FastAPI, server: KvmemServer, tenant_of) -> None:
    """OpenAI chat completions with memory: retrieval, the engine's memory, then a streamed or whole answer."""
    limits = server.limits

    # a whole answer is JSON; with "stream": true it is server-sent events, as OpenAI's
    answers = {"application/json": {}, "text/event-stream": {}}

    errors = error_responses(400, 401, 404, 409, 413, 422, 429, 503, 507)

    @app.post("/v1/chat/completions", responses={200: {"description": "the answer", "content": answers}, **errors})
    async def chat(body: ChatRequest, request: Request):
        t_arrive = time.perf_counter()
        tenant = tenant_of(request)
        if body.model and body.model != server.model_name:
            raise APIError(
                404,
                f"model {body.model!r} not found; this server serves {server.model_name!r}",
                "model_not_found",
                "model",
            )
        if body.messages[-1].role not in ("user", "tool"):
            raise APIError(400, "the last message must be from the user or a tool", param="messages")
        opts = body.memory or MemoryOptions()
        mode = opts.mode or limits.default_mode
        top_k = opts.top_k or limits.default_top_k
        max_tokens = body.max_completion_tokens or body.max_tokens or limits.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise APIError(400, f"max_tokens: at most {limits.max_tokens} on this server", param="max_tokens")
        body.check_supported()
        messages = [m.for_template() for m in body.messages]
        svc = server.service
        tools = tool_plan(body, svc.fmt.tools)
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
        method = Method.of(mode, opts.tail_recompute, sel)
        rendered = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in body.tools or []]
        prep = await asyncio.wait_for(
            prepare_chat(
                server, user, messages, top_k, method, max_tokens, opts.cache == "cold", rendered if tools else None
            ),
            limits.request_timeout_s,
        )

        schema = body.response_format.schema_json() if body.response_format is not None else None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
        sampling = svc.sampling(
            max_tokens,
            temperature=body.temperature or 0.0,
            top_p=body.top_p or 1.0,
            seed=body.seed,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            json_schema=tools.grammar() if tools is not None and tools.mode != "auto" else schema,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = ChatGeneration(server, rid, prep, sampling, stops, t_arrive)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            first = await gen.first()  # errors (busy, engine) become statuses before the stream starts
            return ChatStream(sse(gen, first, include_usage, tools), media_type="text/event-stream")
        text = await watched(server, gen.collect(), limits.request_timeout_s, request)
        message = {"role": "assistant", "content": text}
        parsed = tools.parse(text) if tools is not None else None
        if parsed is not None:
            message = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
            gen.finish_reason = "tool_calls"
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": gen.logprobs_json(),
                    "finish_reason": gen.finish_reason,
                }
            ],
            "usage": gen.usage(),
            "kvmem": gen.kvmem(),
        }


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
