"""A vLLM v1 KV connector that serves kvmem memory by KV injection (stock vLLM, loaded by module path).

Load it with ``KVTransferConfig(kv_connector="KvmemConnector", kv_connector_module_path=
"kvmem.engines.vllm_connector", kv_role="kv_consumer")``. A request opts in through
``SamplingParams(extra_args={"kv_transfer_params": {"kvmem": {...}}})``::

    {"store": "/path/to/store", "user": "conv-26", "version": "<store.version(user)>",
     "fact_ids": ["D1:3", ...],   # injected order
     "start": 0,                  # virtual position of the first header token (vLLM numbers the prompt from 0)
     "parts": [[user, version], ...]}  # only for memory of several entity scopes (``UserKV.union``); then
                                       # "user" and "version" are the union's, and each part's version is checked

and ``cache_salt = kvmem_cache_salt(store_id, user, version)`` on the prompt (``store_id``: the store manifest's).

Scheduler side (engine-core process): checks that the prompt starts with exactly the composed memory token ids
(store header ids + the facts' token ids from the store metadata), that the memory version is still the store's
and that the request carries the user+version cache salt; then reports the memory tokens (minus the last prompt
token, which vLLM must compute) beyond any local prefix-cache hit as externally computed, loaded synchronously.
Anything else falls back to a normal prefill and is counted in ``KvmemConnector.metrics`` (logged, and written
to ``kv_connector_extra_config["metrics_file"]`` when set).

Worker side (model-runner process): opens the store itself (cached per process, per user version), composes
``[header][facts]`` with chunked RoPE at the virtual positions (``compose(Rotary.from_config(hf_config), ...)``)
and writes K/V into the request's paged blocks through the attention backend's own
``layer.impl.do_kv_cache_update`` with ``slot = block_id * block_size + offset`` before the forward pass.
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
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..compose import compose
from ..models import MANIFEST, head_dim, weights_hash
from ..rope import LENGTH_DEPENDENT, Rotary, rope_type
from ..rows import canonical, within
from ..store import Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvmem.vllm_connector")

PARAMS_KEY = "kvmem"


def kvmem_cache_salt(store_id: str, user: str, version: str, tail: bool = False) -> str:
    """The prefix-cache salt a kvmem request must carry: covers the store (a random id made at its creation, so
    two stores, or a store re-created at the same path, never share one), the user and the memory version.
    ``tail``: the prompt goes on with more retrieved facts that the engine recomputes (tail recompute); their
    blocks hold prefilled, not stored, KV, so such prompts get their own cache namespace (with the injected
    length added by ``tail_salt``) and never share blocks with plain injection."""
    return f"kvmem:{store_id}:{user}:{version}" + (":tail" if tail else "")


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
) -> dict:
    """``kv_transfer_params`` for a request whose prompt starts with ``[header][facts fact_ids...]``.
    ``memory_tokens``: set for tail recompute (the prompt continues with recomputed facts): the injected length,
    which the cache salt must carry. ``parts``: for memory drawn from several entity scopes (``UserKV.union``),
    each scope's (user, version); ``user`` and ``version`` are then the union's."""
    p = {"store": str(store), "user": user, "version": version, "fact_ids": list(fact_ids), "start": int(start)}
    if memory_tokens is not None:
        p["memory_tokens"] = int(memory_tokens)
    if parts is not None and len(parts) > 1:
        p["parts"] = [[u, v] for u, v in parts]
    return {PARAMS_KEY: p}


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


@dataclass
class KvmemConnectorMetadata(KVConnectorMetadata):
    loads: list[KvmemLoad] = field(default_factory=list)


class KvmemConnector(KVConnectorBase_V1):
    """kvmem memory injection for stock vLLM (synchronous load, all layers before the forward pass)."""

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
        self._identity = engine_identity(vllm_config)
        self._trusted: dict[tuple[str, str], str | None] = {}  # (root, store_id) -> None if it matches, else why
        # scheduler side
        self._matched: dict[str, tuple[dict, int, str]] = {}  # req_id -> (params, local computed tokens, ids hash)
        self._pending: list[KvmemLoad] = []
        self.metrics: Counter = Counter()
        # worker side
        self._rotary = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._reported = 0.0
        self._num_layers = (getattr(self._hf_config, "text_config", None) or self._hf_config).num_hidden_layers

    @classmethod
    def scheduler_only(cls, stores: list[str | Path], identity: dict) -> KvmemConnector:
        """The scheduler side alone, without a vLLM config: for tests of its matching rules. ``stores``: the
        allowed store directories; ``identity``: the engine's ``weights_sha256`` and ``dtype``."""
        conn = object.__new__(cls)
        conn.metrics, conn._metrics_file, conn._trusted, conn._matched = Counter(), None, {}, {}
        conn._allowed = [canonical(p) for p in stores]
        conn._identity = dict(identity)
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

    def _check(self, request: Request) -> tuple[dict, int] | None:
        """(params, memory length) if ``request`` may take injected memory, else None (counted)."""
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
            mem = memory_token_ids(p)
            want = kvmem_cache_salt(
                _store(str(p["store"])).manifest["store_id"], p["user"], p["version"], tail="memory_tokens" in p
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
        return p, mem

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        checked = self._check(request)
        if checked is None:
            return 0, False
        p, mem = checked
        # vLLM must compute at least the last prompt token to produce logits.
        end = min(len(mem), request.num_prompt_tokens - 1)
        ext = end - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._matched[request.request_id] = (p, num_computed_tokens, ids_digest(mem))
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        p, first, digest = matched
        block_ids = list(blocks.get_block_ids()[0])
        self._pending.append(
            KvmemLoad(request.request_id, p, block_ids, first, num_external_tokens, request.num_prompt_tokens, digest)
        )
        self._count("requests_injected")
        self._count("tokens_injected", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmemConnectorMetadata(self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted: drop any state for the request; the blocks are vLLM's to free."""
        self._matched.pop(request.request_id, None)
        self._pending = [ld for ld in self._pending if ld.req_id != request.request_id]
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

    def _rot(self):
        if self._rotary is None:
            self._rotary = Rotary.from_config(self._hf_config)
        return self._rotary

    def _compose(self, ld: KvmemLoad):
        """The load's composed memory, after the worker's own checks: allowed store, matching fingerprint, the
        exact version (one snapshot), and the ids the scheduler verified. Raises on any mismatch."""

        p = ld.params
        why = self._untrusted(str(p["store"]))
        if why:
            raise PermissionError(why)
        st = _store(p["store"])
        ukv = st.snapshots(_parts(p))  # raises if replaced; compose reads only the gathered facts
        rows = ukv.row_of()
        memory = compose(
            self._rot(),
            st.header_token_ids,
            st.header_kv(),
            ukv,
            [rows[f] for f in p["fact_ids"]],
            start=int(p.get("start", 0)),
            served_len=ld.served_len,
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

    @torch.inference_mode()
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmemConnectorMetadata) or not meta.loads:
            return
        from vllm.model_executor.models.utils import extract_layer_index

        layers = []
        for name, layer in forward_context.no_compile_layers.items():
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
        bs = self._block_size
        complete = {idx for idx, _, _ in layers} == set(range(self._num_layers))
        for ld in meta.loads:
            try:
                if not complete:
                    raise RuntimeError(
                        f"only layers {sorted(i for i, _, _ in layers)} of {self._num_layers} can be written"
                    )
                memory = self._compose(ld)
                pos = torch.arange(ld.first, ld.first + ld.count)
                blocks = torch.tensor(ld.block_ids, dtype=torch.long)
                for idx, layer, kv_cache in layers:
                    slots = (blocks[pos // bs] * bs + pos % bs).to(kv_cache.device)
                    # [H, m, D] -> [T, H, D], the layout the attention layer hands to its cache update.
                    key = memory.keys[idx][:, ld.first : ld.first + ld.count].transpose(0, 1)
                    value = memory.values[idx][:, ld.first : ld.first + ld.count].transpose(0, 1)
                    key = key.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
                    value = value.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
                    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
            except Exception as exc:  # this request's load fails; vLLM recomputes its blocks, the engine lives on
                logger.warning(
                    "kvmem: load for request %s failed (%s: %s); its memory blocks are recomputed",
                    ld.req_id,
                    type(exc).__name__,
                    exc,
                )
                self._load_errors |= self._block_ids_of(ld)
        self._report_reads()

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
