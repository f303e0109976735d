#!/usr/bin/env bash
# Set up and run the main job on real input. This is README command (1).
# Ingests LoCoMo conv-26 into a store (once), then answers its questions by KV injection and by prompt injection.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvmem models install qwen2.5-coder-0.5b-instruct
exec .venv/bin/kvmem demo "${KVMEM_LOCOMO:-../shared/data/locomo/locomo7.json}" "$@"
