"""Command line: thin wrappers that parse, call and print. Known errors become one line and exit code 2.

One module per command group: ``serve``, ``mcp``, ``ask``, ``memory``, ``store`` (with ``ingest-locomo``),
``models`` (with ``doctor`` and ``check-exactness``), ``bench`` (with ``eval``) and ``demo``; the options they
share are spelled once in ``common``. Each command imports what it runs inside its own body, so ``kvmem --help``
and argument errors answer without loading torch, transformers or vLLM."""

from __future__ import annotations

import os
import sys

import typer

# Before any command imports transformers or huggingface_hub: models come from the local cache only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from . import ask, bench, demo, evals, mcp, memory, models, serve, store
from .common import friendly

__all__ = ["app", "friendly", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvmem: LLM memory by KV injection.")


@app.callback()
def exit_on_signals() -> None:
    """Every command: SIGTERM and SIGHUP exit through SystemExit (status 128 + signal), so atexit handlers run;
    vLLM's among them stops its engine-core processes, which a bare SIGTERM leaves running, holding their memory.
    Later signals are ignored, so they cannot interrupt that shutdown. (``serve`` installs its own.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return

    def _exit(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


# In the order `kvmem --help` lists them.
app.command("doctor")(models.doctor)
app.command("ingest-locomo")(store.ingest_locomo)
app.command("serve")(serve.serve_cmd)
app.command("mcp")(mcp.mcp_cmd)
app.command("ask")(ask.ask)
app.command("check-exactness")(models.check_exactness)
app.command("demo")(demo.demo)
app.add_typer(models.models_app, name="models")
app.add_typer(bench.bench_app, name="bench")
app.add_typer(evals.eval_app, name="eval")
app.add_typer(store.store_app, name="store")
app.add_typer(memory.memory_app, name="memory")


def main():  # pragma: no cover
    app()
