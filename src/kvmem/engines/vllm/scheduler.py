"""The connector's scheduler side (vLLM's engine-core process): which requests take injected memory, and how much.

For each waiting request it checks that the request names a trusted store, that the prompt starts with exactly the
composed memory token ids (store header ids + the facts' token ids from the store metadata), that the memory
version is still the store's and that the request carries the memory's cache salt (``params.kvmem_cache_salt``);
then it reports the memory tokens (minus the last prompt token, which vLLM must compute) beyond any local
prefix-cache hit as externally computed, loaded asynchronously (vLLM's ``load_kv_async``: the request waits in
WAITING_FOR_REMOTE_KVS while the engine steps the others) unless ``Settings.async_load`` is False. Anything else
is a normal prefill, counted in ``metrics`` (logged, and written to ``Settings.metrics_file`` when set). It reads
store metadata only, never KV, and O(1) of it per request (``stores.memory_token_ids``: each scope's version row,
and the named facts' rows when not cached): it runs in vLLM's engine core, where nothing else is scheduled
meanwhile. The worker side (``worker``) reads and writes the KV.

Built without vLLM's configuration (``KvmemScheduler(settings)``), so its rules can be checked on their own.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import stores
from .config import Settings
from .metadata import KvmemConnectorMetadata, KvmemLoad, ids_digest
from .params import PARAMS_KEY, MemoryRef
from .stores import Trust, memory_token_ids, open_store

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvmem.vllm_connector")  # the name log configurations already select


class KvmemScheduler:
    """The scheduler side of ``KvmemConnector`` (module docstring). ``metrics``: counters of injected requests and
    tokens, and of each kind of fallback (``untrusted_store``, ``unsalted``, ``store_error``, ``mismatch``,
    ``load_failed``)."""

    ANSWER_S = 1.0  # a store read here holds the engine core: a database silent this long is a fallback (once)

    def __init__(self, settings: Settings):
        self.settings = settings
        stores.configure(answer_cap_s=self.ANSWER_S)
        self.metrics: Counter = Counter()
        self._trust = Trust(settings.stores, settings.identity)
        self._matched: dict[str, tuple[MemoryRef, int, str]] = {}  # req_id -> (ref, local computed tokens, ids hash)
        self._pending: list[KvmemLoad] = []  # loads for the next step's metadata
        self._refused: set[str] = set()  # requests whose asynchronous load failed: a plain prefill from now on
        self._loading: set[str] = set()  # live requests given an asynchronous load

    def _count(self, what: str, n: int = 1) -> None:
        self.metrics[what] += n
        path = self.settings.metrics_file
        if path:
            try:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(dict(self.metrics), f)
                os.replace(tmp, path)
            except OSError as exc:  # a metrics file is never worth the scheduler
                logger.warning("kvmem: cannot write metrics file %s: %s", path, exc)

    def _check(self, request: Request) -> tuple[MemoryRef, list[int]] | None:
        """(the request's memory, with the verified store's id; its token ids) if ``request`` may take injected
        memory, else None (counted, unless the request names no kvmem memory)."""
        ktp = getattr(request, "kv_transfer_params", None) or {}
        if not (isinstance(ktp, dict) and ktp.get(PARAMS_KEY)):
            return None
        prompt = list(request.prompt_token_ids or [])
        try:
            ref = MemoryRef.from_params(ktp)
            if ref.start != 0:
                raise ValueError("vLLM numbers prompt positions from 0: kvmem start must be 0")
            why = self._trust.why_untrusted(ref.store)
            if why:
                self._count("untrusted_store")
                logger.warning("kvmem: request %s: %s; normal prefill", request.request_id, why)
                return None
            st = open_store(ref.store)
            ref.check_store_kv_format(st)
            mem = memory_token_ids(ref, st)  # O(1) store work: versions, and the named facts' rows if not cached
            ref = replace(ref, store_id=st.manifest["store_id"])
            if ref.memory_tokens is not None and ref.memory_tokens != len(mem):
                raise ValueError(f"memory_tokens {ref.memory_tokens} != the composed memory's {len(mem)}")
            if request.cache_salt != ref.salt:
                self._count("unsalted")
                logger.warning(
                    "kvmem: request %s lacks the user/version cache salt; normal prefill", request.request_id
                )
                return None
        except Exception as exc:  # a store error (locked, missing, corrupt), bad params: never the engine's end
            self._count("store_error")
            logger.warning("kvmem: request %s: %s: %s; normal prefill", request.request_id, type(exc).__name__, exc)
            return None
        if len(prompt) < len(mem) or prompt[: len(mem)] != mem:
            self._count("mismatch")
            logger.warning(
                "kvmem: request %s prompt does not start with its composed memory (%d tokens); "
                "normal prefill (mismatches so far: %d)",
                request.request_id,
                len(mem),
                self.metrics["mismatch"],
            )
            return None
        return ref, mem

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by vLLM's scheduler for a waiting request, each time it tries to schedule it, after the local
        prefix-cache lookup (``num_computed_tokens`` tokens hit). Returns (memory tokens beyond those that this
        connector will load, whether the load is asynchronous); (0, False) for a normal prefill. The last prompt
        token is never loaded: vLLM must compute it to produce logits."""
        self._matched.pop(request.request_id, None)
        if request.request_id in self._refused:  # its load failed once: vLLM recomputes, it is not tried again
            return 0, False
        checked = self._check(request)
        if checked is None:
            return 0, False
        ref, mem = checked
        end = min(len(mem), request.num_prompt_tokens - 1)
        ext = end - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._matched[request.request_id] = (ref, num_computed_tokens, ids_digest(mem))
        return ext, self.settings.async_load

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called by vLLM's scheduler for each request it schedules from the waiting queue, once the request's
        blocks are allocated (the step of ``get_num_new_matched_tokens``; for an asynchronous load again when the
        load is done, then with no external tokens). Queues the load for this step's metadata and counts it;
        returns nothing."""
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        ref, first, digest = matched
        asynchronous = self.settings.async_load
        if asynchronous:
            self._loading.add(request.request_id)
        block_ids = list(blocks.get_block_ids()[0])
        self._pending.append(
            KvmemLoad(
                request.request_id,
                ref,
                block_ids,
                first,
                num_external_tokens,
                request.num_prompt_tokens,
                digest,
                asynchronous,
            )
        )
        self._count("requests_injected")
        self._count("tokens_injected", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvmemConnectorMetadata:
        """Called by vLLM's scheduler at the end of each scheduling step. Returns the step's loads (sent to the
        workers with the scheduler output) and forgets them."""
        meta = KvmemConnectorMetadata(self._pending)
        self._pending = []
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Called by vLLM's scheduler with the workers' report of a step (``KVConnectorOutput``). Requests whose
        asynchronous load failed get a plain prefill from now on; returns nothing."""
        failed = set(getattr(connector_output, "failed_recving", None) or ()) & self._loading
        if failed:
            self._refused |= failed
            self._count("load_failed", len(failed))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called by vLLM's scheduler once when a request finishes or is aborted, before its blocks are freed. Drops
        any state for the request. An asynchronous load not yet sent to the worker still goes: vLLM keeps the
        blocks until the worker reports it done. Returns (False: vLLM frees the blocks, no transfer params)."""
        self._matched.pop(request.request_id, None)
        self._refused.discard(request.request_id)
        self._loading.discard(request.request_id)
        self._pending = [ld for ld in self._pending if ld.req_id != request.request_id or ld.asynchronous]
        return False, None
