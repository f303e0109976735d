"""The shared store (rows in PostgreSQL, KV segments in an object store) beyond the behaviour suite that
tests/test_store_safety.py runs on every backend: writers on many processes, PostgreSQL's own refusals, bad
locations as one-line errors, ``kvmem store copy`` and ``Memory`` on a shared store. PostgreSQL is a real
throwaway cluster (``conftest.postgres``); the object store is a ``file://`` URL through obstore, or a real S3
server (``conftest.s3``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import torch
from typer.testing import CliRunner

import store_worker as sw
from conftest import postgres_schema, store_backend
from kvmem.cli import app
from kvmem.store import Store, StoreError, StoreMismatch, Write

WORKER = [sys.executable, str(Path(__file__).with_name("store_worker.py"))]


@pytest.fixture(params=["local", "postgres", "s3"])
def backend(request, monkeypatch):
    return store_backend(request, monkeypatch)


def test_concurrent_writers_lose_nothing(tmp_path, backend):
    """Two writer processes for one user and one each for two others: every acknowledged write is live and has
    exactly one ADD event, no version repeats, and each user's versions grow with its history."""
    st = sw.create(tmp_path / "s")
    root = str(st.root)
    plan = [("u", "a"), ("u", "b"), ("v", "c"), ("w", "d")]
    procs = [subprocess.Popen(WORKER + ["adds", root, u, p, "25"], stdout=subprocess.PIPE, text=True) for u, p in plan]
    acked = {p: proc.communicate(timeout=300)[0].split() for (_, p), proc in zip(plan, procs)}
    assert all(proc.returncode == 0 for proc in procs)
    assert all(len(ids) == 25 for ids in acked.values())
    versions = []
    for user, prefixes in (("u", "ab"), ("v", "c"), ("w", "d")):
        live = {f.fact_id for f in st.reads.snapshot(user).facts}
        assert live == {i for p in prefixes for i in acked[p]}
        events = st.reads.events(user)
        assert sorted(e["memory_id"] for e in events if e["event"] == "ADD") == sorted(live)
        vs = [v for (v,) in st.rows.execute('SELECT version FROM history WHERE "user"=? ORDER BY id', (user,))]
        assert vs == sorted(vs) and int(st.reads.version(user)) == vs[-1]
        versions += vs
    assert len(versions) == len(set(versions)) == 100


