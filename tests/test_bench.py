"""Benchmarks and the LoCoMo evaluation: scoring unit tests, and every command on a tiny config (fast model, two
sessions of one conversation, 2 questions, k in {1, 2}) writing well-formed output. Not timed tests."""

from __future__ import annotations

import ast
import csv
import http.server
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import kvmem_cli
from kvmem.bench.common import select_questions
from kvmem.bench.eval_locomo import exact_match, f1_multi, f1_score, locomo_f1, normalize_answer, parse_verdict
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
BENCH = Path(__file__).resolve().parents[1] / "src" / "kvmem" / "bench"
# namedtuple's documented API, not private names
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


# --- no private names -------------------------------------------------------------------------------------


def private_names(source: str, module: str) -> list[str]:
    """The private names (one leading underscore, not dunder) that the code of ``module`` (``kvmem.bench.x``)
    reaches in another module: imported from a kvmem module (``from kvmem.memory import _date``, or relatively),
    an attribute of anything but ``self`` / ``cls`` (``mem._context``), or one named to ``getattr``/``setattr``/
    ``hasattr``. Each as ``"line: what"``."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                where = f"{base}.{node.module}" if node.module else base
            else:
                where = node.module or ""
            if where == "kvmem" or where.startswith("kvmem."):
                parts = where.split(".")
                found += [f"{node.lineno}: from {where} import {a.name}" for a in node.names if private(a.name)]
                found += [f"{node.lineno}: from {where}" for p in parts if private(p)]
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("kvmem.") and any(private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in NAMEDTUPLE_API:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def test_bench_reaches_no_private_name():
    """Benchmarks and the evaluation use kvmem's public API only (and each other's public names): a private name
    may change without notice, and a benchmark that needs one shows an API that is missing."""
    found = {
        path.name: hits
        for path in sorted(BENCH.glob("*.py"))
        if (hits := private_names(path.read_text(), f"kvmem.bench.{path.stem}"))
    }
    assert not found, found


def test_private_name_check_catches_each_form():
    code = """
