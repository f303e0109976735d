"""Shared pieces of the benchmark and evaluation commands.

- a store cache keyed by data file (content hash), sample, model and window under ``.cache/stores/``;
- the deterministic question subset (categories 1-4);
- the machine description written into every result;
- JSON / CSV / PNG writers (matplotlib, Agg backend) and median / p95.

Nothing here times anything; each command module owns its own measurement loop.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..engines.select import open_engine
from ..hardware import resolve_engine
from ..locomo import LocomoError, load_locomo
from ..locomo_ingest import ingest_conversation
from ..models import fingerprint, load
from ..policy import Encoding
from ..retrieve import HYBRID, Embedder, Fusion
from ..service import MemoryService
from ..store import Store, StoreError

CACHE_ENV = "KVMEM_BENCH_CACHE"


# --- option parsing -----------------------------------------------------------------------------------


def int_list(text: str, name: str, minimum: int = 0) -> list[int]:
    """``"5,10,20"`` -> [5, 10, 20] (order kept, duplicates dropped). Raises ValueError naming the option."""
    try:
        vals = [int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, not {text!r}") from None
    if not vals:
        raise ValueError(f"{name} is empty")
    bad = [v for v in vals if v < minimum]
    if bad:
        raise ValueError(f"{name} values must be >= {minimum}, got {bad}")
    return list(dict.fromkeys(vals))


def str_list(text: str | None) -> list[str]:
    return [x for x in (text or "").replace(" ", "").split(",") if x]


def check_engine(engine: str) -> str:
    """The engine a bench command runs: ``hf`` always works; ``vllm`` must run here; ``auto`` is vllm where it
    runs, else hf (with a note on stderr). Raises EngineUnavailable (a ValueError: one line, exit code 2)."""

    engine, note = resolve_engine(engine)
    if note:
        log_err(note)
    return engine


# --- data, questions, stores ---------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:12]


def load_samples(data: Path, samples: list[str] | None):
    """The chosen LoCoMo conversations, in the order asked (all of the file's when ``samples`` is empty)."""

    convs = load_locomo(data)
    if not samples:
        return convs
    by_id = {c.sample_id: c for c in convs}
    missing = [s for s in samples if s not in by_id]
    if missing:
        raise LocomoError(f"sample(s) {', '.join(missing)} not in {data}; it has: {', '.join(by_id)}")
    return [by_id[s] for s in samples]


@dataclass(frozen=True)
class QItem:
    """One benchmark question: ``qid`` = ``<sample>#<index in the sample's qa list>`` (stable across runs)."""

    qid: str
    sample: str
    question: str
    answer: str
    category: int


def select_questions(convs, n: int | None) -> list[QItem]:
    """A deterministic subset of ``n`` category 1-4 questions (all of them when ``n`` is None or 0).

    Each sample's answerable questions are shuffled with a seed derived from the sample id, then the samples
    are taken round-robin. The subset for N is a prefix of the subset for N+1, so larger runs extend smaller ones.
    """
    pools = []
    for c in convs:
        items = [
            QItem(f"{c.sample_id}#{i}", c.sample_id, q.question, q.answer, q.category)
            for i, q in enumerate(c.questions)
            if 1 <= q.category <= 4 and q.question.strip()
        ]
        random.Random(f"kvmem-bench/{c.sample_id}").shuffle(items)
        pools.append(items)
    out: list[QItem] = []
    i = 0
    while any(i < len(p) for p in pools):
        for p in pools:
            if i < len(p):
                out.append(p[i])
        i += 1
    return out[:n] if n else out


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, ".cache/stores"))


def store_path(
    data: Path,
    sample: str,
    model: str,
    window: int,
    dtype: str = "bfloat16",
    neighbours: int = 0,
    history: bool = False,
) -> Path:
    """Cache directory of the store for (data file, sample, model, compute dtype, window, neighbours, history)."""
    safe_model = Path(model).name if os.sep in model else model
    name = f"w{window}" + (f"-n{neighbours}" if neighbours else "") + ("-h" if history else "")
    return cache_root() / f"{Path(data).stem}-{file_digest(Path(data))}" / sample / safe_model / dtype / name


