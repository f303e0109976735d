"""Latent attention (DeepSeek V2 / V3) on stock vLLM + the kvmem connector, on CPU, fp32, random weights.

vLLM's CPU MLA kernel takes kv_lora_rank 512 with qk_rope_head_dim 64 only, so the models here have those widths
and tiny everything else (hidden 256, 4 heads, 2 layers: layer 0 dense, layer 1 MoE). V2 without q_lora_rank, V3
with it. The connector writes the memory's latent rows [c_kv | k_pe] into vLLM's MLA cache, k_pe rotated by
vLLM's own rotary (``engines.vllm.latent``); a joint injection must give vLLM's own prompt prefill: the same raw
logits (max |dlogit| <= 1e-5 x max |logit| over each step's top logits) and the same 20 greedy tokens.

Each configuration runs in its own subprocess (this file run as a script) holding one in-process engine for all
cases; the test process builds the model and store, computes the transformers-engine references and asserts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import random_ids, tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 20
TOP = 20  # raw logits compared per step
REL_TOL = 1e-5
ORDER = ["f2", "f0", "f3", "f1"]
MLA = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    common=dict(hidden_size=256, intermediate_size=256, initializer_range=0.1),  # varied greedy tokens
)
CONFIGS = {
    # vLLM routes DeepSeek's experts by groups always (deepseek_v2.py: use_grouped_topk=True): one group of all
    "deepseek_v2": dict(q_lora_rank=None, n_group=1, topk_group=1),
    # vLLM builds the router's correction bias that transformers' V3 checkpoint holds only for noaux_tc
    "deepseek_v3": dict(topk_method="noaux_tc"),
}


def build(tmp: Path, family: str) -> dict:
    """The tiny model saved for vLLM, and a store of three users with the same fact token ids: joint (one
    prefill of the whole memory), indep (each fact encoded after the header alone), random (noise)."""
    from kvmem.compose import compose
    from kvmem.encode import encode_spans
    from kvmem.engines.hf import HFEngine
    from kvmem.models import kv_identity, weights_hash
    from kvmem.rope import Rotary
    from kvmem.store import FactRecord, Store

    model = tiny_model(family, **MLA, **CONFIGS[family])
    mdir = tmp / "model"
    model.save_pretrained(mdir)
    header = random_ids(12, seed=20)
    facts = {f"f{i}": random_ids(14 + 3 * i, seed=30 + i) for i in range(4)}
    query = random_ids(7, seed=40)
    fp = {
        "model": str(mdir),
        "architecture": family,
        "weights_sha256": weights_hash(mdir),
        "dtype": "float32",
        **kv_identity(model.config),
    }
    (hkv,) = encode_spans(model, [header], [(0, len(header))])
    store = Store.create(tmp / "store", fp, "", header, hkv.keys, hkv.values, {"name": "none"})

    def put(user: str, kvs: list) -> str:
        rs = [FactRecord(fid, user, fid, "", "", "", tuple(ids), 0, 0) for fid, ids in facts.items()]
        return store.writes.put_user(user, rs, [k for k, _ in kvs], [v for _, v in kvs], torch.zeros(len(rs), 4), 0)

    joint_ids = header + [t for f in ORDER for t in facts[f]]
    (jkv,) = encode_spans(model, [joint_ids], [(0, len(joint_ids))])
    spans, off = {}, len(header)
    for f in ORDER:
        spans[f] = (off, off + len(facts[f]))
        off += len(facts[f])
    versions = {
        "joint": put("joint", [(jkv.keys[:, :, a:b], jkv.values[:, :, a:b]) for a, b in (spans[f] for f in facts)])
    }
    ind = encode_spans(
        model,
        [header + ids for ids in facts.values()],
        [(len(header), len(header) + len(ids)) for ids in facts.values()],
    )
    versions["indep"] = put("indep", [(s.keys, s.values) for s in ind])
    g = torch.Generator().manual_seed(7)
    noise = [(torch.randn(s.keys.shape, generator=g), torch.randn(s.values.shape, generator=g)) for s in ind]
    versions["random"] = put("random", [(k * s.keys.std(), v * s.values.std()) for (k, v), s in zip(noise, ind)])
    store.close()
    # transformers-engine references: the prompt, and indep's memory injected into its cache
    st = Store.open(tmp / "store")
    engine = HFEngine(model, eos_token_ids=[])
    ukv = st.reads.snapshot("indep")
    rows = ukv.row_of()
    mem = compose(Rotary.for_model(model), header, st.reads.header_kv(), ukv, [rows[f] for f in ORDER])
    assert mem.token_ids == joint_ids
    refs = {"indep": engine.run(query, mem, "kv", STEPS).token_ids, "prompt": engine.run(query, mem, "prompt", STEPS)}
    refs["prompt"] = refs["prompt"].token_ids
    st.close()
    return {
        "model": str(mdir),
        "store": str(tmp / "store"),
        "memory": joint_ids,
        "query": query,
        "versions": versions,
        "hf": refs,
    }


def run_engine(spec_path: str) -> None:
    """Subprocess entry: one in-process engine, every case, results to <spec dir>/result.json."""
    from vllm import SamplingParams

    from kvmem.engines.vllm.engine import VLLMEngine
    from kvmem.engines.vllm.params import MemoryRef
    from kvmem.store import Store

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec_path).parent
    eng = VLLMEngine(
        spec["model"],
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        max_model_len=256,
        in_process=True,
        skip_tokenizer_init=True,
        metrics_file=str(out / "metrics.json"),
        stores=[spec["store"]],
        logprobs_mode="raw_logits",  # the "logprobs" vLLM returns are the raw logits
    )
    sid = Store.open(spec["store"]).manifest["store_id"]
    ids = spec["memory"] + spec["query"]
    results = {}
    for name, user in (("prompt", None), ("joint", "joint"), ("indep", "indep"), ("random", "random")):
        ref = MemoryRef(spec["store"], sid, user, spec["versions"][user], ORDER) if user else None
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=STEPS,
            ignore_eos=True,
            detokenize=False,
            logprobs=TOP,
            extra_args={"kv_transfer_params": ref.to_params()} if ref else None,
        )
        prompt = {"prompt_token_ids": ids, "cache_salt": ref.salt if ref else "cold"}
        (o,) = eng.llm.generate([prompt], sp, use_tqdm=False)
        c = o.outputs[0]
        results[name] = {
            "tokens": list(c.token_ids),
            "cached": o.num_cached_tokens,
            "logits": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs],
        }
    (out / "result.json").write_text(json.dumps(results))


_RUNS: dict[str, dict] = {}


@pytest.fixture(scope="module", params=list(CONFIGS))
def run(request, tmp_path_factory):
    family = request.param
    if family in _RUNS:
        return _RUNS[family]
    tmp = tmp_path_factory.mktemp(f"vllm-{family}")
    spec = build(tmp, family)
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="2")
    proc = subprocess.Popen(
        [sys.executable, __file__, str(tmp / "spec.json")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a run that hangs is killed with its engine, not orphaned
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{family} hung for 600 s: {stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    res = json.loads((tmp / "result.json").read_text())
    res["_metrics"] = json.loads((tmp / "metrics.json").read_text())
    res["_spec"], res["_family"] = spec, family
    _RUNS[family] = res
    return res


def _worst(a: list[dict], b: list[dict]) -> float:
    """max over steps of max |dlogit| / max |logit| on the reference step's top logits (``b``)."""
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(abs(v) for v in y.values())
        worst = max(worst, max(abs(x[t] - v) for t, v in y.items() if t in x) / scale)
        assert len(x.keys() & y.keys()) >= TOP - 1  # (a tie at the edge may swap the last one)
    return worst


