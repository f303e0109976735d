"""The rules every command, the server and ``Memory`` share: how writes encode, which serving methods exist, and
which user ids are allowed. No heavy imports, so the CLI checks its arguments before torch loads.

* ``Encoding``: what each fact's stored KV is computed behind (window, neighbours, history) and its defaults;
* ``parse_mode``: a serving method (``kv``, ``prompt``, ``kv-tail<r>``, ``kv-sel<p>``);
* ``check_user``: a user id, NFC-normalised.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

DEFAULT_WINDOW = 5  # turns before a fact's source turn (context-window encoding)
DEFAULT_NEIGHBOURS = 4  # on by default: closes the KV-vs-prompt gap at no serving cost (docs/benchmarks.md)
MAX_NEIGHBOURS = 32
MAX_USER_CHARS = 256


@dataclass(frozen=True)
class Encoding:
    """How a write encodes each fact's KV (paper §3.2, and kvmem's neighbour-aware and history encodings).

    ``window``: conversation turns before the fact's source turn, encoded with it; ``neighbours``: the fact is
    also encoded behind its m most similar other facts of the user; ``history``: behind every earlier fact of
    the user instead (not with neighbours). ``Encoding.of`` fills what is not given with the defaults: window 5
    and 4 neighbours, or window 0 and no neighbours with ``history`` (turns between earlier facts and the fact
    measured worse)."""

    window: int = DEFAULT_WINDOW
    neighbours: int = DEFAULT_NEIGHBOURS
    history: bool = False

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an integer >= 0, got {self.window!r}")
        check_neighbours(self.neighbours)
        if not isinstance(self.history, bool):
            raise ValueError(f"history must be True or False, got {self.history!r}")
        if self.history and self.neighbours:
            raise ValueError("history encoding and neighbours do not combine; use one of them")

    @classmethod
    def of(cls, window: int | None = None, neighbours: int | None = None, history: bool | None = None) -> Encoding:
        """The encoding for what was given, defaults for the rest. Raises ValueError for a bad value or
        history with neighbours."""
        history = False if history is None else history
        if window is None:
            window = 0 if history is True else DEFAULT_WINDOW
        if neighbours is None:
            neighbours = 0 if history is True else DEFAULT_NEIGHBOURS
        return cls(window, neighbours, history)

    def describe(self) -> str:
        """``w=5, m=4`` / ``w=0, history``."""
        return (
            f"w={self.window}"
            + (f", m={self.neighbours}" if self.neighbours else "")
            + (", history" if self.history else "")
        )


def check_neighbours(neighbours) -> int:
    """``neighbours`` as given, or ValueError outside 0..MAX_NEIGHBOURS."""
    if isinstance(neighbours, bool) or not isinstance(neighbours, int) or not 0 <= neighbours <= MAX_NEIGHBOURS:
        raise ValueError(f"neighbours must be an integer in 0..{MAX_NEIGHBOURS}, got {neighbours!r}")
    return neighbours


MODES_HELP = (
    "kv, prompt, kv-tail<r> (tail recompute of r facts) or kv-sel<p> (selective recompute of p% of fact tokens)"
)


def parse_mode(mode: str, tail_recompute: int | None = None) -> tuple[str, int | None, float]:
    """A serving method -> (mode, tail recompute r, selective-recompute fraction): "kv", "prompt",
    "kv-tail<r>" (tail recompute r) or "kv-sel<p>" (query-aware selective recompute of p% of the fact tokens,
    transformers engine; ``engines.hf.selective_recompute``). ``tail_recompute``: the r a plain ``kv`` gets.
    Raises ValueError otherwise, and for selective with tail recompute."""
    tail = re.fullmatch(r"kv-tail(0|[1-9][0-9]*)", mode) if isinstance(mode, str) else None
    if tail:
        return "kv", int(tail[1]), 0.0
    sel = re.fullmatch(r"kv-sel([1-9][0-9]?|100)", mode) if isinstance(mode, str) else None
    if sel:
        if tail_recompute:
            raise ValueError("kv-sel (selective recompute) and tail recompute do not combine; use one of them")
        return "kv", 0, int(sel[1]) / 100
    if mode not in ("kv", "prompt"):
        raise ValueError(f"mode must be 'kv', 'prompt', 'kv-tail<r>' or 'kv-sel<1-100>', not {mode!r}")
    return mode, tail_recompute, 0.0


def check_user(user) -> str:
    """A store user id, NFC-normalised (two spellings of one name are one user). Raises ValueError for a
    non-string, an empty one, more than 256 characters, path or control characters."""
    if not isinstance(user, str):
        raise ValueError("user_id must be a non-empty string")
    user = unicodedata.normalize("NFC", user)
    if not user.strip():
        raise ValueError("user_id must be a non-empty string")
    if (
        len(user) > MAX_USER_CHARS
        or any(c in user for c in "/\\\0")
        or user in (".", "..")
        or any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in user)
    ):
        raise ValueError(
            f"user_id {user[:40]!r} is not allowed (no path characters, control characters, or more "
            f"than {MAX_USER_CHARS} characters)"
        )
    return user


def check_store_user(user) -> str:
    """A store's user: an id (``check_user``), or an entity scope's key of several ids joined by ``/``
    (``scopes.Scope.key``). Raises ValueError."""
    if not isinstance(user, str) or "/" not in user:
        return check_user(user)
    for part in user.split("/"):
        if part:
            check_user(part)
    if user.endswith("/") or "//" in user or len(user) > 4 * MAX_USER_CHARS:
        raise ValueError(f"store user {user[:40]!r} is not a scope key")
    return user
