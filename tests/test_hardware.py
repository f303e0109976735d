"""The machine decides the dtype and the engine: every rule checked on injected CPU facts (both answers), plus
the real detection under the AVX2 emulation variables, KV-cache sizing per dtype, and per-layer encode progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvmem import hardware
from kvmem.store import Write

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from kvmem.hardware import CpuFacts, EngineUnavailable, choose_dtype, plan, resolve_dtype, resolve_engine, vllm_kernels

ZEN3 = CpuFacts(
    "AMD EPYC 7B13 (Zen 3)",
    "AVX2",
    avx2=True,
    avx512=False,
    avx512_bf16=False,
    amx=False,
    onednn_max_isa="",
    cuda=False,
    cores=2,
)
GENOA = CpuFacts(
    "AMD EPYC 9B14 (Zen 4)",
    "AVX512",
    avx2=True,
    avx512=True,
    avx512_bf16=True,
    amx=False,
    onednn_max_isa="",
    cuda=False,
    cores=2,
)
SAPPHIRE = CpuFacts(
    "Intel Xeon (Sapphire Rapids)",
    "AVX512",
    avx2=True,
    avx512=True,
    avx512_bf16=True,
    amx=True,
    onednn_max_isa="",
    cuda=False,
    cores=2,
)
SKYLAKE = CpuFacts(
    "Intel Xeon (Skylake)",
    "AVX512",
    avx2=True,
    avx512=True,
    avx512_bf16=False,
    amx=False,
    onednn_max_isa="",
    cuda=False,
    cores=2,
)
OLD = CpuFacts(
    "no AVX2", "DEFAULT", avx2=False, avx512=False, avx512_bf16=False, amx=False, onednn_max_isa="", cuda=False, cores=2
)


@pytest.mark.parametrize(
    "facts,dtype,kernels",
    [
        (ZEN3, "float32", "AVX2 (vllm._C_AVX2)"),
        (SKYLAKE, "float32", "AVX-512 (vllm._C_AVX512)"),
        (GENOA, "bfloat16", "AVX-512 + BF16 (vllm._C)"),
        (SAPPHIRE, "bfloat16", "AVX-512 + BF16 (vllm._C)"),
        (replace(ZEN3, cuda=True), "bfloat16", "AVX2 (vllm._C_AVX2)"),
        (OLD, "float32", None),
    ],
)
def test_dtype_and_vllm_kernels_per_cpu(facts, dtype, kernels):
    assert choose_dtype(facts)[0] == dtype
    assert vllm_kernels(facts) == kernels


def test_emulation_caps_turn_native_bf16_off():
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16, or torch dispatching at AVX2, make bf16 emulated: fp32."""
    dtype, why = choose_dtype(replace(SAPPHIRE, onednn_max_isa="AVX2"))
    assert dtype == "float32" and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    dtype, why = choose_dtype(replace(GENOA, capability="AVX2"))
    assert dtype == "float32" and "AVX2" in why
    assert choose_dtype(replace(SAPPHIRE, onednn_max_isa="AVX512_CORE_AMX"))[0] == "bfloat16"
    assert "emulated" in choose_dtype(ZEN3)[1]


def test_engine_auto_falls_back_and_vllm_refuses_with_one_line():
    engine, note = resolve_engine("auto", OLD)
    assert engine == "hf" and note.startswith("note: using the transformers engine") and "AVX2" in note
    with pytest.raises(EngineUnavailable, match="--engine vllm cannot run here: vLLM's CPU build needs AVX2"):
        resolve_engine("vllm", OLD)
    assert resolve_engine("hf", OLD) == ("hf", None)
    with pytest.raises(ValueError, match="--engine must be one of auto, vllm, hf"):
        resolve_engine("tgi", OLD)
    p = plan(OLD)
    assert p.engine == "hf" and p.vllm_kernels is None and p.dtype == "float32"


def test_engine_auto_picks_vllm_where_it_runs():
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    assert resolve_engine("auto", ZEN3) == ("vllm", None)
    assert plan(ZEN3).engine == "vllm" and "AVX2" in plan(ZEN3).engine_reason


