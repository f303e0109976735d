"""Memory as tools over the Model Context Protocol (the official ``mcp`` SDK's ``MCPServer``), with the names and
arguments of Mem0's OpenMemory MCP server, so its users switch without editing prompts:

* ``add_memories(text)``: ``Memory.add`` (``infer`` as the server is configured: ``Limits.mcp_infer``, default
  True as a REST add's default); returns the add's ``{"results": [{"id", "memory", "event"}]}``.
* ``search_memory(query)``: ``Memory.search`` (top 20 with a cosine of at least 0.1, as ``/v3/memories/search``);
  returns ``{"results": [{"id", "memory", "score", "hash", "created_at", "updated_at", ...}]}``, best first.
* ``list_memories()``: ``Memory.get_all``, oldest first, at most ``LIST_LIMIT``: ``{"results": [...]}``.
* ``delete_memories(memory_ids)``: the REST API's cascading erasure of each (all checked first: one that is not
  the caller's is a tool error and nothing is erased); returns ``{"message", "deleted", "erasure"}``.
* ``delete_all_memories()``: ``Memory.delete_all`` of the user; returns ``{"message", "erasure"}``.
* ``get_memory(memory_id)``, ``update_memory(memory_id, text)``: one memory; a new text, re-encoded.

Each result is one text content holding JSON (as OpenMemory's). Bad arguments, an unknown or foreign id, a full
write queue are tool errors (``isError`` results): the session goes on.

Who asks: no tool argument names a user. Over HTTP (``kvmem serve``, ``mount_mcp``) the tenant comes from the API
key (``Authorization: Bearer``, as for REST; none without keys) and the user from the URL: ``/mcp?user_id=alice``,
``/mcp/u/alice`` or OpenMemory's ``/mcp/<client_name>/http/alice``; a missing or bad user is an HTTP 400, a missing
or unknown key a 401, before any MCP message is read. Over stdio (``kvmem mcp``, ``run_stdio``) the user is the
command's ``--user-id``. The HTTP transport is streamable HTTP, stateless with JSON answers: every POST stands
alone, so any replica behind ``--replicas``' ingress can answer it (the ingress prefers the user's replica:
``mcp_user``).

Writes queue on the server's model thread with the REST API's writes (``memories.queued_write``); reads run off
the event loop. This module imports the SDK only inside its functions (the ``mcp`` extra; the ingress imports
``mcp_user`` without it)."""

import asyncio
import functools
import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import parse_qs

from ..extras import missing
from ..memory import Memory
from ..scopes import Scope, ScopeError, namespace_prefix, parse_key
from .runtime import KvmemServer
from .schemas import APIError, error_of

logger = logging.getLogger("kvmem.server")

MCP_PATHS = ("/mcp", "/mcp/u/{user_id}", "/mcp/{client_name}/http/{user_id}")  # where ``mount_mcp`` answers
SEARCH_TOP_K, SEARCH_THRESHOLD = 20, 0.1  # as POST /v3/memories/search
LIST_LIMIT = 1000  # list_memories returns at most this many (oldest first)
CALLER = "kvmem.mcp.caller"  # the ASGI scope key the HTTP gate leaves the caller under
INSTRUCTIONS = (
    "Long-term memory of one user. Call search_memory with the user's question before you answer; call "
    "add_memories with anything the user shares about themselves or asks you to remember."
)


@dataclass(frozen=True)
class Caller:
    """Whose memory a tool call reaches: ``tenant`` (None without API keys) and the ``user`` id."""

    tenant: str | None
    user: str

    def owns(self, store_user: str) -> bool:
        """Whether a memory of store user ``store_user`` belongs to this user (alone or with an agent or run)."""
        scope = parse_key(store_user, self.tenant)
        return scope is not None and scope.user_id == self.user


def check_user(user) -> str:
    """``user`` as a user id (``scopes.Scope``'s rules: stripped, NFC). Raises APIError 400 ``invalid_user``."""
    try:
        return Scope.of(user_id=user).user_id
    except ScopeError as exc:
        raise APIError(400, f"user_id: {exc}", "invalid_user", "user_id") from None


def mcp_user(path: str, query: bytes | str) -> str | None:
    """The user an MCP URL names (``/mcp?user_id=``, ``/mcp/u/<id>``, ``/mcp/<client>/http/<id>``), unchecked;
    None for another path or none named."""
    parts = path.rstrip("/").split("/")[1:]
    if parts[:1] != ["mcp"]:
        return None
    if len(parts) == 3 and parts[1] == "u" or len(parts) == 4 and parts[2] == "http":
        return parts[-1] or None
    q = query.decode("latin-1") if isinstance(query, bytes) else query
    return (parse_qs(q).get("user_id") or [None])[0] if len(parts) == 1 else None


