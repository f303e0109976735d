"""``kvmem serve --engine vllm`` when its engine dies: visible at once, then the process exits for a restart.
It starts a server of its own, and the tests on the session's shared vLLM server (``vllm_server``) run after
it (tests/conftest.py), so no other engine runs beside the one it kills."""

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from conftest import VLLM_KEYS, free_port, serve_cmd, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_dead_engine_turns_ready_and_chats_into_503_and_the_server_exits(tmp_path):
    """kill -9 of vLLM's engine core under a running server: /ready and chats answer 503 at once, one log line
    says so, and the process exits non-zero (3) within 12 s of the kill, with no engine process left, so its
    supervisor restarts it."""
    import psutil

    from kvmem.hardware import cpu_facts, vllm_problem

    why = vllm_problem(cpu_facts())
    if why:
        pytest.skip(f"vLLM cannot run here: {why}")
    (tmp_path / "keys.json").write_text(json.dumps(VLLM_KEYS))
    key = next(iter(VLLM_KEYS))  # tenant acme
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(serve_cmd(tmp_path, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, tmp_path / "server.log")
        kids = psutil.Process(proc.pid).children(recursive=True)
        core = [k for k in kids if "EngineCore" in k.name() or "EngineCore" in " ".join(k.cmdline())]
        assert core
        t_kill = time.time()
        for k in core:
            k.kill()
        seen = {}
        t0 = time.time()
        while time.time() - t0 < 30 and proc.poll() is None:
            try:
                r = httpx.get(f"{url}/ready", timeout=2)
                c = httpx.post(
                    f"{url}/v1/chat/completions",
                    timeout=10,
                    headers={"Authorization": f"Bearer {key}"},
                    json={"messages": [{"role": "user", "content": "hi"}], "memory": {"mode": "off"}},
                )
                if r.status_code == 503:  # the death seen by /ready (it may take a chat to notice it)
                    seen["ready"] = 503
                if c.status_code != 200:
                    seen["chat"] = (c.status_code, c.json()["error"]["code"])
                if "ready" in seen and "chat" in seen:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.2)
        assert seen.get("ready") == 503 and seen.get("chat") == (503, "engine_dead"), seen
        assert proc.wait(timeout=120) == 3
        took = time.time() - t_kill
        print(f"the server exited {took:.1f} s after its engine died")  # for docs/benchmarks.md (pytest -s)
        # DEAD_GRACE_S (2 s) of 503s, uvicorn's drain (5 s at most), the engine's shutdown (3 s at most)
        assert took < 12, f"the server exited {took:.1f} s after its engine died"
        # and took every engine process with it: a worker orphaned by the core's kill exits on its own poll,
        # which took over 5 s on a 2-core machine busy with another model (30 s: slow, not left behind)
        _, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, alive
        text = (tmp_path / "server.log").read_text()
        assert text.count("engine died; answering 503") == 1, text[-2000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