def test_writes_for_different_users_do_not_wait_for_each_other(tmp_path, postgres, monkeypatch):
    """On PostgreSQL a writer holds only its user's lock: while this process holds user u's, a writer of v
    commits, and a writer of u waits until u's lock is released (then commits)."""
    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", "postgres")
    st = sw.create(tmp_path / "s")
    root = str(st.root)
    with st.writes.writer("u"):
        other = subprocess.run(WORKER + ["adds", root, "v", "x", "2"], capture_output=True, text=True, timeout=60)
        assert other.returncode == 0 and other.stdout.split() == ["x0", "x1"]
        same = subprocess.Popen(WORKER + ["adds", root, "u", "y", "1"], stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        assert same.poll() is None  # waiting for u's lock
    assert same.communicate(timeout=60)[0].split() == ["y0"]
    assert [f.fact_id for f in st.reads.snapshot("u").facts] == ["y0"]
    with st.writes.writer(None):  # fsck and reset take the store-wide lock: every writer waits
        blocked = subprocess.Popen(WORKER + ["adds", root, "v", "z", "1"], stdout=subprocess.PIPE, text=True)
        time.sleep(2)
        assert blocked.poll() is None
    assert blocked.communicate(timeout=60)[0].split() == ["z0"]


def test_postgres_store_opens_without_writing_and_checks_its_schema(tmp_path, postgres, monkeypatch):
    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", "postgres")
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    url = str(st.root)
    with pytest.raises(StoreError, match="already holds a kvmem store"):
        Store.create(url, sw.FP, "h", [1], kv[0], kv[0].clone(), {"name": "e"}, segments_url=(tmp_path / "kv").as_uri())
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE turns")
        opened = Store.open(url)
        with pytest.raises(StoreError, match='relation "turns" does not exist'):
            opened.reads.turns("u")
        assert conn.execute("SELECT to_regclass('turns')").fetchone()[0] is None  # not re-created
        conn.execute("UPDATE kvmem_manifest SET schema_version = 1")
    with pytest.raises(StoreError, match="schema version 1 is not 4"):
        Store.open(url)


def test_bad_locations_are_one_line_errors_exit_2(tmp_path, postgres):
    """Unreachable database, wrong user (credentials), a typo in the scheme, a missing database, an empty one, a
    shared store without --segments, a bad segments URL, another model's shared store: one line, exit 2, and no
    password in it."""
    sock = postgres.split("host=", 1)[1]
    empty = postgres_schema(postgres, "empty_one")
    cases = [
        (f"postgresql://postgres@/postgres?host={tmp_path}/nowhere", "cannot connect to PostgreSQL"),
        (f"postgresql://nobody:s3cret-pw@/postgres?host={sock}", 'role "nobody" does not exist'),
        (f"postgressql://postgres@/postgres?host={sock}", "is not a store location"),
        ("s3://bucket/prefix", "KV segments go by --segments URL"),
        (f"postgresql://postgres@/no_such_db?host={sock}", 'database "no_such_db" does not exist'),
        (empty, "no kvmem store at postgresql://postgres@/postgres"),
    ]
    for url, why in cases:
        res = CliRunner().invoke(app, ["memory", "list", "--store", url, "--user", "u"])
        assert res.exit_code == 2 and why in res.output, (url, res.output)
        assert "s3cret" not in res.output and "Traceback" not in res.output and res.output.count("\n") == 1
    add = [
        "memory",
        "add",
        "--store",
        empty,
        "--user",
        "u",
        "--no-infer",
        "-m",
        "x",
        "--model",
        "smollm2-135m-instruct",
    ]
    res = CliRunner().invoke(app, add)
    assert res.exit_code == 2 and "give --segments URL" in res.output, res.output
    res = CliRunner().invoke(app, [*add, "--segments", "s4://bucket/kv"])
    assert res.exit_code == 2 and "s4://bucket/kv" in res.output and "Traceback" not in res.output, res.output
    st = Store.create(
        empty, {**sw.FP, "model": "other"}, "h", [1], torch.zeros(2, 1, 1, 64), torch.zeros(2, 1, 1, 64),
        {"name": "e", "dim": 4}, segments_url=(tmp_path / "kv").as_uri(),
    )  # fmt: skip
    st.close()
    with pytest.raises(StoreMismatch, match="does not match"):
        Store.open(empty, sw.FP)
    res = CliRunner().invoke(app, ["ask", "q", "--store", empty, "--user", "u", "--engine", "hf"])
    assert res.exit_code == 2 and "unknown user 'u'" in res.output, res.output


def test_readers_cache_segments_on_local_disk(tmp_path, postgres, monkeypatch):
    """``cache_dir``: the first read of a shared segment fetches it into a byte-bounded local disk cache; later
    reads (other Store objects too) read that copy, exactly; a corrupt copy is refused once, then fetched again;
    a cache too small for a segment still serves it. The counters say which happened."""
    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", "postgres")
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 7, big=True)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    cache = tmp_path / "cache"
    reader = Store.open(st.root, cache_dir=cache)
    assert sw.check(reader.reads.snapshot("u")) == 7
    s = reader.reads.cache_stats()
    assert (s["disk_misses"], s["disk_hits"], s["kv_misses"]) == (1, 0, 3) and s["disk_fetched_bytes"] > 3 * 2**20
    assert s["disk_cache_bytes"] >= s["disk_fetched_bytes"]
    reader.reads.forget()  # memory only: the disk copy stays
    assert sw.check(reader.reads.snapshot("u")) == 7 and reader.reads.cache_stats()["disk_hits"] == 1
    assert sw.check(reader.reads.snapshot("u")) == 7 and reader.reads.cache_stats()["kv_hits"] == 3  # from memory now
    other = Store.open(st.root, cache_dir=cache)
    assert sw.check(other.reads.snapshot("u")) == 7
    assert (other.reads.cache_stats()["disk_hits"], other.reads.cache_stats()["disk_misses"]) == (1, 0)
    (copy,) = list(cache.rglob("*.val"))
    data = bytearray(copy.read_bytes())
    data[-7] ^= 0xFF
    copy.write_bytes(bytes(data))
    third = Store.open(st.root, cache_dir=cache)
    with pytest.raises(StoreError, match="fails its checksum"):
        third.reads.snapshot("u").gather([0])
    assert sw.check(third.reads.snapshot("u")) == 7  # the bad copy was dropped and fetched again
    tiny = Store.open(st.root, cache_dir=tmp_path / "tiny", cache_dir_bytes=1)
    assert sw.check(tiny.reads.snapshot("u")) == 7
    assert tiny.reads.cache_stats()["disk_evictions"] == 1  # cached, then pushed out by the 1-byte bound
    # prefetch along the retrieval path: the segment is fetched before the read, which then finds it on disk
    ahead = Store.open(st.root, cache_dir=tmp_path / "ahead")
    snap = ahead.reads.snapshot("u")
    for future in ahead.reads.prefetch(snap, [0, 2]):
        future.result()
    assert (ahead.reads.cache_stats()["disk_misses"], ahead.reads.cache_stats()["disk_hits"]) == (1, 0)
    assert sw.check(snap) == 7
    s = ahead.reads.cache_stats()
    assert (s["disk_misses"], s["disk_hits"]) == (1, 1)
    assert sw.check(snap) == 7 and ahead.reads.cache_stats()["kv_misses"] == s["kv_misses"]  # all from memory
    # a cold read (load tests): out of the memory tier and the disk cache, so the store itself serves it again
    ahead.reads.evict(snap, [0])
    assert sw.check(snap) == 7
    c = ahead.reads.cache_stats()
    assert (c["disk_misses"], c["disk_hits"]) == (2, 1) and c["kv_misses"] == 2 * s["kv_misses"]
    # a read racing the prefetch of its segment waits for that one fetch instead of fetching it again
    racing = Store.open(st.root, cache_dir=tmp_path / "racing")
    inner, fetch = racing.segments.inner, racing.segments.inner.read
    monkeypatch.setattr(inner, "read", lambda name: (time.sleep(0.5), fetch(name))[1])
    snap = racing.reads.snapshot("u")
    futures = racing.reads.prefetch(snap, [0])
    assert sw.check(snap) == 7  # while the prefetch is still fetching
    assert [f.result() for f in futures] == [None]
    assert racing.reads.cache_stats()["disk_misses"] == 1


