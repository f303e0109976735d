"""``Memory`` and ``AsyncMemory``: the facade, Mem0's open-source ``Memory`` over a kvmem store (the package
docstring, ``kvmem.memory``, says what it does and over which rooms)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path

from .. import scopes
from ..config import config_kwargs
from ..ingest import finish_erasure, open_or_create_store, render_turns, write_facts
from ..models import DEFAULT_MODEL, LoadedModel, fingerprint, load
from ..policy import Encoding
from ..retrieve import HYBRID, Embedder, Fusion, IndexCache, search
from ..scopes import Scope
from ..store import (
    CACHE_BYTES,
    Erasure,
    FactRecord,
    Store,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    UnknownUser,
    Write,
    came_from,
    check_kv_format,
    check_segments_url,
    is_url,
)
from . import grounding, importer, mem0, reconcile
from .extract import make_extractor
from .forget import Forgetting, erasure_counts
from .mem0 import (
    MemoryConflict,
    MemoryInputError,
    check_messages,
    date_label,
)

_UNSET = object()


def default_store() -> str | Path:
    """Where ``Memory()`` keeps its store: ``$KVMEM_STORE`` (a directory or a store URL), else
    ``$XDG_DATA_HOME/kvmem/memory`` (``~/.local/share/kvmem/memory``)."""
    env = os.environ.get("KVMEM_STORE")
    if env:
        return env
    return Path(os.environ.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "kvmem" / "memory"


class Memory(Forgetting, importer.Importing):
    """Mem0's open-source ``Memory`` (mem0ai 2.2.1's ``mem0.memory.main.Memory``) whose facts are also stored as
    the answer model's KV, for KV injection.

    Args:
        store: store directory or URL; created for ``model`` if it does not exist. None: ``default_store()``
            (``$KVMEM_STORE``, else ``~/.local/share/kvmem/memory``).
        model: registry name (default: the store's model, else ``models.DEFAULT_MODEL``) or a ``LoadedModel``.
        extractor: None (the local model), ``{"base_url", "model", "api_key"}`` or an ``extract.Extractor``.
        window: conversation turns encoded before each new fact (context-window encoding).
            ``window``, ``neighbours`` and ``history`` left as None take, for each scope, how that scope's facts
            were encoded so far (``Store.reads.user_info``), and for a new scope the defaults 5, 4 and False (window 0
            and neighbours 0 with ``history=True``).
        neighbours: also encode each new fact behind its m most similar live facts of the scope (neighbour-aware
            encoding, ``ingest.scope_neighbours``; default ``policy.DEFAULT_NEIGHBOURS`` = 4, 0 = off). No
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
        defer_reencode_s: None (default): an erasure re-encodes at once every fact whose KV was computed behind
            the erased text; a number of seconds: it leaves that to ``reencode_pending`` (the server's background
            job), which must run within that bound; the derived KV is served until then.
        hybrid: what ``search`` ranks by when a call does not say (``keyword_search``): True (the default), cosine
            fused with the store's full-text (BM25) scores (``retrieve.HYBRID``); False, cosine similarity alone;
            or a ``retrieve.Fusion``.

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
        defer_reencode_s: float | None = None,
        hybrid: bool | Fusion = True,
    ):

        if not isinstance(hybrid, (bool, Fusion)):
            raise MemoryInputError(f"hybrid must be true, false or a retrieve.Fusion, not {hybrid!r}")
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
        self.fusion = hybrid if isinstance(hybrid, Fusion) else (HYBRID if hybrid else None)
        self.custom_instructions = custom_instructions
        self.defer_reencode_s = defer_reencode_s
        self._fields: dict[tuple, tuple] = {}  # (scope key, version, namespace) -> each fact's filter fields
        self.extraction_counts: Counter = Counter()  # infer=True adds: facts extracted / rejected, empty adds, ...
        self.import_batch_size = importer.IMPORT_BATCH  # records per commit of an import

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

    def _read_scopes(self, filters, ids: dict, namespace) -> tuple[list[str], dict]:
        """The store users a read of ``filters`` (plus top-level entity ids ``ids``) covers, and the checked
        filters (``mem0.read_filters``). Raises MemoryInputError."""
        filters, named = mem0.read_filters(filters, ids)
        mem0.compile_filters(filters)  # every operand checked, whether or not the scopes hold memories
        if len(named.ids()) == len(scopes.ENTITIES):  # one scope: no need to look it up
            return [named.key(namespace)], filters
        return self._scopes_of(named, namespace), filters

    def _scopes_of(self, named: Scope | None, namespace, live: bool = False) -> list[str]:
        """The store users that are scopes of ``namespace`` with every id ``named`` names (None: all of them;
        ``live``: with a live fact), found through the store's scope index, so the cost follows the caller's own
        scopes; a store created before the index lists its users."""
        keys = self.store.reads.scope_keys(scopes.IndexQuery.of(named, namespace), live)
        if keys is None:
            keys = self.store.reads.users(with_no_live_facts=not live)
        return [k for k in keys if scopes.matches(k, named, namespace)]

    def entity_scopes(self, namespace: str | None = None) -> list[Scope]:
        """Every scope of ``namespace`` with live memories (what ``/v1/entities`` lists), through the scope index:
        the cost follows that namespace's scopes, not the store's facts."""
        return [scopes.parse_key(k, namespace) for k in self._scopes_of(None, namespace, live=True)]

    def _snapshot(self, users: list[str]):
        """Rows and embeddings of the current version of ``users``' memories, read as one (no KV: reads never
        need it), or None when none has live memories."""
        try:
            return self.store.reads.snapshots([(u, None) for u in users]) if users else None
        except UnknownUser:
            return None

    def _fields_of(self, ukv, namespace) -> tuple[list[dict], set[str]]:
        """Each fact's filterable fields (``mem0.filter_fields``) and every field name any of them has, cached per
        scope version."""
        out, names = [], set(scopes.BUILTIN_FIELDS)
        for part in ukv.parts or (ukv,):
            key = (part.user, part.version, namespace)
            got = self._fields.get(key)
            if got is None:
                s = scopes.parse_key(part.user, namespace) or Scope(user_id=part.user)
                rows = [mem0.filter_fields(f, s) for f in part.facts]
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
        pred, used = mem0.compile_filters(filters)
        if mem0.by_ids_only(filters):
            # the scopes were picked by exactly these ids: only expiry is left to check
            return None if show_expired else ukv.unexpired(mem0.today())
        fields, known = self._fields_of(ukv, namespace)
        mem0.check_fields(used, known)
        keep = {f.row for f, x in zip(ukv.facts, fields) if pred(x)}
        live = None if show_expired else ukv.unexpired(mem0.today())
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
        explain: bool = False,
        keyword_search: bool | None = None,
        **unsupported,
    ) -> dict:
        """The ``top_k`` (default 20) memories most similar to ``query`` among those ``filters`` select, with a
        cosine score of at least ``threshold`` (default 0.1; None: any): ``{"results": [{id, memory, hash,
        metadata, score, created_at, updated_at, user_id?, agent_id?, run_id?, ...}]}``, best first.

        ``keyword_search``: rank by cosine fused with the store's keyword (BM25) scores (True), or by cosine alone
        (False); None: as the Memory was made (``hybrid``). Fused, ``score`` is the fused score in [0, 1]
        (``retrieve.Fusion``) and ``threshold`` still applies to the cosine, as in Mem0 2.x. ``explain``: each
        result also carries ``score_details`` (Mem0 2.x's name): ``semantic_score`` (cosine), ``bm25_score``
        (the raw keyword score, None where the words did not match), their ranks among the candidates, the fusion
        and ``final_score``.

        ``filters``: Mem0's (``scopes`` module docstring), with at least one entity id; it is applied before the
        top-k (FAISS ``IDSelectorBatch``), so ``top_k`` results come back whenever that many match. Top-level
        ``user_id`` / ``agent_id`` / ``run_id`` and ``limit`` (for ``top_k``) are kvmem's older spelling.
        Expired memories are left out unless ``show_expired``. Raises MemoryInputError."""
        mem0.refuse(unsupported, "search")
        if rerank:
            raise MemoryInputError("rerank is not supported by kvmem (no reranker ships offline); search without it")
        query = mem0.check_text(query, "query")
        top_k = mem0.check_count(top_k if top_k is not None else limit, "top_k", 20)
        mem0.check_threshold(threshold)
        ukv, allowed = self._read(filters, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id},
                                  show_expired, namespace)  # fmt: skip
        if ukv is None or top_k == 0:
            return {"results": []}
        if keyword_search is not None and not isinstance(keyword_search, bool):
            raise MemoryInputError(f"keyword_search must be true or false, not {keyword_search!r}")
        fusion = self.fusion if keyword_search is None else (self.fusion or Fusion()) if keyword_search else None
        hits = search(self.indexes, self.store, ukv, self.embedder.embed([query])[0], query, top_k, allowed, fusion)
        out = []
        for h in hits:
            if threshold is None or h.semantic >= threshold:
                out.append(mem0.item(ukv.facts[h.position], namespace, h.score))
                if explain:
                    out[-1]["score_details"] = {**h.explain(fusion), "threshold": threshold}
        return {"results": out}

    def _fact(self, memory_id, namespace: str | None = None) -> FactRecord | None:
        """The live memory with this id among ``namespace``'s scopes (a tenant sees its own ids only)."""
        try:
            return self.store.reads.fact(str(memory_id), within=scopes.namespace_prefix(namespace))
        except LookupError as exc:
            raise MemoryInputError(str(exc)) from None

    def get(self, memory_id: str, namespace: str | None = None) -> dict | None:
        """One memory by id (Mem0's item, ``score`` None), or None."""
        f = self._fact(memory_id, namespace)
        return None if f is None else {**mem0.item(f, namespace), "score": None}

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
        mem0.refuse(unsupported, "get_all")
        top_k = mem0.check_count(top_k if top_k is not None else limit, "top_k", 20)
        ukv, allowed = self._read(filters, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id},
                                  show_expired, namespace)  # fmt: skip
        if ukv is None:
            return {"results": []}
        facts = [f for f in ukv.facts if allowed is None or f.row in allowed]
        facts.sort(key=lambda f: (f.created_at, f.row))
        return {"results": [mem0.item(f, namespace) for f in facts[:top_k]]}

    def page(
        self, user_id: str, *, offset: int = 0, limit: int = 50, namespace: str | None = None
    ) -> tuple[int, list[dict]]:
        """What ``get_all(user_id=...)`` returns (every live, unexpired memory of the user's scopes), newest first,
        as (how many there are, the ``limit`` items after the first ``offset``): only the page's items are built,
        so a page of a user with 10,000 memories costs its 50, not 10,000 (the memory inspector's pages). Raises
        MemoryInputError for a bad user id."""
        ukv, allowed = self._read(None, {"user_id": user_id}, False, namespace)
        if ukv is None:
            return 0, []
        facts = [f for f in ukv.facts if allowed is None or f.row in allowed]
        facts.sort(key=lambda f: (f.created_at, f.row), reverse=True)
        return len(facts), [mem0.item(f, namespace) for f in facts[offset : offset + limit]]

    def history(self, memory_id: str, namespace: str | None = None) -> list[dict]:
        """Every event of a memory, oldest first (Mem0's history rows, ``mem0.history_rows``). Raises
        MemoryInputError for an id that never existed."""
        return mem0.history_rows(
            self.store.reads.history(str(memory_id), scopes.namespace_prefix(namespace)), memory_id
        )

    # --- writes ---------------------------------------------------------------------------------------------

    def _encoding(self, user: str) -> tuple[int, int, bool]:
        """(window, neighbours, history) of a write to ``user`` (a scope key): what the constructor was given,
        else how the scope's facts were encoded so far (``Store.reads.user_info``), else the defaults (5, 4, False; 0,
        0 with history), so one scope's facts keep one encoding across processes. A given ``history`` that
        switches the scope's method takes that method's defaults for what is not given."""
        try:
            info = self.store.reads.user_info(user)
        except StoreUnavailable:  # the database, not the scope: never write with guessed settings
            raise
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
        return self._context(user, new_turns, upto)[0]

    def _context(
        self, user: str, new_turns: list[dict], upto: int, skip: set[int] = frozenset()
    ) -> tuple[str, tuple[int, ...]]:
        """``encoding_context`` and its turns' references (provenance: stored turns by index, this add's ``i``-th
        new turn as ``-(i + 1)``); ``skip``: stored turns left out (those the same commit erases)."""
        window = self._encoding(user)[0]
        if window == 0:
            return "", ()
        stored = [t for t in self.store.reads.turns(user, last=window + len(skip)) if t["idx"] not in skip]
        turns = [(t, t["idx"]) for t in stored] + [(t, -(i + 1)) for i, t in enumerate(new_turns[:upto])]
        turns = turns[-window:]
        return render_turns([t for t, _ in turns]), tuple(r for _, r in turns)

    def _write(
        self,
        user: str,
        new: list[tuple[str, str | None, dict]] = (),
        delete: list[str] = (),
        turns: list[dict] = (),
        contexts: list[str] = (),
        events: list[tuple] = (),
        now: float | None = None,
        created: dict[str, float] | None = None,
        dated: bool = False,
        window: int | None = None,
        provenance: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        expect: dict[str, int] | None = None,
        erase: Erasure | None = None,
    ) -> tuple[str, list[FactRecord]]:
        """Every commit of this facade: through the one write path (``ingest.write_facts``), in one store
        transaction. new: (text, fact id or None for a fresh uuid, metadata); ``delete``: ids, or ``store.ALL``
        (what is live when the commit runs); ``created``: kept creation times of updated ids (``dated``: also
        each fact's date, as for imported memories; else the date is now's); ``now``: None, the commit's time;
        ``window``: the window recorded for the scope (None: the scope's encoding, ``_encoding``);
        ``provenance``: per new fact (its window's turn references, the turns it came from), as ``_context``
        gives them (None: unknown); ``expect``: fact id -> the row read, a compare-and-set (MemoryConflict when
        one changed since; checked before anything is written, the erasure's ids included); ``erase``: facts
        erased in the same commit (``Store.writes.commit``; filled in with what it covered; its cascade is the caller's,
        ``ingest.finish_erasure``). The model and embedder load only for a write with new facts. Returns (the new
        version, the new facts' records)."""

        scope_window, neighbours, history = self._encoding(user)
        window = scope_window if window is None else window
        created = created or {}
        records = [
            FactRecord(
                fid or str(uuid.uuid4()),
                user,
                text,
                "",
                "",
                date_label(created.get(fid, now) if dated else now),
                (),
                0,
                window,
                metadata=mem0.check_metadata(meta),
                created_at=created.get(fid, now),
                context_turns=None if provenance is None else provenance[i][0],
                source_turns=() if provenance is None else provenance[i][1],
            )
            for i, (text, fid, meta) in enumerate(new)
        ]
        rendered = [f"- [{r.date}] {r.text}\n" for r in records]
        try:
            version, _ = write_facts(
                self.lm if records else None,
                self.embedder if records else None,
                self.store,
                Write(user, records, delete=delete, turns=turns, events=events, now=now, expect=expect, erase=erase),
                list(contexts),
                rendered,
                encoding=Encoding(window, neighbours, history),
            )
        except StoreConflict as exc:
            raise MemoryConflict(str(exc)) from None
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
        scope = mem0.scope_of(user_id, agent_id, run_id)
        user = scope.key(namespace)
        mem0.check_memory_type(memory_type)
        msgs = check_messages(messages)
        meta = mem0.user_metadata(metadata)
        exp = mem0.check_expiration(expiration_date)
        if exp is not None:
            meta["expiration_date"] = exp
        now = mem0.check_timestamp(timestamp)
        if prompt is not None:
            prompt = mem0.check_text(prompt, "prompt")
        turns = [{"speaker": m.get("name") or m["role"], "content": m["content"], "time": now} for m in msgs]
        if not infer:
            kept = [(i, m) for i, m in enumerate(msgs) if m["role"] != "system"]  # as Mem0: never a memory
            new = [(m["content"], None, {**meta, "role": m["role"]} | mem0.actor(m)) for _, m in kept]
            ctx = [self._context(user, turns, i) for i, _ in kept]
            prov = [(refs, (-(i + 1),)) for (i, _), (_, refs) in zip(kept, ctx)]
            _, records = self._write(user, new, turns=turns, contexts=[c for c, _ in ctx], now=now, provenance=prov)
            return {"results": mem0.added(records)}
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
        emb = self.embedder.embed([text])[0]
        scores, rows = self.indexes.search(self.store, ukv, emb, k, ukv.unexpired(mem0.today()))
        return [(float(s), ukv.facts[r]) for s, r in zip(scores, rows)]

    def _infer(self, user, msgs, turns, metadata, now, prompt=None) -> dict:
        """``add(infer=True)``: extract, check, reconcile (``reconcile``), then one commit: a fact whose words are
        not the user's own is dropped; an explicit request to forget deletes the memory it is about; a
        correction turns the ADD of the corrected fact into an UPDATE of the memory it corrects. With nothing to
        change the turns are still committed (the context of later facts). The result says when nothing was
        extracted or kept (``message``).

        All or nothing: the ADDs, UPDATEs and DELETEs (erasures, ``_erase``'s row work) are one store commit,
        a compare-and-set on every memory updated or deleted as read here, so MemoryConflict means nothing was
        applied. The re-encoding of what was computed behind the erased text follows it (``finish_erasure``)."""
        extractor = lambda: self.extractor  # made (and the model loaded) only when there is text to extract from
        got = reconcile.extract(msgs, extractor, date_label(now), prompt)
        ukv = self._snapshot([user])  # read after the extraction, just before the decisions
        similar = lambda text, k: self._similar(ukv, text, k)
        plan = reconcile.decide(got, extractor, similar, metadata, self.extraction_counts)
        kept = {n[1] for n in plan.new}
        gone = [t for t in plan.delete if t not in kept]  # deleted for good (an UPDATE's id is re-added)
        deleted = [t for t in plan.delete if t in kept]
        # the memories updated or deleted, as read: a compare-and-set, so a concurrent change is never overwritten
        read = {f.fact_id: f for f in (ukv.facts if ukv is not None else ())}
        expect = {t: read[t].row for t in plan.delete if t in read}
        if got.forgets:  # a request to forget is not kept as a turn: it may repeat what it asks to forget
            turns = [
                {**t, "content": " ".join(p for p in grounding.sentences(t["content"]) if p not in got.forgets)}
                if m["role"] == "user" else t
                for t, m in zip(turns, msgs)
            ]  # fmt: skip
            turns = [t for t in turns if t["content"]]
        erasing = self._sources(user, [read[t] for t in gone if t in read])  # nothing new is encoded behind them
        text, refs = self._context(user, turns, len(turns) - 1, erasing)
        source = tuple(-(i + 1) for i in range(len(turns)))
        created = {t: read[t].created_at for t in plan.delete if t in read}
        job = Erasure(gone, defer_s=self.defer_reencode_s or 0.0) if gone else None
        version, records = self._write(
            user, plan.new, deleted, turns, [text] * len(plan.new), plan.events, now, created,
            provenance=[(refs, source)] * len(plan.new), expect=expect, erase=job,
        )  # fmt: skip
        erasure = None
        if job is not None:
            erasure = erasure_counts(
                finish_erasure(lambda: self.lm, self.store, user, job, version, self.defer_reencode_s)
            )
        added = [r for r, n in zip(records, plan.new) if n[1] is None]
        out: dict = {"results": mem0.added(added) + plan.results}
        if erasure is not None:
            out["erasure"] = erasure
        if not out["results"]:
            self.extraction_counts["empty"] += 1
            why = (
                f"{plan.rejected} extracted facts were not in the user's messages"
                if plan.rejected
                else "no facts found"
            )
            out["message"] = f"nothing remembered: {why}"
        return out

    def _sources(self, user: str, facts: list[FactRecord]) -> set[int]:
        """The stored turns ``facts`` came from (``store.came_from``: what erasing them erases)."""
        out = {t for f in facts if f.context_turns is not None for t in f.source_turns}
        if any(f.context_turns is None for f in facts):
            rows = [(t["idx"], t["dia_id"], t["content"]) for t in self.store.reads.turns(user)]
            out |= {t for f in facts if f.context_turns is None for t in came_from(None, f.source_turn, f.text, rows)}
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
        ``data``: Mem0's older name for ``text``. A compare-and-set on the memory as read here: when another
        writer (another replica) updated or deleted it in between, nothing is written and MemoryConflict is
        raised (HTTP 409), never a silent overwrite of that change. Raises MemoryInputError, MemoryConflict."""
        text = data if text is None else text
        mem0.check_update(text, metadata, expiration_date is not _UNSET)
        text = None if text is None else mem0.check_text(text, "update text")
        f = self._fact(memory_id, namespace)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        meta = json.loads(f.metadata or "{}")
        meta.update(mem0.user_metadata(metadata))
        if expiration_date is not _UNSET:
            meta.pop("expiration_date", None)
            if expiration_date is not None:
                meta["expiration_date"] = mem0.check_expiration(expiration_date)
        new_text = f.text if text is None else text
        now = time.time()
        ctx, refs = self._context(f.user, [], 0)
        try:
            self._write(
                f.user,
                [(new_text, f.fact_id, meta)],
                [f.fact_id],
                [],
                [ctx],
                [(f.fact_id, "UPDATE", f.text, new_text)],
                now,
                {f.fact_id: f.created_at},
                provenance=[(refs, f.source_turns)],
                expect={f.fact_id: f.row},
            )
        except StoreUnavailable:  # the database did not answer: a 503, not a missing memory
            raise
        except StoreError as exc:  # deleted concurrently
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory updated successfully!"}


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