from kvmem.memory import _date
from ..memory import Memory, _date
from .serve_load import _phase
from .common import pyplot
import kvmem._internal
mem._context("u", [], 0)
self._own
parts._replace(query="")
getattr(store, "_cache")
getattr(model, "model", model)
"""
    hits = private_names(code, "kvmem.bench.extraction")
    assert [h.split(":")[0] for h in hits] == ["2", "3", "4", "6", "7", "10"], hits
    assert "3: from kvmem.memory import _date" in hits and "4: from kvmem.bench.serve_load import _phase" in hits


# --- scoring -----------------------------------------------------------------------------------------------


def test_normalize_and_f1_values():
    assert normalize_answer("The Cat, and a dog!") == "cat dog"
    assert f1_score("The cat sat", "cat sat down") == pytest.approx(0.8)  # p=1, r=2/3
    assert f1_score("Paris", "paris.") == 1.0
    assert f1_score("no overlap", "something else") == 0.0
    assert f1_score("a the", "cat") == 0.0  # empty after normalisation
    assert f1_score("red red blue", "red blue blue") == pytest.approx(2 / 3)  # multiset overlap
    assert exact_match("The Cat.", "cat") == 1.0 and exact_match("cat sat", "cat") == 0.0


def test_multi_hop_splits_reference_on_commas():
    # sub-answers "pottery" (best match 1.0) and "camping" (best match 0.0) -> 0.5
    assert f1_multi("pottery", "pottery, camping") == pytest.approx(0.5)
    assert f1_multi("camping, pottery", "pottery, camping") == 1.0
    assert locomo_f1("pottery", "pottery, camping", 1) == pytest.approx(0.5)
    # other categories: commas are dropped by normalisation, the whole answer is one bag of tokens
    assert locomo_f1("pottery", "pottery, camping", 4) == pytest.approx(2 / 3)
    # category 3 keeps the reference before ';'
    assert locomo_f1("likely yes", "Likely yes; she said so", 3) == 1.0


def test_judge_verdict_parsing():
    assert parse_verdict('{"label": "CORRECT"}') == 1
    assert parse_verdict('```json\n{"label": "WRONG"}\n```') == 0
    assert parse_verdict("The answer is CORRECT.") == 1
    assert parse_verdict("INCORRECT") == 0
    assert parse_verdict("maybe") is None and parse_verdict("CORRECT or WRONG") is None


def test_question_subset_is_deterministic_prefix(locomo_path):
    from kvmem.locomo import load_locomo

    convs = load_locomo(locomo_path)[:2]
    a, b = select_questions(convs, 10), select_questions(convs, 30)
    assert a == select_questions(convs, 10) and b[:10] == a and len(b) == 30
    assert {q.category for q in b} <= {1, 2, 3, 4}
    assert {q.sample for q in a} == {"conv-26", "conv-30"}  # round-robin over samples
    assert len({q.qid for q in b}) == 30


# --- commands on a tiny config -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, locomo_path):
    """conv-26 with only sessions 1-2 of facts; a private store cache."""
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    sample = next(s for s in json.loads(locomo_path.read_text()) if s["sample_id"] == "conv-26")
    sample["observation"] = {
        k: v for k, v in sample["observation"].items() if k in ("session_1_observation", "session_2_observation")
    }
    root = tmp_path_factory.mktemp("bench")
    data = root / "small.json"
    data.write_text(json.dumps([sample]))
    old_env = os.environ.get("KVMEM_BENCH_CACHE")
    os.environ["KVMEM_BENCH_CACHE"] = str(root / "stores")
    yield {"data": data, "root": root}
    if old_env is None:
        os.environ.pop("KVMEM_BENCH_CACHE", None)
    else:
        os.environ["KVMEM_BENCH_CACHE"] = old_env


def cli(*args, rc: int = 0) -> SimpleNamespace:
    """``kvmem *args`` in this process (``conftest.kvmem_cli``), exit code ``rc``; ``.output``: stdout, then
    stderr."""
    p = kvmem_cli(*args, check_rc=rc)
    return SimpleNamespace(output=p.stdout + p.stderr)


def common(tiny, out: Path, questions: int = 2):
    return [
        "--data",
        tiny["data"],
        "--model",
        FAST,
        "--samples",
        "conv-26",
        "--questions",
        questions,
        "--out",
        out,
        "--no-progress",
    ]


def check_outputs(out: Path, png: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert isinstance(json.loads((out / "records.json").read_text()), list)
    with open(out / "records.csv") as f:
        assert len(list(csv.DictReader(f))) >= 1
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["machine"]["cores"] >= 1 and summary["machine"]["torch"]
    return summary


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_flag(tiny, tmp_path):
    from kvmem.hardware import cpu_facts, vllm_kernels, vllm_problem

    facts = cpu_facts()
    if vllm_kernels(facts) is None and not facts.cuda:  # a CPU vLLM cannot run on: one error line, exit 2
        res = cli("bench", "latency", "--engine", "vllm", *common(tiny, tmp_path), rc=2)
        assert "cannot run here" in res.output and "Traceback" not in res.output
        assert len(res.output.strip().splitlines()) == 1
    else:  # scripts/setup.sh installs vLLM; where it can run it must import (a broken install fails here)
        assert vllm_problem(facts) is None
        # One engine start for both benchmark runs: ``eval frontier`` runs ``bench latency``'s run and then
        # ``eval locomo``'s (``answer_batch``, batched as ``bench throughput`` batches) on the one vLLM engine;
        # each writes the files and fields its own command writes on the hf engine.
        out = tmp_path / "vllm"
        cli("eval", "frontier", "--engine", "vllm", "--models", FAST, "--methods", "prompt,kv", "--k", "1,2",
            "--window", 0, "--latency-questions", 1, "--max-new-tokens", 4, "--data", tiny["data"],
            "--samples", "conv-26", "--questions", 3, "--out", out, "--no-progress")  # fmt: skip
        s = check_outputs(out / FAST / "latency", "latency_vs_k.png")
        assert s["engine"] == "vllm" and s["ttft_ms"]["bare"] > 0
        assert set(s["ttft_ms"]["kv"]) == {"1", "2"} and all(v > 0 for v in s["ttft_ms"]["prompt"].values())
        rows = [json.loads(x) for x in (out / FAST / "eval" / "records.jsonl").read_text().splitlines()]
        assert len(rows) == 12 and {(r["mode"], r["k"]) for r in rows} == {
            (m, k) for m in ("kv", "prompt") for k in (1, 2)
        }
        assert all(r["engine"] == "vllm" and r["k_used"] == r["k"] and len(r["fact_ids"]) == r["k"] for r in rows)
        ev = check_outputs(out / FAST / "eval", "accuracy_vs_k.png")
        assert ev["f1"]["0"]["2"]["kv"]["overall"] is not None
        assert {p["engine"] for p in check_outputs(out, "frontier.png")["points"]} == {"vllm"}


@pytest.mark.slow
def test_bench_latency(tiny):
    out = tiny["root"] / "latency"
    bad = cli("bench", "latency", "--engine", "hf", "--retrieval", "bm25", *common(tiny, out), rc=2)
    assert "retrieval 'bm25': one of cosine, hybrid" in bad.output and "Traceback" not in bad.output
    res = cli(
        "bench",
        "latency",
        "--engine",
        "hf",
        "--k",
        "1,2",
        "--window",
        "0",
        "--max-new-tokens",
        4,
        "--methods",
        "kv-sel50,kv-tail1",
        "--retrieval",
        "cosine",
        *common(tiny, out),
    )
    s = check_outputs(out, "latency_vs_k.png")
    assert s["retrieval"] == "cosine"  # as asked, not the default hybrid
    assert set(s["ratios"]["method_over_kv"]) == {"kv-sel50", "kv-tail1"}
    assert all(v > 0 for m in s["ratios"]["prompt_over_method"].values() for v in m.values())
    assert set(s["ttft_ms"]["kv"]) == {"1", "2"} and set(s["ttft_ms"]["prompt"]) == {"1", "2"}
    assert s["ttft_ms"]["bare"] > 0
    assert set(s["ratios"]["prompt_over_kv"]) == {"1", "2"}
    assert s["ratios"]["kv_kmax_over_kmin"] > 0 and s["ratios"]["kv_over_bare"] > 0
    assert 0 < s["overhead_fraction"] < 1
    assert "host" in s["store_device_note"]
    recs = json.loads((out / "records.json").read_text())
    assert len(recs) == 2 * (1 + 4 * 2)  # per question: bare + (kv, prompt, kv-sel50, kv-tail1) x 2 k
    prefilled = {(r["qid"], r["k_asked"], r["mode"]): r["prefilled_tokens"] for r in recs}
    for r in recs:
        assert r["q2fa"] >= r["q2ft"] >= r["ttft"] > 0
        if r["mode"] == "kv":
            assert r["prefilled_tokens"] < r["prompt_tokens"]
            assert prefilled[(r["qid"], r["k_asked"], "kv-sel50")] > r["prefilled_tokens"]  # probe + half the facts
        elif r["mode"] == "prompt":
            assert r["prefilled_tokens"] == r["prompt_tokens"]
    assert "pr/kv" in res.output


@pytest.mark.slow
def test_bench_throughput(tiny):
    out = tiny["root"] / "throughput"
    cli(
        "bench",
        "throughput",
        "--engine",
        "hf",
        "--users",
        "1,2",
        "--k",
        2,
        "--window",
        0,
        "--tokens",
        4,
        "--retrieval",
        "rrf",
        *common(tiny, out, 4),
    )
    s = check_outputs(out, "qps_vs_users.png")
    assert s["retrieval"] == "rrf:60:1"
    assert set(s["qps"]["kv"]) == {"1", "2"} and set(s["qps"]["prompt"]) == {"1", "2"}
    assert all(v > 0 for m in ("kv", "prompt") for v in s["qps"][m].values())
    assert set(s["ratios"]["kv_over_prompt"]) == {"1", "2"}
    assert "one at a time" in s["concurrency_note"] and s["includes_retrieval_and_composition"]
    recs = json.loads((out / "records.json").read_text())
    assert len(recs) == 2 * (2 + 4) and all(r["generated_tokens"] == 4 for r in recs)
    u2 = [r for r in recs if r["users"] == 2 and r["mode"] == "kv"]
    assert len({r["qid"] for r in u2}) == 4  # 2 users x 2 distinct questions


def test_bench_footprint(tiny):
    out = tiny["root"] / "footprint"
    cli("bench", "footprint", "--engine", "hf", "--window", 0, *common(tiny, out))
    s = check_outputs(out, "footprint.png")
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64: 2*30*3*64*b bytes per token (b: the machine's dtype).
    # Measured on disk: the safetensors file holds that plus a header of a few hundred bytes, nothing else.
    from kvmem.hardware import resolve_dtype

    b = 2 if resolve_dtype(None) == "bfloat16" else 4
    assert s["theory_bytes_per_token"] == 2 * 30 * 3 * 64 * b
    (rec,) = json.loads((out / "records.json").read_text())
    n = rec["fact_tokens"]
    assert n > 100 and 0 < rec["kv_file_bytes"] - n * 2 * 30 * 3 * 64 * b < 1024
    assert s["kv_bytes_per_conversation"]["conv-26"] > 0 and s["index_bytes"]["conv-26"] > 0
    assert s["metadata_bytes"]["conv-26"] > 0
    # in-process RSS: it can shrink below the value before the load when earlier tests freed memory
    assert s["rss_bytes"]["peak"] >= s["rss_bytes"]["serving"] > 0 and s["rss_bytes"]["before_load"] > 0


def test_bench_encode(tiny):
    out = tiny["root"] / "encode"
    cli("bench", "encode", "--engine", "hf", "--window", "0,2", *common(tiny, out))
    s = check_outputs(out, "encode.png")
    assert set(s["by_window"]) == {"0", "2"}
    for w in s["by_window"].values():
        assert w["tokens_per_s"] > 0 and w["plain_tokens_per_s"] > 0 and w["fraction_of_plain_forward"] > 0
        assert w["seconds_per_conversation"] > 0
    assert s["by_window"]["2"]["encoded_tokens"] > s["by_window"]["0"]["encoded_tokens"]


class _Judge(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible stub: CORRECT for the first question it sees, an unparseable reply afterwards."""

    calls: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.calls.append(body)
        text = '{"label": "CORRECT"}' if len(_Judge.calls) == 1 else "I cannot tell."
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_eval_locomo_scores_judges_and_resumes(tiny):
    out = tiny["root"] / "eval"
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/v1"
        args = [
            "eval",
            "locomo",
            "--engine",
            "hf",
            "--k",
            "1",
            "--window",
            "0",
            "--mode",
            "kv,prompt",
            "--max-new-tokens",
            8,
            "--judge-url",
            url,
            "--judge-model",
            "stub",
            *common(tiny, out),
        ]
        res = cli(*args)
        assert "4 to answer" in res.output
        s = check_outputs(out, "accuracy_vs_k.png")
        rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and {r["mode"] for r in rows} == {"kv", "prompt"}
        for r in rows:
            assert 0 <= r["f1"] <= 1 and r["em"] in (0, 1) and r["judge"] in (0, 1)
            assert r["f1"] == pytest.approx(locomo_f1(r["answer"], r["reference"], r["category"]), abs=1e-4)
        assert sum(r["judge"] for r in rows) == 1  # one CORRECT; unparseable verdicts count as wrong
        assert sum(1 for r in rows if r.get("judge_parsed") is False) == 3
        assert s["f1"]["0"]["1"]["kv"]["overall"] is not None and "overall" in s["f1_gap_prompt_minus_kv"]["0"]["1"]
        assert {r["category"] for r in s["table"]} == {1, 2, 3, 4, "overall"}
        recall = s["evidence_recall"]  # every question of the sample, retrieval only
        assert recall["k"] == [5, 10, 20, 50, 100] and recall["retrieval"] == "weighted:0.1"  # the default
        overall = recall["categories"]["overall"]
        assert overall["questions"] > 100 and 0 < overall["coverage"] < 100  # facts of sessions 1-2 only
        assert overall["recall"]["100"] == overall["coverage"]  # k above the fact count: every fact retrieved
        assert overall["recall"]["5"] <= overall["recall"]["20"] <= overall["recall"]["100"]
        # rerun: nothing is answered again, the file is unchanged
        before = (out / "records.jsonl").read_text()
        res = cli(*args)
        assert "0 to answer, 4 already" in res.output
        assert (out / "records.jsonl").read_text() == before and len(_Judge.calls) == 4
        # another neighbour count: its own store and its own records, the default's (m=4) untouched
        res = cli(*[a for a in args if a not in ("--judge-url", url, "--judge-model", "stub")], "--neighbours", 2)
        assert "4 to answer, 0 already" in res.output
        names = {p.name for p in (tiny["root"] / "stores").glob("*/conv-26/*/*/*")}
        assert {"w0-n4", "w0-n2"} <= names and "w0" not in names
        rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
        assert [r.get("neighbours", 0) for r in rows] == [4] * 4 + [2] * 4
        assert json.loads((out / "summary.json").read_text())["neighbours"] == 2
        # the facts in write order: records of their own; with one fact (k=1) the order changes no prompt, so
        # the paired comparison finds every answer the same
        timed = tiny["root"] / "eval-time"
        plain = [a for a in args if a not in ("--judge-url", url, "--judge-model", "stub")]
        res = cli(*plain[: plain.index("--out")], "--out", timed, "--no-progress", "--neighbours", 2, "--order", "time")
        assert "4 to answer, 0 already" in res.output
        assert {json.loads(x)["order"] for x in (timed / "records.jsonl").read_text().splitlines()} == {"time"}
        res = cli("eval", "compare", out, timed, "--out", tiny["root"] / "compare")
        got = json.loads((tiny["root"] / "compare" / "compare.json").read_text())
        assert got["b"]["retrieval_order"] == "weighted:0.1, time"
        assert got["a"]["retrieval_order"] == "weighted:0.1, relevance"
        overall = [r for r in got["rows"] if r["category"] == "overall"]
        assert {r["mode"] for r in overall} == {"kv", "prompt"}
        assert all(r["n"] == 2 and r["delta_f1"] == 0 and r["same_answer"] == 2 for r in overall)
        assert all(r["same_facts"] == 2 and r["f1_a"] == r["f1_b"] for r in overall)
        err = cli(*plain, "--order", "newest", rc=2).output
        assert "order must be one of relevance, time, not 'newest'" in err and "Traceback" not in err
    finally:
        srv.shutdown()


