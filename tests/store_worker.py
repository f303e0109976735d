"""Subprocess roles for the store's concurrency and crash tests (tests/test_store_safety.py).

    python store_worker.py write ROOT USER FIRST N [--big]   put_user generations FIRST.. FIRST+N-1 of USER
    python store_worker.py read ROOT USER SECONDS        snapshot USER in a loop; count torn / failed reads
    python store_worker.py churn ROOT USER N             N single-fact adds and deletes (ids c0, c1, ...)
    python store_worker.py adds ROOT USER PREFIX N       N single-fact adds (ids PREFIX0, ...); prints each id
                                                         once its commit returned (acknowledged)

Generation g of a user: facts "<user>-g<g>-<i>" whose keys and values are filled with the float g, so any read
that pairs rows of one generation with tensors of another is seen at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from kvmem.store import FactRecord, Store, StoreError, Write

FP = {"model": "tiny", "weights_sha256": "abc", "dtype": "float32", "rope": {"rope_theta": 10000.0}}
N_FACTS = 3


def generation(user: str, g: int, big: bool = False):
    tokens = 2000 if big else 4  # big: a few MB per file, so a kill lands inside a write
    facts = [
        FactRecord(f"{user}-g{g}-{i}", user, f"fact {i} of gen {g}", "", "", "", tuple(range(tokens)), 0, 0)
        for i in range(N_FACTS)
    ]
    kv = [torch.full((2, 1, tokens, 64), float(g)) for _ in facts]
    return facts, kv, torch.full((N_FACTS, 4), float(g))


def segments_url(root) -> str | None:
    """Where a test store keeps its segments: its own directory, or (``KVMEM_TEST_SEGMENTS=object`` or
    ``postgres``) an object store beside it, reached through obstore by a ``file://`` URL, or (``s3``) a prefix
    named after ``root`` in the session's S3 server (``conftest.s3``: its endpoint and keys in the environment)."""
    kind = os.environ.get("KVMEM_TEST_SEGMENTS")
    if kind == "s3":
        import hashlib

        return f"s3://kvmem/t{hashlib.sha256(str(root).encode()).hexdigest()[:16]}"
    if kind in ("object", "postgres"):
        return Path(str(root) + "-objects").resolve().as_uri()
    return None


def put_object(st: Store, name: str, data: bytes) -> None:
    """Write ``data`` as segment object ``name`` of ``st`` by hand (a corrupt file, a half write), on any
    backend: a file beside the store, or an object through obstore."""
    path = st.segments.local_path(name)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    inner = getattr(st.segments, "inner", st.segments)  # a disk-cached store: write the object itself
    inner._obs.put(inner.store, name, data)


def get_object(st: Store, name: str) -> bytes:
    path = st.segments.local_path(name)
    if path is not None:
        return path.read_bytes()
    inner = getattr(st.segments, "inner", st.segments)
    return bytes(inner._obs.get(inner.store, name).bytes())


def location(root) -> str | Path:
    """Where a test store at ``root`` lives: that directory, or (``KVMEM_TEST_SEGMENTS=postgres`` or ``s3``) a fresh
    schema of the session's PostgreSQL cluster (``conftest.postgres``), named after ``root``."""
    if os.environ.get("KVMEM_TEST_SEGMENTS") not in ("postgres", "s3"):
        return root
    import hashlib

    from conftest import postgres_schema

    return postgres_schema(os.environ["KVMEM_TEST_POSTGRES"], "t" + hashlib.sha256(str(root).encode()).hexdigest()[:16])


def create(root) -> Store:
    header = torch.zeros(2, 1, 3, 64)
    return Store.create(
        location(root),
        FP,
        "hdr",
        [1, 2, 3],
        header,
        header.clone(),
        {"name": "e", "dim": 4},
        segments_url=segments_url(root),
    )


def check(ukv) -> int:
    """The generation of a snapshot; raises AssertionError if its rows and tensors disagree."""
    gens = {int(f.fact_id.split("-g")[1].split("-")[0]) for f in ukv.facts}
    assert len(gens) == 1, f"fact rows of several generations: {gens}"
    (g,) = gens
    keys, values = ukv.gather(list(range(len(ukv.facts))))
    for t in (keys, values, ukv.embeddings):
        assert bool((t == g).all()), f"rows of generation {g}, tensors of {t.flatten()[0].item()}"
    assert keys.shape[2] == sum(f.num_tokens for f in ukv.facts)
    return g


def main(argv):
    role, root, user = argv[:3]
    if role == "write":
        first, n, big = int(argv[3]), int(argv[4]), "--big" in argv
        st = Store.open(root)
        for g in range(first, first + n):
            facts, kv, emb = generation(user, g, big)
            st.writes.put_user(user, facts, kv, kv, emb, window=0)
            print(g, flush=True)  # generation g is committed
        return
    if role == "churn":
        import random

        rng, st, live = random.Random(1), Store.open(root), []
        for i in range(int(argv[3])):
            if len(live) < 3 or rng.random() < 0.55:
                fid = f"c{i}"
                f = FactRecord(fid, user, fid, "", "", "", (1, 2), 0, 0)
                k = torch.full((2, 1, 2, 64), float(i))
                st.writes.commit(
                    Write(user, [f], [k], [k.clone()], torch.nn.functional.normalize(torch.randn(1, 4), dim=1))
                )
                live.append(fid)
            else:
                st.writes.commit(Write(user, delete=[live.pop(rng.randrange(len(live)))]))
        return
    if role == "adds":
        st, prefix = Store.open(root), argv[3]
        for i in range(int(argv[4])):
            f = FactRecord(f"{prefix}{i}", user, f"{prefix}{i}", "", "", "", (1, 2), 0, 0)
            k = torch.full((2, 1, 2, 64), float(i))
            st.writes.commit(Write(user, [f], [k], [k.clone()], torch.ones(1, 4) / 2))
            print(f.fact_id, flush=True)
        return
    seconds = float(argv[3])
    st = Store.open(root)
    reads = torn = failed = 0
    gens = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            gens.add(check(st.reads.snapshot(user)))
        except AssertionError:
            torn += 1
        except (StoreError, OSError):
            failed += 1
        reads += 1
    print(json.dumps({"reads": reads, "torn": torn, "failed": failed, "generations": len(gens)}))


if __name__ == "__main__":
    main(sys.argv[1:])
