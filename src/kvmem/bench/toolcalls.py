"""``kvmem bench toolcalls``: function-calling quality of any OpenAI-compatible chat server, on a fixed set of
single-turn cases (``data/toolcalls.json``), and a paired comparison between servers on the same cases.

Each case is one user question and three tools; ``expect`` is the one right call (the tool's name and its exact
arguments) or null where no tool fits. Every case is asked once per ``tool_choice`` mode (``auto``,
``required``), greedy (temperature 0), without memory (no ``user``), over plain HTTP (``httpx``). Per case and
mode, four yes/no outcomes:

* ``schema_valid``: every call in the answer names one of the case's tools and its arguments parse as JSON and
  validate against that tool's schema; under ``required`` there must also be at least one call. Over all cases.
* ``right_function``: the first call names the expected tool. Over the cases where a tool fits.
* ``exact_args``: the right function, and its arguments equal the expected ones (parsed JSON, ``==``).
* ``no_call``: no call at all. Over the cases where no tool fits, ``auto`` only.

A run writes ``<out>/<name>.json`` (the server's answers and outcomes, per case and mode). The summary
(``summary.json``, and the table printed) gives each result in ``--out`` its rates, and each against the
``reference`` result (``vllm`` by default) the paired difference (this one's rate minus the reference's) with its
95% CI (``common.paired_bootstrap`` over the per-case differences) and McNemar's exact p (a binomial test of the
discordant pairs, ``scipy.stats.binomtest``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

from .common import machine, paired_bootstrap, table, write_json

MODES = ("auto", "required")
METRICS = ("schema_valid", "right_function", "exact_args", "no_call")


class ServerError(ValueError):
    """The server did not answer, or answered other than 200 (the CLI prints it as one line)."""


def load_cases(path: Path | None = None) -> tuple[dict, list[dict]]:
    """(tool name -> OpenAI tool definition, the cases) of ``path`` (default: the packaged set)."""
    text = (
        path.read_text()
        if path is not None
        else resources.files(__package__).joinpath("data/toolcalls.json").read_text()
    )
    data = json.loads(text)
    return data["tools"], data["cases"]


def _calls(message: dict) -> list[dict]:
    """The answer's calls as ``{"name", "arguments"}``, arguments parsed (None where they are not JSON)."""
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "")
        except (TypeError, ValueError):
            args = None
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def score(case: dict, tools: dict, mode: str, calls: list[dict]) -> dict:
    """The case's outcomes (``METRICS``; None where the metric does not apply) for the answer's ``calls``."""
    import jsonschema

    def valid(call) -> bool:
        if call["name"] not in case["tools"] or not isinstance(call["arguments"], dict):
            return False
        try:
            jsonschema.validate(call["arguments"], tools[call["name"]]["function"]["parameters"])
        except jsonschema.ValidationError:
            return False
        return True

    exp = case["expect"]
    out = {"schema_valid": all(valid(c) for c in calls) and (bool(calls) or mode == "auto")}
    first = calls[0] if calls else None
    right = first is not None and exp is not None and first["name"] == exp["name"]
    out["right_function"] = right if exp is not None else None
    out["exact_args"] = (right and first["arguments"] == exp["arguments"]) if exp is not None else None
    out["no_call"] = (not calls) if exp is None and mode == "auto" else None
    return out


