"""``kvmem bench serve``: a load test of ``kvmem serve`` on loopback, bounded in users, time and requests.

1. Starts ``kvmem serve`` (a subprocess, with API keys) on a fresh store and waits for ``/ready``.
2. Gives each simulated user its own memories over ``POST /v1/memories`` (``infer=False``): ``facts`` distinct
   LoCoMo observations plus one **canary**, a random code word only that user has.
3. For each concurrency in ``users`` and each mode (kv, prompt): that many users run for ``duration`` seconds,
   each a loop of streaming chat requests (``memory.mode`` = the phase's mode, ``top_k`` = ``k``) with a memory
   add (``add_every``) and a delete of its own added fact (``delete_every``) mixed in.

Measured at the client: requests completed and errors; TTFT = request sent -> first token's SSE chunk (the
server sends the role chunk only once the first token exists), p50 / p95; chat QPS per mode. Every chat answer
and its ``kvmem.fact_ids`` are checked: **leaks** = another user's canary in the text or another user's fact id;
**stale** = a fact id this user deleted before sending the request. The server's and engine's peak RSS (the
process tree, sampled every 0.5 s) is reported. Writes serve.json, serve.md and serve.png.

``cold_every`` n: one more kv phase at the headline concurrency in which every n-th user is **cold**: each of its
chats asks for ``memory.cache = "cold"`` (the server runs with ``--allow-cold-requests``), so its facts are dropped
from every cache tier (page cache, disk cache, both read caches) and vLLM's prefix cache cannot serve them; the
request's own prefetch along the retrieval path then runs as for any request. It comes right
after an all-hot kv phase of the same users and length (the reference: every cache warm, as for the cold phase's
hot users). The hot users' TTFT in the cold phase against the same users' TTFT in the reference is what a cold
user costs everyone else (``cold`` in serve.json).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import shutil
import sys
import time
from pathlib import Path

import httpx
import psutil

from ..locomo import load_locomo
from .common import free_port, log_err, machine, median, p95, pyplot, served, table, write_json

WORDS = [
    "amber",
    "basalt",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lagoon",
    "marble",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


def facts_pool(data: Path) -> list[str]:

    seen, out = set(), []
    for c in load_locomo(data):
        for f in c.facts:
            if f.text not in seen and 20 <= len(f.text) <= 200:
                seen.add(f.text)
                out.append(f"[{f.date}] {f.text}")
    random.Random(0).shuffle(out)
    return out


class Tree:
    """Peak RSS of a process and its children (server + vLLM engine core and worker), sampled."""

    def __init__(self, pid: int):

        self.proc, self.peak_total, self.peak_server, self.peak_engine = psutil.Process(pid), 0, 0, 0
        self.peaks: dict[str, int] = {}  # "<process name> <pid>" -> peak RSS (every process of the tree)

    def sample(self) -> None:

        try:
            main = self.proc.memory_info().rss
            kids = {}
            for c in self.proc.children(recursive=True):
                try:
                    kids[f"{_label(c)} {c.pid}"] = c.memory_info().rss
                except psutil.Error:
                    continue
        except psutil.Error:
            return
        for name, rss in [(f"kvmem serve {self.proc.pid}", main), *kids.items()]:
            self.peaks[name] = max(self.peaks.get(name, 0), rss)
        total = sum(kids.values())
        self.peak_server, self.peak_engine = max(self.peak_server, main), max(self.peak_engine, total)
        self.peak_total = max(self.peak_total, main + total)


def _label(p: psutil.Process) -> str:
    """A process's short name: Ray's workers by their actor (``ray::ServeReplica:kvmem:Replica``)."""
    cmd = p.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0]
    if cmd and len(cmd) > 1 and cmd[1].endswith(".py"):
        return Path(cmd[1]).stem
    return p.name()


class User:
    def __init__(self, i: int, key: str, facts: list[str]):
        self.name, self.key, self.facts = f"user{i:03d}", key, facts
        self.canary = f"{random.choice(WORDS)}-{secrets.token_hex(3)}"
        self.ids: set[str] = set()  # every id this user ever got back
        self.extra: list[str] = []  # ids of facts added during the run (deletable)
        self.deleted: set[str] = set()
        self.n_added = 0


async def _setup_user(client, u: User) -> None:
    msgs = [{"role": "user", "content": f} for f in u.facts] + [
        {"role": "user", "content": f"{u.name}'s secret code word is {u.canary}."}
    ]
    r = await client.post(
        "/v1/memories",
        json={"messages": msgs, "user_id": u.name, "infer": False},
        headers={"Authorization": f"Bearer {u.key}"},
        timeout=600,
    )
    r.raise_for_status()
    u.ids |= {e["id"] for e in r.json()["results"]}


async def setup_users(base: str, users: list[User]) -> None:
    """Every user's memories and canary (``_setup_user``), four users at a time."""
    async with httpx.AsyncClient(base_url=base) as client:
        sem = asyncio.Semaphore(4)

        async def one(u):
            async with sem:
                await _setup_user(client, u)

        await asyncio.gather(*(one(u) for u in users))


