"""What each route answers with 200, as pydantic models: the OpenAPI document carries them (``response_model``), so a
client generator or a fuzzer can check an answer. Each model is open (``extra="allow"``: fields beyond those
named pass through) and routes answer with ``response_model_exclude_unset``, so an answer is exactly what the
route returns; the models name the fields a client may rely on and their types."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- service ---------------------------------------------------------------------------------------------


class Health(Open):
    status: Literal["ok"]


class Ready(Open):
    status: Literal["ready"]
    engine: str
    model: str
    replica: str | None = None  # with --replicas: the replica that answered, and its process
    pid: int | None = None


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Open):
    object: Literal["list"]
    data: list[ModelCard]


# --- chat ------------------------------------------------------------------------------------------------


class AssistantMessage(Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict] | None = None


class Choice(Open):
    index: int
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class KvmemInfo(Open):
    """kvmem's own field of an answer: the memory method, the facts injected, the engine, the timings (ms)."""

    mode: str
    k: int
    fact_ids: list[str]
    engine: str
    kv_format: str
    timings_ms: dict[str, float]
    replica: str | None = None


class ChatCompletion(Open):
    """OpenAI's ``chat.completion`` (a whole answer; with ``stream``: ``chat.completion.chunk`` events)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    kvmem: KvmemInfo


# --- memories --------------------------------------------------------------------------------------------


class Ping(Open):
    status: str
    org_id: str
    project_id: str
    user_email: str | None = None


class MemoryItem(Open):
    """Mem0's memory item, with the entity ids promoted (``memory.mem0.item``)."""

    id: str
    memory: str
    hash: str | None = None
    metadata: dict | None = None
    created_at: str | None = None
    updated_at: str | None = None
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    score: float | None = None


class Results(Open):
    results: list[MemoryItem]


class Erasure(Open):
    """What an erasure did: facts erased, turns erased, facts re-encoded at once or deferred."""

    erased: int
    turns: int
    reencoded: int
    deferred: int


class MemoryEvent(Open):
    id: str
    memory: str
    event: Literal["ADD", "UPDATE", "DELETE", "NONE"]
    previous_memory: str | None = None


class Added(Open):
    """An add's outcome: one event per memory written, changed or erased; ``message`` when nothing was."""

    results: list[MemoryEvent]
    erasure: Erasure | None = None
    message: str | None = None


class Message(Open):
    message: str
    erasure: Erasure | None = None


class HistoryRow(Open):
    id: int | str  # the event's number in the store
    memory_id: str
    old_memory: str | None = None
    new_memory: str | None = None
    event: str
    created_at: str | None = None
    updated_at: str | None = None
    is_deleted: bool
    actor_id: str | None = None
    role: str | None = None


class Page(Open):
    count: int
    next: str | None
    previous: str | None
    results: list[MemoryItem]


class Entity(Open):
    type: Literal["user", "agent", "run"]
    name: str
    id: str
    total_memories: int | None = None


class EntityPage(Open):
    count: int
    next: str | None
    previous: str | None
    results: list[Entity]


class Imported(Open):
    """An import: records written, per scope label, and records already there (skipped)."""

    count: int
    scopes: dict[str, int]
    existing: int
