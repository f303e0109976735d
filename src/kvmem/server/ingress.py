"""The ingress of ``kvmem serve --replicas N`` (in the ``kvmem serve`` process): it reads each HTTP request,
derives its route key (``route_key``, the one rule of which replica a request prefers), and sends the chosen
replica's ASGI response back (``replicas``): an event stream as it comes, any other answer once it is whole, so a
replica lost in the middle of a JSON body is a retried read or a write's 503 ``replica_lost``, never a 200 with
half a body.

Reads and chats whose replica died before answering are retried on another replica; a write whose replica died
answers 503 ``replica_lost`` (it may or may not have landed). A replica that answers 503 ``store_unavailable``
(it cannot reach the store, or the part of it one machine is cut off from) ranks last for every user
(``replicas.UNREADY``) until its ``/ready`` answers 200 again, probed every second; the read or chat it
answered is tried once more on a replica that can serve it. Ray's queue bound per caller
(``max_queued_requests``) answers 429 instead of queueing without limit. A read or chat whose client goes away
is cancelled on its replica; a write runs to its end. ``/metrics``: the ingress's own counters (routing,
affinity, retries) and every live replica's metrics with a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from ..scopes import Scope, ScopeError, parse_key
from .mcp import mcp_user
from .replicas import LIVE, ROUTED, UNREADY, Replicas
from .routes import body_limit_error
from .runtime import store_bytes_gauge
from .schemas import APIError
from .stalls import BodyTimeout, SendTimeout

logger = logging.getLogger("kvmem.server")

PIN_HEADER = "x-kvmem-replica"  # request: try this replica first (tests, debugging); response: who answered
RETRIES = 2  # another replica, for a read or chat whose replica died before answering
UNREADY_S = 3.0  # a replica that answered 503 store_unavailable ranks last this long, renewed while /ready is 503
UNREADY_PROBE_S = 1.0  # how often such a replica's /ready is asked
IDEMPOTENT = {
    ("POST", p) for p in ("/v1/chat/completions", "/v1/memories/search", "/v3/memories/search", "/v3/memories")
}
BODY_ROUTED = ("/v1/chat/completions", "/v1/memories", "/v1/memories/search", "/v3/memories/add", "/v3/memories/search")


async def route_key(cluster: Replicas, method: str, path: str, query: bytes, headers, body: bytes) -> str | None:
    """The one rule of which replica a request prefers (``replicas.UserAffinityRouter`` hashes what this
    returns): the store user of the request's user alone in the caller's tenant (``user_key``), whatever scope
    (agent, run) it also names, so one user's chats and memories stay on one replica. The user is the chat's
    ``user``, the memories API's ``user_id`` (body, filters or query), the user of ``/v1/memories/{id}``'s
    owner, or the user an MCP URL names (``mcp.mcp_user``). None without one (the router spreads such requests).
    Only a hint: errors are the replica's."""
    try:
        tenant = cluster.tenants.tenant(headers.get("authorization"))
    except APIError:
        return None
    user = None
    path = path.rstrip("/") or "/"  # mem0ai's client spells every path with a trailing slash
    if path in BODY_ROUTED and method == "POST":
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        if isinstance(doc, dict):
            user = doc.get("user" if path == "/v1/chat/completions" else "user_id")
            if user is None and isinstance(doc.get("filters"), dict):
                user = doc["filters"].get("user_id")
    elif path == "/v1/memories":
        user = (parse_qs(query.decode("latin-1")).get("user_id") or [None])[0]
    elif path == "/mcp" or path.startswith("/mcp/"):  # the MCP tools: the user is on the URL (``mcp``)
        user = mcp_user(path, query)
    elif path.startswith("/v1/memories/"):
        owner = await cluster.owner(path.split("/")[3], tenant)
        scope = parse_key(owner, tenant) if owner is not None else None
        user = scope.user_id if scope is not None else None
    return user_key(tenant, user)


def user_key(tenant: str | None, user) -> str | None:
    """The store user of ``user`` (an id as a request gives it) alone in ``tenant``'s namespace, as chats and
    writes name it (``scopes.Scope.key``); None for no id or a bad one."""
    if not isinstance(user, str):
        return None
    try:
        return Scope.of(user_id=user).key(tenant)
    except ScopeError:
        return None


