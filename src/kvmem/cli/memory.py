"""``kvmem memory ...``: the online memory (Mem0-shaped) from the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ..policy import Encoding
from .common import (
    DTYPE,
    EXTRACTOR_MODEL,
    EXTRACTOR_URL,
    JSON,
    KV_FORMAT,
    NEW_STORE_MODEL,
    SEGMENTS,
    USER_HISTORY,
    USER_NEIGHBOURS,
    USER_WINDOW,
    check_kv_format_name,
    emit,
    friendly,
    open_memory,
    store_option,
)

memory_app = typer.Typer(
    no_args_is_help=True,
    help="Online memory (Mem0-shaped): add, search, list, get, update, delete, delete-all, history, compact.",
)


_STORE = store_option("Created on the first add.")
_USER = typer.Option(None, "--user", help="User id (Mem0's user_id).")
_AGENT = typer.Option(None, "--agent", help="Agent id (Mem0's agent_id): with or instead of --user.")
_RUN = typer.Option(None, "--run", help="Run id (Mem0's run_id): with or instead of --user.")


def _message(out: dict, as_json: bool) -> None:
    """A Mem0-style ``{"message": ...}`` reply: the JSON, or its message (and what an erasure covered)."""
    if as_json:
        typer.echo(json.dumps(out))
        return
    e = out.get("erasure")
    more = ""
    if e:
        later = f", {e['deferred']} deferred" if e["deferred"] else ""
        more = (
            f" (erased {e['erased']} memories and {e['turns']} turns; re-encoded {e['reencoded']} memories computed "
            f"behind them{later})"
        )
    typer.echo(out["message"] + more)


def _print_memories(items: list[dict], as_json: bool) -> None:
    if as_json:
        emit({"results": items}, True)
        return
    for m in items:
        score = f"{m['score']:.3f}  " if "score" in m else ""
        typer.echo(f"{score}{m['id']}  {m['memory']}")


def read_messages(file: Path | None, message: str | None) -> str | list:
    """``memory add``'s input: ``message`` as text; else ``file`` (``-`` or None: standard input) as a JSON list of
    ``{role, content}``, or as plain text (stripped) when it is not JSON. Raises ValueError: both given, a
    directory, no such file, or nothing but whitespace."""
    if message is not None and file is not None:
        raise ValueError("give a file or --message, not both")
    if message is not None:
        text = message
    elif file is None or str(file) == "-":
        text = sys.stdin.read()
    elif file.is_dir():
        raise ValueError(f"{str(file)!r} is a directory, not a file of messages")
    elif not file.exists():
        raise ValueError(
            f"no file {str(file)!r}; to remember text itself, use --message/-m TEXT (or pipe it on standard input)"
        )
    else:
        text = file.read_text()  # any readable file: also /dev/stdin or a <(process substitution)
    if not text.strip():
        raise ValueError("no messages given (a file, --message, or standard input)")
    if message is None:  # a file or stdin: a JSON list of {role, content}, else plain text; -m is always text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text.strip()


@memory_app.command("add")
@friendly
def memory_add(
    file: Path | None = typer.Argument(
        None,
        help="A file of messages: a JSON list of {role, content}, or plain text; '-' or nothing reads standard input.",
    ),
    message: str | None = typer.Option(None, "--message", "-m", help="The message text itself, instead of a file."),
    store: str = _STORE,
    user: str | None = _USER,
    agent: str | None = _AGENT,
    run: str | None = _RUN,
    infer: bool = typer.Option(
        True,
        "--infer/--no-infer",
        help="Extract facts with the model (Mem0's two steps), or store each message verbatim.",
    ),
    window: int | None = USER_WINDOW,
    neighbours: int | None = USER_NEIGHBOURS,
    history: bool | None = USER_HISTORY,
    model: str | None = NEW_STORE_MODEL,
    extractor_url: str | None = EXTRACTOR_URL,
    extractor_model: str | None = EXTRACTOR_MODEL,
    dtype: str = DTYPE,
    segments: str | None = SEGMENTS,
    kv_format: str | None = KV_FORMAT,
    as_json: bool = JSON,
):
    """Remember messages for a user: facts are extracted (or taken verbatim), encoded and committed."""
    if window is not None or neighbours is not None or history is not None:
        Encoding.of(window, neighbours, history)
    messages = read_messages(file, message)
    from ..memory import check_messages
    from ..scopes import Scope

    check_messages(messages)  # bad input fails before a model loads or a store is created
    Scope.of(user, agent, run)
    check_kv_format_name(kv_format)
    mem = open_memory(
        store,
        model,
        window,
        dtype,
        extractor_url,
        extractor_model,
        create=True,
        neighbours=neighbours,
        history=history,
        segments=segments,
        kv_format=kv_format,
    )
    out = mem.add(messages, user, agent_id=agent, run_id=run, infer=infer)
    if as_json:
        emit(out, True)
    else:
        for r in out["results"]:
            typer.echo(f"{r['event']:6s} {r['id']}  {r['memory']}")


@memory_app.command("import")
@friendly
def memory_import(
    file: Path = typer.Argument(..., help="Mem0's export: the JSON get_all returns ({'results': [...]} or a list)."),
    store: str = _STORE,
    model: str | None = NEW_STORE_MODEL,
    dtype: str = DTYPE,
    segments: str | None = SEGMENTS,
    kv_format: str | None = KV_FORMAT,
    as_json: bool = JSON,
):
    """Move memories in from Mem0: written verbatim with their ids, scopes, metadata and times, then encoded.
    At most 10,000 records per file, committed 32 at a time; running an import again skips what it wrote."""
    if not file.is_file():
        raise ValueError(f"no file {str(file)!r}")
    try:
        export = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not JSON ({exc})") from None
    check_kv_format_name(kv_format)
    from ..memory.importer import check_size

    check_size(export)  # too many records: one error line before any store is made or model loaded
    mem = open_memory(store, model, None, dtype, None, None, create=True, segments=segments, kv_format=kv_format)
    out = mem.import_memories(export)
    if as_json:
        emit(out, True)
    else:
        for scope, n in out["scopes"].items():
            typer.echo(f"{n:6d}  {scope}")
        typer.echo(f"{out['count']:6d}  memories imported")
        if out["existing"]:
            typer.echo(f"{out['existing']:6d}  already imported (skipped)")


@memory_app.command("search")
@friendly
def memory_search(
    query: str,
    store: str = _STORE,
    user: str | None = _USER,
    agent: str | None = _AGENT,
    run: str | None = _RUN,
    limit: int = typer.Option(10, help="Results at most (Mem0's top_k)."),
    threshold: float = typer.Option(0.1, help="Lowest cosine score returned."),
    filters: str | None = typer.Option(None, help='Mem0 filters as JSON, e.g. \'{"category": {"in": ["work"]}}\'.'),
    as_json: bool = JSON,
):
    """The memories most similar to QUERY, best first, among those the scope and filters select."""
    found = open_memory(store).search(
        query, user, agent_id=agent, run_id=run, top_k=limit, threshold=threshold, filters=_filters(filters)
    )
    _print_memories(found["results"], as_json)


@memory_app.command("list")
@friendly
def memory_list(
    store: str = _STORE,
    user: str | None = _USER,
    agent: str | None = _AGENT,
    run: str | None = _RUN,
    limit: int = typer.Option(100),
    filters: str | None = typer.Option(None, help="Mem0 filters as JSON."),
    as_json: bool = JSON,
):
    """The live memories the scope and filters select, oldest first."""
    found = open_memory(store).get_all(user, agent_id=agent, run_id=run, top_k=limit, filters=_filters(filters))
    _print_memories(found["results"], as_json)


def _filters(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--filters is not JSON ({exc})") from None


@memory_app.command("get")
@friendly
def memory_get(memory_id: str, store: str = _STORE, as_json: bool = JSON):
    """One memory by id."""
    m = open_memory(store).get(memory_id)
    if m is None:
        raise ValueError(f"memory {memory_id!r} not found")
    if as_json:
        emit(m, True)
    else:
        _print_memories([m], False)


@memory_app.command("update")
@friendly
def memory_update(memory_id: str, text: str, store: str = _STORE, as_json: bool = JSON):
    """Replace a memory's text (re-encoded; the id stays)."""
    _message(open_memory(store).update(memory_id, text), as_json)


