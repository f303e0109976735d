"""The memories REST API, scoped to the caller's tenant, in two spellings of Mem0's platform:

* kvmem's own (``/v1/memories``, ``/v1/memories/search``, ...), as before;
* the paths mem0ai 2.2.1's ``MemoryClient`` / ``AsyncMemoryClient`` call: ``GET /v1/ping/``, ``POST
  /v3/memories/add/``, ``POST /v3/memories/search/``, ``POST /v3/memories/`` (paginated), ``GET|PUT|DELETE
  /v1/memories/{id}/``, ``GET /v1/memories/{id}/history/``, ``DELETE /v1/memories/``, ``GET /v1/entities/`` and
  ``DELETE /v2/entities/{type}/{name}/`` (the client's ``users``, ``delete_users`` and ``reset``).

Every path answers with and without its trailing slash (the client's httpx does not follow redirects). Each
call maps to one ``Memory`` method with the tenant as its namespace; writes queue on the model thread (an import
one batch at a time, so chats run between its batches). A write that lost a race with another writer of the same
memory answers 409 ``memory_conflict`` (``MemoryConflict``); an import over ``MAX_IMPORT_RECORDS`` records 413."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from ..memory import MemoryConflict, MemoryInputError
from ..memory.importer import ImportTooLarge
from ..scopes import namespace_prefix, parse_key
from . import responses as out
from .runtime import KvmemServer, server_of, tenant_of
from .schemas import AddMemoryRequest, APIError, ListRequest, SearchRequest, UpdateRequest, error_responses
from .tenants import Tenants

ENTITY_TYPES = {"user": "user_id", "agent": "agent_id", "run": "run_id"}
EntityType = Literal["user", "agent", "run"]
Id = Annotated[str | None, Query(min_length=1)]  # an entity id in a query: an empty one is a 400
ERRORS = error_responses(400, 401, 404, 409, 413, 422, 429, 503, 507)  # what any memories route may answer
router = APIRouter()


async def queued_write(server: KvmemServer, steps) -> object:
    """Run ``steps`` (callables) in order on the model thread as one write holding one place in the write queue:
    at most ``max_writes`` writes are queued (then 429 ``writes_busy``); each step is its own task there, so chats
    queued meanwhile run between an import's batches. Returns the last step's result. A queued write is never
    timed out: a write that answered 503 must not land later (a retry would duplicate it). 409 for a lost race.
    The REST memories API and the MCP tools (``mcp``) write through here."""
    server.start_upkeep(asyncio.get_running_loop())
    if server.pending_writes >= server.max_writes:
        raise APIError(429, f"{server.pending_writes} writes are queued; retry later", "writes_busy")
    server.pending_writes += 1
    try:
        out = None
        for step in steps:
            out = await server.on_model_thread(step)
        return out
    except MemoryConflict as exc:
        raise APIError(409, str(exc), "memory_conflict") from None
    finally:
        server.pending_writes -= 1


def route(method: str, *paths: str, model=None):
    """Register the decorated function on ``router`` at each of ``paths``, with and without a trailing slash;
    ``model``: its 200's schema (``responses``)."""

    def register(fn):
        for path in paths:
            for p in (path, path + "/"):
                router.add_api_route(
                    p, fn, methods=[method], responses=ERRORS, response_model=model, response_model_exclude_unset=True
                )
        return fn

    return register


async def owned_fact(server: KvmemServer, tenant, memory_id: str):
    """The memory ``memory_id`` of ``tenant``; APIError 404 for one that does not exist or is another tenant's."""
    try:
        within = namespace_prefix(tenant)  # another tenant's ids are not looked at
        f = await server.off_loop(lambda: server.memory.store.reads.fact(str(memory_id), within=within))
    except LookupError as exc:
        raise MemoryInputError(str(exc)) from None
    if f is None or not Tenants.owns(tenant, f.user):  # another tenant's id answers as one that never existed
        raise APIError(404, f"memory {str(memory_id)[:64]!r} not found", "memory_not_found")
    return f


