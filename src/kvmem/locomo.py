"""LoCoMo reader: conversations, turns and memory facts (the ``observation`` entries).

Format: Maharana et al., "Evaluating Very Long-Term Conversational Memory of LLM Agents" (ACL 2024).
A file is a JSON list of samples with ``sample_id``, ``conversation`` (``session_<n>`` turn lists and
``session_<n>_date_time``), ``observation`` (``session_<n>_observation``: speaker -> [[fact, dia_id], ...])
and ``qa``. The reader knows nothing about models or engines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .compose import replace_invalid

_SESSION = re.compile(r"^session_(\d+)$")
_DIA = re.compile(r"^D(\d+):(\d+)$")
_DIA_ANY = re.compile(r"D:?(\d+):(\d+)")  # also inside "D8:6; D9:17", "D9:1 D4:4" and the typo "D:11:26"


class LocomoError(ValueError):
    """The file is missing, not JSON, or not in LoCoMo format; ``path``: the file, where it could not be read."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class Turn:
    dia_id: str
    speaker: str
    text: str
    session: int
    date: str

    def render(self) -> str:
        """One line of conversation context, as fed to the encoder before a fact."""
        return f"{self.speaker}: {self.text}\n"


@dataclass(frozen=True)
class Fact:
    """One memory fact. ``fact_id`` is stable across runs: ``<sample>/s<session>/<speaker idx>/<n>``."""

    fact_id: str
    user: str
    text: str
    speaker: str
    source_turn: str  # dia_id of the earliest evidence turn
    date: str
    source_turns: tuple[str, ...] = ()  # every evidence turn's dia_id (``dia_ids``), earliest first

    def render(self) -> str:
        """The fact as it appears in the memory block; ends in a newline so facts tokenize independently."""
        return f"- [{self.date}] {self.text}\n"


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...] = ()


@dataclass
class Conversation:
    sample_id: str
    turns: list[Turn]
    facts: list[Fact]
    questions: list[Question] = field(default_factory=list)

    def turns_before(self, dia_id: str, window: int) -> list[Turn]:
        """The ``window`` turns immediately before turn ``dia_id`` (fewer at the start; none if unknown)."""
        if window <= 0:
            return []
        idx = self._turn_index().get(dia_id)
        if idx is None:
            return []
        return self.turns[max(0, idx - window) : idx]

    def _turn_index(self) -> dict[str, int]:
        if not hasattr(self, "_idx"):
            self._idx = {t.dia_id: i for i, t in enumerate(self.turns)}
        return self._idx


def dia_ids(evidence) -> tuple[str, ...]:
    """The turn ids (``D<session>:<turn>``) named by LoCoMo evidence, a string or a list of strings as the file
    has them ("D1:3", "D8:6; D9:17", "D26:14, D26:34", ["D1:18", "D"]); in order, each once, unparseable parts
    dropped."""
    items = evidence if isinstance(evidence, (list, tuple)) else [evidence]
    found = [f"D{a}:{b}" for e in items for a, b in _DIA_ANY.findall(str(e))]
    return tuple(dict.fromkeys(found))


def _dia_key(dia_id: str) -> tuple[int, int]:
    m = _DIA.match(dia_id.strip())
    return (int(m.group(1)), int(m.group(2))) if m else (10**9, 10**9)


def load_locomo(path: str | Path) -> list[Conversation]:
    """Read every sample of a LoCoMo-format JSON file.

    Raises:
        LocomoError: the file is missing, a directory or unreadable, is not JSON, or lacks the LoCoMo fields.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LocomoError(f"LoCoMo file not found: '{path}'", path) from None
    except IsADirectoryError:
        raise LocomoError(f"'{path}' is a directory, not a LoCoMo file", path) from None
    except OSError as exc:
        raise LocomoError(f"cannot read the LoCoMo file '{path}': {exc.strerror or exc}", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LocomoError(f"{path} is not valid JSON: {exc}") from None
    raw = _replace_invalid(raw)
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, dict) and "sample_id" in s for s in raw):
        raise LocomoError(f"{path} is not in LoCoMo format (expected a list of samples with 'sample_id')")
    return [_parse_sample(s, path) for s in raw]


def _replace_invalid(x):
    """Every string of the file with lone UTF-16 surrogates replaced by U+FFFD (JSON allows "\\ud83d" alone;
    no tokenizer does)."""

    if isinstance(x, str):
        return replace_invalid(x)
    if isinstance(x, list):
        return [_replace_invalid(v) for v in x]
    if isinstance(x, dict):
        return {k: _replace_invalid(v) for k, v in x.items()}
    return x


def _parse_sample(sample: dict, path: Path) -> Conversation:
    sid = str(sample["sample_id"])
    conv = sample.get("conversation")
    if not isinstance(conv, dict):
        raise LocomoError(f"{path}: sample {sid} has no 'conversation'")
    turns: list[Turn] = []
    dates: dict[int, str] = {}
    for key in sorted((k for k in conv if _SESSION.match(k)), key=lambda k: int(_SESSION.match(k).group(1))):
        n = int(_SESSION.match(key).group(1))
        dates[n] = str(conv.get(f"{key}_date_time", ""))
        for t in conv[key] or []:
            text = t.get("text", "")
            if t.get("blip_caption"):
                text = f"{text} [shares a photo: {t['blip_caption']}]"
            turns.append(Turn(str(t.get("dia_id", "")), str(t.get("speaker", "")), text, n, dates[n]))

    facts: list[Fact] = []
    observed = []
    for key, per_speaker in (sample.get("observation") or {}).items():
        m = re.match(r"^session_(\d+)_observation$", key)
        if m and isinstance(per_speaker, dict):
            observed.append((int(m.group(1)), per_speaker))
    for n, per_speaker in sorted(observed, key=lambda x: x[0]):
        for s_idx, (speaker, items) in enumerate(sorted(per_speaker.items())):
            for i, item in enumerate(items or []):
                if not isinstance(item, (list, tuple)) or not item or not str(item[0]).strip():
                    continue
                text = str(item[0]).strip()
                ev = item[1] if len(item) > 1 else ""
                ev_list = [str(e) for e in ev] if isinstance(ev, (list, tuple)) else [str(ev)]
                source = min(ev_list, key=_dia_key) if ev_list else ""
                turns_of = tuple(sorted(dia_ids(ev), key=_dia_key))
                facts.append(
                    Fact(f"{sid}/s{n}/{s_idx}/{i}", sid, text, str(speaker), source, dates.get(n, ""), turns_of)
                )

    questions = [
        Question(
            str(q["question"]), str(q.get("answer", "")), int(q.get("category", 0)), tuple(q.get("evidence") or ())
        )
        for q in sample.get("qa") or []
        if "question" in q
    ]
    return Conversation(sid, turns, facts, questions)


def get_conversation(path: str | Path, sample_id: str) -> Conversation:
    """One sample by id. Raises LocomoError naming the samples the file has."""
    convs = load_locomo(path)
    for c in convs:
        if c.sample_id == sample_id:
            return c
    have = ", ".join(c.sample_id for c in convs) or "no samples"
    raise LocomoError(f"sample {sample_id!r} not in {path}; it has: {have}")


def answerable(questions: list[Question]) -> list[Question]:
    """Categories 1-4 only: category 5 is adversarial/unanswerable and excluded by the usual protocol."""
    return [q for q in questions if 1 <= q.category <= 4]