def test_lost_database_connections(tmp_path, postgres, monkeypatch):
    """A connection that died while idle (PostgreSQL restarted, an idle timeout, a network cut; here the backend
    is terminated) is replaced before the next read and the next write, which succeed. A writer whose own
    connection (the one holding its lock) dies mid-write fails with StoreUnavailable and commits nothing, never
    going on without its lock; the previous version stays served and the next write works."""
    from kvmem.store import StoreUnavailable

    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", "postgres")
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 3)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)

    def kill(pid):
        with psycopg.connect(postgres, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0] is True
        time.sleep(0.2)

    kill(st.rows.conn.info.backend_pid)
    kill(st.rows._idle[0].info.backend_pid)  # the pooled writer connection, idle
    st.reads.forget()
    assert sw.check(st.reads.snapshot("u")) == 3
    facts, kv, emb = sw.generation("u", 4)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    assert sw.check(st.reads.snapshot("u")) == 4
    real_put = st.segments.put

    def put_then_lose_the_lock(name, tensors, metadata):
        digest = real_put(name, tensors, metadata)
        kill(st.rows.conn.info.backend_pid)  # this thread's connection: the writer's, with its lock
        return digest

    monkeypatch.setattr(st.segments, "put", put_then_lose_the_lock)
    facts, kv, emb = sw.generation("u", 5)
    with pytest.raises(StoreUnavailable):
        st.writes.put_user("u", facts, kv, kv, emb, window=0)
    monkeypatch.undo()
    fresh = Store.open(st.root)
    assert sw.check(fresh.reads.snapshot("u")) == 4
    facts, kv, emb = sw.generation("u", 6)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    assert sw.check(fresh.reads.snapshot("u")) == 6
    assert fresh.fsck()["bad"] == {}


