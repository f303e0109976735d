"""Tail recompute: KV injection of all but the last r retrieved facts, the last r prefilled with the
query. In fp32 on the transformers engine: the prompt ids never change with r; r = k is exactly prompt injection
(every fact recomputed on top of the injected header); r = 0 is plain KV injection; in between the logits differ
from plain injection (the tail now attends to the injected facts), and the engine prefills exactly the tail and
the query."""

from __future__ import annotations

import pytest
import torch

from kvmem.memory import Memory
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
FACTS = [
    "Maya moved to Lisbon in 2021.",
    "Maya's brother Tom is a pilot.",
    "Tom flies to Tokyo every month.",
    "Maya adopted a dog named Biscuit.",
    "Biscuit is afraid of thunder.",
    "Maya teaches chemistry.",
]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    from kvmem.models import load
    from kvmem.retrieve import Embedder
    from kvmem.service import MemoryService

    lm, emb = load(FAST, dtype="float32"), Embedder()
    root = tmp_path_factory.mktemp("tail") / "s"
    mem = Memory(root, model=lm, embedder=emb, window=2)
    for f in FACTS:  # one add per fact: each is encoded behind the turns before it, not behind the other facts
        mem.add(f, user_id="maya", infer=False)
    return MemoryService.open(root, model=lm, embedder=emb, engine="hf")


def _logits(svc, r: int, mode: str = "kv"):
    p = svc.prepare("maya", "Where does Maya's brother fly to?", 4, mode, 8, tail_recompute=r)
    (gen,) = svc.engine.generate([p.request(svc.sampling(8))])
    return p, gen


def test_tail_recompute_spans_plain_injection_to_prompt_injection(svc):
    pr, g_pr = _logits(svc, 0, "prompt")
    runs = {r: _logits(svc, r) for r in (0, 1, 2, 4)}
    ukv = svc.store.reads.snapshot("maya")
    row = ukv.row_of()
    for r, (p, g) in runs.items():
        assert p.prompt_ids == pr.prompt_ids and p.fact_ids == pr.fact_ids  # same prompt for every r
        tail = sum(ukv.facts[row[f]].num_tokens for f in p.fact_ids[len(p.fact_ids) - r :]) if r else 0
        query = len(runs[0][0].query_ids)
        assert g.prefilled_tokens == tail + query  # the engine prefilled exactly the tail facts and the query
        assert len(p.memory.composed.token_ids) == len(pr.prompt_ids) - tail - query  # and injected the rest
    full = runs[4][1].first_logits
    assert torch.allclose(full, g_pr.first_logits, atol=1e-4), (full - g_pr.first_logits).abs().max()
    plain = runs[0][1].first_logits
    assert (plain - g_pr.first_logits).abs().max() > 1e-3  # per-fact windows: plain injection is not the prompt
    for r in (1, 2):  # repair changes what the tail contributes
        assert (runs[r][1].first_logits - plain).abs().max() > 1e-3


def test_tail_recompute_cli_and_bad_values(svc):
    with pytest.raises(ValueError, match="tail_recompute"):
        svc.prepare("maya", "Who is Tom?", 3, "kv", 8, tail_recompute=-1)
    from kvmem.policy import Method

    assert Method.parse("kv-tail4") == Method("kv", 4, 0.0) and Method.parse("prompt") == Method("prompt", None, 0.0)
    with pytest.raises(ValueError):
        Method.parse("kv-tailx")


def test_caches_smaller_than_one_entry_serve_uncached(svc):
    """Every cache is a bound, never an error: with 1-byte caches nothing is cached and every request still
    answers, with the same prompt as a service with room to cache."""
    from kvmem.service import MemoryService

    tiny = MemoryService(svc.store.root, svc.engine, svc.lm, svc.embedder, index_cache_bytes=1, store_cache_bytes=1)
    for _ in range(2):
        a = tiny.ask("maya", "Where does Maya's brother fly to?", 3, "kv", 4)
    b = svc.ask("maya", "Where does Maya's brother fly to?", 3, "kv", 4)
    assert a.prompt_token_ids == b.prompt_token_ids and a.answer == b.answer
    assert tiny.indexes.nbytes == 0 and tiny.store.kv_cache_bytes == 0 and tiny.indexes.misses == 2


def test_a_segment_truncated_after_it_was_read_costs_one_prefill(svc, tmp_path):
    """The transformers engine reads only the retrieved facts' spans (pread, no mapping). A segment truncated
    after this process verified and read it is refused on its next read: that chat is prefilled whole (the same
    answer as prompt mode), the process lives, and the other users' chats inject as before."""
    import shutil

    from kvmem.service import MemoryService

    root = tmp_path / "copy"
    shutil.copytree(svc.store.root, root)
    cold = MemoryService(root, svc.engine, svc.lm, svc.embedder, store_cache_bytes=1)  # nothing cached
    q = "Where does Maya's brother fly to?"
    before = cold.ask("maya", q, 4)
    assert before.prefilled_tokens < before.prompt_tokens  # injected
    for seg in cold.store.reads.snapshot("maya").segments:
        path = cold.store.segment_path("maya", seg)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    after, prompt = cold.ask("maya", q, 4), cold.ask("maya", q, 4, mode="prompt")
    assert after.prefilled_tokens == after.prompt_tokens == prompt.prompt_tokens  # all of it prefilled
    assert after.answer == prompt.answer and after.mode == "kv"  # (windowed KV answers otherwise: not compared)
