"""The engine seam is real: both engines satisfy both roles (``engines.base.check_implements``: every abstract
method implemented, the same parameters), what differs between them is a capability declared once
(``engines.registry``), and the one module that builds engines is the only place that names them."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.engines import registry
from kvmem.engines.base import AsyncEngine, Engine, EngineRequest, check_implements
from kvmem.engines.hf import AsyncHFEngine, HFEngine
from kvmem.hardware import cpu_facts, vllm_problem

SRC = Path(__file__).resolve().parents[1] / "src" / "kvmem"


def _vllm_classes():
    why = vllm_problem(cpu_facts())
    if why:
        pytest.skip(f"vLLM cannot run here: {why}")
    from kvmem.engines.vllm.engine import AsyncVLLMEngine, VLLMEngine

    return VLLMEngine, AsyncVLLMEngine


def _engine_classes(name: str):
    """(sync, async) engine classes of ``name``; vLLM's skip where it cannot run here."""
    return (HFEngine, AsyncHFEngine) if name == "hf" else _vllm_classes()


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_each_engine_satisfies_both_roles(name):
    """The same conformance check for each engine: its sync class is an ``Engine``, its async class an
    ``AsyncEngine`` (every abstract method, the same parameters), the pair agrees on what it can do, and the
    registry declares that before any engine starts."""
    sync, asyn = _engine_classes(name)
    assert check_implements(sync, Engine) == [], sync
    assert check_implements(asyn, AsyncEngine) == [], asyn
    assert sync.name == asyn.name == name
    assert (sync.selective_recompute, sync.batches) == (asyn.selective_recompute, asyn.batches)
    assert registry.ENGINES[name].selective_recompute == sync.selective_recompute  # checked before start
    # what differs between the two engines
    assert (sync.selective_recompute, sync.batches) == {"hf": (True, False), "vllm": (False, True)}[name]


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
    from kvmem.engines.vllm.engine import line_stop_at

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
    from kvmem.service import check_methods

    with pytest.raises(ValueError, match="--engine hf"):
        check_methods(["kv", "kv-sel20"], "vllm")
    check_methods(["kv", "kv-sel20"], "hf")
    check_methods(["kv", "prompt", "kv-tail2"], "vllm")


def test_the_capability_registry_imports_no_engine():
    """The CLI and the server check methods against the registry before an engine starts: it must load none."""
    code = (
        "import sys, kvmem.engines.registry; "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm') "
        "or m.startswith('kvmem.engines.') and m != 'kvmem.engines.registry'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_method_is_parsed_once_and_written_back_the_same():
    from kvmem.policy import Method

    for spelled in ("kv", "prompt", "kv-tail3", "kv-sel20", "kv-sel100"):
        assert str(Method.parse(spelled)) == spelled
    assert Method.parse("kv-sel20") == Method("kv", 0, 0.2) and Method.parse("kv", 2) == Method("kv", 2)
    assert Method.parse(Method.of("kv", None, 20)) == Method.parse("kv-sel20")
    assert Method.parse(Method.of("kv", 1)) == Method("kv", 1) and str(Method.of("off")) == "off"
    with pytest.raises(ValueError, match="do not combine"):
        Method.parse(Method.of("kv", None, 20), tail_recompute=1)
    with pytest.raises(ValueError, match="not 'off'"):
        Method.parse(Method.of("off"))


def test_latent_attention_is_served_by_every_engine():
    """DeepSeek V2 / V3 take injected KV on both engines (vLLM: ``tests/test_vllm_latent.py``): no refusal."""
    from kvmem.engines.registry import ENGINES, latent_refusal

    assert [latent_refusal(name) for name in ENGINES] == [None] * len(ENGINES)