def test_both_row_backends_satisfy_the_seam(tmp_path, postgres):
    """``SQLiteRows`` and ``PostgresRows`` implement every method of ``Rows`` with its parameters, and behave the
    same through it: nothing there before ``create``, then the manifest and header as written; versions only grow;
    a write transaction is all or nothing; a snapshot does not see a commit made during it; another holder of a
    user's writer lock makes ``locked`` raise StoreBusy after its timeout, while another user's lock is free."""
    from kvmem.engines.base import check_implements
    from kvmem.store import StoreBusy, backends, rows
    from kvmem.store.postgres_rows import PostgresRows
    from kvmem.store.sqlite_rows import SQLiteRows

    for impl in (SQLiteRows, PostgresRows):
        assert check_implements(impl, rows.Rows) == [], impl
    url = postgres_schema(postgres, "rows_seam")
    for make in (lambda: backends.open_rows(tmp_path / "d"), lambda: backends.open_rows(url)):
        r, other = make(), None
        assert not r.exists()
        r.create({"format": 3, "store_id": "abc"}, b"header bytes")
        assert r.exists() and r.manifest()["store_id"] == "abc" and r.header() == b"header bytes"
        with r.transaction():
            v1 = r.next_version()
        with r.transaction():
            v2 = r.next_version()
        assert v2 > v1
        with pytest.raises(ZeroDivisionError), r.transaction():
            r.execute("INSERT INTO meta (key, value) VALUES (?, ?)", ("k", 1))
            raise ZeroDivisionError
        assert r.execute("SELECT COUNT(*) FROM meta WHERE key=?", ("k",)).fetchone()[0] == 0
        other = make()
        with r.snapshot():
            before = r.execute("SELECT COUNT(*) FROM meta").fetchone()[0]
            with other.transaction():
                other.execute("INSERT INTO meta (key, value) VALUES (?, ?)", ("k", 2))
            assert r.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == before
        assert r.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == before + 1
        with other.locked("u", None):
            with pytest.raises(StoreBusy), r.locked("u", 0.3):
                pass
            if isinstance(r, PostgresRows):  # a local store has one lock for every user
                with r.locked("v", 0.3):
                    pass
        with r.locked("u", 0.3):
            pass
        assert r.nbytes() > 0
        r.close()
        other.close()


