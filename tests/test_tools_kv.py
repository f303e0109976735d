"""A chat's tools block (its system text and tool definitions, as the chat template renders them after the
memory) injected from KV encoded once, on the transformers engine, in fp32, with the smallest model whose chat
template renders tools (Qwen2.5-Coder 0.5B; SmolLM2's and Gemma 3's have none). The block's KV, encoded behind
the header and relocated after the memory, gives prompt mode's logits (max |dlogit| <= 1e-5 x max |logit|, the
same greedy tokens) where nothing it has not seen precedes it; a chat with tools then prefills only its turns,
with the same prompt ids as prompt mode; the cache is keyed by tenant and bounded."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmem.models import MANIFEST, model_dir

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "qwen2.5-coder-0.5b-instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
                "required": ["to", "body"],
            },
        },
    },
]
SYSTEM = {"role": "system", "content": "You are Alice's assistant. Be brief."}


def chat(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    if not (model_dir(MODEL) / MANIFEST).exists():
        pytest.fail(f"{MODEL} is not installed; run: kvmem models install {MODEL}")
    from kvmem.memory import Memory
    from kvmem.models import load
    from kvmem.retrieve import Embedder
    from kvmem.service import MemoryService

    lm, emb = load(MODEL, dtype="float32"), Embedder()
    root = tmp_path_factory.mktemp("tools-kv") / "s"
    mem = Memory(root, model=lm, embedder=emb, window=0)
    for fact in ("Alice lives in Lisbon, in Portugal.", "Alice's sister Ines is a pilot."):
        mem.add(fact, user_id="alice", infer=False)
    return MemoryService.open(root, model=lm, embedder=emb, engine="hf")


def test_an_injected_tools_block_gives_prompt_modes_logits(svc):
    """[header][tools block] composed from the store's header KV and the block's cached KV, then the turns
    prefilled, equals prompt mode's prefill of the same ids over 6 greedy steps; the block encoded without the
    header in front of it (its own positions 0..) is far outside the bound, so the check sees a wrong context."""
    from kvmem.encode import encode_spans

    engine, tok = svc.engine, svc.lm.tokenizer
    p = svc.prepare("alice", "What is the weather where I live?", 2, "kv", 8, chat("What is the weather where I live?"),
                    tools=TOOLS)  # fmt: skip
    block = p.plan.block
    assert block is not None and block.text.startswith("\n\nYou are Alice's assistant.") and "get_weather" in block.text
    turns = p.query_ids
    bare = dataclasses.replace(p.plan, rows=[])  # no fact between the header and the block
    mem = engine.memory(bare)
    ids = bare.header_ids + list(block.token_ids)
    assert mem.composed.token_ids == ids and tok.decode(ids + turns).count("# Tools") == 1
    kv = engine.run(turns, mem.composed, "kv", 6, keep_step_logits=True)
    ref = engine.run(turns, mem.composed, "prompt", 6, keep_step_logits=True)
    assert kv.prefilled_tokens == len(turns) and ref.prefilled_tokens == len(ids) + len(turns)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(kv.step_logits, ref.step_logits))
    assert worst <= 1e-5, worst
    assert kv.token_ids == ref.token_ids and len(set(kv.token_ids)) > 1

    (alone,) = encode_spans(svc.lm.model, [list(block.token_ids)], [(0, len(block.token_ids))])
    h = len(bare.header_ids)
    keys, values = mem.composed.keys.clone(), mem.composed.values.clone()
    keys[:, :, h:] = engine.rotary.rotate_keys(alone.keys, torch.arange(h, len(ids)))
    values[:, :, h:] = alone.values
    wrong = dataclasses.replace(mem.composed, keys=keys, values=values)
    off = engine.run(turns, wrong, "kv", 1)
    assert float((off.first_logits - ref.first_logits).abs().max() / ref.first_logits.abs().max()) > 1e-3


def test_a_chat_with_tools_prefills_only_its_turns(svc):
    """kv mode with two facts: the prompt ids are prompt mode's and exactly the one-piece tokenization of the
    conversation; the engine prefills only the turns after the block; the next chat with the same system text and
    tools reads the cached KV (one encoding for both), and another tenant's, or other tools, encode their own."""
    from kvmem.engines.base import ToolsBlock

    tools = svc.engine.tools
    misses, hits = tools.misses, tools.hits
    q = "Who is my sister?"
    kv = svc.prepare("alice", q, 2, "kv", 8, chat(q), tools=TOOLS)
    pr = svc.prepare("alice", q, 2, "prompt", 8, chat(q), tools=TOOLS)
    assert kv.prompt_ids == pr.prompt_ids and kv.fact_ids == pr.fact_ids and len(kv.fact_ids) == 2
    whole = svc.fmt.conversation_ids(svc.lm.tokenizer, chat(q), tools=TOOLS)
    assert kv.prompt_ids[len(kv.prompt_ids) - len(whole) :] == whole
    block = kv.plan.block
    assert len(kv.query_ids) == len(whole) - len(block.token_ids) < 20 < len(block.token_ids)
    (g_kv,) = svc.engine.generate([kv.request(svc.sampling(1))])
    assert g_kv.prefilled_tokens == len(kv.query_ids) and g_kv.prompt_tokens == len(kv.prompt_ids)
    assert pr.plan is None and len(pr.query_ids) == len(whole)  # prompt mode prefills the block with the turns
    q2 = "Where do I live?"
    again = svc.prepare("alice", q2, 1, "kv", 8, chat(q2), tools=TOOLS)
    assert again.plan.block == block
    # the first of these two chats may have hit the previous test's entry: together at most one encoding
    assert tools.misses - misses <= 1 and tools.hits - hits >= 1
    before = tools.misses
    tools.kv(ToolsBlock(block.text, block.token_ids, owner="other-tenant"), kv.plan.header_ids, 0)
    other = svc.prepare("alice", q2, 1, "kv", 8, chat(q2), tools=TOOLS[:1])
    assert tools.misses == before + 2 and other.plan.block.text != block.text


def test_the_tools_cache_is_bounded(svc):
    """At most ``max_entries`` blocks (least recently used out first); a block larger than ``max_bytes`` serves
    its chat with the same KV and is not kept."""
    from kvmem.engines.base import ToolsBlock
    from kvmem.engines.tools_kv import ToolsKV

    header = svc.store.header_token_ids
    ids = svc.lm.tokenizer("\n\nA short system text.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    a, b = ToolsBlock("a", tuple(ids)), ToolsBlock("b", tuple(ids[:-1]))
    small = ToolsKV(svc.lm.model, max_entries=1)
    ka, _ = small.kv(a, header, 0)
    small.kv(b, header, 0)
    assert len(small) == 1 and small.nbytes == 2 * ka.nbytes * (len(ids) - 1) // len(ids)
    small.kv(a, header, 0)
    assert small.misses == 3 and small.hits == 0  # a was evicted by b
    tiny = ToolsKV(svc.lm.model, max_bytes=ka.nbytes)
    k2, v2 = tiny.kv(a, header, 0)
    assert len(tiny) == 0 and tiny.nbytes == 0 and torch.equal(k2, ka)
    with pytest.raises(ValueError, match="at least one"):
        ToolsKV(svc.lm.model, max_entries=0)
