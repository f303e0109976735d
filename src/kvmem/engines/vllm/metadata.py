"""What the scheduler side sends the worker side each step (vLLM's connector metadata): the loads to do.

vLLM pickles it from the engine-core process to the model-runner processes with the step's scheduler output.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import MemoryRef


def ids_digest(ids) -> str:
    """What the worker re-checks: SHA-256 of the composed memory token ids the scheduler verified."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


@dataclass
class KvmemLoad:
    """Write memory tokens ``[first, first+count)`` of a request into its blocks.

    ``ref``: the request's memory, with ``store_id`` set to the id of the store the scheduler verified the request
    against (a store re-created at the same path has another; "" skips that check). ``block_ids``: the request's
    blocks (KV-cache group 0). ``served_len``: the prompt's tokens. ``ids_sha256``: ``ids_digest`` of the memory ids
    the scheduler verified against the prompt. ``asynchronous``: read on a loader thread (or from memory) and
    reported by ``get_finished``; else written before the step's forward pass.
    """

    req_id: str
    ref: MemoryRef
    block_ids: list[int]
    first: int
    count: int
    served_len: int
    ids_sha256: str
    asynchronous: bool = False


@dataclass
class KvmemConnectorMetadata(KVConnectorMetadata):
    """One step's loads, in the order the scheduler allocated them."""

    loads: list[KvmemLoad] = field(default_factory=list)
