"""Faults injected into kvmem serve (transformers engine, smollm2-135m-instruct, fp32), for the fault table of
docs/benchmarks.md: two clients that never read a stream, /metrics over a store with 100,000 more files, bad
input. Run it under PYTHONPATH=src (or another checkout's src for a before figure); prints a JSON summary."""

import concurrent.futures
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import http_server, metric, stalled_stream
from kvmem.server import KvmemServer, Limits

KA, KB = "key-acme-0123456789abcdef", "key-globex-0123456789abcdef"
out = {}
root = Path(tempfile.mkdtemp()) / "store"
srv = KvmemServer.start(
    root,
    model="smollm2-135m-instruct",
    engine="hf",
    dtype="float32",
    window=2,
    api_keys={KA: "acme", KB: "globex"},
    limits=Limits(default_max_tokens=8),
)
if hasattr(srv.limits, "send_timeout_s"):
    srv.limits.send_timeout_s = 2.0
srv.engine.max_queue = 2


with http_server(srv, sndbuf=4096) as base:
    h = {"Authorization": f"Bearer {KA}"}
    httpx.post(
        f"{base}/v1/memories",
        headers=h,
        json={"messages": "Alice keeps bees.", "user_id": "alice", "infer": False},
        timeout=120,
    )
    # --- A: two clients that stop reading, engine with 2 slots
    socks = [stalled_stream(base, KA, 400) for _ in range(2)]
    t0 = time.perf_counter()
    failed = ok = 0
    first_ok = None
    freed = None
    while time.perf_counter() - t0 < 45:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KB}"},
            json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 2},
            timeout=120,
        )
        if r.status_code == 200:
            ok += 1
            first_ok = first_ok or time.perf_counter() - t0
        else:
            failed += 1
        if freed is None and metric(base, "kvmem_engine_queue_depth") == 0:
            freed = time.perf_counter() - t0
        if first_ok and freed is not None:
            break
        time.sleep(0.5)
    closed = []
    for s in socks:
        s.settimeout(0.5)
        try:
            while s.recv(1 << 16):
                pass
            closed.append(True)
        except TimeoutError:
            closed.append(False)
        s.close()
    out["stall"] = {
        "other_tenant_failed": failed,
        "first_200_s": first_ok,
        "queue_empty_s": freed,
        "server_closed_conn": closed,
    }
    print(out, flush=True)
    time.sleep(3)
    # --- B: /health behind a /metrics scrape with 100,000 more files in the store
    junk = Path(srv.service.store.root) / "junk"
    junk.mkdir()
    for i in range(100_000):
        (junk / f"f{i}").touch()
    t = time.perf_counter()
    srv.service.store.disk_bytes()
    walk = time.perf_counter() - t
    fresh = KvmemServer(srv.service, srv.memory, srv.engine, srv.tenants, srv.limits, srv.model_pool)
    with http_server(fresh) as b2, concurrent.futures.ThreadPoolExecutor(2) as pool:
        waits = []
        for _ in range(7):
            if hasattr(fresh, "_store_bytes"):
                fresh._store_bytes = (0.0, 0)  # main's cache: every scrape walks, as one every 10 s does
            sc = pool.submit(httpx.get, f"{b2}/metrics", timeout=60)
            time.sleep(0.02)
            t = time.perf_counter()
            httpx.get(f"{b2}/health", timeout=60)
            waits.append(time.perf_counter() - t)
            sc.result()
        waits.sort()
        out["metrics"] = {"walk_s": walk, "health_median_s": statistics.median(waits), "health_max_s": waits[-1]}
    shutil.rmtree(junk)
    print(out, flush=True)
    # --- C: bad input
    c = httpx.Client(base_url=base, headers=h, timeout=60)
    deep = {"user_id": "alice"}
    for i in range(300):
        deep = {"AND": [deep]} if i % 2 else {"NOT": [deep]}
    r = c.post("/v3/memories/search", json={"query": "bees", "filters": deep})
    out["deep_filter"] = (r.status_code, r.text[:160], len(json.dumps(deep)))
    r = c.get("/v1/memories/%00")
    out["nul_path"] = (r.status_code, r.text[:160])
    r = c.post("/v1/memories", json={"messages": "a\x00b", "user_id": "alice", "infer": False})
    out["nul_body"] = (r.status_code, r.text[:160])
    print(json.dumps(out, indent=1), flush=True)
srv.close()
