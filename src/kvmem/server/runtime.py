"""Runtime wiring of ``kvmem serve``: the service, the ``Memory`` facade for writes, the engine, tenants, limits
and metrics, built once by ``KvmemServer.start``.

Everything that runs the transformers model (encoding new facts, the transformers engine's composition and
decoding) runs on one model thread, so the model and its RoPE state are never used by two requests at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engines.base import AsyncEngine
from ..engines.select import open_engine
from ..ingest import open_or_create_store
from ..memory import Memory
from ..models import DEFAULT_MODEL, load
from ..policy import Method
from ..retrieve import HYBRID, Embedder, IndexCache
from ..service import MemoryService, check_methods
from ..settings import MAX_QUEUE, Limits, ServeOptions
from ..store import Store, check_kv_format, check_segments_url
from .storesize import StoreSize
from .tenants import Tenants

logger = logging.getLogger("kvmem.server")
UPKEEP_S = 30.0  # the upkeep task's round: deferred re-encodings due before the next round, collection, cache sweep
EXPIRE_EVERY_S = 600.0  # expired memories are erased at least this often


# the connector's counters file becomes label values of kvmem_connector_events: names of its own shape only, and
# a bounded number of them
EVENT_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
MAX_CONNECTOR_EVENTS = 64


def private_metrics_file() -> str:
    """Where the vLLM connector writes its counters (and ``.worker``, ``.loads`` beside them): a fresh directory
    only this user can enter (``tempfile.mkdtemp``, mode 0700), never a predictable name in a shared /tmp."""
    return str(Path(tempfile.mkdtemp(prefix="kvmem-metrics-")) / "connector.json")


class Metrics:
    """The server's prometheus metrics, in their own registry (several servers per process in tests)."""

    def __init__(self, server: KvmemServer):

        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmem_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.ttft = Histogram(
            "kvmem_ttft_seconds",
            "Server-side time to first token by memory mode",
            ["mode"],
            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60),
            registry=r,
        )
        self.tokens = Counter(
            "kvmem_prompt_tokens", "Prompt tokens: injected (from memory KV) or prefilled", ["kind"], registry=r
        )
        self.send_timeouts = Counter(
            "kvmem_send_timeouts",
            "Requests cut off because their client stopped reading for --send-timeout (their engine request aborted)",
            registry=r,
        )
        self.fallbacks = Counter(
            "kvmem_connector_fallbacks",
            "kv-mode requests whose memory was prefilled instead of injected, by reason",
            ["reason"],
            registry=r,
        )
        Gauge("kvmem_engine_queue_depth", "Requests waiting for or running in the engine", registry=r).set_function(
            lambda: server.engine.queue_depth()
        )
        if server.store_size is not None:  # with --replicas, the ingress's (one figure for the shared store)
            store_bytes_gauge(r, server.store_size)
        cached = Gauge("kvmem_cache_bytes", "Bytes held by the server's LRU caches", ["cache"], registry=r)
        indexes = server.service.indexes
        cached.labels("index").set_function(lambda: indexes.nbytes)
        cached.labels("store_kv").set_function(lambda: server.service.store.kv_cache_bytes)
        store_reads = Gauge(
            "kvmem_store_reads",
            "Reads of memory KV by the server and the vLLM worker: facts served from a memory cache (kv_hits) or "
            "read from segments (kv_misses, kv_read_bytes), facts evicted from it (kv_evictions, kv_evicted_bytes; "
            "stored bytes); with --cache-dir, segments from the disk cache (disk_hits) or fetched from the object "
            "store (disk_misses, disk_fetched_bytes, disk_cache_bytes, disk_evictions)",
            ["counter"],
            registry=r,
        )
        self._worker_reads: dict = {}  # the vLLM worker's, read once per render (engines.vllm.worker writes them)
        for name in ("kv_hits", "kv_misses", "kv_read_bytes", "kv_evictions", "kv_evicted_bytes", "disk_hits",
                     "disk_misses", "disk_fetched_bytes", "disk_cache_bytes", "disk_evictions"):  # fmt: skip
            store_reads.labels(name).set_function(
                lambda n=name: server.service.store.reads.cache_stats().get(n, 0) + self._worker_reads.get(n, 0)
            )
        Gauge(
            "kvmem_store_kv_format", "The store's KV format (1 for the one it holds)", ["kv_format"], registry=r
        ).labels(server.service.store.kv_format).set(1)
        hits = Gauge("kvmem_index_cache_events", "Per-user index cache hits and misses", ["event"], registry=r)
        hits.labels("hit").set_function(lambda: indexes.hits)
        hits.labels("miss").set_function(lambda: indexes.misses)
        extraction = Gauge(
            "kvmem_extraction",
            "infer=True adds and what extraction gave: adds, facts_extracted, facts_rejected (not in the user's "
            "messages), empty (nothing remembered), corrections (an ADD made an UPDATE), forgotten (deleted on a "
            "request to forget)",
            ["counter"],
            registry=r,
        )
        for name in ("adds", "facts_extracted", "facts_rejected", "empty", "corrections", "forgotten"):
            extraction.labels(name).set_function(lambda n=name: server.memory.extraction_counts[n])
        self._conn = Gauge("kvmem_connector_events", "The vLLM connector's scheduler counters", ["event"], registry=r)
        self._metrics_file = server.engine.metrics_file
        self._conn_events: dict[str, int] = {}  # the connector's event names seen, in order

    def render(self) -> bytes:

        path = self._metrics_file
        if path and Path(path).exists():
            try:
                for k, v in json.loads(Path(path).read_text()).items():
                    if self._conn_events.get(k, len(self._conn_events)) >= MAX_CONNECTOR_EVENTS:
                        continue  # a bounded set of label values
                    if isinstance(k, str) and EVENT_RE.match(k) and isinstance(v, (int, float)):
                        self._conn_events.setdefault(k, len(self._conn_events))
                        self._conn.labels(k).set(v)
            except (OSError, ValueError, AttributeError):
                pass
        if path:
            try:
                self._worker_reads = json.loads(Path(f"{path}.worker").read_text())
            except (OSError, ValueError):
                pass
        return generate_latest(self.registry)


