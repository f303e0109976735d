"""Erasure reaches every copy of the data within ``retire_after_s`` plus one upkeep round: the segment files (or
objects) an erased user leaves, though it never writes again (``Memory.collect``, run by ``reencode_pending``);
each server's local disk cache of segments (``Store.sweep_cache``; ``fsck --cache-dir``); and a ``kvmem store copy``
made while a re-encoding was deferred, which keeps its stale marks and provenance rather than passing the derived KV
off as clean. Each file is searched for the raw bytes of the erased KV, as ``tests/test_erasure.py`` searches for
the erased text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import store_worker as sw
from kvmem.cli import app
from kvmem.memory import Memory
from kvmem.store import FactRecord, Store, StoreError, Write, copy_store
from test_erasure import SECRET, assert_same_kv, memory, shared  # noqa: F401 (``shared``: the module's model)


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def holding(marks: list[bytes], *roots: Path) -> list[Path]:
    """The files under ``roots`` that hold any of ``marks`` (raw bytes)."""
    return [p for p in files_under(*roots) if any(m in p.read_bytes() for m in marks)]


def first_token_keys(st: Store, user: str) -> list[bytes]:
    """Each live fact's first token's keys as a segment stores them ([L, H, D] of a token-major file, fp32)."""
    ukv = st.reads.snapshot(user)
    out = []
    for i in range(len(ukv.facts)):
        k, _ = ukv.fact_kv(i)
        assert k.dtype == torch.float32
        out.append(k[:, :, 0, :].contiguous().numpy().tobytes())
    return out


@pytest.mark.parametrize("objects", [False, True], ids=["directory", "object-store"])
def test_an_erased_user_leaves_no_segment_after_one_upkeep_round(tmp_path, shared, objects):  # noqa: F811
    """``delete_all`` of a user, who never writes again: its segments are retired (kept ``retire_after_s`` for
    readers of the version before), and the next upkeep round once that has passed (``reencode_pending``, which
    runs ``collect``) removes them: no file of the store's segments, in its directory or in the object store
    (``file://``), holds a byte of the user's KV. Before, they were collected only by the user's next commit."""
    kv = tmp_path / "kv"
    a = memory((tmp_path / "a", kv.as_uri() if objects else None), shared)
    a.add(f"My social security number is {SECRET}.", "u", infer=False)
    a.add("I walk my dog every morning.", "u", agent_id="coach", infer=False)
    marks = [m for user in a.store.reads.users() for m in first_token_keys(a.store, user)]
    assert len(marks) == 2
    segments_at = [kv] if objects else [tmp_path / "a" / "users"]
    a.delete_all(user_id="u")
    assert len(holding(marks, *segments_at)) == 2  # retired, not yet removed: a reader may still read them
    assert a.reencode_pending() == {"reencoded": 0, "scopes": 0, "collected": 0}  # 60 s have not passed
    a.store.writes.retire_after_s = 0  # as if they had
    assert a.reencode_pending() == {"reencoded": 0, "scopes": 0, "collected": 2}
    assert holding(marks, *segments_at) == [] and files_under(*segments_at) == []
    assert a.collect() == 0 and a.store.fsck()["replaced"] == []


def _store_with_random_kv(root, objects: Path) -> tuple[Store, bytes]:
    """A store with its segments at ``objects`` (``file://``) and one user's one fact of random KV; the bytes of
    its keys."""
    header = torch.zeros(2, 1, 3, 64)
    st = Store.create(root, sw.FP, "hdr", [1, 2, 3], header, header.clone(), {"name": "e", "dim": 4},
                      segments_url=objects.as_uri())  # fmt: skip
    keys = torch.randn(2, 1, 4, 64)
    fact = FactRecord("f", "u", "a fact", "", "", "", (1, 2, 3, 4), 0, 0)
    st.writes.commit(Write("u", [fact], [keys], [torch.randn(2, 1, 4, 64)], torch.ones(1, 4)))
    return st, keys[:, :, 0, :].contiguous().numpy().tobytes()


@pytest.fixture(params=["sqlite", "postgres"])
def rows_at(request, tmp_path):
    """Where a test store's rows go: a directory, or a schema of the session's PostgreSQL cluster."""
    if request.param == "sqlite":
        return tmp_path / "s"
    from conftest import postgres_schema

    return postgres_schema(request.getfixturevalue("postgres"), "erasure_cache_sweep")


def test_a_disk_cache_drops_what_the_store_removed(tmp_path, rows_at):
    """Two servers' disk caches (``--cache-dir``) each hold a copy of a segment; the user is erased. A cache keeps
    its copy while the store still holds the segment for readers (retired less than ``retire_after_s`` ago), then
    the upkeep's sweep (``Store.sweep_cache``) drops it; ``fsck --cache-dir`` (``Store.fsck(cache_dir=...)``)
    drops and names it in a cache no server sweeps. Before, no cache ever dropped a copy: tiers took stored KV
    for immutable."""
    st, mark = _store_with_random_kv(rows_at, tmp_path / "kv")
    (name,) = st.segments.names()
    caches = [tmp_path / "cache1", tmp_path / "cache2"]
    readers = [Store.open(st.root, cache_dir=c) for c in caches]
    for r in readers:
        r.reads.snapshot("u").gather([0])  # fetched whole into the cache
    assert [len(holding([mark], c)) for c in caches] == [1, 1]
    st.writes.delete_user("u")
    assert readers[0].sweep_cache() == [] and len(holding([mark], caches[0])) == 1  # still held for readers
    readers[0].writes.retire_after_s = 0  # retire_after_s has passed: due for removal, whether or not removed yet
    assert readers[0].sweep_cache() == [name] and holding([mark], caches[0]) == []
    st.writes.retire_after_s = 0
    assert st.collect() == [name] and holding([mark], tmp_path / "kv") == []
    assert len(holding([mark], caches[1])) == 1  # the second server's copy, until its own sweep or fsck
    res = CliRunner().invoke(app, ["store", "fsck", "--store", str(st.root), "--cache-dir", str(caches[1]), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["cache_removed"] == [name] and holding([mark], caches[1]) == []
    assert Store.open(st.root).fsck(cache_dir=caches[1])["cache_removed"] == []
    with pytest.raises(StoreError, match="not a segment cache directory"):
        Store.open(st.root).fsck(cache_dir=tmp_path / "kv")
    assert not (tmp_path / "kv" / "cache.db").exists()  # nothing made there


def test_a_copy_keeps_what_a_deferred_erasure_left_to_reencode(tmp_path, shared):  # noqa: F811
    """A store whose erasure deferred its re-encoding (a fact's KV still computed behind the erased turn, its
    window), copied: the copy keeps the stale mark with its deadline and the provenance that names the erased
    turn (not copied), so its ``fsck`` reports the same ``derived`` facts as the source's, and its
    ``reencode_pending`` makes the KV equal, in fp32, that of a store that never saw the secret. Before, the copy
    dropped the erased turn from the provenance, and with it the mark: its derived KV passed for clean."""
    lm, emb = shared
    window = lambda root, **kw: Memory(root, model=lm, embedder=emb, window=5, neighbours=0, **kw)
    a = window(tmp_path / "a", defer_reencode_s=30.0)
    secret = a.add(f"My social security number is {SECRET}.", "u", infer=False)["results"][0]["id"]
    a.add("I walk my dog every morning.", "u", infer=False)
    assert a.delete(secret)["erasure"]["deferred"] == 1
    ((_, fid, _, by),) = a.store.reads.stale()
    report = copy_store(a.store.root, tmp_path / "copy")
    assert report["stale"] == 1 and report["facts"] == 1 and report["turns"] == 1
    c = window(tmp_path / "copy")
    assert [(u, f, b) for u, f, _, b in c.store.reads.stale()] == [("u", fid, by)]
    (fact,) = c.store.reads.snapshot("u").facts
    assert [t["content"] for t in c.store.reads.turns("u")] == ["I walk my dog every morning."]
    assert len(fact.context_turns) == 1 and fact.context_turns[0] not in {t["idx"] for t in c.store.reads.turns("u")}
    derived = lambda st: sorted(f for fs in st.fsck()["derived"].values() for f in fs)
    assert derived(c.store) == derived(a.store) == [fid]
    c.store.writes.commit(
        Write("u", turns=[{"content": "I play chess on Sundays."}])
    )  # a new turn: never the erased index
    assert fact.context_turns[0] not in {t["idx"] for t in c.store.reads.turns("u")}
    assert c.reencode_pending()["reencoded"] == 1
    assert c.store.reads.stale() == [] and derived(c.store) == []
    b = window(tmp_path / "b")
    b.add("I walk my dog every morning.", "u", infer=False)
    assert_same_kv(c, b, "u")
