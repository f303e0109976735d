"""``kvmem serve --replicas 2`` on a local Ray Serve: two transformers-engine replicas of the test model over one
shared store (the session's throwaway PostgreSQL, segments on local disk), behind one ingress. Real Ray, real
PostgreSQL, the real ``openai`` client; the server is the CLI in a subprocess, stopped with SIGTERM at the end.

Tests run in file order on one server: affinity, cross-replica visibility, tenants, the openai client, then a
replica killed under load, then SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from conftest import metric, postgres_schema

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FAST = "smollm2-135m-instruct"
KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
PASSWORD = "pg-pass-5f1c2e9a"  # PGPASSWORD of kvmem serve; the test cluster trusts local logins, so never asked for


@pytest.fixture(scope="module")
def cluster(postgres, tmp_path_factory):
    from kvmem.bench.common import free_port

    where = tmp_path_factory.mktemp("replicas")
    (where / "keys.json").write_text(json.dumps({KEY_A: "ta", KEY_B: "tb"}))
    url = postgres_schema(postgres, "replicas")
    port = free_port()
    cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--store", url, "--segments", (where / "kv").as_uri(),
           "--model", FAST, "--engine", "hf", "--window", "0", "--replicas", "2", "--port", str(port),
           "--api-keys", str(where / "keys.json"), "--timeout", "60", "--max-queue", "4", "--no-mcp-infer"]  # fmt: skip
    with open(where / "serve.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PGPASSWORD": PASSWORD},
        )  # the node's, as documented; fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, (where / "serve.log").read_text()[-3000:]
        try:
            if httpx.get(f"{base}/ready", headers=auth(KEY_A), timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the replicas did not start in 300 s"
        time.sleep(1)
    (where / "store-url").write_text(url)
    yield proc, base, where
    if proc.poll() is None:  # a failed test before the SIGTERM test
        os.killpg(proc.pid, signal.SIGKILL)


def auth(key: str, replica: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {key}"}
    if replica:
        h["X-Kvmem-Replica"] = replica
    return h


def chat(base, user, key=KEY_A, replica=None, question="What do I like?", **extra) -> dict:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": FAST, "user": user, "messages": [{"role": "user", "content": question}], "max_tokens": 2,
              **extra},
        headers=auth(key, replica),
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["x-kvmem-replica"] == r.json()["kvmem"]["replica"]
    return r.json()


def add(base, user, text, key=KEY_A, replica=None) -> tuple[str, str]:
    r = httpx.post(
        f"{base}/v1/memories",
        json={"user_id": user, "messages": [{"role": "user", "content": text}], "infer": False},
        headers=auth(key, replica),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["id"], r.headers["x-kvmem-replica"]


def replicas_of(base) -> dict[str, int]:
    """Replica id -> pid, from each replica's /ready (pinned)."""
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    ids = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines() if 'replica="' in line}
    out = {}
    for rid in ids:
        r = httpx.get(f"{base}/ready", headers=auth(KEY_A, rid), timeout=30).json()
        if r["replica"] == rid:
            out[rid] = r["pid"]
    return out


def two_users_on_two_replicas(base) -> dict[str, str]:
    """replica -> a user whose requests go there (16 users: all on one replica with probability 2^-15)."""
    seen = {}
    for i in range(16):
        seen.setdefault(chat(base, f"u{i}", memory={"mode": "off"})["kvmem"]["replica"], f"u{i}")
    assert len(seen) == 2, seen
    return seen


def test_each_user_stays_on_its_replica(cluster):
    _, base, _ = cluster
    for replica, user in two_users_on_two_replicas(base).items():
        assert {chat(base, user)["kvmem"]["replica"] for _ in range(20)} == {replica}
    assert metric(base, "kvmem_affinity_hit_rate") == 1.0
    assert metric(base, "kvmem_replicas_live") == 2
    assert 'kvmem_requests_total{replica="' in httpx.get(f"{base}/metrics").text  # replicas' metrics, labelled


