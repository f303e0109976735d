"""A slow or unreachable PostgreSQL: every connection is bounded (connect, statement and lock timeouts, keepalives,
a client-side bound on each answer), a stall is noticed once and then answered at once, and everything works again
when the database does.

The stall is real: this module's own throwaway cluster (``scripts/postgres.sh``, not the session's shared one) has
its postmaster and every backend stopped with SIGSTOP, then resumed with SIGCONT. Its store URL sets
``statement_timeout`` to 1 s (a URL's own setting wins over kvmem's), so a stalled statement is given up after
1 + ``ANSWER_GRACE_S`` = 3 s."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import psutil
import pytest
import torch

import store_worker as sw
from kvmem.store import Store, StoreUnavailable, Write, postgres_rows

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[1]
FAST = "smollm2-135m-instruct"
BOUND_S = 1 + postgres_rows.ANSWER_GRACE_S  # the URL's statement_timeout + the grace


@pytest.fixture(scope="module")
def cluster():
    """(url, data directory) of a cluster of this module's own, so that stopping it freezes no other test."""
    where = tempfile.mkdtemp(prefix="kvmem-pg-stall-")
    script = str(ROOT / "scripts" / "postgres.sh")
    url = subprocess.run(["bash", script, "start", where], env={**os.environ, "PG_FSYNC": "off"},
                         capture_output=True, text=True)  # fmt: skip
    if url.returncode == 2 and "PostgreSQL is not installed" in url.stderr:
        shutil.rmtree(where, ignore_errors=True)
        pytest.skip(url.stderr.strip())
    url.check_returncode()
    yield url.stdout.strip(), Path(where) / "data"
    subprocess.run(["bash", script, "stop", where], capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


@contextmanager
def stalled(data: Path):
    """The cluster stopped (SIGSTOP: the postmaster, then every backend and helper), resumed on exit (SIGCONT)."""
    pm = psutil.Process(int((data / "postmaster.pid").read_text().split()[0]))
    stopped = []
    try:
        for p in [pm, *pm.children(recursive=True)]:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:  # a backend that ended after it was listed (an earlier test's session)
                continue
            stopped.append(p)
        yield
    finally:  # every process stopped is resumed, even when stopping the rest failed
        for p in reversed(stopped):
            with suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)


def store_url(base: str, name: str) -> str:
    """A fresh schema ``name`` whose sessions run with statement_timeout 1 s, set by the URL."""
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{name}"')
    return f"{base}&options=-c%20search_path%3D{name}%20-c%20statement_timeout%3D1s"


def timed(fn, *args):
    """(seconds, the exception ``fn`` raised or None)."""
    t = time.monotonic()
    try:
        fn(*args)
        return time.monotonic() - t, None
    except Exception as exc:
        return time.monotonic() - t, exc


def test_a_stalled_database_is_bounded_then_answered_at_once(cluster, tmp_path):
    """Every connection carries kvmem's timeouts and keepalives (the URL's own setting winning). With the database
    stopped, the first read gives up within the bound (StoreUnavailable), and every call after it (reads, writes,
    ``available``) fails at once, without waiting for the database again; opening the store gives up within its
    connect timeout. Resumed, the store is available again within seconds, every write acknowledged before the stall
    is there, and a new write commits."""
    base, data = cluster
    url = store_url(base, "bounded")
    head = torch.zeros(2, 1, 3, 64)
    st = Store.create(url, sw.FP, "hdr", [1, 2, 3], head, head.clone(), {"name": "e", "dim": 4},
                      segments_url=(tmp_path / "kv").as_uri())  # fmt: skip
    conn = st.rows.conn
    libpq = {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}
    assert {k: libpq[k] for k in postgres_rows.PG_CONNECT} == postgres_rows.PG_CONNECT
    # the server's side of TCP too (a vanished writer's session, and its advisory locks, end within ~25 s); a unix
    # socket, as here, reads those as 0, so the sent options are checked
    assert all(f"-c {k}={v}" in libpq["options"] for k, v in postgres_rows.PG_SESSION.items())
    assert libpq["options"].endswith("-c search_path=bounded -c statement_timeout=1s")  # the URL's own, last
    shown = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN ('statement_timeout', "
                              "'lock_timeout', 'idle_in_transaction_session_timeout')").fetchall())  # fmt: skip
    assert shown == {"statement_timeout": "1000", "lock_timeout": "10000",
                     "idle_in_transaction_session_timeout": "60000"}  # fmt: skip
    assert conn.answer_within_s == BOUND_S
    facts, kv, emb = sw.generation("u", 1)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    with stalled(data):
        st.reads.forget()
        took, exc = timed(st.reads.snapshot, "u")
        assert isinstance(exc, StoreUnavailable) and BOUND_S - 0.5 < took < BOUND_S + 2, (took, exc)
        facts, kv, emb = sw.generation("u", 2)
        for call in (lambda: st.reads.snapshot("u"), lambda: st.writes.put_user("u", facts, kv, kv, emb, window=0)):
            took, exc = timed(call)
            assert isinstance(exc, StoreUnavailable) and took < 0.2, (took, exc)
        took, exc = timed(lambda: assert_false(st.available()))
        assert exc is None and took < 0.2, (took, exc)
        took, exc = timed(Store.open, url.replace("?", "?connect_timeout=2&", 1))
        assert isinstance(exc, StoreUnavailable) and took < 5, (took, exc)
    t = time.monotonic()
    while not st.available():
        assert time.monotonic() - t < 5, "not available 5 s after the database resumed"
        time.sleep(0.1)
    st.reads.forget()
    assert sw.check(st.reads.snapshot("u")) == 1
    facts, kv, emb = sw.generation("u", 3)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    assert sw.check(Store.open(url).reads.snapshot("u")) == 3
    st.close()


