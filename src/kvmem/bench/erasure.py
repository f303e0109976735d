"""``kvmem bench erasure``: what erasure costs.

* ``delete`` of one memory from a user with N memories (``--counts``), re-encoding at once and deferred: latency
  per delete (median, p95) and the facts it re-encoded. The memories are a LoCoMo conversation's turns (cycled),
  added with ``infer=False`` in batches of ``batch`` messages at the default encoding (w=5, m=4); the deleted
  memories are drawn at random. Deferred: the delete alone, and the upkeep job's ``reencode_pending`` after them.
* ``--copies``: erasure through copies (docs/operations.md › What deletion erases): the store's segments in an
  object store (a ``file://`` URL) read by a second store with a disk cache (a server's ``--cache-dir``), beside a
  local store; each delete timed, then the upkeep's round (``Memory.collect`` and the cache's ``sweep_cache``)
  every ``round_s`` with ``retire_after_s``, and the time from the delete until no file of the store, the object
  store or the cache holds the deleted memory's KV (its fp32 bytes; the text goes with the delete's commit).
* facts re-encoded per deleted fact on a LoCoMo conversation ingested as ``kvmem ingest-locomo`` does
  (observations, w=5, m=4): for every fact, the live facts whose provenance names it or its source turn (what
  erasing it re-encodes), counted from the store; ``--check`` of them erased for real, to confirm the count.

Writes summary.json under ``--out``.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

from ..locomo import get_conversation
from ..locomo_ingest import ingest_conversation
from ..memory import Memory
from ..models import load
from ..retrieve import Embedder
from ..store import Store
from .common import machine, median, p95, write_summary_and_records


def _fill(mem: Memory, turns, n: int, batch: int) -> None:
    for start in range(0, n, batch):
        msgs = [
            {"role": "user", "name": turns[i % len(turns)].speaker, "content": turns[i % len(turns)].text}
            for i in range(start, min(n, start + batch))
        ]
        mem.add(msgs, "u", infer=False)


def deletes(lm, emb, turns, n: int, k: int, batch: int, seed: int, echo) -> list[dict]:
    """``k`` deletes re-encoding at once and ``k`` deferred, from a user with ``n`` memories."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-erase-") as tmp:
        mem = Memory(Path(tmp) / "s", model=lm, embedder=emb, window=5, neighbours=4)
        t0 = time.perf_counter()
        _fill(mem, turns, n, batch)
        echo(f"  {n} memories added in {time.perf_counter() - t0:.1f} s")
        rng = random.Random(seed)
        for mode in ("now", "deferred"):
            mem.defer_reencode_s = None if mode == "now" else 3600.0
            for _ in range(k):
                ids = [f.fact_id for f in mem.store.reads.snapshot("u").facts]
                t0 = time.perf_counter()
                out = mem.delete(rng.choice(ids))["erasure"]
                rows.append({"memories": n, "mode": mode, "ms": (time.perf_counter() - t0) * 1e3, **out})
            if mode == "deferred":
                t0 = time.perf_counter()
                got = mem.reencode_pending()
                ms = (time.perf_counter() - t0) * 1e3
                rows.append(
                    {"memories": n, "mode": "upkeep", "ms": ms, "erased": 0, "turns": 0,
                     "reencoded": got["reencoded"], "deferred": 0}
                )  # fmt: skip
        mem.close()
    return rows


def _holds(dirs: list[Path], needle: bytes) -> bool:
    """Whether any file under ``dirs`` holds ``needle``."""
    return any(needle in f.read_bytes() for d in dirs for f in d.rglob("*") if f.is_file())


def copies(lm, emb, turns, n: int, k: int, batch: int, seed: int, retire_s: float, round_s: float, echo) -> list:
    """``k`` deletes from a user with ``n`` memories on a local store and on an object store read through a
    disk cache: each delete's time, then upkeep rounds every ``round_s`` (collect; sweep the cache) with
    ``retire_after_s = retire_s`` until no file holds the deleted memory's KV (``gone_s``, from the delete)."""
    rows = []
    for kind in ("local", "object store + disk cache"):
        with tempfile.TemporaryDirectory(prefix="kvmem-bench-erase-copies-") as tmp:
            tmp = Path(tmp)
            cached = kind != "local"
            mem = Memory(tmp / "s", model=lm, embedder=emb, window=5, neighbours=4,
                         segments_url=(tmp / "objects").as_uri() if cached else None)  # fmt: skip
            _fill(mem, turns, n, batch)
            mem.store.writes.retire_after_s = retire_s
            reader = Store.open(tmp / "s", cache_dir=tmp / "cache") if cached else None
            rng = random.Random(seed)
            for _ in range(k):
                facts = mem.store.reads.snapshot("u").facts
                victim = rng.choice(facts)
                ukv = mem.store.reads.snapshot("u")
                i = next(j for j, f in enumerate(ukv.facts) if f.fact_id == victim.fact_id)
                # its last token's key in the last layer, as stored: layer 0's first key is the same for every fact
                needle = ukv.fact_kv(i)[0][-1, 0, -1].float().numpy().tobytes()
                if reader is not None:  # the server's cache holds every segment
                    rk = reader.reads.snapshot("u")
                    for j in range(len(rk.facts)):
                        rk.fact_kv(j)
                dirs = [tmp / "s", tmp / "objects", tmp / "cache"]
                t0 = time.perf_counter()
                out = mem.delete(victim.fact_id)["erasure"]
                ms = (time.perf_counter() - t0) * 1e3
                rounds, sweep_ms = 0, 0.0
                while _holds(dirs, needle) and time.perf_counter() - t0 < retire_s + 10 * round_s + 60:
                    time.sleep(round_s)
                    t1 = time.perf_counter()
                    mem.collect()
                    if reader is not None:
                        reader.sweep_cache()
                    sweep_ms += (time.perf_counter() - t1) * 1e3
                    rounds += 1
                gone = None if _holds(dirs, needle) else time.perf_counter() - t0
                rows.append({"memories": n, "where": kind, "ms": ms, "rounds": rounds, "upkeep_ms": sweep_ms,
                             "gone_s": gone, **out})  # fmt: skip
            if reader is not None:
                reader.close()
            mem.close()
    return rows