def test_a_write_on_one_replica_is_seen_on_the_other_and_a_delete_on_neither(cluster):
    _, base, _ = cluster
    a, b = sorted(replicas_of(base))
    fid, where = add(base, "alice", "Alice keeps bees on her roof in Lisbon.", replica=a)
    assert where == a
    out = chat(base, "alice", replica=b, question="Where does Alice keep bees?")
    assert out["kvmem"]["replica"] == b and out["kvmem"]["fact_ids"] == [fid]
    home = chat(base, "alice")["kvmem"]["replica"]  # by memory id, routed to its owner's replica too
    assert httpx.get(f"{base}/v1/memories/{fid}", headers=auth(KEY_A), timeout=60).headers["x-kvmem-replica"] == home
    r = httpx.delete(f"{base}/v1/memories/{fid}", headers=auth(KEY_A, b), timeout=60)
    assert r.status_code == 200 and r.headers["x-kvmem-replica"] == b
    for rep in (a, b):
        assert fid not in chat(base, "alice", replica=rep)["kvmem"]["fact_ids"]
        r = httpx.post(f"{base}/v1/memories/search", json={"query": "bees", "user_id": "alice"},
                       headers=auth(KEY_A, rep), timeout=60)  # fmt: skip
        assert r.status_code == 200 and fid not in [m["id"] for m in r.json()["results"]]


def test_tenants_are_isolated_on_every_replica(cluster):
    _, base, _ = cluster
    fid, _ = add(base, "carol", "Carol's locker code is 4417.")
    for rep in replicas_of(base):
        r = httpx.get(f"{base}/v1/memories/{fid}", headers=auth(KEY_B, rep), timeout=60)
        assert r.status_code == 404 and r.headers["x-kvmem-replica"] == rep, r.text
        r = httpx.get(f"{base}/v1/memories/{fid}", headers=auth(KEY_A, rep), timeout=60)
        assert r.status_code == 200 and r.json()["memory"].startswith("Carol's locker")
        out = chat(base, "carol", key=KEY_B, replica=rep)  # tenant b's "carol" is another user: no memory
        assert out["kvmem"]["fact_ids"] == []
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401


def test_no_key_or_password_is_stored_by_ray(cluster, monkeypatch):
    """Ray keeps deployment arguments, runtime environments and Serve's checkpoints in its GCS, which the cluster's
    operators can read: read all of it (every internal KV namespace, the actor and job tables) from the cluster's
    GCS and find neither API key nor the store's password, in any spelling; the replicas still serve both
    tenants (they read the keys file and the password on their node)."""
    import asyncio
    from urllib.parse import quote

    from ray._raylet import Config, GcsClient

    proc, base, _ = cluster

    def args(p):
        try:
            return p.cmdline()
        except psutil.Error:  # a process that ended meanwhile
            return []

    address = next(  # this cluster's GCS (its raylet names it), not another Ray's on the machine
        a.split("=", 1)[1]
        for p in psutil.Process(proc.pid).children(recursive=True)
        for a in args(p)
        if a.startswith(("--gcs-address=", "--gcs_address="))
    )
    # a local ray.init turns on token auth (the token in ~/.ray/auth_token): this process must present it too
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    Config.initialize("")
    client = GcsClient(address=address)
    blobs = []
    for ns in (b"serve", b"fun", b"session", b"job", b"cluster", b"dashboard", b"healthcheck", b"tracing", None):
        for key in client.internal_kv_keys(b"", ns):
            blobs.append(key + b"=" + (client.internal_kv_get(key, ns) or b""))

    async def actor_table():  # Ray 2.60 has no synchronous call for it
        return await client.async_get_all_actor_info(timeout=30)

    actors = list(asyncio.run(actor_table()).values())
    blobs += [t.SerializeToString() for t in actors + list(client.get_all_job_info().values())]
    assert sum("Replica" in a.class_name for a in actors) >= 2  # the replicas' actors, with their runtime env
    assert any(b"serve-deployment-state-checkpoint" in b for b in blobs)  # and Serve's stored deployment config
    # what the replicas do get is readable there, in plain bytes: the deployment's arguments, its runtime env
    assert any(b"keys.json" in b for b in blobs) and any(b"KVMEM_THREADS" in b for b in blobs)
    for secret in (KEY_A, KEY_B, PASSWORD):
        for spelling in {secret.encode(), quote(secret).encode(), secret.encode("utf-16-le")}:
            assert not any(spelling in b for b in blobs), secret
    for key in (KEY_A, KEY_B):
        assert chat(base, "frank", key=key, memory={"mode": "off"})["choices"][0]["message"]["content"] is not None


