#!/usr/bin/env bash
# Everything a fresh clone needs: system packages, the virtualenv, and (with --servers) the
# PostgreSQL and MariaDB servers running. Safe to run again: it only does what is missing.
#   scripts/setup.sh [--servers]
# Environment: PYTHON (python3), VENV (.venv), DJANGO (Django>=5.2,<6), EXTRAS (postgres,mysql,test)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DJANGO=${DJANGO:-Django>=5.2,<6}
EXTRAS=${EXTRAS:-postgres,mysql,test}

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
fi

stamp="$VENV/.installed"
wanted="$(cat pyproject.toml) $DJANGO $EXTRAS $($PYTHON --version 2>&1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  echo "setup: creating $VENV with $($PYTHON --version 2>&1) and $DJANGO"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" "$DJANGO"
  printf '%s' "$wanted" > "$stamp"
fi
