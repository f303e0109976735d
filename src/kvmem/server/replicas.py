"""``kvmem serve --replicas N``: N serving replicas on Ray Serve behind one ingress, each user's requests routed
to the replica that holds their memory warm (paper §7, "route each request to where a user's memory resides").

* **Replicas** (``Replica``, a Ray Serve deployment): each is a whole ``KvmemServer`` (its own engine, index
  cache and segment caches) running the same FastAPI app as the single-process server, so chat, the memories
  REST API, tenants, errors and limits are the same code. Every replica opens the one shared store: versions are
  checked against it on every request, so any replica serves any user correctly; a write is durable in the store
  before it is acknowledged.
* **Routing** (``UserAffinityRouter``, Ray Serve's request-router API): rendezvous hashing of the store user
  (tenant-salted, ``Tenants.user``) over the live replicas. The preferred replica comes first; when it is full
  (``max_ongoing_requests``) the others follow in hash order, so load falls back without reshuffling other
  users. A dead replica leaves the set at once; its users hash to the others until Ray has restarted it.
* **Ingress** (``create_ingress``, in the ``kvmem serve`` process): reads each HTTP request, derives its route
  key (the chat's ``user``, a memory's ``user_id``, or the owner of ``/v1/memories/{id}``), and streams the
  replica's ASGI response back. Reads and chats that fail because their replica died before answering are
  retried on another replica; a write whose replica died answers 503 (it may or may not have landed). Ray's
  queue bound per caller (``max_queued_requests``) answers 429 instead of queueing without limit.

``/metrics`` at the ingress: its own counters (routing, affinity, retries) and every live replica's metrics
with a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections import Counter as Tally
from dataclasses import dataclass, field
from urllib.parse import parse_qs

import ray
from cachetools import LRUCache
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.request_router import RequestRouter

from ..rows import canonical, password
from ..store import Store
from .routes import body_limit_error, create_app
from .runtime import KvmemServer, Limits, preflight
from .schemas import APIError
from .tenants import Tenants

logger = logging.getLogger("kvmem.server")

APP_NAME = "kvmem"
PIN_HEADER = "x-kvmem-replica"  # request: try this replica first (tests, debugging); response: who answered
RETRIES = 2  # another replica, for a read or chat whose replica died before answering
IDEMPOTENT = {("POST", "/v1/chat/completions"), ("POST", "/v1/memories/search")}

# Routing counts of the routers in this process (the ingress's handle owns them): the affinity hit rate.
ROUTED = Tally()  # preferred | fallback | pinned
LIVE: list[str] = []  # the replica ids the router last routed among
PREFERRED: dict[str, str] = {}  # request id -> its user's preferred replica, until routed


def _shared():
    """This module as imported: Ray pickles a request router's module by value, so the router's own globals
    are a copy; its counts go to the imported module's, which the ingress reads."""
    import kvmem.server.replicas

    return kvmem.server.replicas