async def write(server: KvmemServer, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as one queued write (``queued_write``)."""
    return await queued_write(server, [lambda: fn(*args, **kwargs)])


def read(server: KvmemServer, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` off the event loop (an awaitable)."""
    return server.off_loop(lambda: fn(*args, **kwargs))


# --- service ---------------------------------------------------------------------------------------------


@route("GET", "/v1/ping", model=out.Ping)
async def ping(request: Request):
    """mem0ai's client checks its key here on construction; the tenant is its organisation (one project)."""
    tenant = tenant_of(request)
    return {"status": "ok", "org_id": tenant or "kvmem", "project_id": "default", "user_email": None}


# --- writes ----------------------------------------------------------------------------------------------


@route("POST", "/v1/memories", "/v3/memories/add", model=out.Added)
async def add(body: AddMemoryRequest, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    server.attach_extraction(asyncio.get_running_loop())
    return await write(
        server,
        server.memory.add,
        body.messages,
        **body.scope_ids(),
        metadata=body.metadata,
        infer=body.infer,
        timestamp=body.timestamp,
        expiration_date=body.expiration_date,
        prompt=body.prompt or body.custom_instructions,
        namespace=tenant,
    )


@route("PUT", "/v1/memories/{memory_id}", model=out.Message)
async def update_memory(memory_id: str, body: UpdateRequest, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    await owned_fact(server, tenant, memory_id)
    given = {k: getattr(body, k) for k in body.model_fields_set}  # an explicit null expiration_date clears it
    return await write(server, server.memory.update, memory_id, **given, namespace=tenant)


@route("DELETE", "/v1/memories/{memory_id}", model=out.Message)
async def delete_memory(memory_id: str, request: Request, delete_linked: bool = False):
    # delete_linked: an update keeps its memory's id here, so no older memory is left to resurface
    server, tenant = server_of(request), tenant_of(request)
    await owned_fact(server, tenant, memory_id)
    return await write(server, server.memory.delete, memory_id, namespace=tenant)


@route("DELETE", "/v1/memories", model=out.Message)
async def delete_all(request: Request, user_id: Id = None, agent_id: Id = None, run_id: Id = None):
    server, tenant = server_of(request), tenant_of(request)
    if "app_id" in request.query_params:
        raise APIError(400, "app_id is not supported: scope memories by user_id, agent_id or run_id")
    return await write(server, server.memory.delete_all, user_id, agent_id, run_id, namespace=tenant)


@route("POST", "/v1/memories/import", model=out.Imported)
async def import_memories(request: Request):
    """A Mem0 export (what ``get_all`` returns), as ``kvmem memory import`` takes it."""
    server, tenant = server_of(request), tenant_of(request)
    try:
        export = await request.json()
    except ValueError:
        raise APIError(400, "the body is not valid JSON", "invalid_json") from None
    try:  # every record checked before anything is written (store reads only: off the model thread)
        plan = await read(server, server.memory.plan_import, export, namespace=tenant)
    except ImportTooLarge as exc:
        raise APIError(413, str(exc), "too_many_records") from None
    steps = [lambda b=b: server.memory.import_batch(b) for b in plan.batches]
    await queued_write(server, steps)
    return plan.result()


@route("DELETE", "/v2/entities/{entity_type}/{name}", model=out.Message)
async def delete_entity(entity_type: EntityType, name: str, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    got = await write(server, server.memory.delete_all, **{ENTITY_TYPES[entity_type]: name}, namespace=tenant)
    # erasure: facts erased, turns erased, facts re-encoded (or deferred) because their KV was behind them
    return {"message": "Entity deleted successfully.", "erasure": got["erasure"]}


# --- reads -----------------------------------------------------------------------------------------------


@route("POST", "/v1/memories/search", "/v3/memories/search", model=out.Results)
async def search(body: SearchRequest, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    legacy = request.url.path.startswith("/v1/")  # kvmem's own spelling: limit, default 10
    top_k = body.top_k if body.top_k is not None else ((body.limit or 10) if legacy else 20)
    return await read(
        server,
        server.memory.search,
        body.query,
        filters=body.filters,
        **{k: v for k, v in body.ids().items() if v is not None},
        top_k=top_k,
        threshold=body.threshold if body.threshold is not None else 0.1,
        show_expired=body.show_expired,
        namespace=tenant,
        explain=body.explain,
        keyword_search=body.keyword_search,
    )


@route("GET", "/v1/memories", model=out.Results)
async def list_memories(
    request: Request,
    user_id: Id = None,
    agent_id: Id = None,
    run_id: Id = None,
    limit: int = Query(100, ge=1, le=10000),
):
    server, tenant = server_of(request), tenant_of(request)
    ids = {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}
    return await read(server, server.memory.get_all, **ids, top_k=limit, namespace=tenant)


@route("POST", "/v3/memories", model=out.Page)
async def list_page(
    body: ListRequest, request: Request, page: int = Query(1, ge=1), page_size: int = Query(100, ge=1, le=1000)
):
    """mem0ai's ``get_all``: one page of the memories ``filters`` select, oldest first."""
    server, tenant = server_of(request), tenant_of(request)
    everything = await read(
        server,
        server.memory.get_all,
        filters=body.filters,
        **{k: v for k, v in body.ids().items() if v is not None},
        top_k=1 << 30,
        show_expired=body.show_expired,
        namespace=tenant,
    )
    items = everything["results"]
    pages = max(1, math.ceil(len(items) / page_size))
    base = str(request.url.remove_query_params(["page", "page_size"]))
    link = lambda n: f"{base}?page={n}&page_size={page_size}" if 1 <= n <= pages else None
    return {
        "count": len(items),
        "next": link(page + 1),
        "previous": link(page - 1) if page <= pages else None,
        "results": items[(page - 1) * page_size : page * page_size],
    }


@route("GET", "/v1/memories/{memory_id}/history", model=list[out.HistoryRow])
async def memory_history(memory_id: str, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    events = await read(server, server.memory.history, memory_id, namespace=tenant)
    if not all(Tenants.owns(tenant, e["user_id"]) for e in events):  # as an id that never existed
        raise MemoryInputError(f"memory {memory_id!r} not found")
    for e in events:  # the store's scope key -> the caller's entity ids
        scope = parse_key(e.pop("user_id"), tenant)
        e.update(scope.ids() if scope is not None else {})
    return events


@route("GET", "/v1/memories/{memory_id}", model=out.MemoryItem)
async def get_memory(memory_id: str, request: Request):
    server, tenant = server_of(request), tenant_of(request)
    await owned_fact(server, tenant, memory_id)
    item = await read(server, server.memory.get, memory_id, namespace=tenant)
    if item is None:  # deleted between the check and the read
        raise APIError(404, f"memory {memory_id[:64]!r} not found", "memory_not_found")
    return item


@route("GET", "/v1/entities", model=out.EntityPage)
async def entities(request: Request):
    """Every user, agent and run with live memories in the caller's tenant (mem0ai's ``users``)."""
    server, tenant = server_of(request), tenant_of(request)
    found = await read(server, server.memory.entity_scopes, tenant)  # by the scope index: this tenant's only
    counts: dict[tuple[str, str], int] = {}
    for s in found:
        for kind, field in ENTITY_TYPES.items():
            if s is not None and getattr(s, field) is not None:
                counts[(kind, getattr(s, field))] = counts.get((kind, getattr(s, field)), 0) + 1
    results = [{"type": t, "name": n, "id": n, "total_memories": None} for (t, n) in sorted(counts)]
    return {"count": len(results), "next": None, "previous": None, "results": results}
