#!/usr/bin/env bash
# Several machines on one machine (root: network namespaces), for the multi-node tests and the fault run:
#   scripts/cluster.sh up [--run-dir DIR] [--model M] [--no-serve]
#       namespaces head, w1, w2 on a bridge (10.77.0.0/24); db (PostgreSQL, password auth) at 10.77.1.2 and s3
#       (rclone serve s3) at 10.77.1.3 on a link of their own to each node; a Ray head + two workers; and
#       kvmem serve --replicas 2 --ray-address on them, one replica per worker. Prints the ingress URL.
#   scripts/cluster.sh down [--run-dir DIR]    end every process in the namespaces, delete them and the bridge
#   scripts/cluster.sh placement               each replica's node, from Ray's state API
# The run directory (default /tmp/kvmc) keeps the logs, secrets.env (mode 600) and keys.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" tests/cluster.py "$@"
