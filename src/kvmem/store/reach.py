"""Whether one remote service of a store (its PostgreSQL rows, its object store's segments) answers now.

A service found unreachable once (by a probe, or by any call that got no answer: ``mark_down``) fails every call
at once (``check_up``: StoreUnavailable) instead of each call waiting out its own timeout, until a background
probe gets an answer. ``available`` is the readiness answer a server's ``/ready`` gives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .location import StoreUnavailable

PROBE_TIMEOUT_S = 2.0  # a probe (SELECT 1, a HEAD of the object store) waits this long at most: no answer, down
PROBE_EVERY_S = 1.0  # while a service is unavailable, it is probed this often (in the background)


class Reach:
    """Reachability of one service, probed by ``probe`` (a call bounded by its own timeout: True when the
    service answered, False otherwise; it must not raise).

    ``what`` names the service in StoreUnavailable's message ("PostgreSQL at host/db"); ``every_s``: while it is
    down, and for ``available``, the probe runs at most this often, one at a time; ``thread``: the background
    prober's name. Thread-safe."""

    def __init__(self, probe: Callable[[], bool], what: str, every_s: float, thread: str):
        self._probe_fn, self.what, self.every_s, self._thread = probe, what, every_s, thread
        self.down_since: float | None = None  # time.monotonic() when it was found unreachable (None: reachable)
        self._down_lock, self._probe_lock = threading.Lock(), threading.Lock()
        self._prober: threading.Thread | None = None
        self._probed = (0.0, True)  # (when, answered) of the last readiness probe
        self._closed = False

    def mark_down(self) -> None:
        """Found unreachable: every ``check_up`` fails from now on, and a background probe (one per service)
        looks for it every ``every_s`` until it answers (none after ``close``)."""
        with self._down_lock:
            if self.down_since is None:
                self.down_since = time.monotonic()
            if self._closed or (self._prober is not None and self._prober.is_alive()):
                return
            self._prober = threading.Thread(target=self._probe_until_up, name=self._thread, daemon=True)
            self._prober.start()

    def check_up(self) -> None:
        """Raises StoreUnavailable, at once, while the service is marked unreachable."""
        since = self.down_since
        if since is not None:
            raise StoreUnavailable(f"{self.what} has not answered for {time.monotonic() - since:.0f} s")

    def probe(self, wait: bool = True) -> bool | None:
        """One probe (False after ``close``); None, without waiting, when ``wait`` is False and another probe is
        under way."""
        if not self._probe_lock.acquire(blocking=wait):
            return None
        try:
            return False if self._closed else bool(self._probe_fn())
        finally:
            self._probe_lock.release()

    def _probe_until_up(self) -> None:
        while not self._closed:
            if self.probe():
                with self._down_lock:
                    self.down_since = None
                self._probed = (time.monotonic(), True)
                return
            time.sleep(self.every_s)

    def available(self) -> bool:
        """False at once while marked unreachable; else the last probe's answer, probed again when it is older
        than ``every_s`` (one at a time: a caller meanwhile gets the last answer and never waits); a probe without
        an answer marks it unreachable."""
        if self.down_since is not None:
            return False
        at, ok = self._probed
        if time.monotonic() - at >= self.every_s:
            got = self.probe(wait=False)
            if got is not None:
                ok = got
                self._probed = (time.monotonic(), ok)
                if not ok:
                    self.mark_down()
        return ok and self.down_since is None

    def close(self) -> None:
        """No probe runs after this returns (one under way is waited for); the background prober stops."""
        self._closed = True
        with self._probe_lock:
            pass
