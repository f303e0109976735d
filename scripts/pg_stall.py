"""A PostgreSQL stall under ``kvmem serve``, measured (docs/benchmarks.md, "Database faults").

    PYTHONPATH=CHECKOUT/src python scripts/pg_stall.py CHECKOUT STALL_S    # under the heavy lock; one JSON line

A throwaway cluster (CHECKOUT's ``scripts/postgres.sh``) holds a store, served by the transformers engine
(``smollm2-135m-instruct``, fp32, uvicorn in a thread). Five memories are written; then the cluster's postmaster and
backends are stopped (SIGSTOP) for STALL_S seconds while three clients loop (a memories read, a chat with memory
off, ``/ready``), and resumed (SIGCONT). Reports the first read's latency and the status codes during the stall,
when ``/ready`` and reads are 200 again after it, and how many acknowledged writes are missing. Run it with the
``src`` of the code to measure on PYTHONPATH (CHECKOUT is where its scripts are)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import psycopg
import uvicorn

from kvmem.server import KvmemServer, create_app

FAST = "smollm2-135m-instruct"


@contextmanager
def http_server(srv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(srv), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        th.join(timeout=10)


def main(tree: Path, stall_s: float) -> dict:
    where = tempfile.mkdtemp(prefix="kvmem-pg-stall-")
    script = str(tree / "scripts" / "postgres.sh")
    env = {**os.environ, "PG_FSYNC": "off"}
    base = subprocess.run(["bash", script, "start", where], capture_output=True, text=True, check=True, env=env)
    base = base.stdout.strip()
    with psycopg.connect(base, autocommit=True) as c:
        c.execute("CREATE SCHEMA bench")
    url = base + "&options=-csearch_path%3Dbench"
    srv = KvmemServer.start(url, model=FAST, engine="hf", dtype="float32", window=0,
                            segments_url=Path(where, "kv").as_uri())  # fmt: skip
    try:
        with http_server(srv) as api:
            return measure(api, Path(where) / "data", stall_s)
    finally:
        srv.close()
        subprocess.run(["bash", script, "stop", where], capture_output=True)


def measure(api: str, data: Path, stall_s: float) -> dict:
    acked = []
    for i in range(5):
        r = httpx.post(f"{api}/v1/memories", json={"messages": f"Ana fact {i}.", "user_id": "ana", "infer": False},
                       timeout=60)  # fmt: skip
        r.raise_for_status()
        acked.append(r.json()["results"][0]["id"])
    chat = {"model": FAST, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "user": "bob",
            "memory": {"mode": "off"}}  # fmt: skip
    calls = {
        "read": lambda c: c.get(f"{api}/v1/memories", params={"user_id": "ana"}),
        "chat_off": lambda c: c.post(f"{api}/v1/chat/completions", json=chat),
        "ready": lambda c: c.get(f"{api}/ready"),
    }
    log: dict[str, list] = {k: [] for k in calls}  # (started, took, status), s from the stall's start
    stop, t0 = threading.Event(), time.monotonic()

    def loop(kind):
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    code = calls[kind](c).status_code
                except httpx.HTTPError:
                    code = -1
                log[kind].append((t - t0, time.monotonic() - t, code))
                time.sleep(0.2)

    pm = psutil.Process(int((data / "postmaster.pid").read_text().split()[0]))
    procs = [pm, *pm.children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    threads = [threading.Thread(target=loop, args=(k,)) for k in calls]
    for th in threads:
        th.start()
    time.sleep(stall_s)
    for p in reversed(procs):
        p.send_signal(signal.SIGCONT)
    resumed = time.monotonic() - t0

    def back(kind):  # s after the resume until the first 200 that ended after it
        ends = [s + d for s, d, c in log[kind] if s + d > resumed and c == 200]
        return round(min(ends) - resumed, 2) if ends else None

    while (back("read") is None or back("ready") is None) and time.monotonic() - t0 < resumed + 60:
        time.sleep(0.2)
    stop.set()
    for th in threads:
        th.join()
    listed = httpx.get(f"{api}/v1/memories", params={"user_id": "ana"}, timeout=60).json()["results"]
    during = {k: [e for e in v if e[0] < resumed] for k, v in log.items()}

    def p50(xs):
        return round(sorted(xs)[len(xs) // 2], 3) if xs else None

    return {
        "stall_s": stall_s,
        "read_first_answer_s": round(during["read"][0][1], 2),
        "read_p50_s_during": p50([d for _, d, _ in during["read"]]),
        "ready_first_503_at_s": next((round(s + d, 2) for s, d, c in log["ready"] if c == 503), None),
        "chat_off_p50_s_during": p50([d for _, d, _ in during["chat_off"]]),
        "codes_during": {k: dict(Counter(c for _, _, c in v)) for k, v in during.items()},
        "read_200_after_resume_s": back("read"),
        "ready_200_after_resume_s": back("ready"),
        "acked_writes_lost": len(set(acked) - {m["id"] for m in listed}),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]).resolve(), float(sys.argv[2]))))
