"""``/ui``: the memory inspector, server-rendered pages over the same tenants, ``Memory`` facade and chat
pipeline the REST API uses (``memories``, ``streaming``), mounted in ``kvmem serve``'s app (``routes``), so the
Ray ingress, which forwards every path to a replica, serves it too.

Pages: sign in and out (``session``); the tenant's users (``Store.user_page``: memory counts, KV bytes, last
activity; search and paging); a user's memories (text, scopes, metadata, times, KV format and bytes, provenance
linking to the turns and facts); one memory with its history; a scope's stored turns; search with its score
details and the facts a chat at k would inject; delete with a preview, then the erasure report; delete-all with
a typed confirmation; Ask, one question answered in kv and in prompt mode side by side.

Templates are Jinja2 with autoescape (memory text is always text); the only script and style are the package's
own files under ``/ui/static`` (``SECURITY_HEADERS``' Content-Security-Policy allows nothing inline). Every POST
checks the session's CSRF token. Errors are pages with their 4xx status, never a traceback.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from ...memory import MemoryInputError
from ...policy import Method
from ...scopes import Scope, ScopeError, namespace_prefix, parse_key
from ...store import StoreError, StoreUnavailable, redact_text
from ..memories import queued_write
from ..runtime import KvmemServer
from ..schemas import APIError
from ..streaming import ChatGeneration, watched
from .data import KvSize, erasure_preview, human_bytes, metadata_text, provenance
from .session import COOKIE, LOGIN_COOKIE, MAX_AGE_S, SECURITY_HEADERS, Session, Sessions, check_csrf

HERE = Path(__file__).parent
USERS_PAGE = 50  # users per page
MEMORIES_PAGE = 50  # memories per page
MAX_K = 50  # search and Ask: at most this many facts


class Problem(Exception):
    """A page's 4xx: shown as the error page with this status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _when(t) -> str:
    if t in (None, ""):
        return ""
    if isinstance(t, str):
        return t.replace("T", " ")[:19]
    return datetime.fromtimestamp(float(t), UTC).strftime("%Y-%m-%d %H:%M:%S")


