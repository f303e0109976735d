"""``kvmem serve``: one long-lived process, an OpenAI-compatible chat API with KV-injected memory and a memories
REST API in Mem0's platform shapes (FastAPI + uvicorn, pydantic models, prometheus_client metrics).

Request path (chat): key -> tenant; the request's ``user`` is the memory owner inside the tenant's namespace
(``"<tenant>:<user>"`` in the store, so the vLLM cache salt covers the tenant too); ``MemoryService.prepare``
embeds the last user message, retrieves ``top_k`` facts and composes ``[header][facts][conversation]``; the engine
(``engines.base.AsyncEngine``: vLLM's ``AsyncLLM`` with the kvmem connector, or the transformers engine one
request at a time) prefills only the conversation in ``kv`` mode, everything in ``prompt`` mode, and the bare
chat in ``off`` mode. Writes (``POST /v1/memories`` ...) go through ``memory.Memory``'s one write path and are
visible to the next chat request (a new memory version).

Everything that runs the transformers model (encoding new facts, the hf engine's composition and decoding) runs
on one model thread, so the model and its RoPE state are never used by two requests at once.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 bad input, 401 missing or
unknown key, 403 another tenant's memory, 404 unknown memory id / model / route, 409 a write that lost a race,
413 body too large, 422 a field of the wrong type, 429 engine queue full, 503 not ready or timed out.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvmem.server")

MAX_BODY_BYTES = 1 << 20
TENANT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class APIError(Exception):
    """An error answered as OpenAI-style JSON with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
             422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                                       "param": self.param, "code": self.code}}, status_code=self.status)


# --- request and response models ---------------------------------------------------------------------------

class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32000)
    name: str | None = None


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1, le=200)
    mode: Literal["kv", "prompt", "off"] | None = None
    tail_recompute: int | None = Field(None, ge=0, le=200)
    selective_recompute: int | None = Field(None, ge=0, le=100)  # % of fact tokens; transformers engine only


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields kvmem does not use (logprobs, ...)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: dict | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=1)
    memory: MemoryOptions | None = None


class AddMemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: str | list[dict]
    user_id: str = Field(max_length=256)
    metadata: dict | None = None
    infer: bool = True
    timestamp: float | None = None


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(max_length=8000)
    user_id: str = Field(max_length=256)
    limit: int = Field(10, ge=1, le=1000)
    filters: dict | None = None


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


# --- tenants ---------------------------------------------------------------------------------------------

