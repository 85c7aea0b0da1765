#!/usr/bin/env bash
# Install (if needed) and start a local PostgreSQL server for mxdb's store tests.
#
# Runs as root on Debian (bookworm).  Idempotent: safe when PostgreSQL is already
# installed, already running, or already configured.  Listens on 127.0.0.1:5432 with
# trust authentication for local TCP (a throwaway CI server, never a production one).
# The last line of output is the URL to export:
#     export MXDB_TEST_PG_URL="$(ci/postgres.sh | tail -n1)"
set -euo pipefail

PORT="${PGPORT:-5432}"
URL="postgresql+psycopg://postgres@127.0.0.1:${PORT}/postgres"

log() { echo "postgres.sh: $*" >&2; }

if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    log "installing postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q postgresql >&2
fi

# The newest installed major version.
VERSION="$(ls /usr/lib/postgresql | sort -n | tail -n1)"
BIN="/usr/lib/postgresql/${VERSION}/bin"
log "using PostgreSQL ${VERSION}"

if command -v pg_ctlcluster >/dev/null 2>&1; then
    # Debian layout: a cluster "main" with its config in /etc/postgresql/<v>/main.
    if ! pg_lsclusters -h 2>/dev/null | awk '{print $1" "$2}' | grep -qx "${VERSION} main"; then
        log "creating cluster ${VERSION}/main"
        pg_createcluster "${VERSION}" main --port "${PORT}" >&2
    fi
    CONF_DIR="/etc/postgresql/${VERSION}/main"
    HBA="${CONF_DIR}/pg_hba.conf"
    # Trust local TCP connections (first matching line wins, so put ours on top).
    if ! grep -q '^# mxdb-ci trust' "${HBA}"; then
        log "enabling trust auth for 127.0.0.1 in ${HBA}"
        tmp="$(mktemp)"
        {
            echo '# mxdb-ci trust'
            echo 'host all all 127.0.0.1/32 trust'
            echo 'host all all ::1/128 trust'
            cat "${HBA}"
        } >"${tmp}"
        cat "${tmp}" >"${HBA}"
        rm -f "${tmp}"
    fi
    sed -i "s/^#\?port = .*/port = ${PORT}/" "${CONF_DIR}/postgresql.conf"
    sed -i "s/^#\?listen_addresses = .*/listen_addresses = '127.0.0.1'/" \
        "${CONF_DIR}/postgresql.conf"
    # Tests open one connection per process; leave headroom.
    sed -i "s/^#\?max_connections = .*/max_connections = 200/" "${CONF_DIR}/postgresql.conf"
    status="$(pg_lsclusters -h | awk -v v="${VERSION}" '$1==v && $2=="main" {print $4}')"
    if [ "${status}" = "online" ]; then
        log "reloading running cluster"
        pg_ctlcluster "${VERSION}" main reload >&2
    else
        log "starting cluster"
        pg_ctlcluster "${VERSION}" main start >&2
    fi
else
    # Plain layout (no postgresql-common): a data dir owned by postgres, run with pg_ctl.
    DATA="${PGDATA:-/var/lib/postgresql/data}"
    if [ ! -s "${DATA}/PG_VERSION" ]; then
        log "initdb ${DATA}"
        mkdir -p "${DATA}"
        chown postgres:postgres "${DATA}"
        su postgres -c "${BIN}/initdb -D '${DATA}' --auth-local=trust --auth-host=trust" >&2
    fi
    if ! su postgres -c "${BIN}/pg_ctl -D '${DATA}' status" >/dev/null 2>&1; then
        log "starting server"
        su postgres -c "${BIN}/pg_ctl -D '${DATA}' -l '${DATA}/server.log' -w \
            -o \"-p ${PORT} -c listen_addresses=127.0.0.1 -c max_connections=200\" start" >&2
    fi
fi

# Wait until it accepts TCP connections.
for _ in $(seq 1 60); do
    if "${BIN}/pg_isready" -h 127.0.0.1 -p "${PORT}" -q; then
        break
    fi
    sleep 0.5
done
if ! "${BIN}/pg_isready" -h 127.0.0.1 -p "${PORT}" -q; then
    log "server did not become ready on 127.0.0.1:${PORT}"
    exit 1
fi
# Trust auth must work over TCP without a password.
psql -h 127.0.0.1 -p "${PORT}" -U postgres -d postgres -Atc 'select 1' >/dev/null
log "ready; export MXDB_TEST_PG_URL=${URL}"
echo "${URL}"
