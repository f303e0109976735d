"""What ``Memory`` erases, and the upkeep that follows an erasure: ``delete``, ``delete_all``, ``expire`` and ``reset``
(each an erasure through ``ingest.erase_facts``: rows, source turns and history text go, and the facts computed
behind them are re-encoded), ``compact``, and the background half (``reencode_pending``, ``collect``). A mixin of
``facade.Memory``, whose store, model and caches it uses.
"""

from __future__ import annotations

import time
from collections import Counter

from ..ingest import erase_facts, reencode_stale
from ..store import ALL, StoreError, StoreUnavailable
from . import mem0
from .mem0 import MemoryInputError


def erasure_counts(got) -> dict:
    """What an erasure covered, as the API reports it."""
    return {k: int(got.get(k, 0)) for k in ("erased", "turns", "reencoded", "deferred")}


class Forgetting:
    """``Memory``'s erasures and their upkeep (the module docstring)."""

    def delete(self, memory_id: str, namespace: str | None = None) -> dict:
        """Erase one memory: it is never retrieved or injected again, and nothing keeps its words (``_erase``).
        Returns ``{"message", "erasure": {"erased", "turns", "reencoded", "deferred"}}``. Raises MemoryInputError
        if unknown."""
        f = self._fact(memory_id, namespace)
        if f is None:
            raise MemoryInputError(f"memory {memory_id!r} not found")
        try:
            erasure = self._erase(f.user, [f.fact_id])
        except StoreUnavailable:
            raise
        except StoreError as exc:  # a concurrent delete of the same id won the race
            raise MemoryInputError(f"memory {memory_id!r} not found ({exc})") from None
        return {"message": "Memory deleted successfully!", "erasure": erasure}

    def delete_all(
        self,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        namespace: str | None = None,
    ) -> dict:
        """Erase every memory whose scope has all the given ids (``delete_all(user_id="u")`` also erases u's
        memories with an agent or run), each scope in one commit, with all of its turns and its history's text
        (``_erase``). Returns ``{"message", "erasure": {...}}`` (counts summed over the scopes). Raises
        MemoryInputError without any id."""
        mem0.check_delete_all(user_id, agent_id, run_id)
        users, _ = self._read_scopes(None, {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}, namespace)
        total = Counter()
        for user in users:
            total.update(self._erase(user, ALL))  # what is live when the commit runs, and every turn
        return {"message": "Memories deleted successfully!", "erasure": erasure_counts(total)}

    def _erase(self, user: str, delete) -> dict:
        """Erase facts ``delete`` (ids, or ``ALL``: then every turn of the scope too) of scope key ``user``
        (``ingest.erase_facts``): rows, source turns and history text go; the facts whose KV was computed behind
        them are re-encoded without them now, or, with ``defer_reencode_s``, by the background job
        (``reencode_pending``) within that bound. Returns ``{"erased", "turns", "reencoded", "deferred"}``."""
        got = erase_facts(lambda: self.lm, self.store, user, delete, defer_s=self.defer_reencode_s)
        return erasure_counts(got)

    def reencode_pending(self, due_within_s: float | None = None) -> dict:
        """The background half of a deferred erasure: re-encode every scope's stale facts (those due within
        ``due_within_s`` seconds; None: all) and rewrite the segments that held their old KV; and finish the
        erasures whose cascade failed after they landed (``Store.writes.compactions``: every segment of the scope still
        holding dead KV is rewritten); then ``collect``. Returns ``{"reencoded": n, "scopes": n, "collected": n}``."""
        horizon = None if due_within_s is None else time.time() + due_within_s
        deferred = set(self.store.writes.compactions())
        users = sorted({u for u, _, _, by in self.store.reads.stale() if horizon is None or by <= horizon} | deferred)
        n = 0
        for user in users:
            got, old = reencode_stale(self.lm, self.store, user)
            n += got
            rewrite = set(old) | (set(self.store.writes.dead_segments(user)) if user in deferred else set())
            if rewrite:
                self.store.writes.compact(user, sorted(rewrite))
            if user in deferred:
                self.store.writes.compacted(user)
        return {"reencoded": n, "scopes": len(users), "collected": self.collect()}

    def collect(self) -> int:
        """Remove the files (or objects) of every scope's segments retired ``store.writes.retire_after_s`` or more ago
        (``Store.collect``), so what an erasure left in them goes within that bound even for a scope that never
        writes again (one erased whole); no model. Run by ``reencode_pending`` (the server's upkeep round); a
        library user calls either now and then. Returns how many segments were removed."""
        return len(self.store.collect())

    def expire(self, today: str | None = None) -> dict:
        """Erase every memory whose ``expiration_date`` has passed (before ``today``, YYYY-MM-DD; default
        today), in every scope, as ``delete`` erases one. Returns the summed ``{"erased", "turns", "reencoded",
        "deferred"}``."""
        today = today or mem0.today()
        total = Counter()
        for user in self.store.reads.users():
            ukv = self._snapshot([user])
            live = None if ukv is None else ukv.unexpired(today)
            if live is not None:
                gone = [f.fact_id for f in ukv.facts if f.row not in live]
                if gone:
                    total.update(self._erase(user, gone))
        return erasure_counts(total)

    def compact(self, user_id: str | None = None, agent_id=None, run_id=None, namespace: str | None = None) -> dict:
        """Rewrite one scope's KV segments without dead rows; what search and get_all return is unchanged."""
        user = mem0.scope_of(user_id, agent_id, run_id).key(namespace)
        if self._snapshot([user]) is None:
            return {"message": "nothing to compact"}
        return {"message": "Memory compacted", "version": self.store.writes.compact(user)}

    def reset(self) -> dict:
        """Delete every memory, turn and history row of the store (the model and header stay); nothing is left
        to re-encode. Returns ``{"message", "erasure": {"erased", "turns", "reencoded": 0, "deferred": 0}}``."""
        with self.store.writes.writer():
            facts, turns = self.store.reads.totals()
        self.store.writes.reset()
        self.indexes.clear()
        self._fields.clear()
        return {"message": "Memory reset", "erasure": erasure_counts({"erased": facts, "turns": turns})}
