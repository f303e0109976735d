"""``kvmem mcp``: one user's memory as MCP tools over stdio, for desktop clients (Claude Desktop, Cursor)."""

from __future__ import annotations

import contextlib
import sys

import typer

from ..policy import Encoding
from .common import (
    DTYPE,
    EXTRACTOR_MODEL,
    EXTRACTOR_URL,
    NEW_STORE_MODEL,
    USER_HISTORY,
    USER_NEIGHBOURS,
    USER_WINDOW,
    friendly,
    open_memory,
    store_option,
)


@friendly
def mcp_cmd(
    store: str = store_option("Created on the first add."),
    user_id: str = typer.Option(..., "--user-id", help="Whose memory the tools reach (Mem0's user_id)."),
    infer: bool = typer.Option(
        True,
        "--infer/--no-infer",
        help="add_memories extracts facts with the model (Mem0's default), or stores the text verbatim.",
    ),
    model: str | None = NEW_STORE_MODEL,
    dtype: str = DTYPE,
    window: int | None = USER_WINDOW,
    neighbours: int | None = USER_NEIGHBOURS,
    history: bool | None = USER_HISTORY,
    extractor_url: str | None = EXTRACTOR_URL,
    extractor_model: str | None = EXTRACTOR_MODEL,
):
    """Serve the memory tools of OpenMemory's MCP server (add_memories, search_memory, list_memories,
    delete_memories, delete_all_memories; get_memory, update_memory) over stdio for one user, until stdin
    closes. The model loads at the first write."""
    from ..extras import require
    from ..scopes import Scope

    require("mcp", "kvmem mcp")
    Scope.of(user_id=user_id)  # a bad id is one line before anything loads
    if window is not None or neighbours is not None or history is not None:
        Encoding.of(window, neighbours, history)
    from ..server.mcp import run_stdio

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol's: a new store loads its model here
        mem = open_memory(store, model, window, dtype, extractor_url, extractor_model, create=True,
                          neighbours=neighbours, history=history)  # fmt: skip
    run_stdio(mem, user_id, infer)