def test_eval_compare_pairs_two_runs_by_question(tmp_path):
    """``eval compare``: per category and overall, each run's mean F1 (%) over the questions both answered, b − a
    with its paired CI, and how many used the same facts; a setting only one run answered is left out; two runs
    without a common setting, or a directory that holds no run, are one error line (exit 2)."""

    def rec(qid, cat, f1, facts, mode="kv", k=5):
        return {"model": "m", "mode": mode, "k": k, "window": 5, "neighbours": 4, "history": False, "qid": qid,
                "category": cat, "f1": f1, "answer": str(f1), "fact_ids": facts}  # fmt: skip

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ra = [rec("q1", 1, 0.5, ["x", "y"]), rec("q2", 4, 0.0, ["z"]), rec("q3", 4, 1.0, ["w"]), rec("q9", 1, 1.0, [])]
    rb = [rec("q1", 1, 0.75, ["y", "x"]), rec("q2", 4, 0.5, ["v"]), rec("q3", 4, 1.0, ["w"]), rec("q1", 1, 1, [], k=9)]
    (a / "records.json").write_text(json.dumps(ra))
    (b / "records.json").write_text(json.dumps(rb))
    res = cli("eval", "compare", a, b, "--out", a)  # into a run's directory: its own files are left alone
    assert json.loads((a / "records.json").read_text()) == ra
    got = json.loads((a / "compare.json").read_text())
    rows = {r["category"]: r for r in got["rows"]}
    assert set(rows) == {"multi-hop", "single-hop", "overall"}  # q9 is in a alone, k=9 in b alone
    assert got["left_out"] == {"settings_only_in_a": 0, "settings_only_in_b": 1, "answers_only_in_a": 1,
                               "answers_only_in_b": 0}  # fmt: skip
    assert "left out (in one run only): 1 settings only in b, 1 answers only in a" in res.output
    o = rows["overall"]
    assert (o["n"], o["f1_a"], o["f1_b"], o["delta_f1"], o["same_facts"], o["same_answer"]) == (3, 50, 75, 25, 2, 1)
    assert o["ci95"][0] <= 25 <= o["ci95"][1]
    assert (rows["single-hop"]["f1_a"], rows["single-hop"]["f1_b"], rows["single-hop"]["delta_f1"]) == (50, 75, 25)
    assert "| overall | 3 | 50.00 | 75.00 | +25.00 |" in (a / "compare.md").read_text()
    # a record from before neighbours and history were recorded ran without them: it pairs with m=0
    c, d = tmp_path / "c", tmp_path / "d"
    c.mkdir(), d.mkdir()
    (c / "records.json").write_text(json.dumps([rec("q1", 1, 0.5, []) | {"neighbours": 0}]))
    old = {k: v for k, v in rec("q1", 1, 0.25, []).items() if k not in ("neighbours", "history")}
    (d / "records.json").write_text(json.dumps([old]))
    cli("eval", "compare", c, d, "--out", c)
    o = [r for r in json.loads((c / "compare.json").read_text())["rows"] if r["category"] == "overall"]
    assert [(r["neighbours"], r["history"], r["n"], r["delta_f1"]) for r in o] == [(0, False, 1, -25.0)]
    bad = [  # each a clean error naming the file, never a traceback
        ([rec("q1", 1, "0.5", [])], "has F1 '0.5', not a number in [0, 1]"),
        ([rec("q1", 1, 1.5, [])], "has F1 '1.5'"),
        ([rec("q1", 1, True, [])], "has F1 'True'"),
        ([rec("q1", 7, 0.5, [])], "has category '7', not 1-4"),
        ([rec("q1", 1, 0.5, ["x", 1])], "fact_ids that are not a list of strings"),
        ([rec("q1", 1, 0.5, []), rec("q1", 1, 0.5, [])], "answers question 'q1' twice"),
        ([{**rec("q1", 1, 0.5, []), "qid": ["q1"]}], "has no question id"),
        ([], "holds no records"),
    ]
    for records, why in bad:
        (b / "records.json").write_text(json.dumps(records))
        err = cli("eval", "compare", a, b, rc=2).output
        assert why in err and str(b / "records.json") in err and "Traceback" not in err, (why, err)
    (b / "records.json").write_text("[" * 100_000)
    assert "is not JSON" in cli("eval", "compare", a, b, rc=2).output
    (b / "records.json").write_text(json.dumps([rec("q1", 2, 0.5, [])]))
    assert "question 'q1' is category 1 in" in cli("eval", "compare", a, b, rc=2).output
    (b / "records.json").write_text(json.dumps([rec("q1", 1, 0.5, [], k=7)]))
    err = cli("eval", "compare", a, b, rc=2).output
    assert "share no question in any setting" in err and "Traceback" not in err
    assert "has no records.json" in cli("eval", "compare", a, tmp_path / "none", rc=2).output


