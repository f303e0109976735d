"""A vLLM v1 KV connector that serves kvmem memory by KV injection (stock vLLM, loaded by module path).

Load it with ``KVTransferConfig(kv_connector="KvmemConnector", kv_connector_module_path=
"kvmem.engines.vllm_connector", kv_role="kv_consumer")``. A request opts in through
``SamplingParams(extra_args={"kv_transfer_params": {"kvmem": {...}}})``::

    {"store": "/path/to/store", "user": "conv-26", "version": "<store.version(user)>",
     "fact_ids": ["D1:3", ...],   # injected order
     "start": 0,                  # virtual position of the first header token (vLLM numbers the prompt from 0)
     "parts": [[user, version], ...],  # only for memory of several entity scopes (``UserKV.union``); then
                                       # "user" and "version" are the union's, and each part's version is checked
     "kv_format": "int8"}              # only for a lossy store (``kvformat``): the format the caller expects

and ``cache_salt = kvmem_cache_salt(store_id, user, version)`` on the prompt (``store_id``: the store manifest's).

Scheduler side (engine-core process): checks that the prompt starts with exactly the composed memory token ids
(store header ids + the facts' token ids from the store metadata), that the memory version is still the store's
and that the request carries the user+version cache salt; then reports the memory tokens (minus the last prompt
token, which vLLM must compute) beyond any local prefix-cache hit as externally computed, loaded asynchronously
(vLLM's ``load_kv_async``: the request waits in WAITING_FOR_REMOTE_KVS while the engine steps the others;
``kv_connector_extra_config["async_load"] = False`` loads inside the step instead).
Anything else falls back to a normal prefill and is counted in ``KvmemConnector.metrics`` (logged, and written
to ``kv_connector_extra_config["metrics_file"]`` when set).

Worker side (model-runner process): opens the store itself (cached per process, per user version), composes
``[header][facts]`` with chunked RoPE at the virtual positions (``compose(Rotary.from_config(hf_config), ...)``)
and writes K/V into the request's paged blocks through the attention backend's own
``layer.impl.do_kv_cache_update`` with ``slot = block_id * block_size + offset``. An asynchronous load reads the
facts on one of a few loader threads (store and disk I/O: a slow read holds up no other request), or at once when
this process holds all of them in memory; on a CPU ``get_finished``, on the engine's thread, then composes,
rotates and writes them (on an accelerator the loader does, on its copy stream) and reports the load done (the
blocks are the request's alone until then: vLLM frees an aborted request's blocks only once its load is reported).
A synchronous load does all of it before the forward pass.
Nothing is shared with the API process except what travels in the request and in vLLM's connector metadata.

Isolation: injected blocks become ordinary prefix-cache blocks keyed by token ids *and* the request's cache salt;
the salt covers user and memory version, so blocks are never served to another user or version.

Trust: the stores an engine may read are fixed at engine start (``kv_connector_extra_config["stores"]``: store
directories or folders holding them); a store's fingerprint must match the engine's model (weights, dtype,
shapes) on both sides; the worker re-checks that the ids it composed hash to what the scheduler verified.
Failure isolation: any scheduler-side error is a counted fallback to a normal prefill; any worker-side error
fails only that request's load, reported through ``get_block_ids_with_load_errors`` so vLLM recomputes those
blocks (``kv_load_failure_policy="recompute"``). The engine never dies for one request.
Refused at engine start, until implemented: tensor parallelism > 1, more than one KV-cache group, fp8 KV caches,
and length-dependent RoPE (``dynamic``, ``longrope``: keys rotated for one served length would enter the prefix
cache and be reused at another).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ..compose import compose
from ..models import MANIFEST, head_dim, weights_hash
from ..rope import LENGTH_DEPENDENT, Rotary, rope_type
from ..staging import LayerStager
from ..store import Store, canonical, within

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvmem.vllm_connector")

PARAMS_KEY = "kvmem"
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


def kvmem_cache_salt(
    store_id: str, user: str, version: str, tail: bool = False, kv_format: str = "native", cold: str | None = None
) -> str:
    """The prefix-cache salt a kvmem request must carry: covers the store (a random id made at its creation, so
    two stores, or a store re-created at the same path, never share one), the user and the memory version.
    ``tail``: the prompt goes on with more retrieved facts that the engine recomputes (tail recompute); their
    blocks hold prefilled, not stored, KV, so such prompts get their own cache namespace (with the injected
    length added by ``tail_salt``) and never share blocks with plain injection. ``kv_format``: the KV format the
    request expects (a lossy one is in the salt, so blocks injected from a quantised store are never a prefix-cache
    hit for a request that expects lossless KV). ``cold``: a request's nonce (``kvmem_params``): its blocks are
    no prefix-cache hit for any other request."""
    fmt = "" if kv_format == "native" else f":{kv_format}"
    return f"kvmem:{store_id}:{user}:{version}{fmt}" + (f":cold:{cold}" if cold else "") + (":tail" if tail else "")


def tail_salt(salt: str, memory_tokens: int) -> str:
    """A tail-recompute request's salt: where injection stops is part of what its blocks hold."""
    return f"{salt}:{memory_tokens}"


