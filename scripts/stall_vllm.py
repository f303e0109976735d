"""Clients that never read a stream, on ``kvmem serve --engine vllm`` (smollm2-135m-instruct, fp32, ``--max-queue
2``), for the fault table of docs/benchmarks.md: two clients ask for a 1,500-token stream with 20 top logprobs (about
3 KB a chunk) and never read; another tenant chats (4 tokens) every 0.5 s. Prints a JSON summary: seconds until the
other tenant is first answered 200 (429 while the two streams hold both slots), its 429s meanwhile, seconds until
the engine queue is empty, the send timeouts counted, whether the server closed the stalled connections.

    python scripts/stall_vllm.py --send-timeout 2 --send-buffer 4096   # after
    python scripts/stall_vllm.py --send-timeout 3600 --send-buffer 4096   # before: no bound within --cap
    python scripts/stall_vllm.py --send-timeout 2   # the kernel's autotuned send buffer
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import VLLM_KEYS, free_port, metric, serve_cmd, stalled_stream, wait_ready

KA, KB = VLLM_KEYS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--send-timeout", type=float, default=2.0)
    ap.add_argument("--send-buffer", type=int, default=None)
    ap.add_argument("--cap", type=float, default=90.0, help="seconds to watch at most")
    ap.add_argument("--max-tokens", type=int, default=1500)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stall-vllm-"))
    (tmp / "keys.json").write_text(json.dumps(VLLM_KEYS))
    port = free_port()
    cmd = serve_cmd(tmp, port) + ["--max-queue", "2", "--send-timeout", str(a.send_timeout)]
    if a.send_buffer:
        cmd += ["--send-buffer", str(a.send_buffer)]
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - the server writes to it until it stops
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    out = {"send_timeout_s": a.send_timeout, "send_buffer": a.send_buffer, "max_tokens": a.max_tokens}
    try:
        t = time.perf_counter()
        wait_ready(proc, base, tmp / "server.log")
        out["start_s"] = round(time.perf_counter() - t, 1)
        httpx.post(  # warm: the first chat compiles
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KB}"},
            json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 4},
            timeout=300,
        )
        socks = [stalled_stream(base, KA, a.max_tokens) for _ in range(2)]
        t0 = time.perf_counter()
        refused, first_ok, empty = 0, None, None
        while time.perf_counter() - t0 < a.cap and (first_ok is None or empty is None):
            r = httpx.post(
                f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KB}"},
                json={"messages": [{"role": "user", "content": "Hi"}], "memory": {"mode": "off"}, "max_tokens": 4},
                timeout=300,
            )
            if r.status_code == 200:
                first_ok = first_ok or round(time.perf_counter() - t0, 1)
            elif r.status_code == 429:
                refused += 1
            else:
                raise RuntimeError(r.text)
            if empty is None and time.perf_counter() - t0 > 1 and metric(base, "kvmem_engine_queue_depth") == 0:
                empty = round(time.perf_counter() - t0, 1)
            time.sleep(0.5)
        out.update(
            other_tenant_first_200_s=first_ok,
            other_tenant_429=refused,
            queue_empty_s=empty,
            queue_depth_at_end=metric(base, "kvmem_engine_queue_depth"),
            send_timeouts=metric(base, "kvmem_send_timeouts_total"),
        )
        closed = []
        for s in socks:
            s.settimeout(0.5)
            n = 0
            try:
                while chunk := s.recv(1 << 16):
                    n += len(chunk)
                closed.append(n)
            except TimeoutError:
                closed.append(None)  # still open
            s.close()
        out["bytes_before_close"] = closed
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
