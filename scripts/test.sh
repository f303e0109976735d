#!/usr/bin/env bash
# Set up (venv, packages, the test models) and run the test suite. This is README command (2); .ci/run runs it.
#   bash scripts/test.sh            everything (vLLM, Ray, PostgreSQL, all three models)
#   bash scripts/test.sh --fast     the fast tier: no vLLM, no Ray, no PostgreSQL, no browser, nothing slow, the
#                                   smallest model
#   bash scripts/test.sh --cluster  the fault run on the namespace cluster alone (root; about 3 minutes; the full
#                                   suite runs it too)
# Other arguments pass through to pytest (e.g. -x, -k name, tests/test_store.py).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
cluster=0
args=()
for a in "$@"; do
  if [ "$a" = --fast ]; then fast=1; elif [ "$a" = --cluster ]; then cluster=1; else args+=("$a"); fi
done
bash scripts/setup.sh
models=(smollm2-135m-instruct)
[ $fast = 1 ] || models+=(qwen2.5-coder-0.5b-instruct gemma3-270m)
.venv/bin/kvmem models install "${models[@]}"
# Habits first (seconds): lint, format and the import structure (layers, no cycles; pyproject.toml).
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/lint-imports
pytest=(.venv/bin/python -m pytest -q)
if [ $fast = 1 ]; then
  # markers: pyproject.toml and tests/conftest.py
  exec "${pytest[@]}" -m "not vllm and not ray and not postgres and not slow and not browser" ${args[@]+"${args[@]}"}
fi
if [ $cluster = 1 ]; then
  exec "${pytest[@]}" -m cluster ${args[@]+"${args[@]}"}
fi
exec "${pytest[@]}" ${args[@]+"${args[@]}"}