def ensure_store(
    data: Path,
    conv,
    lm,
    embedder,
    window: int,
    log=None,
    show_progress: bool = True,
    neighbours: int | None = None,
    history: bool = False,
) -> Path:
    """The cached store for ``conv`` at ``window`` (and ``neighbours``, neighbour-aware encoding, or ``history``,
    history encoding), ingesting it first when missing (or built differently)."""

    neighbours = Encoding.of(window, neighbours, history).neighbours
    root = store_path(data, conv.sample_id, lm.name, window, str(lm.dtype).removeprefix("torch."), neighbours, history)
    try:
        st = Store.open(root, fingerprint(lm))
        info = st.reads.user_info(conv.sample_id) if conv.sample_id in st.reads.users() else {}
        ok = (
            info.get("window") == window
            and info.get("neighbours") == neighbours
            and info.get("history", False) == history
        )
        if ok:
            st.writes.add_text_index()  # a store cached before the full-text index existed gets one (no re-encoding)
        st.close()
    except StoreError:
        ok = False
    if not ok:
        if (root / "manifest.json").exists():
            shutil.rmtree(root)
        rep = ingest_conversation(
            lm,
            embedder,
            root,
            conv,
            window,
            source=str(data),
            progress=show_progress,
            neighbours=neighbours,
            history=history,
        )
        if log:
            log(
                f"ingested {rep.num_facts} facts of {conv.sample_id} (w={window}, m={neighbours}"
                f"{', history' if history else ''}) in "
                f"{rep.total_s:.1f} s ({rep.num_encoded_tokens} tokens encoded, encode {rep.encode_s:.1f} s) -> {root}"
            )
    return root


def answer_batch(
    svcs: dict, items: list[tuple[str, str, int, str]], max_new_tokens: int, ignore_eos: bool = False
) -> list:
    """Answers (``service.Answer``) for ``(sample, question, k, mode)`` items, in order; the services share one
    engine. An engine that batches gets every item retrieved and composed first, then all in one ``generate``
    call (continuous batching; each prompt names its own store and memory; prompt mode gets cold cache salts, so
    the baseline prefills every prompt in full). One that does not gets them one at a time, each composed just
    before it runs (composition sets length-dependent RoPE state for that request)."""
    if not items:
        return []
    first = svcs[items[0][0]]
    sampling = first.sampling(max_new_tokens, ignore_eos)
    if not first.engine.batches:
        out = []
        for s, q, k, m in items:
            p = svcs[s].prepare(s, q, k, m, max_new_tokens)
            out.append(svcs[s].answer(p, first.engine.generate([p.request(sampling)])[0]))
        return out
    preps = [svcs[s].prepare(s, q, k, m, max_new_tokens) for s, q, k, m in items]
    gens = first.engine.generate([p.request(sampling) for p in preps])
    return [svcs[s].answer(p, g) for (s, *_), p, g in zip(items, preps, gens)]


def bare(svc, question: str, max_new_tokens: int, ignore_eos: bool = False) -> dict:
    """The no-memory baseline: the question alone, a cold prefix cache. Timings in ms, counts in tokens."""
    p = svc.bare(question, max_new_tokens)
    (gen,) = svc.engine.generate([p.request(svc.sampling(max_new_tokens, ignore_eos))])
    return {
        "ttft": gen.ttft_ms,
        "decode": gen.decode_ms,
        "prefilled_tokens": gen.prefilled_tokens,
        "generated_tokens": len(gen.token_ids),
    }


def store_device_note(store_device: str) -> str:
    if store_device not in ("host", "device"):
        raise ValueError(f"--store-device must be host or device, not {store_device!r}")
    import torch

    if not torch.cuda.is_available():
        return (
            f"--store-device {store_device}: CPU-only machine, the engine's device is the host, so the store is "
            "in host memory either way (no pinned/streamed vs resident distinction to measure)"
        )
    return (
        f"--store-device {store_device}: the hf engine gathers facts from the host store and copies the "
        "composed block to the device per request; a device-resident store is not implemented for the hf "
        "engine, so both settings measure the host path"
    )


