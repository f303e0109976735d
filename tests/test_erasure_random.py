"""Randomized erasure checks: seeded sequences of adds (verbatim and inferred, with ADD / UPDATE / DELETE
decisions of a scripted extractor), updates, deletes (eager and deferred), ``delete_all``, imports, compaction,
background re-encoding, a store copy and reads (search, ``get_all``, the KV through a store with a disk cache),
then every check of ``tests/erasure_checker.py``: no erased text or KV in any file (or PostgreSQL row), the live
memories as the operations leave them, every survivor's KV equal in fp32 to its encoding behind its recorded
context less the erased parts, and a clean ``fsck``. SQLite and PostgreSQL; a tiny random-weight Llama (2 layers,
hidden 32) over smollm2-135m-instruct's tokenizer and a tiny random-weight BERT embedder over MiniLM's
tokenizer, built once per module.

Tiers: 20 seeds on SQLite in the fast tier; 200 seeds per backend under ``slow`` (and ``postgres``).
``test_the_checker_finds_a_defect_put_back`` (slow) shows the checker can fail: four defects it found before they
were fixed (retired segments never collected, a disk cache never swept, a copy dropping stale marks, an update
forgetting its original turns) put back one at a time, each found within 40 seeds.
``KVMEM_ERASURE_OPS`` (``all``, ``+kind``, or a list) changes what the sweeps run.

A failure names the seed, the operations and what was found where, and the command that replays it:
``KVMEM_ERASURE_SEED=123 KVMEM_ERASURE_BACKEND=sqlite pytest tests/test_erasure_random.py -k replay``.

Time, 2026-12-07 on the 2-core AMD EPYC Zen 3 (AVX2 only, fp32), alone on the machine: 200 seeds on SQLite 69 s,
on PostgreSQL 118 s, the fast sweep's 20 about 6 s; docs/testing.md keeps the figures.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import erasure_checker as ec
from conftest import postgres_schema
from kvmem.models import MANIFEST, model_dir
from kvmem.store.copy import _carry_stale as _carry

FAST_SEEDS = range(20)
FULL_SEEDS = range(200)
# defects that were real once, put back one at a time (the dotted place, what stands in there), and
# what the checker must then find (the message's pattern) within DEFECT_SEEDS
DEFECTS = {
    "retire": ("kvmem.store.Store.collect", lambda self, now=None: [], r"KV of .* in (objects|store/users)/"),
    "cached_read": ("kvmem.store.Store.sweep_cache", lambda self: [], r"in cache/"),
    "copy": (  # every copied mark cleared
        "kvmem.store.copy._carry_stale",
        lambda target, user, ids, stale: _carry(target, user, ids, {}),
        r"the copy copy0: ",
    ),
    "infer_update": (
        "kvmem.store.sql_rows.SQLRows.inherited",
        lambda *a, **k: {},
        r"secret zq[a-z]{8} in store/meta\.sqlite",
    ),
}
DEFECT_SEEDS = range(40)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    if not (model_dir(ec.TOKENIZER_OF) / MANIFEST).exists():
        pytest.fail(f"{ec.TOKENIZER_OF} is not installed; run: kvmem models install {ec.TOKENIZER_OF}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    yield ec.tools(ec.tiny_embedder(tmp_path_factory.mktemp("embedder")))
    torch.set_num_threads(threads)


def sweep(seeds, backend: str, tmp_path, tools, ops, base: str | None = None) -> None:
    for seed in seeds:
        url = postgres_schema(base, "erasure_random") if base else None
        ec.check(seed, backend, ec.fresh_dir(tmp_path / "run"), tools, ops, url)


def test_random_erasure_fast(tmp_path, tools):
    """20 seeds on SQLite: every check of the checker holds."""
    sweep(FAST_SEEDS, "sqlite", tmp_path, tools, ec.ops_from_env())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_random_erasure_full(backend, request, tmp_path, tools):
    """200 seeds per backend."""
    base = request.getfixturevalue("postgres") if backend == "postgres" else None
    sweep(FULL_SEEDS, backend, tmp_path, tools, ec.ops_from_env(), base)


def test_replay(request, tmp_path, tools):
    """One seed, from ``KVMEM_ERASURE_SEED`` (and ``KVMEM_ERASURE_BACKEND``, ``KVMEM_ERASURE_OPS``): what a
    failure's message says to run. Skipped without it."""
    seed = os.environ.get("KVMEM_ERASURE_SEED")
    if seed is None:
        pytest.skip("set KVMEM_ERASURE_SEED to replay a seed")
    backend = os.environ.get("KVMEM_ERASURE_BACKEND", "sqlite")
    base = request.getfixturevalue("postgres") if backend == "postgres" else None
    sweep([int(seed)], backend, tmp_path, tools, ec.ops_from_env(), base)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DEFECTS))
def test_the_checker_finds_a_defect_put_back(kind, tmp_path, tools, monkeypatch):
    """The checker can fail: with one fixed defect put back (``DEFECTS[kind]``: the collection of retired
    segments, the disk cache's sweep, a copy's stale marks, an update's inherited source turns, each replaced by
    a stand-in that does nothing), some seed of ``DEFECT_SEEDS`` finds it, and says where."""
    target, stand_in, finds = DEFECTS[kind]
    monkeypatch.setattr(target, stand_in)
    for seed in DEFECT_SEEDS:
        try:
            sweep([seed], "sqlite", tmp_path, tools, ec.DEFAULT_OPS)
        except AssertionError as exc:
            if re.search(finds, str(exc)):
                return
            raise
    pytest.fail(f"no seed of {DEFECT_SEEDS} found the defect {kind!r} put back")
