"""``store.reach.Reach``, the availability of a store's remote service (its PostgreSQL rows, its object store),
on a probe of the test's own: no database, no object store, no model; under a second."""

from __future__ import annotations

import threading
import time

import pytest

from kvmem.store import StoreUnavailable
from kvmem.store.reach import Reach


def test_reach_fails_at_once_while_down_and_comes_back_with_its_service():
    """``store.reach.Reach``, which the PostgreSQL rows and the object store's segments both use: found down once,
    every call fails at once (no wait on the service) until the background probe gets an answer; ``available``
    probes at most once per interval and marks it down on no answer; no probe runs after ``close``."""
    up, calls = threading.Event(), []

    def probe() -> bool:
        calls.append(time.monotonic())
        return up.is_set()

    up.set()
    reach = Reach(probe, "the test service", 0.05, "test-probe")
    assert reach.available() and len(calls) == 1
    assert reach.available() and len(calls) == 1  # within the interval: the last answer, no probe
    reach.check_up()
    up.clear()
    time.sleep(0.06)
    assert not reach.available() and reach.down_since is not None  # no answer: marked down
    with pytest.raises(StoreUnavailable, match=r"^the test service has not answered for \d+ s$"):
        reach.check_up()
    n = len(calls)
    time.sleep(0.3)
    assert len(calls) > n + 2  # the background prober keeps looking while it is down
    assert not reach.available()
    up.set()
    deadline = time.monotonic() + 5
    while reach.down_since is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    reach.check_up()  # back: calls go through again
    assert reach.available()
    reach.close()
    n = len(calls)
    assert reach.probe() is False and len(calls) == n  # closed: no probe reaches the service
    reach.mark_down()
    time.sleep(0.2)
    assert len(calls) == n  # and no background prober starts
