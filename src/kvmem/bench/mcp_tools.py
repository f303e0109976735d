"""``kvmem bench mcp``: round trips of the memory tools over MCP's streamable HTTP (``/mcp``), side by side with
the same work over the REST memories API, against one in-process ``kvmem serve`` app on a loopback port (the
transformers engine; adds verbatim, ``infer=False``, so an add is one encoding of the text).

Per round, in this order: a new MCP session (``initialize`` and its ``initialized`` notification), ``tools/list``
(the protocol alone), ``add_memories``, ``search_memory``, then the REST ``POST /v1/memories`` and ``POST
/v1/memories/search`` of the same texts. Every call is timed at the client (the SDK's ``ClientSession`` over
``httpx2``; the REST calls over ``httpx2`` too), milliseconds. The first round is a warm-up and not recorded.

Writes summary.json (p50 / p95 per operation, and MCP's p50 over REST's for add and search) and records.json/csv
under ``--out``."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..server.inthread import serve_in_thread
from .common import machine, median, p95, ratio, table, write_summary_and_records

OPS = ("mcp_session", "mcp_list_tools", "mcp_add", "mcp_search", "rest_add", "rest_search")


async def _rounds(base: str, rounds: int) -> list[dict]:
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    records = []
    async with httpx2.AsyncClient(timeout=300) as http:
        for i in range(rounds + 1):
            text = f"Note {i}: the bench user keeps {i} plants on the balcony."
            question = f"How many plants, note {i}?"
            took: dict[str, float] = {}
            t0 = time.perf_counter()
            async with (
                streamable_http_client(f"{base}/mcp?user_id=bench", http_client=http) as (read, write),
                ClientSession(read, write) as s,
            ):
                await s.initialize()
                took["mcp_session"] = time.perf_counter() - t0
                calls = {
                    "mcp_list_tools": ("list_tools", ()),
                    "mcp_add": ("call_tool", ("add_memories", {"text": text})),
                    "mcp_search": ("call_tool", ("search_memory", {"query": question})),
                }
                for op, (method, args) in calls.items():
                    t0 = time.perf_counter()
                    res = await getattr(s, method)(*args)
                    took[op] = time.perf_counter() - t0
                    if getattr(res, "is_error", False):
                        raise RuntimeError(f"{op}: {res.content[0].text}")
            for op, path, body in (
                ("rest_add", "/v1/memories", {"messages": text, "user_id": "rest", "infer": False}),
                ("rest_search", "/v1/memories/search", {"query": question, "user_id": "rest"}),
            ):
                t0 = time.perf_counter()
                r = await http.post(f"{base}{path}", json=body)
                took[op] = time.perf_counter() - t0
                r.raise_for_status()
            if i:  # round 0 warms up
                records += [{"round": i, "op": op, "ms": round(s * 1e3, 3)} for op, s in took.items()]
    return records


def run(out: Path, model: str, rounds: int = 30, dtype: str | None = None, echo=print) -> dict:
    import anyio

    from ..server import KvmemServer, Limits

    env = machine()
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-mcp-") as tmp:
        srv = KvmemServer.start(Path(tmp) / "s", model=model, engine="hf", dtype=dtype, window=1,
                                limits=Limits(mcp_infer=False))  # fmt: skip
        try:
            with serve_in_thread(srv) as base:
                records = anyio.run(_rounds, base, rounds)
        finally:
            srv.close()
    ms = {op: [r["ms"] for r in records if r["op"] == op] for op in OPS}
    summary = {
        "machine": env,
        "model": model,
        "engine": "hf",
        "rounds": rounds,
        **{f"{op}_ms": {"p50": round(median(v), 2), "p95": round(p95(v), 2)} for op, v in ms.items()},
        "mcp_over_rest_p50": {
            "add": ratio(median(ms["mcp_add"]), median(ms["rest_add"])),
            "search": ratio(median(ms["mcp_search"]), median(ms["rest_search"])),
        },
    }
    write_summary_and_records(out, summary, records)
    echo(table([[op, median(v), p95(v)] for op, v in ms.items()], ["operation", "p50 ms", "p95 ms"]))
    echo(f"{env['cpu']} ({env['cores']} cores), {model}, {rounds} rounds; {out / 'summary.json'}")
    return summary
