#!/usr/bin/env bash
# A throwaway PostgreSQL cluster (Debian's postgresql package) for tests and benchmarks, on a unix socket only.
#   scripts/postgres.sh start DIR    initdb (once) and start; prints the URL: postgresql://postgres@/postgres?host=DIR
#   scripts/postgres.sh stop DIR     stop it (fast: no checkpoint is needed for a throwaway cluster)
# PostgreSQL refuses to run as root: as root the server runs as the package's `postgres` OS user.
# PG_FSYNC=off (tests) skips fsync; benchmarks keep the default (on), like the local store, which fsyncs.
set -euo pipefail
cmd=${1:?start|stop}
dir=$(realpath -m "${2:?cluster directory}")
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$bin/initdb" ] || { echo "PostgreSQL is not installed: run scripts/setup.sh (it installs Debian's postgresql)" >&2; exit 2; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case $cmd in
  start)
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log"
    fi
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start \
      -o "-k $dir -c listen_addresses='' -c fsync=${PG_FSYNC:-on} -c max_connections=200" >/dev/null
    echo "postgresql://postgres@/postgres?host=$dir"
    ;;
  stop)
    as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null
    ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
