"""``kvmem serve``: one long-lived process, an OpenAI-compatible chat API with KV-injected memory and a memories
REST API in Mem0's platform shapes (FastAPI + uvicorn, pydantic models, prometheus_client metrics).

Request path (chat): key -> tenant (``tenants``); the request's ``user`` is the memory owner inside the
tenant's namespace; the route (``chat``) checks the whole request, names its method once (``policy.Method``)
and calls the service's one chat pipeline once (``service.MemoryService.prepare_chat``: ``plan`` embeds the last
user message, retrieves ``top_k`` facts and orders them; the engine's ``memory`` composes them
(``engines.base.AsyncEngine``); the retry and the plain-chat fallbacks are the service's; the decoding), and
``streaming`` runs what it returns: the engine prefills only the conversation in ``kv`` mode, everything in
``prompt`` mode, and the bare chat in ``off`` mode. Writes (``POST /v1/memories`` ...) go through
``memory.Memory``'s one write path and are visible to the next chat request (a new memory version).

Modules: ``schemas`` (request models, errors), ``responses`` (each 200's schema), ``tenants``, ``runtime``
(wiring: ``KvmemServer.start``, metrics), ``streaming`` (one prepared chat on the engine, SSE), ``toolcalls`` (a
tool call's grammar, parse and streamed form), ``routes`` (the FastAPI app, the admin router), ``chat`` and
``memories`` (their routers); the settings are ``kvmem.settings``' ``Limits`` and ``ServeOptions``; with
``--replicas``: ``replicas`` (the Ray Serve deployment and its user-affinity router) and ``ingress`` (the HTTP
front that forwards to them).

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 bad input, 401 missing or
unknown key, 404 unknown memory id (or another tenant's: answered alike) / model / route, 409 a write that lost a race,
413 body too large, 422 a field of the wrong type, 429 engine queue full, 503 not ready or timed out.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..extras import require
from ..settings import Limits, ServeOptions
from ..store import redact
from .routes import create_app
from .runtime import KvmemServer
from .schemas import APIError
from .tenants import Tenants, load_api_keys

EXIT_ENGINE_DIED = 3  # `kvmem serve`'s exit status when its engine died: a supervisor restarts it

logger = logging.getLogger("kvmem.server")

__all__ = ["APIError", "KvmemServer", "Limits", "ServeOptions", "Tenants", "create_app", "load_api_keys", "serve"]


DEAD_GRACE_S = 2.0  # a server whose engine died answers 503 this long, then drains and exits
DEAD_CLOSE_S = 3.0  # then its engine's shutdown gets this long; the exit follows either way
# so the process is gone within DEAD_GRACE_S + uvicorn's drain (5 s at most) + DEAD_CLOSE_S of the death


def serve(
    store: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys_file: str | None = None,
    log=print,
    replicas: int = 1,
    ray_address: str | None = None,
    use_ray: bool = False,
    send_buffer: int | None = None,
    **start_kwargs,
) -> None:
    """Start the server (blocking): one process with one engine, or with ``replicas`` > 1, ``ray_address`` or
    ``use_ray``, an ingress here and the replicas on Ray Serve (``replicas``). Without an API keys file it binds
    to loopback only. ``send_buffer``: each accepted connection's kernel send buffer, bytes (fixed: no
    autotuning; None: the kernel's default). Raises ValueError for a bad keys file or a non-loopback host without
    keys."""
    import uvicorn

    keys = load_api_keys(api_keys_file) if api_keys_file else None
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"refusing to bind {host} without --api-keys: without keys the server is loopback-only")
    if not keys and ray_address:  # the replicas of a joined cluster answer whoever reaches its nodes
        raise ValueError("refusing to join a Ray cluster (--ray-address) without --api-keys: give a keys file")
    tenants = f"tenants: {', '.join(sorted(set(keys.values())))}" if keys else "no API keys: loopback only"

    def _exit(signum, frame):  # SIGTERM (docker stop, systemd), SIGHUP: unwind so the engine processes stop too
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not interrupt the shutdown itself
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(0)

    def _handle():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit)

    _handle()  # before start: a stop while engines load unwinds them too
    if replicas > 1 or ray_address or use_ray:
        require("replicas", "serving on Ray Serve (kvmem serve --replicas, --ray, --ray-address)")
        from .ingress import create_ingress
        from .replicas import Replicas

        cluster = Replicas.start(str(store), replicas, ray_address, api_keys_file=api_keys_file, **start_kwargs)
        app, close, healthy = create_ingress(cluster), cluster.close, lambda: True
        log(
            f"kvmem serve: {replicas} replica(s) on Ray Serve ({ray_address or 'a local Ray'}), store "
            f"{redact(str(store))}, {tenants}; http://{host}:{port}/v1"
        )
    else:
        server = KvmemServer.start(store, api_keys=keys, **start_kwargs)
        app, close, healthy = create_app(server), server.close, server.engine.healthy
        log(
            f"kvmem serve: {server.model_name} on the {server.engine.name} engine, store {redact(str(store))}, "
            f"{tenants}; http://{host}:{port}/v1"
        )
    _handle()  # again: ray.init installs its own
    uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    died = threading.Event()

    def watch():  # a dead engine: 503s at once (routes), then drain and exit non-zero for the supervisor
        while not uv.should_exit:
            if not healthy():
                logger.error("the engine died; answering 503 and exiting for a restart")
                died.set()
                time.sleep(DEAD_GRACE_S)  # /ready says 503 a moment before the port closes: balancers see it
                uv.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="kvmem-engine-watch", daemon=True).start()
    try:
        uv.run(sockets=[listener(uv.config, send_buffer)] if send_buffer else None)  # drains on SIGINT/SIGTERM,
        # then re-raises the signal: SystemExit here
    finally:
        if died.is_set():  # a dead engine's shutdown can wait on processes and sockets that are gone: bounded
            closer = threading.Thread(target=close, name="kvmem-close", daemon=True)
            closer.start()
            closer.join(DEAD_CLOSE_S)
        else:
            close()
        log("kvmem serve: stopped" + (" (the engine died)" if died.is_set() else ""))
    if died.is_set():
        _exit_now(EXIT_ENGINE_DIED)


def listener(config, send_buffer: int):
    """uvicorn's listening socket for ``config`` (its own ``bind_socket``) with SO_SNDBUF set to ``send_buffer``
    bytes: every accepted connection inherits it, so a client that stops reading stalls the server's sends after
    that many bytes (plus uvicorn's 64 KB write buffer) instead of the megabytes an autotuned buffer takes."""
    import socket

    sock = config.bind_socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return sock


def _exit_now(status: int) -> None:
    """Exit with ``status`` at once: the engine's remaining child processes are killed, logs flushed, and neither
    the dead engine's threads nor its exit hooks can hold the process (``os._exit``)."""
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
