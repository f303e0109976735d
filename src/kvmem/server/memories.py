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

from fastapi import FastAPI, Request

from ..memory import MemoryConflict, MemoryInputError
from ..memory.importer import ImportTooLarge
from ..scopes import namespace_prefix, parse_key
from .runtime import KvmemServer
from .schemas import AddMemoryRequest, APIError, ListRequest, SearchRequest, UpdateRequest, error_responses
from .tenants import Tenants

ENTITY_TYPES = {"user": "user_id", "agent": "agent_id", "run": "run_id"}
ERRORS = error_responses(400, 401, 404, 409, 413, 422, 429, 503, 507)  # what any memories route may answer


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


def memory_routes(app: FastAPI, server: KvmemServer, tenant_of) -> None:
    def route(method: str, path: str):
        """Register ``path`` with and without a trailing slash."""

        def register(fn):
            for p in (path, path + "/"):
                app.add_api_route(p, fn, methods=[method], responses=ERRORS)
            return fn

        return register

    async def owned_fact(tenant, memory_id: str):
        try:
            within = namespace_prefix(tenant)  # another tenant's ids are not looked at
            f = await server.off_loop(lambda: server.memory.store.reads.fact(str(memory_id), within=within))
        except LookupError as exc:
            raise MemoryInputError(str(exc)) from None
        if f is None or not Tenants.owns(tenant, f.user):  # another tenant's id answers as one that never existed
            raise APIError(404, f"memory {str(memory_id)[:64]!r} not found", "memory_not_found")
        return f

    async def write(fn, *args, **kwargs):
        return await queued_write(server, [lambda: fn(*args, **kwargs)])

    def read(fn, *args, **kwargs):
        return server.off_loop(lambda: fn(*args, **kwargs))

    # --- service -------------------------------------------------------------------------------------------

    @route("GET", "/v1/ping")
    async def ping(request: Request):
        """mem0ai's client checks its key here on construction; the tenant is its organisation (one project)."""
        tenant = tenant_of(request)
        return {"status": "ok", "org_id": tenant or "kvmem", "project_id": "default", "user_email": None}

    # --- writes --------------------------------------------------------------------------------------------

    async def add(body: AddMemoryRequest, request: Request):
        tenant = tenant_of(request)
        server.attach_extraction(asyncio.get_running_loop())
        if body.prompt is not None and body.custom_instructions is not None:
            raise APIError(400, "give prompt or custom_instructions, not both", param="prompt")
        return await write(
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

    route("POST", "/v1/memories")(add)
    route("POST", "/v3/memories/add")(add)

    @route("PUT", "/v1/memories/{memory_id}")
    async def update_memory(memory_id: str, body: UpdateRequest, request: Request):
        await owned_fact(tenant_of(request), memory_id)
        given = {k: getattr(body, k) for k in body.model_fields_set}  # an explicit null expiration_date clears it
        if not given:
            raise APIError(400, "At least one of text, metadata, or expiration_date must be provided.")
        return await write(server.memory.update, memory_id, **given, namespace=tenant_of(request))

    @route("DELETE", "/v1/memories/{memory_id}")
    async def delete_memory(memory_id: str, request: Request, delete_linked: bool = False):
        # delete_linked: an update keeps its memory's id here, so no older memory is left to resurface
        await owned_fact(tenant_of(request), memory_id)
        return await write(server.memory.delete, memory_id, namespace=tenant_of(request))

    @route("DELETE", "/v1/memories")
    async def delete_all(
        request: Request, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None
    ):
        tenant = tenant_of(request)
        if "app_id" in request.query_params:
            raise APIError(400, "app_id is not supported: scope memories by user_id, agent_id or run_id")
        return await write(server.memory.delete_all, user_id, agent_id, run_id, namespace=tenant)

    @route("POST", "/v1/memories/import")
    async def import_memories(request: Request):
        """A Mem0 export (what ``get_all`` returns), as ``kvmem memory import`` takes it."""
        tenant = tenant_of(request)
        try:
            export = await request.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON", "invalid_json") from None
        try:  # every record checked before anything is written (store reads only: off the model thread)
            plan = await read(server.memory.plan_import, export, namespace=tenant)
        except ImportTooLarge as exc:
            raise APIError(413, str(exc), "too_many_records") from None
        steps = [lambda b=b: server.memory.import_batch(b) for b in plan.batches]
        await queued_write(server, steps)
        return plan.result()

    @route("DELETE", "/v2/entities/{entity_type}/{name}")
    async def delete_entity(entity_type: str, name: str, request: Request):
        tenant = tenant_of(request)
        if entity_type not in ENTITY_TYPES:
            raise APIError(400, f"entity type {entity_type!r}: one of {', '.join(ENTITY_TYPES)}")
        got = await write(server.memory.delete_all, **{ENTITY_TYPES[entity_type]: name}, namespace=tenant)
        # erasure: facts erased, turns erased, facts re-encoded (or deferred) because their KV was behind them
        return {"message": "Entity deleted successfully.", "erasure": got["erasure"]}

    # --- reads ---------------------------------------------------------------------------------------------

    async def search(body: SearchRequest, request: Request):
        tenant = tenant_of(request)
        if body.rerank:
            raise APIError(400, "rerank is not supported: kvmem ranks by cosine, or fused with keywords")
        legacy = request.url.path.startswith("/v1/")  # kvmem's own spelling: limit, default 10
        top_k = body.top_k if body.top_k is not None else ((body.limit or 10) if legacy else 20)
        return await read(
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

    route("POST", "/v1/memories/search")(search)
    route("POST", "/v3/memories/search")(search)

    @route("GET", "/v1/memories")
    async def list_memories(
        request: Request,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int = 100,
    ):
        tenant = tenant_of(request)
        if not 1 <= limit <= 10000:
            raise APIError(422, "limit must be between 1 and 10000", "invalid_value", "limit")
        ids = {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}
        return await read(server.memory.get_all, **ids, top_k=limit, namespace=tenant)

    @route("POST", "/v3/memories")
    async def list_page(body: ListRequest, request: Request, page: int = 1, page_size: int = 100):
        """mem0ai's ``get_all``: one page of the memories ``filters`` select, oldest first."""
        tenant = tenant_of(request)
        if page < 1 or not 1 <= page_size <= 1000:
            raise APIError(422, "page >= 1 and page_size in 1..1000", "invalid_value", "page")
        everything = await read(
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

    @route("GET", "/v1/memories/{memory_id}/history")
    async def memory_history(memory_id: str, request: Request):
        tenant = tenant_of(request)
        events = await read(server.memory.history, memory_id, namespace=tenant)
        if not all(Tenants.owns(tenant, e["user_id"]) for e in events):  # as an id that never existed
            raise MemoryInputError(f"memory {memory_id!r} not found")
        for e in events:  # the store's scope key -> the caller's entity ids
            scope = parse_key(e.pop("user_id"), tenant)
            e.update(scope.ids() if scope is not None else {})
        return events

    @route("GET", "/v1/memories/{memory_id}")
    async def get_memory(memory_id: str, request: Request):
        tenant = tenant_of(request)
        await owned_fact(tenant, memory_id)
        item = await read(server.memory.get, memory_id, namespace=tenant)
        if item is None:  # deleted between the check and the read
            raise APIError(404, f"memory {memory_id[:64]!r} not found", "memory_not_found")
        return item

    @route("GET", "/v1/entities")
    async def entities(request: Request):
        """Every user, agent and run with live memories in the caller's tenant (mem0ai's ``users``)."""
        tenant = tenant_of(request)
        found = await read(server.memory.entity_scopes, tenant)  # by the scope index: this tenant's scopes only
        counts: dict[tuple[str, str], int] = {}
        for s in found:
            for kind, field in ENTITY_TYPES.items():
                if s is not None and getattr(s, field) is not None:
                    counts[(kind, getattr(s, field))] = counts.get((kind, getattr(s, field)), 0) + 1
        results = [{"type": t, "name": n, "id": n, "total_memories": None} for (t, n) in sorted(counts)]
        return {"count": len(results), "next": None, "previous": None, "results": results}