def test_eval_compare_pairs_across_a_named_setting(tmp_path):
    """``eval compare --a KEY=VALUE --b KEY=VALUE``: two modes of one run, or two windows of two runs, paired by
    question across the named key; a key with several values left unchosen, a value no record has, or a key that
    is not a setting's, is one error line (exit 2)."""

    def rec(qid, cat, f1, mode="kv", window=5, k=5):
        return {"model": "m", "mode": mode, "k": k, "window": window, "neighbours": 4, "history": False,
                "qid": qid, "category": cat, "f1": f1, "answer": f"{mode}{f1}", "fact_ids": ["x"]}  # fmt: skip

    one = tmp_path / "one"
    one.mkdir()
    rows = [rec("q1", 1, 0.5, "prompt"), rec("q2", 4, 1.0, "prompt"), rec("q1", 1, 0.25, "kv"), rec("q2", 4, 0.5, "kv")]
    rows.append(rec("q1", 1, 0.0, "kv", k=9))  # another k: paired on its own, with no prompt at k=9 to meet
    (one / "records.json").write_text(json.dumps(rows))
    res = cli("eval", "compare", one, one, "--a", "mode=prompt", "--b", "mode=kv", "--out", tmp_path / "c")
    got = json.loads((tmp_path / "c" / "compare.json").read_text())
    o = [r for r in got["rows"] if r["category"] == "overall"]
    assert [(r["mode"], r["k"], r["n"], r["f1_a"], r["f1_b"], r["delta_f1"]) for r in o] == [
        ("prompt → kv", 5, 2, 75.0, 37.5, -37.5)
    ]
    assert got["a"]["select"] == {"mode": "prompt"} and got["left_out"]["settings_only_in_b"] == 1
    assert "| prompt → kv | 5 | overall | 2 | 75.00 | 37.50 | -37.50 |" in (tmp_path / "c" / "compare.md").read_text()
    assert "prompt → kv" in res.output
    w0, w5 = tmp_path / "w0", tmp_path / "w5"
    w0.mkdir(), w5.mkdir()
    (w0 / "records.json").write_text(json.dumps([rec("q1", 1, 0.2, window=0), rec("q2", 4, 0.4, window=0)]))
    (w5 / "records.json").write_text(json.dumps([rec("q1", 1, 0.6), rec("q2", 4, 0.4), rec("q3", 4, 1.0)]))
    cli("eval", "compare", w0, w5, "--a", "window=0", "--b", "window=5", "--out", tmp_path / "w")
    o = [r for r in json.loads((tmp_path / "w" / "compare.json").read_text())["rows"] if r["category"] == "overall"]
    assert [(r["window"], r["n"], r["delta_f1"]) for r in o] == [("0 → 5", 2, 20.0)]
    # without a selector, the windows differ and nothing pairs
    assert "share no question in any setting" in cli("eval", "compare", w0, w5, rc=2).output
    for args, why in [
        (("--a", "mode=prompt"), "holds mode=prompt and kv: choose one"),  # b keeps both modes: which one?
        (("--a", "mode=judge", "--b", "mode=kv"), "no record has mode=judge (in its records, mode is kv, prompt)"),
        ((), "keep the same records of one file"),  # a run against itself, unselected: every difference is zero
        (("--a", "k=5", "--b", "k=5"), "keep the same records of one file"),  # ... or selected alike
        (("--a", "mode=prompt", "--a", "k=9", "--b", "mode=kv"), "no record has mode=prompt, k=9 together"),
        (("--a", "k=10", "--b", "k=5"), "no record has k=10 (in its records, k is 5, 9)"),
        (("--a", "retrieval=hybrid"), "give KEY=VALUE with KEY one of model, mode, k"),
        (("--b", "mode"), "give KEY=VALUE"),
        (("--a", "k=5", "--a", "k=9"), "--a names k twice"),
    ]:
        err = cli("eval", "compare", one, one, *args, rc=2).output
        assert why in err and "Traceback" not in err, (args, err)
    # two values of a key left out of the pairing, each on other questions, are refused too, never averaged
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "records.json").write_text(json.dumps([rec("q1", 1, 0.5, "prompt"), rec("q2", 4, 1.0, "kv")]))
    err = cli("eval", "compare", mixed, one, "--b", "mode=kv", rc=2).output
    assert "holds mode=prompt and kv: choose one" in err and str(mixed) in err
    (mixed / "records.json").write_text(json.dumps([{k: v for k, v in rec("q1", 1, 0.5).items() if k != "mode"}]))
    assert "record 0 has no mode" in cli("eval", "compare", mixed, one, rc=2).output
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # a path that cannot resolve is "no run there", as any other
    assert "has no records.json" in cli("eval", "compare", loop, one, rc=2).output
    from kvmem.bench.common import paired_bootstrap

    # a paired difference that rounds to zero is 0.0, never -0.0: it prints +0.00 in every table and JSON
    mean, ci = paired_bootstrap([-0.004, -0.002, -0.003])
    assert f"{mean:+.2f}" == "+0.00" and [f"{x:+.2f}" for x in ci] == ["+0.00", "+0.00"] and "-0.0" not in str(ci)
    assert f"{paired_bootstrap([-1.236, -1.236])[0]:+.2f}" == "-1.24"