def test_serve_on_a_shared_store(tmp_path, postgres):
    """``kvmem serve`` on a shared store (the transformers engine, in-process): memories written over REST land in
    PostgreSQL and the object store; a kv-mode chat injects them (the same prompt as prompt mode, the memory
    counted as cached); a second server on the same store, as another replica would, sees the writes at once and
    reads the segments through its disk cache; ``/metrics`` counts it."""
    import httpx

    from conftest import http_server
    from kvmem.server import KvmemServer

    url = postgres_schema(postgres, "serve_shared")
    objects, fast = (tmp_path / "kv").as_uri(), "smollm2-135m-instruct"
    one = KvmemServer.start(url, model=fast, engine="hf", dtype="float32", window=2, segments_url=objects)
    facts = ["Rui grows tomatoes on his balcony.", "Rui's daughter is called Inês.", "Rui commutes by ferry."]
    with http_server(one) as base:
        for f in facts:
            r = httpx.post(f"{base}/v1/memories", json={"messages": f, "user_id": "rui", "infer": False}, timeout=120)
            assert r.status_code == 200, r.text
    one.close()
    assert len(list((tmp_path / "kv").glob("*/*.kv.safetensors"))) == 3
    two = KvmemServer.start(url, engine="hf", dtype="float32", cache_dir=str(tmp_path / "cache"))
    with http_server(two) as base:
        listed = httpx.get(f"{base}/v1/memories", params={"user_id": "rui"}).json()["results"]
        assert sorted(m["memory"] for m in listed) == sorted(facts)
        usage = {}
        for mode in ("kv", "prompt"):
            body = {
                "model": fast,
                "messages": [{"role": "user", "content": "How does Rui get to work?"}],
                "user": "rui",
                "max_tokens": 6,
                "memory": {"top_k": 3, "mode": mode},
            }
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usage[mode] = r.json()["usage"]
        assert usage["kv"]["prompt_tokens"] == usage["prompt"]["prompt_tokens"]
        assert usage["kv"]["prompt_tokens_details"]["cached_tokens"] > 20
        assert usage["prompt"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = httpx.get(f"{base}/metrics").text
        reads = {
            line.split('counter="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvmem_store_reads{")
        }
        assert reads["disk_misses"] == 3 and reads["disk_fetched_bytes"] > 0 and reads["kv_misses"] >= 3
    two.close()


def test_racing_creators_get_one_store_and_one_clear_error(tmp_path, postgres):
    """Two processes creating a store at one location at once: one creates it, the other gets StoreError
    ("already holds"), never a half-made schema or a raw unique violation."""
    url = postgres_schema(postgres, "create_race")
    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); import store_worker as sw; from kvmem.store import Store, "
        "StoreError\nh = torch.zeros(2, 1, 3, 64)\ntry:\n    Store.create(sys.argv[1], sw.FP, 'hdr', [1, 2, 3], h, "
        "h.clone(), {'name': 'e', 'dim': 4}, segments_url=sys.argv[2]).close(); print('created')\nexcept StoreError "
        "as e:\n    print('refused' if 'already holds' in str(e) else e)"
    )
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, url, (tmp_path / "kv").as_uri()], stdout=subprocess.PIPE, text=True, cwd=root
        )
        for _ in range(3)
    ]
    outs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outs == ["created", "refused", "refused"], outs
    assert Store.open(url).fingerprint == sw.FP


def test_urls_with_spaces_passwords_and_queries(tmp_path, postgres):
    """A ``file://`` segments URL of a path with a space or non-ASCII letters (percent-encoded) is written and read
    where obstore puts it; a password, given in the user part (percent-encoded) or as ``?password=``, is what
    ``location.password`` returns and is gone from ``location.canonical`` (what an engine's logged config gets)."""
    from kvmem.store import location

    where = tmp_path / "with space ünï"
    st = Store.create(
        postgres_schema(postgres, "spaces"), sw.FP, "h", [1], torch.zeros(2, 1, 1, 64), torch.zeros(2, 1, 1, 64),
        {"name": "e", "dim": 4}, segments_url=where.as_uri(),
    )  # fmt: skip
    facts, kv, emb = sw.generation("u", 2)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    assert sw.check(Store.open(st.root).reads.snapshot("u")) == 2 and len(list(where.glob("*/*.kv.safetensors"))) == 1
    for url, pw in (
        ("postgresql://kv:p%40ss%2Fw0rd@db:5432/mem?options=-csearch_path%3Dx", "p@ss/w0rd"),
        ("postgresql://kv@db/mem?sslmode=require&password=s3cret", "s3cret"),
    ):
        assert location.password(url) == pw
        assert pw not in location.canonical(url)
        assert "w0rd" not in location.redact(url) and "s3cret" not in location.redact(url)
        assert location.canonical(url).startswith("postgresql://kv@db")


