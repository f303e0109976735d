"""The engine seam is real: both engines satisfy both roles (``engines.base.check_implements``: every abstract
method implemented, the same parameters), what differs between them is a declared capability, and the one
module that builds engines is the only place that names them."""

import re
from pathlib import Path

import pytest

from kvmem.engines import select
from kvmem.engines.base import AsyncEngine, Engine, EngineRequest, check_implements
from kvmem.engines.hf import AsyncHFEngine, HFEngine
from kvmem.hardware import cpu_facts, vllm_problem

SRC = Path(__file__).resolve().parents[1] / "src" / "kvmem"


def _vllm_classes():
    why = vllm_problem(cpu_facts())
    if why:
        pytest.skip(f"vLLM cannot run here: {why}")
    from kvmem.engines.vllm_engine import AsyncVLLMEngine, VLLMEngine

    return VLLMEngine, AsyncVLLMEngine


def test_both_engines_satisfy_both_roles():
    sync_vllm, async_vllm = _vllm_classes()
    for impl, role in (
        (HFEngine, Engine),
        (sync_vllm, Engine),
        (AsyncHFEngine, AsyncEngine),
        (async_vllm, AsyncEngine),
    ):
        assert check_implements(impl, role) == [], impl
    # the pair of one engine agrees on what it can do
    assert HFEngine.selective_recompute and not sync_vllm.selective_recompute
    assert (HFEngine.batches, sync_vllm.batches) == (False, True)
    for sync, asyn in ((HFEngine, AsyncHFEngine), (sync_vllm, async_vllm)):
        assert (sync.name, sync.selective_recompute, sync.batches) == (
            asyn.name,
            asyn.selective_recompute,
            asyn.batches,
        )
        assert select.SELECTIVE_RECOMPUTE[sync.name] == sync.selective_recompute  # checked before engines start


def test_check_implements_finds_what_is_missing():
    class Half(Engine):
        name = "half"

        def memory(self, plan):
            return None

        def generate(self, requests, extra):  # a parameter the role does not have, without a default
            return []

    problems = check_implements(Half, Engine)
    assert any("complete_json is not implemented" in p for p in problems)
    assert any("Half.generate" in p for p in problems)
    assert check_implements(Half, AsyncEngine)  # and it is not the other role


def test_hf_engine_serves_a_request_from_the_protocol():
    """``Engine.generate`` with a memory-less request prefills the whole prompt: the same tokens ``run`` gives."""
    from conftest import tiny_model
    from kvmem.engines.base import Sampling

    eng = HFEngine(tiny_model("llama"), eos_token_ids=[])
    ids = [5, 9, 13, 2, 7]
    (gen,) = eng.generate([EngineRequest(ids, sampling=Sampling(max_tokens=4))])
    ref = eng.run(ids, None, "prompt", 4)
    assert gen.token_ids == ref.token_ids and gen.prefilled_tokens == len(ids) and gen.prompt_tokens == len(ids)
    assert gen.finish_reason == "length"


def test_one_stop_rule_never_ends_an_answer_on_a_leading_line_break():
    """Completion-style models end an answer at a line break, but only after some text: a first token that is
    a line break (Gemma 3 often opens so) is kept and decoding goes on. Both engines apply the same rule."""
    from conftest import tiny_model
    from kvmem.engines.base import Sampling, ends_answer
    from kvmem.engines.vllm_engine import line_stop_at

    lines = frozenset({10, 11})
    s = Sampling(stop_token_ids=(2,), line_stop_ids=lines)
    assert not ends_answer([10], s) and not ends_answer([10, 11], s) and ends_answer([10, 5, 11], s)
    assert ends_answer([2], s) and not ends_answer([5, 10], Sampling(line_stop_ids=lines, json_schema="{}"))
    assert line_stop_at([10, 11, 5, 7, 10, 5], s) == (5, True) and line_stop_at([10, 11], s) == (None, False)
    assert line_stop_at([10, 5], s, seen_text=True) == (1, True)
    eng = HFEngine(tiny_model("llama"), eos_token_ids=[])
    ids = [5, 9, 13, 2, 7]
    free = eng.run(ids, None, "prompt", sampling=Sampling(max_tokens=8)).token_ids
    first = frozenset({free[0]})  # the model's first token, treated as a line break
    got = eng.run(ids, None, "prompt", sampling=Sampling(max_tokens=8, line_stop_ids=first))
    cut, _ = line_stop_at(free, Sampling(line_stop_ids=first))
    assert got.token_ids == free[: cut or 8] and len(got.token_ids) >= 2
    assert got.finish_reason == ("stop" if cut else "length")


def test_only_the_engine_package_names_an_engine():
    pattern = re.compile(r'name == "hf"|name == "vllm"|isinstance\(.*Engine')
    found = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.py")
        if "engines" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_selective_recompute_is_refused_before_an_engine_starts():
    with pytest.raises(ValueError, match="--engine hf"):
        select.check_methods(["kv", "kv-sel20"], "vllm")
    select.check_methods(["kv", "kv-sel20"], "hf")
    select.check_methods(["kv", "prompt", "kv-tail2"], "vllm")