def test_resolve_dtype_names():
    assert resolve_dtype("bf16") == "bfloat16" and resolve_dtype("fp32") == "float32"
    assert resolve_dtype("torch.float32") == "float32"
    assert resolve_dtype("auto") == resolve_dtype(None) == choose_dtype(hardware.cpu_facts())[0]
    with pytest.raises(ValueError, match="--dtype must be auto"):
        resolve_dtype("int8")


def test_threads_follow_usable_cores():
    n = hardware.configure_threads()
    assert n == hardware.usable_cores() == torch.get_num_threads() >= 1
    assert n <= len(os.sched_getaffinity(0))


def _doctors(*envs: dict) -> list[dict]:
    """``kvmem doctor --json`` in a process per environment, all at once (each imports vLLM: seconds)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvmem.cli", "doctor", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for env in envs
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out) for out, _ in outs]


@pytest.mark.slow
def test_doctor_under_avx2_emulation_says_fp32():
    """The real detection, with the variables that emulate an AVX2 machine on a native-bf16 one."""
    d, plain = _doctors({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, {})
    assert d["dtype"] == "float32" and d["facts"]["capability"] == "AVX2"
    assert plain["dtype"] == choose_dtype(hardware.cpu_facts())[0]
    assert plain["threads"] == hardware.usable_cores()


def test_kv_cache_sizing_per_dtype(tmp_path):
    """gemma3-270m-shaped config: 32,768 tokens of fp32 KV (all 18 layers full-size) need 1.125 GiB, more than
    1 GiB; the context is lowered to what fits instead of vLLM refusing to start."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    import transformers as tf

    from kvmem.engines.vllm.engine import fit_max_model_len, kv_bytes_per_token

    cfg = tf.Gemma3TextConfig(
        num_hidden_layers=18,
        num_key_value_heads=1,
        head_dim=256,
        hidden_size=640,
        num_attention_heads=4,
        max_position_embeddings=32768,
    )
    cfg.save_pretrained(tmp_path)
    assert kv_bytes_per_token(cfg, "float32") == 2 * 18 * 1 * 256 * 4 == 36864
    assert 32768 * 36864 > 1 << 30
    fp32 = fit_max_model_len(tmp_path, "float32", 1 << 30, 32768)
    # 256 tokens of margin: vLLM's block rounding must still hold one full-length request (the 1.5B in fp32
    # failed to start at 18688 tokens of a 18724-token cache)
    assert fp32 == 28672 and (fp32 + 256) * 36864 <= 1 << 30 and fp32 % 256 == 0
    assert fit_max_model_len(tmp_path, "bfloat16", 1 << 30, 32768) == 32768
    with pytest.raises(EngineUnavailable, match="holds 0 tokens"):
        fit_max_model_len(tmp_path, "float32", 1000, 32768)


def test_encode_progress_ticks_per_layer_and_sums_to_tokens():
    from conftest import random_ids, tiny_model
    from kvmem.encode import encode_spans

    model = tiny_model("llama")
    seqs = [random_ids(n, seed=n) for n in (40, 41, 90)]
    ticks = []

    def progress(n):  # like tqdm.update, returns a value; the hooks must not pass it on as the layer's output
        ticks.append(n)
        return True

    plain = encode_spans(model, seqs, [(0, 5)] * 3, max_batch_tokens=100)
    ticked = encode_spans(model, seqs, [(0, 5)] * 3, max_batch_tokens=100, progress=progress)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(plain, ticked))
    assert sum(ticks) == 40 + 41 + 90
    n_batches = 2  # [40, 41] fit 100 padded tokens together, 90 goes alone
    assert len(ticks) == n_batches * model.config.num_hidden_layers


