"""``Memory``: online memory with Mem0's open-source ``Memory`` shapes, over a kvmem store.

Every write (``add``, ``update``, ``delete``, ...) goes through the one write path (``ingest.write_facts``): a
new fact is encoded behind the ``window`` conversation turns before it (context-window encoding, paper §3.2),
embedded, and committed with its KV segment in one store transaction, so the vector index and the KV store never
disagree; the scope's memory version changes on every commit (the vLLM connector's checks and cache salt key on
it). Deletes are tombstones; an update is a delete plus an add that keeps the id; ``compact`` drops dead rows.

The API is mem0ai 2.2.1's ``Memory`` / ``AsyncMemory``: entity scopes (``user_id``, ``agent_id``, ``run_id``;
each combination is one store partition, ``scopes``), Mem0's filters applied before the top-k, its defaults
(``top_k`` 20, ``threshold`` 0.1) and return shapes. ``infer=True`` uses the local answer model (or an
OpenAI-compatible endpoint) with schema-constrained JSON. The README's Mem0 table lists what still differs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections import Counter
from datetime import UTC, date, datetime
from pathlib import Path

from . import grounding, scopes
from .compose import check_text
from .config import config_kwargs
from .extract import DECISIONS_PROMPT, FACTS_PROMPT, Decision, make_extractor
from .ingest import open_or_create_store, write_facts
from .models import DEFAULT_MODEL, LoadedModel, fingerprint, load
from .policy import Encoding, check_user
from .retrieve import Embedder, IndexCache
from .scopes import Scope, ScopeError
from .store import (
    CACHE_BYTES,
    FactRecord,
    Store,
    StoreError,
    UnknownUser,
    check_kv_format,
    check_segments_url,
    is_url,
)

logger = logging.getLogger("kvmem.memory")

MAX_MESSAGE_CHARS = 8000
MAX_MESSAGES = 64
MAX_NAME_CHARS = 64
MAX_CONTEXT_CHARS = 4000  # the encoding window's text, nearest turns kept: one add's cost stays bounded


class MemoryInputError(ValueError):
    """Bad input (unknown memory id, empty or oversized message, malformed message list, bad user_id, empty
    update): nothing is changed. The CLI prints it as one ``error:`` line and exits 2."""


def fact_date(ts: float) -> str:
    """A UNIX time as the date a memory is dated with and the extraction prompt shows ("3 December, 2026", UTC)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%-d %B, %Y")


def check_messages(messages) -> list[dict]:
    """A string or an OpenAI-style list of {role, content} -> checked messages. Raises MemoryInputError."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list) or not messages:
        raise MemoryInputError("messages must be a non-empty string or a list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise MemoryInputError(f"at most {MAX_MESSAGES} messages per add, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("content"), str)
            or not isinstance(m.get("role", "user"), str)
        ):
            raise MemoryInputError(f"message {i} must be an object with a string 'content' (and 'role')")
        for key in ("role", "name"):
            v = m.get(key)
            if v is not None and (not isinstance(v, str) or not v.strip() or len(v) > MAX_NAME_CHARS):
                raise MemoryInputError(
                    f"message {i}: '{key}' must be a non-empty string of at most {MAX_NAME_CHARS} characters"
                )
            if v is not None:
                _text(v, f"message {i} {key}", MAX_NAME_CHARS)
        if not m["content"].strip():
            raise MemoryInputError(f"message {i} is empty")
        text = _text(m["content"], f"message {i}")
        out.append({"role": m.get("role", "user"), "content": text, "name": m.get("name")})
    return out


def check_user_id(user_id) -> str:
    try:
        return check_user(user_id)
    except ValueError as exc:
        raise MemoryInputError(str(exc)) from None


def _text(text, what: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A non-empty, valid-Unicode string of at most ``limit`` characters, stripped. Raises MemoryInputError."""
    if not isinstance(text, str) or not text.strip():
        raise MemoryInputError(f"{what} must be a non-empty string")
    if len(text) > limit:
        raise MemoryInputError(f"{what} has {len(text)} characters; at most {limit}")
    try:
        return check_text(text.strip(), what)
    except ValueError as exc:
        raise MemoryInputError(str(exc)) from None


def _metadata(metadata) -> str:
    """Metadata as JSON: an object of JSON values. Raises MemoryInputError."""
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise MemoryInputError("metadata must be an object")

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from strings(k)
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)

    try:
        for text in strings(metadata):  # a lone surrogate would be stored, then break every read
            check_text(text, "metadata")
        out = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MemoryInputError(f"metadata must hold JSON values only ({exc})") from None
    if len(out) > MAX_MESSAGE_CHARS:
        raise MemoryInputError(f"metadata is {len(out)} characters of JSON; at most {MAX_MESSAGE_CHARS}")
    return out


def _timestamp(timestamp) -> float:
    if timestamp is None:
        return time.time()
    try:
        ts = float(timestamp)
    except (TypeError, ValueError):
        raise MemoryInputError(f"timestamp must be Unix seconds, not {timestamp!r}") from None
    if not 0 <= ts < 32503680000:  # year 3000
        raise MemoryInputError(f"timestamp {timestamp!r} is out of range (Unix seconds)")
    return ts


