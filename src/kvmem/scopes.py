"""Entity scopes and Mem0's filter language.

A memory belongs to a ``user_id``, an ``agent_id``, a ``run_id`` or a combination (Mem0's entity scopes). Each
combination is one partition of the store, with its own KV segments, search index, version and turns: the store
"user" of that partition is its **scope key**:

* ``alice`` for user ``alice`` alone (so stores written before scopes existed read unchanged);
* ``alice/agent:travel``, ``/agent:travel/run:r1``, ``alice/run:r1``... otherwise. ``/`` never occurs in an id
  (``policy.check_user``), so a key names exactly one scope.

A namespace (the server's tenant) prefixes the user part: ``acme:alice/agent:travel``.

Filters are Mem0's (``mem0.memory.main.Memory.search``): ``{"key": value}`` (equality), ``{"key": {op: value}}``
with ``eq, ne, in, nin, gt, gte, lt, lte, contains, icontains``, ``"*"`` (any value), and ``AND`` / ``OR`` /
``NOT`` over lists of filters. Keys are the entity ids, ``created_at`` / ``updated_at`` / ``expiration_date``,
``role``, ``actor_id``, or metadata fields. ``compile_filters`` checks a filter once and returns a predicate
over a memory's fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .policy import check_user

ENTITIES = ("user_id", "agent_id", "run_id")
_TAGS = {"agent_id": "agent", "run_id": "run"}
OPERATORS = ("eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "contains", "icontains")
BUILTIN_FIELDS = frozenset({*ENTITIES, "actor_id", "role", "created_at", "updated_at", "expiration_date", "memory"})
_WHITESPACE = re.compile(r"\s")


class ScopeError(ValueError):
    """A bad entity id, no entity at all, an unknown filter operator or field. Nothing was changed."""


@dataclass(frozen=True)
class Scope:
    """One entity scope: any of user, agent and run, at least one of them."""

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None

    @classmethod
    def of(cls, user_id=None, agent_id=None, run_id=None) -> Scope:
        """Checked ids (strings; integers as Mem0 coerces them; NFC; no whitespace, path or control characters).
        Raises ScopeError for a bad id or none at all."""
        ids = {}
        for name, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
            if value is None:
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            try:
                value = check_user(value.strip() if isinstance(value, str) else value)
            except ValueError as exc:
                raise ScopeError(str(exc).replace("user_id", name, 1)) from None
            if name != "user_id" and _WHITESPACE.search(value):
                raise ScopeError(f"{name} {value[:40]!r} must not contain whitespace")
            ids[name] = value
        if not ids:
            raise ScopeError("at least one of 'user_id', 'agent_id' or 'run_id' must be given")
        return cls(**ids)

    def key(self, namespace: str | None = None) -> str:
        """The store user of this scope (module docstring)."""
        out = (f"{namespace}:" if namespace is not None else "") + (self.user_id or "")
        for name, tag in _TAGS.items():
            if getattr(self, name) is not None:
                out += f"/{tag}:{getattr(self, name)}"
        return out

    def ids(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in ENTITIES if getattr(self, k) is not None}

    def within(self, named: Scope) -> bool:
        """Every entity of this scope is one ``named`` names: what a chat naming ``named`` injects from."""
        return all(getattr(named, k) == v for k, v in self.ids().items())

    def subscopes(self) -> list[Scope]:
        """Every scope made of some of this scope's entities (the scopes a chat naming this one injects)."""
        ids = list(self.ids().items())
        out = []
        for mask in range(1, 1 << len(ids)):
            out.append(Scope(**{k: v for i, (k, v) in enumerate(ids) if mask >> i & 1}))
        return out


def namespace_prefix(namespace: str | None) -> str | None:
    """What every store key of ``namespace``'s scopes starts with (``Scope.key``), or None (no namespace: any
    key): a tenant looks memory ids up within its own keys only."""
    return None if namespace is None else f"{namespace}:"


def parse_key(key: str, namespace: str | None = None) -> Scope | None:
    """The scope a store user names, or None for a key outside ``namespace`` (or not a scope key)."""
    if namespace is not None:
        if not key.startswith(f"{namespace}:"):
            return None
        key = key[len(namespace) + 1 :]
    user, *rest = key.split("/")
    ids: dict[str, str] = {"user_id": user} if user else {}
    for part in rest:
        tag, _, value = part.partition(":")
        name = {"agent": "agent_id", "run": "run_id"}.get(tag)
        if name is None or not value or name in ids:
            return None
        ids[name] = value
    return Scope(**ids) if ids else None