def kvmem_params(
    store: str,
    user: str,
    version: str,
    fact_ids: list[str],
    start: int = 0,
    memory_tokens: int | None = None,
    parts: list[tuple[str, str]] | None = None,
    kv_format: str = "native",
    cold: str | None = None,
) -> dict:
    """``kv_transfer_params`` for a request whose prompt starts with ``[header][facts fact_ids...]``.
    ``memory_tokens``: set for tail recompute (the prompt continues with recomputed facts): the injected length,
    which the cache salt must carry. ``parts``: for memory drawn from several entity scopes (``UserKV.union``),
    each scope's (user, version); ``user`` and ``version`` are then the union's. ``kv_format``: the store's
    (``Store.kv_format``); both sides refuse a store that holds another. ``cold``: a nonce for a load test's cold
    request: the worker drops the facts from its read cache before reading them, and the salt carries the nonce, so
    nothing of this memory is found in any cache tier."""
    p = {"store": str(store), "user": user, "version": version, "fact_ids": list(fact_ids), "start": int(start)}
    if memory_tokens is not None:
        p["memory_tokens"] = int(memory_tokens)
    if parts is not None and len(parts) > 1:
        p["parts"] = [[u, v] for u, v in parts]
    if kv_format != "native":
        p["kv_format"] = kv_format
    if cold:
        p["cold"] = str(cold)
    return {PARAMS_KEY: p}


def check_kv_format(p: dict, store) -> None:
    """The params' KV format must be the store's: a quantised store is never served to a request that expects
    lossless KV, or the other way round. Raises ValueError."""
    want = p.get("kv_format", "native")
    if want != store.kv_format:
        raise ValueError(f"the request expects {want} KV, the store holds {store.kv_format}")


def _parts(p: dict) -> list[tuple[str, str]]:
    """The (user, version) pairs kvmem params name; a union's must spell its ``user`` and ``version``."""
    if "parts" not in p:
        return [(str(p["user"]), str(p["version"]))]
    parts = [(str(u), str(v)) for u, v in p["parts"]]
    if json.dumps([u for u, _ in parts]) != p["user"] or ",".join(v for _, v in parts) != p["version"]:
        raise ValueError("kvmem params: parts do not spell the union's user and version")
    return parts


# --- per-process store access (each process opens the store itself) -----------------------------------------

_LOCK = threading.Lock()
_STORES: dict[str, Any] = {}
_CACHE_BYTES = [1 << 30]  # each store's cache bound in this process: kv_connector_extra_config["cache_bytes"]
_CACHE_DIR: list[str | None] = [None]  # this process's disk cache of remote segments: ...["cache_dir"]
_FACT_TOKENS: dict[tuple[str, str, str], dict[str, tuple[int, ...]]] = {}


def _store(root: str):
    """This process's handle on the store at ``root``, reopened if the store was re-created there."""

    with _LOCK:
        st = _STORES.get(root)
        if st is None or st.replaced():
            if st is not None:
                st.close()
            st = _STORES[root] = Store.open(root, cache_bytes=_CACHE_BYTES[0], cache_dir=_CACHE_DIR[0])
            for k in [k for k in _FACT_TOKENS if k[0] == root]:
                del _FACT_TOKENS[k]
        return st


