"""Benchmarks and the LoCoMo evaluation: one module per command (``kvmem bench ...``, ``kvmem eval locomo``)."""
