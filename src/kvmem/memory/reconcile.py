"""``add(infer=True)``'s reconciliation: extracted facts -> ADD / UPDATE / DELETE decisions against the scope's
memories, with the user's requests to forget and corrections acted on even where the model missed them.

Two steps, so the scope is read after the (slow) extraction, as close to the commit as it can be:

1. ``extract``: the messages without their requests to forget -> the extractor's facts, each kept only if it is
   grounded in the user's own words and is no chatter (``grounding``).
2. ``decide``: the extractor's decisions on those facts against the most similar memories, then a correction
   turns the ADD of the corrected fact into an UPDATE of the memory it corrects, and a request to forget deletes
   the memory it is about. Returns a ``Plan``: what the facade commits in one write.

The cues are acted on without the model by cosine score (all-MiniLM-L6-v2), with the thresholds below.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..store import FactRecord
from . import grounding
from .extract import DECISIONS_PROMPT, FACTS_PROMPT, Decision, Extractor

logger = logging.getLogger("kvmem.memory")

# cosine scores for acting on a cue without the model: the memory a correction or a request to forget is about
# must be at least this similar (a forget: and name a word the request names); a forget also takes runners-up
# within the margin, or as similar as "sure"
CORRECTION_MIN_SCORE = 0.4
FORGET_MIN_SCORE, FORGET_MARGIN, FORGET_SURE_SCORE = 0.3, 0.03, 0.6

Similar = Callable[[str, int], list[tuple[float, FactRecord]]]  # (text, k) -> (cosine score, memory), best first


def norm(text: str) -> str:
    """A fact's text as compared for sameness: lower case, single spaces, no final full stop."""
    return " ".join(text.lower().split()).rstrip(".")


@dataclass
class Extracted:
    """What ``extract`` found in one add's messages."""

    forgets: list[str]  # the user's sentences that ask to forget something
    sources: list[str]  # the user's messages, without those sentences: what a fact must be grounded in
    others: list[str]  # the assistant's and system messages
    prompts: list[str]  # the extraction prompts and date: words a fact must not come from
    found: list[str]  # every fact the extractor returned
    facts: list[str]  # the grounded, non-chatter ones, one per normalised text
    rejected: int  # distinct facts dropped


@dataclass
class Plan:
    """One add's changes, committed in one write."""

    new: list[tuple[str, str | None, dict]] = field(default_factory=list)  # (text, id kept or None, metadata)
    delete: list[str] = field(default_factory=list)  # ids tombstoned (each UPDATE's too)
    events: list[tuple] = field(default_factory=list)  # UPDATE history events (fact_id, event, old, new)
    results: list[dict] = field(default_factory=list)  # the UPDATE and DELETE results; ADDs come from the commit
    rejected: int = 0  # facts and decisions dropped as not the user's own words


def extract(msgs: list[dict], extractor: Callable[[], Extractor], day: str, prompt: str | None) -> Extracted:
    """Step 1. ``msgs``: checked messages (``mem0.check_messages``); ``extractor``: returns the extractor, called
    only when a user message is left to extract from (making it loads the model); ``day``: today's date label
    for the prompt; ``prompt``: the caller's instructions or None."""
    kept = []  # the messages without their requests to forget: such a request is no fact to remember
    forgets = []
    for m in msgs:
        parts = grounding.sentences(m["content"]) if m["role"] == "user" else [m["content"]]
        forgets += [p for p in parts if m["role"] == "user" and grounding.forget_request(p)]
        rest = " ".join(p for p in parts if p not in forgets)
        if rest:
            kept.append({**m, "content": rest})
    sources = [m["content"] for m in kept if m["role"] == "user"]
    found = extractor().facts(kept, day, prompt) if sources else []
    others = [m["content"] for m in msgs if m["role"] != "user"]
    prompts = [FACTS_PROMPT, DECISIONS_PROMPT, prompt or "", day]
    facts = [
        f
        for f in {norm(f): f for f in found}.values()
        if grounding.grounded(f, sources, others, prompts) and not grounding.chatter(f)
    ]
    rejected = len({norm(f) for f in found}) - len(facts)
    if rejected:
        logger.info("extractor: %d facts not in the user's messages were dropped", rejected)
    return Extracted(forgets, sources, others, prompts, found, facts, rejected)