# --- machine, stats ------------------------------------------------------------------------------------


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    ram = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import transformers

        tf_version = transformers.__version__
    except Exception:  # pragma: no cover
        tf_version = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(ram / 2**30, 1),
        "torch": torch.__version__,
        "transformers": tf_version,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def rss_bytes() -> dict:
    """Resident memory of this process: current (VmRSS) and peak (VmHWM), bytes."""
    out = {"rss": 0, "peak_rss": 0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss"] = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                out["peak_rss"] = int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def median(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def p95(xs) -> float:

    xs = list(xs)
    return float(np.percentile(xs, 95)) if xs else float("nan")


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b and b == b and a == a else None


def paired_bootstrap(diffs) -> tuple[float, list[float] | None]:
    """The mean of paired differences (one per question) and its 95% CI: ``scipy.stats.bootstrap`` (BCa, 10,000
    resamples, seed 0). The CI is the mean itself when every difference is the same (nothing to resample), and
    None with fewer than two differences."""
    d = np.asarray(list(diffs), dtype=float)
    if len(d) == 0:
        return float("nan"), None
    mean = round(float(d.mean()), 2) + 0.0  # + 0.0: a mean that rounds to zero is 0.0, never -0.0
    if len(d) < 2:
        return mean, None
    if np.all(d == d[0]):
        return mean, [mean, mean]
    from scipy.stats import bootstrap

    ci = bootstrap((d,), np.mean, n_resamples=10_000, confidence_level=0.95, random_state=0).confidence_interval
    if not np.isfinite([ci.low, ci.high]).all():  # BCa undefined on this sample (too few distinct values)
        ci = bootstrap((d,), np.mean, n_resamples=10_000, method="percentile", random_state=0).confidence_interval
    return mean, [round(float(ci.low), 2) + 0.0, round(float(ci.high), 2) + 0.0]


# --- writers ---------------------------------------------------------------------------------------------


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str))
    return path


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v, ensure_ascii=False)
        else:
            out[key] = v
    return out


