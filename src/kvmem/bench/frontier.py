"""``kvmem eval frontier``: the accuracy-latency frontier of prompt injection, KV injection and tail recompute.

For each model, on the same LoCoMo questions and the same stores:

1. latency, ``kvmem bench latency``'s run (``latency.run``) on the first ``latency_questions`` of the questions:
   every method at every k, one request at a time, interleaved question by question, each request stopped at
   its first token (the decode after it changes no TTFT). A point's TTFT is the median of those requests (a
   TTFT from inside an eval batch is not a latency). It runs first, on a fresh engine, so no eval request has
   warmed the prefix cache it measures.
2. accuracy, ``kvmem eval locomo``'s run (``eval_locomo.run``) on all the questions, batched on the same
   engine: LoCoMo token F1 (and the LLM judge's accuracy when an endpoint is given).

Every (model, method, k) is then a point (F1, median TTFT). For each prompt-injection point the table names the
best kvmem point of the same model whose median TTFT is no higher, and its F1 minus prompt injection's, with a
paired bootstrap 95% CI over the questions (``common.paired_bootstrap``).

Resumable: answers are kept in ``<out>/<model>/eval/records.jsonl`` and a latency run whose summary matches the
one asked is reused, so rerunning the same command after a stop continues where it stopped.

``add_runs``: earlier runs' ``--out`` directories whose models this run does not measure (e.g. one model at more k
than another can afford); their points, answers and bare-query TTFTs join the tables, the targets and the plot.
Only runs on the same questions, encoding, retrieval and kind of machine are taken (``AddedRun``).

``retrieval`` (``recall.parse_fusion``; the default hybrid, ``retrieve.HYBRID``) ranks the facts of the latency run
and of the eval alike; the summary records it (``retrieval``), and a run from before it records none: it ranked by
cosine alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from ..policy import Encoding
from ..service import check_methods
from . import eval_locomo, latency
from .common import (
    Setup,
    machine,
    markdown_table,
    paired_bootstrap,
    pyplot,
    select_questions,
    table,
    write_summary_and_records,
)
from .recall import describe, parse_fusion

PROMPT = "prompt"
LATENCY_TOKENS = 1  # the latency run's requests stop at the first token: TTFT is all it reports here


def run(
    data: Path,
    out: Path,
    models: list[str],
    methods: list[str],
    ks: list[int],
    samples: list[str] | None,
    questions: int | None,
    latency_questions: int,
    engine: str,
    window: int | None = None,
    neighbours: int | None = None,
    history: bool = False,
    max_new_tokens: int = 32,
    judge_url: str | None = None,
    judge_model: str | None = None,
    plot_path: Path | None = None,
    show_progress: bool = True,
    echo=print,
    add_runs: list[Path] = (),
    retrieval: str = "hybrid",
) -> dict:
    """Measure every model's points, add those of ``add_runs`` (module docstring), then write ``out/summary.json``
    (points and table), ``out/frontier.md``, ``out/frontier.png`` (and a copy at ``plot_path``); returns the
    summary. Raises ValueError (one line) on bad arguments or an added run that does not compare."""
    methods = [str(m) for m in check_methods(methods, engine)]
    if PROMPT not in methods or len(methods) < 2:
        raise ValueError("--methods must name prompt and at least one kvmem method (kv, kv-tail<r>, ...)")
    if not models:
        raise ValueError("--models is empty")
    if latency_questions < 1:
        raise ValueError("--latency-questions must be >= 1")
    enc = Encoding.of(window, neighbours, history)
    fusion = parse_fusion(retrieval)
    retrieval = describe(fusion)
    # an added run is read and checked before the hours of measuring, as far as it can be without them
    adding: list[AddedRun] = []
    here = machine() if add_runs else {}
    for path in add_runs:  # each adds only models that neither this run nor an earlier --add-run has
        have = models + [m for a in adding for m in a.bare]
        adding.append(AddedRun.load(path, have, enc.describe(), max_new_tokens, here, retrieval))
    points, scores, bare = [], {}, {}
    for model in models:
        setup = Setup.load(data, samples, model, engine, show_progress)
        setup.fusion = fusion
        where = out / Path(model).name
        try:
            lat = measure_latency(setup, where / "latency", ks, enc, methods, latency_questions, echo)
            ev = eval_locomo.run(
                data, where / "eval", ks, [enc.window], methods, samples, questions, model, engine, max_new_tokens,
                judge_url, judge_model, show_progress, echo, neighbours=enc.neighbours, history=enc.history,
                retrieval=retrieval, setup=setup,
            )  # fmt: skip
            engine_name = setup.engine_name
        finally:
            setup.close()
        bare[model] = lat["ttft_ms"]["bare"]
        rows = json.loads((where / "eval" / "records.json").read_text())
        for method in methods:
            for k in ks:
                sel = [r for r in rows if r["mode"] == method and r["k"] == k]
                scores[(model, method, k)] = {r["qid"]: r["f1"] for r in sel}
                points.append(point(model, method, k, sel, lat, engine_name))

    qids = set().union(*scores.values())
    for run_ in adding:
        run_.check(ev, qids, engine_name)
        points += run_.points
        scores.update(run_.scores)
        bare.update(run_.bare)
    added = [run_.note for run_ in adding]
    all_models = list(bare)
    all_methods = list(dict.fromkeys([*methods, *(p["method"] for p in points)]))
    frontier = best_under_prompt(points, scores)
    goals = targets(points, scores, bare)
    summary = {
        "command": "eval frontier",
        "models": all_models,
        "methods": all_methods,
        "measured_models": models,
        "added_runs": added,
        "k": ks,
        "encoding": enc.describe(),
        "retrieval": retrieval,
        "samples": ev["samples"],
        "questions": ev["questions"],
        "latency_questions": lat["questions"],
        "max_new_tokens": max_new_tokens,
        "judge_model": judge_model,
        "ttft": "median of one-at-a-time requests in a separate latency run (kvmem bench latency), per point",
        "f1": "LoCoMo token F1 (%) of the batched eval (kvmem eval locomo), per point",
        "machine": lat["machine"],
        "points": points,
        "frontier": frontier,
        "targets": goals,
    }
    write_summary_and_records(out, summary, points)
    png = out / "frontier.png"
    plot(png, points, all_models, all_methods, summary)
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, plot_path)
    md = markdown(points, frontier, summary) + "\n\n" + markdown_targets(goals)
    (out / "frontier.md").write_text(md + "\n")
    echo(table([[p["model"], p["method"], p["k"], p["f1"], p["judge"], p["ttft_ms"]] for p in points],
               ["model", "method", "k", "F1", "judge", "TTFT ms"]))  # fmt: skip
    echo(md)
    echo(f"wrote {out}/summary.json, records.json, records.csv, frontier.md, frontier.png")
    return summary


class _Point(BaseModel):
    """One point of an earlier run's summary (``point``'s fields)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    engine: str
    method: str
    k: int
    n: int = Field(ge=0)
    f1: float | None
    judge: float | None = None
    ttft_ms: float = Field(gt=0)
    ttft_p95_ms: float = Field(gt=0)