def store_bytes_gauge(registry: CollectorRegistry, size: StoreSize) -> None:
    """``kvmem_store_bytes`` (the last background measurement, ``storesize``) and its age, in ``registry``."""
    Gauge(
        "kvmem_store_bytes",
        f"Bytes of the store: its rows and KV segments, measured off the event loop every {size.every_s:.0f} s "
        "or more (NaN until the first measurement)",
        registry=registry,
    ).set_function(size.value)
    Gauge(
        "kvmem_store_bytes_seconds", "How long the last measurement of kvmem_store_bytes took, s", registry=registry
    ).set_function(lambda: size.seconds)


def preflight(
    store: str | Path,
    model: str | None = None,
    engine: str = "auto",
    dtype: str | None = None,
    segments_url: str | None = None,
    selective_recompute: int = 0,
    tail_recompute: int = 0,
    kv_format: str | None = None,
    **_,
) -> None:
    """What ``KvmemServer.start`` refuses before it loads anything: methods the engine cannot serve, and for an
    existing store another model or dtype, or a ``--segments`` it was not created with. Also where the servers
    start elsewhere (``replicas``), so a bad option is one line here. Raises ValueError, StoreError."""
    # the default method of chat requests, refused before any engine starts (e.g. selective with tail recompute)
    check_methods([Method.of("kv", tail_recompute, selective_recompute)], engine)
    if not Store.exists(store):
        return
    st = Store.open(store)
    try:
        check_segments_url(st, segments_url)
        check_kv_format(st, kv_format)
        st.check_serves(model, dtype)
    finally:
        st.close()