def load_api_keys(path: str | Path) -> dict[str, str]:
    """``{"<key>": "<tenant>", ...}`` (JSON). Raises ValueError for an unreadable file, a short key or a tenant
    name other than ``[A-Za-z0-9_-]{1,64}``."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read API keys from {path}: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path} must be a JSON object of key -> tenant")
    for key, tenant in raw.items():
        if not isinstance(key, str) or len(key) < 16:
            raise ValueError(f"{path}: every key must be a string of at least 16 characters")
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise ValueError(f"{path}: tenant {tenant!r} must match [A-Za-z0-9_-]{{1,64}}")
    return dict(raw)


@dataclass
class Tenants:
    """Keys -> tenants. Without keys every caller is the one default tenant (the server then binds to loopback)."""

    keys: dict[str, str] = field(default_factory=dict)

    def tenant(self, authorization: str | None) -> str | None:
        if not self.keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "missing API key (Authorization: Bearer <key>)", "missing_api_key")
        given = given.strip().encode()
        found = None
        for key, tenant in self.keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", "invalid_api_key")
        return found

    @staticmethod
    def user(tenant: str | None, user_id) -> str:
        """The store's user for ``user_id`` in ``tenant``'s namespace. Raises APIError 400 for a bad user_id."""
        from .store import check_user

        try:
            check_user(user_id)
            if tenant is not None:
                check_user(f"{tenant}:{user_id}")
        except ValueError:
            limit = 256 - (len(tenant) + 1 if tenant is not None else 0)
            raise APIError(400, f"user_id {str(user_id)[:40]!r} is not allowed: a non-empty string of at most {limit} "
                           "characters, no path or control characters", "invalid_user", "user") from None
        return user_id if tenant is None else f"{tenant}:{user_id}"

    @staticmethod
    def owns(tenant: str | None, store_user: str) -> bool:
        return tenant is None or store_user.startswith(f"{tenant}:")

    @staticmethod
    def public(tenant: str | None, store_user: str) -> str:
        return store_user if tenant is None else store_user[len(tenant) + 1:]


# --- metrics ---------------------------------------------------------------------------------------------

class Metrics:
    """The server's prometheus metrics, in their own registry (several servers per process in tests)."""

    def __init__(self, server: "KvmemServer"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmem_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.ttft = Histogram("kvmem_ttft_seconds", "Server-side time to first token by memory mode", ["mode"],
                              buckets=(.025, .05, .1, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 10, 20, 60), registry=r)
        self.tokens = Counter("kvmem_prompt_tokens", "Prompt tokens: injected (from memory KV) or prefilled",
                              ["kind"], registry=r)
        self.fallbacks = Counter("kvmem_connector_fallbacks", "kv-mode requests whose memory was prefilled instead "
                                 "of injected, by reason", ["reason"], registry=r)
        Gauge("kvmem_engine_queue_depth", "Requests waiting for or running in the engine", registry=r) \
            .set_function(lambda: server.engine.queue_depth())
        Gauge("kvmem_store_bytes", "Bytes of the store directory", registry=r).set_function(server.store_bytes)
        cached = Gauge("kvmem_cache_bytes", "Bytes held by the server's LRU caches", ["cache"], registry=r)
        cached.labels("index").set_function(lambda: server.service._indexes.currsize)
        cached.labels("store_kv").set_function(lambda: server.service.store._segments.currsize)
        hits = Gauge("kvmem_index_cache_events", "Per-user index cache hits and misses", ["event"], registry=r)
        hits.labels("hit").set_function(lambda: server.service.index_hits)
        hits.labels("miss").set_function(lambda: server.service.index_misses)
        conn = Gauge("kvmem_connector_events", "The vLLM connector's scheduler counters", ["event"], registry=r)
        self._conn, self._server = conn, server

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        path = self._server.connector_metrics_file
        if path and Path(path).exists():
            try:
                for k, v in json.loads(Path(path).read_text()).items():
                    self._conn.labels(k).set(v)
            except (OSError, ValueError):
                pass
        return generate_latest(self.registry)


# --- the server ------------------------------------------------------------------------------------------

@dataclass
class Limits:
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout_s: float = 120.0
    default_top_k: int = 10
    default_mode: str = "kv"
    default_max_tokens: int = 64


class KvmemServer:
    """What the app holds: the memory service (retrieval + composition), the Memory facade (writes), the
    engine, tenants, limits and metrics. Build with ``KvmemServer.start``; ``service.lm`` names the model."""

    def __init__(self, service, memory, engine, tenants: Tenants, limits: Limits, model_pool: ThreadPoolExecutor,
                 connector_metrics_file: str | None = None):
        self.service, self.memory, self.engine, self.tenants, self.limits = service, memory, engine, tenants, limits
        self.model_pool = model_pool  # the one thread that runs the transformers model
        self.connector_metrics_file = connector_metrics_file
        self.model_name = service.lm.name
        self.ready = True
        self.pending_writes, self.max_writes = 0, 64
        self.selective_recompute = 0  # default memory.selective_recompute (%), transformers engine only
        self.metrics = Metrics(self)
        self._store_bytes = (0.0, 0)

    @classmethod
    def start(cls, store: str | Path, model: str | None = None, engine: str = "auto", api_keys: dict | None = None,
              limits: Limits | None = None, dtype: str | None = None, cache_bytes: int = 512 << 20,
              kv_cache_memory_bytes: int = 1 << 30, max_queue: int = 64, window: int | None = None,
              vllm_options: dict | None = None, tail_recompute: int = 0,
              neighbours: int | None = None, selective_recompute: int = 0,
              history: bool | None = None) -> "KvmemServer":
        """Load the store, model, embedder and engine. ``engine``: auto | vllm | hf; ``window``, ``neighbours``,
        ``history``: how writes encode new memories (``Memory``; None: each user's recorded encoding);
        ``tail_recompute`` / ``selective_recompute``: the default ``memory`` options of chat requests. Raises
        StoreError, ModelError, EngineUnavailable (one line each); ValueError for selective recompute off the
        transformers engine or with tail recompute."""
        import os

        from .hardware import resolve_engine
        from .ingest import open_or_create_store
        from .memory import Memory
        from .models import DEFAULT_MODEL, REGISTRY, load, model_dir
        from .retrieve import Embedder
        from .serve import MemoryService, check_methods_engine, parse_mode

        os.environ["KVMEM_STORE_CACHE_BYTES"] = str(cache_bytes)  # this process and the vLLM worker's stores
        methods = [f"kv-sel{selective_recompute}"] if selective_recompute else []
        for m in methods:
            parse_mode(m, tail_recompute)  # ValueError: selective and tail recompute do not combine
        if engine == "vllm":
            check_methods_engine(methods, engine)  # refused before vLLM is probed
        engine, note = resolve_engine(engine)
        if note:
            logger.warning(note)
        check_methods_engine(methods, engine)  # auto may have resolved to vLLM
        root = Path(store)
        embedder = Embedder()
        if not (root / "manifest.json").exists():  # a new, empty store for the model
            lm = load(model or DEFAULT_MODEL, dtype=dtype)
            open_or_create_store(root, lm, embedder)[0].close()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-model")
        metrics_file = None
        if engine == "vllm":
            from .engines.vllm_engine import AsyncVLLMEngine

            svc = MemoryService(root, model, dtype=dtype, embedder=embedder, engine="hf", load_weights=False,
                                index_cache_bytes=cache_bytes)  # tokenizer + fingerprint only; vLLM has the weights
            metrics_file = str(root / f".connector-metrics-{os.getpid()}.json")
            name = svc.lm.name
            path = model_dir(name) if name in REGISTRY else name
            eng = AsyncVLLMEngine(path, dtype=str(svc.lm.dtype).removeprefix("torch."), stores=[root],
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, metrics_file=metrics_file,
                                  max_queue=max_queue, max_model_len=min(svc.max_context, 32768),
                                  **(vllm_options or {}))
            svc.vllm, svc.engine_name = eng, "vllm"
            svc.max_context = min(svc.max_context, eng.max_model_len)
            mem = Memory(root, model=name, window=window, embedder=embedder, engine=SyncJSON(eng),
                         dtype=dtype, neighbours=neighbours, history=history)  # the model loads on the first write
        else:
            from .engines.hf import AsyncHFEngine

            svc = MemoryService(root, model, dtype=dtype, embedder=embedder, engine="hf", index_cache_bytes=cache_bytes)
            # generation, composition and encoding share the one model thread
            eng = AsyncHFEngine(svc.engine, svc.max_context, max_queue=max_queue, pool=pool)
            mem = Memory(root, model=svc.lm, window=window, embedder=embedder, neighbours=neighbours,
                         history=history)
        svc.tail_recompute = tail_recompute
        srv = cls(svc, mem, eng, Tenants(api_keys or {}), limits or Limits(), pool, metrics_file)
        srv.max_writes, srv.selective_recompute = max_queue, selective_recompute
        return srv

    def store_bytes(self) -> int:
        at, n = self._store_bytes
        if time.monotonic() - at > 10:  # a directory walk, at most every 10 s
            n = self.service.store.disk_bytes()
            self._store_bytes = (time.monotonic(), n)
        return n

    def close(self) -> None:
        """Stop the engine (vLLM's engine core and worker processes) and the model thread."""
        self.ready = False
        try:
            if self.engine.name == "vllm":
                self.engine.llm.shutdown()
        finally:
            self.model_pool.shutdown(wait=False, cancel_futures=True)

    async def on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_pool, fn, *args)

    async def off_loop(self, fn, *args):
        """Blocking work that does not touch the transformers model (vLLM: retrieval) on the default pool."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class SyncJSON:
    """An async engine's ``complete_json`` for code on a worker thread (``extract.LocalExtractor``)."""

    def __init__(self, engine):
        self.engine, self.loop = engine, None

    def complete_json(self, prompt_ids, schema, max_tokens=256):
        return asyncio.run_coroutine_threadsafe(self.engine.complete_json(prompt_ids, schema, max_tokens),
                                                self.loop).result()


