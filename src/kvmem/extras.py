"""Optional dependencies (pip extras): check that an extra is installed before a feature that needs it runs.

A bare ``pip install kvmem`` serves one machine with the local store. These features need an extra:

==============  ==========================  =====================================================================
extra           modules                     what needs it
==============  ==========================  =====================================================================
``bench``       matplotlib, psutil          ``kvmem bench ...`` and ``kvmem eval ...``: plots, peak RSS
``replicas``    ray (Ray Serve)             ``kvmem serve --replicas N`` / ``--ray`` / ``--ray-address``
``postgres``    psycopg                     a ``postgresql://`` store (its rows in PostgreSQL)
``s3``          obstore, diskcache          KV segments by URL (``--segments s3://``, ``file://``, ...), ``--cache-dir``
``mcp``         mcp (the official SDK)      ``/mcp`` in ``kvmem serve``, ``kvmem mcp`` (MCP tools over stdio)
==============  ==========================  =====================================================================

The check looks the modules up without importing them (``importlib.util.find_spec``), so it costs nothing on a
path that does not need them.
"""

from __future__ import annotations

from importlib.util import find_spec

# extra -> the top-level modules it installs (pyproject.toml's [project.optional-dependencies]; a test checks both
# agree)
EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("matplotlib", "psutil"),
    "replicas": ("ray",),
    "postgres": ("psycopg",),
    "s3": ("obstore", "diskcache"),
    "mcp": ("mcp",),
}

BENCH_FEATURE = "benchmarking (kvmem bench, kvmem eval)"  # what needs the bench extra, as its error names it


class MissingExtra(ImportError):
    """A feature needs an optional dependency that is not installed. The message is one line that names the
    feature, the missing module and the ``pip install 'kvmem[<extra>]'`` that brings it."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` (a key of ``EXTRAS``) that are not installed, in ``EXTRAS`` order."""
    return [m for m in EXTRAS[extra] if find_spec(m) is None]


def require(extra: str, feature: str) -> None:
    """Raise ``MissingExtra`` if any module of ``extra`` (a key of ``EXTRAS``) is not installed; ``feature`` says
    what needed it (e.g. ``"a postgresql:// store"``)."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{feature} needs {' and '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not installed: "
            f"pip install 'kvmem[{extra}]'",
            name=absent[0],
        )