async def _chat(
    client, u: User, mode: str, k: int, max_tokens: int, stats: dict, canaries: dict, cold: bool = False,
    send_cold: bool = True,
) -> None:  # fmt: skip
    body = {
        "model": stats["model"],
        "user": u.name,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "memory": {"top_k": k, "mode": mode, **({"cache": "cold"} if cold and send_cold else {})},
        "messages": [
            {
                "role": "user",
                "content": random.choice(
                    [
                        "What is my secret code word?",
                        "What did I do last weekend?",
                        "Who are my friends?",
                        "What are my hobbies?",
                        "Where did I travel recently?",
                        "What do I like to eat?",
                    ]
                ),
            }
        ],
    }
    deleted_before = set(u.deleted)
    t0 = time.perf_counter()
    ttft, text, kv = None, [], None
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {u.key}"}, timeout=600
    ) as r:
        if r.status_code != 200:
            await r.aread()
            stats["errors"].append(f"chat {r.status_code}: {r.text[:200]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                stats["errors"].append(f"chat stream: {ev['error']}")
                return
            for ch in ev.get("choices", []):
                text.append(ch["delta"].get("content") or "")
            kv = ev.get("kvmem", kv)
    answer = "".join(text)
    if kv is None:
        stats["errors"].append("chat: no kvmem field in the final chunk")
        return
    stats["ttft_cold" if cold else "ttft_hot"].append(ttft)
    stats["ttft"][mode].append(ttft)
    stats["done"][mode] += 1
    stats["served"].append((time.perf_counter(), u.name, kv.get("replica")))
    foreign_ids = set(kv["fact_ids"]) - u.ids
    foreign_canary = [c for name, c in canaries.items() if name != u.name and c in answer]
    if foreign_ids or foreign_canary:
        stats["leaks"].append({"user": u.name, "ids": sorted(foreign_ids), "canaries": foreign_canary})
    if set(kv["fact_ids"]) & deleted_before:
        stats["stale"].append({"user": u.name, "ids": sorted(set(kv["fact_ids"]) & deleted_before)})


async def _add(client, u: User, stats: dict) -> None:
    u.n_added += 1
    r = await client.post(
        "/v1/memories",
        headers={"Authorization": f"Bearer {u.key}"},
        timeout=600,
        json={"messages": f"{u.name} noted item {u.n_added} on the shopping list.", "user_id": u.name, "infer": False},
    )
    if r.status_code != 200:
        stats["errors"].append(f"add {r.status_code}: {r.text[:200]}")
        return
    for e in r.json()["results"]:
        u.ids.add(e["id"])
        u.extra.append(e["id"])
    stats["adds"] += 1


async def _delete(client, u: User, stats: dict) -> None:
    if not u.extra:
        return
    fid = u.extra.pop(0)
    r = await client.delete(f"/v1/memories/{fid}", headers={"Authorization": f"Bearer {u.key}"}, timeout=600)
    if r.status_code != 200:
        stats["errors"].append(f"delete {r.status_code}: {r.text[:200]}")
        return
    u.deleted.add(fid)
    stats["deletes"] += 1


async def load_phase(
    base: str,
    users: list[User],
    mode: str,
    k: int,
    duration: float,
    max_tokens: int,
    model: str,
    add_every: int,
    delete_every: int,
    tree: Tree,
    during=None,
    cold_every: int = 0,
    send_cold: bool = True,
) -> dict:
    """One load phase; ``during(stats)``: a coroutine run alongside (fault injection); ``cold_every`` n: users
    0, n, 2n, ... are cold (every chat of theirs reads its memory from the store, ``memory.cache = "cold"``).
    With ``send_cold`` False they are only counted apart (``ttft_cold``), so the other users' TTFT is that of the
    same users under an all-hot load."""

    stats = {
        "model": model,
        "ttft": {mode: []},
        "ttft_hot": [],
        "ttft_cold": [],
        "done": {mode: 0},
        "errors": [],
        "leaks": [],
        "stale": [],
        "adds": 0,
        "deletes": 0,
        "served": [],
    }
    canaries = {u.name: u.canary for u in users}
    end = time.perf_counter() + duration

    cold = {u.name for i, u in enumerate(users) if cold_every and i % cold_every == 0}

    async def loop(u: User):
        n = 0
        while time.perf_counter() < end:
            n += 1
            try:
                if add_every and n % add_every == 0:
                    await _add(client, u, stats)
                elif delete_every and n % delete_every == 0:
                    await _delete(client, u, stats)
                else:
                    await _chat(client, u, mode, k, max_tokens, stats, canaries, u.name in cold, send_cold)
            except (httpx.HTTPError, ValueError) as exc:
                stats["errors"].append(f"{type(exc).__name__}: {exc}")

    async def sampler():
        while time.perf_counter() < end:
            tree.sample()
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=len(users) + 4, max_keepalive_connections=len(users) + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        t0 = time.perf_counter()
        extra = [during(stats)] if during is not None else []
        await asyncio.gather(sampler(), *(loop(u) for u in users), *extra)
        wall = time.perf_counter() - t0
    tt = stats["ttft"][mode]
    return {
        "users": len(users),
        "mode": mode,
        "wall_s": round(wall, 2),
        "chats": stats["done"][mode],
        "qps": round(stats["done"][mode] / wall, 3),
        "ttft_ms_p50": round(median(tt), 1),
        "ttft_ms_p95": round(p95(tt), 1),
        "adds": stats["adds"],
        "deletes": stats["deletes"],
        "errors": len(stats["errors"]),
        "error_samples": stats["errors"][:5],
        "leaks": len(stats["leaks"]),
        "leak_samples": stats["leaks"][:5],
        "stale": len(stats["stale"]),
        "served": stats["served"],
        "cold_users": len(cold),
        "hot_ttft_ms_p50": round(median(stats["ttft_hot"]), 1),
        "hot_ttft_ms_p95": round(p95(stats["ttft_hot"]), 1),
        "cold_ttft_ms_p50": round(median(stats["ttft_cold"]), 1) if stats["ttft_cold"] else None,
        "cold_ttft_ms_p95": round(p95(stats["ttft_cold"]), 1) if stats["ttft_cold"] else None,
        "cold_chats": len(stats["ttft_cold"]),
    }


def run(
    data: Path,
    out: Path,
    users: list[int],
    duration: float,
    k: int,
    facts: int,
    engine: str,
    model: str,
    max_tokens: int = 16,
    window: int = 2,
    sweep_duration: float | None = None,
    add_every: int = 10,
    delete_every: int = 15,
    kv_cache_bytes: int = 2 << 30,
    port: int | None = None,
    cold_every: int = 0,
) -> dict:

    out.mkdir(parents=True, exist_ok=True)
    n_users = max(users)
    pool = facts_pool(data)
    if len(pool) < n_users * facts:
        raise ValueError(
            f"{data} has {len(pool)} distinct facts; {n_users} users x {facts} facts need more (lower --facts)"
        )
    keys = {f"bench-key-{i:03d}-{secrets.token_hex(8)}": f"tenant{i % 4}" for i in range(n_users)}
    (out / "keys.json").write_text(json.dumps(keys))
    store = out / "store"
    if store.exists():
        shutil.rmtree(store)
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvmem.cli",
        "serve",
        "--store",
        str(store),
        "--model",
        model,
        "--engine",
        engine,
        "--port",
        str(port),
        "--api-keys",
        str(out / "keys.json"),
        "--window",
        str(window),
        "--max-queue",
        str(4 * n_users + 16),
        "--kv-cache-bytes",
        str(kv_cache_bytes),
        "--timeout",
        "600",
        *(["--allow-cold-requests"] if cold_every else []),
    ]
    log_err("bench serve: " + " ".join(cmd))
    t0 = time.perf_counter()
    with served(cmd, base, out / "server.log") as (proc, ready):
        startup_s = time.perf_counter() - t0
        log_err(f"bench serve: ready in {startup_s:.0f} s ({ready['engine']} engine)")
        key_list = list(keys)
        all_users = [User(i, key_list[i], pool[i * facts : (i + 1) * facts]) for i in range(n_users)]

        t1 = time.perf_counter()
        asyncio.run(setup_users(base, all_users))
        setup_s = time.perf_counter() - t1
        log_err(f"bench serve: {n_users} users x {facts + 1} memories added in {setup_s:.0f} s")
        tree = Tree(proc.pid)
        rows = []
        for n in sorted(users):
            d = duration if n == max(users) else (sweep_duration or duration)
            for mode in ("kv", "prompt"):
                row = asyncio.run(
                    load_phase(
                        base, all_users[:n], mode, k, d, max_tokens, ready["model"], add_every, delete_every, tree
                    )
                )
                row.pop("served")
                log_err(
                    f"  users={n} {mode}: {row['chats']} chats, {row['qps']} QPS, ttft p50 {row['ttft_ms_p50']} "
                    f"p95 {row['ttft_ms_p95']} ms, errors {row['errors']}, leaks {row['leaks']}, "
                    f"stale {row['stale']}"
                )
                rows.append(row)
        cold = None
        if cold_every:
            n = max(users)

            def phase(send_cold: bool) -> dict:
                r = asyncio.run(
                    load_phase(
                        base, all_users[:n], "kv", k, duration, max_tokens, ready["model"], add_every, delete_every,
                        tree, cold_every=cold_every, send_cold=send_cold,
                    )
                )  # fmt: skip
                r.pop("served")
                return r

            hot = phase(False)  # the reference: the same users, every cache warm
            row = phase(True)
            cold = {
                "users": n,
                "cold_users": row["cold_users"],
                "all_hot": {
                    "p50": hot["hot_ttft_ms_p50"],
                    "p95": hot["hot_ttft_ms_p95"],
                    "chats": hot["chats"] - hot["cold_chats"],
                },
                "hot_with_cold": {"p50": row["hot_ttft_ms_p50"], "p95": row["hot_ttft_ms_p95"]},
                "cold": {"p50": row["cold_ttft_ms_p50"], "p95": row["cold_ttft_ms_p95"], "chats": row["cold_chats"]},
                "hot_p95_over_all_hot": round(row["hot_ttft_ms_p95"] / hot["hot_ttft_ms_p95"], 3),
                "errors": row["errors"],
                "error_samples": row["error_samples"],
                "leaks": row["leaks"],
                "stale": row["stale"],
                "chats": row["chats"],
            }
            log_err(f"  users={n} kv, 1 in {cold_every} cold: {cold}")
        metrics = httpx.get(f"{base}/metrics").text
    for r in rows:
        other = next(x for x in rows if x["users"] == r["users"] and x["mode"] != r["mode"])
        if r["mode"] == "kv":
            r["kv_over_prompt_qps"] = round(r["qps"] / other["qps"], 2) if other["qps"] else None
            r["p95_over_p50"] = round(r["ttft_ms_p95"] / r["ttft_ms_p50"], 2) if r["ttft_ms_p50"] else None
    summary = {
        "machine": machine(),
        "engine": ready["engine"],
        "model": ready["model"],
        "k": k,
        "facts_per_user": facts,
        "max_tokens": max_tokens,
        "window": window,
        "duration_s": duration,
        "startup_s": round(startup_s, 1),
        "setup_s": round(setup_s, 1),
        "peak_rss_server_bytes": tree.peak_server,
        "peak_rss_engine_bytes": tree.peak_engine,
        "peak_rss_total_bytes": tree.peak_total,
        "rows": rows,
        "cold": cold,
        "errors_total": sum(r["errors"] for r in rows),
        "leaks_total": sum(r["leaks"] for r in rows),
        "stale_total": sum(r["stale"] for r in rows),
        "command": " ".join(sys.argv),
    }
    write_json(out / "serve.json", summary)
    (out / "metrics.txt").write_text(metrics)
    head = [
        "users",
        "mode",
        "chats",
        "QPS",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "adds",
        "deletes",
        "errors",
        "leaks",
        "stale",
        "kv/prompt QPS",
    ]
    body = [
        [
            r["users"],
            r["mode"],
            r["chats"],
            r["qps"],
            r["ttft_ms_p50"],
            r["ttft_ms_p95"],
            r["adds"],
            r["deletes"],
            r["errors"],
            r["leaks"],
            r["stale"],
            r.get("kv_over_prompt_qps", ""),
        ]
        for r in rows
    ]
    md = table(body, head)
    (out / "serve.md").write_text(md + "\n")
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for mode in ("kv", "prompt"):
        rs = [r for r in rows if r["mode"] == mode]
        a1.plot([r["users"] for r in rs], [r["qps"] for r in rs], marker="o", label=mode)
        a2.plot([r["users"] for r in rs], [r["ttft_ms_p95"] for r in rs], marker="o", label=mode)
    for ax, lab in ((a1, "chat QPS"), (a2, "TTFT p95 (ms, client)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(lab)
        ax.legend()
    a2.set_yscale("log")
    fig.suptitle(
        f"kvmem serve ({ready['engine']}, {ready['model']}, k={k}), {summary['machine']['cpu'][:40]}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(out / "serve.png", dpi=120)
    print(md)
    print(
        f"peak RSS: server {tree.peak_server / 2**30:.2f} GiB, engine {tree.peak_engine / 2**30:.2f} GiB; "
        f"errors {summary['errors_total']}, leaks {summary['leaks_total']}, stale {summary['stale_total']}"
    )
    return summary
