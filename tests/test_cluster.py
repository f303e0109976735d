"""Many machines on one machine (tests/cluster.py): network namespaces on a bridge, PostgreSQL over TCP with a
password, a real S3 server, a Ray head and two workers, ``kvmem serve --replicas 2 --ray-address`` on them; a
load of several users while each fault is injected, held and healed, then the history checker
(tests/cluster_faults.py). Needs root (namespaces); about 5 minutes on 2 cores: the whole cluster, two model
replicas and six faults in one test, the only one of its kind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.postgres]


def test_faults_under_load_lose_nothing():
    """One replica on each worker node (Ray's state API); across the six faults (a worker killed with -9, a worker
    cut from db, another from s3, PostgreSQL's immediate restart, the ingress killed, s3 killed; each held 8 s)
    no acknowledged write is lost, no user is served another's memory, and every user is served again after
    each heal."""
    import cluster_faults

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (network namespaces)")
    out = Path(tempfile.mkdtemp(prefix="kvmc-"))  # short: Ray's unix sockets live below it
    try:
        rep = cluster_faults.run(hold=8, users=4, out=out, names=None, settle=3)
    finally:
        shutil.rmtree(out / "cluster", ignore_errors=True)
    assert sorted(rep["placement"].values()) == ["10.77.0.11", "10.77.0.12"]
    t = rep["totals"]
    assert t["acked_writes"] >= 20, t
    assert t["acked_writes_lost"] == 0 and t["cross_user_injections"] == 0 and t["cross_user_reads"] == 0, rep
    assert all(w["all_served_after_heal_s"] is not None for w in rep["faults"]), rep["faults"]