def create_ingress(cluster: Replicas) -> FastAPI:
    """The HTTP front of the replicas: every route is forwarded (``route_key``, retries, 429/503 mapping);
    ``/metrics`` adds the replicas' metrics to the ingress's own."""
    app = FastAPI(title="kvmem", version="0.1", docs_url=None, redoc_url=None, openapi_url=None)
    limits = cluster.limits
    registry = CollectorRegistry()
    requests = Counter("kvmem_ingress_requests", "Requests forwarded to replicas, by outcome", ["outcome"],
                       registry=registry)  # fmt: skip
    affinity = Gauge(
        "kvmem_affinity_requests",
        "Requests with a user by where the router sent them: the user's preferred replica, another one (the "
        "preferred was full or unknown yet), or a pinned one (X-Kvmem-Replica)",
        ["routed"],
        registry=registry,
    )
    for name in ("preferred", "fallback", "pinned"):
        affinity.labels(name).set_function(lambda n=name: ROUTED[n])
    Gauge("kvmem_affinity_hit_rate", "preferred / (preferred + fallback)", registry=registry).set_function(
        lambda: ROUTED["preferred"] / max(1, ROUTED["preferred"] + ROUTED["fallback"])
    )
    Gauge("kvmem_replicas_live", "Replicas the router routes among", registry=registry).set_function(lambda: len(LIVE))
    store_bytes_gauge(registry, cluster.store_size)  # once here for the shared store (the replicas skip it)

    watching: list[asyncio.Task] = []

    def mark_unready(rid: str) -> None:
        UNREADY[rid] = time.monotonic() + UNREADY_S
        if not watching or watching[0].done():
            watching[:] = [asyncio.ensure_future(watch_unready())]

    async def watch_unready() -> None:
        """While a replica is marked: ask its ``/ready`` every ``UNREADY_PROBE_S``; 200 clears the mark, 503
        renews it; a replica gone from the live set, or one not answering, keeps it until it expires."""
        while UNREADY:
            await asyncio.sleep(UNREADY_PROBE_S)
            for rid in list(UNREADY):
                if rid not in LIVE or UNREADY.get(rid, 0) < time.monotonic() - 60:
                    UNREADY.pop(rid, None)
                    continue
                req = {"method": "GET", "path": "/ready", "raw_path": b"/ready", "query_string": b"", "headers": [],
                       "body": b""}  # fmt: skip
                try:
                    first, gen = await asyncio.wait_for(forward(req, None, rid, retry=False), 5)
                    [c async for c in gen]
                except (APIError, TimeoutError):
                    continue
                if (PIN_HEADER.encode(), rid.encode()) in first["headers"] and first["status"] == 200:
                    UNREADY.pop(rid, None)

    async def forward(req: dict, key: str | None, pin: str | None, retry: bool):
        """The replica's first message and its stream. ``retry`` (reads and chats): a replica that died before
        answering is replaced by another, and no answer in ``--timeout`` (+10 s) is a 503. A write is never
        retried nor timed out here (it may be running: the replica's own limits apply). A 503
        ``store_unavailable`` marks its replica (``mark_unready``); a read or chat is then tried once more, on
        another replica, where one is not marked. Raises APIError."""
        rerouted = False
        for attempt in range(RETRIES + 1):
            gen = cluster.handle.remote(req, route_key=key, pin=pin)
            try:
                wait = limits.request_timeout_s + 10 if retry else None
                first = await asyncio.wait_for(gen.__anext__(), wait)
                if first["status"] != 503 and _sse(first["headers"]):
                    return first, gen
                if first["status"] != 503:
                    # a whole answer is read before its status goes out: a replica that dies mid-body makes a
                    # read retried and a write replica_lost, never a 200 with half a JSON body
                    body = await asyncio.wait_for(_joined(gen), wait)
                    return first, _Replay(body)
                body = await _drained(gen)  # an error's small JSON body
                rid = dict(first["headers"]).get(PIN_HEADER.encode(), b"").decode()
                if rid and _code(body) == "store_unavailable":
                    mark_unready(rid)
                    others = [r for r in LIVE if r != rid and UNREADY.get(r, 0) <= time.monotonic()]
                    if retry and not rerouted and others:
                        rerouted, pin = True, None
                        requests.labels("rerouted").inc()
                        continue
                return first, _Replay(body)
            except asyncio.CancelledError:  # the client went away: the replica's work stops too
                gen.cancel()
                raise
            except BackPressureError:
                requests.labels("busy").inc()
                raise APIError(429, "every replica's queue is full; retry later", "replicas_busy") from None
            except DeploymentUnavailableError:
                requests.labels("unavailable").inc()
                raise APIError(503, "no replica is running yet; nothing was applied", "not_ready") from None
            except RayActorError as exc:
                gen.cancel()
                if retry and attempt < RETRIES:
                    requests.labels("retried").inc()
                    pin = None
                    await asyncio.sleep(0.2 * (attempt + 1))  # the router drops the dead replica meanwhile
                    continue
                requests.labels("replica_lost").inc()
                what = "" if retry else "; the write may or may not have landed: read before retrying"
                raise APIError(503, f"the replica serving this request died ({type(exc).__name__}){what}",
                               "replica_lost") from None  # fmt: skip
            except RayTaskError as exc:
                logger.error("a replica failed a request: %s", exc)
                raise APIError(500, "the replica failed this request", "internal_error") from None
            except (TimeoutError, StopAsyncIteration):
                gen.cancel()
                requests.labels("timeout").inc()
                raise APIError(503, "no replica answered in time", "timeout") from None
        raise AssertionError("unreachable")

    async def rest(gen, sse: bool):
        try:
            async for chunk in gen:
                yield chunk
        except (RayActorError, RayTaskError):
            requests.labels("lost_mid_stream").inc()
            if sse:  # an explicit end, not a stream that merely stops
                err = {"error": {"message": "the replica serving this stream died", "type": "api_error",
                                 "code": "replica_lost"}}  # fmt: skip
                yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            gen.cancel()

    async def scrape(rid: str) -> str | None:
        req = {"method": "GET", "path": "/metrics", "raw_path": b"/metrics", "query_string": b"", "headers": [],
               "body": b""}  # fmt: skip
        try:
            first, gen = await asyncio.wait_for(forward(req, None, rid, retry=False), 5)
            text = b"".join([c async for c in gen]).decode()
        except (APIError, TimeoutError):
            return None
        return text if (PIN_HEADER.encode(), rid.encode()) in first["headers"] else None  # not a stand-in

    @app.get("/metrics")
    async def metrics():
        ids = list(LIVE)
        texts = await asyncio.gather(*(scrape(rid) for rid in ids))
        merged = _merged({rid: t for rid, t in zip(ids, texts, strict=True) if t is not None})
        return Response(generate_latest(registry) + merged, media_type=CONTENT_TYPE_LATEST)

    async def disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def proxy(request: Request):
        too_big = body_limit_error(request.headers, limits.max_body_bytes)
        if too_big is not None:
            return too_big.response()
        body = await request.body()
        scope = request.scope
        path, method = scope["path"], request.method
        key = await route_key(cluster, method, path, scope["query_string"], request.headers, body)
        req = {
            "method": method,
            "path": path,
            "raw_path": scope.get("raw_path") or path.encode(),
            "query_string": scope["query_string"],
            "headers": list(scope["headers"]),
            "body": body,
            "client": tuple(scope["client"]) if scope.get("client") else None,
        }
        retry = method in ("GET", "HEAD") or (method, path.rstrip("/")) in IDEMPOTENT
        call = asyncio.ensure_future(forward(req, key, request.headers.get(PIN_HEADER), retry))
        if retry:  # a read or chat stops when its client goes; a write runs to its end
            gone = asyncio.ensure_future(disconnected(request))
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not call.done():
                call.cancel()
                return APIError(400, "the client disconnected", "client_disconnected").response()
        try:
            first, gen = await call
        except APIError as err:
            resp = err.response()
            if err.status == 429:
                resp.headers["retry-after"] = "1"
            return resp
        requests.labels("ok").inc()
        raw = [(k, v) for k, v in first["headers"] if k.lower() != b"content-length"]
        resp = StreamingResponse(rest(gen, _sse(raw)), status_code=first["status"])
        resp.raw_headers = raw  # the replica's headers as sent (duplicates kept)
        return resp

    # a client that stops reading: its stream is cancelled on its replica too (``stalls``)
    stalls = Counter("kvmem_send_timeouts", "Requests cut off because their client stopped reading for --send-timeout",
                     registry=registry)  # fmt: skip
    app.add_middleware(BodyTimeout, timeout_s=lambda: limits.body_timeout_s)  # a trickled body: 408
    app.add_middleware(SendTimeout, timeout_s=lambda: limits.send_timeout_s, on_stall=stalls.inc)
    return app


