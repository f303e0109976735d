"""``Memory``: online memory with Mem0's open-source ``Memory`` shapes, over a kvmem store.

Every write (``add``, ``update``, ``delete``, ...) goes through the one write path (``ingest.write_facts``): a
new fact is encoded behind the ``window`` conversation turns before it (context-window encoding, paper §3.2),
embedded, and committed with its KV segment in one store transaction, so the vector index and the KV store never
disagree; the user's memory version changes on every commit (the vLLM connector's checks and cache salt key on
it). Deletes are tombstones; an update is a delete plus an add that keeps the id; ``compact`` drops dead rows.

Where kvmem differs from Mem0: memories belong to a ``user_id`` (no agent_id/run_id); ``infer=True`` uses the
local answer model (or an OpenAI-compatible endpoint) with schema-constrained JSON; ``add`` with ``infer=False``
stores each message as one fact, as Mem0 does.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from .compose import check_text
from .extract import make_extractor
from .ingest import open_or_create_store, write_facts
from .models import DEFAULT_MODEL, LoadedModel, fingerprint, load
from .policy import Encoding, check_user
from .retrieve import Embedder, IndexCache
from .store import CACHE_BYTES, FactRecord, Store, StoreError, check_segments_url

logger = logging.getLogger("kvmem.memory")

MAX_MESSAGE_CHARS = 8000
MAX_MESSAGES = 64
MAX_NAME_CHARS = 64
MAX_CONTEXT_CHARS = 4000  # the encoding window's text, nearest turns kept: one add's cost stays bounded


class MemoryInputError(ValueError):
    """Bad input (unknown memory id, empty or oversized message, malformed message list, bad user_id, empty
    update): nothing is changed. The CLI prints it as one ``error:`` line and exits 2."""


def _date(ts: float) -> str:
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


class Memory:
    """Mem0-compatible memory whose facts are also stored as the answer model's KV (for KV injection).

    Args:
        store: store directory; created for ``model`` if it does not exist.
        model: registry name (default: the store's model, else ``models.DEFAULT_MODEL``) or a ``LoadedModel``.
        extractor: None (the local model), ``{"base_url", "model", "api_key"}`` or an ``extract.Extractor``.
        window: conversation turns encoded before each new fact (context-window encoding).
            ``window``, ``neighbours`` and ``history`` left as None take, for each user, how that user's facts
            were encoded so far (``Store.user_info``), and for a new user the defaults 5, 4 and False (window 0
            and neighbours 0 with ``history=True``).
        neighbours: also encode each new fact behind its m most similar live facts of the user (neighbour-aware
            encoding, ``ingest.neighbour_prefixes``; default ``policy.DEFAULT_NEIGHBOURS`` = 4, 0 = off). No
            serving cost.
        history: encode each new fact behind every live fact of the user written before it (history encoding,
            ``ingest.encode_facts``). Not with ``neighbours`` (then default 0). No serving cost. The defaults
            and checks are ``policy.Encoding``'s.
        dtype: compute dtype (None: this machine's; see ``kvmem doctor``).
        engine: a running engine with ``complete_json`` (an ``Engine``, or a synchronous view of an
            ``AsyncEngine``) that the local extractor decodes on; None: the transformers model under xgrammar.
        index_cache_bytes: LRU bound of the per-user search indexes; ``indexes``: an ``retrieve.IndexCache`` to
            share (the server's), instead of an own one; ``store_cache_bytes``: the store's cache bound;
            ``segments_url``: for a new store, the object store its KV segments go to (``Store.create``).
    """

    def __init__(
        self,
        store: str | Path,
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
    ):

        try:  # a new user's encoding; checked here, before any model loads
            self.encoding = Encoding.of(window, neighbours, history)
        except ValueError as exc:
            raise MemoryInputError(str(exc)) from None
        self._given = (window, neighbours, history)  # None: the user's recorded encoding (``_encoding``)
        root = store
        self._lm, self._dtype = (model, dtype) if isinstance(model, LoadedModel) else (None, dtype)
        self._embedder = embedder
        if Store.exists(root):  # reads need no model: it loads on the first write
            self.store = Store.open(root, cache_bytes=store_cache_bytes)
            check_segments_url(self.store, segments_url)
            self._model_name = model if isinstance(model, str) else self.store.fingerprint["model"]
        else:
            self._model_name = model if isinstance(model, str) else DEFAULT_MODEL
            if self._lm is None:
                self._lm = load(self._model_name, dtype=dtype)
            self.store, _ = open_or_create_store(root, self._lm, self.embedder, store_cache_bytes, segments_url)
        self._extractor_spec, self._extractor, self.engine = extractor, None, engine
        self.indexes = indexes if indexes is not None else IndexCache(index_cache_bytes)

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
        """``{"store": DIR, "model": NAME, "window": 5, "neighbours": 4, "history": False, "extractor": {...},
        "dtype": ...}``."""
        if not isinstance(config, dict) or "store" not in config:
            raise MemoryInputError("config must be a dict with at least 'store'")
        unknown = set(config) - {"store", "model", "window", "neighbours", "history", "extractor", "dtype"}
        if unknown:
            raise MemoryInputError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(
            config["store"],
            config.get("model"),
            config.get("extractor"),
            config.get("window"),
            dtype=config.get("dtype"),
            neighbours=config.get("neighbours"),
            history=config.get("history"),
        )

    # --- reads ----------------------------------------------------------------------------------------------

    def _item(self, f: FactRecord, score: float | None = None) -> dict:
        out = {
            "id": f.fact_id,
            "memory": f.text,
            "user_id": f.user,
            "metadata": json.loads(f.metadata or "{}"),
            "created_at": _iso(f.created_at),
            "updated_at": _iso(f.updated_at),
        }
        if score is not None:
            out["score"] = round(float(score), 6)
        return out

    def _snapshot(self, user: str):
        """Rows and embeddings of the user's current version (no KV: reads never need it), or None."""
        if not self.store.version(user):
            return None
        try:
            return self.store.snapshot(user)
        except StoreError:  # every fact deleted
            return None

    def _search(self, user: str, query: str, limit: int):
        ukv = self._snapshot(user)
        if ukv is None:
            return None, [], []
        scores, rows = self.indexes.search(self.store, ukv, self.embedder.embed([query])[0], limit)
        return ukv, list(rows), list(scores)

    def search(self, query: str, user_id: str, limit: int = 100, filters: dict | None = None) -> dict:
        """The ``limit`` memories most similar to ``query``: ``{"results": [{id, memory, score, metadata,
        created_at, updated_at, user_id}]}``, best first. ``filters``: metadata key -> required value."""
        user = check_user_id(user_id)
        query = _text(query, "query")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise MemoryInputError(f"limit must be a positive integer, got {limit!r}")
        if filters is not None and not isinstance(filters, dict):
            raise MemoryInputError("filters must be an object of metadata key -> value")
        ukv, rows, scores = self._search(user, query, limit if not filters else max(limit * 4, 100))
        out = [self._item(ukv.facts[r], s) for r, s in zip(rows, scores)]
        if filters:
            out = [m for m in out if all(m["metadata"].get(k) == v for k, v in filters.items())]
        return {"results": out[:limit]}

    def _fact(self, memory_id) -> FactRecord | None:
        try:
            return self.store.fact(str(memory_id))
        except LookupError as exc:
            raise MemoryInputError(str(exc)) from None

    def get(self, memory_id: str) -> dict | None:
        """One memory by id, or None."""
        f = self._fact(memory_id)
        return None if f is None else self._item(f)

    def get_all(self, user_id: str, limit: int = 100) -> dict:
        """``{"results": [...]}``: the user's live memories, oldest first."""
        user = check_user_id(user_id)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise MemoryInputError(f"limit must be a positive integer, got {limit!r}")
        ukv = self._snapshot(user)
        return {"results": [self._item(f) for f in (ukv.facts if ukv else [])[:limit]]}

    def history(self, memory_id: str) -> list[dict]:
        """Every event of a memory, oldest first: id, memory_id, user_id, event, old_memory, new_memory,
        created_at. Raises MemoryInputError for an id that never existed."""
        events = self.store.history(str(memory_id))
        if not events:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        if len({e["user_id"] for e in events}) > 1:
            raise MemoryInputError(f"memory id {memory_id!r} belongs to several users")
        for e in events:
            e["created_at"] = _iso(e["created_at"])
        return events

    # --- writes ---------------------------------------------------------------------------------------------

    def _encoding(self, user: str) -> tuple[int, int, bool]:
        """(window, neighbours, history) of a write to ``user``: what the constructor was given, else how the
        user's facts were encoded so far (``Store.user_info``), else the defaults (5, 4, False; 0, 0 with
        history), so one user's facts keep one encoding across processes. A given ``history`` that switches the
        user's method takes that method's defaults for what is not given."""
        try:
            info = self.store.user_info(user)
        except StoreError:  # a new user (or one whose every fact was deleted)
            info = None
        w, m, h = self._given
        recorded = bool(info and info.get("history"))
        if h is None:  # explicit neighbours turn a history user's method off
            h = (recorded and not m) if info is not None else self.encoding.history
        if info is not None and h == recorded:  # the user's window and neighbours go with its method
            w = info["window"] if w is None else w
            m = info["neighbours"] if m is None else m
        # otherwise h is the constructor's method, whose defaults these are
        return self.encoding.window if w is None else w, self.encoding.neighbours if m is None else m, h

    def _context(self, user: str, new_turns: list[dict], upto: int) -> str:
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
    ) -> tuple[str, list[FactRecord]]:
        """new: (text, fact id or None for a fresh uuid, metadata); ``created``: kept creation times of updated ids."""

        window, neighbours, history = self._encoding(user)
        records = [
            FactRecord(
                fid or str(uuid.uuid4()),
                user,
                text,
                "",
                "",
                _date(now),
                (),
                0,
                window,
                metadata=_metadata(meta),
                created_at=(created or {}).get(fid, now),
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
        self, messages, user_id: str, metadata: dict | None = None, infer: bool = True, timestamp: float | None = None
    ) -> dict:
        """Remember ``messages`` (a string or OpenAI-style [{role, content}]) for ``user_id``.

        ``infer=False``: each message becomes one fact, verbatim. ``infer=True``: the extractor turns them into
        facts and reconciles each with the most similar existing memories (ADD / UPDATE / DELETE / NONE).
        The raw messages are stored as the user's turns (the context of later facts). Returns
        ``{"results": [{"id", "memory", "event", "previous_memory"?}]}``. Raises MemoryInputError for bad input.
        """
        user = check_user_id(user_id)
        msgs = check_messages(messages)
        _metadata(metadata)
        now = _timestamp(timestamp)
        turns = [{"speaker": m.get("name") or m["role"], "content": m["content"], "time": now} for m in msgs]
        if not infer:
            new = [(m["content"], None, metadata) for m in msgs]
            contexts = [self._context(user, turns, i) for i in range(len(msgs))]
            _, records = self._write(user, new, [], turns, contexts, [], now)
            return {"results": [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in records]}
        return self._infer(user, msgs, turns, metadata, now)

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

    def _infer(self, user, msgs, turns, metadata, now) -> dict:
        facts = list({_norm(f): f for f in self.extractor.facts(msgs, _date(now))}.values())  # no repeats
        existing: dict[str, str] = {}
        for f in facts:  # the most similar existing memories of each new fact
            ukv, rows, _ = self._search(user, f, 5)
            for r in rows:
                existing[ukv.facts[r].fact_id] = ukv.facts[r].text
        decisions = self.extractor.reconcile(facts, list(existing.items())) if facts else []
        context = self._context(user, turns, len(turns) - 1)
        new, delete, events, results = [], [], [], []
        known = {_norm(t) for t in existing.values()}
        for d in decisions:
            if d.target is not None and (d.target in delete or any(n[1] == d.target for n in new)):
                continue  # one decision per memory per add
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
        if new or delete:
            created = {t: f.created_at for t in delete if (f := self.store.fact(t, user)) is not None}
            _, records = self._write(user, new, delete, turns, [context] * len(new), events, now, created)
            added = [r for r, n in zip(records, new) if n[1] is None]
            results = [{"id": r.fact_id, "memory": r.text, "event": "ADD"} for r in added] + results
        else:  # nothing to remember: the turns are still the context of later facts
            self.store.commit(user, turns=turns, window=self._encoding(user)[0], now=now)
        return {"results": results}

    def update(self, memory_id: str, data: str) -> dict:
        """Replace a memory's text (re-encoded behind the turns before now); keeps its id. Raises MemoryInputError."""
        data = _text(data, "update text")
        f = self._fact(memory_id)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        now = time.time()
        try:
            self._write(
                f.user,
                [(data, f.fact_id, json.loads(f.metadata or "{}"))],
                [f.fact_id],
                [],
                [self._context(f.user, [], 0)],
                [(f.fact_id, "UPDATE", f.text, data)],
                now,
                {f.fact_id: f.created_at},
            )
        except StoreError as exc:  # deleted concurrently
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory updated successfully!"}

    def delete(self, memory_id: str) -> dict:
        """Tombstone one memory: it is never retrieved or injected again. Raises MemoryInputError if unknown."""
        f = self._fact(memory_id)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        try:
            self.store.commit(f.user, delete=[f.fact_id], window=self._encoding(f.user)[0])
        except StoreError as exc:  # a concurrent delete of the same id won the race
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory deleted successfully!"}

    def delete_all(self, user_id: str) -> dict:
        self.store.delete_user(check_user_id(user_id))  # what is live when the commit runs
        return {"message": "Memories deleted successfully!"}

    def compact(self, user_id: str) -> dict:
        """Rewrite the user's KV segments without dead rows; what search and get_all return is unchanged."""
        user = check_user_id(user_id)
        if self._snapshot(user) is None:
            return {"message": "nothing to compact"}
        return {"message": "Memory compacted", "version": self.store.compact(user)}

    def reset(self) -> None:
        """Delete every memory, turn and history row of the store (the model and header stay)."""
        self.store.reset()
        self.indexes.clear()


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()