class Tools:
    """What the tools run on: a ``Memory``, how reads and writes reach it, and who calls. The HTTP and stdio
    sides differ only here (``ServerTools``, ``StdioTools``)."""

    memory: Memory
    infer: bool

    async def read(self, fn, *args, **kwargs):
        raise NotImplementedError

    async def write(self, steps: list):
        """Run ``steps`` (callables) in order as one write; the last one's result."""
        raise NotImplementedError

    def caller(self, ctx) -> Caller:
        raise NotImplementedError


class ServerTools(Tools):
    """The tools inside ``kvmem serve``: the server's ``Memory``, its write queue and model thread; the caller is
    what the HTTP gate found on the request (``mount_mcp``)."""

    def __init__(self, server: KvmemServer):
        self.server, self.memory, self.infer = server, server.memory, server.limits.mcp_infer

    async def read(self, fn, *args, **kwargs):
        return await self.server.off_loop(lambda: fn(*args, **kwargs))

    async def write(self, steps: list):
        from .memories import queued_write

        self.server.attach_extraction(asyncio.get_running_loop())
        return await queued_write(self.server, steps)

    def caller(self, ctx) -> Caller:
        request = ctx.request_context.request
        who = request.scope.get(CALLER) if request is not None else None
        if who is None:  # not through the gate: never a default user
            raise APIError(400, "no user for this connection", "missing_user")
        return who


class StdioTools(Tools):
    """The tools of ``kvmem mcp``: one ``Memory`` and one user for the process; everything that touches the
    memory runs on one thread, off the event loop (the model loads at the first write)."""

    def __init__(self, memory: Memory, user: str, infer: bool = True):
        self.memory, self.infer, self.who = memory, infer, Caller(None, check_user(user))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-mcp")

    async def read(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def write(self, steps: list):
        out = None
        for step in steps:
            out = await self.read(step)
        return out

    def caller(self, ctx) -> Caller:
        return self.who


def build_server(tools: Tools):
    """The ``MCPServer`` with the memory tools over ``tools``."""
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    mcp = MCPServer("kvmem", instructions=INSTRUCTIONS, version="0.1", log_level="WARNING")
    mem = tools.memory
    reads = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    erases = ToolAnnotations(destructive_hint=True, idempotent_hint=True, open_world_hint=False)

    def tool(description: str, annotations=None):
        """Register ``fn`` as a tool whose errors are tool errors: library and API errors by their message (as the
        REST API words them), anything else as an internal error (logged)."""

        def register(fn):
            @functools.wraps(fn)
            async def run(*args, **kwargs):
                try:
                    out = await fn(*args, **kwargs)
                except ToolError:
                    raise
                except Exception as exc:
                    err = error_of(exc)
                    if err.status >= 500 and err.code == "internal_error":
                        logger.exception("MCP tool %s failed", fn.__name__)
                    raise ToolError(err.message) from None
                return json.dumps(out, ensure_ascii=False)

            mcp.add_tool(run, description=description, annotations=annotations, structured_output=False)
            return fn

        return register

    async def owned(who: Caller, memory_id: str):
        try:
            f = await tools.read(lambda: mem.store.reads.fact(memory_id, within=namespace_prefix(who.tenant)))
        except LookupError:
            f = None
        if f is None or not who.owns(f.user):  # another user's memory reads as unknown: no existence oracle
            raise ToolError(f"memory {memory_id[:64]!r} not found")
        return f

    @tool(
        "Add a new memory. Call it whenever the user tells anything about themselves, their preferences, or "
        "anything that may be useful in later conversations, and when the user asks you to remember something."
    )
    async def add_memories(text: str, ctx: Context) -> str:
        who = tools.caller(ctx)
        return await tools.write([lambda: mem.add(text, user_id=who.user, infer=tools.infer, namespace=who.tenant)])

    @tool("Search the user's memories for what is relevant to a query. Call it every time the user asks anything.",
          reads)  # fmt: skip
    async def search_memory(query: str, ctx: Context) -> str:
        who = tools.caller(ctx)
        return await tools.read(
            mem.search, query, user_id=who.user, top_k=SEARCH_TOP_K, threshold=SEARCH_THRESHOLD,
            namespace=who.tenant,
        )  # fmt: skip

    @tool("List all memories of the user, oldest first.", reads)
    async def list_memories(ctx: Context) -> str:
        who = tools.caller(ctx)
        return await tools.read(mem.get_all, user_id=who.user, top_k=LIST_LIMIT, namespace=who.tenant)

    @tool("Get one memory of the user by its id.", reads)
    async def get_memory(memory_id: str, ctx: Context) -> str:
        who = tools.caller(ctx)
        await owned(who, memory_id)
        return await tools.read(mem.get, memory_id, namespace=who.tenant)

    @tool("Replace the text of one memory of the user (by its id), keeping its id.")
    async def update_memory(memory_id: str, text: str, ctx: Context) -> str:
        who = tools.caller(ctx)
        await owned(who, memory_id)
        out = await tools.write([lambda: mem.update(memory_id, text=text, namespace=who.tenant)])
        return {**out, "id": memory_id}

    @tool(
        "Delete specific memories of the user by their ids: their text and everything computed from it is erased.",
        erases,
    )
    async def delete_memories(memory_ids: list[str], ctx: Context) -> str:
        who = tools.caller(ctx)
        ids = list(dict.fromkeys(memory_ids))
        if not ids:
            raise ToolError("memory_ids: give at least one memory id")
        for i in ids:  # every id checked before anything is erased
            await owned(who, i)
        reports: list[dict] = []
        await tools.write([lambda i=i: reports.append(mem.delete(i, namespace=who.tenant)["erasure"]) for i in ids])
        total = Counter()
        for report in reports:
            total.update(report)
        return {"message": f"Successfully deleted {len(ids)} memories", "deleted": ids, "erasure": dict(total)}

    @tool("Delete all memories of the user: their text and everything computed from it is erased.", erases)
    async def delete_all_memories(ctx: Context) -> str:
        who = tools.caller(ctx)
        out = await tools.write([lambda: mem.delete_all(user_id=who.user, namespace=who.tenant)])
        return {"message": "Successfully deleted all memories", "erasure": out["erasure"]}

    return mcp


def mount_mcp(app, server: KvmemServer) -> None:
    """Serve the memory tools at ``MCP_PATHS`` of ``app`` (``kvmem serve``'s FastAPI app): streamable HTTP,
    stateless, JSON answers. Each request passes the gate first: the API key (401) and the user on the URL (400)
    are checked before the SDK reads it. Without the ``mcp`` extra, those paths answer 404 naming it. Without API
    keys (a loopback-only server), the SDK's DNS-rebinding guard accepts loopback Host and Origin headers only."""
    from starlette.routing import Route

    methods = ["GET", "POST", "DELETE"]
    if missing("mcp"):
        absent = APIError(404, "MCP is not installed on this server: pip install 'kvmem[mcp]'", "mcp_not_installed")
        for path in MCP_PATHS:
            app.router.routes.append(Route(path, lambda scope, receive, send: absent.response()(scope, receive, send),
                                           methods=methods))  # fmt: skip
        return
    from mcp.server.transport_security import TransportSecuritySettings

    mcp = build_server(ServerTools(server))
    keyed = bool(server.tenants.keys)
    mcp.streamable_http_app(
        json_response=True,
        stateless_http=True,
        max_request_body_size=server.limits.max_body_bytes,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False) if keyed else None,
        host="0.0.0.0" if keyed else "127.0.0.1",  # loopback: the SDK's guard of loopback Host/Origin headers
    )
    gate = _Gate(server, mcp.session_manager)
    for path in MCP_PATHS:
        app.router.routes.append(Route(path, gate, methods=methods))