def test_connector_refuses_what_it_does_not_implement():
    """TP > 1, fp8 KV caches, several KV-cache groups, latent attention with vLLM's CPU rotary kernel and
    length-dependent RoPE are refused at engine start with one clear error, not served wrongly; latent attention
    with vLLM's PyTorch rotary is served."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from types import SimpleNamespace as NS

    import transformers as tf

    from kvmem.engines.vllm.config import check_engine_config

    def cfg(tp=1, cache_dtype="auto", rope=None, custom_ops=()):
        hf = tf.LlamaConfig(rope_scaling=rope) if rope else tf.LlamaConfig()
        return NS(
            parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=1),
            cache_config=NS(cache_dtype=cache_dtype),
            model_config=NS(hf_config=hf),
            compilation_config=NS(custom_ops=list(custom_ops)),
        )

    check_engine_config(cfg())  # plain Llama: fine
    check_engine_config(cfg(rope={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="tensor/pipeline parallelism"):
        check_engine_config(cfg(tp=2))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        check_engine_config(cfg(cache_dtype="fp8"))
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        check_engine_config(cfg(), NS(kv_cache_groups=[1, 2]))
    deepseek = cfg()
    deepseek.model_config.hf_config = tf.DeepseekV3Config()
    with pytest.raises(ValueError, match="vLLM's rotary kernel .*'-rotary_embedding'"):
        check_engine_config(deepseek)  # (this machine runs vLLM on its CPU)
    deepseek.compilation_config.custom_ops = ["-rotary_embedding"]
    check_engine_config(deepseek)
    for rope in (
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 32,
            "long_factor": [1.0] * 32,
            "original_max_position_embeddings": 1024,
        },
    ):
        with pytest.raises(ValueError, match=f"RoPE scaling '{rope['rope_type']}' depends on the served length"):
            check_engine_config(cfg(rope=rope))


def test_scheduler_side_errors_are_counted_fallbacks(tmp_path, monkeypatch):
    """Whatever the store raises in the scheduler ("database is locked", a missing or corrupt
    store, malformed params) is a counted fallback to a normal prefill, never an exception into vLLM."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    import sqlite3
    from types import SimpleNamespace as NS

    import store_worker as sw
    from kvmem.engines.vllm import scheduler as vs
    from kvmem.engines.vllm.config import Settings
    from kvmem.engines.vllm.params import MemoryRef, kvmem_cache_salt

    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    version = st.writes.commit(Write("u", facts, kv, kv.copy(), emb))
    identity = {k: st.fingerprint[k] for k in ("weights_sha256", "dtype")}
    conn = vs.KvmemScheduler(Settings(stores=[st.root], identity=identity))
    params = MemoryRef(str(st.root), st.manifest["store_id"], "u", version, [f.fact_id for f in facts]).to_params()
    salt = kvmem_cache_salt(st.manifest["store_id"], "u", version)
    ids = st.header_token_ids + [t for f in facts for t in f.token_ids]

    def request(p=params):
        return NS(
            kv_transfer_params=p,
            prompt_token_ids=ids + [7],
            cache_salt=salt,
            request_id="r",
            num_prompt_tokens=len(ids) + 1,
        )

    assert conn.get_num_new_matched_tokens(request(), 0) == (len(ids), True)  # the good case injects, async
    conn.update_connector_output(NS(failed_recving={"r"}))  # a request with no load in flight: ignored
    assert conn.metrics["load_failed"] == 0
    conn.update_state_after_alloc(request(), NS(get_block_ids=lambda: [[0, 1]]), len(ids))
    conn.update_connector_output(NS(failed_recving={"r"}))  # its load failed on the worker: not tried again
    assert conn.get_num_new_matched_tokens(request(), 0) == (0, False) and conn.metrics["load_failed"] == 1
    conn.request_finished(request(), [])
    assert conn.get_num_new_matched_tokens(request(), 0) == (len(ids), True)
    for fault in (sqlite3.OperationalError("database is locked"), FileNotFoundError("users/u.x.kv.safetensors")):

        def boom(p, *_, fault=fault):
            raise fault

        monkeypatch.setattr(vs, "memory_token_ids", boom)
        assert conn.get_num_new_matched_tokens(request(), 0) == (0, False)
    monkeypatch.undo()
    assert conn.get_num_new_matched_tokens(request({"kvmem": "not an object"}), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request(["not", "a", "dict"]), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request(dict(params, kvmem={**params["kvmem"], "store": "/nope"})), 0) == (
        0,
        False,
    )
    # a store path outside the allow-list is judged before anything opens it: untrusted, not a store error
    assert conn.metrics["store_error"] == 3 and conn.metrics["untrusted_store"] == 1
    assert conn.metrics["requests_injected"] == 1  # the one load allocated above