def server_of(request) -> KvmemServer:
    """The ``KvmemServer`` behind a request's app (``routes.create_app`` sets it)."""
    return request.app.state.kvmem


def tenant_of(request) -> str | None:
    """The caller's tenant, by its API key (``Tenants.tenant``: APIError 401 for a missing or unknown key;
    None without keys)."""
    return server_of(request).tenants.tenant(request.headers.get("authorization"))


class KvmemServer:
    """What the app holds: the memory service (retrieval + composition), the Memory facade (writes), the
    engine, tenants, limits and metrics. Build with ``KvmemServer.start``; ``service.lm`` names the model."""

    def __init__(
        self,
        service: MemoryService,
        memory: Memory,
        engine: AsyncEngine,
        tenants: Tenants,
        limits: Limits,
        model_pool: ThreadPoolExecutor,
        max_writes: int = MAX_QUEUE,
        selective_recompute: int = 0,
        measure_store: bool = True,
    ):
        self.service, self.memory, self.engine, self.tenants, self.limits = service, memory, engine, tenants, limits
        self.model_pool = model_pool  # the one thread that runs the transformers model
        self.model_name = service.lm.name
        self.ready = True
        self.pending_writes, self.max_writes = 0, max_writes
        self.selective_recompute = selective_recompute  # default memory.selective_recompute (%)
        self.replica: str | None = None  # this server's name as one of several replicas (``replicas``)
        # the store's size for /metrics, on a background thread (``storesize``); None: measured elsewhere (replicas)
        self.store_size = StoreSize(service.store.root) if measure_store else None
        self.metrics = Metrics(self)

    @classmethod
    def start(
        cls,
        store: str | Path,
        model: str | None = None,
        engine: str = "auto",
        api_keys: dict | None = None,
        limits: Limits | None = None,
        dtype: str | None = None,
        options: ServeOptions | None = None,
        **settings,
    ) -> KvmemServer:
        """Load the store, model, embedder and engine (``engines.select.open_engine``). ``engine``: auto | vllm |
        hf; ``limits``: each request's bounds and defaults (``settings.Limits``); ``options``, or its fields as
        keyword arguments (``settings``): how the parts are built (``settings.ServeOptions``: caches, the
        engine's queue, how writes encode, the write timeout, a new store's segments and KV format, extraction,
        deferred re-encoding, hybrid retrieval, whether the store's size is measured here). Raises ValueError
        (pydantic's ValidationError) for a bad option; StoreError, ModelError, EngineUnavailable (one line each);
        ValueError for selective recompute off the transformers engine or with tail recompute."""
        o = options if options is not None else ServeOptions(**settings)
        if options is not None and settings:
            raise ValueError(f"give options or its fields, not both: {', '.join(settings)}")
        segments_url, kv_format, cache_bytes, cache_dir = o.segments_url, o.kv_format, o.cache_bytes, o.cache_dir
        selective_recompute, tail_recompute, hybrid = o.selective_recompute, o.tail_recompute, o.hybrid
        preflight(store, model, engine, dtype, segments_url, selective_recompute, tail_recompute, kv_format)
        root = store
        embedder = Embedder()
        if not Store.exists(root):  # a new, empty store for the model
            lm = load(model or DEFAULT_MODEL, dtype=dtype)
            open_or_create_store(root, lm, embedder, segments_url=segments_url, kv_format=kv_format)[0].close()
        st = Store.open(root)
        model = model or st.fingerprint["model"]
        if hybrid and not st.reads.has_text_index():
            logger.warning(
                "--hybrid: store %s has no full-text index (created before hybrid search), so it is searched by "
                "cosine alone; `kvmem store text-index --store %s` adds one",
                st.name,
                st.name,
            )
        st.close()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-model")
        opened = open_engine(
            model,
            engine,
            dtype,
            serving=True,
            stores=[root],
            max_queue=o.max_queue,
            kv_cache_memory_bytes=o.kv_cache_memory_bytes,
            pool=pool,
            cache_bytes=cache_bytes,
            cache_dir=cache_dir,
            metrics_file=(metrics_file := private_metrics_file()),
            vllm_options=o.vllm_options,
        )
        if opened.note:
            logger.warning(opened.note)
        eng, lm = opened.engine, opened.lm
        if not eng.metrics_file:  # an engine that writes no counters (transformers)
            shutil.rmtree(Path(metrics_file).parent, ignore_errors=True)
        indexes = IndexCache(cache_bytes)
        svc = MemoryService(
            root,
            eng,
            lm,
            embedder,
            tail_recompute=tail_recompute,
            store_cache_bytes=cache_bytes,
            store_cache_dir=cache_dir,
            fusion=HYBRID if hybrid else None,
        )
        svc.indexes = indexes
        # writes: the same model (its weights load on the first write where the engine does not hold them)
        mem = Memory(
            root,
            model=lm if lm.model.device.type != "meta" else lm.name,
            window=o.window,
            embedder=embedder,
            dtype=dtype,
            neighbours=o.neighbours,
            history=o.history,
            indexes=indexes,
            store_cache_bytes=cache_bytes,
            extractor=o.extractor,
            defer_reencode_s=o.defer_reencode_s,
            hybrid=hybrid,
        )
        mem.store.writes.write_timeout_s = svc.store.writes.write_timeout_s = o.write_timeout_s
        return cls(
            svc,
            mem,
            eng,
            Tenants(api_keys or {}),
            limits or Limits(),
            pool,
            o.max_queue,
            selective_recompute,
            o.measure_store,
        )

    def start_upkeep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start (once, at the first request) the upkeep task on ``loop``: every round, on the model thread,
        re-encode what deferred erasures left (``Memory.reencode_pending``: the facts due before the next round,
        so none outlives its bound by more than one re-encoding) and remove every segment retired
        ``retire_after_s`` or more ago (``Memory.collect``, which it runs); off it, drop from this server's disk
        cache (``--cache-dir``) every segment the store no longer holds (``Store.sweep_cache``); and erase expired
        memories (``Memory.expire``, every ``EXPIRE_EVERY_S``)."""
        if getattr(self, "_upkeep", None) is not None:
            return
        every = UPKEEP_S if self.memory.defer_reencode_s is None else min(UPKEEP_S, self.memory.defer_reencode_s / 2)

        async def upkeep():
            last_expiry = 0.0
            while True:
                await asyncio.sleep(every)
                try:
                    await self.on_model_thread(self.memory.reencode_pending, 2 * every)
                    await self.off_loop(self.service.store.sweep_cache)
                    if time.monotonic() - last_expiry >= EXPIRE_EVERY_S:
                        await self.on_model_thread(self.memory.expire)
                        last_expiry = time.monotonic()
                except Exception:  # a busy store, a closed pool: the next round tries again
                    logger.exception("upkeep: re-encoding, collection or expiry failed; tried again in %.0f s", every)

        self._upkeep = loop.create_task(upkeep())

    def attach_extraction(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let writes (on the model thread) decode extraction JSON on the engine (``AsyncEngine.sync_json``)."""
        if self.memory.engine is None:
            self.memory.engine = self.engine.sync_json(loop)

    def close(self) -> None:
        """Stop the engine (vLLM's engine core and worker processes) and the model thread."""
        asyncio.run(self.aclose())

    async def aclose(self) -> None:
        """``close`` from inside an event loop."""
        self.ready = False
        if self.store_size is not None:
            self.store_size.close()
        try:
            await self.engine.shutdown()
        finally:
            self.model_pool.shutdown(wait=False, cancel_futures=True)
            if self.engine.metrics_file:  # the private directory of the connector's counters
                shutil.rmtree(Path(self.engine.metrics_file).parent, ignore_errors=True)

    async def on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_pool, fn, *args)

    async def off_loop(self, fn, *args):
        """Blocking work that does not touch the transformers model (retrieval) on the default pool."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
