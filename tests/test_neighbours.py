"""Neighbour-aware encoding (the offline half of FusionRAG): each new fact is encoded behind its m most
similar live facts of the same user. In fp32 on the test model: the stored KV of a fact equals a plain prefill of
``[header][neighbours, least similar first][fact]`` (keys compared after rotation to those positions), it differs
from the m = 0 encoding beyond layer 0, and serving injects exactly the same tokens as before (no serving cost)."""

from __future__ import annotations

import pytest
import torch

import store_worker as sw
from conftest import assert_is_prefill, store_backend
from kvmem.ingest import neighbour_prefixes, scope_neighbours
from kvmem.memory import Memory, MemoryInputError
from kvmem.models import MANIFEST, model_dir
from kvmem.policy import check_neighbours

FAST = "smollm2-135m-instruct"
FACTS = [
    "Maya moved to Lisbon in 2021.",
    "Maya's brother Tom is a pilot.",
    "Maya adopted a dog named Biscuit.",
    "Tom flies to Tokyo every month.",
    "Maya teaches chemistry at a school.",
    "Tom's plane is an Airbus A320.",
]


def test_neighbour_prefixes_pick_the_most_similar_others():
    emb = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.8, 0.6]]), dim=1)  # two new facts
    pool = torch.nn.functional.normalize(torch.tensor([[0.0, 1.0], [1.0, 0.1], [0.6, 0.8]]), dim=1)
    prefixes, chosen = neighbour_prefixes(emb, [[10], [11]], pool, [[1], [2], [3]], 2)
    # candidates: pool rows 0..2, then the new facts as 3, 4; never the fact itself; least similar first
    assert chosen == [[4, 1], [1, 2]]
    assert prefixes == [[11, 2], [2, 3]]
    assert neighbour_prefixes(emb, [[10], [11]], None, [], 5)[1] == [[1], [0]]  # capped at the other facts
    assert neighbour_prefixes(emb, [[10], [11]], pool, [[1], [2], [3]], 0)[0] == [[], []]
    # a token budget keeps the most similar neighbours that fit
    long_pool = [[1] * 600, [2] * 500, [3] * 300]
    assert neighbour_prefixes(emb, [[10], [11]], pool, long_pool, 3)[1] == [[2, 4, 1], [3, 1, 2]]
    assert neighbour_prefixes(emb, [[10], [11]], pool, long_pool, 3, max_tokens=700)[1] == [[4, 1], [3, 2]]
    # exact copies add no context: a pool copy of the fact itself, and a second copy of a neighbour, are skipped
    dup_pool = [[2], [10], [2]]  # row 1 copies new fact 0; rows 0 and 2 are the same fact
    assert neighbour_prefixes(emb, [[10], [11]], pool, dup_pool, 3)[1] == [[2, 4], [1, 2]]  # else [2,4,1], [3,1,2]
    for bad in (-1, 33, 1.5, True):
        with pytest.raises(ValueError, match="neighbours"):
            check_neighbours(bad)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder

    lm, emb = load(FAST, dtype="float32"), Embedder()
    out = {}
    for m in (0, 2):
        mem = Memory(tmp_path_factory.mktemp(f"n{m}") / "s", model=lm, embedder=emb, window=0, neighbours=m)
        for f in FACTS:  # one add per fact: each sees only the facts added before it
            mem.add(f, user_id="maya", infer=False)
        out[m] = mem
    return lm, emb, out