class _Answer(BaseModel):
    """One answer of an earlier run's ``eval/records.json`` (the fields the pairing reads)."""

    model_config = ConfigDict(extra="ignore")
    qid: str
    mode: str
    k: int
    f1: float = Field(ge=0, le=1)


class _Bare(BaseModel):
    model_config = ConfigDict(extra="ignore")
    bare: float = Field(gt=0)


class _Latency(BaseModel):
    """An earlier run's ``latency/summary.json``: the bare query's median TTFT, ms (the rest is per method)."""

    model_config = ConfigDict(extra="ignore")
    ttft_ms: _Bare


class _Run(BaseModel):
    """An earlier ``eval frontier`` run's ``summary.json`` (the fields ``--add-run`` reads)."""

    model_config = ConfigDict(extra="ignore")
    command: Literal["eval frontier"]
    models: list[str]
    measured_models: list[str] | None = None  # a run that itself added runs: only these have folders in it
    points: list[_Point]
    samples: list[str]
    questions: int
    encoding: str
    retrieval: str = "cosine"  # a run from before the summary recorded it ranked by cosine alone
    max_new_tokens: int
    latency_questions: int
    machine: dict[str, object]

    @field_validator("models", "measured_models")
    @classmethod
    def _names(cls, names):
        for m in names or ():
            if not m or Path(m).name != m or m in (".", "..") or not m.isprintable():
                raise ValueError(f"{m!r} is not a model name")
        return names