def mount_ui(app: FastAPI, server: KvmemServer) -> None:
    """Add ``/ui`` and ``/ui/static`` to ``app``."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescape on for .html
    templates.env.filters.update(when=_when, size=human_bytes, q=lambda s: quote(str(s), safe=""))
    sessions = Sessions(server.tenants.keys)
    keyed = bool(server.tenants.keys)
    memory = server.memory
    store = memory.store
    kv: list[KvSize] = []

    def kv_size() -> KvSize:
        if not kv:
            kv.append(KvSize.of(store))
        return kv[0]

    app.mount("/ui/static", StaticFiles(directory=str(HERE / "static")), name="ui-static")

    @app.middleware("http")
    async def _headers(request: Request, call_next):
        resp = await call_next(request)
        if request.url.path == "/ui" or request.url.path.startswith("/ui/"):
            for k, v in SECURITY_HEADERS.items():
                resp.headers.setdefault(k, v)
        return resp

    def render(request: Request, name: str, session: Session | None, status: int = 200, **ctx) -> HTMLResponse:
        ctx.update(session=session, tenant=session.tenant if session else None, keyed=keyed)
        return templates.TemplateResponse(request, name, ctx, status_code=status)

    def page(fn):
        """A signed-in page: the session (else a redirect to sign in), and a ``Problem``, a bad input or a
        missing memory as the error page with its status."""

        async def handler(request: Request):
            session = sessions.read(request.cookies.get(COOKIE))
            if session is None:
                return RedirectResponse("/ui/login", 303)
            try:
                if request.method == "POST":
                    form = await request.form()
                    if not check_csrf(session, form.get("csrf")):
                        raise Problem(403, "this form is not from this session (CSRF token missing or wrong)")
                    return await fn(request, session, form)
                return await fn(request, session)
            except Problem as exc:
                return render(request, "error.html", session, exc.status, message=exc.message)
            except APIError as exc:
                return render(request, "error.html", session, exc.status, message=exc.message)
            except StoreUnavailable as exc:  # the database did not answer: try again, as the REST API's 503 says
                return render(request, "error.html", session, 503, message=redact_text(str(exc)))
            except (MemoryInputError, ScopeError, ValueError, StoreError) as exc:
                return render(request, "error.html", session, 400, message=str(exc))

        handler.__name__ = fn.__name__
        return handler

    def get(path: str, fn) -> None:
        app.add_api_route(path, page(fn), methods=["GET"], include_in_schema=False)

    def post(path: str, fn) -> None:
        app.add_api_route(path, page(fn), methods=["POST"], include_in_schema=False)

    def number(request: Request, name: str, default: int, lo: int, hi: int) -> int:
        raw = request.query_params.get(name)
        if raw in (None, ""):
            return default
        if not raw.isdigit() or not lo <= int(raw) <= hi:
            raise Problem(400, f"{name} must be a whole number from {lo} to {hi}")
        return int(raw)

    def scope_of(user_id: str, agent_id=None, run_id=None) -> Scope:
        try:
            return Scope.of(user_id, agent_id or None, run_id or None)
        except ScopeError as exc:
            raise Problem(400, str(exc)) from None

    async def owned(session: Session, memory_id: str):
        """The live memory ``memory_id`` of the session's tenant, else 404 (another tenant's id alike)."""
        prefix = namespace_prefix(session.tenant)
        try:
            f = await server.off_loop(lambda: store.reads.fact(memory_id, within=prefix))
        except LookupError as exc:
            raise Problem(400, str(exc)) from None
        if f is None:
            raise Problem(404, f"memory {memory_id[:64]!r} not found")
        return f

    # --- signing in and out ----------------------------------------------------------------------------------

    @app.get("/ui", include_in_schema=False)
    async def home(request: Request):
        signed_in = sessions.read(request.cookies.get(COOKIE)) is not None
        return RedirectResponse("/ui/users" if signed_in else "/ui/login", 303)

    def login_page(request: Request, status: int = 200, message: str | None = None) -> HTMLResponse:
        token, cookie = sessions.login_token()
        resp = render(request, "login.html", None, status, csrf=token, message=message)
        resp.set_cookie(LOGIN_COOKIE, cookie, max_age=3600, path="/ui", httponly=True, samesite="strict")
        return resp

    @app.get("/ui/login", include_in_schema=False)
    async def login_form(request: Request):
        return login_page(request)

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request):
        form = await request.form()
        if not sessions.login_ok(request.cookies.get(LOGIN_COOKIE), form.get("csrf")):
            return login_page(request, 403, "The sign-in form expired or is not from this server; try again.")
        tenant = None
        if keyed:
            try:
                tenant = server.tenants.tenant(f"Bearer {form.get('api_key') or ''}")
            except APIError:
                return login_page(request, 401, "That API key is not valid here.")
        _, cookie = sessions.issue(tenant)
        resp = RedirectResponse("/ui/users", 303)
        resp.set_cookie(COOKIE, cookie, max_age=MAX_AGE_S, path="/ui", httponly=True, samesite="strict")
        resp.delete_cookie(LOGIN_COOKIE, path="/ui")
        return resp

    async def logout(request: Request, session: Session, form):
        sessions.revoke(session)
        resp = RedirectResponse("/ui/login", 303)
        resp.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
        return resp

    post("/ui/logout", logout)

    # --- users ---------------------------------------------------------------------------------------------

    async def users(request: Request, session: Session):
        q = request.query_params.get("q", "").strip()[:128]
        n = number(request, "page", 1, 1, 1 << 31)
        prefix = namespace_prefix(session.tenant) or ""
        got = await server.off_loop(lambda: store.reads.user_page(prefix, q, (n - 1) * USERS_PAGE, USERS_PAGE))
        if got is None:  # a store made before the scope index: list its users (every scope key) instead
            found = await server.off_loop(lambda: memory.entity_scopes(session.tenant))
            ids = sorted({s.user_id for s in found if s is not None and s.user_id and q.lower() in s.user_id.lower()})
            heads = [prefix + u for u in ids]
            got = (len(heads), [(h, None, None, None) for h in heads[(n - 1) * USERS_PAGE : n * USERS_PAGE]])
        total, rows = got
        size = kv_size()
        shown = [
            {
                "user_id": h[len(prefix) :],
                "memories": facts,
                "kv_bytes": None if tokens is None else size.nbytes(tokens, facts),
                "last": last,
            }
            for h, facts, tokens, last in rows
        ]
        pages = max(1, math.ceil(total / USERS_PAGE))
        return render(request, "users.html", session, users=shown, total=total, q=q, page=n, pages=pages)

    get("/ui/users", users)

    async def user_memories(request: Request, session: Session):
        user_id = request.path_params["user_id"]
        scope_of(user_id)
        n = number(request, "page", 1, 1, 1 << 31)
        offset = (n - 1) * MEMORIES_PAGE
        total, shown = await server.off_loop(
            lambda: memory.page(user_id, offset=offset, limit=MEMORIES_PAGE, namespace=session.tenant)
        )
        pages = max(1, math.ceil(total / MEMORIES_PAGE))
        prefix = namespace_prefix(session.tenant)
        size = kv_size()

        def records():
            return {i["id"]: store.reads.fact(i["id"], within=prefix) for i in shown}

        facts = await server.off_loop(records)
        rows = []
        for item in shown:
            f = facts.get(item["id"])
            if f is None:  # deleted since
                continue
            rows.append(
                {
                    "item": item,
                    "tokens": f.num_tokens,
                    "kv_bytes": size.nbytes(f.num_tokens, 1),
                    "prov": provenance(f),
                    "meta": metadata_text(f),
                }
            )
        return render(
            request, "user.html", session, user_id=user_id, rows=rows, total=total, page=n, pages=pages,
            kv_format=size.fmt,
        )  # fmt: skip

    get("/ui/users/{user_id}", user_memories)

    async def turns(request: Request, session: Session):
        user_id = request.path_params["user_id"]
        qp = request.query_params
        scope = scope_of(user_id, qp.get("agent_id"), qp.get("run_id"))
        got = await server.off_loop(lambda: store.reads.turns(scope.key(session.tenant)))
        return render(request, "turns.html", session, user_id=user_id, scope=scope.ids(), turns=got)

    get("/ui/users/{user_id}/turns", turns)

    # --- one memory ----------------------------------------------------------------------------------------

    async def memory_page(request: Request, session: Session):
        """A live memory with its history, or the history alone of an erased one (its text shown as erased)."""
        memory_id = request.path_params["memory_id"]
        try:
            f = await owned(session, memory_id)
        except Problem as exc:
            if exc.status != 404:
                raise
            f = None
        try:
            events = await server.off_loop(lambda: memory.history(memory_id, namespace=session.tenant))
        except MemoryInputError:  # never existed in this tenant
            raise Problem(404, f"memory {memory_id[:64]!r} not found") from None
        if f is None:
            scope = parse_key(events[0]["user_id"], session.tenant) if events else None
            return render(request, "memory.html", session, f=None, memory_id=memory_id, history=events,
                          scope=scope.ids() if scope else {})  # fmt: skip
        scope = parse_key(f.user, session.tenant)
        size = kv_size()
        return render(
            request, "memory.html", session, f=f, memory_id=memory_id, history=events,
            scope=scope.ids() if scope else {}, prov=provenance(f), meta=metadata_text(f),
            kv_bytes=size.nbytes(f.num_tokens, 1), kv_format=size.fmt,
        )  # fmt: skip

    get("/ui/memories/{memory_id}", memory_page)

    async def delete_preview(request: Request, session: Session):
        f = await owned(session, request.path_params["memory_id"])
        plan = await server.off_loop(lambda: erasure_preview(store, f))
        scope = parse_key(f.user, session.tenant)
        return render(request, "delete.html", session, f=f, plan=plan, scope=scope.ids() if scope else {})

    get("/ui/memories/{memory_id}/delete", delete_preview)

    async def delete(request: Request, session: Session, form):
        f = await owned(session, request.path_params["memory_id"])
        scope = parse_key(f.user, session.tenant)
        got = await queued_write(server, [lambda: memory.delete(f.fact_id, namespace=session.tenant)])
        return render(
            request, "report.html", session, what=f"memory {f.fact_id}", erasure=got["erasure"],
            user_id=scope.user_id if scope else None, memory_id=f.fact_id,
        )  # fmt: skip

    post("/ui/memories/{memory_id}/delete", delete)

    async def delete_all_form(request: Request, session: Session):
        user_id = request.path_params["user_id"]
        scope_of(user_id)
        count, _ = await server.off_loop(lambda: memory.page(user_id, limit=0, namespace=session.tenant))
        return render(request, "delete_all.html", session, user_id=user_id, count=count)

    get("/ui/users/{user_id}/delete", delete_all_form)

    async def delete_all(request: Request, session: Session, form):
        user_id = request.path_params["user_id"]
        scope_of(user_id)
        if form.get("confirm") != user_id:
            raise Problem(400, f"type the user id {user_id!r} exactly to confirm; nothing was deleted")
        got = await queued_write(server, [lambda: memory.delete_all(user_id=user_id, namespace=session.tenant)])
        return render(request, "report.html", session, what=f"every memory of user {user_id}", erasure=got["erasure"])

    post("/ui/users/{user_id}/delete", delete_all)

    # --- search and Ask ------------------------------------------------------------------------------------

    def chat_users(session: Session, user_id: str) -> list[str]:
        """The store users a chat naming ``user_id`` injects from (its scope alone: ``Scope.subscopes``)."""
        return [s.key(session.tenant) for s in scope_of(user_id).subscopes()]

    async def search(request: Request, session: Session):
        qp = request.query_params
        user_id, q = qp.get("user_id", "").strip(), qp.get("q", "").strip()
        k = number(request, "k", server.limits.default_top_k, 1, MAX_K)
        results, injected = None, []
        if user_id and q:
            scope_of(user_id)
            got = await server.off_loop(
                lambda: memory.search(q, user_id=user_id, top_k=k, explain=True, namespace=session.tenant)
            )
            results = got["results"]

            def would_inject():
                try:
                    return server.service.plan(chat_users(session, user_id), q, k, "prompt").fact_ids
                except StoreError:  # no memories in the chat's scope
                    return []

            ids = await server.off_loop(would_inject)
            texts = {r["id"]: r["memory"] for r in results}
            prefix = namespace_prefix(session.tenant)
            missing = [i for i in ids if i not in texts]
            if missing:
                found = await server.off_loop(lambda: {i: store.reads.fact(i, within=prefix) for i in missing})
                texts.update({i: f.text for i, f in found.items() if f is not None})
            injected = [{"id": i, "memory": texts.get(i, "")} for i in ids]
        return render(request, "search.html", session, user_id=user_id, q=q, k=k, results=results, injected=injected)

    get("/ui/search", search)

    async def ask_form(request: Request, session: Session):
        qp = request.query_params
        k = number(request, "k", server.limits.default_top_k, 1, MAX_K)
        return render(request, "ask.html", session, user_id=qp.get("user_id", ""), q="", k=k, answers=None)

    get("/ui/ask", ask_form)

    async def answer(session: Session, user_id: str, q: str, k: int, mode: str) -> dict:
        """One chat through the service's pipeline (as ``/v1/chat/completions`` runs it): the answer, TTFT,
        tokens prefilled and the injected facts."""
        limits = server.limits
        t0 = time.perf_counter()
        method = Method.of(mode, None, server.selective_recompute)
        messages = [{"role": "user", "content": q}]
        max_tokens = min(limits.default_max_tokens, limits.max_tokens)
        prep = await asyncio.wait_for(
            server.service.prepare_chat(
                chat_users(session, user_id), messages, k, method, max_tokens, run=server.off_loop,
                sampling={"temperature": 0.0, "top_p": 1.0},
            ),
            limits.request_timeout_s,
        )  # fmt: skip
        gen = ChatGeneration(server, f"ui-{uuid.uuid4().hex}", prep, [], t0)
        text = await watched(server, gen.collect(), limits.request_timeout_s)
        info = gen.kvmem()
        prefix = namespace_prefix(session.tenant)
        found = await server.off_loop(lambda: [store.reads.fact(i, within=prefix) for i in info["fact_ids"]])
        final = gen.final
        return {
            "mode": info["mode"],
            "text": text,
            "ttft_ms": gen.ttft_ms,
            "prompt_tokens": len(prep.prompt_ids),
            "prefilled": final.prefilled_tokens if final is not None else None,
            "facts": [{"id": i, "memory": f.text if f else ""} for i, f in zip(info["fact_ids"], found)],
            "timings": info["timings_ms"],
        }

    async def ask(request: Request, session: Session, form):
        user_id, q = str(form.get("user_id", "")).strip(), str(form.get("q", "")).strip()
        raw_k = str(form.get("k", server.limits.default_top_k))
        if not raw_k.isdigit() or not 1 <= int(raw_k) <= MAX_K:
            raise Problem(400, f"k must be a whole number from 1 to {MAX_K}")
        if not user_id or not q:
            raise Problem(400, "give a user id and a question")
        scope_of(user_id)
        k = int(raw_k)
        answers = [await answer(session, user_id, q, k, mode) for mode in ("kv", "prompt")]
        return render(request, "ask.html", session, user_id=user_id, q=q, k=k, answers=answers)

    post("/ui/ask", ask)

    @app.get("/ui/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)
