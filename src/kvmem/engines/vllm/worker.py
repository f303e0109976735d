"""The connector's worker side (vLLM's model-runner process): it reads, composes and writes the memory's KV.

For each load the scheduler side sent (``metadata.KvmemLoad``), it reads the facts from the store itself
(``reader.LoadReader``: the store is opened in this process, its fingerprint and the exact version checked),
composes ``[header][facts]`` with chunked RoPE at the virtual positions (``compose(Rotary.from_config(hf_config),
...)``), re-checks that the composed ids hash to what the scheduler verified, and writes K/V into the request's
paged blocks through the attention backend's own ``layer.impl.do_kv_cache_update`` with ``slot = block_id *
block_size + offset``.

An asynchronous load is read on one of a few loader threads (store and disk I/O: a slow read holds up no other
request), or at once when this process holds all of it in memory; on a CPU ``get_finished``, on the engine's thread,
then composes, rotates and writes it (on an accelerator the loader does, on its copy stream) and reports the load
done (the blocks are the request's alone until then: vLLM frees an aborted request's blocks only once its load is
reported). A synchronous load does all of it before the forward pass.

Any failure fails only that request's load: a synchronous one's blocks are reported through
``get_block_ids_with_load_errors`` (vLLM recomputes them, ``kv_load_failure_policy="recompute"``), an asynchronous
one as a failed receive (vLLM recomputes its prompt). The engine never dies for one request.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ...compose import compose
from ...models import is_latent
from ...rope import Rotary
from ...staging import LayerStager
from .config import Settings
from .latent import vllm_rotary, write_latent
from .metadata import KvmemConnectorMetadata, KvmemLoad, ids_digest
from .reader import FactsRead, LoadReader
from .stores import cache_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("kvmem.vllm_connector")  # the name log configurations already select

LOADERS = 4  # worker threads for asynchronous loads: a slow read holds up one, never the others

_SCRATCH = threading.local()


def _scratch(name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """This thread's reusable buffer ``name``, viewed as ``shape`` (contents undefined; grown, never shrunk). A
    load's buffers are tens of MB at large k; fresh ones cost a page fault per 4 KB on first touch, which doubled
    the load's tensor work here."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    n, key = math.prod(shape), (name, dtype, str(device))
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = bufs[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _one_thread_ops() -> None:
    """A loader thread runs its tensor ops on itself alone. Beside the engine's busy processes, a team of OpenMP
    threads waits at every op's barrier for whichever of them the kernel descheduled: on 2 cores that made a load's
    ops 2-4x slower than one thread. OpenMP's thread count is per thread, so the engine's threads, which have run
    ops already, keep theirs; torch's default for threads that have not yet run one becomes 1
    (``torch.set_num_threads`` itself is disabled in vLLM's CPU worker, so its binding is not undone)."""
    try:
        if torch.get_num_threads() > 1:
            torch._C.set_num_threads(1)  # what torch.set_num_threads is, before vLLM's CPU worker replaces it
    except Exception as exc:  # a slower load, never a broken loader
        logger.warning("kvmem: loader threads keep torch's thread count (%s)", exc)


class KvmemWorker:
    """The worker side of ``KvmemConnector`` (module docstring). ``loads``: the last loads' stages (ms) and sizes,
    in the order they finished. ``reader``: how loads are read (by default a ``LoadReader`` of ``settings``)."""

    def __init__(self, vllm_config: VllmConfig, settings: Settings, reader: LoadReader | None = None):
        self.settings = settings
        self.reader = reader if reader is not None else LoadReader(settings)
        self._vllm_config = vllm_config
        self._block_size = vllm_config.cache_config.block_size
        self._hf_config = vllm_config.model_config.hf_config
        self._text_config = getattr(self._hf_config, "text_config", None) or self._hf_config
        self._num_layers = self._text_config.num_hidden_layers
        self._latent = is_latent(self._text_config)  # MLA: rows [c_kv | k_pe] through ``latent.write_latent``
        self._rotary = None
        self._stagers: dict = {}  # device -> LayerStager
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._layers: list | None = None  # (layer index, attention layer, its KV cache), once all are known
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future, KvmemLoad, list]] = {}  # req_id -> its read, the load, layers
        self._failed_ids: set[str] = set()  # asynchronous loads that failed since the last report
        self._aborted: set[str] = set()  # requests that finished while their load was in flight
        self.loads: deque = deque(maxlen=256)  # each load's stages, ms (``_write``), for the metrics file
        self._seq = itertools.count()  # loads numbered in the order they finish
        self._reported = 0.0

    # --- vLLM's worker-side hooks --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called by vLLM's model runner once, after it has allocated the KV caches (layer name -> tensor), before
        any step. Raises ValueError unless every layer has one (a partial injection would leave unwritten
        blocks); returns nothing."""
        from vllm.model_executor.models.utils import extract_layer_index

        have = {extract_layer_index(n) for n in kv_caches}
        if have != set(range(self._num_layers)):
            raise ValueError(
                f"kvmem connector: the engine has KV caches for layers {sorted(have)}, not all "
                f"{self._num_layers}; partial injection would leave unwritten blocks"
            )
        self._kv_caches = kv_caches
        self._layers = None  # found again, with these tensors

    def start_load_kv(self, meta: KvmemConnectorMetadata, forward_context: ForwardContext) -> None:
        """Called by vLLM's model runner in each step with the step's metadata from the scheduler side: before the
        forward pass when the step has synchronous loads, else just after the forward is launched. Writes each
        synchronous load now; starts each asynchronous one (on a loader thread, or from memory), to be written and
        reported by ``get_finished``. Returns nothing; a load's failure fails only its request."""
        if not meta.loads:
            return
        layers = self._attention_layers(forward_context)
        # On a CPU the engine's thread, idle while it waits, composes and writes what a loader read (the loader's
        # ops would compete with it for the same cores); an accelerator's engine thread must keep launching the
        # forward, so there the loader writes too, on its copy stream.
        on_cpu = not layers or layers[0][2].device.type == "cpu"
        for ld in meta.loads:
            if ld.asynchronous:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(
                        max_workers=LOADERS, thread_name_prefix="kvmem-load", initializer=_one_thread_ops
                    )
                read = self.reader.read_from_memory(ld) if on_cpu else None
                if read is None:
                    future = self._submit(ld, None if on_cpu else layers)
                else:  # nothing to wait for: written and reported by this step's ``get_finished``
                    future = Future()
                    future.set_result(read)
                self._inflight[ld.req_id] = (future, ld, layers)
                continue
            try:
                self._write(ld, layers)
            except Exception as exc:  # one request's failure, never the engine's
                self._failed(ld, exc)
            self._report_loads()
        self._report_reads()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called through ``get_transfer_results`` after each step's forward, with the requests that finished in
        the step. Returns (None: this connector sends nothing, the requests whose asynchronous load ended since the last
        call, loaded or failed; None if none). A load whose read has ended is written here, on the engine's thread,
        before it is reported, unless its request has finished (aborted) meanwhile: its blocks are vLLM's to free,
        so it is only reported."""
        self._aborted |= set(finished_req_ids or ()) & self._inflight.keys()
        done = {rid for rid, (future, _, _) in self._inflight.items() if future.done()}
        for rid in done:
            future, ld, layers = self._inflight.pop(rid)
            exc = future.exception()  # a read's or a loader's write's failure, whatever it raised
            if exc is None and future.result() is not None and rid not in self._aborted:
                try:
                    self._write(ld, layers, future.result())
                except Exception as e:  # one request's failure, never the engine's
                    exc = e
            self._aborted.discard(rid)
            if exc is not None:
                self._failed(ld, exc)
        if done:
            self._report_loads()
            self._report_reads()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Called by vLLM's model runner after each step's forward, with the requests that finished in the step.
        Returns ``get_finished``'s
        loads as ``finished_recving``, with the failed ones also in ``failed_recving``: vLLM then recomputes that
        request's prompt, and the scheduler side does not try its memory again."""
        _, recving = self.get_finished(finished_req_ids)
        failed, self._failed_ids = self._failed_ids, set()
        return KVConnectorTransferResults(finished_recving=set(recving or ()), failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by vLLM's model runner after each step's forward, after ``get_transfer_results``. Returns the
        blocks whose synchronous load failed in this step (vLLM recomputes them), and forgets them."""
        bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        """Called by vLLM when the worker process shuts down: waits for the loader threads to finish."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)

    # --- loads ---------------------------------------------------------------------------------------------

    def _rot(self):
        """kvmem's ``Rotary`` of the model, or for latent attention vLLM's own rotary of ``k_pe``
        (``latent.vllm_rotary``)."""
        if self._rotary is None:
            if self._latent:
                self._rotary = vllm_rotary(self._vllm_config, self._text_config)
            else:
                self._rotary = Rotary.from_config(self._hf_config)
        return self._rotary

    def _compose(self, ld: KvmemLoad, read: FactsRead, rotate: bool = True):
        """The load's composed memory from ``read``, checked against the ids the scheduler verified.
        ``read.stages`` gets compose's stages (ms). Raises LookupError on a mismatch."""
        st = read.store
        memory = compose(
            None if self._latent else self._rot(),  # (a latent memory is composed pre-RoPE: no rotary needed)
            st.header_token_ids,
            st.reads.header_kv(),
            read.user_kv,
            read.rows,
            start=ld.ref.start,
            served_len=ld.served_len,
            timings=read.stages,
            rotate=rotate,
            empty=lambda name, shape, dtype: _scratch(name, shape, dtype, "cpu"),
            spans=read.spans,
        )
        if ids_digest(memory.token_ids) != ld.ids_sha256:
            raise LookupError("composed memory ids differ from the ids the scheduler verified")
        return memory

    def _block_ids_of(self, ld: KvmemLoad) -> set[int]:
        bs = self._block_size
        return {
            ld.block_ids[i] for i in range(ld.first // bs, (ld.first + ld.count - 1) // bs + 1) if i < len(ld.block_ids)
        }

    def _attention_layers(self, forward_context) -> list:
        """(layer index, attention layer, the KV cache it writes) of every layer this worker can write: from the
        forward context, or the static one when a step runs no forward (async loads start then too). Kept once
        every layer is found."""
        if self._layers is not None:
            return self._layers
        from vllm.model_executor.models.utils import extract_layer_index

        found = getattr(forward_context, "no_compile_layers", None) or getattr(
            self._vllm_config.compilation_config, "static_forward_context", {}
        )
        layers = []
        for name, layer in found.items():
            kv_cache = getattr(layer, "kv_cache", None)  # the view the layer itself passes to its cache update
            if not torch.is_tensor(kv_cache) or kv_cache.numel() == 0:
                kv_cache = self._kv_caches.get(name)
            impl = getattr(layer, "impl", None)
            if (
                impl is None
                or not hasattr(impl, "do_kv_cache_update")
                or not torch.is_tensor(kv_cache)
                or kv_cache.numel() == 0
            ):
                continue
            layers.append((extract_layer_index(name), layer, kv_cache))
        if {idx for idx, _, _ in layers} == set(range(self._num_layers)):
            self._layers = layers
        return layers

    @torch.inference_mode()
    def _write(self, ld: KvmemLoad, layers: list, read: FactsRead | None = None) -> None:
        """Compose ``ld``'s memory from ``read`` (read here when None) and write tokens ``[first, first+count)`` of
        it into the request's blocks, every layer. On a CPU this runs on the engine's thread, whose op threads are
        otherwise idle or about to run the next forward: on a loader thread the same memory-bound work ran at one
        thread, beside the engine's busy processes, twice as slow. Raises on any failure (nothing is
        half-trusted: the caller reports all its blocks as failed)."""
        if read is None:
            read = self.reader.read(ld)
        t0 = time.perf_counter()
        if {idx for idx, _, _ in layers} != set(range(self._num_layers)):
            raise RuntimeError(f"only layers {sorted(i for i, _, _ in layers)} of {self._num_layers} can be written")
        stages = read.stages
        memory = self._compose(ld, read, rotate=False)  # pre-RoPE: rotated below, one layer at a time
        self._inject(ld, memory, sorted(layers, key=lambda x: x[0]), stages)  # layers[i] is layer i
        stages["load"] = read.ms + (time.perf_counter() - t0) * 1e3  # the work, not the wait between
        self.loads.append({"seq": next(self._seq), "req_id": ld.req_id, "tokens": ld.count,
                           "k": len(ld.ref.fact_ids), "kv_format": ld.ref.kv_format,
                           **{k: round(v, 3) for k, v in stages.items()}})  # fmt: skip

    def _inject(self, ld: KvmemLoad, memory, layers: list, stages: dict) -> None:
        """Tokens ``[first, first+count)`` of the pre-RoPE ``memory`` into the request's blocks. Chunks of layers
        are staged to the cache's device (``LayerStager``: one layer at a time on a GPU, all at once on a CPU),
        rotated there, seen in the [T, H, D] layout the attention layer's cache update takes, and written;
        one chunk is written while the next is copied. ``stages`` gets ``rotate`` and ``block_write`` (ms; on a
        device these are the time to queue the work, and ``block_write`` ends when every write has completed)."""
        if self._latent:
            bs, pos = self._block_size, torch.arange(ld.first, ld.first + ld.count)
            slots = torch.tensor(ld.block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs
            write_latent(
                self._rot(),
                self._text_config,
                memory,
                slice(ld.first, ld.first + ld.count),
                [(layer, kv_cache) for _, layer, kv_cache in layers],
                slots.to(layers[0][2].device),
                stages,
            )
            return
        device = layers[0][2].device
        if device not in self._stagers:
            self._stagers[device] = LayerStager(device)
        stager = self._stagers[device]
        by_index = {idx: (layer, kv_cache) for idx, layer, kv_cache in layers}
        rot, sl = self._rot(), slice(ld.first, ld.first + ld.count)
        bs = self._block_size
        pos = torch.arange(ld.first, ld.first + ld.count)
        slots = (torch.tensor(ld.block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs).to(device)
        dtype, cache_dtype = memory.keys.dtype, layers[0][2].dtype
        cos_sin = {t: rot.cos_sin(memory.positions[sl], t, dtype, device, ld.served_len) for t in set(rot.layer_types)}
        keys, values = stager.pin(memory.keys[:, :, sl]), stager.pin(memory.values[:, :, sl])
        rotate = write = 0.0
        for l0, k, v in stager.chunks(keys, values):
            t = time.perf_counter()
            # rotated in the stored layout (a strided output would be twice as slow), then seen token-major
            # [c, T, H, D]: vLLM's CPU cache update reads through the token and head strides, so there the
            # views go as they are; other kernels get contiguous copies in the cache's dtype
            c, H, T, D = k.shape
            rotated = rot.rotate_layers(k, l0, cos_sin, out=_scratch("rotated", k.shape, dtype, device))
            key, value = rotated.transpose(1, 2), v.transpose(1, 2)
            if stager.cuda or dtype != cache_dtype:
                key = _scratch("key", (c, T, H, D), cache_dtype, device).copy_(key)
                value = _scratch("value", (c, T, H, D), cache_dtype, device).copy_(value)
            t2 = time.perf_counter()
            for i in range(key.shape[0]):
                layer, kv_cache = by_index[l0 + i]
                layer.impl.do_kv_cache_update(layer, key[i], value[i], kv_cache, slots)
            rotate, write = rotate + t2 - t, write + time.perf_counter() - t2
        if stager.cuda:  # on a device the writes are queued: done means written
            torch.cuda.current_stream(device).synchronize()
        stages["rotate"], stages["block_write"] = rotate * 1e3, write * 1e3

    def _failed(self, ld: KvmemLoad, exc: BaseException) -> None:
        """This request's load failed; vLLM recomputes its blocks (a synchronous load's, reported as invalid) or
        the whole prompt (an asynchronous one's, reported as a failed receive), and the engine lives on."""
        logger.warning(
            "kvmem: load for request %s failed (%s: %s); its memory blocks are recomputed",
            ld.req_id,
            type(exc).__name__,
            exc,
        )
        if ld.asynchronous:
            self._failed_ids.add(ld.req_id)
        else:
            self._load_errors |= self._block_ids_of(ld)

    def _submit(self, ld: KvmemLoad, layers: list | None) -> Future:
        """``ld``'s read on a loader thread, and its write into ``layers`` when given; its future, whose result is
        what is left for ``get_finished`` to write (None: nothing). When the pool cannot take it (broken, or a new
        thread cannot start), the load fails like any other and the engine goes on. The work item may already be
        queued when a thread start fails, so it runs only if it was not given up first."""
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():  # given up before it started
                return
            try:
                read = self.reader.read(ld)
                if layers is not None:
                    self._write(ld, layers, read)
                    read = None
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(read)

        try:
            self._loader.submit(run)
        except Exception as exc:
            self._loader = None  # a new pool for the next load
            if future.cancel():  # not started, and now it never will: the load failed
                future = Future()
                future.set_exception(exc)
        return future

    # --- reports to files, read by the server's /metrics and ``kvmem bench profile`` --------------------------

    def _report_loads(self) -> None:
        """With ``Settings.profile``: the last loads' stages (ms: snapshot, read, dequantize, rotate, block_write,
        load; ``in_memory``: 1 when no read was needed) to ``<metrics_file>.loads``, after every load (``kvmem
        bench profile``)."""
        path = self.settings.metrics_file
        if not (self.settings.profile and path):
            return
        try:
            tmp = f"{path}.loads.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(list(self.loads), f)
            os.replace(tmp, f"{path}.loads")
        except OSError as exc:
            logger.warning("kvmem: cannot write %s.loads: %s", path, exc)

    def _report_reads(self) -> None:
        """This worker's store reads (its caches' hits, misses, bytes: ``stores.cache_stats``) to
        ``<metrics_file>.worker``, at most once a second, for the server's ``/metrics``."""
        path = self.settings.metrics_file
        if not path or time.monotonic() - self._reported < 1.0:
            return
        self._reported = time.monotonic()
        total = cache_stats()
        try:
            tmp = f"{path}.worker.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(dict(total), f)
            os.replace(tmp, f"{path}.worker")
        except OSError as exc:
            logger.warning("kvmem: cannot write metrics file %s.worker: %s", path, exc)