class _Gate:
    """The ASGI app in front of the SDK's session manager: the caller (key -> tenant, URL -> user) checked and left
    in the request's scope for the tools (``ServerTools.caller``). The manager runs in a task of the server's
    event loop, started by the first MCP request (a replica's app is called without an ASGI lifespan)."""

    def __init__(self, server: KvmemServer, manager):
        self.server, self.manager = server, manager
        self._running: asyncio.Future | None = None  # done once the manager runs

    async def __call__(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            tenant = self.server.tenants.tenant(headers.get("authorization"))
            named = {scope.get("path_params", {}).get("user_id"), mcp_user("/mcp", scope["query_string"])} - {None}
            if not named:
                raise APIError(400, "name the user on the URL: /mcp?user_id=<id> or /mcp/u/<id>", "missing_user",
                               "user_id")  # fmt: skip
            if len(named) > 1:
                raise APIError(400, "the URL names two different users", "invalid_user", "user_id")
            scope[CALLER] = Caller(tenant, check_user(named.pop()))
        except APIError as err:
            await err.response()(scope, receive, send)
            return
        await self._started()
        await self.manager.handle_request(scope, receive, send)

    async def _started(self) -> None:
        if self._running is not None:
            return await self._running
        loop = asyncio.get_running_loop()
        self._running = up = loop.create_future()

        async def run():
            try:
                async with self.manager.run():
                    up.set_result(None)
                    await asyncio.Event().wait()  # until the loop ends (cancelled)
            except BaseException as exc:
                if not up.done():
                    up.set_exception(exc)
                raise

        self._task = loop.create_task(run(), name="kvmem-mcp")  # held: a task only weakly referenced may vanish
        await up


def run_stdio(memory: Memory, user: str, infer: bool = True) -> None:
    """``kvmem mcp``: the memory tools over stdio for user ``user`` of ``memory``'s store, until stdin closes
    (the SDK points fd 1 at stderr meanwhile, so nothing else can write to the protocol)."""
    import anyio

    mcp = build_server(StdioTools(memory, user, infer))
    anyio.run(mcp.run_stdio_async)