def run_target(
    name: str,
    url: str,
    out: Path,
    cases: int = 0,
    modes=MODES,
    max_tokens: int = 128,
    api_key: str = "none",
    data: Path | None = None,
    concurrency: int = 1,
    echo=print,
) -> dict:
    """Asks every case (the first ``cases``; 0 = all) of ``modes`` at ``url`` (a base URL whose ``/v1`` is the
    OpenAI API, or ending in ``/v1``) and writes ``out``/``name``.json; returns it. The model is the first of
    ``/v1/models``. ``concurrency``: requests in flight at once. Each answer is appended to
    ``out``/``name``.partial.jsonl as it comes, and a run finds there the answers it need not ask again (a run
    stopped, or a request that failed, resumes where it was); the file goes once the result is written. Raises
    ServerError when the server cannot be reached or answers other than 200."""
    import httpx

    tools, all_cases = load_cases(data)
    todo = all_cases[:cases] if cases else all_cases
    api = url.rstrip("/")
    api = api if api.endswith("/v1") else api + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=3600, headers=headers) as http:
        try:
            r = http.get(f"{api}/models")
        except httpx.HTTPError as e:
            raise ServerError(f"{name}: {api}/models: {e}") from None
        if r.status_code != 200:
            raise ServerError(f"{name}: {api}/models answered {r.status_code}: {r.text[:200]}")
        model = r.json()["data"][0]["id"]

        def ask(case: dict, mode: str) -> dict:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": case["question"]}],
                "tools": [tools[t] for t in case["tools"]],
                "tool_choice": mode,
                "temperature": 0,
                "max_tokens": max_tokens,
            }
            t0 = time.perf_counter()
            try:
                r = http.post(f"{api}/chat/completions", json=body)
            except httpx.HTTPError as e:
                raise ServerError(f"{name}: case {case['id']} ({mode}): {e}") from None
            took = time.perf_counter() - t0
            if r.status_code != 200:
                raise ServerError(f"{name}: case {case['id']} ({mode}): {r.status_code} {r.text[:300]}")
            choice = r.json()["choices"][0]
            calls = _calls(choice["message"])
            echo(f"{name}: {case['id']} {mode} {took:.1f} s")
            rec = {
                "case": case["id"],
                "mode": mode,
                "calls": calls,
                "content": choice["message"].get("content"),
                "finish_reason": choice.get("finish_reason"),
                "s": round(took, 3),
                **score(case, tools, mode, calls),
            }
            with lock, open(partial, "a") as f:
                f.write(json.dumps(rec) + "\n")
            return rec

        # answers kept as they come: a run stopped (or a request that timed out) resumes where it was
        partial = out / f"{name}.partial.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        done = {}
        if partial.exists():
            for line in partial.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    done[(rec["case"], rec["mode"])] = rec
        lock = threading.Lock()
        todo_pairs = [(c, m) for c in todo for m in modes if (c["id"], m) not in done]
        # concurrent requests: the server batches them (greedy answers do not depend on the batch's company)
        with ThreadPoolExecutor(concurrency) as pool:
            fresh = {(r["case"], r["mode"]): r for r in pool.map(lambda cm: ask(*cm), todo_pairs)}
        records = [done.get((c["id"], m)) or fresh[(c["id"], m)] for c in todo for m in modes]
    result = {
        "name": name,
        "url": url,
        "model": model,
        "cases": len(todo),
        "modes": list(modes),
        "machine": machine(),
        "rates": rates(records),
        "records": records,
    }
    write_json(out / f"{name}.json", result)
    partial.unlink()
    return result


def rates(records: list[dict]) -> dict:
    """mode -> metric -> {"hits", "n", "rate"} over the records where the metric applies."""
    out: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        out[mode] = {}
        for m in METRICS:
            vals = [r[m] for r in records if r["mode"] == mode and r[m] is not None]
            if vals:
                out[mode][m] = {"hits": sum(vals), "n": len(vals), "rate": round(sum(vals) / len(vals), 4)}
    return out


def paired(a: dict, b: dict) -> dict:
    """mode -> metric -> ``a``'s rate minus ``b``'s over the cases both answered, its 95% CI, McNemar's exact p
    (two-sided), and the discordant counts (a right where b is wrong, and the reverse)."""
    from scipy.stats import binomtest

    key = lambda r: (r["case"], r["mode"])
    theirs = {key(r): r for r in b["records"]}
    out: dict = {}
    for mode in a["modes"]:
        if mode not in b["modes"]:
            continue
        out[mode] = {}
        for m in METRICS:
            pairs = [
                (r[m], theirs[key(r)][m])
                for r in a["records"]
                if r["mode"] == mode and key(r) in theirs and r[m] is not None and theirs[key(r)][m] is not None
            ]
            if not pairs:
                continue
            diff, ci = paired_bootstrap(int(x) - int(y) for x, y in pairs)
            a_only = sum(1 for x, y in pairs if x and not y)
            b_only = sum(1 for x, y in pairs if y and not x)
            p = binomtest(a_only, a_only + b_only, 0.5).pvalue if a_only + b_only else 1.0
            out[mode][m] = {"n": len(pairs), "diff": diff, "ci95": ci, "mcnemar_p": round(float(p), 4),
                            "a_only": a_only, "b_only": b_only}  # fmt: skip
    return out


def summarize(out: Path, reference: str = "vllm", echo=print) -> dict:
    """``out``/summary.json from every result in ``out``: rates, and each against ``reference``'s (when it is
    there). Prints a table of both."""
    results = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "summary"}
    ref = results.get(reference)
    summary = {"reference": reference if ref else None, "results": {}, "paired": {}}
    rows = []
    for name, res in results.items():
        summary["results"][name] = {"model": res["model"], "url": res["url"], "cases": res["cases"],
                                    "cpu": res["machine"]["cpu"], "time": res["machine"]["time"],
                                    "rates": res["rates"]}  # fmt: skip
        vs = paired(res, ref) if ref is not None and name != reference else {}
        if vs:
            summary["paired"][f"{name}-{reference}"] = vs
        for mode, ms in res["rates"].items():
            for m, v in ms.items():
                d = vs.get(mode, {}).get(m)
                rows.append(
                    [name, mode, m, f"{v['hits']}/{v['n']}", v["rate"], d and d["diff"],
                     d and d["ci95"] and f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]", d and d["mcnemar_p"]]
                )  # fmt: skip
    write_json(out / "summary.json", summary)
    echo(table(rows, ["server", "tool_choice", "metric", "hits", "rate", f"diff vs {reference}", "95% CI", "p"]))
    return summary
