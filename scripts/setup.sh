#!/usr/bin/env bash
# Everything a fresh clone needs: system packages, the virtualenv, and (with --servers) the
# PostgreSQL and MariaDB servers running. Safe to run again: it only does what is missing.
#   scripts/setup.sh [--servers]
# Environment: PYTHON (python3), VENV (.venv), DJANGO (Django>=5.2,<6), EXTRAS (postgres,mysql:
# the package's extras), DEPENDENCY_GROUPS (test: pyproject.toml's development-only groups)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DJANGO=${DJANGO:-Django>=5.2,<6}
EXTRAS=${EXTRAS:-postgres,mysql}
# Not GROUPS: bash keeps that name for the user's group ids and ignores assignments to it.
DEPENDENCY_GROUPS=${DEPENDENCY_GROUPS:-test}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need_packages=()
command -v pkg-config >/dev/null || need_packages+=(pkg-config)
pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null \
  || need_packages+=(libmariadb-dev)
[ "${1:-}" != --servers ] || [ -x /usr/sbin/pgbouncer ] || need_packages+=(pgbouncer)
# The cluster check's test runs a one-node Galera cluster.
[ "${1:-}" != --servers ] || [ -e /usr/lib/galera/libgalera_smm.so ] || need_packages+=(galera-4)
if [ ${#need_packages[@]} -gt 0 ]; then
  echo "setup: installing ${need_packages[*]} (Debian packages)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

if [ "${1:-}" = --servers ]; then
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && [ -d /etc/postgresql ]; then
    echo "setup: starting PostgreSQL"
    as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  fi
  if ! mariadb-admin -uroot -h127.0.0.1 ping >/dev/null 2>&1 && [ -x /usr/sbin/mariadbd ]; then
    echo "setup: starting MariaDB"
    as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    for _ in $(seq 60); do mariadb-admin -uroot -h127.0.0.1 ping >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  for _ in $(seq 60); do pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && break; sleep 0.5; done
  # The replica tests (tests/replica.py) make a hot standby of this server with
  # pg_basebackup, which needs a replication connection from 127.0.0.1; "all" in pg_hba.conf
  # does not cover replication. Allow it with the method of the file's own 127.0.0.1 line
  # (trust on a test machine), once, and reload; nothing else of the server changes.
  if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && ! psql -w -qAt -c IDENTIFY_SYSTEM \
    "host=127.0.0.1 port=5432 user=postgres replication=true" >/dev/null 2>&1; then
    hba="$(psql -w -qAt -h 127.0.0.1 -p 5432 -U postgres -c 'SHOW hba_file' 2>/dev/null || true)"
    method="$( [ -n "$hba" ] && as_root cat "$hba" | awk '$1 == "host" && $2 == "all" \
      && $3 == "all" && $4 == "127.0.0.1/32" { print $5; exit }' || true)"
    line="host replication all 127.0.0.1/32 $method"
    if [ -n "$method" ] && ! as_root grep -qxF "$line" "$hba"; then
      echo "setup: allowing replication connections from 127.0.0.1 in $hba"
      printf '%s\n' "$line" | as_root tee -a "$hba" >/dev/null
      psql -w -qAt -h 127.0.0.1 -p 5432 -U postgres -c 'SELECT pg_reload_conf()' >/dev/null
    fi
  fi
fi

stamp="$VENV/.installed"
wanted="$(cat pyproject.toml) $DJANGO $EXTRAS $DEPENDENCY_GROUPS $($PYTHON --version 2>&1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  echo "setup: creating $VENV with $($PYTHON --version 2>&1) and $DJANGO"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # pip 25.1 is the first to install PEP 735 dependency groups (--group).
  "$VENV/bin/python" -m pip install -q --upgrade "pip>=25.1"
  group_args=()
  IFS=, read -ra names <<< "$DEPENDENCY_GROUPS"
  for name in "${names[@]}"; do group_args+=(--group "$name"); done
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" "${group_args[@]}" "$DJANGO"
  printf '%s' "$wanted" > "$stamp"
fi