def test_copy_into_s3_and_back(tmp_path, postgres, s3, monkeypatch):
    """``kvmem store copy``'s function from a local store into PostgreSQL with its segments on S3, then back into
    a directory: every fact and its KV arrive (checked against their generation), the segments are objects in the
    bucket, and the S3 server served ranged reads of them."""
    from kvmem.store import copy_store

    monkeypatch.delenv("KVMEM_TEST_SEGMENTS", raising=False)
    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 3)
    st.writes.put_user("u", facts, kv, kv, emb, window=0)
    url = postgres_schema(postgres, "copy_s3")
    there = copy_store(st.root, url, segments_url="s3://kvmem/copy-s3")
    before = s3.calls().get("GET range", 0)
    back = copy_store(url, tmp_path / "back")
    assert there["facts"] == back["facts"] == sw.N_FACTS
    shared = Store.open(url)
    assert (
        sw.check(shared.reads.snapshot("u")) == 3 and sw.check(Store.open(tmp_path / "back").reads.snapshot("u")) == 3
    )
    (name,) = shared.segments.names()
    assert (s3.root / "data" / "kvmem" / "copy-s3" / shared.manifest["store_id"] / name).is_file()
    assert s3.calls().get("GET range", 0) > before


def _add(st, user: str, fid: str, value: float = 1.0) -> None:
    f = sw.FactRecord(fid, user, fid, "", "", "", (1, 2), 0, 0)
    k = torch.full((2, 1, 2, 64), value)
    st.writes.commit(Write(user, [f], [k], [k.clone()], torch.ones(1, 4) / 2))


SCOPES = [
    "acme:alice",
    "acme:alice/agent:travel",
    "acme:alice/agent:travel/run:r1",
    "acme:/agent:travel",
    "acme:/run:r1",
    "acme:bob/run:r1",
    "acme:alicex",
    "globex:alice",
    "globex:/agent:travel",
    "alice",
    "/agent:travel",
]


def test_scope_reads_use_the_scope_index_and_follow_the_callers_scopes(tmp_path, backend):
    """A read naming fewer than all three ids, and ``/v1/entities``' listing, find the caller's scopes through
    the scope index: the same scopes the old listing of every user found, and (SQLite's statements traced) never
    a statement that lists every user or every fact of the store."""
    from kvmem import Memory
    from kvmem.scopes import Scope, parse_key

    st = sw.create(tmp_path / "s")
    for i, key in enumerate(SCOPES):
        _add(st, key, f"f{i}")
    st.writes.commit(
        Write("acme:bob/run:r1", delete=["f5"])
    )  # a scope with no live memory: read, never listed as an entity
    m = Memory(st.root)
    cases = [({"user_id": "alice"}, ns) for ns in ("acme", "globex", None)] + [
        ({"agent_id": "travel"}, "acme"),
        ({"agent_id": "travel"}, None),
        ({"run_id": "r1"}, "acme"),
        ({"user_id": "alice", "agent_id": "travel"}, "acme"),
        ({"user_id": "alice", "run_id": "r1"}, "acme"),
        ({"agent_id": "travel", "run_id": "r1"}, "acme"),
        ({"user_id": "nobody"}, "acme"),
    ]
    statements = []
    if backend == "local":
        m.store.rows.db.set_trace_callback(statements.append)
    for ids, ns in cases:
        named = Scope.of(**ids)
        want = sorted(  # what listing every user found
            k
            for k in st.reads.users(with_no_live_facts=True)
            if (s := parse_key(k, ns)) is not None and all(getattr(s, n) == v for n, v in named.ids().items())
        )
        got = {r["memory"] for r in m.get_all(filters=ids, namespace=ns, top_k=100)["results"]}
        assert got == {f"f{SCOPES.index(k)}" for k in want if k != "acme:bob/run:r1"}, (ids, ns)
    if backend == "local":
        m.store.rows.db.set_trace_callback(None)
        whole = [s for s in statements if "FROM users ORDER BY" in s or 'DISTINCT "user" FROM facts' in s]
        assert not whole, whole
        plans = [
            " ".join(r[-1] for r in m.store.rows.db.execute("EXPLAIN QUERY PLAN " + s))
            for s in statements
            if "FROM scopes" in s
        ]
        assert plans and all("SCAN s" not in p and "USING" in p for p in plans), plans
    live = [k for k in sorted(SCOPES) if k != "acme:bob/run:r1"]
    for ns in ("acme", "globex"):
        assert m.entity_scopes(ns) == [parse_key(k, ns) for k in live if k.startswith(f"{ns}:")]
    m.close()
    st.close()


