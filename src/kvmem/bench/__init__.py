"""Benchmarks and the LoCoMo evaluation: one module per command (``kvmem bench ...``, ``kvmem eval locomo``).

They plot (matplotlib) and measure processes (psutil): the ``bench`` extra. Importing this package without it
raises ``extras.MissingExtra`` at once, before a run that would fail only at its plot."""

from ..extras import BENCH_FEATURE, require

require("bench", BENCH_FEATURE)