def assert_false(value) -> None:
    assert value is False


def test_the_vllm_scheduler_side_holds_the_engine_core_at_most_a_second_once(cluster, tmp_path):
    """The scheduler side reads the store on vLLM's engine-core thread. With the database stopped, the first kv
    request waits at most ``KvmemScheduler.ANSWER_S`` and every later one not at all: each is a counted fallback to a
    plain prefill, so the engine keeps generating. Resumed, requests are injected again."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from types import SimpleNamespace as NS

    from kvmem.engines.vllm import scheduler as vs
    from kvmem.engines.vllm.config import Settings
    from kvmem.engines.vllm.params import MemoryRef, kvmem_cache_salt

    base, data = cluster
    head = torch.zeros(2, 1, 3, 64)
    st = Store.create(store_url(base, "scheduler"), sw.FP, "hdr", [1, 2, 3], head, head.clone(),
                      {"name": "e", "dim": 4}, segments_url=(tmp_path / "kv").as_uri())  # fmt: skip
    facts, kv, emb = sw.generation("u", 1)
    version = st.writes.commit(Write("u", facts, kv, kv.copy(), emb))
    identity = {k: st.fingerprint[k] for k in ("weights_sha256", "dtype")}
    conn = vs.KvmemScheduler(Settings(stores=[st.root], identity=identity))
    params = MemoryRef(str(st.root), st.manifest["store_id"], "u", version, [f.fact_id for f in facts]).to_params()
    ids = st.header_token_ids + [t for f in facts for t in f.token_ids]
    request = NS(kv_transfer_params=params, prompt_token_ids=ids + [7], request_id="r", num_prompt_tokens=len(ids) + 1,
                 cache_salt=kvmem_cache_salt(st.manifest["store_id"], "u", version))  # fmt: skip
    assert conn.get_num_new_matched_tokens(request, 0) == (len(ids), True)
    with stalled(data):
        took = []
        for _ in range(3):
            t = time.monotonic()
            assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
            took.append(time.monotonic() - t)
    assert took[0] < vs.KvmemScheduler.ANSWER_S + 0.5 and max(took[1:]) < 0.1, took
    assert conn.metrics["store_error"] == 3
    t = time.monotonic()
    while conn.get_num_new_matched_tokens(request, 0) != (len(ids), True):
        assert time.monotonic() - t < 5, "not injecting 5 s after the database resumed"
        time.sleep(0.1)
    st.close()


@pytest.mark.slow
def test_the_server_answers_503_during_a_stall_and_chats_without_memory_still_generate(cluster, tmp_path):
    """``kvmem serve`` (transformers engine, uvicorn) on a store whose database stops: ``/ready`` turns 503
    ``store_unavailable`` within seconds (a probe a second, each bounded); a memories read answers 503
    ``store_unavailable`` within the statement bound, then at once, with a body that names no URL and no database
    error; a chat with memory off still generates meanwhile. Resumed: ``/ready`` is 200 within seconds, the memory
    written before is listed, and a new write and a kv chat succeed."""
    from conftest import http_server
    from kvmem.server import KvmemServer

    base, data = cluster
    url = store_url(base, "served")
    srv = KvmemServer.start(url, model=FAST, engine="hf", dtype="float32", window=0,
                            segments_url=(tmp_path / "kv").as_uri())  # fmt: skip
    try:
        with http_server(srv) as api:
            r = httpx.post(f"{api}/v1/memories", json={"messages": "Ana keeps bees.", "user_id": "ana", "infer": False},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            assert httpx.get(f"{api}/ready", timeout=10).status_code == 200
            chat = {"model": FAST, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "user": "ana"}
            with stalled(data):
                t = time.monotonic()  # a probe at most once a second, each bounded by 2 s
                while (r := httpx.get(f"{api}/ready", timeout=30)).status_code == 200:
                    assert time.monotonic() - t < 5, "still ready 5 s into the stall"
                    time.sleep(0.1)
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
                for attempt in range(2):
                    t = time.monotonic()
                    r = httpx.get(f"{api}/v1/memories", params={"user_id": "ana"}, timeout=30)
                    took = time.monotonic() - t
                    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
                    assert took < (BOUND_S + 2 if attempt == 0 else 0.5), took
                    for leak in ("postgres", "host=", str(data.parent), "PostgreSQL", "answer"):
                        assert leak not in r.text, r.text
                r = httpx.post(f"{api}/v1/chat/completions", json={**chat, "memory": {"mode": "off"}}, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
            t = time.monotonic()
            while httpx.get(f"{api}/ready", timeout=10).status_code != 200:
                assert time.monotonic() - t < 10, "not ready 10 s after the database resumed"
                time.sleep(0.2)
            while (r := httpx.get(f"{api}/v1/memories", params={"user_id": "ana"}, timeout=30)).status_code != 200:
                assert time.monotonic() - t < 10, r.text  # the writes' store handle has its own probe
                time.sleep(0.2)
            assert [m["memory"] for m in r.json()["results"]] == ["Ana keeps bees."]
            r = httpx.post(f"{api}/v1/memories", json={"messages": "Ana lives in Porto.", "user_id": "ana",
                                                       "infer": False}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            r = httpx.post(f"{api}/v1/chat/completions", json={**chat, "memory": {"mode": "kv"}}, timeout=60)
            assert r.status_code == 200 and len(r.json()["kvmem"]["fact_ids"]) == 2, r.text
    finally:
        srv.close()