def _sse(headers) -> bool:
    """Whether a replica's answer (its raw headers) is a server-sent event stream."""
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


async def _joined(gen) -> bytes:
    """The rest of a replica's answer; raises what its generator raises (a replica lost mid-body)."""
    return b"".join([c async for c in gen])


async def _drained(gen) -> bytes:
    """The rest of a replica's answer (an error body), or b"" when its replica died meanwhile."""
    try:
        return b"".join([c async for c in gen])
    except (RayActorError, RayTaskError):
        return b""
    finally:
        gen.cancel()


def _code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-shaped error body, or None."""
    try:
        return (json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


class _Replay:
    """A replica's answer already read (``forward``), streamed again as its generator would."""

    def __init__(self, body: bytes):
        self.body = body

    async def __aiter__(self):
        if self.body:
            yield self.body

    def cancel(self) -> None:
        pass


def _merged(texts: dict[str, str]) -> bytes:
    """The replicas' Prometheus texts as one exposition: each family once, every sample with
    ``replica="<id>"``."""
    families: dict[str, tuple] = {}
    for rid, text in texts.items():
        for fam in text_string_to_metric_families(text):
            head, samples = families.setdefault(fam.name, ((fam.documentation, fam.type), []))
            samples += [(s.name, {**s.labels, "replica": rid}, s.value) for s in fam.samples]
    lines = []
    for name, ((doc, kind), samples) in families.items():
        name = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes a counter
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for sample, labels, value in samples:
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample}{{{body}}} {value}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