def cascade(lm, emb, data: Path, sample: str, check: int, seed: int, echo) -> dict:
    """Facts re-encoded per erased fact on ``sample`` (w=5, m=4), predicted from provenance for every fact and
    confirmed for ``check`` real erasures (each on the full store)."""
    conv = get_conversation(data, sample)
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-erase-locomo-") as tmp:
        root = Path(tmp) / "s"
        t0 = time.perf_counter()
        ingest_conversation(lm, emb, root, conv, window=5, neighbours=4, progress=False)
        ingest_s = time.perf_counter() - t0
        store = Store.open(root)
        facts = store.reads.snapshot(sample).facts
        predicted = {}
        for f in facts:
            gone_turns = set(f.source_turns)
            predicted[f.fact_id] = sum(
                1
                for g in facts
                if g.fact_id != f.fact_id
                and (
                    g.context_turns is None or gone_turns.intersection(g.context_turns) or f.fact_id in g.context_facts
                )
            )
        counts = sorted(predicted.values())
        checked = []
        for fid in random.Random(seed).sample(sorted(predicted), min(check, len(predicted))):
            store.close()
            with tempfile.TemporaryDirectory(prefix="kvmem-bench-erase-copy-") as t2:
                shutil.copytree(root, Path(t2) / "s")
                st = Store.open(Path(t2) / "s")
                got = st.writes.erase(sample, [fid])
                checked.append({"fact": fid, "predicted": predicted[fid], "stale": len(got["stale"])})
                st.close()
            store = Store.open(root)
        store.close()
    echo(f"  {sample}: {len(facts)} facts ingested in {ingest_s:.0f} s")
    return {
        "sample": sample,
        "facts": len(facts),
        "ingest_s": ingest_s,
        "reencoded_per_deleted_fact": {
            "mean": sum(counts) / len(counts),
            "median": median(counts),
            "p95": p95(counts),
            "max": counts[-1],
        },
        "checked": checked,
    }


def run(
    data: Path,
    out: Path,
    sample: str,
    counts: list[int],
    model: str,
    k: int = 10,
    batch: int = 50,
    check: int = 5,
    seed: int = 0,
    echo=print,
    copies_n: int = 0,
    retire_s: float = 2.0,
    round_s: float = 1.0,
) -> dict:
    """Both parts (``counts`` empty: the LoCoMo part alone; ``check`` < 0: the delete part alone)."""
    lm, emb = load(model), Embedder()
    conv = get_conversation(data, sample)
    rows = []
    for n in counts:
        rows += deletes(lm, emb, conv.turns, n, k, batch, seed, echo)
    table = []
    for n in counts:
        for mode in ("now", "deferred", "upkeep"):
            got = [r for r in rows if r["memories"] == n and r["mode"] == mode]
            if got:
                ms = [r["ms"] for r in got]
                re = [r["reencoded"] for r in got]
                table.append(
                    {"memories": n, "mode": mode, "deletes": len(got), "median_ms": median(ms), "p95_ms": p95(ms),
                     "reencoded_median": median(re)}
                )  # fmt: skip
                echo(f"  {n} memories, {mode}: median {median(ms):.1f} ms, p95 {p95(ms):.1f} ms, re-encoded {re}")
    through = []
    if copies_n:
        crow = copies(lm, emb, conv.turns, copies_n, k, batch, seed, retire_s, round_s, echo)
        rows += crow
        for kind in dict.fromkeys(r["where"] for r in crow):
            got = [r for r in crow if r["where"] == kind]
            ms, gone = [r["ms"] for r in got], [r["gone_s"] for r in got if r["gone_s"] is not None]
            through.append({"where": kind, "memories": copies_n, "deletes": len(got), "median_ms": median(ms),
                            "p95_ms": p95(ms), "upkeep_ms_median": median([r["upkeep_ms"] for r in got]),
                            "gone_s_median": median(gone) if gone else None, "gone_s_max": max(gone, default=None),
                            "never_gone": len(got) - len(gone)})  # fmt: skip
            echo(
                f"  {kind}: delete median {median(ms):.1f} ms, p95 {p95(ms):.1f} ms; no copy holds its KV after "
                f"{through[-1]['gone_s_median']} s median (retire_after_s {retire_s}, a round every {round_s} s)"
            )
    summary = {
        "machine": machine(),
        "copies": {"retire_after_s": retire_s, "round_s": round_s, "results": through} if copies_n else None,
        "model": model,
        "encoding": {"window": 5, "neighbours": 4},
        "delete": table,
        "locomo": cascade(lm, emb, data, sample, check, seed, echo) if check >= 0 else None,
    }
    write_summary_and_records(out, summary, rows)
    return summary
