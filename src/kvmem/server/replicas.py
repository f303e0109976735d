"""``kvmem serve --replicas N``: N serving replicas on Ray Serve behind one ingress, each user's requests routed
to the replica that holds their memory warm (paper §7, "route each request to where a user's memory resides").

* **Replicas** (``Replica``, a Ray Serve deployment): each is a whole ``KvmemServer`` (its own engine, index
  cache and segment caches) running the same FastAPI app as the single-process server, so chat, the memories
  REST API, tenants, errors and limits are the same code. Every replica opens the one shared store: versions are
  checked against it on every request, so any replica serves any user correctly; a write is durable in the store
  before it is acknowledged.
* **Routing** (``UserAffinityRouter``, Ray Serve's request-router API): rendezvous hashing of the request's
  route key (its user's store user, tenant-salted: ``ingress.route_key``) over the live replicas. The preferred
  replica comes first; when it is full (``max_ongoing_requests``) the others follow in hash order, so load falls
  back without reshuffling other users. A dead replica leaves the set at once; its users hash to the others
  until Ray has restarted it.
* **Ingress** (``ingress.create_ingress``, in the ``kvmem serve`` process) reads each request, names its route
  key, and streams the replica's answer back.
* **Secrets** never travel through Ray: Ray keeps deployment arguments and runtime environments in its GCS and
  shows them to the cluster's operators. A replica gets the store's canonical URL (no credentials) and the path of
  the API-keys file, and reads the keys from that file, and the store's credentials from its node's environment
  (``PGPASSWORD``, a passfile: libpq's own), itself. A local Ray started here inherits this process's environment;
  a ``--store`` URL with credentials is refused (Ray records the driver's command line in its GCS), and so are a
  ``--segments`` URL with credentials and an extractor with a key (``refuse_secrets``): the object store's
  credentials and ``KVMEM_EXTRACTOR_API_KEY`` come from each node's environment.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections import Counter as Tally
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from cachetools import LRUCache
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from ..scopes import namespace_prefix
from ..settings import Limits, ServeOptions
from ..store import Store, canonical, has_credentials, redact, secrets
from .routes import create_app
from .runtime import KvmemServer, preflight
from .storesize import StoreSize
from .tenants import Tenants, load_api_keys

logger = logging.getLogger("kvmem.server")

APP_NAME = "kvmem"

# Routing counts of the routers in this process (the ingress's handle owns them): the affinity hit rate.
ROUTED = Tally()  # preferred | fallback | pinned
LIVE: list[str] = []  # the replica ids the router last routed among
PREFERRED: dict[str, str] = {}  # request id -> its user's preferred replica, until routed
# replica id -> until when (time.monotonic()) it ranks last: it answered 503 store_unavailable (it cannot reach
# the store, or part of it, as from one machine cut off from the object store); the ingress sets and clears it
UNREADY: dict[str, float] = {}


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
    replica, then the rest in the user's hash order; a replica that recently answered 503 ``store_unavailable``
    (``UNREADY``, kept by the ingress until its ``/ready`` answers 200) ranks after every other one. Ray tries the
    ranks in order and skips a replica whose queue is full, which is the load fallback. A request without a key
    ranks by its request id (spread evenly). No FIFO mixin: a replica chosen for a request goes to that request
    (FIFO hands it to the oldest pending one)."""

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
        now = time.monotonic()
        down = {rid for rid, until in list(shared.UNREADY.items()) if until > now}
        if down and any(r.replica_id.unique_id not in down for r in ranked):  # one that can serve goes first
            ranked.sort(key=lambda r: r.replica_id.unique_id in down)  # stable: hash order within each part
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
    """What every replica starts with: ``KvmemServer.start``'s arguments and where the API keys are. Ray stores it
    (in its GCS): it holds no secret, only the store's canonical URL and the keys file's path."""

    store: str
    api_keys_file: str | None
    start: dict = field(default_factory=dict)
    split_cores: bool = False  # one machine, no GPU: each replica takes its own cores (local rank)