def synthetic_frontier(d: Path, model: str, qids: list[str], like: dict, kv_f1: float, kv_ttft: float) -> Path:
    """An ``eval frontier --out`` at ``d`` for ``model`` on ``qids``, as ``like`` (another run's summary: the same
    questions, encoding, engine and machine): prompt at k=5 (F1 0.1 per question, 1 s) and kv at k=5 (``kv_f1``
    per question, ``kv_ttft`` ms; the bare query 0.4 ms)."""
    (d / model / "eval").mkdir(parents=True, exist_ok=True)
    (d / model / "latency").mkdir(parents=True, exist_ok=True)
    rows = [{"qid": q, "mode": m, "k": 5, "f1": f} for q in qids for m, f in (("prompt", 0.1), ("kv", kv_f1))]
    (d / model / "eval" / "records.json").write_text(json.dumps(rows))
    (d / model / "latency" / "summary.json").write_text(json.dumps({"ttft_ms": {"bare": 0.4}}))
    engine = like["points"][0]["engine"]
    points = [{"model": model, "engine": engine, "method": m, "k": 5, "n": len(qids), "f1": 100 * f,
               "judge": None, "ttft_ms": t, "ttft_p95_ms": t} for m, f, t in (("prompt", 0.1, 1000.0),
                                                                               ("kv", kv_f1, kv_ttft))]  # fmt: skip
    keep = ("samples", "questions", "encoding", "retrieval", "machine", "latency_questions", "max_new_tokens")
    summary = {"command": "eval frontier", "models": [model], "points": points} | {
        k: like[k] for k in keep if k in like
    }
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_frontier_add_run_takes_only_runs_that_compare(tmp_path):
    """``eval frontier --add-run``: an earlier run's other models join with their points, per-question F1s and
    bare-query TTFTs, and count in both targets. Refused with a one-line error naming what differs: before any
    measuring, a run of another encoding, answer length or machine, adding no model, or whose files are missing
    or malformed; after it, one on other questions or from another engine."""
    from kvmem.bench import frontier

    machine = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "cuda": None, "time": "then"}
    like = {"samples": ["conv-26"], "questions": 2, "encoding": "w=5, m=4", "machine": machine,
            "latency_questions": 9, "max_new_tokens": 32, "points": [{"engine": "vllm"}]}  # fmt: skip
    big = synthetic_frontier(tmp_path / "big", "big-model", ["q1", "q2"], like, kv_f1=0.5, kv_ttft=300.0)
    ev, qids = {"samples": ["conv-26"], "questions": 2}, {"q1", "q2"}
    here = [
        {"model": "small", "method": "prompt", "k": 5, "f1": 10.0, "ttft_ms": 1200.0},
        {"model": "small", "method": "kv", "k": 5, "f1": 20.0, "ttft_ms": 200.0},
    ]
    scores = {("small", "prompt", 5): {"q1": 0.1, "q2": 0.1}, ("small", "kv", 5): {"q1": 0.1, "q2": 0.3}}
    added = frontier.AddedRun.load(big, ["small"], "w=5, m=4", 32, machine | {"time": "now"}, "cosine")
    added.check(ev, qids, "vllm")
    assert added.bare == {"big-model": 0.4} and added.note["models"] == ["big-model"]
    assert added.note["latency_questions"] == 9
    assert [(p["method"], p["f1"]) for p in added.points] == [("prompt", 10.0), ("kv", 50.0)]
    assert added.scores == {
        ("big-model", "prompt", 5): {"q1": 0.1, "q2": 0.1},
        ("big-model", "kv", 5): {"q1": 0.5, "q2": 0.5},
    }
    goals = frontier.targets(here + added.points, scores | added.scores, {"small": 190.0} | added.bare)
    # within 1.3x its bare query (0.52 ms) the big model has no kvmem point; the small one's kv beats its prompt
    assert [(r["model"], r["met"], r["kvmem"] and r["kvmem"]["f1"]) for r in goals["same_model"]] == [
        ("small", True, 20.0),
        ("big-model", False, None),
    ]
    # every prompt point's best faster kvmem point is the big model's kv (50 at 300 ms): +40 over both
    assert [(r["prompt"]["model"], r["kvmem"]["model"], r["delta_f1"], r["met"]) for r in goals["across_models"]] == [
        ("small", "big-model", 40.0, True),
        ("big-model", "big-model", 40.0, True),
    ]
    load = [  # (directory, measured, encoding, max_new_tokens, machine, retrieval), what the one-line error says
        ((big, ["small"], "w=0, m=4", 32, machine, "cosine"), "its encoding is 'w=5, m=4'"),
        ((big, ["small"], "w=5, m=4", 16, machine, "cosine"), "its max_new_tokens is 32"),
        ((big, ["small"], "w=5, m=4", 32, machine | {"cpu": "Intel Xeon"}, "cosine"), "its machine cpu is 'AMD EPYC'"),
        ((big, ["small", "big-model"], "w=5, m=4", 32, machine, "cosine"), "it adds no model"),
        ((tmp_path / "none", ["small"], "w=5, m=4", 32, machine, "cosine"), "no summary.json there"),
        # a run from before the summary recorded its retrieval ranked by cosine: not this run's hybrid
        (
            (big, ["small"], "w=5, m=4", 32, machine, "weighted:0.1"),
            "its retrieval is 'cosine', this run's 'weighted",
        ),
    ]
    for args, why in load:
        with pytest.raises(ValueError, match=why):
            frontier.AddedRun.load(*args)
    for other, why in (
        (
            ({"samples": ["conv-26"], "questions": 3}, {"q1", "q2"}, "vllm"),
            "it scored 2 questions of .'conv-26'., this run 3",
        ),
        ((ev, {"q1", "q3"}, "vllm"), "big-model prompt k=5 answered other questions"),
        (
            (ev, qids, "hf"),
            "its engine is .'vllm'., this run's 'hf'",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            added.check(*other)
    summary = json.loads((big / "summary.json").read_text())
    records, latency = big / "big-model" / "eval" / "records.json", big / "big-model" / "latency" / "summary.json"
    broken = [  # (file, its new text), what the one-line error says
        (big / "summary.json", json.dumps(summary | {"points": [1]}), "summary.json is not what eval frontier writes"),
        (big / "summary.json", json.dumps(summary | {"models": ["../x"]}), "is not a model name"),
        (big / "summary.json", json.dumps(summary | {"machine": [1]}), "machine"),
        (big / "summary.json", "[" * 100_000 + "]" * 100_000, "cannot be read"),
        (records, json.dumps([{"qid": "q1"}]), "records.json is not what eval frontier writes"),
        (records, json.dumps([{"qid": "q1", "mode": "kv", "k": 5, "f1": 0.5}]), "has 0 answers, its point says 2"),
        (latency, json.dumps({"ttft_ms": {"kv": {"5": 1.0}}}), "latency/summary.json is not what eval frontier"),
    ]
    saved = {f: f.read_text() for f, _, _ in broken}
    for f, text, why in broken:
        f.write_text(text)
        with pytest.raises(ValueError, match=why):
            frontier.AddedRun.load(big, ["small"], "w=5, m=4", 32, machine, "cosine")
        f.write_text(saved[f])
    # a run that itself added runs offers only the models it measured: the others have no folders in it
    (big / "summary.json").write_text(
        json.dumps(summary | {"models": ["big-model", "x"], "measured_models": ["big-model"]})
    )
    assert frontier.AddedRun.load(big, ["small"], "w=5, m=4", 32, machine, "cosine").note["models"] == ["big-model"]
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "summary.json").write_text("{")
    err = cli("eval", "frontier", "--engine", "hf", "--methods", "prompt,kv", "--add-run", tmp_path / "none",
              "--out", tmp_path / "out", rc=2).output  # fmt: skip
    assert "cannot be read" in err and "Traceback" not in err
    err = cli("eval", "frontier", "--engine", "hf", "--methods", "prompt,kv", "--retrieval", "bm25",
              "--out", tmp_path / "out", rc=2).output  # fmt: skip
    assert "retrieval 'bm25': one of cosine, hybrid" in err and "Traceback" not in err


@pytest.mark.slow
def test_eval_frontier_points_and_table(tiny):
    """``eval frontier`` on the transformers engine: every (method, k) is a point whose F1 is the mean of its eval
    answers and whose TTFT comes from the latency run; each prompt point's row names the best faster kvmem point;
    a rerun answers nothing again and reuses the latency run."""
    out = tiny["root"] / "frontier"
    args = ["eval", "frontier", "--engine", "hf", "--models", FAST, "--methods", "prompt,kv,kv-tail1", "--k", "2,5",
            "--window", 0, "--latency-questions", 1, "--max-new-tokens", 4, "--plot", out / "copy.png", "--data",
            tiny["data"], "--samples", "conv-26", "--questions", 2, "--out", out, "--no-progress"]  # fmt: skip
    res = cli(*args)
    s = check_outputs(out, "frontier.png")
    assert (out / "copy.png").read_bytes() == (out / "frontier.png").read_bytes()
    assert s["questions"] == 2 and s["latency_questions"] == 1 and s["encoding"] == "w=0, m=4"
    points = {(p["method"], p["k"]): p for p in s["points"]}
    assert set(points) == {(m, k) for m in ("prompt", "kv", "kv-tail1") for k in (2, 5)}
    evals = [json.loads(x) for x in (out / FAST / "eval" / "records.jsonl").read_text().splitlines()]
    lat = json.loads((out / FAST / "latency" / "summary.json").read_text())
    for (m, k), p in points.items():
        f1s = [r["f1"] for r in evals if r["mode"] == m and r["k"] == k]
        assert len(f1s) == p["n"] == 2 and 0 <= p["f1"] <= 100
        assert p["f1"] == pytest.approx(100 * sum(f1s) / 2, abs=0.01)
        assert p["ttft_ms"] == lat["by_window"]["0"]["median_ms"][m][str(k)]["ttft"] > 0
        assert p["ttft_p95_ms"] >= p["ttft_ms"]
    assert [(r["model"], r["k"]) for r in s["frontier"]] == [(FAST, 2), (FAST, 5)]
    for row in s["frontier"]:
        prompt = points[("prompt", row["k"])]
        assert row["prompt_f1"] == prompt["f1"] and row["prompt_ttft_ms"] == prompt["ttft_ms"]
        faster = [p for (m, _), p in points.items() if m != "prompt" and p["ttft_ms"] <= prompt["ttft_ms"]]
        if not faster:
            assert row["method"] is None
            continue
        best = points[(row["method"], row["method_k"])]
        assert best["ttft_ms"] <= prompt["ttft_ms"] and best["f1"] == max(p["f1"] for p in faster)
        assert row["n"] == 2 and row["delta_f1"] == pytest.approx(best["f1"] - prompt["f1"], abs=0.02)
        assert row["ci95"] is not None and row["ci95"][0] <= row["delta_f1"] <= row["ci95"][1]
        assert f"| {FAST} | {row['k']} | {row['prompt_f1']} |" in (out / "frontier.md").read_text()
    assert "F1 difference (95% CI)" in res.output
    # the targets: the best kvmem point within 1.3x the bare query's TTFT against the best prompt point; and, for
    # each prompt point, the best faster kvmem point of any model (one model here: the frontier's own rows)
    same, across = s["targets"]["same_model"], s["targets"]["across_models"]
    bare = lat["ttft_ms"]["bare"]
    assert [r["model"] for r in same] == [FAST] and same[0]["bare_ttft_ms"] == bare > 0
    assert same[0]["prompt"]["f1"] == max(p["f1"] for (m, _), p in points.items() if m == "prompt")
    within = [p for (m, _), p in points.items() if m != "prompt" and p["ttft_ms"] <= 1.3 * bare]
    if within:
        assert same[0]["kvmem"]["f1"] == max(p["f1"] for p in within) and same[0]["n"] == 2
        assert same[0]["met"] == (same[0]["delta_f1"] >= 0)
    else:
        assert same[0]["kvmem"] is None and same[0]["met"] is False
    assert [(r["prompt"]["k"], r["kvmem"] and r["kvmem"]["f1"]) for r in across] == [
        (r["k"], r["f1"]) for r in s["frontier"]
    ]
    assert all(r["met"] == (r["delta_f1"] is not None and r["delta_f1"] >= 2) for r in across)
    assert "met (>= 0)" in (out / "frontier.md").read_text()
    assert s["retrieval"] == "weighted:0.1" and {r["retrieval"] for r in evals} == {"weighted:0.1"}  # the default
    assert lat["retrieval"] == "weighted:0.1"  # the latency run ranks as the answers do
    # the rerun answers nothing again; an earlier run of another model on the same questions joins the tables,
    # the targets and the plot: its kv point, faster and better than every prompt point here, is each one's best
    qids = sorted({r["qid"] for r in evals})
    other = synthetic_frontier(out.parent / "other", "other-model", qids, s, kv_f1=0.9, kv_ttft=0.5)
    res = cli(*args, "--add-run", other)
    assert "latency: reusing" in res.output and "0 to answer, 12 already" in res.output
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["points"][: len(s["points"])] == s["points"] and s2["measured_models"] == [FAST]
    assert s2["models"] == [FAST, "other-model"] and [a["models"] for a in s2["added_runs"]] == [["other-model"]]
    assert {(p["model"], p["method"]) for p in s2["points"][len(s["points"]) :]} == {
        ("other-model", "prompt"),
        ("other-model", "kv"),
    }
    across = s2["targets"]["across_models"]
    assert len(across) == 3 and all(r["kvmem"]["model"] == "other-model" for r in across)
    assert [r["model"] for r in s2["targets"]["same_model"]] == [FAST, "other-model"]
    assert "other-model: from the run in" in (out / "frontier.md").read_text()


@pytest.mark.slow
def test_eval_recall_cosine_against_hybrid(tiny, monkeypatch):
    """``kvmem eval recall``: evidence recall@k per category for each retrieval, from a store built with the
    smallest model; at a k above the fact count both retrievals recall every turn a fact came from."""
    out = tiny["root"] / "recall"
    monkeypatch.setenv("KVMEM_BENCH_CACHE", str(out / "stores"))  # its w0 store apart from the other tests
    res = cli("eval", "recall", "--data", tiny["data"], "--samples", "conv-26", "--k", "1,5,100", "--out", out,
              "--no-progress")  # fmt: skip
    assert "evidence recall, hybrid" in res.output and "hybrid - cosine at k=100" in res.output
    s = json.loads((out / "summary.json").read_text())
    cos, hyb = s["recall"]["cosine"]["categories"], s["recall"]["hybrid"]["categories"]
    assert set(cos) == {"1", "2", "3", "4", "overall"} and s["recall"]["hybrid"]["retrieval"] == "weighted:0.1"
    for cat in cos:
        assert cos[cat]["recall"]["100"] == hyb[cat]["recall"]["100"] == cos[cat]["coverage"] > 0
        assert cos[cat]["recall"]["1"] <= cos[cat]["recall"]["5"] <= cos[cat]["recall"]["100"]
    assert s["gain_at_100_over_cosine"]["hybrid"]["overall"] == 0
    cli("eval", "recall", "--data", tiny["data"], "--retrieval", "cosine,bm25", "--out", out, rc=2)


@pytest.mark.slow
def test_bench_memory(tiny):
    out = tiny["root"] / "memory"
    cli(
        "bench",
        "memory",
        "--turns",
        3,
        "--facts",
        1500,
        "--searches",
        4,
        "--deletes",
        3,
        "--window",
        2,
        "--data",
        tiny["data"],
        "--model",
        FAST,
        "--out",
        out,
    )
    s = check_outputs(out, "memory.png")
    assert s["facts_for_search"] == 1500 and s["deleted_absent_from_next_search"] is True
    for key in ("add_ms", "add_scoped_ms", "plain_forward_ms", "search_ms", "search_scoped_ms", "delete_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p95"]
    for key in ("search_two_scopes_ms", "search_filtered_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p95"]
    recs = json.loads((out / "records.json").read_text())
    assert [r["op"] for r in recs].count("add") == 3 and all(r["tokens"] > 10 for r in recs if r["op"] == "add")
    assert [r["op"] for r in recs].count("add_scoped") == 3


@pytest.mark.slow
def test_bench_mcp(tmp_path):
    out = tmp_path / "mcp"
    cli("bench", "mcp", "--rounds", 2, "--model", FAST, "--dtype", "float32", "--out", out)
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds"] == 2 and s["machine"]["cpu"] is not None
    for op in ("mcp_session", "mcp_list_tools", "mcp_add", "mcp_search", "rest_add", "rest_search"):
        assert 0 < s[f"{op}_ms"]["p50"] <= s[f"{op}_ms"]["p95"]
    assert s["mcp_over_rest_p50"]["add"] > 0 and s["mcp_over_rest_p50"]["search"] > 0
    recs = json.loads((out / "records.json").read_text())
    assert len(recs) == 2 * 6 and {r["round"] for r in recs} == {1, 2}  # round 0 is the warm-up


def test_bench_chat_cost(tiny):
    out = tiny["root"] / "chat-cost"
    cli(
        "bench",
        "chat-cost",
        "--counts",
        "8,250",
        "--chats",
        4,
        "--k",
        5,
        "--fact-tokens",
        4,
        "--cache-bytes",
        1 << 20,
        "--data",
        tiny["data"],
        "--model",
        FAST,
        "--out",
        out,
    )
    s = check_outputs(out, "chat_cost.png")
    per = s["per_count"]
    assert set(per) == {"8", "250"} and per["250"]["segments"] == 3 and per["8"]["segments"] == 1
    for v in per.values():
        assert 0 < v["chat_ms"]["p50"] <= v["chat_ms"]["p95"] and v["store_cache_bytes"] <= 1 << 20
    recs = json.loads((out / "records.json").read_text())
    assert len(recs) == 8 and all(r["compose_ms"] > 0 and r["plan_ms"] > 0 for r in recs)


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_tools(tmp_path):
    """``bench tools`` at toy sizes on the smallest model whose chat template has tools: every arm in the summary;
    with tools, kv and prompt mode see the same prompt, prompt mode prefills all of it and kv mode only the
    turns; the block is encoded once and then read from the cache."""
    model = "qwen2.5-coder-0.5b-instruct"
    if not (model_dir(model) / MANIFEST).exists():
        pytest.fail(f"{model} is not installed; run: kvmem models install {model}")
    out = tmp_path / "tools"
    args = ("--k", 2, "--tools", "0,2", "--chats", 1, "--memories", 3, "--fact-tokens", 4, "--dtype", "float32")
    cli("bench", "tools", *args, "--model", model, "--out", out)
    s = check_outputs(out, "tools_ttft.png")
    arms = s["arms"]
    assert set(arms) == {f"k2/tools{n}/{m}" for n in (0, 2) for m in ("kv", "prompt")}
    kv, pr = arms["k2/tools2/kv"], arms["k2/tools2/prompt"]
    assert kv["prompt_tokens"] == pr["prompt_tokens"] == pr["prefilled_tokens"] > 300
    assert kv["prefilled_tokens"] < 30 and kv["first_ms"] > 0 and 0 < kv["ttft_ms"]["p50"] <= kv["ttft_ms"]["p95"]
    assert arms["k2/tools0/kv"]["prefilled_tokens"] > kv["prefilled_tokens"]  # without tools the system text too
    assert s["tools_cache"]["entries"] == 1 and s["tools_cache"]["hits"] >= 1
    assert s["kv_p50_tools2_over_tools0"]["2"] > 0 and len(json.loads((out / "records.json").read_text())) == 4


def test_bench_store(tiny, postgres):
    """``bench store`` end to end at toy sizes: every op on both backends, the three TTFT arms through
    ``kvmem serve``, ratios and targets in the summary; its PostgreSQL schema is dropped afterwards."""
    import psycopg

    out = tiny["root"] / "store"
    args = ["--adds", 4, "--deletes", 2, "--memories", 120, "--searches", 4, "--gathers", 2, "--chats", 2, "--k", 3]
    args += ["--data", tiny["data"]]
    cli("bench", "store", "--postgres", postgres, *args, "--model", FAST, "--out", out)
    s = check_outputs(out, "store_backends.png")
    for op in ("add", "delete", "search", "gather20-cold", "gather50-warm"):
        assert all(s["per_op"][op][b]["p50"] > 0 for b in ("local", "shared")), op
    assert [s["per_op"]["ttft"][a]["n"] for a in ("local", "shared-warm", "shared-cold")] == [2, 2, 2]
    assert s["ratios"]["add_shared_over_local_p50"] > 0 and s["targets"]["ttft_shared_warm_over_local_p50"] == 1.1
    with psycopg.connect(postgres) as conn:
        left = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'kvmem_bench_%'").fetchall()
    assert left == []


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_stops_the_vllm_engine(tiny):
    """A terminated `kvmem eval` takes vLLM's engine-core process with it (before cli.exit_on_signals it kept
    running, orphaned, holding its KV cache)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from kvmem.hardware import cpu_facts, vllm_kernels

    facts = cpu_facts()
    if vllm_kernels(facts) is None and not facts.cuda:
        pytest.skip("vLLM cannot run on this CPU (test_vllm_engine_flag checks the error)")
    args = [
        "eval",
        "locomo",
        "--engine",
        "vllm",
        "--k",
        "2",
        "--window",
        "0",
        "--mode",
        "kv,prompt",
        *common(tiny, tiny["root"] / "sigterm", 40),
    ]
    script = Path(sys.executable).with_name("kvmem")  # the installed command, as users start it
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvmem.cli"]
    p = subprocess.Popen([*cmd, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engine, t0 = [], time.monotonic()
    try:
        while not engine and p.poll() is None and time.monotonic() - t0 < 600:
            time.sleep(0.5)
            engine = [c for c in psutil.Process(p.pid).children(recursive=True) if "VLLM" in c.name()]
        assert engine, f"no vLLM engine process started (exit {p.poll()})"
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, f"engine processes left running: {alive}"
    finally:
        if p.poll() is None:
            p.kill()
        for c in engine:
            if c.is_running():
                c.kill()


def test_scale_model_values_and_command(tmp_path):
    """The capacity model's pieces against closed forms, then the command's output."""
    import numpy as np
    from typer.testing import CliRunner

    from kvmem.bench import scale_sim
    from kvmem.cli import app

    assert scale_sim.kv_bytes_per_token(*scale_sim.MODELS["0.5B"]) == 12 * 1024  # 12 KB per token in bf16
    assert scale_sim.kv_bytes_per_token(*scale_sim.MODELS["8B"]) == 128 * 1024
    uniform = np.full(1000, 1e-3)
    assert scale_sim.lru_hit_rate(uniform, 250) == pytest.approx(0.25, abs=1e-6)  # LRU on uniform: C / N
    p = scale_sim.zipf_p(10_000, 1.0)
    assert scale_sim.lru_hit_rate(p, 10_000) == 1.0 and scale_sim.lru_hit_rate(p, 0) == 0.0
    one, four = scale_sim.lru_hit_rate(p, 500), scale_sim.affinity_hit_rate(p, 4, 500)
    assert 0.5 < one < four < 1  # Zipf's head fits; four caches of one quarter each hold more
    # a mixture whose every request is hot has the hot p95
    assert scale_sim._lognormal_quantile_mix(1.0, (100, 150), (1000, 1500), 0.95) == pytest.approx(150, rel=1e-3)
    res = CliRunner().invoke(app, ["bench", "scale", "--users", "1000,5000", "--facts", "10", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "scale.json").read_text())
    assert len(out["rows"]) == 6 and (tmp_path / "scale.png").stat().st_size > 0
    r = next(r for r in out["rows"] if r["model"] == "0.5B" and r["users"] == 1000)
    assert r["store_bytes"] == 1000 * 10 * (32 * 12 * 1024 + 4 * 384 + 200)
    assert r["cache_hit_rate_affinity"] == 1.0  # 1,000 users x 10 facts fit in 64 GiB
    res = CliRunner().invoke(app, ["bench", "scale", "--hot-ttft-p50", "300", "--hot-ttft-p95", "200"])
    assert res.exit_code == 2 and "hot-ttft" in res.output
