#!/usr/bin/env bash
# A throwaway PostgreSQL cluster (Debian's postgresql package) for tests and benchmarks, on a unix socket only.
#   scripts/postgres.sh start DIR    initdb (once) and start; prints the URL: postgresql://postgres@/postgres?host=DIR
#   PG_LISTEN=ADDR PG_PASSWORD=PW scripts/postgres.sh start DIR
#                                    also listen on ADDR:5432 with password auth (scram-sha-256) for TCP clients
#                                    (tests/cluster.py's db node); prints postgresql://postgres@ADDR:5432/postgres
#                                    (the password is not in the URL: clients take it from PGPASSWORD)
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
      if [ -n "${PG_LISTEN:-}" ]; then
        : "${PG_PASSWORD:?PG_LISTEN needs PG_PASSWORD: TCP clients authenticate}"
        umask 077
        printf '%s\n' "$PG_PASSWORD" >"$dir/pwfile"
        if [ "$(id -u)" = 0 ]; then chown postgres "$dir/pwfile"; fi
        as_pg "$bin/initdb" -D "$dir/data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
          --pwfile="$dir/pwfile" -E UTF8 --no-locale >"$dir/initdb.log"
        rm -f "$dir/pwfile"
        echo "host all all 0.0.0.0/0 scram-sha-256" >>"$dir/data/pg_hba.conf"
      else
        as_pg "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log"
      fi
    fi
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start \
      -o "-k $dir -c listen_addresses='${PG_LISTEN:-}' -c fsync=${PG_FSYNC:-on} -c max_connections=200" >/dev/null
    if [ -n "${PG_LISTEN:-}" ]; then
      echo "postgresql://postgres@$PG_LISTEN:5432/postgres"
    else
      echo "postgresql://postgres@/postgres?host=$dir"
    fi
    ;;
  stop)
    as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null
    ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
