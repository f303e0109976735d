"""What every command group shares: the error wrapper, JSON output, the bench loader, and the options spelled once.

Options used by more than one command are defined here, once, as typer ``Option`` objects (a default is spelled
with its option); a command takes one as its parameter's default, e.g. ``engine: str = ENGINE``. Importing this
module loads no torch, transformers or vLLM."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import typer

from ..policy import DEFAULT_NEIGHBOURS, DEFAULT_WINDOW, MAX_NEIGHBOURS


def _user_errors() -> tuple[type[BaseException], ...]:
    from ..compose import ContextOverflow
    from ..extras import MissingExtra
    from ..locomo import LocomoError
    from ..models import ModelError
    from ..retrieve import RetrievalError
    from ..store import StoreError

    # OSError: a directory or unreadable path given where a file was expected (and the reverse).
    return (ContextOverflow, LocomoError, MissingExtra, ModelError, RetrievalError, StoreError, ValueError, OSError)


LOCOMO_ENV = "KVMEM_LOCOMO"  # names the LoCoMo file of ``kvmem demo`` and of every bench and eval ``--data``


def _locomo_source(exc: BaseException) -> str:
    """For an error reading the LoCoMo file (``locomo.LocomoError.path``), where its path came from when the
    command line did not give it: ``$KVMEM_LOCOMO`` or the default."""
    path = getattr(exc, "path", None)
    if path is None:
        return ""
    if os.environ.get(LOCOMO_ENV) and Path(os.environ[LOCOMO_ENV]) == path:
        return f" (the path is ${LOCOMO_ENV}'s)"
    if path == LOCOMO_DATA:
        return f" (the default path: give another, or set {LOCOMO_ENV})"
    return ""


def friendly(fn):
    """Turn known errors into ``error: <message>`` on stderr and exit code 2 (no traceback); an error about the
    LoCoMo file says where its path came from (``_locomo_source``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_errors() as exc:
            typer.echo(f"error: {exc}{_locomo_source(exc)}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def emit(obj, as_json: bool) -> None:
    """Print ``obj``: as one line of JSON (non-ASCII kept), or as it is."""
    typer.echo(json.dumps(obj, ensure_ascii=False) if as_json else obj)


def check_kv_format_name(kv_format: str | None) -> None:
    """A --kv-format that names no format is one line before any model loads (``kvformat.check_format``); whether it
    matches an existing store is ``store.check_kv_format``."""
    if kv_format is not None:
        from ..kvformat import check_format

        check_format(kv_format)


def bench_module(name: str) -> ModuleType:
    """``kvmem.bench.<name>``, imported when a bench or eval command runs, never at ``kvmem --help``.

    Without the ``bench`` extra: one ``error:`` line naming ``pip install 'kvmem[bench]'``, exit code 2, before
    any model loads (matplotlib is imported only when the plot is drawn, after the run)."""
    from ..extras import BENCH_FEATURE, MissingExtra, require

    try:
        require("bench", BENCH_FEATURE)  # each run: kvmem.bench checks only on import
        return importlib.import_module(f"kvmem.bench.{name}")
    except MissingExtra as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


# --- options used by more than one command --------------------------------------------------------------------

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"  # models.DEFAULT_MODEL (a test checks); kvmem.models imports torch

ENGINE_HELP = (
    "auto (vLLM where it runs here, else transformers), vllm (stock vLLM + kvmem connector) or hf (transformers, "
    "the reference engine)."
)


def engine_option(default: str = "auto", why: str = ""):
    """The one ``--engine`` option; every command defaults to ``auto``. A command that defaults otherwise gives
    ``why`` (shown in its help)."""
    return typer.Option(default, "--engine", help=f"{ENGINE_HELP} {why}".strip())


ENGINE = engine_option()
DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="Compute dtype: auto (bf16 on a GPU or a native-bf16 CPU, fp32 "
    "elsewhere; see `kvmem doctor`), bfloat16 or float32.",
)
JSON = typer.Option(False, "--json")
MODEL = typer.Option(DEFAULT_MODEL, "--model", help="Answer model (registry name).")
NEW_STORE_MODEL = typer.Option(None, "--model", help="Answer model for a new store (default: the default model).")

STORE_HELP = (
    "The store: a directory, or a shared store's PostgreSQL URL (postgresql://user@host:5432/db; the password "
    "from PGPASSWORD or ~/.pgpass)."
)


def store_option(note: str = ""):
    """The required ``--store`` option; ``note`` says what this command does with a missing store."""
    return typer.Option(..., "--store", help=f"{STORE_HELP} {note}".strip())


SEGMENTS = typer.Option(
    None,
    "--segments",
    help="For a new store: keep its KV segments in this object store (file:///mnt/shared/kv, s3://bucket/prefix, "
    "gs://...; credentials from the environment) instead of the store's own directory. Required with a "
    "postgresql:// --store.",
)
KV_FORMAT = typer.Option(
    None,
    "--kv-format",
    help="For a new store: how its KV segments hold keys and values. native (the model dtype, lossless; the "
    "default), int8 (about half of bf16's bytes; keys scaled per channel, values per token) or fp8 (e4m3). An "
    "existing store keeps the format it was created with.",
)
EXTRACTOR_URL = typer.Option(
    None, "--extractor-url", help="OpenAI-compatible base URL for fact extraction (default: the answer model)."
)
EXTRACTOR_MODEL = typer.Option(None, "--extractor-model", help="The model name to ask at --extractor-url.")


def extractor(url: str | None, model: str | None) -> dict | None:
    """--extractor-url / --extractor-model as ``Memory``'s and the server's ``extractor`` argument."""
    return {"base_url": url, "model": model or "default"} if url else None


def open_memory(
    store: str,
    model: str | None = None,
    window: int | None = None,
    dtype: str = "auto",
    extractor_url: str | None = None,
    extractor_model: str | None = None,
    create: bool = False,
    neighbours: int | None = None,
    history: bool | None = None,
    segments: str | None = None,
    kv_format: str | None = None,
):
    """``Memory`` over ``store`` with the CLI's options (``create``: a write may create the store; reads never
    do: "no kvmem store at ...")."""
    from ..memory import Memory
    from ..store import Store

    if not create:
        Store.open(store).close()
    return Memory(
        store,
        model=model,
        window=window,
        dtype=dtype,
        extractor=extractor(extractor_url, extractor_model),
        neighbours=neighbours,
        history=history,
        segments_url=segments,
        kv_format=kv_format,
    )


# How a LoCoMo conversation's stores are encoded (ingest-locomo, eval locomo): policy.Encoding's defaults.
WINDOW_HELP = (
    f"Conversation turns before each fact's source turn encoded with it (default {DEFAULT_WINDOW}, or 0 "
    "with --history)."
)
LOCOMO_NEIGHBOURS = typer.Option(
    None,
    "--neighbours",
    min=0,
    max=MAX_NEIGHBOURS,
    help="Neighbour-aware encoding: each "
    f"fact also behind its m most similar other facts (default {DEFAULT_NEIGHBOURS}, or 0 with "
    "--history; 0 = off; no serving cost).",
)
LOCOMO_HISTORY = typer.Option(
    False,
    "--history/--no-history",
    help="History encoding: each fact also behind every fact "
    "of the conversation before it (1 encoded token per fact token at --window 0, its default; "
    "no serving cost).",
)
# How writes encode new memories (serve, memory add); unset: each user's recorded encoding (Memory keeps it per user).
USER_WINDOW = typer.Option(
    None,
    "--window",
    help="Conversation turns encoded before each new memory (default: the "
    "user's recorded window, else 5, or 0 with --history).",
)
USER_NEIGHBOURS = typer.Option(
    None,
    "--neighbours",
    min=0,
    max=MAX_NEIGHBOURS,
    help="Also encode each new memory "
    "behind its m most similar memories of the user (default: the user's recorded m, else 4, "
    "or 0 with --history; 0 = off).",
)
USER_HISTORY = typer.Option(
    None,
    "--history/--no-history",
    help="History encoding: each new memory behind every "
    "memory of the user written before it (default: as the user's memories were encoded so far, "
    "else off).",
)
LOCOMO_DATA = Path("../shared/data/locomo/locomo7.json")  # the default LoCoMo file (demo, bench, eval; LOCOMO_ENV)
