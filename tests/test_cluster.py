"""Many machines on one machine (tests/cluster.py): network namespaces on a bridge, PostgreSQL over TCP with a
password, a real S3 server, a Ray head and two workers, ``kvmem serve --replicas 2 --ray-address`` on them; a
load of several users while each fault is injected, held and healed, then the history checker
(tests/cluster_faults.py). Needs root (namespaces); about 3 minutes on 2 cores: the whole cluster, two model
replicas and six faults in one test, the only one of its kind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _ev(user, op, t, outcome="ack", **kw):
    return {"user": user, "op": op, "t0": t, "t1": t + 0.1, "outcome": outcome, **kw}


def test_the_history_checker_finds_what_it_reports():
    """The checker on made-up histories: a clean one reports nothing; an acked add missing from the final list,
    a list after an update still showing the old text, a chat that misses an acked fact or injects another
    user's, an acked delete still served, and a hung request are each counted; an unknown write is not judged."""
    from cluster_faults import check

    clean = [
        _ev("a", "add", 1, id="a1", text="x"), _ev("b", "add", 1.5, id="b1", text="y"),
        _ev("a", "update", 2, id="a1", text="x2"), _ev("a", "list", 3, seen={"a1": "x2"}),
        _ev("a", "chat", 4, fact_ids=["a1"]), _ev("a", "add", 5, "unknown", text="z"),
        _ev("a", "final", 9, seen={"a1": "x2", "a9": "z"}), _ev("b", "final", 9, seen={"b1": "y"}),
    ]  # fmt: skip
    rep = check(clean, [{"name": "f", "title": "fault f", "inject": 1.2, "heal": 1.4}])
    assert (rep["faults"][0]["name"], rep["faults"][0]["fault"]) == ("f", "fault f")
    t = rep["totals"]
    assert (t["acked_writes"], t["unknown"], rep["problems"]) == (3, 1, [])
    assert rep["faults"][0]["all_served_after_heal_s"] == 0.7  # a is served again at 2.1 (b at 1.6)
    bad = [
        _ev("a", "add", 1, id="a1", text="x"), _ev("a", "add", 1.1, id="a2", text="w"),
        _ev("b", "add", 1.5, id="b1", text="y"),
        _ev("a", "update", 2, id="a1", text="x2"), _ev("a", "list", 3, seen={"a1": "x", "a2": "w"}),
        _ev("a", "chat", 4, fact_ids=["a1", "b1"]), _ev("a", "delete", 5, id="a2"),
        _ev("a", "chat", 6, fact_ids=["a1", "a2"]), _ev("b", "chat", 6.5, "unknown", hung=True),
        _ev("a", "final", 9, seen={"a1": "x2"}), _ev("b", "final", 9, seen={}),
    ]  # fmt: skip
    t = check(bad, [])["totals"]
    assert t["read_your_writes_violations"] == 1  # the list showing a1's old text
    assert t["stale_injections"] == 2  # the chat without a2, the chat with the deleted a2
    assert t["cross_user_injections"] == 1 and t["acked_writes_lost"] == 1 and t["hung"] == 1
    # reads and chats that failed while a fault was held, per fault (writes are not retried: not counted)
    held = [
        _ev("a", "list", 1.1, "failed"), _ev("a", "add", 1.2, "failed", text="z"), _ev("b", "chat", 1.3, "unknown"),
        _ev("a", "chat", 1.6, "failed"), _ev("a", "final", 9, seen={}), _ev("b", "final", 9, seen={}),
    ]  # fmt: skip
    (w,) = check(held, [{"name": "f", "inject": 1.0, "heal": 1.5, "rerouted": 2}])["faults"]
    assert (w["reads_failed_while_held"], w["failed"], w["rerouted"]) == (2, 3, 2)  # the chat at 1.6: after heal
    assert w["unserved_while_held"] == ["a", "b"]
    served = [*held[:4], _ev("b", "list", 1.4, seen={})]  # b's list sent while held, acked
    (w,) = check(served, [{"name": "f", "inject": 1.0, "heal": 1.5}])["faults"]
    assert w["unserved_while_held"] == ["a"]


def test_answers_that_promise_nothing_about_a_write_are_unknown():
    """A write the ingress reports as ``replica_lost`` (its replica died while running it) may have landed, as may
    one answered 500 or 504: the checker must not take it for a write that did not happen (a delete that landed
    would count as an acknowledged fact lost). A 503 ``store_unavailable``, a 404 or a 409 wrote nothing."""
    from cluster_faults import check, outcome_of

    assert [outcome_of(503, "replica_lost"), outcome_of(500, "internal_error"), outcome_of(504, None)] == [
        "unknown"
    ] * 3
    assert {outcome_of(503, "store_unavailable"), outcome_of(404, "memory_not_found"), outcome_of(409, None)} == {
        "failed"
    }
    evs = [
        _ev("a", "add", 1, id="a1", text="x"), _ev("a", "delete", 2, outcome_of(503, "replica_lost"), id="a1"),
        _ev("a", "final", 9, seen={}),
    ]  # fmt: skip
    assert check(evs, [])["totals"]["acked_writes_lost"] == 0
    # a 2xx whose body is not the JSON it claims (a replica lost mid-body) is unknown and counted; the load's own
    # exception is a client error, reported, never a request
    evs = [
        _ev("a", "add", 1, "unknown", code="unreadable_body", text="x"),
        {"user": "a", "op": "client_error", "t0": 2, "t1": 2, "outcome": "error", "error": "Traceback ..."},
        _ev("a", "final", 9, seen={"a1": "x"}),
    ]  # fmt: skip
    rep = check(evs, [{"name": "f", "inject": 1.5, "heal": 2.5}])
    t = rep["totals"]
    assert (t["requests"], t["unknown"], t["unreadable_answers"], t["client_errors"]) == (2, 1, 1, 1), t
    assert t["acked_writes_lost"] == 0 and rep["problems"][0]["op"] == "client_error"
    assert rep["faults"][0]["requests"] == 0  # the client error is not a request held in the fault


