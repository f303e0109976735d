"""Checks on what fact extraction returns, on the output rather than by prompt wording alone.

* ``grounded``: a fact is kept only if its content words come from the user's own messages rather than from
  what the assistant, a system message or kvmem's extraction prompt said (today's date, "personal memory",
  ...), so prompt text and the assistant's suggestions never become a user fact.
* ``chatter``: a "fact" about the conversation (what was asked, what the assistant said, small talk) is dropped.
* ``forget_request`` / ``correction``: a user's explicit request to forget something, or a correction of what
  they said before ("actually ...", "not X anymore"): the cues that make ``Memory.add`` delete or update the
  matching memory even where the model's reconciliation missed it.

Plain word matching: no model, so the checks are the same on every extractor.
"""

from __future__ import annotations

import re

STOPWORDS = frozenset(
    """a an the and or but if then so of to in on at by for with from about into over after before as is are was
    were be been being am do does did have has had having i me my mine myself we us our ours you your yours he him
    his she her hers it its they them their theirs this that these those there here what which who whom whose
    when where why how all any both each few more most other some such no nor not only own same than too very can
    will just should would could may might must shall now also still again really quite user user's users person
    people named called name someone their them being like likes""".split()  # noqa: SIM905
)
_WORD = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*")
PREFIX = 5  # "allergy" ~ "allergic", "starting" ~ "started": a shared 5-letter prefix is the same word here

_ASK = r"(?:^|[.!?;,]\s*|\bplease\s+|\b(?:can|could|would|will) you\s+(?:please\s+)?|\band\s+)"
FORGET = re.compile(  # an imperative "forget / delete / remove ..." (not "don't forget"), or "... from memory"
    _ASK + r"(forget|delete|remove|erase|wipe|unlearn)\b"
    r"|\b(?:delete|remove|erase|wipe|forget)\b[^.!?]*\b(?:from (?:your|the) memory|from memory|from your records)"
    r"|\b(stop remembering|don'?t remember|do not remember|no longer remember|shouldn'?t have (?:told|shared|said))",
    re.IGNORECASE,
)
CORRECTION = re.compile(
    r"\b(actually|correction|not \w+ anymore|not \w+ any more|no longer|anymore|any more|changed|moved from|"
    r"instead|i meant|i said|please fix|fix that|sold)\b|,\s*not\s+\w+",
    re.IGNORECASE,
)


def words(text: str) -> list[str]:
    """Lower-cased content words of ``text`` (stopwords dropped, possessive 's removed)."""
    out = []
    for w in _WORD.findall(text.lower()):
        w = w.removesuffix("'s")
        if w not in STOPWORDS and len(w) > 1:
            out.append(w)
    return out


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    if a[0].isdigit() or b[0].isdigit() or min(len(a), len(b)) < PREFIX:
        return False
    return a[:PREFIX] == b[:PREFIX]


def _count(fw: set[str], ws: set[str]) -> int:
    return sum(1 for w in fw if any(_same(w, s) for s in ws))


def grounded(fact: str, said: list[str], others: list[str] = (), prompts: list[str] = ()) -> bool:
    """Whether ``fact`` comes from what the user ``said``: no word of it is only in ``others`` (the assistant's and
    system messages: the user did not say it), no number only in ``prompts`` (kvmem's own prompt text, today's
    date), and at least one content word and a quarter of them are the user's, no fewer than the prompts'.
    Paraphrase passes ("I moved to Porto" -> "Alice lives in Porto"); a prompt fragment ("Today is 1 December,
    2026."), an assistant's suggestion or a system message's claim does not."""
    fw = set(words(fact))
    if not fw:
        return False
    user = set(words(" ".join(said)))
    only_theirs = {w for w in fw if not any(_same(w, u) for u in user)}
    if _count(only_theirs, set(words(" ".join(others)))):
        return False
    prompt = {w for w in only_theirs if any(_same(w, p) for p in set(words(" ".join(prompts))))}
    if any(w[0].isdigit() for w in prompt):
        return False
    mine = len(fw) - len(only_theirs)
    return mine >= 1 and mine >= len(prompt) and mine / len(fw) >= 0.25


SMALL_TALK = frozenset(
    {"hi", "hello", "hey", "thanks", "thank", "ok", "okay", "great", "good", "nice", "fine", "well", "doing", "today",
     "bye", "goodbye", "later", "talk", "see", "soon", "helpful", "cool", "sure", "yes", "yeah", "please", "sorry",
     "welcome", "morning", "evening", "night", "day", "weather", "joke"}
)  # fmt: skip
CHATTER = re.compile(
    r"^\s*(?:user|assistant|system)\s*:|\b(?:assistant|chatbot|the ai)\b|"
    r"\b(?:user|they|he|she)\s+(?:asked|asks|is asking|requested|requests|wants to know|wanted to know|said "
    r"(?:hi|hello|goodbye|bye|thanks)|greeted|thanked)\b",
    re.IGNORECASE,
)


def chatter(fact: str) -> bool:
    """A "fact" about the conversation itself, not the user: what the user asked or the assistant said, a
    transcript line, or small talk only ("The user asked for a joke.", "user: Bye!")."""
    return bool(CHATTER.search(fact)) or all(w in SMALL_TALK for w in words(fact))


def shares_words(a: str, b: str) -> bool:
    """Whether two texts share a content word (a memory a forget request is about names what it names)."""
    return _count(set(words(a)), set(words(b))) > 0


def sentences(text: str) -> list[str]:
    """``text`` split after . ! ? (a request to forget and a new fact may share one message)."""
    return [p for p in re.split(r"(?<=[.!?])\s+", text.strip()) if p]


def forget_request(text: str) -> bool:
    """An explicit request to forget or delete something the user told before."""
    return bool(FORGET.search(text))


def correction(text: str) -> bool:
    """A correction of something said before (cue words such as "actually", "not X anymore", ", not X")."""
    return bool(CORRECTION.search(text))


def topic(text: str) -> str:
    """What a forget request is about: the request without its verbs and politeness, for retrieval."""
    stripped = re.sub(
        r"\b(please|forget|delete|remove|erase|wipe|unlearn|from (?:your|the) memory|from memory|everything|about|"
        r"the fact that|anymore|don'?t remember|do not remember|stop remembering|i shouldn'?t have (?:told|shared|"
        r"said) (?:it|that|you))\b",
        " ",
        text,
        flags=re.IGNORECASE,
    )
    return " ".join(stripped.split()) or text