def test_overload_is_refused_with_429_not_queued_without_bound(cluster):
    """--max-queue 4: each replica runs 4 requests at most and the ingress queues 4 more (Ray's
    ``max_queued_requests``); the rest of a burst of 24 gets 429s, nothing else."""
    import asyncio

    _, base, _ = cluster

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            body = {"model": FAST, "user": "eve", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}]}
            rs = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body, headers=auth(KEY_A)) for _ in range(24))
            )
        return [r.status_code for r in rs], [r.json()["error"]["code"] for r in rs if r.status_code == 429]

    codes, why = asyncio.run(burst())
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 4, codes  # at least the preferred replica's 4
    assert set(why) <= {"replicas_busy", "engine_busy"}, why


def test_openai_client_unchanged_streaming_included(cluster):
    from openai import OpenAI

    _, base, _ = cluster
    fid, _ = add(base, "dora", "Dora's cat is called Pixel.")
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY_A)
    msgs = [{"role": "user", "content": "What is my cat called?"}]
    r = client.chat.completions.create(model=FAST, messages=msgs, user="dora", max_tokens=8)
    assert r.choices[0].message.content and r.model_extra["kvmem"]["fact_ids"] == [fid]
    chunks = list(client.chat.completions.create(model=FAST, messages=msgs, user="dora", max_tokens=8, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer through either path
    assert chunks[-1].model_extra["kvmem"]["replica"] == r.model_extra["kvmem"]["replica"]


def test_mcp_through_the_ingress_reaches_the_users_replica(cluster):
    """The MCP tools behind the ingress: each request goes to the replica of the user its URL names (stateless
    streamable HTTP: every POST stands alone), and the SDK's client adds and finds a memory through it."""
    import anyio
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    _, base, _ = cluster
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
            "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}  # fmt: skip
    for replica, user in two_users_on_two_replicas(base).items():
        for url in (f"{base}/mcp?user_id={user}", f"{base}/mcp/u/{user}"):
            r = httpx.post(url, json=init, headers={**auth(KEY_A), "Accept": "application/json, text/event-stream"},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200 and r.headers["x-kvmem-replica"] == replica, r.text

    async def main():
        async with (
            httpx2.AsyncClient(headers=auth(KEY_A), timeout=120) as http,
            streamable_http_client(f"{base}/mcp?user_id=erin", http_client=http) as (read, write),
            ClientSession(read, write) as s,
        ):
            await s.initialize()
            added = json.loads((await s.call_tool("add_memories", {"text": "Erin rows on the Douro."})).content[0].text)
            found = json.loads((await s.call_tool("search_memory", {"query": "Where does Erin row?"})).content[0].text)
            return added["results"][0]["id"], found["results"]

    fid, found = anyio.run(main)
    assert found[0]["id"] == fid and found[0]["memory"] == "Erin rows on the Douro."


def test_bad_options_are_one_line_before_ray_starts(cluster):
    """Another model for the store, or a --segments it was not created with: exit 2 with one line, and no Ray
    (each run in this process: a refusal comes before anything starts)."""
    from conftest import kvmem_cli

    _, _, where = cluster
    url = (where / "store-url").read_text()
    for extra, says in (
        (
            ["--model", "gemma3-270m"],
            "was built with model 'smollm2-135m-instruct' and does not match the loaded model 'gemma3-270m'",
        ),
        (["--segments", "file:///elsewhere"], "--segments applies only when a store is created"),
    ):
        p = kvmem_cli("serve", "--store", url, "--replicas", "2", "--engine", "hf", *extra, check_rc=None)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "Started a local Ray" not in p.stderr, p.stderr
    with_pw = url.replace("postgres@", f"postgres:{PASSWORD}@", 1)
    for store, extra, says in (  # joining a cluster needs keys; no Ray mode takes credentials in the URL
        (url, ["--ray-address", "127.0.0.1:9"], "without --api-keys"),
        (with_pw, ["--ray-address", "127.0.0.1:9", "--api-keys", str(where / "keys.json")], "carries credentials"),
        (with_pw, ["--replicas", "2"], "carries credentials"),
    ):
        p = kvmem_cli("serve", "--store", store, *extra, check_rc=None)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_sigterm_stops_the_ingress_replicas_engines_and_ray(cluster):
    proc, base, _ = cluster
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 4  # Ray's processes, the controller and both replicas
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