class Replica:
    """One serving replica: a ``KvmemServer`` and its app; ``__call__`` runs one HTTP request through the app
    and yields its ASGI response: ``{"status", "headers"}`` first, then body chunks (bytes)."""

    def __init__(self, cfg: ReplicaConfig, fingerprint: str = ""):
        self._fingerprint = fingerprint  # what the ingress deployed: a restarted ingress compares it (``start``)
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
        keys = load_api_keys(cfg.api_keys_file) if cfg.api_keys_file else None  # on this node, not through Ray
        self.server = KvmemServer.start(cfg.store, api_keys=keys, **cfg.start)
        self.server.replica = self.name
        self.app = create_app(self.server)

    async def __call__(self, req: dict, route_key: str | None = None, pin: str | None = None):
        queue: asyncio.Queue = asyncio.Queue()
        request = [{"type": "http.request", "body": req["body"], "more_body": False}]

        async def receive():
            if request:
                return request.pop()
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
                chunks, done = [msg.get("body", b"")], not msg.get("more_body")
                while not done and not queue.empty():  # what is ready goes as one item: each costs Ray an RPC
                    nxt = queue.get_nowait()
                    if nxt is None:
                        done = True
                        break
                    chunks.append(nxt.get("body", b""))
                    done = not nxt.get("more_body")
                if any(chunks):
                    yield b"".join(chunks)
        finally:
            if not task.done():
                task.cancel()

    def fingerprint(self) -> str:
        """The deployment's options as the ingress that deployed this replica hashed them (``_fingerprint``)."""
        return self._fingerprint

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


def _fingerprint(cfg: ReplicaConfig, replicas: int, resources: dict, env: dict, max_queue: int) -> str:
    """A hash of everything a deployment is made of: the replicas' config, their count, resources, environment
    and queue bound, the API keys file's bytes, and kvmem's own code (every module of the package, so an upgrade
    never attaches to replicas running the old code). Equal fingerprints: interchangeable deployments."""
    h = hashlib.sha256()
    what = {"cfg": asdict(cfg), "n": replicas, "res": resources, "env": env, "q": max_queue}
    h.update(json.dumps(what, sort_keys=True, default=repr).encode())
    if cfg.api_keys_file:
        h.update(Path(cfg.api_keys_file).read_bytes())
    package = Path(__file__).resolve().parents[1]
    for f in sorted(package.rglob("*.py")):
        h.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


def refuse_secrets(start: dict) -> None:
    """Raise ValueError (one line, no secret in it) when ``KvmemServer.start``'s arguments, which Ray records as
    the replicas' deployment arguments, carry a credential: in the ``--segments`` URL (user part, signed query) or
    the extractor (a key in ``--extractor-url`` or an ``api_key``). Each can come from the environment of every
    node instead, where a local Ray started here inherits it."""
    seg = start.get("segments_url")
    if has_credentials(seg):
        raise ValueError(
            f"the --segments URL {redact(seg)} carries credentials, which Ray would record (its GCS keeps the "
            "replicas' arguments and this command line): remove them and give them in the environment of kvmem "
            "serve and of every Ray node (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)"
        )
    ex = start.get("extractor")
    if isinstance(ex, dict) and (has_credentials(ex.get("base_url")) or ex.get("api_key") not in (None, "", "none")):
        raise ValueError(
            f"the extractor ({redact(str(ex.get('base_url')))}) carries a key, which Ray would record (its GCS "
            "keeps the replicas' arguments and this command line): remove it and set KVMEM_EXTRACTOR_API_KEY in "
            "the environment of kvmem serve and of every Ray node"
        )


def _running(fingerprint: str):
    """The handle of the kvmem app already RUNNING on the joined cluster with ``fingerprint`` (deployed by an
    ingress that died without stopping it, kill -9 say), else None: a restarted ingress attaches to its
    replicas instead of replacing them, so no model loads again."""
    try:
        app = serve.status().applications.get(APP_NAME)
        if app is None or app.status != "RUNNING":
            return None
        handle = serve.get_app_handle(APP_NAME)
        same = handle.options(method_name="fingerprint").remote().result(timeout_s=30) == fingerprint
    except Exception as exc:  # no Serve yet, or a replica that does not answer: deploy afresh
        logger.info("no running kvmem app to attach to (%s: %s)", type(exc).__name__, exc)
        return None
    if same:
        logger.warning("attached to the running kvmem app on this cluster (same options): no replica restarted")
    return handle if same else None


