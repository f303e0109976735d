"""End to end on the real installed models: ingest-locomo, ask in both modes, bad input, check-exactness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kvmem_cli
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
DEFAULT = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma3-270m"
KVMEM = [sys.executable, "-m", "kvmem.cli"]
run = kvmem_cli
SLOW = pytest.mark.slow  # a model larger than the smallest


def require(name: str) -> None:
    if not (model_dir(name) / MANIFEST).exists():
        pytest.fail(f"{name} is not installed; run: kvmem models install {name}")


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_locomo) -> Path:
    require(FAST)
    root = tmp_path_factory.mktemp("store") / "s"
    p = run(
        "ingest-locomo",
        tiny_locomo,
        "--sample",
        "conv-26",
        "--store",
        root,
        "--window",
        "3",
        "--model",
        FAST,
        "--json",
    )
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["user"] == "conv-26" and report["num_facts"] > 10 and report["window"] == 3
    return root


def test_store_copy_round_trips_through_a_shared_store(store, tmp_path, postgres):
    """``kvmem store copy`` local -> shared (PostgreSQL + object store) -> local: every fact, turn and event, each
    segment verified; ``ask`` by cosine gives the same facts and answer from all three, in both modes (hybrid: the
    same facts, in each backend's keyword order). A non-empty
    destination is refused unless --force."""
    from conftest import postgres_schema

    url = postgres_schema(postgres, "copy_round_trip")
    there = json.loads(run("store", "copy", store, url, "--segments", (tmp_path / "kv").as_uri(), "--json").stdout)
    back = json.loads(run("store", "copy", url, tmp_path / "back", "--json").stdout)
    assert there == back and there["users"] == 1 and there["facts"] > 10 and there["turns"] > 10
    assert there["events"] == there["facts"] and there["kv_bytes"] > 0
    # what ``kvmem ask --engine hf`` runs, on one loaded model and engine for the three stores (a process each
    # cost a model load each)
    from kvmem.engines.select import open_engine
    from kvmem.retrieve import HYBRID, Embedder
    from kvmem.service import MemoryService

    opened, emb = open_engine(FAST, "hf"), Embedder()
    q = "What did Caroline research?"
    for mode, fusion in (("kv", None), ("prompt", None), ("kv", HYBRID)):
        answers = []
        for s in (store, url, tmp_path / "back"):
            svc = MemoryService(s, opened.engine, opened.lm, emb, fusion=fusion)
            a = svc.ask("conv-26", q, 5, mode, 8)
            svc.close()
            answers.append((tuple(a.fact_ids), a.answer, a.prompt_tokens, a.prefilled_tokens))
        if fusion is None:  # cosine: the same ranking from every backend
            assert len(set(answers)) == 1 and len(answers[0][0]) == 5, answers
        else:  # hybrid: each backend's own keyword scorer (FTS5's BM25, PostgreSQL's ts_rank) may order the
            # same facts differently; a copy back to a local store ranks as the original
            assert answers[0] == answers[2] and sorted(answers[0][0]) == sorted(answers[1][0]), answers
    # the refusals: one error line each, exit code 2 (in this process: no model loads)
    from typer.testing import CliRunner

    from kvmem.cli import app

    for dst, extra, needle in (
        (tmp_path / "back", [], "pass --force"),
        (tmp_path / "back", ["--force"], "'conv-26' is already in"),  # never merges two histories
        (tmp_path / "junk", [], "non-empty directory that holds no store"),
    ):
        if dst.name == "junk":
            dst.mkdir()
            (dst / "notes.txt").write_text("mine")
        res = CliRunner().invoke(app, ["store", "copy", str(store), str(dst), *extra])
        assert res.exit_code == 2 and needle in res.output and res.output.startswith("error: "), res.output
        assert len(res.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_ask_both_modes_same_prompt(store):
    from kvmem.store import Store

    q = "What did Caroline research?"
    kv = json.loads(
        run(
            "ask", "--engine", "hf", "--store", store, "--user", "conv-26", "--k", 5, "--mode", "kv", "--json", q
        ).stdout
    )
    pr = json.loads(
        run(
            "ask", "--engine", "hf", "--store", store, "--user", "conv-26", "--k", 5, "--mode", "prompt", "--json", q
        ).stdout
    )
    assert kv["fact_ids"] == pr["fact_ids"] and len(kv["fact_ids"]) == 5 and kv["k"] == 5
    assert kv["prompt_tokens"] == pr["prompt_tokens"]
    st = Store.open(store)
    by_id = {f.fact_id: f for f in st.reads.snapshot("conv-26").facts}
    memory_tokens = len(st.header_token_ids) + sum(by_id[f].num_tokens for f in kv["fact_ids"])
    assert kv["prefilled_tokens"] == kv["prompt_tokens"] - memory_tokens  # only the query
    assert pr["prefilled_tokens"] == pr["prompt_tokens"]
    for a in (kv, pr):
        assert set(a["timings_ms"]) >= {"embed", "search", "compose", "ttft", "total"}
        assert a["timings_ms"]["total"] >= a["timings_ms"]["ttft"] > 0
        assert isinstance(a["answer"], str) and a["answer"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--user", "nobody", "--k", "3", "q?"], "unknown user 'nobody'"),
        (["--user", "conv-26", "--k", "0", "q?"], "--k must be >= 1"),
        (["--user", "conv-26", "--k", "3", "  "], "empty question"),
        # "at most k=N fits": test_budget_reserves_the_answer
        pytest.param(  # loads the model and composes: ~9 s
            ["--user", "conv-26", "--k", "8", "--max-context", "10", "What did Caroline research?"],
            "no memory fits",
            marks=SLOW,
        ),
        (["--user", "conv-26", "--k", "3", "--max-context", "0", "q?"], "--max-context must be >= 1"),
        (["--user", "conv-26", "--k", "3", "--max-new-tokens", "0", "q?"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_input_is_one_line_exit_2(store, args, needle):
    p = run("ask", "--engine", "hf", "--store", store, *args, check_rc=2)
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_budget_reserves_the_answer(store):
    """A context exactly as long as the composed prompt leaves no room for the answer: refused
    with kvmem's own "at most k" error, not accepted (and decoded past the context)."""
    q = "What did Caroline research?"
    a = json.loads(
        run(
            "ask", "--engine", "hf", "--store", store, "--user", "conv-26", "--k", 3, "--json", "--max-new-tokens", 4, q
        ).stdout
    )
    p = run(
        "ask",
        "--engine",
        "hf",
        "--store",
        store,
        "--user",
        "conv-26",
        "--k",
        3,
        "--max-new-tokens",
        4,
        "--max-context",
        a["prompt_tokens"],
        q,
        check_rc=2,
    )
    assert "+ answer (4 tokens)" in p.stderr and "at most k=2 fits" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    run(
        "ask",
        "--engine",
        "hf",
        "--store",
        store,
        "--user",
        "conv-26",
        "--k",
        3,
        "--max-new-tokens",
        4,
        "--max-context",
        a["prompt_tokens"] + 4,
        q,
    )


def test_store_in_another_dtype_is_refused_with_how_to_reencode(store):
    from kvmem.hardware import resolve_dtype

    other = "float32" if resolve_dtype(None) == "bfloat16" else "bfloat16"
    p = run(
        "ask", "--engine", "hf", "--dtype", other, "--store", store, "--user", "conv-26", "--k", 3, "q?", check_rc=2
    )
    assert f"computed in {resolve_dtype(None)}, but this run computes in {other}" in p.stderr
    assert "--dtype" in p.stderr and "re-encode" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", [FAST, pytest.param(DEFAULT, marks=SLOW), pytest.param(GEMMA, marks=SLOW)])
def test_bos_and_eos_follow_the_gguf(name):
    """The prompt starts with BOS exactly when the GGUF says add_bos (Gemma 3's converted tokenizer
    had lost it), and the GGUF's EOS is a stop id of the service."""
    require(name)
    from kvmem.compose import PromptFormat
    from kvmem.models import load

    meta = json.loads((model_dir(name) / MANIFEST).read_text())["tokenizer"]
    lm = load(name)
    fmt = PromptFormat.for_tokenizer(lm.tokenizer, lm.chat)
    plain = lm.tokenizer(fmt.header, add_special_tokens=False)["input_ids"]
    assert fmt.header_ids(lm.tokenizer) == ([meta["bos_token_id"]] if meta["add_bos"] else []) + plain
    assert meta["add_bos"] == (name == GEMMA)
    eos = lm.model.generation_config.eos_token_id
    assert meta["eos_token_id"] in ([eos] if isinstance(eos, int) else eos)


def test_demo_and_eval_read_the_locomo_file_from_the_environment(tmp_path, monkeypatch):
    """``KVMEM_LOCOMO`` names the LoCoMo file of ``kvmem demo`` (as ``scripts/demo.sh`` does) and of every bench and
    eval command's ``--data``; a missing file is one error line that names it and the variable."""
    gone = tmp_path / "gone.json"
    monkeypatch.setenv("KVMEM_LOCOMO", str(gone))
    for args in (["demo"], ["eval", "locomo", "--engine", "hf", "--model", FAST]):
        p = kvmem_cli(*args, check_rc=2)
        assert f"error: LoCoMo file not found: '{gone}' (the path is $KVMEM_LOCOMO's)" in p.stderr
        assert "Traceback" not in p.stderr
    # given on the command line, the file needs no note; a directory is named as one
    p = kvmem_cli("eval", "locomo", "--engine", "hf", "--model", FAST, "--data", tmp_path / "other.json", check_rc=2)
    assert f"error: LoCoMo file not found: '{tmp_path / 'other.json'}'\n" in p.stderr
    assert f"'{tmp_path}' is a directory, not a LoCoMo file" in kvmem_cli("demo", tmp_path, check_rc=2).stderr
    monkeypatch.delenv("KVMEM_LOCOMO")
    monkeypatch.chdir(tmp_path)  # where the default path (../shared/...) names nothing
    p = kvmem_cli("demo", check_rc=2)
    assert "(the default path: give another, or set KVMEM_LOCOMO)" in p.stderr


@pytest.mark.slow
def test_missing_store_and_bad_file(tmp_path, store):
    p = run("ask", "--store", tmp_path / "none", "--user", "x", "--k", "3", "q?", check_rc=2)
    assert "no kvmem store" in p.stderr and "Traceback" not in p.stderr
    p = run(
        "ingest-locomo", tmp_path / "missing.json", "--sample", "conv-26", "--store", store, "--model", FAST, check_rc=2
    )
    assert "not found" in p.stderr


@pytest.mark.slow
def test_a_store_url_is_one_error_not_a_directory_named_after_it(tmp_path, small_locomo, monkeypatch):
    """``--store postgresql://…`` used to create a local directory ``postgresql:`` and write the store there. Now
    it is a shared store's database (here, nothing listens on that port), and another URL is refused."""
    for args in (
        ["ingest-locomo", str(small_locomo), "--sample", "conv-26", "--model", FAST],
        ["memory", "add", "--user", "u", "--no-infer", "-m", "Bob keeps bees."],
    ):
        for url, why in (
            ("postgresql://postgres:pw@127.0.0.1:1/kvmem", "cannot connect to PostgreSQL at postgresql://postgres@"),
            ("s3://bucket/kv", "is not a store location"),
        ):
            monkeypatch.chdir(tmp_path)
            p = run(*args, "--store", url, check_rc=None)
            assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
            assert ":pw@" not in p.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_store_refuses_other_model(store, small_locomo):
    require(DEFAULT)
    before = (store / "meta.sqlite").read_bytes()
    p = run("ingest-locomo", small_locomo, "--sample", "conv-26", "--store", store, "--model", DEFAULT, check_rc=2)
    assert "refusing to inject" in p.stderr and "Traceback" not in p.stderr
    assert (store / "meta.sqlite").read_bytes() == before  # nothing stored was touched


@pytest.mark.slow
@pytest.mark.parametrize("name", [FAST, DEFAULT, GEMMA])
def test_check_exactness_real_model(name):
    require(name)
    p = run("check-exactness", "--model", name, "--json")
    r = json.loads(p.stdout)
    assert r["passed"] is True and r["greedy_match_joint"] and r["greedy_match_relocated"]
    assert r["rel_logit_diff_joint"] <= 1e-5 and r["rel_logit_diff_relocated"] <= 1e-5
    assert r["rel_key_diff_window"] <= 1e-5 and r["memory_tokens"] > 300


@pytest.mark.vllm  # auto is vLLM wherever it runs
@pytest.mark.slow
def test_gemma3_end_to_end(tmp_path, tiny_locomo):
    """Gemma 3 (sliding-window layers, two RoPE bases, completion-style prompt) through ingest and ask, both modes
    on the transformers engine; then ``ask`` on the default engine, auto: stock vLLM with the kvmem connector where
    it runs (one engine start), which prefills only the query, as the transformers engine does, --json names the
    engine that answered, and a completion-style answer ends at the line break in vLLM too (one stop rule)."""
    require(GEMMA)
    from kvmem.hardware import plan

    root = tmp_path / "g"
    run("ingest-locomo", tiny_locomo, "--sample", "conv-26", "--store", root, "--window", "2", "--neighbours", 0,
        "--model", GEMMA)  # fmt: skip
    q = "What did Caroline research?"
    from kvmem.service import MemoryService

    svc = MemoryService.open(root, engine="hf")  # both modes on one loaded model (the CLI's ask: other tests)
    kv, pr = (svc.ask("conv-26", q, 4, mode, max_new_tokens=8).to_json() for mode in ("kv", "prompt"))
    svc.close()
    args = ["ask", "--store", root, "--user", "conv-26", "--k", 4, "--json"]
    assert kv["fact_ids"] == pr["fact_ids"] and kv["prompt_tokens"] == pr["prompt_tokens"]
    assert kv["prefilled_tokens"] < 30 < pr["prefilled_tokens"] == pr["prompt_tokens"]
    assert kv["answer"] and pr["answer"]  # a leading line break never ends the answer before it starts
    p = run(*args, "--max-new-tokens", 16, q, process=True)  # no --engine: auto (vLLM's engine core: a process)
    auto = json.loads(p.stdout.strip().splitlines()[-1])
    assert auto["engine"] == plan().engine and auto["mode"] == "kv"
    assert auto["fact_ids"] == kv["fact_ids"] and auto["prompt_tokens"] == kv["prompt_tokens"]
    assert auto["prefilled_tokens"] == kv["prefilled_tokens"]  # the query alone, as vLLM counts it
    assert "\n" not in auto["answer"] and auto["answer"] and auto["generated_tokens"] >= 1
    assert "force killing" not in p.stderr  # the engine core shut down cleanly


def test_undecodable_question_is_one_error_line(store):
    """Bytes that are not UTF-8 reach Python as lone surrogates: one error line, not a tokenizer traceback."""
    p = subprocess.run(
        KVMEM + ["ask", "--engine", "hf", "--store", str(store), "--user", "conv-26", "--k", "3", b"\xff\xfe?"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and "not valid Unicode" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_two_installs_of_one_model_at_once_give_one_whole_install(tmp_path):
    """Two ``kvmem models install`` of the same model started together (two set-up scripts, say): one converts,
    the other waits for it and finds the model installed; both exit 0 and the folder is one whole install
    (manifest, weights, nothing left half-written beside it)."""
    import os

    require(FAST)
    env = {**os.environ, "KVMEM_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(KVMEM + ["models", "install", FAST], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sorted("already installed" in e for e in errs) == [False, True], errs
    target = tmp_path / "models" / FAST
    assert json.loads((target / MANIFEST).read_text())["name"] == FAST
    assert (target / "model.safetensors").stat().st_size > 100_000_000
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f".{FAST}.lock", FAST]
    assert not any(p.is_dir() for p in target.iterdir())


# --- the command line itself: no model loads ---------------------------------------------------------------------


def _commands():
    """(path, click command) for every command and group of ``kvmem``."""
    import typer

    from kvmem.cli import app

    todo = [(["kvmem"], typer.main.get_command(app))]
    while todo:
        path, cmd = todo.pop()
        yield path, cmd
        todo += [(path + [name], sub) for name, sub in getattr(cmd, "commands", {}).items()]


def test_help_loads_no_engine():
    """``kvmem --help``, every command built and every group's help: no torch, transformers or vLLM imported."""
    code = (
        "import sys, typer\n"
        "from typer.testing import CliRunner\n"
        "from kvmem.cli import app\n"
        "typer.main.get_command(app)\n"
        "for args in ([], ['serve'], ['ask'], ['memory'], ['store'], ['models'], ['bench'], ['eval'], ['demo']):\n"
        "    assert CliRunner().invoke(app, [*args, '--help']).exit_code == 0, args\n"
        "print(sorted({'torch', 'transformers', 'vllm', 'matplotlib'} & set(sys.modules)))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]


def test_one_engine_option_defaults_to_auto():
    """Every command's --engine defaults to auto and is spelled alike; the demo alone defaults to hf and says why."""
    engines = {" ".join(path): p for path, cmd in _commands() for p in getattr(cmd, "params", []) if p.name == "engine"}
    assert len(engines) >= 10
    for name, p in engines.items():
        assert p.opts == ["--engine"] and p.help.startswith("auto (vLLM where it runs here"), name
        if name == "kvmem demo":
            assert p.default == "hf" and "The demo defaults to hf" in p.help
        else:
            assert p.default == "auto", name


def test_cli_default_model_is_the_registry_default():
    from kvmem.cli.common import DEFAULT_MODEL
    from kvmem.models import DEFAULT_MODEL as REGISTRY_DEFAULT

    assert DEFAULT_MODEL == REGISTRY_DEFAULT


def test_bench_without_its_extra_is_one_error_line(monkeypatch):
    """A missing ``bench`` extra (here matplotlib, hidden as an uninstalled package is): one ``error:`` line that
    names the install, exit code 2, before any benchmark runs."""
    from typer.testing import CliRunner

    from kvmem.cli import app

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    res = CliRunner().invoke(app, ["bench", "scale", "--users", "1000"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "pip install 'kvmem[bench]'" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "matplotlib" in res.output


def test_memory_add_reads_json_messages_or_plain_text(tmp_path):
    from kvmem.cli.memory import read_messages

    (tmp_path / "m.json").write_text('[{"role": "user", "content": "I keep bees."}]')
    (tmp_path / "m.txt").write_text("  I keep bees.\n")
    assert read_messages(tmp_path / "m.json", None) == [{"role": "user", "content": "I keep bees."}]
    assert read_messages(tmp_path / "m.txt", None) == "I keep bees."
    assert read_messages(None, '["-m is always text"]') == '["-m is always text"]'
    for file, message, why in (
        (tmp_path / "m.txt", "x", "not both"),
        (tmp_path, None, "is a directory"),
        (tmp_path / "none.txt", None, "--message/-m TEXT"),
        (None, "  ", "no messages given"),
    ):
        with pytest.raises(ValueError, match=why):
            read_messages(file, message)


def test_serve_help_shows_the_library_defaults():
    """``kvmem serve --help`` shows, for each option of the server's settings, the default a library caller of
    ``KvmemServer.start`` gets (``settings.Limits``, ``settings.ServeOptions``): one value, written once."""
    import re

    from typer.testing import CliRunner

    from kvmem.cli import app
    from kvmem.settings import Limits, ServeOptions

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    blocks = {m[1]: m[2] for m in re.finditer(r"(--[a-z-]+)\b(.*?)(?=│ [ *] +--[a-z]|\Z)", out, re.S)}
    lim, opt = Limits(), ServeOptions()
    want = {
        "--top-k": lim.default_top_k,
        "--mode": lim.default_mode,
        "--max-tokens": lim.default_max_tokens,
        "--timeout": lim.request_timeout_s,
        "--send-timeout": lim.send_timeout_s,
        "--body-timeout": lim.body_timeout_s,
        "--max-body-bytes": lim.max_body_bytes,
        "--cache-bytes": opt.cache_bytes,
        "--kv-cache-bytes": opt.kv_cache_memory_bytes,
        "--max-queue": opt.max_queue,
        "--write-timeout": opt.write_timeout_s,
        "--tail-recompute": opt.tail_recompute,
        "--selective-recompute": opt.selective_recompute,
    }
    assert (lim.default_top_k, lim.default_max_tokens, lim.request_timeout_s, opt.max_queue) == (5, 64, 120.0, 64)
    for flag, value in want.items():
        shown = re.search(r"\[default: ([^\]]+)\]", blocks[flag])
        assert shown is not None and shown[1] == str(value), (flag, value, blocks[flag])


def test_server_settings_are_checked_for_library_callers(tmp_path):
    """A bad setting is refused by its bundle, for ``KvmemServer.start`` as for the CLI, before anything loads
    (no store is created); the CLI names the option in one line."""
    from pydantic import ValidationError

    from kvmem.server import KvmemServer
    from kvmem.settings import Limits, ServeOptions

    with pytest.raises(ValidationError, match="default_top_k"):
        Limits(default_top_k=0)
    with pytest.raises(ValidationError, match="request_timeout_s"):
        Limits(request_timeout_s=0)
    with pytest.raises(ValidationError, match="history encoding and neighbours"):
        ServeOptions(history=True, neighbours=2)
    with pytest.raises(ValidationError, match="max_queue"):
        KvmemServer.start(tmp_path / "s", model=FAST, engine="hf", max_queue=0)
    with pytest.raises(ValidationError, match="bogus"):
        KvmemServer.start(tmp_path / "s", model=FAST, engine="hf", bogus=1)
    assert not (tmp_path / "s").exists()
    p = run("serve", "--store", tmp_path / "s", "--top-k", "0", "--send-timeout", "-1", check_rc=None)
    assert p.returncode == 2 and p.stderr.strip() == (
        "error: --top-k: Input should be greater than or equal to 1; --send-timeout: Input should be greater than 0"
    ), p.stderr
