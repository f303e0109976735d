"""The class vLLM loads by path: ``KvmemConnector``, a thin ``KVConnectorBase_V1`` that hands each hook to its side.

Load it with ``KVTransferConfig(kv_connector="KvmemConnector", kv_connector_module_path="kvmem.engines.vllm.connector",
kv_role="kv_consumer", kv_load_failure_policy="recompute")`` (``engine.engine_kwargs`` does). vLLM builds one
connector per role: in the engine-core process the scheduler side (``scheduler.KvmemScheduler``: which requests take
injected memory), in each model-runner process the worker side (``worker.KvmemWorker``: reads, composes and writes
the memory's KV). The two share nothing but what a request carries (``params.MemoryRef``, its cache salt) and the
scheduler's per-step metadata (``metadata.KvmemConnectorMetadata``).

Isolation: injected blocks become ordinary prefix-cache blocks keyed by token ids *and* the request's cache salt;
the salt covers store, user and memory version (``params.kvmem_cache_salt``), so blocks are never served to another
user or version. Trust: the stores an engine may read are fixed at engine start (``kv_connector_extra_config
["stores"]``); a store's fingerprint must match the engine's model on both sides; the worker re-checks that the ids
it composed hash to what the scheduler verified. Failure isolation: any scheduler-side error is a counted fallback
to a normal prefill; any worker-side error fails only that request's load. Refused at engine start
(``config.check_engine_config``), until implemented: tensor parallelism > 1, more than one KV-cache group, fp8 KV
caches and length-dependent RoPE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from . import stores
from .config import Settings, check_engine_config
from .metadata import KvmemConnectorMetadata
from .scheduler import KvmemScheduler
from .worker import KvmemWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvmemConnector(KVConnectorBase_V1):
    """kvmem memory injection for stock vLLM. Built by vLLM once per role; ``scheduler`` or ``worker`` is the side
    this process runs (the other is None), and each hook below hands over to it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        """Called by vLLM at engine start, in the engine-core process (role SCHEDULER) and in each model-runner
        process (role WORKER). Raises ValueError for a configuration the connector does not implement."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine_config(vllm_config, kv_cache_config)
        settings = Settings.of(vllm_config)
        stores.configure(settings.cache_bytes, settings.cache_dir)
        self.scheduler = KvmemScheduler(settings) if role == KVConnectorRole.SCHEDULER else None
        self.worker = KvmemWorker(vllm_config, settings) if role == KVConnectorRole.WORKER else None

    # --- scheduler side (engine-core process) ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``KvmemScheduler.get_num_new_matched_tokens``."""
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``KvmemScheduler.update_state_after_alloc``."""
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """``KvmemScheduler.build_connector_meta``."""
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        """``KvmemScheduler.update_connector_output``."""
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``KvmemScheduler.request_finished``."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # --- worker side (model-runner processes) ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """``KvmemWorker.register_kv_caches``."""
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """``KvmemWorker.start_load_kv`` with the metadata vLLM bound for this step (nothing to do without
        kvmem's)."""
        assert self.worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvmemConnectorMetadata):
            self.worker.start_load_kv(meta, forward_context)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``KvmemWorker.get_finished``."""
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``KvmemWorker.get_transfer_results``."""
        assert self.worker is not None
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """``KvmemWorker.get_block_ids_with_load_errors``."""
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by vLLM's attention layers before each layer's forward: nothing to wait for (every load is
        written before the forward reads it, or the request is not scheduled until it is). Returns None."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Called by vLLM's attention layers after each layer's forward: a consumer saves nothing. Returns None."""
        return

    def wait_for_save(self) -> None:
        """Called by vLLM's model runner after each step's forward: nothing was saved. Returns None."""
        return

    # --- both sides ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Called by vLLM when the engine core (scheduler side) or a worker process shuts down: the worker side
        waits for its loader threads; the scheduler side holds nothing to release."""
        if self.worker is not None:
            self.worker.shutdown()