SERVE_FIELDS = set(ServeOptions.__dataclass_fields__)


class Replicas:
    """N replicas on Ray Serve: ``start`` joins ``ray_address`` or starts a local Ray with this machine's
    cores, deploys the replicas with ``UserAffinityRouter`` and waits until they are running (on a joined cluster
    where they already run with the same options, left by an ingress that died, it attaches to them instead);
    ``close`` stops them (their engines with them) and a Ray it started."""

    def __init__(self, handle, started_ray: bool, replicas: int, limits: Limits, tenants: Tenants, store: str):
        self.handle, self.started_ray, self.replicas = handle, started_ray, replicas
        self.limits, self.tenants, self.store_location = limits, tenants, store
        self._store: Store | None = None
        self._owners = LRUCache(maxsize=100_000)  # a memory id's owner never changes
        self.store_size = StoreSize(store)  # for the ingress's /metrics: once for the shared store

    @classmethod
    def start(
        cls,
        store: str,
        replicas: int,
        ray_address: str | None = None,
        api_keys_file: str | None = None,
        **start_kwargs,
    ) -> Replicas:
        """``api_keys_file``: the JSON keys file (``tenants.load_api_keys``), read here for the ingress and by each
        replica on its node (the same path there). Raises ValueError for a bad replica count, a keys file that
        cannot be read, or a store URL with credentials when joining a cluster (its replicas could get them only
        through Ray); what ``ray.init`` raises for an unreachable cluster. ``start_kwargs``: ``KvmemServer.start``'s
        (``settings.ServeOptions`` fields among them, checked here before Ray starts)."""
        from ..hardware import usable_cores

        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        api_keys = load_api_keys(api_keys_file) if api_keys_file else None
        if secrets(store):  # Ray records the driver's command line in its job table, and the replicas' config
            raise ValueError(
                "the --store URL carries credentials, which Ray would record (its GCS keeps this command line): "
                "remove them from the URL and set PGPASSWORD (or a passfile, PGPASSFILE) in the environment of "
                "kvmem serve and of every Ray node"
            )
        refuse_secrets(start_kwargs)
        max_queue = ServeOptions(**{k: v for k, v in start_kwargs.items() if k in SERVE_FIELDS}).max_queue
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
            keys_path = str(Path(api_keys_file).resolve()) if api_keys_file else None
            # the store's size is measured once, by the ingress, not by every replica
            start = {**start_kwargs, "max_queue": max_queue, "measure_store": False}
            cfg = ReplicaConfig(canonical(store), keys_path, start, split)
            fp = _fingerprint(cfg, replicas, per, env, max_queue)
            handle = None if started else _running(fp)
            if handle is None:
                serve.start(proxy_location="Disabled")
                handle = serve.run(
                    deployment.bind(cfg, fp),
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

    async def owner(self, memory_id: str, tenant: str | None = None) -> str | None:
        """The store user of a memory id among ``tenant``'s scopes, for routing ``/v1/memories/{id}`` (None:
        unknown, route anywhere); the store is read off the event loop."""
        if (tenant, memory_id) in self._owners:
            return self._owners[tenant, memory_id]

        def read():
            if self._store is None:
                self._store = Store.open(self.store_location)
            f = self._store.reads.fact(memory_id, within=namespace_prefix(tenant))
            return f.user if f is not None else None

        try:
            user = await asyncio.to_thread(read)
        except Exception:  # routing is a hint: the replica answers the real error
            return None
        if user is not None:
            self._owners[tenant, memory_id] = user
        return user

    def close(self) -> None:
        """Delete the app (each replica drains, then its ``__del__`` stops its engine); on a Ray this process
        started, Serve and Ray stop too. On a joined cluster other Serve apps keep running."""
        self.store_size.close()
        try:
            serve.delete(APP_NAME)
            if self.started_ray:
                serve.shutdown()
        finally:
            if self._store is not None:
                self._store.close()
            if self.started_ray:
                ray.shutdown()