def write_summary_and_records(out: Path, summary: dict, records: list[dict]) -> None:
    """The files every bench command writes: summary.json, records.json and records.csv under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", summary)
    write_json(out / "records.json", records)
    write_csv(out / "records.csv", records)


def log_k_axis(ax, ks: list[int], plt) -> None:
    """A log-scale x axis labelled with exactly the k values measured."""
    ax.set_xscale("log")
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())


def write_csv(path: Path, rows: list[dict]) -> Path:
    """Rows of (possibly nested) dicts, flattened with dotted keys; columns = union in first-seen order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = [_flatten(r) for r in rows]
    cols: dict[str, None] = {}
    for r in flat:
        cols.update(dict.fromkeys(r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(cols))
        w.writeheader()
        w.writerows(flat)
    return path


def markdown_table(rows: list[list], header: list[str]) -> str:
    """A GitHub markdown table (None as an empty cell)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table(rows: list[list], header: list[str]) -> str:
    """A compact fixed-width text table."""
    cells = [
        [
            (
                ""
                if c is None
                else (
                    f"{c:.3g}"
                    if isinstance(c, float) and abs(c) < 1e4
                    else f"{c:.0f}"
                    if isinstance(c, float)
                    else str(c)
                )
            )
            for c in r
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def progress(total: int, desc: str, enabled: bool = True):

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


@dataclass
class Setup:
    """What every command loads once: the chosen conversations, model and embedder, and (``services``) one
    engine for all their stores."""

    data: Path
    convs: list
    lm: object
    embedder: object
    engine: str  # as asked (auto | vllm | hf); ``engine_name`` once started
    show_progress: bool = True
    opened: object = None  # engines.select.Opened, once started
    resolved: str = ""  # the engine ``auto`` resolves to here, before it starts
    note: str | None = None
    engine_options: dict = field(default_factory=dict)  # more ``open_engine`` arguments (metrics_file, ...)
    fusion: Fusion | None = HYBRID  # what every service ranks by (``retrieve``; None: cosine alone)

    @classmethod
    def load(
        cls,
        data: Path,
        samples: list[str] | None,
        model: str,
        engine: str,
        show_progress: bool = True,
        fusion: Fusion | None = HYBRID,
    ) -> Setup:
        """``fusion``: what its services rank by (``retrieve.Fusion``; None: cosine alone). Raises
        EngineUnavailable for an engine that cannot run here, LocomoError for a missing or malformed ``data``."""
        resolved, note = resolve_engine(engine)  # EngineUnavailable before anything loads
        if note:
            log_err(note)
        convs = load_samples(Path(data), samples)
        lm, embedder = load(model), Embedder()
        return cls(Path(data), convs, lm, embedder, engine, show_progress, resolved=resolved, note=note, fusion=fusion)

    def start(self, stores: list[Path] = ()):
        """The engine (started once; ``stores``: more stores it may inject from besides the bench cache)."""
        if self.opened is None:
            self.opened = open_engine(self.lm, self.engine, stores=[cache_root(), *stores], **self.engine_options)
            if self.opened.note and self.opened.note != self.note:  # a start-up failure, not load's own note
                log_err(self.opened.note)
        return self.opened.engine

    @property
    def engine_name(self) -> str:
        """The running engine's name (or, before it starts, the one ``engine`` resolves to)."""
        return self.opened.engine.name if self.opened is not None else self.resolved

    def service(self, root: Path):
        """A ``service.MemoryService`` over ``root`` on the shared engine."""

        return MemoryService(root, self.start([root]), self.lm, self.embedder, fusion=self.fusion)

    def services(self, window: int, log=None, neighbours: int | None = None, history: bool = False) -> dict:
        """sample -> ``MemoryService`` over that sample's cached store at ``window`` (and ``neighbours`` or
        ``history``: ``policy.Encoding``). Every store is ingested before the engine starts; all samples share
        it."""
        roots = {
            c.sample_id: ensure_store(
                self.data, c, self.lm, self.embedder, window, log, self.show_progress, neighbours, history
            )
            for c in self.convs
        }
        return {sample: self.service(root) for sample, root in roots.items()}

    def close(self) -> None:
        if self.opened is not None:
            self.opened.engine.close()


def log_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token_ms(client, model: str, user: str, question: str, k: int, max_tokens: int = 4) -> float:
    """Time to the first streamed content token of one kv-mode chat of ``user`` at ``k`` facts, as the client
    (``client``: an ``httpx.Client`` on a ``kvmem serve``, with its key) sees it, ms; NaN when the stream ends
    without content. Raises httpx.HTTPStatusError on a non-2xx answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "user": user,
        "max_tokens": max_tokens,
        "stream": True,
        "memory": {"top_k": k, "mode": "kv"},
    }
    t0, first = time.perf_counter(), None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end: the connection goes back to the pool whole
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = (time.perf_counter() - t0) * 1e3
    return first if first is not None else float("nan")


@contextmanager
def served(cmd: list[str], base: str, log: Path, ready_timeout_s: float = 600):
    """Run ``kvmem serve`` (``cmd``, in its own process group, output to ``log``) until ``base``/ready answers
    200; yields (the server's ``Popen``, the ``/ready`` JSON); stops the server (SIGTERM, then SIGKILL after
    30 s). Raises RuntimeError if it exits or is not ready in time."""
    with served_together([(cmd, base, log)], ready_timeout_s) as [one]:
        yield one


@contextmanager
def served_together(specs: list[tuple[list[str], str, Path]], ready_timeout_s: float = 600):
    """``served`` for several servers, (cmd, base, log) each, started at once (their imports and model loads
    overlap); yields [(``Popen``, ``/ready`` JSON)] in ``specs``' order once every one is ready, and stops them
    all. Raises RuntimeError if one exits or is not ready in ``ready_timeout_s``."""
    import signal
    import subprocess

    import httpx

    procs: list[subprocess.Popen] = []
    try:
        for cmd, _, log in specs:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as errlog:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(cmd, stdout=errlog, stderr=subprocess.STDOUT, start_new_session=True))
        ready: list[dict | None] = [None] * len(specs)
        t0 = time.perf_counter()
        while any(r is None for r in ready):
            for i, ((_, base, log), proc) in enumerate(zip(specs, procs)):
                if ready[i] is not None:
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
                try:
                    r = httpx.get(f"{base}/ready", timeout=2)
                    if r.status_code == 200:
                        ready[i] = r.json()
                except httpx.HTTPError:
                    pass
            if time.perf_counter() - t0 > ready_timeout_s:
                late = ", ".join(str(log) for (_, _, log), r in zip(specs, ready) if r is None)
                raise RuntimeError(f"the server did not become ready in {ready_timeout_s:g} s; see {late}")
            if any(r is None for r in ready):
                time.sleep(0.2)
        yield list(zip(procs, ready))
    finally:
        for proc in procs:
            with suppress(ProcessLookupError):  # a server that exited may have taken its group with it
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
