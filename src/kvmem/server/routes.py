"""The FastAPI app of ``kvmem serve``: errors and limits for every request, then three routers, each a module of
module-level route functions: ``admin`` here (health, readiness, models, metrics), ``chat.router`` (OpenAI chat
completions with KV-injected memory) and ``memories.router`` (the memories REST API in Mem0's platform shapes),
plus MCP at ``/mcp``. A route reads its server from the app (``runtime.server_of``) and the caller's tenant from
its key (``runtime.tenant_of``); blocking work runs off the event loop."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from . import chat, memories
from .mcp import mount_mcp
from .responses import Health, ModelList, Ready
from .runtime import KvmemServer, logger, server_of, tenant_of
from .schemas import NONBLANK, APIError, engine_dead, error_of, error_responses, store_unavailable
from .stalls import BodyTimeout, SendTimeout
from .ui import mount_ui

READY_PROBE_S = 3.0  # /ready answers 503 store_unavailable when the store's probe takes longer


def create_app(server: KvmemServer) -> FastAPI:
    """The FastAPI app over a started ``KvmemServer``: errors and limits, then the routers."""
    app = FastAPI(title="kvmem", version="0.1", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.kvmem = server
    _errors_and_limits(app, server)
    for router in (admin, memories.router, chat.router):
        app.include_router(router)
    mount_mcp(app, server)  # /mcp: the memory tools over the Model Context Protocol
    mount_ui(app, server)  # /ui: the memory inspector in the browser
    app.openapi = lambda: _document(app)
    app.add_middleware(BodyTimeout, timeout_s=lambda: server.limits.body_timeout_s)  # a trickled body: 408
    # outermost: a client that stops reading never holds its request (a streamed chat's engine slot) past the bound
    app.add_middleware(
        SendTimeout, timeout_s=lambda: server.limits.send_timeout_s, on_stall=server.metrics.send_timeouts.inc
    )
    return app


NO_NUL = "^[^\\u0000]*$"  # what every string of a request may hold: no store takes a NUL (400 otherwise)


def _document(app: FastAPI) -> dict:
    """The OpenAPI document, built once: FastAPI's, with every string of a request (a body's, a path's or a
    query's) that has no pattern of its own given ``NO_NUL``, as the server enforces it (``schemas.Body``, the
    middleware's path and query check)."""
    if app.openapi_schema is None:
        doc = FastAPI.openapi(app)
        requests = [doc.get("components", {}).get("schemas", {})]
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                requests += [p.get("schema", {}) for p in op.get("parameters", [])]
        todo = list(requests)
        while todo:
            x = todo.pop()
            if isinstance(x, dict):
                if x.get("type") == "string" and "pattern" not in x and "format" not in x:
                    x["pattern"] = NO_NUL
                todo += list(x.values())
            elif isinstance(x, list):
                todo += x
        app.openapi_schema = doc
    return app.openapi_schema


def _empty(error: dict) -> bool:
    """A validation error for an empty string (``min_length``) or a blank one (``schemas.NONBLANK``)."""
    return error.get("type") == "string_too_short" or (error.get("ctx") or {}).get("pattern") == NONBLANK


def _union_tag(part) -> bool:
    """A part of a validation error's location that names a union's branch (``constrained-str``, ``list[str]``,
    ``int``), not a field."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in ("str", "int", "float", "bool", "dict"))


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
        e = errs[0] if errs else {}
        if e.get("type") != "bad_request":  # of a union's errors, an empty string's is the one to answer
            e = next((x for x in errs if _empty(x)), e)
        loc = ".".join(str(x) for x in e.get("loc", ())[1:] if not _union_tag(x)) or None
        if e.get("type") == "bad_request":  # a check of the request models (tools, tool messages): 400
            return APIError(400, f"{loc}: {e.get('msg')}" if loc else e.get("msg"), "invalid_request", loc).response()
        if any(e.get("type") in ("json_invalid", "json_type") or tuple(e.get("loc", ())) == ("body",) for e in errs):
            return APIError(400, "the body is not a valid JSON object", "invalid_json").response()
        if _empty(e):  # an empty id, query or stop string: bad input (400), as the library answers it
            return APIError(400, f"{loc}: {e.get('msg')}", "invalid_request", loc).response()
        if e.get("type") == "extra_forbidden":  # e.g. a Mem0 v1/v2 field a v3 client would not send
            return APIError(400, f"field {loc!r} is not supported by this server", "unsupported_field", loc).response()
        return APIError(422, f"{loc or 'body'}: {e.get('msg', 'invalid value')}", "invalid_value", loc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        resp = APIError(exc.status_code, str(exc.detail)).response()
        resp.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow: every method the path answers (each is a route of its own)
            allowed = {m for r in app.routes if r.matches(request.scope)[0] != Match.NONE for m in r.methods or ()}
            resp.headers["allow"] = ", ".join(sorted(allowed))
        return resp

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


admin = APIRouter()


@admin.get("/health", response_model=Health, responses=error_responses(400, 413))
async def health():
    return {"status": "ok"}


@admin.get("/ready", response_model=Ready, response_model_exclude_unset=True, responses=error_responses(400, 413, 503))
async def ready(request: Request):
    """200 while the engine runs and the store answers; else 503 ``engine_dead``, ``not_ready`` or
    ``store_unavailable`` (the store's database has not answered a probe: ``Store.available``)."""
    server = server_of(request)
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


@admin.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}, **error_responses(400, 413)},
)
async def metrics(request: Request):
    """Prometheus text exposition format."""
    return Response(server_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@admin.get("/v1/models", response_model=ModelList, responses=error_responses(400, 401, 413, 503))
async def models(request: Request):
    tenant_of(request)
    name = server_of(request).model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvmem"}]}
