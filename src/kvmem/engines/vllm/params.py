"""The request's memory parameters: one typed, versioned reference, its one encoder and decoder, and the salt rule.

A kvmem request names its memory in vLLM's ``kv_transfer_params`` (``SamplingParams(extra_args=
{"kv_transfer_params": ref.to_params()})``) and carries ``ref.salt`` as its prompt's ``cache_salt``. The engine
front end encodes (``MemoryRef.to_params``); the connector's scheduler side decodes (``MemoryRef.from_params``)
and hands the decoded reference to the worker side in its metadata. On the wire::

    {"kvmem": {"schema": 1,
               "store": "/path/to/store", "user": "conv-26", "version": "<store.reads.version(user)>",
               "fact_ids": ["D1:3", ...],       # injected order
               "start": 0,                      # virtual position of the first header token
               "memory_tokens": 120,            # only for tail recompute: the injected length
               "parts": [[user, version], ...], # only for memory of several entity scopes (``UserKV.union``); then
                                                # "user" and "version" are the union's
               "kv_format": "int8",             # only for a lossy store (``kvformat``)
               "cold": "<nonce>"}}              # only for a load test's cold request

Parameters written before ``schema`` existed carry none and are read as schema 1, which they are.
Imports nothing of vLLM or torch: the engine front end uses it before vLLM is loaded.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

PARAMS_KEY = "kvmem"  # the key of kvmem's parameters in ``kv_transfer_params``
SCHEMA = 1  # the version of the parameters' layout; a decoder refuses any other


def kvmem_cache_salt(
    store_id: str,
    user: str,
    version: str,
    kv_format: str = "native",
    cold: str | None = None,
    memory_tokens: int | None = None,
) -> str:
    """The prefix-cache salt a kvmem request must carry (the one place this rule is spelled). It covers:

    * the store (``store_id``: a random id made at its creation, so two stores, or a store re-created at the same
      path, never share one), the user and the memory version;
    * ``kv_format``, the KV format the request expects: a lossy one is in the salt, so blocks injected from a
      quantised store are never a prefix-cache hit for a request that expects lossless KV;
    * ``cold``, a request's nonce: its blocks are no prefix-cache hit for any other request;
    * ``memory_tokens``, set for tail recompute: the prompt goes on with more retrieved facts that the engine
      recomputes, so its blocks hold prefilled, not stored, KV. Such prompts get their own namespace, with the
      injected length (where injection stops is part of what the blocks hold), and never share blocks with plain
      injection.
    """
    fmt = "" if kv_format == "native" else f":{kv_format}"
    salt = f"kvmem:{store_id}:{user}:{version}{fmt}" + (f":cold:{cold}" if cold else "")
    return salt if memory_tokens is None else f"{salt}:tail:{int(memory_tokens)}"


def cold_salt() -> str:
    """A fresh cache salt for a prompt without memory: it shares no prefix-cache block, so it is prefilled in
    full."""
    return f"cold:{uuid.uuid4().hex}"


@dataclass(frozen=True)
class MemoryRef:
    """Which stored memory a prompt starts with: ``[header][facts fact_ids...]`` from the store at ``store``.

    ``store_id`` (the store manifest's id) is not sent: it goes into the salt on the sending side, and a receiver
    (the connector) reads it from the store it opens itself, never from the request; a decoded reference has ""
    until the receiver sets it (``dataclasses.replace``). ``memory_tokens``: set for tail recompute (the prompt
    goes on with recomputed facts): the injected length. ``parts``: for memory drawn from several entity scopes
    (``UserKV.union``), each scope's (user, version); ``user`` and ``version`` are then the union's.
    ``kv_format``: the store's (``Store.kv_format``); both connector sides refuse a store that holds another.
    ``cold``: a nonce for a load test's cold request: the worker drops the facts from its read cache before reading
    them, and the salt carries the nonce, so nothing of this memory is found in any cache tier.
    """

    store: str
    store_id: str
    user: str
    version: str
    fact_ids: tuple[str, ...]
    start: int = 0
    memory_tokens: int | None = None
    parts: tuple[tuple[str, str], ...] | None = None
    kv_format: str = "native"
    cold: str | None = None

    def __post_init__(self):
        set_ = object.__setattr__  # a frozen dataclass normalises its own fields this way
        set_(self, "store", str(self.store))
        set_(self, "fact_ids", tuple(self.fact_ids))
        if self.parts is not None:
            set_(self, "parts", tuple((str(u), str(v)) for u, v in self.parts) if len(self.parts) > 1 else None)

    @property
    def salt(self) -> str:
        """The prompt's cache salt (``kvmem_cache_salt``)."""
        return kvmem_cache_salt(
            self.store_id, self.user, self.version, self.kv_format, self.cold, memory_tokens=self.memory_tokens
        )

    def scopes(self) -> list[tuple[str, str]]:
        """The (user, version) pairs this memory is drawn from: ``parts``, or the one user's."""
        return list(self.parts) if self.parts else [(self.user, self.version)]

    def check_store_kv_format(self, store) -> None:
        """The store must hold the KV format this reference expects: a quantised store is never served to a request
        that expects lossless KV, or the other way round. Raises ValueError."""
        if self.kv_format != store.kv_format:
            raise ValueError(f"the request expects {self.kv_format} KV, the store holds {store.kv_format}")

    def to_params(self) -> dict:
        """``kv_transfer_params`` for this memory (the encoder; module docstring)."""
        p = {
            "schema": SCHEMA,
            "store": self.store,
            "user": self.user,
            "version": self.version,
            "fact_ids": list(self.fact_ids),
            "start": int(self.start),
        }
        if self.memory_tokens is not None:
            p["memory_tokens"] = int(self.memory_tokens)
        if self.parts is not None:
            p["parts"] = [[u, v] for u, v in self.parts]
        if self.kv_format != "native":
            p["kv_format"] = self.kv_format
        if self.cold:
            p["cold"] = str(self.cold)
        return {PARAMS_KEY: p}

    @classmethod
    def from_params(cls, kv_transfer_params: dict) -> MemoryRef:
        """The reference ``kv_transfer_params`` carry (the decoder; ``store_id`` is ""). Raises ValueError, saying
        what is wrong, for parameters that are not kvmem's, of another schema, missing a field or malformed, or
        whose ``parts`` do not spell the union's user and version."""
        p = kv_transfer_params.get(PARAMS_KEY) if isinstance(kv_transfer_params, dict) else None
        if not isinstance(p, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        schema = p.get("schema", 1)
        if schema != SCHEMA:
            raise ValueError(f"kvmem params of schema {schema!r}; this engine reads schema {SCHEMA}")
        missing = [k for k in ("store", "user", "version", "fact_ids") if k not in p]
        if missing:
            raise ValueError(f"kvmem params lack {', '.join(missing)}")
        if not isinstance(p["fact_ids"], list) or not all(isinstance(f, str) for f in p["fact_ids"]):
            raise ValueError("kvmem params: fact_ids must be a list of strings")
        parts = p.get("parts")
        if parts is not None:
            parts = [(str(u), str(v)) for u, v in parts]
            if json.dumps([u for u, _ in parts]) != p["user"] or ",".join(v for _, v in parts) != p["version"]:
                raise ValueError("kvmem params: parts do not spell the union's user and version")
        return cls(
            store=str(p["store"]),
            store_id="",
            user=str(p["user"]),
            version=str(p["version"]),
            fact_ids=tuple(p["fact_ids"]),
            start=int(p.get("start", 0)),
            memory_tokens=int(p["memory_tokens"]) if p.get("memory_tokens") is not None else None,
            parts=tuple(parts) if parts is not None else None,
            kv_format=str(p.get("kv_format", "native")),
            cold=str(p["cold"]) if p.get("cold") else None,
        )
