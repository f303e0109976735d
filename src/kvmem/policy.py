"""The rules every command, the server and ``Memory`` share: how writes encode, which serving methods exist, and
which user ids are allowed. No heavy imports, so the CLI checks its arguments before torch loads.

* ``Encoding``: what each fact's stored KV is computed behind (window, neighbours, history) and its defaults;
* ``Method``: a serving method (``kv``, ``prompt``, ``kv-tail<r>``, ``kv-sel<p>``; ``off``: a bare chat), parsed
  once from its spelling;
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
_TAIL = re.compile(r"kv-tail(0|[1-9][0-9]*)")
_SELECTIVE = re.compile(r"kv-sel([1-9][0-9]?|100)")


@dataclass(frozen=True)
class Method:
    """How a request's memory reaches the model: the one structured form of a serving method.

    ``mode``: "kv" (KV injection), "prompt" (prompt injection) or "off" (a bare chat, no memory); ``tail``: kv
    mode prefills the last r retrieved facts with the query instead of injecting them (tail recompute; None: the
    service's default r); ``recompute``: the fraction in (0, 1] of the injected fact tokens that the query
    attends to most, recomputed (query-aware selective recompute; 0 = off), in percent steps.

    ``Method.parse`` reads the user-facing spelling (``kv``, ``prompt``, ``kv-tail<r>``, ``kv-sel<p>``), ``str``
    writes it back, and ``Method.of`` builds one from the options a request or a command gives (mode, tail
    recompute, selective-recompute percentage)."""

    mode: str = "kv"
    tail: int | None = None
    recompute: float = 0.0

    @classmethod
    def parse(cls, method: str | Method, tail_recompute: int | None = None) -> Method:
        """``method`` (its spelling, or a ``Method``) checked, with ``tail_recompute`` as the r of a ``kv`` or
        ``prompt`` that names none. Raises ValueError for another spelling ("off" included: a bare chat is no
        serving method), and for selective with tail recompute."""
        if isinstance(method, Method):
            tail_recompute = tail_recompute if method.tail is None else method.tail
            if method.recompute or method.mode not in ("kv", "prompt"):
                return cls.parse(str(method), tail_recompute)
            return cls(method.mode, tail_recompute)
        tail = _TAIL.fullmatch(method) if isinstance(method, str) else None
        if tail:
            return cls("kv", int(tail[1]))
        sel = _SELECTIVE.fullmatch(method) if isinstance(method, str) else None
        if sel:
            if tail_recompute:
                raise ValueError("kv-sel (selective recompute) and tail recompute do not combine; use one of them")
            return cls("kv", 0, int(sel[1]) / 100)
        if method not in ("kv", "prompt"):
            raise ValueError(f"mode must be 'kv', 'prompt', 'kv-tail<r>' or 'kv-sel<1-100>', not {method!r}")
        return cls(method, tail_recompute)

    @classmethod
    def of(cls, mode: str = "kv", tail_recompute: int | None = None, selective_recompute: int = 0) -> Method:
        """The method a request's options name: ``mode`` kv | prompt | off, ``tail_recompute`` r (None: the
        service's default), ``selective_recompute`` p% of the fact tokens (kv mode; 0 = off). Not yet checked:
        ``parse`` (the service's ``plan``) refuses selective with tail recompute."""
        if mode == "kv" and selective_recompute:
            return cls("kv", tail_recompute, selective_recompute / 100)
        return cls(mode, tail_recompute)

    def __str__(self) -> str:
        """The user-facing spelling: ``kv``, ``prompt``, ``off``, ``kv-sel<p>``; ``kv`` with a tail r is
        ``kv-tail<r>``."""
        if self.recompute:
            return f"kv-sel{round(self.recompute * 100)}"
        return f"kv-tail{self.tail}" if self.mode == "kv" and self.tail else self.mode


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
