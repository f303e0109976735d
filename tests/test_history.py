"""History encoding: each fact is encoded behind every fact of the user written before it, as a prompt
that lists them all computes it. In fp32: ``encode_chain`` equals a plain prefill of each fact's whole sequence
(tiny random models, with and without a window of turns), it differs from encoding the fact alone, a long write is
split into runs that fit the position budget, and ``Memory(history=True)`` stores, for a fact added later, the KV
of a prefill of ``[header][earlier facts][fact]``."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_is_prefill, random_ids, tiny_model
from kvmem.encode import encode_chain, encode_spans
from kvmem.ingest import history_runs
from kvmem.memory import Memory, MemoryInputError
from kvmem.models import MANIFEST, model_dir
from kvmem.policy import Encoding

FAST = "smollm2-135m-instruct"


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("with_turns", [False, True])
def test_chain_is_a_prefill_of_each_facts_sequence(family, with_turns):
    model = tiny_model(family)
    prefix = random_ids(5, seed=1)
    facts = [random_ids(n, seed=10 + i) for i, n in enumerate((4, 7, 3, 6))]
    turns = [random_ids(n, seed=20 + i) if with_turns else [] for i, n in enumerate((0, 5, 2, 8))]
    got = encode_chain(model, prefix, facts, turns)
    for i, (ids, ctx) in enumerate(zip(facts, turns)):
        before = prefix + sum(facts[:i], []) + ctx
        (want,) = encode_spans(model, [before + ids], [(len(before), len(before) + len(ids))])
        torch.testing.assert_close(got[i].keys, want.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[i].values, want.values, rtol=1e-5, atol=1e-5)
        # what it changes: without the earlier facts the same fact has other values (beyond layer 0)
        (alone,) = encode_spans(model, [prefix + ctx + ids], [(len(prefix) + len(ctx), len(prefix + ctx + ids))])
        if i:
            assert (alone.values[1:] - got[i].values[1:]).abs().max() > 1e-3
        else:
            torch.testing.assert_close(alone.values, got[i].values, rtol=1e-5, atol=1e-5)


def test_chain_refuses_what_it_cannot_encode_exactly():
    model = tiny_model(
        "llama",
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        common={"max_position_embeddings": 64},
    )
    for turns in (None, [[], [6]]):
        with pytest.raises(ValueError, match="fixed-frequency RoPE"):
            encode_chain(model, [1, 2], [[3, 4], [5]], turns)
    for model in (tiny_model("gemma3"), tiny_model("mistral", sliding_window=4)):  # layer types, or a config value
        encode_chain(model, [1, 2], [[3, 4], [5]])  # one pass: exact (the chain is a plain prefill)
        with pytest.raises(ValueError, match="sliding-window"):
            encode_chain(model, [1, 2], [[3, 4], [5]], [[], [6]])
    with pytest.raises(ValueError, match="no tokens"):
        encode_chain(tiny_model("qwen2"), [1, 2], [[3], []], [[], [4, 5]])


def test_history_runs_fit_the_budget():
    facts = [[i] * n for i, n in enumerate((30, 20, 40, 25, 35, 10), start=1)]
    ctx = [[0] * 5 for _ in facts]
    earlier = [[9] * 50, [8] * 30]
    runs = history_runs(10, earlier, facts, ctx, budget=120)
    assert [i for _, idx in runs for i in idx] == list(range(len(facts)))  # every fact once, in order
    for prefix, idx in runs:
        assert len(prefix) <= (120 - 10) // 2  # newest earlier facts, whole, within half the budget
        for j, i in enumerate(idx):
            assert 10 + len(prefix) + sum(len(facts[x]) for x in idx[:j]) + len(ctx[i]) + len(facts[i]) <= 120
    assert runs[0][0] == [8] * 30  # the 50-token fact does not fit beside it: dropped whole, oldest first
    assert runs[1][0][-len(facts[runs[0][1][-1]]) :] == facts[runs[0][1][-1]]  # a run starts behind the last one
    assert len(history_runs(10, [], facts, ctx, budget=10_000)) == 1
    # the earlier facts give way to a fact that fits the budget beside the header (not beside half the budget)
    assert history_runs(10, [[7] * 55], [[1] * 60], [[]], budget=120) == [([], [0])]
    assert history_runs(10, [[7] * 50], [[1] * 60], [[]], budget=120) == [([7] * 50, [0])]  # exactly at the budget
    assert history_runs(10, [[7] * 51], [[1] * 60], [[]], budget=120) == [([], [0])]
    with pytest.raises(ValueError, match="does not fit"):
        history_runs(10, [], [[1] * 200], [[]], budget=120)


def test_budget_split_is_exact_per_run():
    """A split write equals, per run, the chain of that run's prefix: facts after a split see the newest facts
    before it, not all of them."""
    model = tiny_model("qwen2")
    facts = [random_ids(6, seed=30 + i) for i in range(5)]
    runs = history_runs(3, [], facts, [[] for _ in facts], budget=20)
    assert len(runs) > 1
    for prefix, idx in runs:
        got = encode_chain(model, [1, 2, 3] + prefix, [facts[i] for i in idx])
        before = [1, 2, 3] + prefix
        (want,) = encode_spans(model, [before + facts[idx[0]]], [(len(before), len(before) + 6)])
        torch.testing.assert_close(got[0].values, want.values, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def lm_emb():
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder

    return load(FAST, dtype="float32"), Embedder()


def test_memory_history_stores_a_prefill_behind_earlier_facts(tmp_path, lm_emb):
    lm, emb = lm_emb
    mem = Memory(tmp_path / "s", model=lm, embedder=emb, window=0, history=True)
    assert mem.encoding.neighbours == 0  # history replaces the neighbours default
    first = mem.add("Maya moved to Lisbon in 2021.", user_id="maya", infer=False)["results"][0]["id"]
    mem.add("Maya's brother Tom is a pilot.", user_id="maya", infer=False)
    mem.delete(first)  # a deleted fact is no longer history
    mem.add(
        [
            {"role": "user", "content": "Tom flies to Tokyo every month."},
            {"role": "user", "content": "Maya adopted a dog named Biscuit."},
        ],
        user_id="maya",
        infer=False,
    )
    store = mem.store
    assert store.reads.user_info("maya")["history"] is True
    ukv = store.reads.snapshot("maya")
    facts = ukv.facts
    assert len(facts) == 3
    last = len(facts) - 1
    seq = store.header_token_ids + [t for f in facts for t in f.token_ids]
    keys, values = ukv.fact_kv(last)
    assert_is_prefill(lm.model, seq, keys, values)
    plain = Memory(tmp_path / "p", model=lm, embedder=emb, window=0, neighbours=0)
    plain.add("Maya adopted a dog named Biscuit.", user_id="maya", infer=False)
    assert plain.store.reads.user_info("maya")["history"] is False
    assert (plain.store.reads.snapshot("maya").fact_kv(0)[1][1:] - values[1:]).abs().max() > 1e-2


def test_history_and_neighbours_do_not_combine(tmp_path, lm_emb):
    lm, emb = lm_emb
    with pytest.raises(MemoryInputError, match="do not combine"):
        Memory(tmp_path / "x", model=lm, embedder=emb, history=True, neighbours=2)
    with pytest.raises(MemoryInputError, match="history"):
        Memory(tmp_path / "x", model=lm, embedder=emb, history="yes")
    # history alone: no turns between the chain and the fact (turns there measured worse, docs/benchmarks.md)
    mem = Memory(tmp_path / "y", model=lm, embedder=emb, history=True)
    assert mem.encoding == Encoding(0, 0, True)
    assert Memory(tmp_path / "y", model=lm, embedder=emb).encoding == Encoding(5, 4, False)


@pytest.mark.slow
def test_ingest_locomo_history_cli(tmp_path, tiny_locomo):
    """``ingest-locomo --history --window 0`` runs every fact once, in one pass behind the header (encoded tokens =
    header + fact tokens, against m + 1 fact lengths per fact for neighbours), stores the same tokens, and the
    store records the method; with a window each fact's turns are run on top of the chain."""
    import json

    from conftest import kvmem_cli
    from kvmem.store import Store

    def ingest(root, *extra):
        p = kvmem_cli("ingest-locomo", tiny_locomo, "--sample", "conv-26", "--store", root, "--model", FAST, "--json",
                      *extra)  # fmt: skip
        return json.loads(p.stdout.strip().splitlines()[-1])

    hist = ingest(tmp_path / "h0", "--history")  # --window 0 by default
    plain = ingest(tmp_path / "p0", "--neighbours", "0", "--window", "0")
    st = Store.open(tmp_path / "h0")
    assert hist["history"] is True and hist["neighbours"] == 0 and st.reads.user_info("conv-26")["history"] is True
    assert hist["num_fact_tokens"] == plain["num_fact_tokens"] and hist["num_facts"] == plain["num_facts"] > 10
    assert hist["num_encoded_tokens"] == len(st.header_token_ids) + hist["num_fact_tokens"]
    hw = ingest(tmp_path / "h1", "--history", "--window", "1")
    plain1 = ingest(tmp_path / "p1", "--neighbours", "0", "--window", "1")
    turn_tokens = plain1["num_encoded_tokens"] - plain["num_encoded_tokens"]  # the window's turns alone
    last_fact = st.reads.snapshot("conv-26").facts[-1].num_tokens
    # the chain without its last fact, then every fact behind its turns
    assert hw["num_encoded_tokens"] == hist["num_encoded_tokens"] - last_fact + turn_tokens + hist["num_fact_tokens"]


