"""Evidence recall of retrieval on LoCoMo: of the turns a question names as its evidence, the share whose facts
are among the top k retrieved, per category, for cosine search and hybrid search (``retrieve.Fusion``).

A fact maps to its source turns through the LoCoMo file itself: the store keeps each fact's ``fact_id``, which
names the observation it was written from (``locomo.Fact.fact_id``), and the observation names its evidence
turns (``locomo.Fact.source_turns``). An evidence turn no fact came from can never be recalled; ``coverage`` is
the share that can (the ceiling of recall). Counts are evidence turns, pooled over a category's questions
(micro-averaged). Only retrieval runs: the question embedder, the vector index and the store's full-text index.
"""

from __future__ import annotations

from ..locomo import dia_ids
from ..retrieve import HYBRID, Fusion, search

KS = (5, 10, 20, 50, 100)
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def parse_fusion(spec: str) -> Fusion | None:
    """A retrieval named on the command line: ``cosine`` (None), ``hybrid`` (``retrieve.HYBRID``, the default),
    ``rrf[:rrf_k[:weight]]`` or ``weighted[:weight]``. Raises ValueError."""
    name, *args = spec.split(":")
    try:
        if name == "cosine" and not args:
            return None
        if name == "hybrid" and not args:
            return HYBRID
        if name == "rrf" and len(args) <= 2:
            return Fusion("rrf", float(args[1]) + 0.0 if len(args) > 1 else 1.0, int(args[0]) if args else 60)
        if name == "weighted" and len(args) <= 1:
            return Fusion("weighted", float(args[0]) + 0.0 if args else 0.1)  # + 0.0: -0 is 0
    except ValueError as exc:
        raise ValueError(f"retrieval {spec!r}: {exc}") from None
    raise ValueError(f"retrieval {spec!r}: one of cosine, hybrid, rrf[:K[:W]], weighted[:W]")


def evidence_recall(items, embedder, ks=KS, fusion: Fusion | None = None) -> dict:
    """Evidence recall@k of ``items``: ``(conversation, store, indexes)`` triples, the store holding the
    conversation's facts as user ``conversation.sample_id`` (``ingest_conversation``) and ``indexes`` an
    ``retrieve.IndexCache``. Categories 1-4, questions with evidence only.

    Returns ``{"k": [...], "retrieval": "cosine" | fusion, "categories": {"1".."4", "overall": {"questions",
    "turns", "coverage" (%), "recall": {"5": %, ...}}}}``."""
    ks = sorted(set(ks))
    tally: dict = {}
    for conv, store, indexes in items:
        ukv = store.reads.snapshot(conv.sample_id)
        turns_of = {f.fact_id: set(f.source_turns or (f.source_turn,)) for f in conv.facts}
        known = set().union(*turns_of.values()) if turns_of else set()
        qs = [(q, dia_ids(q.evidence)) for q in conv.questions if 1 <= q.category <= 4 and q.question.strip()]
        qs = [(q, ev) for q, ev in qs if ev]
        if not qs:
            continue
        vecs = embedder.embed([q.question for q, _ in qs])
        for (q, ev), vec in zip(qs, vecs):
            for cat in (q.category, "overall"):
                t = tally.setdefault(cat, {"questions": 0, "turns": 0, "covered": 0, "hits": dict.fromkeys(ks, 0)})
                t["questions"] += 1
                t["turns"] += len(ev)
                t["covered"] += sum(e in known for e in ev)
            for k in ks:
                hits = search(indexes, store, ukv, vec, q.question, k, ukv.unexpired(), fusion)
                got = set().union(*(turns_of.get(ukv.facts[h.position].fact_id, ()) for h in hits))
                n = sum(e in got for e in ev)
                for cat in (q.category, "overall"):
                    tally[cat]["hits"][k] += n
    cats = {}
    for cat in (1, 2, 3, 4, "overall"):
        t = tally.get(cat)
        if t is None:
            continue
        cats[str(cat)] = {
            "name": CATEGORY_NAMES.get(cat, "overall"),
            "questions": t["questions"],
            "turns": t["turns"],
            "coverage": round(100 * t["covered"] / t["turns"], 2),
            "recall": {str(k): round(100 * t["hits"][k] / t["turns"], 2) for k in ks},
        }
    return {"k": ks, "retrieval": describe(fusion), "categories": cats}