@memory_app.command("delete")
@friendly
def memory_delete(memory_id: str, store: str = _STORE, as_json: bool = JSON):
    """Delete one memory (it is never retrieved or injected again)."""
    _message(open_memory(store).delete(memory_id), as_json)


@memory_app.command("delete-all")
@friendly
def memory_delete_all(
    store: str = _STORE,
    user: str | None = _USER,
    agent: str | None = _AGENT,
    run: str | None = _RUN,
    as_json: bool = JSON,
):
    """Delete every memory whose scope has all the given ids (a user's: with its agents' and runs' too)."""
    _message(open_memory(store).delete_all(user, agent, run), as_json)


@memory_app.command("history")
@friendly
def memory_history(memory_id: str, store: str = _STORE, as_json: bool = JSON):
    """Every event of a memory: ADD, UPDATE (old and new text), DELETE, with times."""
    events = open_memory(store).history(memory_id)
    if as_json:
        emit(events, True)
        return
    for e in events:
        typer.echo(f"{e['created_at']}  {e['event']:6s} {e['old_memory'] or ''!s:30.30s} -> {e['new_memory'] or ''}")


@memory_app.command("compact")
@friendly
def memory_compact(
    store: str = _STORE,
    user: str | None = _USER,
    agent: str | None = _AGENT,
    run: str | None = _RUN,
    as_json: bool = JSON,
):
    """Rewrite one scope's KV segments without deleted rows."""
    _message(open_memory(store).compact(user, agent, run), as_json)