def test_a_load_user_meets_broken_answers_and_goes_on(tmp_path):
    """The load against a server that acknowledges every request with a body it cannot use (an add's 200 without
    its result): each such answer is a ``client_error`` event, the user's thread goes on and, once the stop file
    appears, lists its memories and ends, though its canary was never acknowledged (it once waited for it
    forever, and the run with it)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cluster_faults import load

    class Broken(BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = b'{"results": []}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    events, stop = tmp_path / "events.jsonl", tmp_path / "stop"
    threading.Timer(1.5, stop.touch).start()
    run = threading.Thread(target=load, args=(f"http://127.0.0.1:{srv.server_port}", "k", str(events), 1, str(stop)))
    run.start()
    run.join(timeout=20)
    srv.shutdown()
    assert not run.is_alive(), "the load did not end after the stop file appeared"
    evs = [json.loads(x) for x in events.read_text().splitlines()]
    errors = [e for e in evs if e["op"] == "client_error"]
    assert errors and "ValueError" in errors[0]["error"], evs  # the add's missing result, unpacked
    assert [e["outcome"] for e in evs if e["op"] == "final"] == ["ack"]


@pytest.mark.cluster
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.postgres
def test_faults_under_load_lose_nothing():
    """One replica on each worker node (Ray's state API); across the six faults (user0's worker cut from db, the
    other worker cut from s3, the ingress killed, user0's worker killed with -9, PostgreSQL's immediate restart,
    s3 killed; each held 8 s) no acknowledged write is lost, no user is served another's memory, every user is
    served while user0's worker is cut from db or dead (the other replica takes its users: the ingress moves a
    read or chat that got 503 store_unavailable), no read fails while a worker is cut, and every user is served
    again after each heal; the ingress, restarted, attaches to the replicas still running instead of replacing
    them. PostgreSQL's statement_timeout is 2 s here, so a replica cut from db answers 503 within 4 s, inside the
    hold."""
    import cluster_faults

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (network namespaces)")
    out = Path(tempfile.mkdtemp(prefix="kvmc-"))  # short: Ray's unix sockets live below it
    out.chmod(0o755)  # PostgreSQL runs as its own user (never root), and its data directory lies below
    passed = False
    try:
        rep = cluster_faults.run(hold=8, users=4, out=out, names=None, settle=0.5, statement_timeout="2s")
        _check_faults(rep)
        passed = True
    finally:
        if passed:
            shutil.rmtree(out, ignore_errors=True)
        else:  # the load's events, every node's log and the report, for whoever reads the failure
            print(f"the fault run's folder is kept: {out} (events.jsonl, cluster/logs/, report.json)")


def _check_faults(rep: dict) -> None:
    import cluster_faults

    assert sorted(rep["placement"].values()) == ["10.77.0.11", "10.77.0.12"]
    t = rep["totals"]
    assert t["acked_writes"] >= 20, t
    assert t["acked_writes_lost"] == 0 and t["cross_user_injections"] == 0 and t["cross_user_reads"] == 0, rep
    assert t["read_your_writes_violations"] == 0 and t["stale_injections"] == 0 and t["hung"] == 0, t
    # the load lost none of its users to its own errors, and every answer was the JSON it said it was
    assert t["client_errors"] == 0 and t["unreadable_answers"] == 0, rep["problems"]
    assert [w["name"] for w in rep["faults"]] == list(cluster_faults.FAULTS)
    f = {w["name"]: w for w in rep["faults"]}
    assert [f[k]["fault"] for k in ("ingress-restart", "pg-restart", "s3-restart")] == [
        "ingress killed, restarted", "PostgreSQL immediate restart", "s3 killed, restarted"
    ]  # fmt: skip
    # the restarted ingress attached to the running replicas (same options): no replica restarted, no model load
    assert f["ingress-restart"]["replicas_kept"] is True, f["ingress-restart"]
    assert all(w["all_served_after_heal_s"] is not None for w in rep["faults"]), rep["faults"]
    # user0's worker cut from db or killed: every user is still served while it lasts, user0 by the other replica
    # (on a worker cut from s3 a write may wait out the object store's 10 s timeout, longer than the hold)
    db_cut, killed, s3_cut = f["db-cut"], f["kill-worker"], f["s3-cut"]
    assert db_cut["unserved_while_held"] == [] and killed["unserved_while_held"] == [], (db_cut, killed)
    assert db_cut["reads_failed_while_held"] == 0 and s3_cut["reads_failed_while_held"] == 0, (db_cut, s3_cut)
