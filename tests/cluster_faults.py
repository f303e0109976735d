"""Faults under load on the one-machine cluster (tests/cluster.py), with a history checker.

    python tests/cluster_faults.py run [--hold 30] [--users 6] [--out DIR] [--faults a,b,...] [--json FILE]
        build the cluster, run the load, inject each fault in turn (hold it, heal it, wait until every user is
        served again, at most ``SERVED_WITHIN_S``), stop the load, check the history, print the report (JSON, and a
        Markdown table), down. DIR keeps the events, every node's logs and the report; its path is printed.
    python tests/cluster_faults.py load URL KEY EVENTS USERS STOPFILE      (internal: run in the head namespace)

The load: ``USERS`` users, one thread each, through the ingress with an API key. Each user first adds a unique
canary fact, then loops over kv-mode chats (``memory.top_k`` above the user's fact count, so every live fact is
injected), lists of its memories, adds, updates and deletes of its own facts (at most ``MAX_FACTS`` live). Every
request is one event in EVENTS (JSON lines): the user, the operation, the memory id and text it wrote, the send and
answer times, the outcome (``ack``: a 2xx; ``failed``: an error status or a refused connection, nothing written;
``unknown``: no answer, the write may or may not have happened) and what a read saw (the ids and texts of a list,
the ``kvmem.fact_ids`` a chat injected); a 500, a 504 and a 503 ``replica_lost`` (the ingress's word for a
write whose replica died while running it) are ``unknown`` too. When STOPFILE appears each user lists its
memories until that succeeds. Any exception in a user's thread (``guarded``) is a ``client_error`` event and the
user goes on.

The checker (``check``) replays each user's history (one thread per user: its requests are sequential) and
reports: acknowledged writes lost (the last list lacks an acked fact or its acked text, or shows an acked delete);
read-your-writes violations (a list sent after an ack that does not show it); stale injections (a chat sent after
an ack whose injected facts miss it or still hold a deleted fact: the bound is 0 s, as every replica checks the
user's version in the store on every request); cross-user injections (a chat or list of one user holding another
user's fact); requests that hung (no answer within ``CLIENT_TIMEOUT_S``); and, per fault, the seconds from the heal
until every user had a request acknowledged again. Writes whose outcome is unknown make their ids uncertain: those
ids are not judged until a later acked write of them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

SERVED_WITHIN_S = 120.0  # after a heal, how long the run waits for every user to be served before going on
CLIENT_TIMEOUT_S = 30.0  # a request with no answer by then "hung" (a fail-fast server answers 503 well before)
MAX_FACTS = 10
# answers that promise nothing about a write: a gateway timeout, an internal error, and the ingress's 503
# replica_lost ("the write may or may not have landed": its replica died while running it)
UNKNOWN = {504, 500, "replica_lost"}
MODEL = "smollm2-135m-instruct"
FAULTS = ("db-cut", "s3-cut", "ingress-restart", "kill-worker", "pg-restart", "s3-restart")  # in the order run


def outcome_of(status: int, code: str | None) -> str:
    """A write's outcome from an error answer (``status`` >= 300, the body's ``error.code``): ``unknown`` for what
    promises nothing (``UNKNOWN``), else ``failed`` (nothing written)."""
    return "unknown" if status in UNKNOWN or code in UNKNOWN else "failed"


# --- the load (runs inside the head namespace) ----------------------------------------------------------


def load(url: str, key: str, events_path: str, users: int, stop_file: str) -> None:
    import httpx

    lock = threading.Lock()

    def record(ev: dict) -> None:
        with lock:  # out: the events file, open while the users run
            out.write(json.dumps(ev) + "\n")

    def user_loop(u: str, seed: int) -> bool:
        rng = random.Random(seed)
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT_S)
        live: dict[str, str] = {}  # what this user believes is live (acked), to pick ids for updates/deletes
        n = 0

        def call(op: str, method: str, path: str, **kw) -> dict:
            ev = {"user": u, "op": op, "t0": time.time()}
            try:
                r = client.request(method, path, **kw)
                ev.update(t1=time.time(), status=r.status_code)
                try:
                    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                except ValueError:  # an answer that is not the JSON it says: what it did is unknown
                    ev.update(outcome="unknown", code="unreadable_body", text_head=r.text[:200])
                    return ev
                if r.status_code < 300:
                    ev["outcome"] = "ack"
                    ev["body"] = body
                else:
                    ev["code"] = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
                    ev["outcome"] = outcome_of(r.status_code, ev["code"])
            except httpx.TimeoutException:
                ev.update(t1=time.time(), status=None, outcome="unknown", hung=True)
            except httpx.TransportError as exc:
                # refused before anything was sent: nothing was written; a connection lost mid-request: unknown
                sent = not isinstance(exc, httpx.ConnectError)
                ev.update(t1=time.time(), status=None, outcome="unknown" if sent else "failed", code=type(exc).__name__)
            return ev

        def add(text: str) -> None:
            ev = call("add", "POST", "/v1/memories", json={"messages": text, "user_id": u, "infer": False})
            ev["text"] = text
            if ev["outcome"] == "ack":
                (item,) = ev.pop("body")["results"]
                ev["id"] = item["id"]
                live[item["id"]] = text
            record(ev)

        def final() -> bool:
            ev = call("final", "GET", "/v1/memories", params={"user_id": u, "limit": 1000})
            if ev["outcome"] == "ack":
                ev["seen"] = {m["id"]: m["memory"] for m in ev.pop("body")["results"]}
            record(ev)
            return ev["outcome"] == "ack"

        canary = f"The canary word of {u} is {u}-{os.urandom(4).hex()}."
        while not live and not os.path.exists(stop_file):  # the canary is acked before the load begins
            guarded(u, add, canary)
            if not live:
                time.sleep(1)
        canary_id = next(iter(live), None)

        def step(n: int) -> None:
            p = rng.random()
            own = [i for i in live if i != canary_id]
            if p < 0.35:
                ev = call("chat", "POST", "/v1/chat/completions", json={
                    "model": MODEL, "user": u, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "What is my canary word?"}],
                    "memory": {"mode": "kv", "top_k": 50},
                })  # fmt: skip
                if ev["outcome"] == "ack":
                    b = ev.pop("body")
                    ev["fact_ids"] = b.get("kvmem", {}).get("fact_ids")
                    ev["replica"] = b.get("kvmem", {}).get("replica")
                    ev["cached"] = b.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
                record(ev)
            elif p < 0.55:
                ev = call("list", "GET", "/v1/memories", params={"user_id": u, "limit": 1000})
                if ev["outcome"] == "ack":
                    ev["seen"] = {m["id"]: m["memory"] for m in ev.pop("body")["results"]}
                record(ev)
            elif p < 0.75 and len(live) < MAX_FACTS or not own:
                add(f"{u} note {n}: item {rng.randrange(10**6)} is in box {rng.randrange(100)}.")
            elif p < 0.88:
                mid, text = rng.choice(own), f"{u} note {n}: updated, item {rng.randrange(10**6)}."
                ev = call("update", "PUT", f"/v1/memories/{mid}", json={"text": text})
                ev.update(id=mid, text=text)
                ev.pop("body", None)
                if ev["outcome"] == "ack":
                    live[mid] = text
                elif ev["outcome"] == "unknown":
                    live.pop(mid, None)  # no longer certain: not picked again
                record(ev)
            else:
                mid = rng.choice(own)
                ev = call("delete", "DELETE", f"/v1/memories/{mid}")
                ev["id"] = mid
                ev.pop("body", None)
                if ev["outcome"] != "failed":
                    live.pop(mid, None)
                record(ev)

        while not os.path.exists(stop_file):
            n += 1
            guarded(u, step, n)
            time.sleep(rng.uniform(0.05, 0.3))
        end = time.monotonic() + 180
        while time.monotonic() < end:  # the final read: what the store holds once the faults are healed
            if guarded(u, final):
                break
            time.sleep(1)
        return True

    def guarded(u: str, fn, *args):
        """``fn(*args)``; any exception (a harness bug, an answer it cannot read) is recorded as a ``client_error``
        event and the user goes on: a load that loses a user cannot vouch for the server. Should the record itself
        fail, the traceback goes to stderr (the load's log) and the user still goes on."""
        try:
            return fn(*args)
        except Exception:
            t, tb = time.time(), traceback.format_exc(limit=6)
            try:
                record({"user": u, "op": "client_error", "t0": t, "t1": t, "outcome": "error", "error": tb})
            except Exception:
                print(f"{u}: client error not recorded:\n{tb}{traceback.format_exc(limit=2)}", file=sys.stderr)
            return None

    def user(u: str, seed: int) -> None:
        """``user_loop`` with nothing let through: should it end on an exception all the same (one raised
        outside ``guarded``), that is an event too, and the user starts over on a new client."""
        while guarded(u, user_loop, u, seed) is None and not os.path.exists(stop_file):
            time.sleep(1)

    threads = [threading.Thread(target=user, args=(f"user{i}", i), daemon=True) for i in range(users)]
    with open(events_path, "a", buffering=1) as out:
        for t in threads:
            t.start()
        for t in threads:
            t.join()


# --- the checker ----------------------------------------------------------------------------------------


def check(events: list[dict], faults: list[dict]) -> dict:
    """The history's report (see the module docstring). ``faults``: ``{"name", "title", "inject", "heal"}`` (its
    ``--faults`` name, what it did, epoch s); each fault's entry carries both (``name``, ``fault``: the title)."""
    by_user: dict[str, list[dict]] = {}
    owner: dict[str, str] = {}
    for ev in sorted(events, key=lambda e: e["t0"]):
        by_user.setdefault(ev["user"], []).append(ev)
        if ev["op"] == "add" and ev.get("id"):
            owner[ev["id"]] = ev["user"]
    totals = {"requests": 0, "ack": 0, "failed": 0, "unknown": 0, "hung": 0, "acked_writes": 0,
              "acked_writes_lost": 0, "read_your_writes_violations": 0, "stale_injections": 0,
              "cross_user_injections": 0, "cross_user_reads": 0, "client_errors": 0,
              "unreadable_answers": 0}  # fmt: skip
    problems: list[dict] = []
    for user, evs in by_user.items():
        acked: dict[str, str] = {}  # id -> text, as acknowledged
        deleted: set[str] = set()
        uncertain: set[str] = set()
        unknown_texts: set[str] = set()
        for ev in evs:
            if ev["op"] == "client_error":  # the load's own failure (``guarded``), not a request
                totals["client_errors"] += 1
                problems.append({"user": user, "op": "client_error", "t0": ev["t0"], "error": ev.get("error")})
                continue
            totals["requests"] += 1
            totals[ev["outcome"]] += 1
            totals["unreadable_answers"] += ev.get("code") == "unreadable_body"
            totals["hung"] += bool(ev.get("hung"))
            op = ev["op"]
            if op in ("add", "update", "delete"):
                mid = ev.get("id")
                if ev["outcome"] == "ack":
                    totals["acked_writes"] += 1
                    if op == "delete":
                        acked.pop(mid, None)
                        deleted.add(mid)
                    else:
                        acked[mid] = ev["text"]
                        deleted.discard(mid)
                    uncertain.discard(mid)
                elif ev["outcome"] == "unknown":
                    if mid:
                        uncertain.add(mid)
                    else:
                        unknown_texts.add(ev["text"])
                continue
            if ev["outcome"] != "ack":
                continue
            if op in ("list", "final"):
                seen = ev["seen"]
                foreign = [i for i in seen if owner.get(i, user) != user]
                totals["cross_user_reads"] += len(foreign)
                for i, text in seen.items():  # an unknown add that happened: its id is learnt here
                    if i not in acked and i not in deleted and text in unknown_texts:
                        uncertain.add(i)
                bad = [i for i, t in acked.items() if i not in uncertain and seen.get(i) != t]
                bad += [i for i in deleted if i not in uncertain and i in seen]
                key = "acked_writes_lost" if op == "final" else "read_your_writes_violations"
                totals[key] += len(bad)
                if bad or foreign:
                    problems.append({"user": user, "op": op, "t0": ev["t0"], "bad": bad, "foreign": foreign})
            elif op == "chat" and ev.get("fact_ids") is not None:
                got = set(ev["fact_ids"])
                foreign = [i for i in got if owner.get(i, user) != user]
                totals["cross_user_injections"] += len(foreign)
                stale = [i for i in acked if i not in uncertain and i not in got]
                stale += [i for i in deleted if i not in uncertain and i in got]
                totals["stale_injections"] += bool(stale)
                if stale or foreign:
                    problems.append({"user": user, "op": "chat", "t0": ev["t0"], "stale": stale, "foreign": foreign})
        if not any(e["op"] == "final" and e["outcome"] == "ack" for e in evs):
            problems.append({"user": user, "op": "final", "error": "never listed after the faults"})
            totals["acked_writes_lost"] += len(acked)
    windows = []
    for k, f in enumerate(faults):
        end = faults[k + 1]["inject"] if k + 1 < len(faults) else float("inf")
        inside = [e for e in events if f["inject"] <= e["t0"] < end and e["op"] not in ("final", "client_error")]
        fails = [e for e in inside if e["outcome"] != "ack"]
        served = {}
        for u, evs in by_user.items():
            after = [e["t1"] for e in evs if e["t0"] >= f["heal"] and e["outcome"] == "ack" and e["op"] != "final"]
            served[u] = min(after) - f["heal"] if after else None
        windows.append({
            "name": f["name"], "fault": f.get("title", f["name"]), "held_s": round(f["heal"] - f["inject"], 1),
            "requests": len(inside),
            "ack": sum(e["outcome"] == "ack" for e in inside),
            "failed": sum(e["outcome"] == "failed" for e in inside),
            "unknown": sum(e["outcome"] == "unknown" for e in inside),
            "hung": sum(bool(e.get("hung")) for e in inside),
            # reads and chats sent while the fault was held that did not succeed: where one replica cannot reach
            # db or s3, the ingress retries them on the other (a write is never retried: it may have landed)
            "reads_failed_while_held": sum(
                e["op"] in ("list", "chat") and e["outcome"] != "ack" and e["t0"] < f["heal"] for e in inside
            ),
            # users with no request sent while it was held that succeeded: served nowhere during the fault
            "unserved_while_held": sorted(
                u for u in by_user if not any(e["user"] == u and e["outcome"] == "ack" and e["t0"] < f["heal"]
                                              for e in inside)
            ),
            "rerouted": f.get("rerouted"),
            "replicas_kept": f.get("replicas_kept"),
            "statuses": sorted({str(e.get("status") or e.get("code")) for e in fails}),
            "slowest_failure_s": round(max((e["t1"] - e["t0"] for e in fails), default=0.0), 2),
            "all_served_after_heal_s": None if None in served.values() else round(max(served.values()), 1),
        })  # fmt: skip
    return {"totals": totals, "faults": windows, "problems": problems[:50]}


def markdown(report: dict) -> str:
    rows = ["| fault | held s | requests | ack | failed | unknown | hung | failure statuses | slowest failure s "
            "| reads failed while held | users unserved while held | rerouted | all users served after heal, s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in report["faults"]:
        rows.append(
            f"| {w['fault']} | {w['held_s']} | {w['requests']} | {w['ack']} | {w['failed']} | {w['unknown']} "
            f"| {w['hung']} | {', '.join(w['statuses'])} | {w['slowest_failure_s']} "
            f"| {w['reads_failed_while_held']} | {len(w['unserved_while_held'])} | {w['rerouted']} "
            f"| {w['all_served_after_heal_s']} |"
        )
    t = report["totals"]
    rows.append("")
    rows.append(
        f"Totals: {t['requests']} requests, {t['acked_writes']} acknowledged writes; acknowledged writes lost "
        f"{t['acked_writes_lost']}; read-your-writes violations {t['read_your_writes_violations']}; stale injections "
        f"{t['stale_injections']} (bound 0 s); cross-user injections {t['cross_user_injections']} (reads "
        f"{t['cross_user_reads']}); hung past {CLIENT_TIMEOUT_S:.0f} s: {t['hung']}."
    )
    return "\n".join(rows)


# --- the run --------------------------------------------------------------------------------------------


def faults_of(c, model: str, events: Path) -> dict:
    """Each fault by its ``--faults`` name: (title, inject, heal), on the cluster ``c``. The cut and the kill
    strike the worker node whose replica served ``user0``'s latest chat (``node_of_user``), so that at least one
    user must be served elsewhere while the fault is held; the s3 cut strikes the other worker. A title names the
    node at inject time."""
    hit: dict[str, str] = {}

    def worker(other: bool = False) -> str:
        if "node" not in hit:
            hit["node"] = node_of_user(c, events, "user0")
        return ({"w1", "w2"} - {hit["node"]}).pop() if other else hit["node"]

    def ingress_kill():
        os.kill(c.procs["ingress"].pid, signal.SIGKILL)
        c.procs["ingress"].wait()

    def cut(svc: str, other: bool = False) -> tuple:
        whose = "the other worker" if other else "user0's"
        return (
            lambda: f"{worker(other)} ({whose}) cut from {svc}",
            lambda: c.cut(worker(other), svc),
            lambda: c.heal(worker(other), svc),
        )

    def kill() -> tuple:
        return (
            lambda: f"kill -9 {worker()} (user0's; raylet + replica)",
            lambda: c.kill_node_processes(worker()),
            lambda: c.ray_start(worker(), cpus=1),
        )

    # the cuts first, while each worker holds a replica (as placed at start): one node's users move; the ingress
    # restart before the kill, so its replicas are still the ones placed at start
    faults = {
        "db-cut": cut("db"),
        "s3-cut": cut("s3", other=True),
        "ingress-restart": (lambda: "ingress killed, restarted", ingress_kill, lambda: c.ingress_start(model)),
        "kill-worker": kill(),
        "pg-restart": (lambda: "PostgreSQL immediate restart", c.db_stop, c.db_start),
        "s3-restart": (lambda: "s3 killed, restarted", c.s3_kill, c.s3_start),
    }
    return {k: faults[k] for k in FAULTS}


def node_of_user(c, events: Path, user: str) -> str:
    """The worker node (``w1`` or ``w2``) whose replica answered ``user``'s latest acknowledged chat: that
    replica's ``/ready`` (pinned to it through the ingress) gives its pid, and ``ip netns pids`` the node."""
    from cluster import ns, sh

    end = time.monotonic() + 120
    while True:  # the load may not have sent that user's first chat yet
        rids = [
            e["replica"] for e in read_events(events) if e["user"] == user and e["op"] == "chat" and e.get("replica")
        ]
        if rids or time.monotonic() > end:
            break
        time.sleep(0.5)
    if not rids:
        raise RuntimeError(f"{user} had no chat answered within 120 s")
    rid = rids[-1]
    code = (
        "import httpx\n"
        f"r = httpx.get('{c.url}/ready', headers={{'Authorization': 'Bearer {c.api_key}', "
        f"'X-Kvmem-Replica': '{rid}'}}, timeout=30).json()\n"
        "print(r['pid'] if r.get('replica') == " + repr(rid) + " else '')\n"
    )
    pid = c.run_in("head", code).strip().splitlines()[-1]
    for node in ("w1", "w2"):
        if pid in sh("ip", "netns", "pids", ns(node), check=False).stdout.split():
            return node
    raise RuntimeError(f"{user}'s replica {rid} (pid {pid or '?'}) is on neither worker")


def read_events(events_path: Path) -> list[dict]:
    """The events the load has written so far (none before its file exists); a line it is still writing (the last,
    half written) is left out."""
    out = []
    for line in events_path.read_text().splitlines() if events_path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_served(events_path: Path, since: float, users: int, timeout: float, load=None) -> float | None:
    """Seconds from ``since`` until every user had a request acknowledged that was sent after it; None after
    ``timeout`` s, or at once when the ``load`` process (a Popen) has exited: nothing more will come."""
    end = time.time() + timeout
    while time.time() < end and (load is None or load.poll() is None):
        ok: dict[str, float] = {}
        for e in read_events(events_path):
            if e["t0"] >= since and e["outcome"] == "ack":
                ok[e["user"]] = min(ok.get(e["user"], e["t1"]), e["t1"])
        if len(ok) >= users:
            return max(ok.values()) - since
        time.sleep(1)
    return None


def run(hold: float, users: int, out: Path, names: list[str] | None, model: str = MODEL, settle: float = 5,
        log=print, statement_timeout: str | None = None) -> dict:  # fmt: skip
    """Build the cluster, load it, inject the faults (``names``, of ``FAULTS``; None: all), check; always takes
    the cluster down. ``statement_timeout``: PostgreSQL's for kvmem's sessions (None: kvmem's). The report."""
    from cluster import Cluster

    out.mkdir(parents=True, exist_ok=True)
    events, stop = out / "events.jsonl", out / "stop"
    for f in (events, stop):
        f.unlink(missing_ok=True)
    c = Cluster(out / "cluster", statement_timeout=statement_timeout)
    timeline: list[dict] = []
    try:
        c.up(model, log=log)
        placement = c.placement()
        log(f"replicas: {placement}")
        mem = node_memory(c)
        log(f"memory (RSS, MiB): {mem}")
        load_proc = c.spawn("load", "head", [sys.executable, __file__, "load", c.url, c.api_key, events, users, stop])
        t = wait_served(events, time.time(), users, 300, load_proc)
        log(f"load: every user served ({t and round(t, 1)} s); steady {settle * 2:.0f} s")
        time.sleep(settle * 2)
        table = faults_of(c, model, events)
        done: list[str] = []
        for key in table if names is None else names:
            title, inject, heal = table[key]
            name = title()
            replicas = None  # Ray's live replica actors before the ingress restart: as placed, unless one died
            if key == "ingress-restart":
                replicas = set(c.placement()) if "kill-worker" in done else set(placement)
            done.append(key)
            before = rerouted(c)
            t_in = time.time()
            log(f"inject: {name}")
            inject()
            time.sleep(hold)
            heal()
            t_heal = time.time()
            after = rerouted(c)
            moved = after - before if None not in (before, after) and after >= before else None
            timeline.append({"name": key, "title": name, "inject": t_in, "heal": t_heal, "rerouted": moved})
            back = wait_served(events, t_heal, users, SERVED_WITHIN_S, load_proc)
            if replicas is not None:  # the restarted ingress attached to the running replicas: none replaced
                timeline[-1]["replicas_kept"] = set(c.placement()) == replicas
                log(f"replicas kept across the ingress restart: {timeline[-1]['replicas_kept']}")
            log(f"healed: {name}; every user served again after {back and round(back, 1)} s")
            time.sleep(settle)
        stop.touch()
        try:
            load_proc.wait(timeout=240)
        except subprocess.TimeoutExpired:  # a user never got its final list: the checker reports it
            log("the load did not end within 240 s of the stop: killed")
            os.kill(load_proc.pid, signal.SIGKILL)
            load_proc.wait()
        report = check([json.loads(x) for x in events.read_text().splitlines()], timeline)  # all whole now
        report.update(placement=placement, memory_mib=mem, hold_s=hold, users=users, model=model,
                      statement_timeout=statement_timeout, timeline=timeline)  # fmt: skip
        (out / "report.json").write_text(json.dumps(report, indent=1))
        (out / "report.md").write_text(markdown(report) + "\n")
        log(markdown(report))
        return report
    finally:
        stop.touch()
        c.down(log=log)


def rerouted(c) -> int | None:
    """The ingress's count of reads and chats it moved off a replica that answered 503 ``store_unavailable``
    (``kvmem_ingress_requests_total{outcome="rerouted"}``), or None when its /metrics does not answer."""
    code = (
        "import httpx\n"
        f"r = httpx.get('{c.url}/metrics', headers={{'Authorization': 'Bearer {c.api_key}'}}, timeout=5)\n"
        "print(sum(float(x.split()[-1]) for x in r.text.splitlines()"
        " if x.startswith('kvmem_ingress_requests_total{') and 'rerouted' in x))\n"
    )
    try:
        return int(float(c.run_in("head", code, timeout=30).strip().splitlines()[-1]))
    except (RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def node_memory(c) -> dict[str, int]:
    """Each node's processes' resident memory, MiB (``ip netns pids``, ``/proc/PID/status`` VmRSS)."""
    from cluster import NODES, SERVICES, ns, sh

    out = {}
    for node in [*NODES, *SERVICES]:
        kb = 0
        for pid in sh("ip", "netns", "pids", ns(node), check=False).stdout.split():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        kb += int(line.split()[1])
            except OSError:
                pass
        out[node] = kb // 1024
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "load":
        url, key, events, users, stop = argv[1:6]
        load(url, key, events, int(users), stop)
        return 0
    ap = argparse.ArgumentParser(prog="cluster_faults.py")
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("--hold", type=float, default=30.0, help="seconds each fault is held before it is healed")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--out", default="/tmp/kvmc-faults")
    ap.add_argument("--faults", default=None, help=f"comma-separated, of {', '.join(FAULTS)} (default: all; none: "
                    "the load only)")  # fmt: skip
    ap.add_argument("--statement-timeout", default=None, help="PostgreSQL's statement_timeout for kvmem's sessions "
                    "(PGOPTIONS), e.g. 2s: a replica cut from db answers 503 after it + 2 s (default: kvmem's, "
                    "10 s)")  # fmt: skip
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--json", default=None, help="write the report (report.json's fields) to this file too")
    a = ap.parse_args(argv)
    names = None if a.faults is None else [] if a.faults == "none" else a.faults.split(",")
    unknown = sorted(set(names or []) - set(FAULTS))
    if unknown:
        ap.error(f"--faults: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)}, or none)")
    try:
        rep = run(a.hold, a.users, Path(a.out), names, a.model, statement_timeout=a.statement_timeout)
    finally:
        print(f"the run's folder: {a.out} (events.jsonl, cluster/logs/, each node's Ray logs, report.json)")
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1))
    t = rep["totals"]
    return 0 if t["acked_writes_lost"] == 0 and t["cross_user_injections"] == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