def test_neighbour_choice_is_a_top_m_search_that_picks_what_a_full_sort_did():
    """The top-m search (widened while exact copies or the token budget skip candidates) chooses exactly what
    sorting every candidate chose, on a pool with copies and long facts, for a batch of new facts."""
    g = torch.Generator().manual_seed(3)
    pool_n, new_n, m, budget = 400, 16, 4, 40
    pool = torch.nn.functional.normalize(torch.randn(pool_n, 8, generator=g), dim=1)
    emb = torch.nn.functional.normalize(torch.randn(new_n, 8, generator=g), dim=1)
    lens = torch.randint(1, 30, (pool_n + new_n,), generator=g).tolist()
    ids = [[i] * n for i, n in enumerate(lens)]
    for i in range(0, pool_n, 3):  # many exact copies of the new facts' nearest neighbours
        ids[i] = list(ids[pool_n + i % new_n])
    pool_ids, new_ids = ids[:pool_n], ids[pool_n:]

    def full_sort():  # the choice as it was made before: every candidate sorted
        cands = torch.cat([pool, emb])
        sim = emb @ cands.T
        sim[torch.arange(new_n), pool_n + torch.arange(new_n)] = float("-inf")
        out = []
        for j, row in enumerate(sim.argsort(dim=1, descending=True).tolist()):
            kept, used, seen = [], 0, {tuple(new_ids[j])}
            for c in row:
                if len(kept) == m:
                    break
                if c != pool_n + j and tuple(ids[c]) not in seen and used + len(ids[c]) <= budget:
                    kept.append(c)
                    used += len(ids[c])
                    seen.add(tuple(ids[c]))
            out.append(kept[::-1])
        return out

    _, chosen = neighbour_prefixes(emb, new_ids, pool, pool_ids, m, max_tokens=budget)
    assert chosen == full_sort()
    assert any(len(c) == m for c in chosen) and any(len(c) < m for c in chosen)


@pytest.fixture(params=["local", "postgres"])
def backend(request, monkeypatch):
    """The store backend of a test (``conftest.store_backend``): SQLite rows, or the session's PostgreSQL."""
    return store_backend(request, monkeypatch)