def decide(
    got: Extracted,
    extractor: Callable[[], Extractor],
    similar: Similar,
    metadata: dict,
    counts: Counter,
) -> Plan:
    """Step 2. ``similar``: the scope's live memories most similar to a text; ``metadata``: every new memory's;
    ``counts``: the facade's extraction counters (adds, facts_extracted, facts_rejected, corrections, forgotten),
    incremented here. One decision per memory: the first one wins."""
    facts, sources, others, prompts = got.facts, got.sources, got.others, got.prompts
    existing: dict[str, str] = {}
    for f in facts:  # the most similar existing memories of each new fact
        for _, fact in similar(f, 5):
            existing[fact.fact_id] = fact.text
    decisions = extractor().reconcile(facts, list(existing.items())) if facts else []
    # a correction: the memory its sentence is about is replaced by the corrected fact (the model's ADD of it,
    # else a fact it extracted, else the user's own sentence), also where the model deleted it or did nothing
    updated = {d.target for d in decisions if d.event == "UPDATE"}
    for c in [p for t in sources for p in grounding.sentences(t) if grounding.correction(p)]:
        best = similar(c, 1)
        if not best or best[0][0] < CORRECTION_MIN_SCORE or best[0][1].fact_id in updated:
            continue
        fact = best[0][1]
        adds = [i for i, d in enumerate(decisions) if d.event == "ADD" and grounding.shares_words(d.text, c)]
        if adds:
            text = decisions.pop(adds[0]).text
        else:
            text = next((f for f in facts if grounding.shares_words(f, c)), c)
        decisions = [d for d in decisions if d.target != fact.fact_id] + [Decision("UPDATE", text, fact.fact_id)]
        existing[fact.fact_id] = fact.text
        updated.add(fact.fact_id)
        counts["corrections"] += 1
    for t in got.forgets:  # what an explicit request to forget is about, if the model did not delete it
        about = grounding.topic(t)
        hits = similar(about, 3)
        best = hits[0][0] if hits else 0.0
        for score, fact in hits:
            close = score >= best - FORGET_MARGIN or score >= FORGET_SURE_SCORE
            if score >= FORGET_MIN_SCORE and close and grounding.shares_words(about, fact.text):
                existing[fact.fact_id] = fact.text
                decisions = [d for d in decisions if d.target != fact.fact_id]
                decisions.append(Decision("DELETE", fact.text, fact.fact_id))
                counts["forgotten"] += 1
    plan = Plan(rejected=got.rejected)
    new, delete = plan.new, plan.delete
    known = {norm(t) for t in existing.values()}
    for d in decisions:
        if d.target is not None and (d.target in delete or any(n[1] == d.target for n in new)):
            continue  # one decision per memory per add
        if d.event in ("ADD", "UPDATE") and not grounding.grounded(
            d.text, sources + ([existing[d.target]] if d.event == "UPDATE" else []), others, prompts
        ):
            logger.info("extractor: %s %r is not in the user's messages: dropped", d.event, d.text)
            plan.rejected += 1
            continue
        if d.event == "ADD" and norm(d.text) in known | {norm(n[0]) for n in new}:
            logger.info("extractor: %r is already known: NONE", d.text)
            continue
        if d.event == "ADD":
            new.append((d.text, None, metadata))
        elif d.event == "UPDATE":
            new.append((d.text, d.target, metadata))
            delete.append(d.target)
            plan.events.append((d.target, "UPDATE", existing[d.target], d.text))
            plan.results.append(
                {"id": d.target, "memory": d.text, "event": "UPDATE", "previous_memory": existing[d.target]}
            )
        elif d.event == "DELETE":
            delete.append(d.target)
            plan.results.append({"id": d.target, "memory": existing[d.target], "event": "DELETE"})
        else:
            logger.info("extractor: NONE for %r", d.text)
    counts["adds"] += 1
    counts["facts_extracted"] += len({norm(f) for f in got.found})
    counts["facts_rejected"] += plan.rejected
    return plan