def _score(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()


class UserAffinityRouter(RequestRouter):
    """Rendezvous (highest-random-weight) hashing of the request's ``route_key`` over the live replicas.

    ``choose_replicas`` ranks every candidate: the pinned replica (``pin``) if any, then the user's preferred
    replica, then the rest in the user's hash order. Ray tries the ranks in order and skips a replica whose queue
    is full, which is the load fallback. A request without a key ranks by its request id (spread evenly). No FIFO
    mixin: a replica chosen for a request goes to that request (FIFO hands it to the oldest pending one)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        shared = _shared()
        shared.LIVE[:] = sorted(r.replica_id.unique_id for r in candidate_replicas)
        kw = pending_request.kwargs if pending_request is not None else {}
        key = kw.get("route_key") or (pending_request.metadata.request_id if pending_request else "")
        ranked = sorted(candidate_replicas, key=lambda r: _score(key, r.replica_id.unique_id), reverse=True)
        if ranked and kw.get("route_key") and not kw.get("pin"):
            if len(shared.PREFERRED) > 10_000:  # requests never routed (cancelled) leave their entry
                shared.PREFERRED.clear()
            shared.PREFERRED[pending_request.metadata.internal_request_id] = ranked[0].replica_id.unique_id
        pin = kw.get("pin")
        if pin:
            ranked.sort(key=lambda r: r.replica_id.unique_id != pin)  # stable: the rest keep their hash order
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank was offered: back off, then again
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        kw, shared = pending_request.kwargs, _shared()
        if not kw.get("route_key"):
            return
        if kw.get("pin"):
            shared.ROUTED["pinned"] += 1
            return
        best = shared.PREFERRED.pop(pending_request.metadata.internal_request_id, None)
        shared.ROUTED["preferred" if best == replica_id.unique_id else "fallback"] += 1


@dataclass
class ReplicaConfig:
    """What every replica starts with: ``KvmemServer.start``'s arguments and the API keys."""

    store: str
    api_keys: dict | None
    start: dict = field(default_factory=dict)
    split_cores: bool = False  # one machine, no GPU: each replica takes its own cores (local rank)


class Replica:
    """One serving replica: a ``KvmemServer`` and its app; ``__call__`` runs one HTTP request through the app
    and yields its ASGI response: ``{"status", "headers"}`` first, then body chunks (bytes)."""

    def __init__(self, cfg: ReplicaConfig):
        ctx = serve.get_replica_context()
        self.name = ctx.replica_id.unique_id
        if cfg.split_cores:  # torch, and vLLM's CPU thread binding (it binds within the allowed cores), apart
            cores = sorted(os.sched_getaffinity(0))
            n = max(1, len(cores) // ctx.world_size)
            mine = cores[(ctx.rank.local_rank % ctx.world_size) * n :][:n] or cores
            for tid in os.listdir("/proc/self/task"):  # every thread: a new one inherits its creator's mask
                try:
                    os.sched_setaffinity(int(tid), mine)
                except OSError:
                    pass
        self.server = KvmemServer.start(cfg.store, api_keys=cfg.api_keys, **cfg.start)
        self.server.replica = self.name
        self.app = create_app(self.server)

    async def __call__(self, req: dict, route_key: str | None = None, pin: str | None = None):
        queue: asyncio.Queue = asyncio.Queue()
        body = [{"type": "http.request", "body": req["body"], "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await asyncio.Event().wait()  # no disconnect message: the ingress cancels this call instead

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": req["method"],
            "scheme": "http",
            "path": req["path"],
            "raw_path": req["raw_path"],
            "query_string": req["query_string"],
            "root_path": "",
            "headers": req["headers"],
            "client": req.get("client"),
            "server": ("ray-serve", 0),
        }
        task = asyncio.ensure_future(self.app(scope, receive, queue.put))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            done = False
            while not done and (msg := await queue.get()) is not None:
                if msg["type"] == "http.response.start":
                    yield {"status": msg["status"], "headers": msg.get("headers", [])}
                    continue
                body, done = [msg.get("body", b"")], not msg.get("more_body")
                while not done and not queue.empty():  # what is ready goes as one item: each costs Ray an RPC
                    nxt = queue.get_nowait()
                    if nxt is None:
                        done = True
                        break
                    body.append(nxt.get("body", b""))
                    done = not nxt.get("more_body")
                if any(body):
                    yield b"".join(body)
        finally:
            if not task.done():
                task.cancel()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine died is restarted."""
        if not self.server.engine.healthy():
            raise RuntimeError(f"the {self.server.engine.name} engine of replica {self.name} died")

    async def __del__(self):  # Ray Serve awaits it on a graceful stop
        server = getattr(self, "server", None)
        if server is not None:
            await server.aclose()  # the engine's processes stop with the replica


def _resources(replicas: int, gpus: float, cpus: float) -> dict:
    """Ray resources per replica: one GPU each where the cluster has enough (an equal share of them where it has
    fewer GPUs than replicas), else an equal share of the cores."""
    if gpus >= 1:
        return {"num_gpus": min(1.0, gpus / replicas), "num_cpus": max(0.1, min(1.0, cpus / replicas))}
    return {"num_cpus": max(0.1, cpus / replicas)}


class Replicas:
    """N replicas on Ray Serve: ``start`` joins ``ray_address`` or starts a local Ray with this machine's
    cores, deploys the replicas with ``UserAffinityRouter`` and waits until they are running; ``close`` stops
    them (their engines with them) and a Ray it started."""

    def __init__(self, handle, started_ray: bool, replicas: int, limits: Limits, tenants: Tenants, store: str):
        self.handle, self.started_ray, self.replicas = handle, started_ray, replicas
        self.limits, self.tenants, self.store_location = limits, tenants, store
        self._store: Store | None = None
        self._owners = LRUCache(maxsize=100_000)  # a memory id's owner never changes

    @classmethod
    def start(
        cls,
        store: str,
        replicas: int,
        ray_address: str | None = None,
        api_keys: dict | None = None,
        max_queue: int = 64,
        **start_kwargs,
    ) -> Replicas:
        """Raises ValueError for a bad replica count; what ``ray.init`` raises for an unreachable cluster."""
        from ..hardware import usable_cores

        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        preflight(store, **start_kwargs)  # bad options are one line here, not N failed replicas
        if ray_address and ray_address.startswith("ray://"):
            raise ValueError(
                "--ray-address ray://... (Ray Client) cannot stream from deployments; run kvmem serve on a node of "
                "the cluster with --ray-address auto (or the GCS address, host:6379)"
            )
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # a replica killed with -9 takes its engine's processes with it (Linux subreaper in the raylet)
        os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "true")
        started = not ray.is_initialized() and not ray_address
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, logging_level="warning", log_to_driver=True)
            else:
                ray.init(
                    num_cpus=usable_cores(),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",  # a local cluster listens on loopback only
                    object_store_memory=128 << 20,  # requests and answers only: KV never travels through Ray
                    logging_level="warning",
                    log_to_driver=True,
                )
        try:
            res = ray.cluster_resources()
            per = _resources(replicas, res.get("GPU", 0), res.get("CPU", 1))
            env = {
                "KVMEM_THREADS": str(max(1, int(res.get("CPU", 1) / replicas))),
                # requests on the replica's own event loop: no hop to a second loop thread per streamed item
                "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
            }
            if password(store):
                env["PGPASSWORD"] = password(store)
            limits = start_kwargs.get("limits") or Limits()
            deployment = serve.deployment(
                Replica,
                name="Replica",
                num_replicas=replicas,
                ray_actor_options={**per, "runtime_env": {"env_vars": env}},
                max_ongoing_requests=max_queue,
                max_queued_requests=max_queue,
                health_check_period_s=2,
                health_check_timeout_s=30,
                graceful_shutdown_timeout_s=30,  # open streams drain, then __del__ stops the engine
                request_router_config=RequestRouterConfig(request_router_class=UserAffinityRouter),
            )
            split = started and not res.get("GPU") and hasattr(os, "sched_setaffinity")
            cfg = ReplicaConfig(canonical(store), api_keys, {"max_queue": max_queue, **start_kwargs}, split)
            serve.start(proxy_location="Disabled")
            handle = serve.run(
                deployment.bind(cfg),
                name=APP_NAME,
                route_prefix=None,
                logging_config={"log_level": "WARNING", "enable_access_log": False},
            )
        except BaseException:  # a failed start (or SIGTERM meanwhile) leaves no Ray behind
            if started:
                serve.shutdown()
                ray.shutdown()
            raise
        return cls(handle.options(stream=True), started, replicas, limits, Tenants(api_keys or {}), store)

    async def owner(self, memory_id: str) -> str | None:
        """The store user of a memory id, for routing ``/v1/memories/{id}`` (None: unknown, route anywhere);
        the store is read off the event loop."""
        if memory_id in self._owners:
            return self._owners[memory_id]

        def read():
            if self._store is None:
                self._store = Store.open(self.store_location)
            f = self._store.fact(memory_id)
            return f.user if f is not None else None

        try:
            user = await asyncio.to_thread(read)
        except Exception:  # routing is a hint: the replica answers the real error
            return None
        if user is not None:
            self._owners[memory_id] = user
        return user

    def close(self) -> None:
        """Delete the app (each replica drains, then its ``__del__`` stops its engine); on a Ray this process
        started, Serve and Ray stop too. On a joined cluster other Serve apps keep running."""
        try:
            serve.delete(APP_NAME)
            if self.started_ray:
                serve.shutdown()
        finally:
            if self._store is not None:
                self._store.close()
            if self.started_ray:
                ray.shutdown()


async def route_key(cluster: Replicas, method: str, path: str, query: bytes, headers, body: bytes) -> str | None:
    """The store user a request is for (tenant-salted), or None: the chat's ``user``, the memories API's
    ``user_id`` (body or query), or the owner of ``/v1/memories/{id}``. Only a hint: errors are the replica's."""
    try:
        tenant = cluster.tenants.tenant(headers.get("authorization"))
    except APIError:
        return None
    user = None
    if path in ("/v1/chat/completions", "/v1/memories", "/v1/memories/search") and method == "POST":
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        if isinstance(doc, dict):
            user = doc.get("user" if path == "/v1/chat/completions" else "user_id")
    elif path == "/v1/memories":
        user = (parse_qs(query.decode("latin-1")).get("user_id") or [None])[0]
    elif path.startswith("/v1/memories/"):
        return await cluster.owner(path.split("/")[3])
    if not isinstance(user, str):
        return None
    try:
        return Tenants.user(tenant, user)
    except APIError:
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

    async def forward(req: dict, key: str | None, pin: str | None, retry: bool):
        """The replica's first message and its stream. ``retry`` (reads and chats): a replica that died before
        answering is replaced by another, and no answer in ``--timeout`` (+10 s) is a 503. A write is never
        retried nor timed out here (it may be running: the replica's own limits apply). Raises APIError."""
        for attempt in range(RETRIES + 1):
            gen = cluster.handle.remote(req, route_key=key, pin=pin)
            try:
                first = await asyncio.wait_for(gen.__anext__(), limits.request_timeout_s + 10 if retry else None)
                return first, gen
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
        retry = method in ("GET", "HEAD") or (method, path) in IDEMPOTENT
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
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in raw)
        resp = StreamingResponse(rest(gen, sse), status_code=first["status"])
        resp.raw_headers = raw  # the replica's headers as sent (duplicates kept)
        return resp

    return app


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