def _error_of(exc: Exception) -> APIError:
    """Library exceptions -> API errors (never a 500 for bad input)."""
    from .compose import ContextOverflow
    from .engines.base import EngineBusy
    from .memory import MemoryInputError
    from .store import StoreError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineBusy):
        return APIError(429, f"the engine is busy: {exc}; retry later", "engine_busy")
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), "context_length_exceeded", "messages")
    if isinstance(exc, MemoryInputError):
        msg = str(exc)
        return APIError(404 if "not found" in msg else 400, msg, "memory_not_found" if "not found" in msg else None)
    if isinstance(exc, StoreError):
        return APIError(409, f"the store changed under this request: {exc}", "write_conflict")
    if isinstance(exc, (ValueError, LookupError)):
        return APIError(400, str(exc))
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(503, "the request timed out", "timeout")
    return APIError(500, f"internal error ({type(exc).__name__})", "internal_error")


def create_app(server: KvmemServer) -> FastAPI:
    """The FastAPI app over a started ``KvmemServer``."""
    app = FastAPI(title="kvmem", version="0.1", docs_url=None, redoc_url=None)
    app.state.kvmem = server
    limits = server.limits

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") in ("json_invalid", "json_type") or tuple(e.get("loc", ())) == ("body",) for e in errs):
            return APIError(400, "the body is not a valid JSON object", "invalid_json").response()
        e = errs[0] if errs else {}
        loc = ".".join(str(x) for x in e.get("loc", ())[1:]) or None
        return APIError(422, f"{loc or 'body'}: {e.get('msg', 'invalid value')}", "invalid_value", loc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _any(request, exc: Exception):
        err = _error_of(exc)
        if err.status >= 500:
            logger.exception("unhandled error on %s", request.url.path)
        return err.response()

    @app.middleware("http")
    async def _limits_and_metrics(request: Request, call_next):
        n = request.headers.get("content-length")
        if n is not None and (not n.isdigit() or int(n) > limits.max_body_bytes):
            resp = APIError(413, f"the body exceeds {limits.max_body_bytes} bytes", "body_too_large").response()
        elif n is None and "chunked" in request.headers.get("transfer-encoding", "").lower():  # unbounded otherwise
            resp = APIError(413, "a body must come with Content-Length", "length_required").response()
        else:
            try:
                resp = await call_next(request)
            except Exception as exc:  # noqa: BLE001 - errors raised past the handlers
                err = _error_of(exc)
                if err.status >= 500 and err.code == "internal_error":
                    logger.exception("unhandled error on %s", request.url.path)
                resp = err.response()
        matched = request.scope.get("route")  # the route template, never the raw path (bounded label values)
        server.metrics.requests.labels(getattr(matched, "path", "other"), str(resp.status_code)).inc()
        return resp

    def tenant_of(request: Request) -> str | None:
        return server.tenants.tenant(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not server.ready:
            raise APIError(503, "the engine is not ready", "not_ready")
        return {"status": "ready", "engine": server.engine.name, "model": server.model_name}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvmem"}]}

    # --- memories ---------------------------------------------------------------------------------------

    def owned_fact(tenant, memory_id: str):
        from .memory import MemoryInputError

        try:
            f = server.memory.store.fact(str(memory_id))
        except LookupError as exc:
            raise MemoryInputError(str(exc)) from None
        if f is None:
            raise APIError(404, f"memory {str(memory_id)[:64]!r} not found", "memory_not_found")
        if not Tenants.owns(tenant, f.user):
            raise APIError(403, "this memory belongs to another tenant", "forbidden")
        return f

    def public_item(tenant, item: dict) -> dict:
        if "user_id" in item:
            item["user_id"] = Tenants.public(tenant, item["user_id"])
        return item

    async def write(fn, *args):
        """Writes queue on the model thread, at most ``max_queue`` at a time (then 429). A queued write is never
        timed out: a write that answered 503 must not land later (a retry would duplicate it)."""
        if server.pending_writes >= server.max_writes:
            raise APIError(429, f"{server.pending_writes} writes are queued; retry later", "writes_busy")
        server.pending_writes += 1
        try:
            return await server.on_model_thread(fn, *args)
        finally:
            server.pending_writes -= 1

    @app.post("/v1/memories")
    async def add_memories(body: AddMemoryRequest, request: Request):
        tenant = tenant_of(request)
        user = Tenants.user(tenant, body.user_id)
        if isinstance(server.memory.engine, SyncJSON):
            server.memory.engine.loop = asyncio.get_running_loop()
        return await write(lambda: server.memory.add(body.messages, user, body.metadata, body.infer, body.timestamp))

    @app.get("/v1/memories")
    async def list_memories(request: Request, user_id: str, limit: int = 100):
        tenant = tenant_of(request)
        if not 1 <= limit <= 10000:
            raise APIError(422, "limit must be between 1 and 10000", "invalid_value", "limit")
        out = await server.off_loop(server.memory.get_all, Tenants.user(tenant, user_id), limit)
        return {"results": [public_item(tenant, m) for m in out["results"]]}

    @app.post("/v1/memories/search")
    async def search_memories(body: SearchRequest, request: Request):
        tenant = tenant_of(request)
        out = await server.off_loop(server.memory.search, body.query, Tenants.user(tenant, body.user_id),
                                    body.limit, body.filters)
        return {"results": [public_item(tenant, m) for m in out["results"]]}

    @app.get("/v1/memories/{memory_id}/history")
    async def memory_history(memory_id: str, request: Request):
        tenant = tenant_of(request)
        events = await server.off_loop(server.memory.history, memory_id)
        if not all(Tenants.owns(tenant, e["user_id"]) for e in events):
            raise APIError(403, "this memory belongs to another tenant", "forbidden")
        return [public_item(tenant, e) for e in events]

    @app.get("/v1/memories/{memory_id}")
    async def get_memory(memory_id: str, request: Request):
        tenant = tenant_of(request)
        owned_fact(tenant, memory_id)
        item = server.memory.get(memory_id)
        if item is None:  # deleted between the check and the read
            raise APIError(404, f"memory {memory_id[:64]!r} not found", "memory_not_found")
        return public_item(tenant, item)

    @app.put("/v1/memories/{memory_id}")
    async def update_memory(memory_id: str, body: UpdateRequest, request: Request):
        owned_fact(tenant_of(request), memory_id)
        return await write(server.memory.update, memory_id, body.text)

    @app.delete("/v1/memories/{memory_id}")
    async def delete_memory(memory_id: str, request: Request):
        owned_fact(tenant_of(request), memory_id)
        return await write(server.memory.delete, memory_id)

    @app.delete("/v1/memories")
    async def delete_all(request: Request, user_id: str):
        tenant = tenant_of(request)
        return await write(server.memory.delete_all, Tenants.user(tenant, user_id))

    # --- chat -------------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        t_arrive = time.perf_counter()
        tenant = tenant_of(request)
        if body.model and body.model != server.model_name:
            raise APIError(404, f"model {body.model!r} not found; this server serves {server.model_name!r}",
                           "model_not_found", "model")
        if body.messages[-1].role != "user":
            raise APIError(400, "the last message must be from the user", param="messages")
        opts = body.memory or MemoryOptions()
        mode = opts.mode or limits.default_mode
        top_k = opts.top_k or limits.default_top_k
        max_tokens = body.max_completion_tokens or body.max_tokens or limits.default_max_tokens
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        svc = server.service
        user = Tenants.user(tenant, body.user) if body.user is not None else None
        if user is None and mode != "off":
            raise APIError(400, "the request's 'user' field names whose memory to use (or set memory.mode 'off')",
                           param="user")
        sel = server.selective_recompute if opts.selective_recompute is None else opts.selective_recompute
        prep = await asyncio.wait_for(_prepare(server, user, messages, top_k, mode, max_tokens, opts.tail_recompute,
                                               sel), limits.request_timeout_s)
        from .engines.base import Sampling

        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
        sampling = Sampling(max_tokens=max_tokens, temperature=body.temperature or 0.0, top_p=body.top_p or 1.0,
                            seed=body.seed, stop_token_ids=tuple(svc.stop_ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = _Generation(server, rid, prep, sampling, stops, t_arrive)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            first = await gen.first()  # errors (busy, engine) become statuses before the stream starts
            return StreamingResponse(_sse(gen, first, include_usage), media_type="text/event-stream")
        text = await _until_disconnect(request, gen.collect(), limits.request_timeout_s)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": gen.finish_reason}],
                "usage": gen.usage(), "kvmem": gen.kvmem()}

    return app


async def _until_disconnect(request: Request, coro, timeout_s: float):
    """Run ``coro`` (a non-streaming generation) unless the client goes away first: then it is cancelled, which
    closes the engine stream (vLLM aborts the request; the transformers engine stops at the next token)."""
    task = asyncio.ensure_future(coro)
    deadline = time.perf_counter() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(400, "the client disconnected", "client_disconnected")
            if time.perf_counter() > deadline:
                raise asyncio.TimeoutError
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled on purpose
                pass


@dataclass
class _Prepared:
    mode: str
    prompt_ids: list[int]
    memory: object | None  # ComposedMemory (hf) / MemoryRef (vLLM kv mode) / None
    query_len: int
    fact_ids: list[str]
    timings_ms: dict
    recompute: float = 0.0  # selective recompute fraction (hf engine, kv mode)
    header_len: int = 0


async def _prepare(server: KvmemServer, user: str | None, messages: list[dict], top_k: int, mode: str,
                   max_tokens: int, tail_recompute: int | None = None, selective_recompute: int = 0) -> _Prepared:
    """Retrieval and composition for one chat request (on the model thread for hf: composition uses its RoPE).
    ``selective_recompute`` p (kv mode): the ``kv-sel<p>`` method (``serve.parse_mode``; ValueError -> HTTP 400
    on vLLM or with tail recompute)."""
    from .compose import ContextOverflow
    from .store import StoreError

    svc = server.service
    question = messages[-1]["content"]

    def bare() -> _Prepared:
        ids = svc.fmt.conversation_ids(svc.lm.tokenizer, messages, memory=False)
        if len(ids) + max_tokens > svc.max_context:
            raise ContextOverflow(f"the conversation ({len(ids)} tokens) and answer ({max_tokens} tokens) exceed "
                                  f"the model context of {svc.max_context} tokens")
        return _Prepared("off", ids, None, len(ids), [], {})

    def run() -> _Prepared:
        if mode == "off" or not question.strip():
            return bare()
        try:
            method = f"kv-sel{selective_recompute}" if mode == "kv" and selective_recompute else mode
            p = svc.prepare(user, question, top_k, method, max_tokens, messages=messages, tail_recompute=tail_recompute)
        except StoreError as exc:
            if "unknown user" in str(exc):  # no memories yet: answer without any
                return bare()
            raise
        memory = p.ref if svc.vllm is not None else p.memory
        return _Prepared(mode, p.prompt_ids, memory, len(p.query_ids), p.fact_ids, p.timings_ms, p.recompute,
                         p.header_len)

    if svc.vllm is None:
        return await server.on_model_thread(run)
    return await server.off_loop(run)


class _Generation:
    """One engine request: deltas -> text (incremental detokenization, stop strings), counts and timings."""

    def __init__(self, server: KvmemServer, rid: str, prep: _Prepared, sampling, stops: list[str], t_arrive: float):
        self.server, self.rid, self.prep, self.stops, self.t_arrive = server, rid, prep, stops, t_arrive
        tok = server.service.lm.tokenizer
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        eng = server.engine
        memory = prep.memory if prep.mode == "kv" else None
        if eng.name == "hf":
            self._it = eng.stream(rid, prep.prompt_ids, prep.memory, sampling,
                                  mode="prompt" if prep.mode != "kv" else "kv", query_len=prep.query_len,
                                  recompute=prep.recompute, header_len=prep.header_len)
        else:
            self._it = eng.stream(rid, prep.prompt_ids, memory, sampling, query_len=prep.query_len)
        self.ids: list[int] = []
        self.text, self.sent = "", 0
        self.finish_reason, self.final, self.ttft_ms = None, None, None
        self.deadline = t_arrive + server.limits.request_timeout_s

    async def first(self):
        """The first delta (raises the engine's error, e.g. EngineBusy, before any byte is sent)."""
        try:
            return await asyncio.wait_for(self._it.__anext__(), max(0.1, self.deadline - time.perf_counter()))
        except StopAsyncIteration:
            return None

    def _take(self, delta) -> str:
        """Apply a delta; return the new text that may be sent now."""
        if self.ttft_ms is None and (delta.token_ids or delta.finished):
            self.ttft_ms = (time.perf_counter() - self.t_arrive) * 1e3
            self.server.metrics.ttft.labels(self.prep.mode).observe(self.ttft_ms / 1e3)
        self.ids += delta.token_ids
        text = self._decode(self.ids)
        if delta.finished:
            self.final, self.finish_reason = delta, ("length" if delta.finish_reason == "length" else "stop")
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                text, self.finish_reason = text[:i], "stop"
                self.final = self.final or delta
        hold = 0 if self.finish_reason else max((len(s) - 1 for s in self.stops), default=0)
        if not self.finish_reason and text.endswith("\ufffd"):
            hold = max(hold, 1)  # half a multi-byte character
        self.text = text
        ready = text[:max(self.sent, len(text) - hold)]
        new, self.sent = ready[self.sent:], len(ready)
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
                    raise asyncio.TimeoutError
                try:
                    d = await asyncio.wait_for(self._it.__anext__(), remaining)
                except StopAsyncIteration:
                    self.finish_reason = self.finish_reason or "stop"
                    break
                piece = self._take(d)
                if piece:
                    yield piece
            tail = self.text[self.sent:]
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
        if self.prep.mode == "kv" and self.prep.fact_ids and self.final.prefilled_tokens > self.prep.query_len:
            m.fallbacks.labels("prefilled_memory").inc()

    def usage(self) -> dict:
        n_prompt = len(self.prep.prompt_ids)
        cached = (self.final.prompt_tokens - self.final.prefilled_tokens) if self.final else 0
        return {"prompt_tokens": n_prompt, "completion_tokens": len(self.ids),
                "total_tokens": n_prompt + len(self.ids), "prompt_tokens_details": {"cached_tokens": max(0, cached)}}

    def kvmem(self) -> dict:
        t = dict(self.prep.timings_ms)
        t["ttft"] = self.ttft_ms
        return {"mode": self.prep.mode, "k": len(self.prep.fact_ids), "fact_ids": self.prep.fact_ids,
                "engine": self.server.engine.name, "timings_ms": {k: round(v, 3) for k, v in t.items() if v is not None}}


async def _sse(gen: _Generation, first, include_usage: bool):
    """OpenAI's chat.completion.chunk stream: a role delta, content deltas, the finish chunk (with ``kvmem``),
    an optional usage chunk, then ``[DONE]``. A mid-stream error ends the stream with an error event."""
    base = {"id": gen.rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": gen.server.model_name}

    def chunk(delta: dict, finish=None, **extra) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                                      **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for piece in gen.deltas(first):
            yield chunk({"content": piece})
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        err = _error_of(exc)
        yield "data: " + json.dumps({"error": {"message": err.message, "type": APIError.TYPES.get(err.status, "api_error"),
                                               "code": err.code}}) + "\n\n"
        return
    yield chunk({}, gen.finish_reason, kvmem=gen.kvmem())
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": gen.usage()}) + "\n\n"
    yield "data: [DONE]\n\n"


def serve(store: str | Path, host: str = "127.0.0.1", port: int = 8000, api_keys_file: str | None = None,
          log=print, **start_kwargs) -> None:
    """Start the server (blocking). Without an API keys file it binds to loopback only. Raises ValueError for a
    bad keys file or a non-loopback host without keys."""
    import uvicorn

    keys = load_api_keys(api_keys_file) if api_keys_file else None
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"refusing to bind {host} without --api-keys: without keys the server is loopback-only")
    server = KvmemServer.start(store, api_keys=keys, **start_kwargs)
    log(f"kvmem serve: {server.model_name} on the {server.engine.name} engine, store {store}, "
        f"{'tenants: ' + ', '.join(sorted(set(keys.values()))) if keys else 'no API keys: loopback only'}; "
        f"http://{host}:{port}/v1")
    import signal

    def _exit(signum, frame):  # SIGTERM (docker stop, systemd), SIGHUP: unwind so the engine processes stop too
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not interrupt the shutdown itself
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level="warning",
                                       timeout_graceful_shutdown=5))
    try:
        uv.run()  # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal: SystemExit here
    finally:
        server.close()
        log("kvmem serve: stopped")