def index_parts(key: str) -> tuple[str, str | None, str | None]:
    """How the store's scope index (``store.schema``, table ``scopes``) files a store user: (head: the key up to
    its first ``/``, i.e. ``[<namespace>:]<user_id>``, or ``<namespace>:`` for a scope without a user; agent id;
    run id). A key that is no scope key is filed under its head alone."""
    head = key.split("/", 1)[0]
    s = parse_key(key)
    return head, (s.agent_id if s else None), (s.run_id if s else None)


@dataclass(frozen=True)
class IndexQuery:
    """What the scope index is asked for a read naming some of a scope's ids in a namespace: an exact ``head``
    (a user id was named) or a head ``prefix`` (the namespace's, or None: any), and the agent and run ids named.
    The rows it returns are candidates: ``parse_key`` decides (``matches``), as it always did."""

    head: str | None
    prefix: str | None
    agent: str | None
    run: str | None

    @classmethod
    def of(cls, named: Scope | None, namespace: str | None) -> IndexQuery:
        """``named``: the ids a read names (None: every scope of ``namespace``)."""
        ns = f"{namespace}:" if namespace is not None else ""
        user = named.user_id if named is not None else None
        return cls(
            head=ns + user if user is not None else None,
            prefix=ns or None if user is None else None,
            agent=named.agent_id if named is not None else None,
            run=named.run_id if named is not None else None,
        )


def matches(key: str, named: Scope | None, namespace: str | None) -> bool:
    """Whether store user ``key`` is a scope of ``namespace`` with every id ``named`` names."""
    s = parse_key(key, namespace)
    return s is not None and (named is None or all(getattr(s, k) == v for k, v in named.ids().items()))


# --- filters ----------------------------------------------------------------------------------------------


def _compare(op: str, have, want) -> bool:
    if op == "eq":
        return have == want
    if op == "ne":
        return have != want
    if op == "in":
        return have in want
    if op == "nin":
        return have not in want
    if have is None:
        return False
    try:
        if op == "gt":
            return have > want
        if op == "gte":
            return have >= want
        if op == "lt":
            return have < want
        if op == "lte":
            return have <= want
    except TypeError:  # a number against a string: no match, as a typed vector store would say
        return False
    if op == "contains":
        return isinstance(have, (str, list)) and want in have
    return isinstance(have, str) and isinstance(want, str) and want.lower() in have.lower()  # icontains


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_operand(key: str, op: str, want) -> None:
    """Operator ``op``'s operand on field ``key``: ``in`` / ``nin`` a list; ``gt`` / ``gte`` / ``lt`` / ``lte``
    a number or a string (ISO dates compare as strings); ``contains`` / ``icontains`` a string; ``eq`` / ``ne``
    any JSON value. Raises ScopeError naming the field, the operator and what it takes."""
    if op not in OPERATORS:
        raise ScopeError(
            f"unsupported filter operator {op!r} on {key!r}; supported: {', '.join(OPERATORS)}, AND, OR, NOT"
        )
    if op in ("in", "nin"):
        ok, takes = isinstance(want, list), "a list"
    elif op in ("gt", "gte", "lt", "lte"):
        ok, takes = _number(want) or isinstance(want, str), "a number or a string"
    elif op in ("contains", "icontains"):
        ok, takes = isinstance(want, str), "a string"
    else:
        ok, takes = True, ""
    if not ok:
        raise ScopeError(f"filter on {key!r}: operator {op!r} takes {takes}, not {type(want).__name__} {want!r:.40}")


def _condition(key: str, cond) -> Callable[[dict], bool]:
    if not isinstance(key, str) or not key:
        raise ScopeError(f"filter keys must be non-empty strings, not {key!r}")
    if cond == "*":
        return lambda m: m.get(key) is not None
    if not isinstance(cond, dict):
        return lambda m: m.get(key) == cond
    if not cond:
        raise ScopeError(f"filter on {key!r} has no operator")
    checks = []
    for op, want in cond.items():
        check_operand(key, op, want)  # before any memory is looked at: a bad operand is the caller's 400
        checks.append((op, want))
    return lambda m: all(_compare(op, m.get(key), want) for op, want in checks)


