"""The memory tools over the Model Context Protocol, through the official ``mcp`` SDK's own client: streamable HTTP
against ``kvmem serve``'s app on a loopback port (``/mcp``, two tenants), and stdio against ``kvmem mcp`` as a
subprocess. Tool names and arguments are Mem0 OpenMemory's; results are JSON text; the user comes from the URL
and the tenant from the key, never from a tool argument."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from conftest import http_server
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-acme-0123456789abcdef", "key-globex-0123456789abcdef"
TOOLS = {
    "add_memories",
    "search_memory",
    "list_memories",
    "delete_memories",
    "delete_all_memories",
    "get_memory",
    "update_memory",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    srv = KvmemServer.start(
        tmp_path_factory.mktemp("mcp") / "store",
        model=FAST,
        engine="hf",
        dtype="float32",
        window=1,
        api_keys={KEY_A: "acme", KEY_B: "globex"},
        limits=Limits(max_body_bytes=64 << 10, mcp_infer=False),  # verbatim adds: no extraction on a 135M model
    )
    try:
        with http_server(srv) as url:
            yield url
    finally:
        srv.close()


def _session(url: str, key: str | None, fn):
    """``fn(session)`` in one MCP session over streamable HTTP at ``url`` (the SDK's client), its result."""

    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with (
            httpx2.AsyncClient(headers=headers, timeout=120) as http,
            streamable_http_client(url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            return await fn(session)

    return anyio.run(main)


async def _call(session, name: str, **args):
    """A tool's JSON result; AssertionError for a tool error."""
    res = await session.call_tool(name, args)
    assert not res.is_error, res.content
    [content] = res.content
    return json.loads(content.text)


async def _error(session, name: str, **args) -> str:
    """A tool error's text; AssertionError for a result."""
    res = await session.call_tool(name, args)
    assert res.is_error, res.content
    return res.content[0].text


def test_tools_add_search_list_update_delete(base):
    async def run(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert set(tools) == TOOLS
        assert set(tools["delete_memories"].input_schema["properties"]) == {"memory_ids"}  # no user argument
        assert tools["search_memory"].annotations.read_only_hint is True
        facts = ["Alice adopted a grey cat named Pixel.", "Alice works as a nurse at the city hospital."]
        ids = []
        for f in facts:
            [ev] = (await _call(s, "add_memories", text=f))["results"]
            assert ev["event"] == "ADD" and ev["memory"] == f
            ids.append(ev["id"])
        found = (await _call(s, "search_memory", query="What is the name of Alice's cat?"))["results"]
        assert found[0]["id"] == ids[0] and found[0]["memory"] == facts[0] and 0 < found[0]["score"] <= 1
        assert found[0]["user_id"] == "alice"  # the caller's id, never the store's tenant-qualified key
        listed = (await _call(s, "list_memories"))["results"]
        assert [m["id"] for m in listed] == ids and [m["memory"] for m in listed] == facts
        assert (await _call(s, "get_memory", memory_id=ids[1]))["memory"] == facts[1]
        await _call(s, "update_memory", memory_id=ids[1], text="Alice works as a surgeon.")
        assert (await _call(s, "get_memory", memory_id=ids[1]))["memory"] == "Alice works as a surgeon."
        out = await _call(s, "delete_memories", memory_ids=[ids[0]])
        assert out["message"] == "Successfully deleted 1 memories" and out["deleted"] == [ids[0]]
        assert out["erasure"]["erased"] == 1 and {"turns", "reencoded", "deferred"} <= set(out["erasure"])
        assert [m["id"] for m in (await _call(s, "list_memories"))["results"]] == [ids[1]]
        assert "not found" in await _error(s, "get_memory", memory_id=ids[0])
        out = await _call(s, "delete_all_memories")
        assert out["message"] == "Successfully deleted all memories" and out["erasure"]["erased"] == 1
        assert (await _call(s, "list_memories"))["results"] == []

    _session(f"{base}/mcp?user_id=alice", KEY_A, run)


def test_users_and_tenants_see_nothing_of_each_other(base):
    async def add_carol(s):
        return (await _call(s, "add_memories", text="Carol's locker code is 7312."))["results"][0]["id"]

    carol = _session(f"{base}/mcp/u/carol", KEY_A, add_carol)

    async def other(s):  # another user of the same tenant: nothing of carol's is reachable
        assert (await _call(s, "list_memories"))["results"] == []
        assert (await _call(s, "search_memory", query="locker code"))["results"] == []
        assert "not found" in await _error(s, "get_memory", memory_id=carol)
        assert "not found" in await _error(s, "delete_memories", memory_ids=[carol])
        assert "not found" in await _error(s, "update_memory", memory_id=carol, text="x")
        assert (await _call(s, "delete_all_memories"))["erasure"]["erased"] == 0

    _session(f"{base}/mcp?user_id=dave", KEY_A, other)
    _session(f"{base}/mcp/cursor/http/carol", KEY_B, other)  # carol of another tenant, OpenMemory's path form

    async def still(s):
        return [m["id"] for m in (await _call(s, "list_memories"))["results"]]

    assert _session(f"{base}/mcp?user_id=carol", KEY_A, still) == [carol]


def test_bad_arguments_are_tool_errors_and_the_session_goes_on(base):
    async def run(s):
        assert "memory_ids" in await _error(s, "delete_memories", memory_ids="not-a-list")
        assert "text" in await _error(s, "add_memories")
        assert "not found" in await _error(s, "delete_memories", memory_ids=["no-such-id"])
        assert "at least one" in await _error(s, "delete_memories", memory_ids=[])
        assert await _error(s, "add_memories", text="   ")  # Memory's own check of empty text
        assert await _error(s, "no_such_tool")
        assert (await _call(s, "add_memories", text="Erin likes tea."))["results"][0]["event"] == "ADD"
        return (await _call(s, "list_memories"))["results"]

    assert [m["memory"] for m in _session(f"{base}/mcp?user_id=erin", KEY_A, run)] == ["Erin likes tea."]


def test_the_caller_is_checked_before_the_session(base):
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
    }
    hdr = {"Accept": "application/json, text/event-stream"}

    def post(path, key=KEY_A):
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{base}{path}", json=init, headers={**hdr, **auth}, timeout=30)

    assert post("/mcp?user_id=alice", key=None).json()["error"]["code"] == "missing_api_key"
    assert post("/mcp?user_id=alice", key="wrong-key-0123456789").status_code == 401
    r = post("/mcp")
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_user"
    assert post("/mcp?user_id=a%2Fb").json()["error"]["code"] == "invalid_user"
    assert post("/mcp/u/alice?user_id=bob").status_code == 400
    ok = post("/mcp/u/alice")
    assert ok.status_code == 200 and ok.json()["result"]["serverInfo"]["name"] == "kvmem"
    counted = [
        ln for ln in httpx.get(f"{base}/metrics").text.splitlines() if ln.startswith('kvmem_requests_total{route="/mcp')
    ]
    assert any('route="/mcp/u/{user_id}",status="200"' in ln for ln in counted)  # by route template, not raw path
    assert counted and not any('status="500"' in ln for ln in counted)


def test_the_user_an_mcp_url_names():
    """What the ingress of ``--replicas`` routes MCP requests by (unchecked: the replica's gate checks)."""
    from kvmem.server.mcp import mcp_user

    assert mcp_user("/mcp", b"user_id=alice&x=1") == "alice"
    assert mcp_user("/mcp/", "user_id=al%20ice") == "al ice"
    assert mcp_user("/mcp/u/bob", b"") == mcp_user("/mcp/cursor/http/bob/", b"") == "bob"
    assert mcp_user("/mcp", b"") is None and mcp_user("/mcp/cursor/sse/bob", b"") is None
    assert mcp_user("/v1/memories", b"user_id=alice") is None


def test_stdio_kvmem_mcp(tmp_path):
    """``kvmem mcp`` as a desktop client starts it: list, add, search over stdio."""
    store = tmp_path / "store"
    src = str(Path(__file__).resolve().parents[1] / "src")
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "kvmem.cli",
            "mcp",
            "--store",
            str(store),
            "--user-id",
            "alice",
            "--model",
            FAST,
            "--dtype",
            "float32",
            "--window",
            "1",
            "--no-infer",
        ],  # fmt: skip
        env={**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"},
    )

    async def main():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            assert {t.name for t in (await s.list_tools()).tools} == TOOLS
            [ev] = (await _call(s, "add_memories", text="Alice's favourite colour is teal."))["results"]
            found = (await _call(s, "search_memory", query="favourite colour"))["results"]
            return ev, found

    ev, found = anyio.run(main)
    assert found[0]["id"] == ev["id"] and found[0]["memory"] == "Alice's favourite colour is teal."