def test_memory_reads_never_wait_for_another_users_commit_upload(tmp_path, backend):
    """While one user's commit uploads its segment (held back 3 s here), reads of another user (a snapshot,
    ``get_all``, the scope lookup) answer at once: the upload holds that user's writer lock, not the lock every
    read takes."""
    import threading

    from kvmem import Memory

    st = sw.create(tmp_path / "s")
    _add(st, "acme:other", "o1")
    m = Memory(st.root)
    put = m.store.segments.put
    started = threading.Event()

    def slow_put(*args):
        started.set()
        time.sleep(3)
        return put(*args)

    m.store.segments.put = slow_put
    writer = threading.Thread(target=_add, args=(m.store, "acme:slow", "s1"))
    writer.start()
    assert started.wait(10)
    t0 = time.perf_counter()
    got = m.get_all(user_id="other", namespace="acme")["results"]
    snap = m.store.reads.snapshot("acme:other")
    waited = time.perf_counter() - t0
    writer.join()
    assert [r["memory"] for r in got] == ["o1"] and len(snap.facts) == 1
    assert waited < 1.5, f"a read waited {waited:.2f} s behind another user's upload"
    assert [f.fact_id for f in m.store.reads.snapshot("acme:slow").facts] == ["s1"]
    m.close()
    st.close()


UPDATER = """
import pathlib, sys, time
from kvmem import Memory
loc, fid, sig = sys.argv[1:4]
m = Memory(loc, dtype="float32")
m.lm, m.embedder  # loaded before the race
write = m._write
def held(*args, **kwargs):  # this replica has read the memory; it commits once the other one has
    pathlib.Path(sig + ".read").touch()
    while not pathlib.Path(sig + ".go").exists():
        time.sleep(0.05)
    return write(*args, **kwargs)
m._write = held
try:
    m.update(fid, metadata={"by": "b"})
    print("updated")
except Exception as exc:  # MemoryConflict
    print("conflict:" if type(exc).__name__ == "MemoryConflict" else "error:", exc)
"""


@pytest.mark.slow  # two processes load the smallest model (about 15 s)
def test_two_replicas_updating_one_memory_lose_no_update(tmp_path, backend):
    """Two processes (replicas) update one memory: B reads it, A updates its text and commits, then B commits its
    metadata change. B's update is a compare-and-set on the version it read, so it raises MemoryConflict and
    writes nothing: A's text stays (before, B silently wrote the old text back). B's retry then succeeds."""
    from kvmem import Memory
    from kvmem.models import load

    loc = sw.location(tmp_path / "s")
    lm = load("smollm2-135m-instruct", dtype="float32")
    a = Memory(loc, model=lm, window=0, neighbours=0, segments_url=sw.segments_url(tmp_path / "s"))
    fid = a.add("Jo lives in Lisbon.", user_id="jo", infer=False)["results"][0]["id"]
    sig = str(tmp_path / "sig")
    b = subprocess.Popen([sys.executable, "-c", UPDATER, str(a.store.root), fid, sig], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not Path(sig + ".read").exists():
        assert b.poll() is None and time.monotonic() < deadline, b.stderr.read() if b.poll() is not None else "slow"
        time.sleep(0.1)
    a.update(fid, text="Jo lives in Porto.")
    Path(sig + ".go").touch()
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    assert out.startswith("conflict:") and fid in out, out
    got = a.get(fid)
    assert got["memory"] == "Jo lives in Porto." and "by" not in (got["metadata"] or {})
    assert [e["event"] for e in a.history(fid)] == ["ADD", "UPDATE"]
    a.update(fid, metadata={"by": "b"})  # the retry reads the new version
    got = a.get(fid)
    assert got["memory"] == "Jo lives in Porto." and got["metadata"] == {"by": "b"}
    a.close()
