"""``Memory``, ``AsyncMemory``: the facade, Mem0's open-source ``Memory`` over a kvmem store.

Every commit (``add``, ``update``, ``delete``, ``delete_all``, ``import_memories``) goes through one method,
``Memory._write``, and from there through the one write path (``ingest.write_facts``): a new fact is encoded
behind the ``window`` conversation turns before it (context-window encoding, paper §3.2), embedded, and committed
with its KV segment in one store transaction, so the vector index and the KV store never disagree; the scope's
memory version changes on every commit (the vLLM connector's checks and cache salt key on it). Deletes are
tombstones; an update is a delete plus an add that keeps the id; ``compact`` drops dead rows.

The API is mem0ai 2.2.1's ``Memory`` / ``AsyncMemory``: entity scopes (``user_id``, ``agent_id``, ``run_id``;
each combination is one store partition, ``scopes``), Mem0's filters applied before the top-k, its defaults
(``top_k`` 20, ``threshold`` 0.1) and return shapes. ``infer=True`` uses the local answer model (or an
OpenAI-compatible endpoint) with schema-constrained JSON. docs/mem0.md lists what still differs.

The rooms: ``mem0`` (Mem0's input checks and output shapes), ``extract`` (the model's facts and decisions),
``grounding`` (checks on what it returns), ``reconcile`` (ADD / UPDATE / DELETE, forgets, corrections),
``importer`` (a Mem0 export, checked and grouped by scope), under ``facade`` (``Memory``, ``AsyncMemory``).
"""

from .facade import AsyncMemory, Memory, default_store
from .mem0 import (
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MemoryConflict,
    MemoryInputError,
    check_messages,
    check_user_id,
)

__all__ = [
    "MAX_MESSAGES",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "AsyncMemory",
    "Memory",
    "MemoryConflict",
    "MemoryInputError",
    "check_messages",
    "check_user_id",
    "default_store",
]