def test_latent_joint_injection_equals_vllm_prompt_prefill(run):
    """The jointly encoded memory, written as latent rows into vLLM's MLA cache, gives vLLM's own prefill of the
    same prompt: every memory token injected (vLLM's cached-token count), the same raw logits within 1e-5 of the
    largest and the same 20 greedy tokens."""
    p, j, m = run["prompt"], run["joint"], len(run["_spec"]["memory"])
    assert len(p["tokens"]) == STEPS and len(set(p["tokens"])) > 3, "degenerate greedy path"
    assert (p["cached"], j["cached"]) == (0, m)
    assert j["tokens"] == p["tokens"]
    assert _worst(j["logits"], p["logits"]) <= REL_TOL
    assert run["_metrics"]["requests_injected"] == 3 and run["_metrics"]["tokens_injected"] == 3 * m


def test_latent_independent_facts_equal_hf_engine_injection(run):
    """Facts encoded apart (each after the header alone, at other positions) and injected at the composed positions
    give what the transformers engine gives for the same memory (V2: vLLM's V3 answers its own prompt differently
    from transformers' V3 on these weights, a difference of the two models, not of injection); noise in their
    place changes the answer."""
    i, r, m = run["indep"], run["random"], len(run["_spec"]["memory"])
    assert i["cached"] == m and i["tokens"] != run["prompt"]["tokens"], "indep should differ from the joint prefill"
    assert r["cached"] == m and r["tokens"] != i["tokens"]
    if run["_family"] == "deepseek_v2":
        assert run["_spec"]["hf"]["prompt"] == run["prompt"]["tokens"], "vLLM's model differs from transformers'"
        assert i["tokens"] == run["_spec"]["hf"]["indep"]


if __name__ == "__main__":
    run_engine(sys.argv[1])
