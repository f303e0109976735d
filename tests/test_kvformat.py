"""Quantised KV formats: what a segment records, the bytes it takes, the error it adds, and that a lossy store is
never read, copied or opened as a lossless one."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import random_ids, tiny_model
from kvmem import kvformat
from kvmem.compose import compose
from kvmem.encode import encode_spans
from kvmem.engines.hf import build_cache
from kvmem.rope import Rotary
from kvmem.store import FactRecord, Store, StoreError, StoreMismatch, check_kv_format, copy_store
from kvmem.store.segments import to_file

FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}
HEADER = random_ids(6, seed=99)
LENS = [5, 7, 3, 9, 4, 6]


def _store(root, model, kv_format="native"):
    (hkv,) = encode_spans(model, [HEADER], [(0, 6)])
    st = Store.create(root, FP, "hdr", HEADER, hkv.keys, hkv.values, {"name": "e", "dim": 8}, kv_format=kv_format)
    facts = [
        FactRecord(f"u/{i}", "u", f"fact {i}", "A", "D1:1", "d", tuple(random_ids(n, seed=i)), 0, 0)
        for i, n in enumerate(LENS)
    ]
    kvs = encode_spans(model, [HEADER + list(f.token_ids) for f in facts], [(6, 6 + f.num_tokens) for f in facts])
    emb = torch.nn.functional.normalize(torch.randn(len(facts), 8, generator=torch.Generator().manual_seed(0)), dim=1)
    st.writes.put_user("u", facts, [k.keys for k in kvs], [k.values for k in kvs], emb, window=0)
    return st, kvs


@pytest.mark.parametrize("fmt, tol", [("int8", 0.01), ("fp8", 0.07)])
def test_lossy_segments_record_their_format_and_stay_within_their_error(tmp_path, fmt, tol):
    model = tiny_model("llama")
    st, kvs = _store(tmp_path / "s", model, fmt)
    assert st.kv_format == fmt and st.fingerprint["kv_format"] == fmt
    ukv = st.reads.snapshot("u")
    (seg,) = ukv.segments
    path = st.segment_path("u", seg)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert meta["kvmem_kv_format"] == fmt and json.loads(meta["kvmem_key_groups"]) == LENS
        assert f.get_tensor("keys").dtype == kvformat.LOSSY[fmt]
        L, H, _, D = kvs[0].keys.shape
        assert f.get_tensor("key_scales").shape == (len(LENS), L, H, D)  # per (fact, layer, head, channel)
        assert f.get_tensor("value_scales").shape == (sum(LENS), L, H)  # per (layer, head, token)
    for i, kv in enumerate(kvs):  # each fact alone, then all of them in another order, through the read cache
        k, v = ukv.fact_kv(i)
        assert k.dtype == torch.float32 and k.shape == kv.keys.shape
        for got, want in ((k, kv.keys), (v, kv.values)):
            err = (got - want).abs().amax() / want.abs().amax()
            assert 0 < err < tol, (i, float(err))
    order = [3, 0, 5]
    k, v = ukv.gather(order)
    assert torch.equal(k, torch.cat([ukv.fact_kv(i)[0] for i in order], dim=2))
    assert torch.equal(v, torch.cat([ukv.fact_kv(i)[1] for i in order], dim=2))
    # compaction re-quantises with the same groups: the same integers and scales, so not one value moves
    before = ukv.gather(list(range(len(LENS))))
    st.writes.compact("u")
    st.reads.forget()
    after = st.reads.snapshot("u").gather(list(range(len(LENS))))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_int8_keeps_key_channels_with_outliers_apart():
    """Pre-RoPE keys have outlier channels; per-channel key scales keep them from swamping the rest."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 30, 64, generator=g)
    keys[:, :, :, 5] *= 100.0  # one outlier channel
    values = torch.randn(2, 2, 30, 64, generator=g)
    t, _ = to_file(keys, values, "int8", [30])
    q = t["keys"].float() * t["key_scales"].float()  # [n, L, H, D]
    err = (q.permute(1, 2, 0, 3) - keys).abs()
    normal = torch.ones(64, dtype=torch.bool)
    normal[5] = False
    assert float(err[..., normal].amax()) < 0.01 * float(keys[..., normal].abs().amax())


def test_int8_bytes_per_fact_token_are_about_half_of_bf16(tmp_path):
    """The on-disk size with scales and header, for a 0.5B model's shape (24 layers, 2 KV heads, head_dim 64) and
    24-token facts."""
    from kvmem.store.segments import LocalSegments

    L, H, D, facts, n = 24, 2, 64, 10, 24
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(L, H, facts * n, D, generator=g).bfloat16() for _ in range(2))
    segs = LocalSegments(tmp_path)
    sizes = {}
    for fmt in kvformat.FORMATS:
        segs.put(fmt, *to_file(keys, values, fmt, [n] * facts))
        sizes[fmt] = (tmp_path / fmt).stat().st_size
    bf16 = facts * n * L * H * D * 2 * 2
    assert sizes["native"] == pytest.approx(bf16, rel=0.01)
    assert sizes["int8"] / bf16 <= 0.53 and sizes["fp8"] / bf16 <= 0.53, sizes