# cosine scores (all-MiniLM-L6-v2) for acting on a cue without the model: the memory a correction or a request to
# forget is about must be at least this similar (a forget: and name a word the request names); a forget also takes
# runners-up within the margin, or as similar as "sure"
CORRECTION_MIN_SCORE = 0.4
FORGET_MIN_SCORE, FORGET_MARGIN, FORGET_SURE_SCORE = 0.3, 0.03, 0.6
PROMOTED = ("role", "actor_id", "expiration_date")  # stored in a memory's metadata, shown beside it (as Mem0)
IDENTITY = frozenset({"user_id", "agent_id", "run_id", "actor_id"})  # set by the scope, never by metadata
_UNSET = object()


def default_store() -> str | Path:
    """Where ``Memory()`` keeps its store: ``$KVMEM_STORE`` (a directory or a store URL), else
    ``$XDG_DATA_HOME/kvmem/memory`` (``~/.local/share/kvmem/memory``)."""
    env = os.environ.get("KVMEM_STORE")
    if env:
        return env
    return Path(os.environ.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "kvmem" / "memory"


def _user_metadata(metadata) -> dict:
    """The caller's metadata, checked (``_metadata``), without identity keys (a scope is set by ids only)."""
    _metadata(metadata)
    out = {k: v for k, v in (metadata or {}).items() if k not in IDENTITY}
    if len(out) < len(metadata or {}):
        logger.warning("ignoring identity keys in metadata: scopes are set by user_id, agent_id and run_id")
    return out


def _today() -> str:
    return datetime.now(UTC).date().isoformat()


def _expiration(value, past: bool = False) -> str | None:
    """An expiration date as YYYY-MM-DD (a ``date``, ``datetime`` or ISO string), today or later (``past``: or
    earlier, as an imported memory that has expired already)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        value = value.date()
    if isinstance(value, date):
        value = value.isoformat()
    try:
        out = date.fromisoformat(value).isoformat() if isinstance(value, str) else None
    except ValueError:
        out = None
    if out is None:
        raise MemoryInputError(f"expiration_date must be a date in YYYY-MM-DD format, not {value!r}")
    if out < _today() and not past:
        raise MemoryInputError(f"expiration_date {out} is in the past (today is {_today()} UTC)")
    return out


def _actor(message: dict) -> dict:
    return {"actor_id": message["name"]} if message.get("name") else {}


def _times(f: FactRecord) -> dict:
    return {"created_at": _iso(f.created_at), "updated_at": _iso(f.updated_at)}


def _parse_time(value) -> float:
    """An export's ``created_at`` (ISO 8601, naive read as UTC; or Unix seconds) as Unix seconds; now if absent."""
    if value is None:
        return time.time()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _timestamp(value)
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise MemoryInputError(f"created_at {value!r} is not an ISO 8601 time") from None
    return _timestamp((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp())


def _count(value, name: str, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MemoryInputError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _refuse(unsupported: dict, method: str) -> None:
    """Mem0 arguments kvmem does not implement, and unknown ones: one sentence naming them."""
    if not unsupported:
        return
    names = ", ".join(sorted(unsupported))
    raise MemoryInputError(
        f"{method}() does not support {names} (kvmem scores by cosine similarity alone; see the README's Mem0 table)"
    )


class Memory:
    """Mem0's open-source ``Memory`` (mem0ai 2.2.1's ``mem0.memory.main.Memory``) whose facts are also stored as
    the answer model's KV, for KV injection.

    Args:
        store: store directory or URL; created for ``model`` if it does not exist. None: ``default_store()``
            (``$KVMEM_STORE``, else ``~/.local/share/kvmem/memory``).
        model: registry name (default: the store's model, else ``models.DEFAULT_MODEL``) or a ``LoadedModel``.
        extractor: None (the local model), ``{"base_url", "model", "api_key"}`` or an ``extract.Extractor``.
        window: conversation turns encoded before each new fact (context-window encoding).
            ``window``, ``neighbours`` and ``history`` left as None take, for each scope, how that scope's facts
            were encoded so far (``Store.user_info``), and for a new scope the defaults 5, 4 and False (window 0
            and neighbours 0 with ``history=True``).
        neighbours: also encode each new fact behind its m most similar live facts of the scope (neighbour-aware
            encoding, ``ingest.neighbour_prefixes``; default ``policy.DEFAULT_NEIGHBOURS`` = 4, 0 = off). No
            serving cost.
        history: encode each new fact behind every live fact of the scope written before it (history encoding,
            ``ingest.encode_facts``). Not with ``neighbours`` (then default 0). No serving cost. The defaults
            and checks are ``policy.Encoding``'s.
        dtype: compute dtype (None: this machine's; see ``kvmem doctor``).
        engine: a running engine with ``complete_json`` (an ``Engine``, or a synchronous view of an
            ``AsyncEngine``) that the local extractor decodes on; None: the transformers model under xgrammar.
        index_cache_bytes: LRU bound of the per-scope search indexes; ``indexes``: an ``retrieve.IndexCache`` to
            share (the server's), instead of an own one; ``store_cache_bytes``: the store's cache bound;
            ``segments_url``: for a new store, the object store its KV segments go to (``Store.create``).
        custom_instructions: the default ``prompt`` of ``add`` (Mem0's config field of that name).
        kv_format: how a new store keeps KV (``kvformat``: ``native``, the default and lossless; ``int8``; ``fp8``);
            an existing store must already hold it (None: whatever it holds).

    Memories belong to entity scopes (``scopes.Scope``: a ``user_id``, ``agent_id``, ``run_id`` or several).
    Every method takes ``namespace`` too: the tenant whose ids these are (``kvmem serve`` passes it; None for a
    library user). Bad input raises ``MemoryInputError`` and changes nothing.
    """

    def __init__(
        self,
        store: str | Path | None = None,
        model=None,
        extractor=None,
        window: int | None = None,
        embedder=None,
        dtype=None,
        engine=None,
        neighbours: int | None = None,
        history: bool | None = None,
        index_cache_bytes: int = 64 << 20,
        indexes: IndexCache | None = None,
        store_cache_bytes: int = CACHE_BYTES,
        segments_url: str | None = None,
        custom_instructions: str | None = None,
        kv_format: str | None = None,
    ):

        try:  # a new scope's encoding; checked here, before any model loads
            self.encoding = Encoding.of(window, neighbours, history)
        except ValueError as exc:
            raise MemoryInputError(str(exc)) from None
        self._given = (window, neighbours, history)  # None: the scope's recorded encoding (``_encoding``)
        root = default_store() if store is None else store
        if store is None and not is_url(str(root)):
            Path(root).parent.mkdir(parents=True, exist_ok=True)
        self._lm, self._dtype = (model, dtype) if isinstance(model, LoadedModel) else (None, dtype)
        self._embedder = embedder
        if Store.exists(root):  # reads need no model: it loads on the first write
            self.store = Store.open(root, cache_bytes=store_cache_bytes)
            check_segments_url(self.store, segments_url)
            check_kv_format(self.store, kv_format)
            self._model_name = model if isinstance(model, str) else self.store.fingerprint["model"]
        else:
            self._model_name = model if isinstance(model, str) else DEFAULT_MODEL
            if self._lm is None:
                self._lm = load(self._model_name, dtype=dtype)
            self.store, _ = open_or_create_store(
                root, self._lm, self.embedder, store_cache_bytes, segments_url, kv_format
            )
        self._extractor_spec, self._extractor, self.engine = extractor, None, engine
        self.indexes = indexes if indexes is not None else IndexCache(index_cache_bytes)
        self.custom_instructions = custom_instructions
        self._fields: dict[tuple, tuple] = {}  # (scope key, version, namespace) -> each fact's filter fields
        self.extraction_counts: Counter = Counter()  # infer=True adds: facts extracted / rejected, empty adds, ...

    @property
    def embedder(self):
        """The retrieval embedder (loaded on first use: get, delete and history need none)."""
        if self._embedder is None:
            self._embedder = Embedder()
        return self._embedder

    @property
    def lm(self):
        """The answer model (loaded on first use); the store must have been built by it."""
        if self._lm is None:
            dtype = self._dtype
            if dtype in (None, "auto"):  # an existing store's KV fixes the dtype new facts must be encoded in
                dtype = self.store.fingerprint.get("dtype") or dtype
            self._lm = load(self._model_name, dtype=dtype)
            Store.open(self.store.root, fingerprint(self._lm)).close()  # raises StoreMismatch
        return self._lm

    @classmethod
    def from_config(cls, config: dict) -> Memory:
        """A Memory from Mem0's config shape (``vector_store`` / ``llm`` / ``embedder`` / ...) or kvmem's own
        (``store``, ``model``, ``window``, ``neighbours``, ``history``, ``extractor``, ``dtype``, ``segments_url``,
        ``kv_format``).
        ``config.from_mem0_config`` says what maps to what; anything else is refused by name."""
        try:
            return cls(**config_kwargs(config))
        except ValueError as exc:
            if isinstance(exc, MemoryInputError):
                raise
            raise MemoryInputError(str(exc)) from None

    def close(self) -> None:
        """Release the store (Mem0's ``close``); the object is not usable afterwards."""
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def chat(self, query):
        raise NotImplementedError("use kvmem serve's chat completions, which inject memory as KV")

    # --- scopes and filters ---------------------------------------------------------------------------------

    def _scope(self, user_id=None, agent_id=None, run_id=None) -> Scope:
        try:
            return Scope.of(user_id, agent_id, run_id)
        except ScopeError as exc:
            raise MemoryInputError(str(exc)) from None

    def _read_scopes(self, filters, ids: dict, namespace) -> tuple[list[str], dict]:
        """The store users a read of ``filters`` (plus top-level entity ids ``ids``) covers, and the checked
        filters. Raises MemoryInputError for conflicting ids, no entity id, or a malformed filter."""
        if filters is not None and not isinstance(filters, dict):
            raise MemoryInputError("filters must be an object")
        filters = dict(filters or {})
        try:
            for name, value in ids.items():
                if value is None:
                    continue
                have = scopes.entity_constraints(filters).get(name)
                if name in filters and have is None or have is not None and str(have) != str(value):
                    raise MemoryInputError(f"conflicting scopes: {name}={value!r} and filters say {have!r}")
                filters[name] = value
            want = scopes.entity_constraints(filters)
        except ScopeError as exc:
            raise MemoryInputError(str(exc)) from None
        if not want:
            raise MemoryInputError(
                "filters must contain at least one of: user_id, agent_id, run_id (e.g. filters={'user_id': 'u1'})"
            )
        named = self._scope(**want)
        for name in want:
            filters[name] = getattr(named, name)
        if len(want) == 3:
            return [named.key(namespace)], filters
        found = []
        for key in self.store.users(with_no_live_facts=True):
            s = scopes.parse_key(key, namespace)
            if s is not None and all(getattr(s, k) == v for k, v in named.ids().items()):
                found.append(key)
        return found, filters

    def _snapshot(self, users: list[str]):
        """Rows and embeddings of the current version of ``users``' memories, read as one (no KV: reads never
        need it), or None when none has live memories."""
        try:
            return self.store.snapshots([(u, None) for u in users]) if users else None
        except UnknownUser:
            return None

    def _fields_of(self, ukv, namespace) -> tuple[list[dict], set[str]]:
        """Each fact's filterable fields (entity ids, builtin fields, metadata) and every field name any of them
        has, cached per scope version."""
        out, names = [], set(scopes.BUILTIN_FIELDS)
        for part in ukv.parts or (ukv,):
            key = (part.user, part.version, namespace)
            got = self._fields.get(key)
            if got is None:
                s = scopes.parse_key(part.user, namespace) or Scope(user_id=part.user)
                rows = [
                    {**json.loads(f.metadata or "{}"), **s.ids(), "memory": f.text, **_times(f)} for f in part.facts
                ]
                got = (rows, set().union(*(r.keys() for r in rows)))
                if len(self._fields) > 256:
                    self._fields.clear()
                self._fields[key] = got
            out += got[0]
            names |= got[1]
        return out, names

    def _selected(self, ukv, filters: dict, show_expired: bool, namespace) -> set[int] | None:
        """Store row ids of ``ukv``'s facts that pass ``filters`` (and are not expired, unless ``show_expired``),
        or None when every fact does. Raises MemoryInputError for an unknown operator or field."""
        try:
            pred, used = scopes.compile_filters(filters)
        except ScopeError as exc:
            raise MemoryInputError(str(exc)) from None
        if all(k in scopes.ENTITIES and not isinstance(v, dict) and v != "*" for k, v in filters.items()):
            # the scopes were picked by exactly these ids: only expiry is left to check
            return None if show_expired else ukv.unexpired(_today())
        fields, known = self._fields_of(ukv, namespace)
        unknown = sorted(used - known)
        if unknown:
            raise MemoryInputError(f"filter on {unknown[0]!r}: no memory in this scope has that field")
        keep = {f.row for f, x in zip(ukv.facts, fields) if pred(x)}
        live = None if show_expired else ukv.unexpired(_today())
        if live is not None:
            keep &= live
        return None if len(keep) == len(ukv.facts) else keep

    def _read(self, filters, ids: dict, show_expired: bool, namespace):
        """What a read of ``filters`` (and top-level ``ids``) sees: the scopes' memories as one snapshot (None if
        none has any) and the store rows the filters and expiry let through (None: all). Raises
        MemoryInputError."""
        users, filters = self._read_scopes(filters, ids, namespace)
        ukv = self._snapshot(users)
        return ukv, (None if ukv is None else self._selected(ukv, filters, show_expired, namespace))

    def _item(self, f: FactRecord, namespace=None, score: float | None = None) -> dict:
        """Mem0's memory item (``MemoryItem`` plus the promoted entity ids, role and expiration date)."""
        meta = json.loads(f.metadata or "{}")
        s = scopes.parse_key(f.user, namespace) or Scope(user_id=f.user)
        out = {
            "id": f.fact_id,
            "memory": f.text,
            "hash": hashlib.md5(f.text.encode()).hexdigest(),
            "metadata": {k: v for k, v in meta.items() if k not in PROMOTED} or None,
            "created_at": _iso(f.created_at),
            "updated_at": _iso(f.updated_at),
            **s.ids(),
            **{k: meta[k] for k in PROMOTED if k in meta},
        }
        if score is not None:
            out["score"] = round(float(score), 6)
        return out

    # --- reads ----------------------------------------------------------------------------------------------

    def search(
        self,
        query: str,
        user_id: str | None = None,
        *,
        top_k: int | None = None,
        filters: dict | None = None,
        threshold: float | None = 0.1,
        rerank: bool = False,
        show_expired: bool = False,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        namespace: str | None = None,
        **unsupported,
    ) -> dict:
        """The ``top_k`` (default 20) memories most similar to ``query`` among those ``filters`` select, with a
        cosine score of at least ``threshold`` (default 0.1; None: any): ``{"results": [{id, memory, hash,
        metadata, score, created_at, updated_at, user_id?, agent_id?, run_id?, ...}]}``, best first.

        ``filters``: Mem0's (``scopes`` module docstring), with at least one entity id; it is applied before the
        top-k (FAISS ``IDSelectorBatch``), so ``top_k`` results come back whenever that many match. Top-level
        ``user_id`` / ``agent_id`` / ``run_id`` and ``limit`` (for ``top_k``) are kvmem's older spelling.
        Expired memories are left out unless ``show_expired``. Raises MemoryInputError."""
        _refuse(unsupported, "search")
        if rerank:
            raise MemoryInputError("rerank is not supported by kvmem (no reranker ships offline); search without it")
        query = _text(query, "query")
        top_k = _count(top_k if top_k is not None else limit, "top_k", 20)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise MemoryInputError(f"threshold must be a number between 0 and 1, got {threshold!r}")
        if threshold is not None and not 0 <= threshold <= 1:
            raise MemoryInputError(f"Invalid threshold: {threshold}. Must be between 0 and 1 (inclusive).")
        ukv, allowed = self._read(filters, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id},
                                  show_expired, namespace)  # fmt: skip
        if ukv is None or top_k == 0:
            return {"results": []}
        scores, rows = self.indexes.search(self.store, ukv, self.embedder.embed([query])[0], top_k, allowed)
        return {
            "results": [
                self._item(ukv.facts[r], namespace, s)
                for r, s in zip(rows, scores)
                if threshold is None or float(s) >= threshold
            ]
        }

    def _fact(self, memory_id) -> FactRecord | None:
        try:
            return self.store.fact(str(memory_id))
        except LookupError as exc:
            raise MemoryInputError(str(exc)) from None

    def get(self, memory_id: str, namespace: str | None = None) -> dict | None:
        """One memory by id (Mem0's item, ``score`` None), or None."""
        f = self._fact(memory_id)
        return None if f is None else {**self._item(f, namespace), "score": None}

    def get_all(
        self,
        user_id: str | None = None,
        *,
        filters: dict | None = None,
        top_k: int | None = None,
        show_expired: bool = False,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        namespace: str | None = None,
        **unsupported,
    ) -> dict:
        """``{"results": [...]}``: up to ``top_k`` (default 20) live memories that ``filters`` select, oldest
        first (filters and the older top-level ids as in ``search``). Raises MemoryInputError."""
        _refuse(unsupported, "get_all")
        top_k = _count(top_k if top_k is not None else limit, "top_k", 20)
        ukv, allowed = self._read(filters, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id},
                                  show_expired, namespace)  # fmt: skip
        if ukv is None:
            return {"results": []}
        facts = [f for f in ukv.facts if allowed is None or f.row in allowed]
        facts.sort(key=lambda f: (f.created_at, f.row))
        return {"results": [self._item(f, namespace) for f in facts[:top_k]]}

    def history(self, memory_id: str, namespace: str | None = None) -> list[dict]:
        """Every event of a memory, oldest first (Mem0's history rows: id, memory_id, old_memory, new_memory,
        event, created_at, updated_at, is_deleted, actor_id, role; plus the store's user_id). Raises
        MemoryInputError for an id that never existed."""
        events = self.store.history(str(memory_id))
        if not events:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        if len({e["user_id"] for e in events}) > 1:
            raise MemoryInputError(f"memory id {memory_id!r} belongs to several scopes")
        for e in events:
            e["created_at"] = e["updated_at"] = _iso(e["created_at"])
            e.update(is_deleted=e["event"] == "DELETE", actor_id=None, role=None)
        return events

    # --- writes ---------------------------------------------------------------------------------------------

    def _encoding(self, user: str) -> tuple[int, int, bool]:
        """(window, neighbours, history) of a write to ``user`` (a scope key): what the constructor was given,
        else how the scope's facts were encoded so far (``Store.user_info``), else the defaults (5, 4, False; 0,
        0 with history), so one scope's facts keep one encoding across processes. A given ``history`` that
        switches the scope's method takes that method's defaults for what is not given."""
        try:
            info = self.store.user_info(user)
        except StoreError:  # a new scope (or one whose every fact was deleted)
            info = None
        w, m, h = self._given
        recorded = bool(info and info.get("history"))
        if h is None:  # explicit neighbours turn a history scope's method off
            h = (recorded and not m) if info is not None else self.encoding.history
        if info is not None and h == recorded:  # the scope's window and neighbours go with its method
            w = info["window"] if w is None else w
            m = info["neighbours"] if m is None else m
        # otherwise h is the constructor's method, whose defaults these are
        return self.encoding.window if w is None else w, self.encoding.neighbours if m is None else m, h

    def encoding_context(self, user: str, new_turns: list[dict], upto: int) -> str:
        """The ``window`` turns before new turn ``upto`` (stored turns, then this add's), rendered like LoCoMo's."""
        window = self._encoding(user)[0]
        if window == 0:
            return ""
        turns = self.store.turns(user, last=window) + new_turns[:upto]
        text = "".join(f"{t.get('speaker') or 'user'}: {t['content']}\n" for t in turns[-window:])
        return text[-MAX_CONTEXT_CHARS:]

    def _write(
        self,
        user: str,
        new: list[tuple[str, str | None, dict]],
        delete: list[str],
        turns: list[dict],
        contexts: list[str],
        events: list[tuple],
        now: float,
        created: dict[str, float] | None = None,
        dated: bool = False,
    ) -> tuple[str, list[FactRecord]]:
        """new: (text, fact id or None for a fresh uuid, metadata); ``created``: kept creation times of updated ids
        (``dated``: also each fact's date, as for imported memories; else the date is now's)."""

        window, neighbours, history = self._encoding(user)
        created = created or {}
        records = [
            FactRecord(
                fid or str(uuid.uuid4()),
                user,
                text,
                "",
                "",
                fact_date(created.get(fid, now) if dated else now),
                (),
                0,
                window,
                metadata=_metadata(meta),
                created_at=created.get(fid, now),
            )
            for text, fid, meta in new
        ]
        rendered = [f"- [{r.date}] {r.text}\n" for r in records]
        version, _ = write_facts(
            self.lm,
            self.embedder,
            self.store,
            user,
            records,
            contexts,
            rendered,
            delete=delete,
            turns=turns,
            events=events,
            now=now,
            encoding=Encoding(window, neighbours, history),
        )
        return version, records

    def add(
        self,
        messages,
        user_id: str | None = None,
        *,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: dict | None = None,
        timestamp: float | None = None,
        expiration_date=None,
        infer: bool = True,
        memory_type: str | None = None,
        prompt: str | None = None,
        namespace: str | None = None,
    ) -> dict:
        """Remember ``messages`` (a string, a {role, content} object or a list of them) in the scope of
        ``user_id`` / ``agent_id`` / ``run_id`` (at least one).

        ``infer=False``: each non-system message becomes one memory, verbatim (its ``role`` kept). ``infer=True``
        (the default): the extractor turns them into facts (``prompt``, else ``custom_instructions``, replaces
        its instructions) and reconciles each with the most similar memories of the scope (ADD / UPDATE /
        DELETE / NONE). ``expiration_date`` (YYYY-MM-DD, today or later): afterwards the memory is neither
        searched nor injected. ``timestamp`` (Unix seconds; kvmem's extra): when it was said. The raw
        messages are stored as the scope's turns (the context of later facts). Returns ``{"results": [{"id",
        "memory", "event", "previous_memory"?}]}``. Raises MemoryInputError for bad input (procedural memory
        included: kvmem stores facts, not agent procedures)."""
        scope = self._scope(user_id, agent_id, run_id)
        user = scope.key(namespace)
        if memory_type is not None:
            raise MemoryInputError(
                f"memory_type {memory_type!r} is not supported: kvmem stores facts (procedural memory, an agent's "
                "summarised run, is not kept); add without memory_type"
            )
        msgs = check_messages(messages)
        meta = _user_metadata(metadata)
        exp = _expiration(expiration_date)
        if exp is not None:
            meta["expiration_date"] = exp
        now = _timestamp(timestamp)
        if prompt is not None:
            prompt = _text(prompt, "prompt")
        turns = [{"speaker": m.get("name") or m["role"], "content": m["content"], "time": now} for m in msgs]
        if not infer:
            kept = [(i, m) for i, m in enumerate(msgs) if m["role"] != "system"]  # as Mem0: never a memory
            new = [(m["content"], None, {**meta, "role": m["role"]} | _actor(m)) for _, m in kept]
            contexts = [self.encoding_context(user, turns, i) for i, _ in kept]
            if not new:
                self.store.commit(user, turns=turns, window=self._encoding(user)[0], now=now)
                return {"results": []}
            _, records = self._write(user, new, [], turns, contexts, [], now)
            return {"results": [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in records]}
        return self._infer(user, msgs, turns, meta, now, prompt or self.custom_instructions)

    @property
    def extractor(self):
        """The fact extractor (``extract.Extractor``), made on first use from the ``extractor`` argument; may be
        replaced."""

        if self._extractor is None:
            self._extractor = make_extractor(self._extractor_spec, self.lm, self.engine)
        return self._extractor

    @extractor.setter
    def extractor(self, extractor) -> None:
        self._extractor = extractor

    def _similar(self, ukv, text: str, k: int) -> list[tuple[float, FactRecord]]:
        """The ``k`` live memories of ``ukv`` most similar to ``text``: (cosine score, fact), best first."""
        if ukv is None:
            return []
        scores, rows = self.indexes.search(self.store, ukv, self.embedder.embed([text])[0], k, ukv.unexpired(_today()))
        return [(float(s), ukv.facts[r]) for s, r in zip(scores, rows)]

    def _infer(self, user, msgs, turns, metadata, now, prompt=None) -> dict:
        """``add(infer=True)``: extract, check, reconcile, then one commit. What the model returns is checked on
        the output (``grounding``): a fact whose words are not the user's own is dropped; an explicit request to
        forget deletes the memory it is about; a correction turns the ADD of the corrected fact into an UPDATE of
        the memory it corrects. The result says when nothing was extracted or kept (``message``)."""
        kept = []  # the messages without their requests to forget: such a request is no fact to remember
        forgets = []
        for m in msgs:
            parts = grounding.sentences(m["content"]) if m["role"] == "user" else [m["content"]]
            forgets += [p for p in parts if m["role"] == "user" and grounding.forget_request(p)]
            rest = " ".join(p for p in parts if p not in forgets)
            if rest:
                kept.append({**m, "content": rest})
        sources = [m["content"] for m in kept if m["role"] == "user"]
        shown = kept
        found = self.extractor.facts(shown, fact_date(now), prompt) if sources else []
        others = [m["content"] for m in msgs if m["role"] != "user"]
        prompts = [FACTS_PROMPT, DECISIONS_PROMPT, prompt or "", fact_date(now)]
        facts = [
            f
            for f in {_norm(f): f for f in found}.values()
            if grounding.grounded(f, sources, others, prompts) and not grounding.chatter(f)
        ]
        rejected = len({_norm(f) for f in found}) - len(facts)
        if rejected:
            logger.info("extractor: %d facts not in the user's messages were dropped", rejected)
        ukv = self._snapshot([user])
        existing: dict[str, str] = {}
        for f in facts:  # the most similar existing memories of each new fact
            for _, fact in self._similar(ukv, f, 5):
                existing[fact.fact_id] = fact.text
        decisions = self.extractor.reconcile(facts, list(existing.items())) if facts else []
        # a correction: the memory its sentence is about is replaced by the corrected fact (the model's ADD of it,
        # else a fact it extracted, else the user's own sentence), also where the model deleted it or did nothing
        updated = {d.target for d in decisions if d.event == "UPDATE"}
        for c in [p for t in sources for p in grounding.sentences(t) if grounding.correction(p)]:
            best = self._similar(ukv, c, 1)
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
            self.extraction_counts["corrections"] += 1
        for t in forgets:  # what an explicit request to forget is about, if the model did not delete it
            about = grounding.topic(t)
            hits = self._similar(ukv, about, 3)
            best = hits[0][0] if hits else 0.0
            for score, fact in hits:
                close = score >= best - FORGET_MARGIN or score >= FORGET_SURE_SCORE
                if score >= FORGET_MIN_SCORE and close and grounding.shares_words(about, fact.text):
                    existing[fact.fact_id] = fact.text
                    decisions = [d for d in decisions if d.target != fact.fact_id]
                    decisions.append(Decision("DELETE", fact.text, fact.fact_id))
                    self.extraction_counts["forgotten"] += 1
        context = self.encoding_context(user, turns, len(turns) - 1)
        new, delete, events, results = [], [], [], []
        known = {_norm(t) for t in existing.values()}
        for d in decisions:
            if d.target is not None and (d.target in delete or any(n[1] == d.target for n in new)):
                continue  # one decision per memory per add
            if d.event in ("ADD", "UPDATE") and not grounding.grounded(
                d.text, sources + ([existing[d.target]] if d.event == "UPDATE" else []), others, prompts
            ):
                logger.info("extractor: %s %r is not in the user's messages: dropped", d.event, d.text)
                rejected += 1
                continue
            if d.event == "ADD" and _norm(d.text) in known | {_norm(n[0]) for n in new}:
                logger.info("extractor: %r is already known: NONE", d.text)
                continue
            if d.event == "ADD":
                new.append((d.text, None, metadata))
            elif d.event == "UPDATE":
                new.append((d.text, d.target, metadata))
                delete.append(d.target)
                events.append((d.target, "UPDATE", existing[d.target], d.text))
                results.append(
                    {"id": d.target, "memory": d.text, "event": "UPDATE", "previous_memory": existing[d.target]}
                )
            elif d.event == "DELETE":
                delete.append(d.target)
                results.append({"id": d.target, "memory": existing[d.target], "event": "DELETE"})
            else:
                logger.info("extractor: NONE for %r", d.text)
        self.extraction_counts["adds"] += 1
        self.extraction_counts["facts_extracted"] += len({_norm(f) for f in found})
        self.extraction_counts["facts_rejected"] += rejected
        if new or delete:
            created = {t: f.created_at for t in delete if (f := self.store.fact(t, user)) is not None}
            _, records = self._write(user, new, delete, turns, [context] * len(new), events, now, created)
            added = [r for r, n in zip(records, new) if n[1] is None]
            results = [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in added] + results
        else:  # nothing to remember: the turns are still the context of later facts
            self.store.commit(user, turns=turns, window=self._encoding(user)[0], now=now)
        out: dict = {"results": results}
        if not results:
            self.extraction_counts["empty"] += 1
            why = f"{rejected} extracted facts were not in the user's messages" if rejected else "no facts found"
            out["message"] = f"nothing remembered: {why}"
        return out

    def update(
        self,
        memory_id: str,
        text: str | None = None,
        metadata: dict | None = None,
        expiration_date=_UNSET,
        data: str | None = None,
        namespace: str | None = None,
    ) -> dict:
        """Replace a memory's text (re-encoded behind the turns before now) and/or merge ``metadata`` into its
        metadata, and/or set or clear (None) its ``expiration_date``; keeps its id, scope and creation time.
        ``data``: Mem0's older name for ``text``. Raises MemoryInputError."""
        text = data if text is None else text
        if text is None and metadata is None and expiration_date is _UNSET:
            raise MemoryInputError("At least one of text, metadata, or expiration_date must be provided.")
        text = None if text is None else _text(text, "update text")
        f = self._fact(memory_id)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        meta = json.loads(f.metadata or "{}")
        meta.update(_user_metadata(metadata))
        if expiration_date is not _UNSET:
            meta.pop("expiration_date", None)
            if expiration_date is not None:
                meta["expiration_date"] = _expiration(expiration_date)
        new_text = f.text if text is None else text
        now = time.time()
        try:
            self._write(
                f.user,
                [(new_text, f.fact_id, meta)],
                [f.fact_id],
                [],
                [self.encoding_context(f.user, [], 0)],
                [(f.fact_id, "UPDATE", f.text, new_text)],
                now,
                {f.fact_id: f.created_at},
            )
        except StoreError as exc:  # deleted concurrently
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory updated successfully!"}

    def delete(self, memory_id: str, namespace: str | None = None) -> dict:
        """Tombstone one memory: it is never retrieved or injected again. Raises MemoryInputError if unknown."""
        f = self._fact(memory_id)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        try:
            self.store.commit(f.user, delete=[f.fact_id], window=self._encoding(f.user)[0])
        except StoreError as exc:  # a concurrent delete of the same id won the race
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory deleted successfully!"}

    def delete_all(
        self,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        namespace: str | None = None,
    ) -> dict:
        """Delete every memory whose scope has all the given ids (``delete_all(user_id="u")`` also deletes u's
        memories with an agent or run), each scope in one commit. Raises MemoryInputError without any id."""
        if user_id is None and agent_id is None and run_id is None:
            raise MemoryInputError(
                "At least one filter is required to delete all memories. If you want to delete all memories, "
                "use the `reset()` method."
            )
        users, _ = self._read_scopes(None, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}, namespace)
        for user in users:
            self.store.delete_user(user)  # what is live when the commit runs
        return {"message": "Memories deleted successfully!"}

    def import_memories(self, export, namespace: str | None = None) -> dict:
        """Write memories exported from Mem0 (what ``MemoryClient.get_all`` or the OSS ``get_all`` returns: a
        ``{"results": [...]}`` page or a list of items) verbatim, keeping their ids, scopes, metadata, role,
        expiration date and creation times; each scope's memories are encoded and committed at once, in creation
        order. Every record is checked first: a malformed one (by index), an id already live here or repeated,
        and nothing is written. Returns ``{"count": n, "scopes": {"user_id=alice": 3, ...}}``."""
        records = export.get("results") if isinstance(export, dict) else export
        if not isinstance(records, list) or not records:
            raise MemoryInputError("an export is a non-empty list of memories, or an object with 'results'")
        by_scope: dict[str, list] = {}
        errors, seen = [], set()
        for i, rec in enumerate(records):
            try:
                if not isinstance(rec, dict):
                    raise MemoryInputError("is not an object")
                scope = self._scope(rec.get("user_id"), rec.get("agent_id"), rec.get("run_id"))
                text = _text(rec.get("memory"), "'memory'")
                fid = rec.get("id") or str(uuid.uuid4())
                if not isinstance(fid, str) or fid in seen:
                    raise MemoryInputError(f"id {fid!r} is not a string or appears twice")
                seen.add(fid)
                if self._fact(fid) is not None:
                    raise MemoryInputError(f"memory {fid!r} already exists")
                meta = _user_metadata(rec.get("metadata"))
                for key in ("role", "actor_id", "categories"):
                    if rec.get(key) is not None:
                        meta[key] = rec[key]
                if rec.get("expiration_date") is not None:
                    meta["expiration_date"] = _expiration(rec["expiration_date"], past=True)
                created = _parse_time(rec.get("created_at"))
                by_scope.setdefault(scope.key(namespace), []).append((created, text, fid, meta))
            except MemoryInputError as exc:
                errors.append(f"record {i}: {exc}")
        if errors:
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise MemoryInputError("nothing imported: " + "; ".join(errors[:5]) + more)
        counts = {}
        for user, items in by_scope.items():
            items.sort(key=lambda x: x[0])
            new = [(text, fid, meta) for _, text, fid, meta in items]
            contexts = [self.encoding_context(user, [], 0)] * len(new)
            self._write(user, new, [], [], contexts, [], time.time(), {fid: t for t, _, fid, _ in items}, True)
            label = "&".join(f"{k}={v}" for k, v in scopes.parse_key(user, namespace).ids().items())
            counts[label] = len(new)
        return {"count": sum(counts.values()), "scopes": counts}

    def compact(self, user_id: str | None = None, agent_id=None, run_id=None, namespace: str | None = None) -> dict:
        """Rewrite one scope's KV segments without dead rows; what search and get_all return is unchanged."""
        user = self._scope(user_id, agent_id, run_id).key(namespace)
        if self._snapshot([user]) is None:
            return {"message": "nothing to compact"}
        return {"message": "Memory compacted", "version": self.store.compact(user)}

    def reset(self) -> None:
        """Delete every memory, turn and history row of the store (the model and header stay)."""
        self.store.reset()
        self.indexes.clear()
        self._fields.clear()


class AsyncMemory:
    """Mem0's ``AsyncMemory``: ``Memory``'s methods as coroutines, each run in a worker thread
    (``asyncio.to_thread``), over one ``Memory`` (whose store serializes its own access)."""

    def __init__(self, *args, **kwargs):
        self.sync = kwargs.pop("memory", None) or Memory(*args, **kwargs)

    @classmethod
    def from_config(cls, config: dict) -> AsyncMemory:
        return cls(memory=Memory.from_config(config))

    def __getattr__(self, name):
        attr = getattr(self.sync, name)
        if name.startswith("_") or not callable(attr) or name in ("close", "chat"):
            return attr

        async def call(*args, **kwargs):
            return await asyncio.to_thread(attr, *args, **kwargs)

        call.__name__, call.__doc__ = name, attr.__doc__
        return call

    async def __aenter__(self) -> AsyncMemory:
        return self

    async def __aexit__(self, *exc) -> bool:
        self.sync.close()
        return False


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()