def test_a_load_whose_facts_are_all_in_memory_is_read_without_a_loader_thread(tmp_path):
    """The worker reads a load on a loader thread unless this process already holds all of it: the very store the
    scheduler checked, trusted, the snapshot of exactly that version, every fact in the read cache. Then the same
    spans come from memory."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from dataclasses import replace

    import store_worker as sw
    from kvmem.engines.vllm.config import Settings
    from kvmem.engines.vllm.metadata import KvmemLoad
    from kvmem.engines.vllm.params import MemoryRef
    from kvmem.engines.vllm.reader import LoadReader

    st = sw.create(tmp_path / "s")
    facts, kv, emb = sw.generation("u", 1)
    version = st.writes.commit(Write("u", facts, kv, kv.copy(), emb))
    settings = Settings(stores=[st.root], identity={k: st.fingerprint[k] for k in ("weights_sha256", "dtype")})
    reader = LoadReader(settings)
    ids = [f.fact_id for f in facts][::-1]
    ref = MemoryRef(str(st.root), st.manifest["store_id"], "u", version, ids)
    ld = KvmemLoad("r", ref, [0], 0, 4, 8, "", True)
    assert reader.trust.why_untrusted(str(st.root)) is None  # the store open in this process and judged trusted
    assert reader.read_from_memory(ld) is None  # but none of its facts read yet
    read = reader.read(ld)
    got = reader.read_from_memory(ld)
    assert got is not None and got.rows == read.rows == [len(ids) - 1 - i for i in range(len(ids))]
    assert all(a is b for a, b in zip(got.spans, read.spans, strict=True))
    assert got.user_kv.version == version and got.stages["snapshot"] == 0.0
    for p in ({"cold": "n1"}, {"version": "0ld"}, {"fact_ids": [*ids, "nope"]}, {"kv_format": "int8"}):
        assert reader.read_from_memory(replace(ld, ref=replace(ref, **p))) is None, p
    # a store re-created at the same path since the scheduler checked the request: neither path serves it
    assert reader.read_from_memory(replace(ld, ref=replace(ref, store_id="another store"))) is None
    with pytest.raises(LookupError, match="re-created"):
        reader.read(replace(ld, ref=replace(ref, store_id="another store")))
    # a read held back on purpose goes to a loader thread
    slow = LoadReader(replace(settings, load_delay_s={"u": 1.0}))
    assert slow.trust.why_untrusted(str(st.root)) is None
    assert slow.read_from_memory(ld) is None


def test_vllms_cpu_rotary_kernel_is_wrong_for_deepseeks_call():
    """Why vLLM on a CPU runs latent attention models with its PyTorch rotary (``config.CPU_ROTARY``): its kernel
    (``RotaryEmbedding.forward_cpu``), called as DeepSeek's MLA layer calls it (k_pe a strided view of the
    [c_kv | k_pe] projection, q_pe of 4 heads against k_pe's one), differs from ``forward_native``; on contiguous
    one-head keys it agrees. When a vLLM release fixes it, this fails and the custom_ops setting can go."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 4096, is_neox_style=False, rope_parameters={"rope_theta": 1e4}, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    kv, q, pos = torch.randn(10, 576, generator=g), torch.randn(10, 4, 96, generator=g), torch.arange(10)
    want_q, want_k = rope.forward_native(pos, q[..., 32:].clone(), kv[:, 512:].clone().unsqueeze(1))
    kv2, q2 = kv.clone(), q.clone()
    got_q, got_k = rope.forward_cpu(pos, q2[..., 32:], kv2[:, 512:].unsqueeze(1))  # in place, as the model calls it
    assert float((got_k - want_k).abs().max()) > 0.1 and float((got_q - want_q).abs().max()) > 0.1
    _, one = rope.forward_cpu(pos, torch.zeros(10, 1, 64), kv[:, 512:].clone().unsqueeze(1))
    assert torch.allclose(one, want_k, atol=1e-5)