def test_a_lossy_store_is_never_opened_or_copied_as_lossless(tmp_path):
    model = tiny_model("llama")
    st, _ = _store(tmp_path / "s", model, "int8")
    st.close()
    Store.open(tmp_path / "s", FP).close()  # a model's fingerprint: it can read any format
    with pytest.raises(StoreMismatch, match="format int8, not native"):
        Store.open(tmp_path / "s", {**FP, "kv_format": "native"})
    with pytest.raises(StoreError, match="only be copied as int8"):
        copy_store(tmp_path / "s", tmp_path / "plain", kv_format="native")
    assert not Store.exists(tmp_path / "plain")
    st = Store.open(tmp_path / "s")
    with pytest.raises(StoreError, match="holds KV in format int8"):
        check_kv_format(st, "fp8")
    check_kv_format(st, "int8")
    check_kv_format(st, None)
    with pytest.raises(ValueError, match="unknown KV format 'int4'"):
        check_kv_format(st, "int4")


def test_a_native_store_copies_into_int8_and_answers_like_it(tmp_path):
    """copy --kv-format int8 of a native store: the same facts, KV within int8's error, and logits after injection
    within a small distance of the lossless store's."""
    model = tiny_model("llama")
    native, _ = _store(tmp_path / "s", model)
    report = copy_store(tmp_path / "s", tmp_path / "q", kv_format="int8")
    assert report["facts"] == len(LENS)
    quant = Store.open(tmp_path / "q", FP)
    assert quant.kv_format == "int8" and quant.manifest["store_id"] != native.manifest["store_id"]
    rot = Rotary.for_model(model)
    query = random_ids(8, seed=7)
    logits = {}
    for name, st in (("native", native), ("int8", quant)):
        ukv = st.reads.snapshot("u")
        mem = compose(rot, st.header_token_ids, st.reads.header_kv(), ukv, [4, 1, 2])
        cache = build_cache(model, mem)
        pos = torch.arange(mem.end, mem.end + len(query))[None]
        with torch.no_grad():
            logits[name] = model(torch.tensor([query]), past_key_values=cache, position_ids=pos).logits[0]
    delta = (logits["int8"] - logits["native"]).abs()
    assert 0 < float(delta.amax()) < 0.02 * float(logits["native"].abs().amax()), float(delta.amax())
    assert torch.equal(logits["int8"].argmax(-1), logits["native"].argmax(-1))


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_the_read_cache_holds_stored_bytes_and_counts_evictions(tmp_path, fmt):
    """The in-memory tier keeps facts as stored, so int8 holds 3x more of these fp32 facts in the same bound; what
    it pushes out is counted."""
    model = tiny_model("llama")
    _store(tmp_path / "s", model, fmt)[0].close()
    st = Store.open(tmp_path / "s", cache_bytes=10_000)  # all 34 fp32 tokens take 26 KB, int8 8 KB
    ukv = st.reads.snapshot("u")
    for i in range(len(LENS)):
        ukv.fact_kv(i)
    s = st.reads.cache_stats()
    assert s["kv_misses"] == len(LENS) and s["kv_cache_bytes"] <= 10_000
    if fmt == "native":
        assert s["kv_evictions"] >= 2 and s["kv_evicted_bytes"] > 0
    else:  # every int8 fact fits at once
        assert s["kv_evictions"] == 0 and s["kv_cache_bytes"] < 26_112 / 3
        ukv.gather(list(range(len(LENS))))
        assert st.reads.cache_stats()["kv_hits"] == len(LENS)


def _stored(st, user="u") -> dict[str, torch.Tensor]:
    """The one segment of ``user`` as stored: integers and scales."""
    (seg,) = st.reads.snapshot(user).segments
    with safe_open(st.segment_path(user, seg), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_rewrites_of_a_bf16_lossy_store_keep_every_value(tmp_path, fmt):
    """Compaction and copy rewrite a lossy bf16 store byte for byte: the same integers and scales (they read it
    back in fp32, where dequantisation is exact, and re-quantise with the same groups)."""
    model = tiny_model("llama").bfloat16()
    st, _ = _store(tmp_path / "s", model, fmt)
    first = _stored(st)
    st.writes.compact("u")
    compacted = _stored(st)
    st.close()
    copy_store(tmp_path / "s", tmp_path / "c")
    copied = _stored(Store.open(tmp_path / "c"))
    for name, t in first.items():
        assert torch.equal(t.view(torch.uint8), compacted[name].view(torch.uint8)), name
        assert torch.equal(t.view(torch.uint8), copied[name].view(torch.uint8)), name


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_all_zero_and_tiny_groups_stay_finite(fmt):
    keys = torch.zeros(1, 1, 8, 64)
    keys[..., 3, 5] = 1e-7  # a group far below fp16's smallest normal number
    values = torch.zeros(1, 1, 8, 64)
    t, _ = to_file(keys, values, fmt, [4, 4])
    assert bool((t["key_scales"] > 0).all()) and bool((t["value_scales"] > 0).all())
    k = t["keys"].float() * t["key_scales"].float().repeat_interleave(4, 0)
    assert torch.isfinite(k).all() and torch.isfinite(t["values"].float()).all()
    assert float(k.abs().max()) < 1e-4