def _fact_tokens(root: str, user: str, version: str) -> dict[str, tuple[int, ...]]:
    """fact_id -> token ids for ``user`` at ``version`` (metadata only; no KV is read). The version is checked
    against the store on every call, cached or not: a replaced memory is never served."""
    key = (root, user, version)
    st = _store(root)
    if st.user_info(user)["version"] != version:
        raise LookupError(f"memory version {version} of {user!r} is no longer current")
    got = _FACT_TOKENS.get(key)
    if got is None:
        got = {f.fact_id: f.token_ids for f in st.snapshot(user, version).facts}  # rows only
        with _LOCK:
            for k in [k for k in _FACT_TOKENS if k[:2] == (root, user)]:
                del _FACT_TOKENS[k]
            _FACT_TOKENS[key] = got
    return got


def memory_token_ids(p: dict) -> list[int]:
    """The composed memory token ids ``[header][facts]`` named by kvmem params ``p`` (from the store's metadata)."""
    st = _store(p["store"])
    facts: dict[str, tuple[int, ...]] = {}
    for user, version in _parts(p):
        facts.update(_fact_tokens(p["store"], user, version))
    ids = list(st.header_token_ids)
    for fid in p["fact_ids"]:
        if fid not in facts:
            raise LookupError(f"fact {fid!r} is not in memory version {p['version']} of {p['user']!r}")
        ids.extend(facts[fid])
    return ids


def ids_digest(ids) -> str:
    """What the worker re-checks: SHA-256 of the composed memory token ids the scheduler verified."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def engine_identity(vllm_config) -> dict:
    """The engine model's side of the store fingerprint: weights hash, dtype and KV shapes."""

    mc = vllm_config.model_config
    folder = Path(mc.model)
    manifest = folder / MANIFEST
    weights = json.loads(manifest.read_text())["weights_sha256"] if manifest.exists() else weights_hash(folder)
    cfg = getattr(mc.hf_config, "text_config", None) or mc.hf_config
    return {
        "weights_sha256": weights,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim(cfg),
    }