def describe(fusion: Fusion | None) -> str:
    """``cosine``, or the fusion's parameters as ``parse_fusion`` reads them."""
    if fusion is None:
        return "cosine"
    w = f"{fusion.weight:g}" if float(f"{fusion.weight:g}") == fusion.weight else repr(fusion.weight)  # exact
    if fusion.method == "rrf":
        return f"rrf:{fusion.rrf_k}:{w}"
    return f"weighted:{w}"


def rows(result: dict) -> list[list]:
    """Table rows (category, questions, turns, coverage, recall@k...) of one ``evidence_recall`` result."""
    return [
        [c["name"], c["questions"], c["turns"], c["coverage"], *(c["recall"][str(k)] for k in result["k"])]
        for c in result["categories"].values()
    ]


def run(
    data,
    out,
    samples: list[str] | None,
    retrievals: list[str],
    ks: list[int],
    model: str,
    show_progress: bool = True,
    echo=print,
) -> dict:
    """``kvmem eval recall``: evidence recall@k per category of each retrieval in ``retrievals``
    (``parse_fusion``) over ``samples``' stores, the first retrieval the baseline of the gains. Retrieval reads
    no KV, so the stores are built with ``model`` (the smallest by default) at window 0 and no neighbours, once,
    in the bench cache. Writes ``out/summary.json``; returns it."""
    from pathlib import Path

    from ..models import load
    from ..retrieve import Embedder, IndexCache
    from ..store import Store
    from .common import ensure_store, load_samples, log_err, machine, table, write_json

    fusions = [(spec, parse_fusion(spec)) for spec in retrievals]
    if not fusions:
        raise ValueError("--retrieval is empty")
    convs = load_samples(Path(data), samples)
    lm, embedder = load(model), Embedder()
    stores = [
        Store.open(ensure_store(Path(data), c, lm, embedder, 0, log_err, show_progress, neighbours=0)) for c in convs
    ]
    results = {}
    try:
        for spec, fusion in fusions:
            items = [(c, st, IndexCache(256 << 20)) for c, st in zip(convs, stores)]
            results[spec] = evidence_recall(items, embedder, ks, fusion)
    finally:
        for st in stores:
            st.close()
    base = fusions[0][0]
    k20 = 20 if 20 in ks else max(ks)
    at = lambda spec, cat: results[spec]["categories"][cat]["recall"][str(k20)]
    gains = {
        spec: {cat: round(at(spec, cat) - at(base, cat), 2) for cat in r["categories"]}
        for spec, r in results.items()
        if spec != base
    }
    summary = {
        "command": "eval recall",
        "data": str(data),
        "samples": [c.sample_id for c in convs],
        "k": sorted(set(ks)),
        "recall": results,
        f"gain_at_{k20}_over_{base}": gains,
        "stores": f"built with {model} at window 0, no neighbours (retrieval reads no KV)",
        "machine": machine(),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(Path(out) / "summary.json", summary)
    header = ["category", "questions", "turns", "coverage"] + [f"R@{k}" for k in sorted(set(ks))]
    for spec, r in results.items():
        echo(f"evidence recall, {spec} ({', '.join(summary['samples'])}):")
        echo(table(rows(r), header))
    for spec, g in gains.items():
        names = [results[spec]["categories"][c]["name"] for c in g]
        echo(f"{spec} - {base} at k={k20}: " + ", ".join(f"{n} {v:+.2f}" for n, v in zip(names, g.values())))
    echo(f"wrote {out}/summary.json")
    return summary
