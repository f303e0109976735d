#!/usr/bin/env bash
# The device checks for a lent GPU, in one run of under 10 minutes (the device tool: `run` this script):
#   1. tests/test_staging.py on CUDA (the copy stream, its staging buffers and per-layer events);
#   2. scripts/gpu_staging.py: staged against whole-copy injection at k = 5, 20, 50, the 1.5B's shapes, bf16.
# Needs only the device image's own python3, torch and transformers. The vLLM connector tests need a CUDA vLLM
# wheel, which is larger than what travels to the device (64 MiB), so they do not run there.
set -euo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -o addopts="" tests/test_staging.py 2>&1 \
  | tee "$OUT/staging_tests.log"
timeout 300 python3 scripts/gpu_staging.py --out "$OUT/gpu_staging.json" 2>&1 | tee "$OUT/gpu_staging.log"
