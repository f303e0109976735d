#!/usr/bin/env bash
# Set up (venv, packages, the two test models) and run the test suite. This is README command (2); .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvmem models install smollm2-135m-instruct
.venv/bin/kvmem models install qwen2.5-coder-0.5b-instruct
.venv/bin/kvmem models install gemma3-270m
# Habits first (seconds): lint, format and the import structure (layers, no cycles; pyproject.toml).
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
