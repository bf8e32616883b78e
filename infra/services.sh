#!/usr/bin/env bash
# Makes sure the servers the tests (and a production-like local run) need are reachable on
# loopback: Redis on 6379, PostgreSQL on 5432 (database `test`, user `postgres`, trust auth) and an
# S3 endpoint (moto) on 9000. Starts what is absent, leaves what already runs alone, and says what
# it did. Safe to run any number of times.
#
# Usage: infra/services.sh        (then: source the variables it prints, or use infra/test.sh)
set -euo pipefail

REDIS_PORT=6379
PG_PORT=5432
S3_PORT=9000
STATE_DIR="${ECOSCAN_SERVICES_DIR:-${TMPDIR:-/tmp}/ecoscan-services}"
mkdir -p "$STATE_DIR"

say() { echo "services: $*"; }

# True when something accepts TCP connections on 127.0.0.1:$1.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Waits up to $2 seconds for port $1.
wait_port() {
    local port=$1 secs=$2 i
    for ((i = 0; i < secs * 10; i++)); do
        port_open "$port" && return 0
        sleep 0.1
    done
    return 1
}

apt_updated=0
apt_install() {
    if ! command -v apt-get >/dev/null; then
        say "cannot install $* (no apt-get); install it yourself" >&2
        exit 1
    fi
    if [ "$apt_updated" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        apt_updated=1
    fi
    say "installing $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- Redis ---------------------------------------------------------------------------------
if redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    say "redis already running on 127.0.0.1:$REDIS_PORT"
else
    command -v redis-server >/dev/null || apt_install redis-server
    # No persistence: the tests (and the crash tests) want a Redis that forgets on restart.
    redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
        --logfile "$STATE_DIR/redis.log" --dir "$STATE_DIR"
    wait_port "$REDIS_PORT" 10 || { say "redis did not start; see $STATE_DIR/redis.log" >&2; exit 1; }
    say "started redis on 127.0.0.1:$REDIS_PORT"
fi

# --- PostgreSQL ----------------------------------------------------------------------------
pg_ready() { pg_isready -q -h 127.0.0.1 -p "$PG_PORT" 2>/dev/null; }
if command -v pg_isready >/dev/null && pg_ready; then
    say "postgresql already running on 127.0.0.1:$PG_PORT"
else
    if ! command -v pg_ctlcluster >/dev/null || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
        apt_install postgresql
    fi
    version=$(ls /etc/postgresql | sort -V | tail -n1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 100); do pg_ready && break; sleep 0.1; done
    pg_ready || { say "postgresql $version did not start" >&2; exit 1; }
    say "started postgresql $version on 127.0.0.1:$PG_PORT"
fi
# The tests connect as postgres without a password to database `test`. Fresh clusters use peer
# auth on the socket and scram on TCP, so loopback TCP gets trust (loopback only).
psql_su() { if [ "$(id -un)" = postgres ]; then psql "$@"; else su postgres -s /bin/sh -c "psql $(printf '%q ' "$@")"; fi; }
if ! psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
    hba=$(psql_su -Atc 'show hba_file')
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    psql_su -Atc 'select pg_reload_conf()' >/dev/null
    say "allowed trust auth on loopback in $hba"
fi
if [ "$(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atc "select 1 from pg_database where datname = 'test'")" != 1 ]; then
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qc 'create database test'
    say "created database test"
fi

# --- S3 (moto) -----------------------------------------------------------------------------
s3_up() { curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/" 2>/dev/null || port_open "$S3_PORT"; }
if s3_up; then
    say "s3 endpoint already running on 127.0.0.1:$S3_PORT"
else
    if ! command -v moto_server >/dev/null; then
        say "installing moto[server] from PyPI"
        python3 -m pip install -q 'moto[server]'
        hash -r
    fi
    pidfile="$STATE_DIR/moto.pid"
    start_moto() {
        nohup moto_server -H 127.0.0.1 -p "$S3_PORT" >"$STATE_DIR/moto.log" 2>&1 &
        echo $! >"$pidfile"
    }
    # The moto an earlier run started, if its process still runs.
    ours() { [ -f "$pidfile" ] && ps -p "$(cat "$pidfile")" -o args= 2>/dev/null | grep -q moto; }
    if ours; then
        say "moto (pid $(cat "$pidfile")) is starting"
        # ...or stopping (someone killed it a moment ago): once it is gone without having
        # opened the port, start another.
        for ((i = 0; i < 600; i++)); do
            port_open "$S3_PORT" && break
            ours || { start_moto; break; }
            sleep 0.1
        done
    else
        start_moto
    fi
    wait_port "$S3_PORT" 60 || { say "moto did not start; see $STATE_DIR/moto.log" >&2; exit 1; }
    say "started moto (S3) on 127.0.0.1:$S3_PORT (pid $(cat "$pidfile"), log $STATE_DIR/moto.log)"
fi

cat <<VARS
services: ready. For tests and a production-like run:
  export TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT
  export TEST_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/test
  export TEST_S3_ENDPOINT=http://127.0.0.1:$S3_PORT
VARS
