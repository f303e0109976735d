"""``kvmem bench serve --servers single,ray1,ray2 [--fault]``: the same load against the single-process server
and against ``kvmem serve --replicas N`` on Ray Serve, side by side in one run (loopback only, bounded).

The servers run one after another on one new store (a PostgreSQL schema with ``--postgres``, else a
directory). The first server adds every user's memories and canary (``serve_load``; no neighbours, to keep
set-up short: encoding is not what this measures). Every server then runs one kv-mode phase of ``duration``
seconds, in which every user loops over streaming chats, with every 4th request an add and every 6th a delete
(a user does only a few requests a minute on a 2-core CPU). Reported per server: chat QPS,
client TTFT p50 / p95, errors, leaks (another user's canary or fact id), stale (a deleted fact served), the
affinity hit rate and replica counts (``/metrics``), the phase's KV cache hit rate (facts' KV served from a
replica's memory cache), start-up time, and the peak RSS of every process of the server's tree, Ray's own
included.

``--fault``: the last Ray server runs a second phase in which one replica is killed (SIGKILL) halfway. Reported:
failed requests, the seconds until each of the killed replica's users had an answer again, and acknowledged
writes missing from the store afterwards (target 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx

from ..extras import require
from .common import free_port, log_err, machine, pyplot, served, table, write_json
from .serve_load import Tree, User, facts_pool, load_phase, setup_users

SERVERS = {"single": [], "ray1": ["--ray"], "ray2": ["--replicas", "2"]}


def _metric_sum(text: str, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (all replicas)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _ready_pids(base: str, key: str, replicas: set[str]) -> dict[str, int]:
    out = {}
    for rid in replicas:
        r = httpx.get(f"{base}/ready", headers={"Authorization": f"Bearer {key}", "X-Kvmem-Replica": rid}, timeout=30)
        if r.status_code == 200 and r.json().get("replica") == rid:
            out[rid] = r.json()["pid"]
    return out


def _killer(base: str, key: str, at_s: float, record: dict):
    """A ``during`` coroutine for ``serve_load.load_phase``: SIGKILL one replica ``at_s`` seconds in."""

    async def run(stats: dict):
        await asyncio.sleep(at_s)
        replicas = {rep for _, _, rep in stats["served"] if rep}
        pids = await asyncio.to_thread(_ready_pids, base, key, replicas)
        if not pids:
            raise RuntimeError("no replica answered /ready with its pid: nothing to kill")
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGKILL)
        record.update(victim=victim, t_kill=time.perf_counter(), n_before=len(stats["served"]))
        log_err(f"bench serve: killed replica {victim} (pid {pids[victim]})")

    return run


def _recovery(record: dict, served: list) -> dict:
    """Seconds from the kill until each user last served by the victim was answered again (by anyone)."""
    t_kill, victim = record["t_kill"], record["victim"]
    before = served[: record["n_before"]]
    moved = {u for _, u, rep in before if rep == victim}
    back = {}
    for t, u, _ in served[record["n_before"] :]:
        if u in moved and u not in back and t > t_kill:
            back[u] = t - t_kill
    waits = sorted(back.values())
    return {
        "victim_users": len(moved),
        "victim_users_served_again": len(back),
        "seconds_until_served_again_max": round(max(waits), 2) if waits else None,
        "seconds_until_served_again_median": round(waits[len(waits) // 2], 2) if waits else None,
    }


async def _lost_writes(base: str, users: list[User]) -> int:
    """Acknowledged memories (setup, canary and adds, less the acknowledged deletes) missing from the store."""
    lost = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for u in users:
            r = await client.get(
                "/v1/memories", params={"user_id": u.name, "limit": 10000}, headers={"Authorization": f"Bearer {u.key}"}
            )
            r.raise_for_status()
            present = {m["id"] for m in r.json()["results"]}
            lost += len((u.ids - u.deleted) - present)
    return lost


def _store_for(name: str, out: Path, postgres: str | None) -> list[str]:
    """``--store`` (and ``--segments``) of a new store: a directory, or a new schema of ``postgres``."""
    if postgres is None:
        where = out / f"store-{name}"
        if where.exists():
            shutil.rmtree(where)
        return ["--store", str(where)]
    import psycopg

    from .store_backends import schema_url

    schema = f"kvmem_bench_{name}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    seg = out / f"segments-{name}"
    shutil.rmtree(seg, ignore_errors=True)
    return ["--store", schema_url(postgres, schema), "--segments", seg.resolve().as_uri()]


def run(
    data: Path,
    out: Path,
    servers: list[str],
    users: int = 32,
    duration: float = 60.0,
    k: int = 20,
    facts: int = 24,
    engine: str = "auto",
    model: str = "qwen2.5-coder-0.5b-instruct",
    max_tokens: int = 16,
    window: int = 0,
    postgres: str | None = None,
    fault: bool = False,
    add_every: int = 4,
    delete_every: int = 6,
    cache_bytes: int = 512 << 20,
    neighbours: int = 0,
) -> dict:
    """Raises ValueError for an unknown server name or too few facts in ``data``; MissingExtra without Ray (a Ray
    server) or psycopg (``postgres``)."""
    bad = [s for s in servers if s not in SERVERS]
    if bad or not servers:
        raise ValueError(f"--servers: choose from {', '.join(SERVERS)}, not {', '.join(bad) or 'nothing'}")
    if any(s != "single" for s in servers):
        require("replicas", "kvmem bench serve --servers ray1/ray2")
    if postgres is not None:
        require("postgres", "kvmem bench serve --postgres")
    out.mkdir(parents=True, exist_ok=True)
    pool = facts_pool(data)
    if len(pool) < users * facts:
        raise ValueError(f"{data} has {len(pool)} distinct facts; {users} users x {facts} facts need more")
    keys = {f"bench-key-{i:03d}-{secrets.token_hex(8)}": f"tenant{i % 4}" for i in range(users)}
    (out / "keys.json").write_text(json.dumps(keys))
    key_list = list(keys)
    random.seed(0)
    all_users = [User(i, key_list[i], pool[i * facts : (i + 1) * facts]) for i in range(users)]
    store = _store_for("replicas", out, postgres)  # one store: built by the first server, then every server's
    results = []
    fault_row = None
    setup_s = None
    last_ray = next((s for s in reversed(servers) if s != "single"), None)
    for name in servers:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "kvmem.cli", "serve", *store, "--model", model, "--engine", engine,
               "--port", str(port), "--api-keys", str(out / "keys.json"), "--window", str(window), "--neighbours",
               str(neighbours), "--max-queue", str(4 * users + 16), "--cache-bytes", str(cache_bytes), "--timeout",
               "600", *SERVERS[name]]  # fmt: skip
        log_err("bench serve: " + " ".join(cmd))
        t0 = time.perf_counter()
        with served(cmd, base, out / f"server-{name}.log") as (proc, ready):
            startup_s = time.perf_counter() - t0
            tree = Tree(proc.pid)
            tree.sample()
            idle = dict(tree.peaks)
            log_err(f"bench serve [{name}]: ready in {startup_s:.0f} s")
            if setup_s is None:
                t1 = time.perf_counter()
                asyncio.run(setup_users(base, all_users))
                setup_s = time.perf_counter() - t1
                log_err(f"bench serve [{name}]: {users} users x {facts + 1} memories added in {setup_s:.0f} s")
            before = httpx.get(f"{base}/metrics", timeout=60).text
            phase = (base, all_users, "kv", k, duration, max_tokens, ready["model"], add_every, delete_every, tree)
            row = asyncio.run(load_phase(*phase))
            row.pop("served")
            metrics = httpx.get(f"{base}/metrics", timeout=60).text
            (out / f"metrics-{name}.txt").write_text(metrics)
            hits, misses = (  # this phase's reads only
                _metric_sum(metrics, "kvmem_store_reads", counter=c)
                - _metric_sum(before, "kvmem_store_reads", counter=c)
                for c in ("kv_hits", "kv_misses")
            )  # fmt: skip
            preferred = _metric_sum(metrics, "kvmem_affinity_requests", routed="preferred")
            fallback = _metric_sum(metrics, "kvmem_affinity_requests", routed="fallback")
            row.update(
                server=name,
                engine=ready["engine"],
                startup_s=round(startup_s, 1),
                affinity_hit_rate=round(preferred / (preferred + fallback), 4) if preferred + fallback else None,
                routed_preferred=int(preferred),
                routed_fallback=int(fallback),
                segment_cache_hit_rate=round(hits / (hits + misses), 4) if hits + misses else None,
                peak_rss_bytes=dict(sorted(tree.peaks.items())),
                idle_rss_bytes=idle,
                peak_rss_total_bytes=tree.peak_total,
            )
            results.append(row)
            log_err(
                f"  [{name}] {row['chats']} chats, {row['qps']} QPS, ttft p50 {row['ttft_ms_p50']} p95 "
                f"{row['ttft_ms_p95']} ms, errors {row['errors']}, leaks {row['leaks']}, affinity "
                f"{row['affinity_hit_rate']}, segment cache {row['segment_cache_hit_rate']}, peak RSS "
                f"{tree.peak_total / 2**30:.2f} GiB"
            )
            if fault and name == last_ray and name != "ray1":
                record: dict = {}
                killer = _killer(base, key_list[0], duration / 2, record)
                frow = asyncio.run(load_phase(*phase, during=killer))
                served_log = frow.pop("served")
                lost = asyncio.run(_lost_writes(base, all_users))
                fault_row = {
                    "server": name,
                    "chats": frow["chats"],
                    "failed_requests": frow["errors"],
                    "error_samples": frow["error_samples"],
                    "leaks": frow["leaks"],
                    "acknowledged_writes_lost": lost,
                    **_recovery(record, served_log),
                    "ttft_ms_p50": frow["ttft_ms_p50"],
                    "ttft_ms_p95": frow["ttft_ms_p95"],
                }
                log_err(f"  [{name} + kill -9] {fault_row}")
    single = next((r for r in results if r["server"] == "single"), None)
    for r in results:
        if single and r is not single and single["ttft_ms_p50"]:
            r["p50_ttft_over_single"] = round(r["ttft_ms_p50"] / single["ttft_ms_p50"], 3)
    summary = {
        "machine": machine(),
        "model": model,
        "users": users,
        "k": k,
        "facts_per_user": facts,
        "duration_s": duration,
        "max_tokens": max_tokens,
        "store": "postgresql + file:// segments" if postgres else "directory",
        "setup_s": round(setup_s or 0, 1),
        "window": window,
        "neighbours": neighbours,
        "rows": results,
        "fault": fault_row,
        "command": " ".join(sys.argv),
    }
    write_json(out / "replicas.json", summary)
    head = ["server", "chats", "QPS", "TTFT p50 ms", "TTFT p95 ms", "p50 / single", "errors", "leaks", "stale",
            "affinity", "KV cache hits", "start-up s", "peak RSS GiB"]  # fmt: skip
    body = [
        [r["server"], r["chats"], r["qps"], r["ttft_ms_p50"], r["ttft_ms_p95"], r.get("p50_ttft_over_single", ""),
         r["errors"], r["leaks"], r["stale"], r["affinity_hit_rate"] if r["affinity_hit_rate"] is not None else "",
         r["segment_cache_hit_rate"], r["startup_s"], round(r["peak_rss_total_bytes"] / 2**30, 2)]
        for r in results
    ]  # fmt: skip
    md = table(body, head)
    procs = sorted({_kind(p) for r in results for p in r["peak_rss_bytes"]})
    rss_head = ["process (peak RSS, MiB)", *[r["server"] for r in results]]
    rss_body = [[kind, *[_sum_kind(r["peak_rss_bytes"], kind) for r in results]] for kind in procs]
    md += "\n\n" + table(rss_body, rss_head)
    if fault_row:
        md += "\n\n" + table(
            [[fault_row["server"], fault_row["chats"], fault_row["failed_requests"],
              fault_row["acknowledged_writes_lost"], fault_row["victim_users"],
              fault_row["seconds_until_served_again_max"], fault_row["leaks"]]],
            ["kill -9 one replica", "chats", "failed requests", "acked writes lost", "its users",
             "s until all served again (max)", "leaks"],
        )  # fmt: skip
    (out / "replicas.md").write_text(md + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["server"] for r in results]
    ax.bar([i - 0.2 for i in range(len(names))], [r["ttft_ms_p50"] for r in results], 0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in range(len(names))], [r["ttft_ms_p95"] for r in results], 0.4, label="TTFT p95")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms (client, streaming)")
    ax.legend()
    ax.set_title(f"kvmem serve: {users} users, k={k}, {model}; {summary['machine']['cpu'][:40]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=120)
    print(md)
    return summary


def _kind(label: str) -> str:
    return label.rsplit(" ", 1)[0]


def _sum_kind(peaks: dict, kind: str) -> str:
    vals = [v for k, v in peaks.items() if _kind(k) == kind]
    if not vals:
        return ""
    return " + ".join(str(round(v / 2**20)) for v in vals)