MAX_FILTER_DEPTH = 32  # AND / OR / NOT nested at most this deep (each level costs the predicate stack frames)


def check_filter_depth(filters) -> None:
    """Raises ScopeError when ``AND`` / ``OR`` / ``NOT`` nest deeper than ``MAX_FILTER_DEPTH`` (checked without
    recursion, so any depth is refused cleanly, never with a RecursionError)."""
    todo = [(filters, 0)]
    while todo:
        f, depth = todo.pop()
        if not isinstance(f, dict):
            continue
        for key, value in f.items():
            if key in ("AND", "OR", "NOT") and isinstance(value, list):
                if depth + 1 > MAX_FILTER_DEPTH:
                    raise ScopeError(f"filters nest AND / OR / NOT more than {MAX_FILTER_DEPTH} levels deep")
                todo += [(v, depth + 1) for v in value]


def compile_filters(filters: dict | None) -> tuple[Callable[[dict], bool], set[str]]:
    """A predicate over a memory's fields (entity ids, builtin fields, metadata keys; a missing field is None)
    and the field names it reads. Every operand is checked here, before any memory is (``check_operand``). Raises
    ScopeError naming the field for an unknown operator, a bad operand, a malformed filter (not an object; ``AND``
    / ``OR`` / ``NOT`` not a non-empty list of objects), or ``AND`` / ``OR`` / ``NOT`` nested deeper than
    ``MAX_FILTER_DEPTH``."""
    check_filter_depth(filters)
    fields: set[str] = set()

    def build(f) -> Callable[[dict], bool]:
        if not isinstance(f, dict):
            raise ScopeError(f"a filter must be an object, not {type(f).__name__}")
        parts = []
        for key, value in f.items():
            if not isinstance(key, str) or not key:
                raise ScopeError(f"filter keys must be non-empty strings, not {key!r}")
            if key in ("AND", "OR", "NOT"):
                if not isinstance(value, list) or not value:
                    raise ScopeError(f"filter {key} takes a non-empty list of filters, not {type(value).__name__}")
                subs = [build(v) for v in value]
                if key == "AND":
                    parts.append(lambda m, s=subs: all(p(m) for p in s))
                elif key == "OR":
                    parts.append(lambda m, s=subs: any(p(m) for p in s))
                else:
                    parts.append(lambda m, s=subs: not any(p(m) for p in s))
            elif key.startswith("$"):
                raise ScopeError(f"unsupported filter key {key!r}; use AND, OR or NOT")
            else:
                fields.add(key)
                parts.append(_condition(key, value))
        return lambda m: all(p(m) for p in parts)

    pred = build(filters or {})
    return pred, fields


def entity_constraints(filters: dict | None) -> dict[str, str]:
    """The plain entity equalities at the top level of ``filters`` (``{"user_id": "u1"}`` or ``{"eq": "u1"}``),
    or inside its top-level ``AND``: what picks the partitions a search reads before the predicate runs on their
    memories. Raises ScopeError when two of them disagree, or for filters nested deeper than
    ``MAX_FILTER_DEPTH``."""
    check_filter_depth(filters)
    if filters is not None and not isinstance(filters, dict):
        raise ScopeError(f"a filter must be an object, not {type(filters).__name__}")
    if not isinstance((filters or {}).get("AND", []), list):
        raise ScopeError(f"filter AND takes a non-empty list of filters, not {type(filters['AND']).__name__}")
    out = {}
    for name in ENTITIES:
        v = (filters or {}).get(name)
        if isinstance(v, dict) and set(v) == {"eq"}:
            v = v["eq"]
        if v is not None and not isinstance(v, dict) and v != "*":
            out[name] = v
    for sub in (filters or {}).get("AND") or []:  # the platform's {"AND": [{"user_id": ...}, ...]}
        if isinstance(sub, dict):
            for name, v in entity_constraints(sub).items():
                if out.setdefault(name, v) != v:
                    raise ScopeError(f"conflicting scopes: {name} is both {out[name]!r} and {v!r}")
    return out