MACHINE_KEYS = ("cpu", "cores", "torch", "cuda")  # what must match for two runs' TTFTs to compare


def _read(path: Path, f: Path, schema):
    """``f`` (a file of the run at ``path``) parsed and checked against ``schema`` (a pydantic model or
    ``TypeAdapter``); ValueError, one line, naming the file, when it is missing, unreadable or not that."""
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise ValueError(f"--add-run {path}: no {f.relative_to(path)} there (not an eval frontier --out)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"--add-run {path}: {f} cannot be read ({' '.join(str(exc).split())[:160]})") from None
    try:
        return schema.validate_python(data) if isinstance(schema, TypeAdapter) else schema.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"]) or "the top level"
        raise ValueError(f"--add-run {path}: {f} is not what eval frontier writes ({where}: {e['msg']})") from None


@dataclass
class AddedRun:
    """An earlier run's models that this run does not measure: their ``points``, per-question F1s ``scores``
    (``{(model, method, k): {qid: f1}}``), bare-query median TTFTs ``bare`` (``{model: ms}``) and the ``note``
    the summary keeps. ``load`` reads and checks it before anything is measured; ``check`` compares it with what
    this run measured."""

    path: Path
    run: _Run
    points: list[dict]
    scores: dict
    bare: dict[str, float]
    note: dict

    @classmethod
    def load(
        cls, path: Path, measured: list[str], encoding: str, max_new_tokens: int, machine: dict, retrieval: str
    ) -> AddedRun:
        """The run at ``path``; ValueError (one line) when a file is missing or malformed, when it used another
        ``encoding``, ``retrieval`` or ``max_new_tokens`` or ran on another kind of machine (``MACHINE_KEYS``: its
        TTFTs would not compare), or when it adds no model beyond ``measured`` (model names; their folder names
        compare)."""
        run = _read(path, path / "summary.json", _Run)
        for key, want, got in (
            ("encoding", encoding, run.encoding),
            ("retrieval", retrieval, run.retrieval),
            ("max_new_tokens", max_new_tokens, run.max_new_tokens),
            *((f"machine {k}", machine.get(k), run.machine.get(k)) for k in MACHINE_KEYS),
        ):
            if got != want:
                raise ValueError(f"--add-run {path}: its {key} is {got!r}, this run's {want!r}: it does not compare")
        have = {Path(m).name for m in measured}
        new = [m for m in dict.fromkeys(run.measured_models or run.models) if m not in have]
        if not new:
            raise ValueError(f"--add-run {path}: it adds no model (it measured {run.models}, all measured here)")
        points = [p.model_dump() for p in run.points if p.model in new]
        scores, bare = {}, {}
        for model in new:
            mine = [p for p in points if p["model"] == model]
            if not mine:
                raise ValueError(f"--add-run {path}: its summary has no point of {model}")
            answers = _read(path, path / model / "eval" / "records.json", TypeAdapter(list[_Answer]))
            bare[model] = _read(path, path / model / "latency" / "summary.json", _Latency).ttft_ms.bare
            for p in mine:
                got = {a.qid: a.f1 for a in answers if a.mode == p["method"] and a.k == p["k"]}
                if len(got) != p["n"]:
                    raise ValueError(f"--add-run {path}: {model} {p['method']} k={p['k']} has {len(got)} answers, "
                                     f"its point says {p['n']}")  # fmt: skip
                scores[(model, p["method"], p["k"])] = got
        note = {"run": str(path), "models": new, "latency_questions": run.latency_questions,
                "time": run.machine.get("time")}  # fmt: skip
        return cls(path, run, points, scores, bare, note)

    def check(self, ev: dict, qids: set[str], engine: str) -> None:
        """ValueError (one line) unless this run's answers are to the same questions as ours (``ev``'s samples
        and count, and ``qids``) from the same ``engine``."""
        where = f"--add-run {self.path}"
        if self.run.samples != ev["samples"] or self.run.questions != ev["questions"]:
            raise ValueError(f"{where}: it scored {self.run.questions} questions of {self.run.samples}, this run "
                             f"{ev['questions']} of {ev['samples']}: it does not compare")  # fmt: skip
        engines = {p["engine"] for p in self.points}
        if engines != {engine}:
            raise ValueError(f"{where}: its engine is {sorted(engines)}, this run's {engine!r}: it does not compare")
        for (model, method, k), got in self.scores.items():
            if set(got) != qids:
                raise ValueError(f"{where}: {model} {method} k={k} answered other questions than this run")


def measure_latency(setup, out: Path, ks, enc: Encoding, methods, n: int, echo) -> dict:
    """``latency.run`` on ``setup``'s engine for every method at every k, or the summary of an earlier run in
    ``out`` that measured the same."""
    path = out / "summary.json"
    asked = {
        "model": setup.lm.name,
        "engine": setup.engine_name,
        "samples": [c.sample_id for c in setup.convs],
        "questions": len(select_questions(setup.convs, n)),
        "k": ks,
        "windows": [enc.window],
        "neighbours": enc.neighbours,
        "history": enc.history,
        "retrieval": describe(setup.fusion),
        "max_new_tokens": LATENCY_TOKENS,
    }
    if path.exists():
        s = json.loads(path.read_text())
        if all(s.get(key) == v for key, v in asked.items()) and set(methods) <= set(s["ttft_ms"]):
            echo(f"latency: reusing {path}")
            return s
    extra = [m for m in methods if m not in latency.MODES]
    return latency.run(setup.data, out, ks, [enc.window], None, n, setup.lm.name, setup.engine, LATENCY_TOKENS,
                       show_progress=setup.show_progress, echo=echo, methods=extra, neighbours=enc.neighbours,
                       history=enc.history, setup=setup)  # fmt: skip


def point(model: str, method: str, k: int, rows: list[dict], lat: dict, engine: str) -> dict:
    """One (model, method, k): mean F1 (and judge) in % over its eval answers, median and p95 TTFT in ms."""
    w = str(lat["window"])
    judged = [r["judge"] for r in rows if "judge" in r]
    return {
        "model": model,
        "engine": engine,
        "method": method,
        "k": k,
        "n": len(rows),
        "f1": round(100 * sum(r["f1"] for r in rows) / len(rows), 2) if rows else None,
        "judge": round(100 * sum(judged) / len(judged), 2) if judged else None,
        "ttft_ms": lat["by_window"][w]["median_ms"][method][str(k)]["ttft"],
        "ttft_p95_ms": lat["by_window"][w]["p95_ms"][method][str(k)]["ttft"],
    }


def best_under_prompt(points: list[dict], scores: dict) -> list[dict]:
    """For each prompt-injection point: the kvmem point of the same model with the highest F1 among those whose
    median TTFT is no higher (the faster one on a tie), and its F1 minus prompt's, paired by question."""
    rows = []
    for p in (p for p in points if p["method"] == PROMPT):
        faster = [
            q for q in points if q["model"] == p["model"] and q["method"] != PROMPT and q["ttft_ms"] <= p["ttft_ms"]
        ]
        row = {"model": p["model"], "k": p["k"], "prompt_f1": p["f1"], "prompt_ttft_ms": p["ttft_ms"], "method": None,
               "method_k": None, "f1": None, "ttft_ms": None, "delta_f1": None, "ci95": None, "n": 0}  # fmt: skip
        if faster:
            best = _best(faster)
            delta, ci, n = _paired(scores, p, best)
            row.update(method=best["method"], method_k=best["k"], f1=best["f1"], ttft_ms=best["ttft_ms"],
                       delta_f1=delta, ci95=ci, n=n)  # fmt: skip
        rows.append(row)
    return rows


SAME_MODEL_TTFT_BOUND = 1.3  # the bound: a kvmem point within 1.3x of the bare query's TTFT
ACROSS_MODELS_GAIN_F1 = 2.0  # F1 points a faster kvmem point of any model must add over each prompt point


def _best(points: list[dict]) -> dict | None:
    """The point with the highest F1 (the faster one on a tie); None when there is none."""
    return max(points, key=lambda q: (q["f1"], -q["ttft_ms"])) if points else None


def _paired(scores: dict, a: dict, b: dict) -> tuple[float, list[float] | None, int]:
    """Point ``b``'s F1 minus point ``a``'s, paired by question (points of any models: the questions are the
    same): (mean, 95% CI, questions)."""
    ref, got = scores[(a["model"], a["method"], a["k"])], scores[(b["model"], b["method"], b["k"])]
    pairs = [q for q in ref if q in got]
    delta, ci = paired_bootstrap(100 * (got[q] - ref[q]) for q in pairs)
    return delta, ci, len(pairs)


def targets(points: list[dict], scores: dict, bare: dict[str, float]) -> dict:
    """The frontier's two targets, from its points (F1 in %, median TTFT in ms) and ``bare`` (model -> the bare
    query's median TTFT, ms):

    - ``same_model``, per model: its best kvmem point with a TTFT within ``SAME_MODEL_TTFT_BOUND`` x the bare
      query's, against its best prompt-injection point at any k; met when the paired difference is >= 0.
    - ``across_models``, per prompt-injection point: the best kvmem point of any model with no higher TTFT; met
      when it scores at least ``ACROSS_MODELS_GAIN_F1`` more.
    """

    def brief(p: dict | None) -> dict | None:
        return None if p is None else {k: p[k] for k in ("model", "method", "k", "f1", "ttft_ms")}

    same = []
    for model, base in bare.items():
        prompt = _best([p for p in points if p["model"] == model and p["method"] == PROMPT])
        bound = SAME_MODEL_TTFT_BOUND * base
        kv = _best([p for p in points if p["model"] == model and p["method"] != PROMPT and p["ttft_ms"] <= bound])
        row = {"model": model, "bare_ttft_ms": base, "ttft_bound_ms": round(bound, 1), "prompt": brief(prompt),
               "kvmem": brief(kv), "delta_f1": None, "ci95": None, "n": 0, "met": False}  # fmt: skip
        if kv is not None and prompt is not None:
            delta, ci, n = _paired(scores, prompt, kv)
            row.update(delta_f1=delta, ci95=ci, n=n, met=delta >= 0)
        same.append(row)
    across = []
    for p in (p for p in points if p["method"] == PROMPT):
        kv = _best([q for q in points if q["method"] != PROMPT and q["ttft_ms"] <= p["ttft_ms"]])
        row = {"prompt": brief(p), "kvmem": brief(kv), "delta_f1": None, "ci95": None, "n": 0, "met": False}
        if kv is not None:
            delta, ci, n = _paired(scores, p, kv)
            row.update(delta_f1=delta, ci95=ci, n=n, met=delta >= ACROSS_MODELS_GAIN_F1)
        across.append(row)
    return {"same_model": same, "across_models": across}


def markdown_targets(goals: dict) -> str:
    """The two targets (``targets``) as markdown tables."""

    def name(p: dict | None) -> str:
        return "none" if p is None else f"{p['model']} {p['method']} k={p['k']} ({p['f1']}, {p['ttft_ms']:.0f} ms)"

    def diff(r: dict) -> str:
        return "" if r["delta_f1"] is None else f"{r['delta_f1']:+.2f} ({_ci(r['ci95'])})"

    same = markdown_table(
        [
            [r["model"], f"{r['ttft_bound_ms']:.0f}", name(r["kvmem"]), name(r["prompt"]), diff(r), r["met"]]
            for r in goals["same_model"]
        ],  # fmt: skip
        [
            "model",
            f"TTFT bound ({SAME_MODEL_TTFT_BOUND:g}x bare, ms)",
            "best kvmem point within it (F1, TTFT)",
            "best prompt point (F1, TTFT)",
            "F1 difference (95% CI)",
            "met (>= 0)",
        ],  # fmt: skip
    )
    across = markdown_table(
        [[name(r["prompt"]), name(r["kvmem"]), diff(r), r["met"]] for r in goals["across_models"]],
        [
            "prompt point (F1, TTFT)",
            "best kvmem point of any model, TTFT no higher",
            "F1 difference (95% CI)",
            f"met (>= {ACROSS_MODELS_GAIN_F1:g})",
        ],  # fmt: skip
    )
    return "\n\n".join([same, across])


def markdown(points: list[dict], frontier: list[dict], summary: dict) -> str:
    """The frontier table (and the points) as markdown."""
    head = ["model", "prompt k", "prompt F1", "prompt TTFT (ms)", "best kvmem point, TTFT no higher", "its F1",
            "its TTFT (ms)", "F1 difference (95% CI)", "questions"]  # fmt: skip
    rows = [
        [r["model"], r["k"], r["prompt_f1"], f"{r['prompt_ttft_ms']:.0f}"]
        + (
            [
                f"{r['method']} k={r['method_k']}",
                r["f1"],
                f"{r['ttft_ms']:.0f}",
                f"{r['delta_f1']:+.2f} ({_ci(r['ci95'])})",
                r["n"],
            ]  # fmt: skip
            if r["method"]
            else ["none", None, None, None, None]
        )
        for r in frontier
    ]
    judge = any(p["judge"] is not None for p in points)
    phead = ["model", "method", "k", "F1"] + (["judge"] if judge else []) + ["TTFT p50 (ms)", "TTFT p95 (ms)"]
    prows = [[p["model"], p["method"], p["k"], p["f1"]] + ([p["judge"]] if judge else [])
             + [f"{p['ttft_ms']:.0f}", f"{p['ttft_p95_ms']:.0f}"] for p in points]  # fmt: skip
    note = (f"{summary['questions']} questions per point (F1); TTFT from {summary['latency_questions']} "
            f"questions, one request at a time; {summary['encoding']}.")  # fmt: skip
    for a in summary["added_runs"]:
        note += (f" {', '.join(a['models'])}: from the run in {a['run']} ({a['time']}; TTFT from "
                 f"{a['latency_questions']} questions).")  # fmt: skip
    return "\n\n".join([markdown_table(rows, head), markdown_table(prows, phead), note])


def _ci(ci) -> str:
    return "n/a" if ci is None else f"{ci[0]:+.2f} to {ci[1]:+.2f}"


def plot(path: Path, points: list[dict], models: list[str], methods: list[str], summary: dict) -> None:
    """F1 against median TTFT (log x), one curve per model and method through its k values (labelled)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive"]
    colors = {PROMPT: "tab:red"} | {
        m: palette[i % len(palette)] for i, m in enumerate(x for x in methods if x != PROMPT)
    }
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    for mi, model in enumerate(models):
        for method in methods:
            pts = sorted((p for p in points if p["model"] == model and p["method"] == method), key=lambda p: p["k"])
            if not pts:  # a method another run's model was not measured with: no curve, no legend entry
                continue
            xs, ys = [p["ttft_ms"] for p in pts], [p["f1"] for p in pts]
            ax.plot(xs, ys, styles[mi % 4], marker=markers[mi % 4], color=colors[method], label=f"{model} {method}")
            for p in pts:
                ax.annotate(f"k={p['k']}", (p["ttft_ms"], p["f1"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    asked = [str(summary["latency_questions"])] + [str(a["latency_questions"]) for a in summary["added_runs"]]
    ax.set_xlabel(f"median TTFT (ms, log scale; {' or '.join(dict.fromkeys(asked))} questions, one at a time)")
    ax.set_ylabel(f"LoCoMo token F1 (%, {summary['questions']} questions)")
    ax.set_title(f"Accuracy vs latency: prompt injection, KV injection, tail recompute ({summary['encoding']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