def test_a_users_encoding_is_kept_across_processes(tmp_path, lm_emb):
    """A Memory opened without window/neighbours/history writes each user's new facts the way that user's facts
    were encoded so far (``kvmem memory update`` opens the store with no flags); explicit arguments still win."""
    lm, emb = lm_emb
    mem = Memory(tmp_path / "s", model=lm, embedder=emb, window=0, history=True)
    for f in ("Maya moved to Lisbon in 2021.", "Maya's brother Tom is a pilot.", "Tom flies to Tokyo every month."):
        mem.add(f, user_id="maya", infer=False)
    Memory(tmp_path / "s", model=lm, embedder=emb, window=2, neighbours=3).add(
        "Bo is a cook.", user_id="bo", infer=False
    )
    reopened = Memory(tmp_path / "s", model=lm, embedder=emb)
    first = reopened.get_all(user_id="maya")["results"][0]["id"]
    reopened.update(first, "Maya moved to Porto in 2021.")
    info = reopened.store.reads.user_info("maya")
    assert (info["window"], info["neighbours"], info["history"]) == (0, 0, True)
    reopened.add("Bo bakes bread.", user_id="bo", infer=False)
    info = reopened.store.reads.user_info("bo")
    assert (info["window"], info["neighbours"], info["history"]) == (2, 3, False)
    # the updated fact is now the newest: its KV is a prefill behind the other two live facts, in write order
    store = reopened.store
    ukv = store.reads.snapshot("maya")
    facts = ukv.facts
    assert facts[-1].text == "Maya moved to Porto in 2021." and len(facts) == 3
    seq = store.header_token_ids + [t for f in facts for t in f.token_ids]
    assert_is_prefill(lm.model, seq, *ukv.fact_kv(len(facts) - 1))
    Memory(tmp_path / "s", model=lm, embedder=emb, neighbours=2).add("Maya likes tea.", user_id="maya", infer=False)
    info = store.reads.user_info("maya")
    assert (info["window"], info["neighbours"], info["history"]) == (5, 2, False)  # explicit m: history off
    # switching a user's method takes that method's defaults, not the old method's window
    Memory(tmp_path / "s", model=lm, embedder=emb, history=True).add("Bo grows basil.", user_id="bo", infer=False)
    info = store.reads.user_info("bo")
    assert (info["window"], info["neighbours"], info["history"]) == (0, 0, True)
    Memory(tmp_path / "s", model=lm, embedder=emb, history=False).add("Bo rides a bike.", user_id="bo", infer=False)
    info = store.reads.user_info("bo")
    assert (info["window"], info["neighbours"], info["history"]) == (5, 4, False)


def test_reopened_memory_encodes_in_the_stores_dtype(tmp_path):
    """``kvmem memory update`` has no --dtype: a Memory opened without one encodes in the store's dtype, whatever
    this machine would choose for a new store."""
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.hardware import resolve_dtype

    other = "float32" if resolve_dtype(None) == "bfloat16" else "bfloat16"
    mem = Memory(tmp_path / "s", model=FAST, dtype=other, window=0)
    fid = mem.add("Maya moved to Lisbon.", user_id="maya", infer=False)["results"][0]["id"]
    Memory(tmp_path / "s").update(fid, "Maya moved to Porto.")
    assert Memory(tmp_path / "s").get(fid)["memory"] == "Maya moved to Porto."
