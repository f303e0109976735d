"""The store's size for ``/metrics`` (``kvmem_store_bytes``), measured on a background thread, never on the event
loop nor in a scrape.

``Store.disk_bytes`` walks every file of a local store, or lists every object under an object store's prefix:
seconds at a few hundred thousand files. Here one daemon thread, with its own ``Store`` object (so the walk never
holds the serving store's lock), measures it every ``every_s`` seconds (longer when a walk is slow: never more
than a tenth of the thread's time); a scrape reads the last figure. With ``--replicas`` only the ingress measures
it (``ingress``), once for the shared store, not once per replica.
"""

from __future__ import annotations

import logging
import threading
import time

from ..store import Store
from .schemas import redact_text

logger = logging.getLogger("kvmem.server")


class StoreSize:
    """``value()``: the store's bytes at the last measurement (NaN before the first); ``measurements``: how many
    have run; ``seconds``: how long the last one took. ``location``: the store (a directory or a URL); ``measure``:
    a function returning bytes instead (tests)."""

    def __init__(self, location=None, every_s: float = 60.0, measure=None):
        self.location, self.every_s, self._measure = location, every_s, measure
        self._bytes, self.measurements, self.seconds = float("nan"), 0, 0.0
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvmem-store-size", daemon=True)
        self._thread.start()

    def value(self) -> float:
        return self._bytes

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if self._measure is not None:
                    n = self._measure()
                else:
                    store = store or Store.open(self.location)
                    n = store.disk_bytes()
                self._bytes, self.measurements = float(n), self.measurements + 1
            except Exception as exc:  # a gauge never takes the server down; the next round tries again
                if not self._warned:
                    self._warned = True
                    logger.warning("cannot measure the store's size for /metrics: %s", redact_text(str(exc)))
            self.seconds = time.monotonic() - t0
            self._stop.wait(max(self.every_s, 10 * self.seconds))
        if store is not None:
            store.close()

    def close(self) -> None:
        """Stop the thread (it finishes a measurement under way first, in the background)."""
        self._stop.set()
