"""``kvmem serve``'s app on a free loopback port, served by uvicorn in a thread of this process: for benchmarks
and tests that drive the HTTP API of a server they hold in hand."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_in_thread(srv, sndbuf: int | None = None, wait_s: float = 20.0) -> Iterator[str]:
    """Serve ``create_app(srv)`` (``srv``: a ``KvmemServer``) on 127.0.0.1 and a free port until the block ends;
    yields the base URL once ``/health`` answers (or after ``wait_s`` seconds, when the first request will say
    why). ``sndbuf``: the kernel send buffer of each accepted connection, bytes (fixed, not autotuned: a client
    that stops reading stalls the server's sends after a few KB instead of megabytes)."""
    import httpx
    import uvicorn

    from . import create_app

    listener = socket.socket()
    if sndbuf is not None:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(srv), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=uv.run, kwargs={"sockets": [listener]}, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        uv.should_exit = True
        th.join(timeout=10)
        listener.close()