def test_a_write_reads_its_scope_a_page_at_a_time_and_picks_what_the_whole_scope_did(tmp_path, backend):
    """A write's neighbour choice (``scope_neighbours``) reads the scope from the store a page of embeddings at a
    time and then only its candidates' token ids, and chooses exactly what ``neighbour_prefixes`` chose over the
    whole scope's snapshot: on a real store with exact copies, long facts and deleted facts (so a fact's first
    candidates run out and its search is widened, the scope read again), pages smaller and larger than the
    candidates kept, and facts this write deletes."""

    from kvmem.store import FactRecord, Store, Write

    fp = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}
    hk = torch.zeros(1, 1, 3, 8)
    root = tmp_path / "s"
    st = Store.create(
        sw.location(root),
        fp,
        "hdr",
        [1, 2, 3],
        hk,
        hk.clone(),
        {"name": "e", "dim": 8},
        segments_url=sw.segments_url(root),
    )
    g = torch.Generator().manual_seed(5)
    pool_n, new_n, m, budget = 300, 12, 4, 40
    new_emb = torch.randn(new_n, 8, generator=g)
    new_emb[1] = new_emb[0] + 0.05 * torch.randn(8, generator=g)  # two new facts alike: each the other's neighbour
    new_emb = torch.nn.functional.normalize(new_emb, dim=1)
    new_ids = [[1000 + i] * int(n) for i, n in enumerate(torch.randint(1, 30, (new_n,), generator=g))]
    facts, embs = [], []
    for i in range(pool_n):
        ids = [2000 + i] * int(torch.randint(1, 30, (1,), generator=g))
        if i % 3 == 0:
            ids = list(new_ids[i % new_n])  # exact copies of the new facts
        elif i % 5 == 0:
            ids = [2000 + i - 1] * 7  # copies of each other
        facts.append(FactRecord(f"f{i}", "u", f"fact {i}", "", "", "", tuple(ids)))
        # the pool near the new facts, so copies and long facts crowd each one's first candidates
        embs.append(new_emb[i % new_n] + 0.5 * torch.randn(8, generator=g))
    emb = torch.nn.functional.normalize(torch.stack(embs), dim=1)
    for lo in range(0, pool_n, 100):  # three commits: three segments, rows in write order
        part = facts[lo : lo + 100]
        kv = [torch.zeros(1, 1, f.num_tokens, 8) for f in part]
        st.writes.commit(Write("u", part, kv, kv, emb[lo : lo + 100]))
    st.writes.commit(Write("u", delete=[f"f{i}" for i in range(1, pool_n, 7)]))  # tombstoned rows are never candidates
    gone = {f"f{i}" for i in range(2, pool_n, 11)}  # what the write itself deletes
    ukv = st.reads.snapshot("u")
    keep = [i for i, f in enumerate(ukv.facts) if f.fact_id not in gone]
    pool_fids = [ukv.facts[i].fact_id for i in keep]
    want_p, want_c = neighbour_prefixes(
        new_emb, new_ids, ukv.embeddings[keep], [list(ukv.facts[i].token_ids) for i in keep], m, max_tokens=budget
    )
    fids = pool_fids + [f"new{j}" for j in range(new_n)]
    want = [[fids[c] for c in row] for row in want_c]
    assert any(len(c) == m for c in want) and any(len(c) < m for c in want)
    pages, read = [], st.reads.embedding_page
    st.reads.embedding_page = lambda *a: pages.append(a[2]) or read(*a)  # counts the pages read
    for page in (7, 64, 5000):
        got_p, got = scope_neighbours(
            st, "u", new_emb, new_ids, [f"new{j}" for j in range(new_n)], gone, m, max_tokens=budget, page=page
        )
        assert got == want and got_p == want_p, page
    one_pass = -(-len(ukv.facts) // 64) + 1  # its pages and the empty one that ends it
    assert pages.count(64) > one_pass  # widened: the scope was read again for the facts whose candidates ran out
    assert any(f.startswith("f") for row in want for f in row) and any(f.startswith("new") for row in want for f in row)
    # no pool (a scope's first write): the new facts choose among themselves
    assert scope_neighbours(None, "u", new_emb, new_ids, [f"new{j}" for j in range(new_n)], set(), m)[1] == [
        [f"new{c}" for c in row] for row in neighbour_prefixes(new_emb, new_ids, None, [], m)[1]
    ]
    st.close()


def test_stored_kv_is_a_prefill_behind_the_neighbours(stores):
    lm, emb, mems = stores
    store = mems[2].store
    assert store.reads.user_info("maya")["neighbours"] == 2 and mems[0].store.reads.user_info("maya")["neighbours"] == 0
    facts = store.reads.snapshot("maya").facts
    ukv = store.reads.snapshot("maya")
    last = len(facts) - 1
    # the expected neighbours, recomputed here: the earlier facts most similar to the last one
    e = emb.embed([f.text for f in facts])
    sims = e[:last] @ e[last]
    lo, hi = sims.topk(2).indices.flip(0).tolist()
    seq = store.header_token_ids + list(facts[lo].token_ids) + list(facts[hi].token_ids) + list(facts[last].token_ids)
    keys, values = ukv.fact_kv(last)
    assert_is_prefill(lm.model, seq, keys, values)
    # what it changes: the same fact encoded without neighbours (m = 0) has other values beyond layer 0
    plain = mems[0].store.reads.snapshot("maya")
    assert plain.facts[last].token_ids == facts[last].token_ids
    _, v0 = plain.fact_kv(last)
    torch.testing.assert_close(v0[0], values[0], rtol=1e-5, atol=1e-5)  # layer 0 sees only the token itself
    assert (v0[1:] - values[1:]).abs().max() > 1e-2
    # the first fact had no earlier facts: both encodings agree
    torch.testing.assert_close(plain.fact_kv(0)[1], ukv.fact_kv(0)[1], rtol=1e-5, atol=1e-5)


def test_no_serving_cost(stores):
    from kvmem.service import MemoryService

    lm, emb, mems = stores
    preps, texts = [], []
    for m in (0, 2):
        svc = MemoryService.open(mems[m].store.root, model=lm, embedder=emb, engine="hf")
        p = svc.prepare("maya", "Where does Tom fly to?", 4, "kv", 8)
        preps.append(p)
        texts.append([mems[m].get(f)["memory"] for f in p.fact_ids])
    a, b = preps
    assert texts[0] == texts[1] and len(texts[0]) == 4  # the same facts, in the same order
    assert a.prompt_ids == b.prompt_ids and a.query_ids == b.query_ids
    assert (
        a.memory.composed.token_ids == b.memory.composed.token_ids
    )  # same injected tokens: the same prefill at serving time
    assert not torch.equal(a.memory.composed.values[1], b.memory.composed.values[1])  # but other KV


def test_bad_neighbours_is_an_input_error(tmp_path, stores):
    lm, emb, _ = stores
    with pytest.raises(MemoryInputError, match="neighbours"):
        Memory(tmp_path / "x", model=lm, embedder=emb, neighbours=-1)


@pytest.mark.slow
def test_ingest_locomo_neighbours_cli(tmp_path, tiny_locomo):
    """``ingest-locomo`` runs each fact behind m other facts (default 4; ``--neighbours 0`` turns it off): m fact
    lengths more encoded tokens than m = 0 at the same window, the same stored tokens, and the store records m."""
    import json

    from conftest import kvmem_cli
    from kvmem.store import Store

    def ingest(root, *extra, rc=0):
        return kvmem_cli("ingest-locomo", tiny_locomo, "--sample", "conv-26", "--store", root, "--window", "1",
                         "--model", FAST, "--json", *extra, check_rc=rc)  # fmt: skip

    plain = json.loads(ingest(tmp_path / "n0", "--neighbours", "0").stdout.strip().splitlines()[-1])
    nb = json.loads(ingest(tmp_path / "n4").stdout.strip().splitlines()[-1])  # the default
    assert nb["neighbours"] == 4 and plain["neighbours"] == 0
    assert nb["num_facts"] == plain["num_facts"] > 10 and nb["num_fact_tokens"] == plain["num_fact_tokens"]
    extra = nb["num_encoded_tokens"] - plain["num_encoded_tokens"]
    mean_fact = plain["num_fact_tokens"] / plain["num_facts"]
    assert 3 * mean_fact * nb["num_facts"] < extra < 5 * mean_fact * nb["num_facts"]  # about 4 facts more each
    assert Store.open(tmp_path / "n4").reads.user_info("conv-26")["neighbours"] == 4
    bad = ingest(tmp_path / "bad", "--neighbours", "99", rc=2)
    assert "less than or equal to 32" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_bad_neighbours_refused_before_loading(tmp_path):
    """Every command's ``--neighbours`` is range-checked by the CLI itself (exit 2), before a model loads or a
    store is created; the CLI's bound is ingest's (in this process: the same typer app and exit codes)."""
    from conftest import kvmem_cli

    for cmd in (
        ["serve", "--store", str(tmp_path / "s"), "--engine", "hf"],
        ["memory", "add", "hi", "--store", str(tmp_path / "m"), "--user", "u"],
        ["ingest-locomo", "x.json", "--sample", "conv-26", "--store", str(tmp_path / "i")],
        ["demo"],
        ["eval", "locomo"],
    ):
        for bad in ("33", "-1"):
            p = kvmem_cli(*cmd, "--neighbours", bad, "--model", FAST, check_rc=None)
            assert p.returncode == 2 and "--neighbours" in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)
        if cmd[0] != "demo":  # history encoding and neighbours are one or the other
            p = kvmem_cli(*cmd, "--history", "--neighbours", "2", "--model", FAST, check_rc=None)
            assert p.returncode == 2 and "do not combine" in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)
    assert not any(tmp_path.iterdir())  # nothing created