def check_engine_config(vllm_config, kv_cache_config=None) -> None:
    """Refuse, with one clear error at engine start, what the connector does not implement (module docstring)."""

    par = vllm_config.parallel_config
    if getattr(par, "tensor_parallel_size", 1) > 1 or getattr(par, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvmem connector: tensor/pipeline parallelism > 1 is not supported yet")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype.startswith("fp8"):
        raise ValueError(
            f"kvmem connector: kv_cache_dtype={cache_dtype!r} is not supported yet (its scale would "
            f"be skipped); use the model dtype"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(
            f"kvmem connector: {len(groups)} KV-cache groups (hybrid/sliding-window manager) are not supported yet"
        )
    cfg = vllm_config.model_config.hf_config
    rt = rope_type(getattr(cfg, "text_config", None) or cfg)
    if any(x in rt for x in LENGTH_DEPENDENT):
        raise ValueError(
            f"kvmem connector: RoPE scaling {rt!r} depends on the served length, and injected blocks "
            f"enter vLLM's prefix cache keyed by tokens only; use the transformers engine (--engine hf)"
        )


# --- metadata passed scheduler -> worker ---------------------------------------------------------------------


@dataclass
class KvmemLoad:
    """Write memory tokens ``[first, first+count)`` of a request into its blocks."""

    req_id: str
    params: dict
    block_ids: list[int]
    first: int
    count: int
    served_len: int  # prompt tokens
    ids_sha256: str  # ids_digest of the memory ids the scheduler verified against the prompt
    asynchronous: bool = False  # read on a loader thread (or from memory), reported by ``get_finished``
    store_id: str = ""  # the manifest's id of the store the scheduler verified against (a re-created one differs)


@dataclass
class KvmemConnectorMetadata(KVConnectorMetadata):
    loads: list[KvmemLoad] = field(default_factory=list)


class KvmemConnector(KVConnectorBase_V1):
    """kvmem memory injection for stock vLLM: asynchronous loads by default (reads on loader threads; on a CPU
    writes on the engine's thread when the read is done), or synchronous ones, all layers before the forward pass."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine_config(vllm_config, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._hf_config = vllm_config.model_config.hf_config
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._metrics_file = extra.get("metrics_file")
        if extra.get("cache_bytes"):
            _CACHE_BYTES[0] = int(extra["cache_bytes"])
        if extra.get("cache_dir"):
            _CACHE_DIR[0] = str(extra["cache_dir"])
        self._allowed = [canonical(p) for p in extra.get("stores") or []]
        self._async = bool(extra.get("async_load", True))
        self._profile = bool(extra.get("profile", False))
        self._delays = {str(u): float(d) for u, d in (extra.get("load_delay_s") or {}).items()}
        self._identity = engine_identity(vllm_config)
        self._trusted: dict[tuple[str, str], str | None] = {}  # (root, store_id) -> None if it matches, else why
        # scheduler side
        self._matched: dict[str, tuple[dict, int, str]] = {}  # req_id -> (params, local computed tokens, ids hash)
        self._pending: list[KvmemLoad] = []
        self._refused: set[str] = set()  # requests whose asynchronous load failed: a plain prefill from now on
        self._loading: set[str] = set()  # live requests given an asynchronous load
        self.metrics: Counter = Counter()
        # worker side
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
        self._num_layers = (getattr(self._hf_config, "text_config", None) or self._hf_config).num_hidden_layers

    @classmethod
    def scheduler_only(cls, stores: list[str | Path], identity: dict) -> KvmemConnector:
        """The scheduler side alone, without a vLLM config: for tests of its matching rules and of the worker's
        reads. ``stores``: the
        allowed store directories; ``identity``: the engine's ``weights_sha256`` and ``dtype``."""
        conn = object.__new__(cls)
        conn.metrics, conn._metrics_file, conn._trusted, conn._matched = Counter(), None, {}, {}
        conn._allowed = [canonical(p) for p in stores]
        conn._identity = dict(identity)
        conn._async, conn._refused, conn._pending, conn._loading = True, set(), [], set()
        conn._delays = {}  # and the worker's read rules (``_fetch``, ``_fetch_from_memory``)
        return conn

    def _untrusted(self, root: str) -> str | None:
        """Why the store at ``root`` may not be injected into this engine (not allow-listed at engine start, or
        built by another model/dtype), or None. Judged once per store instance (a store re-created at the same
        path is judged again)."""
        if not within(root, self._allowed):
            return f"store {root} is not among the engine's allowed stores"
        st = _store(root)
        key = (root, st.manifest["store_id"])
        if key not in self._trusted:
            bad = [k for k, v in self._identity.items() if st.fingerprint.get(k) != v]
            self._trusted[key] = f"store {root} was built by another model ({', '.join(bad)} differ)" if bad else None
        return self._trusted[key]

    # ==================== scheduler side ====================

    def _count(self, what: str, n: int = 1) -> None:
        self.metrics[what] += n
        if self._metrics_file:
            try:
                tmp = f"{self._metrics_file}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(dict(self.metrics), f)
                os.replace(tmp, self._metrics_file)
            except OSError as exc:  # a metrics file is never worth the scheduler
                logger.warning("kvmem: cannot write metrics file %s: %s", self._metrics_file, exc)

    def _check(self, request: Request) -> tuple[dict, list[int], str] | None:
        """(params, memory token ids, the store's id) if ``request`` may take injected memory, else None
        (counted)."""
        ktp = getattr(request, "kv_transfer_params", None) or {}
        p = ktp.get(PARAMS_KEY) if isinstance(ktp, dict) else None
        if not p:
            return None
        prompt = list(request.prompt_token_ids or [])
        try:
            if int(p.get("start", 0)) != 0:
                raise ValueError("vLLM numbers prompt positions from 0: kvmem start must be 0")
            if not isinstance(p, dict):
                raise ValueError("kvmem params must be an object")
            why = self._untrusted(str(p["store"]))
            if why:
                self._count("untrusted_store")
                logger.warning("kvmem: request %s: %s; normal prefill", request.request_id, why)
                return None
            check_kv_format(p, _store(str(p["store"])))
            mem = memory_token_ids(p)
            store_id = _store(str(p["store"])).manifest["store_id"]
            want = kvmem_cache_salt(
                store_id,
                p["user"],
                p["version"],
                tail="memory_tokens" in p,
                kv_format=p.get("kv_format", "native"),
                cold=p.get("cold"),
            )
            if "memory_tokens" in p:
                if int(p["memory_tokens"]) != len(mem):
                    raise ValueError(f"memory_tokens {p['memory_tokens']} != the composed memory's {len(mem)}")
                want = tail_salt(want, len(mem))
            if request.cache_salt != want:
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
        return p, mem, store_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        if request.request_id in self._refused:  # its load failed once: vLLM recomputes, it is not tried again
            return 0, False
        checked = self._check(request)
        if checked is None:
            return 0, False
        p, mem, store_id = checked
        # vLLM must compute at least the last prompt token to produce logits.
        end = min(len(mem), request.num_prompt_tokens - 1)
        ext = end - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._matched[request.request_id] = (p, num_computed_tokens, ids_digest(mem), store_id)
        return ext, self._async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        p, first, digest, store_id = matched
        if self._async:
            self._loading.add(request.request_id)
        block_ids = list(blocks.get_block_ids()[0])
        self._pending.append(
            KvmemLoad(
                request.request_id,
                p,
                block_ids,
                first,
                num_external_tokens,
                request.num_prompt_tokens,
                digest,
                self._async,
                store_id,
            )
        )
        self._count("requests_injected")
        self._count("tokens_injected", num_external_tokens)

    def update_connector_output(self, connector_output) -> None:
        """The workers' report of a step: requests whose asynchronous load failed get a plain prefill."""
        failed = set(getattr(connector_output, "failed_recving", None) or ()) & self._loading
        if failed:
            self._refused |= failed
            self._count("load_failed", len(failed))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmemConnectorMetadata(self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted: drop any state for the request; the blocks are vLLM's to free. An asynchronous load
        not yet sent to the worker still goes: vLLM keeps the blocks until the worker reports it done."""
        self._matched.pop(request.request_id, None)
        self._refused.discard(request.request_id)
        self._loading.discard(request.request_id)
        self._pending = [ld for ld in self._pending if ld.req_id != request.request_id or ld.asynchronous]
        return False, None

    # ==================== worker side ====================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        have = {extract_layer_index(n) for n in kv_caches}
        if have != set(range(self._num_layers)):
            raise ValueError(
                f"kvmem connector: the engine has KV caches for layers {sorted(have)}, not all "
                f"{self._num_layers}; partial injection would leave unwritten blocks"
            )
        self._kv_caches = kv_caches
        self._layers = None  # found again, with these tensors

    def _rot(self):
        if self._rotary is None:
            self._rotary = Rotary.from_config(self._hf_config)
        return self._rotary

    def _fetch(self, ld: KvmemLoad) -> dict:
        """The reading half of ``ld``'s load, after the worker's own checks: allowed store, matching fingerprint,
        the exact version (one snapshot), then the gathered facts as stored (``UserKV.read``: the read cache, the
        disk cache or the store). Runs on a loader thread for an asynchronous load. Returns what ``_write`` takes;
        raises on any mismatch or failed read."""
        t0 = time.perf_counter()
        delay = self._delays.get(str(ld.params.get("user")))
        if delay:
            time.sleep(delay)
        p = ld.params
        why = self._untrusted(str(p["store"]))
        if why:
            raise PermissionError(why)
        st = _store(p["store"])
        if ld.store_id and st.manifest["store_id"] != ld.store_id:
            raise LookupError(f"store {p['store']} was re-created since the scheduler checked the request")
        check_kv_format(p, st)
        st.header_kv()  # read once per store, here rather than on the engine's thread
        t1 = time.perf_counter()
        ukv = st.snapshots(_parts(p))  # raises if replaced; only the gathered facts are read
        rows_of = ukv.row_of()
        rows = [rows_of[f] for f in p["fact_ids"]]
        if p.get("cold"):  # a load test's cold request: this process's read cache must not have it either
            st.evict(ukv, rows, memory_only=True)
        stages: dict = {"in_memory": 0}
        spans = ukv.read(rows, stages)
        stages["snapshot"] = (time.perf_counter() - t1) * 1e3 - stages["read"]
        return {"store": st, "user_kv": ukv, "rows": rows, "spans": spans, "stages": stages,
                "ms": (time.perf_counter() - t0) * 1e3}  # fmt: skip

    def _fetch_from_memory(self, ld: KvmemLoad) -> dict | None:
        """``_fetch(ld)`` without I/O or waiting on a lock, when this process holds all of it in memory: the very
        store the scheduler checked, open and judged trusted, the snapshot of exactly the admitted versions, and
        every fact in the read cache (``Store.cached``). A version replaced since the scheduler admitted the
        request is served as admitted: its KV never changes, and the prompt carries its ids. None when anything
        must be read or waited for (the load goes to a loader thread)."""
        p, t0 = ld.params, time.perf_counter()
        if p.get("cold") or self._delays.get(str(p.get("user"))):  # a cold request, or a read held back on purpose
            return None
        root = str(p["store"])
        if not _LOCK.acquire(blocking=False):  # another thread is opening a store: never wait on its I/O here
            return None
        try:
            st = _STORES.get(root)
        finally:
            _LOCK.release()
        if st is None or st.manifest["store_id"] != ld.store_id:
            return None
        if self._trusted.get((root, ld.store_id), "untrusted") is not None:
            return None
        try:
            check_kv_format(p, st)
            got = st.cached(_parts(p), list(p["fact_ids"]))
        except Exception:  # the loader's read raises it properly
            return None
        if got is None:
            return None
        ukv, rows, spans = got
        ms = (time.perf_counter() - t0) * 1e3
        return {"store": st, "user_kv": ukv, "rows": rows, "spans": spans,
                "stages": {"snapshot": 0.0, "read": ms, "in_memory": 1}, "ms": ms}  # fmt: skip

    def _compose(self, ld: KvmemLoad, fetched: dict, rotate: bool = True):
        """The load's composed memory from what ``_fetch`` read, checked against the ids the scheduler verified.
        ``fetched["stages"]`` gets compose's stages (ms). Raises LookupError on a mismatch."""
        st = fetched["store"]
        memory = compose(
            self._rot(),
            st.header_token_ids,
            st.header_kv(),
            fetched["user_kv"],
            fetched["rows"],
            start=int(ld.params.get("start", 0)),
            served_len=ld.served_len,
            timings=fetched["stages"],
            rotate=rotate,
            empty=lambda name, shape, dtype: _scratch(name, shape, dtype, "cpu"),
            spans=fetched["spans"],
        )
        if ids_digest(memory.token_ids) != ld.ids_sha256:
            raise LookupError("composed memory ids differ from the ids the scheduler verified")
        return memory

    def _block_ids_of(self, ld: KvmemLoad) -> set[int]:
        bs = self._block_size
        return {
            ld.block_ids[i] for i in range(ld.first // bs, (ld.first + ld.count - 1) // bs + 1) if i < len(ld.block_ids)
        }

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed in this step: vLLM recomputes them (or fails only those requests)."""
        bad, self._load_errors = self._load_errors, set()
        return bad

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
    def _write(self, ld: KvmemLoad, layers: list, fetched: dict | None = None) -> None:
        """Compose ``ld``'s memory from ``fetched`` (``_fetch(ld)``, read here when None) and write tokens
        ``[first, first+count)`` of it into the request's blocks, every layer. On a CPU this runs on the engine's
        thread, whose op threads are otherwise idle or about to run the next forward: on a loader thread the same
        memory-bound work ran at one thread, beside the engine's busy processes, twice as slow. Raises on any
        failure (nothing is half-trusted: the caller reports all its blocks as failed)."""
        if fetched is None:
            fetched = self._fetch(ld)
        t0 = time.perf_counter()
        if {idx for idx, _, _ in layers} != set(range(self._num_layers)):
            raise RuntimeError(f"only layers {sorted(i for i, _, _ in layers)} of {self._num_layers} can be written")
        stages = fetched["stages"]
        memory = self._compose(ld, fetched, rotate=False)  # pre-RoPE: rotated below, one layer at a time
        self._inject(ld, memory, sorted(layers, key=lambda x: x[0]), stages)  # layers[i] is layer i
        stages["load"] = fetched["ms"] + (time.perf_counter() - t0) * 1e3  # the work, not the wait between
        self.loads.append({"seq": next(self._seq), "req_id": ld.req_id, "tokens": ld.count,
                           "k": len(ld.params["fact_ids"]), "kv_format": ld.params.get("kv_format", "native"),
                           **{k: round(v, 3) for k, v in stages.items()}})  # fmt: skip

    def _inject(self, ld: KvmemLoad, memory, layers: list, stages: dict) -> None:
        """Tokens ``[first, first+count)`` of the pre-RoPE ``memory`` into the request's blocks. Chunks of layers
        are staged to the cache's device (``LayerStager``: one layer at a time on a GPU, all at once on a CPU),
        rotated there, seen in the [T, H, D] layout the attention layer's cache update takes, and written;
        one chunk is written while the next is copied. ``stages`` gets ``rotate`` and ``block_write`` (ms; on a
        device these are the time to queue the work, and ``block_write`` ends when every write has completed)."""
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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmemConnectorMetadata) or not meta.loads:
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
                fetched = self._fetch_from_memory(ld) if on_cpu else None
                if fetched is None:
                    future = self._submit(ld, None if on_cpu else layers)
                else:  # nothing to wait for: written and reported by this step's ``get_finished``
                    future = Future()
                    future.set_result(fetched)
                self._inflight[ld.req_id] = (future, ld, layers)
                continue
            try:
                self._write(ld, layers)
            except Exception as exc:  # one request's failure, never the engine's
                self._failed(ld, exc)
            self._report_loads()
        self._report_reads()

    def _submit(self, ld: KvmemLoad, layers: list | None) -> Future:
        """``ld``'s read (``_fetch``) on a loader thread, and its write into ``layers`` when given; its future,
        whose result is what is left for ``get_finished`` to write (None: nothing). When the pool cannot take it
        (broken, or a new thread cannot start), the load fails like any other and the engine goes on. The work
        item may already be queued when a thread start fails, so it runs only if it was not given up first."""
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():  # given up before it started
                return
            try:
                fetched = self._fetch(ld)
                if layers is not None:
                    self._write(ld, layers, fetched)
                    fetched = None
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(fetched)

        try:
            self._loader.submit(run)
        except Exception as exc:
            self._loader = None  # a new pool for the next load
            if future.cancel():  # not started, and now it never will: the load failed
                future = Future()
                future.set_exception(exc)
        return future

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose asynchronous load ended since the last call), loaded or failed. A load whose
        read has ended is written here, on the engine's thread, before it is reported, unless its request has
        finished (aborted) meanwhile: its blocks are vLLM's to free, so it is only reported."""
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
        """``get_finished``'s loads, with the failed ones also in ``failed_recving``: vLLM then recomputes that
        request's prompt, and the scheduler side does not try its memory again."""
        _, recving = self.get_finished(finished_req_ids)
        failed, self._failed_ids = self._failed_ids, set()
        return KVConnectorTransferResults(finished_recving=set(recving or ()), failed_recving=failed)

    def shutdown(self):
        if self._loader is not None:
            self._loader.shutdown(wait=True)

    def _report_loads(self) -> None:
        """With ``kv_connector_extra_config["profile"]``: the last loads' stages (ms: snapshot, read, dequantize,
        rotate, block_write, load; ``in_memory``: 1 when no read was needed) to ``<metrics_file>.loads``, after
        every load (``kvmem bench profile``)."""
        if not (self._profile and self._metrics_file):
            return
        try:
            tmp = f"{self._metrics_file}.loads.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(list(self.loads), f)
            os.replace(tmp, f"{self._metrics_file}.loads")
        except OSError as exc:
            logger.warning("kvmem: cannot write %s.loads: %s", self._metrics_file, exc)

    def _report_reads(self) -> None:
        """This worker's store reads (its caches' hits, misses, bytes: ``Store.cache_stats``) to
        ``<metrics_file>.worker``, at most once a second, for the server's ``/metrics``."""
        if not self._metrics_file or time.monotonic() - self._reported < 1.0:
            return
        self._reported = time.monotonic()
        total: Counter = Counter()
        with _LOCK:
            for st in _STORES.values():
                total.update(st.cache_stats())
        try:
            tmp = f"{self._metrics_file}.worker.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(dict(total), f)
            os.replace(tmp, f"{self._metrics_file}.worker")
        except OSError as exc:
            logger.warning("kvmem: cannot write metrics file %s.worker: %s", self._metrics_file, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return
