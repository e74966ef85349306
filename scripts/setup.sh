#!/usr/bin/env bash
# Everything a fresh clone needs: system packages, the virtualenv, and (with --servers) the
# PostgreSQL and MariaDB servers installed, set up for the tests and running. Safe to run
# again: it only does what is missing.
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

servers=false
[ "${1:-}" != --servers ] || servers=true
# Whether something answers on 127.0.0.1:PORT (bash's /dev/tcp: no client needed yet).
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

need_packages=()
# mysqlclient has no Linux wheel: pip builds it with a C compiler, Python's headers and the
# MariaDB client library (found with pkg-config). The headers come with Debian's python3 as
# python3-dev (a Python built elsewhere, e.g. pyenv's, has its own); venv's ensurepip as
# python3-venv.
command -v cc >/dev/null || need_packages+=(gcc)
[ -e "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ] \
  || need_packages+=(python3-dev)
"$PYTHON" -c 'import ensurepip' 2>/dev/null || need_packages+=(python3-venv)
command -v pkg-config >/dev/null || need_packages+=(pkg-config)
pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null \
  || need_packages+=(libmariadb-dev)
# The servers the tests run against (tests/settings.py: PostgreSQL on 127.0.0.1:5432, user
# postgres; MariaDB on 127.0.0.1:3306, user root, database test; neither with a password),
# installed when the machine has none: no server binary, nothing on the port, and no
# TEST_POSTGRES_URL / TEST_MYSQL_URL naming another. "postgresql" is Debian's current version
# with pg_ctlcluster (postgresql-common) and psql; "mariadb-server" brings mariadbd and the
# mariadb client. A server installed here is set up for the tests below (fresh_*), one that
# was already there is left as it is.
fresh_postgres=false
fresh_mariadb=false
if $servers; then
  [ -x /usr/sbin/pgbouncer ] || need_packages+=(pgbouncer)
  # The failover tests (tests/patroni.py) run etcd and HAProxy of their own in front of a
  # Patroni cluster; the packages' own services are not used.
  command -v etcd >/dev/null || need_packages+=(etcd-server)
  [ -x /usr/sbin/haproxy ] || need_packages+=(haproxy)
  # The cluster check's test runs a one-node Galera cluster.
  [ -e /usr/lib/galera/libgalera_smm.so ] || need_packages+=(galera-4)
  # The browser tests (tests/browser.py) and scripts/screenshot.py drive Debian's Chromium
  # with Playwright, whose own browser download is not needed.
  command -v chromium >/dev/null || need_packages+=(chromium)
  if [ -z "${TEST_POSTGRES_URL:-}" ] && ! compgen -G "/usr/lib/postgresql/*/bin/postgres" \
    >/dev/null && ! listening 5432; then
    need_packages+=(postgresql)
    fresh_postgres=true
  fi
  if [ -z "${TEST_MYSQL_URL:-}" ] && [ ! -x /usr/sbin/mariadbd ] && [ ! -x /usr/sbin/mysqld ] \
    && ! listening 3306; then
    need_packages+=(mariadb-server)
    fresh_mariadb=true
  fi
fi
if [ ${#need_packages[@]} -gt 0 ]; then
  echo "setup: installing ${need_packages[*]} (Debian packages)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

if $servers; then
  # A fresh cluster (the package's postinst makes "main", port 5432) lets local users in by
  # peer and TCP clients by password (scram-sha-256): the tests connect as postgres from
  # 127.0.0.1 without one, replication connections included (tests/replica.py's
  # pg_basebackup). pg_hba.conf's first matching line decides, so these go first; other
  # users keep the file's own rules. A test machine's server: nothing else listens but
  # 127.0.0.1 (Debian's listen_addresses is localhost).
  if $fresh_postgres; then
    for hba in /etc/postgresql/*/main/pg_hba.conf; do
      [ -e "$hba" ] || continue
      if ! as_root grep -qxF "host all postgres 127.0.0.1/32 trust" "$hba"; then
        echo "setup: letting user postgres in from 127.0.0.1 without a password ($hba)"
        as_root sed -i -e '1i # scripts/setup.sh: the tests, as postgres from 127.0.0.1.' \
          -e '1i host all postgres 127.0.0.1/32 trust' \
          -e '1i host replication postgres 127.0.0.1/32 trust' "$hba"
        # Started by the package already (a machine with systemd): read the file again.
        version="$(basename "$(dirname "$(dirname "$hba")")")"
        if as_root pg_ctlcluster "$version" main status >/dev/null 2>&1; then
          as_root pg_ctlcluster "$version" main reload
        fi
      fi
    done
  fi
  # The first version's cluster "main" (the restart tests take the same). /etc/postgresql
  # alone is no cluster: pgbouncer's dependencies make it.
  cluster="$(compgen -G "/etc/postgresql/*/main/postgresql.conf" | head -n1 || true)"
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && [ -n "$cluster" ]; then
    echo "setup: starting PostgreSQL"
    version="$(basename "$(dirname "$(dirname "$cluster")")")"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  fi
  # MariaDB is started here and by the restart tests (tests/faults/helpers.py) as root with
  # start-stop-daemon, not by systemd, whose unit runs it as mysql: a fresh install's config
  # names no user, and mariadbd refuses to run as root. Say it, as Debian's config once did.
  conf=/etc/mysql/mariadb.conf.d/99-advisory-lock-tests.cnf
  if $fresh_mariadb && [ -d "$(dirname "$conf")" ] && [ ! -e "$conf" ]; then
    printf '%s\n' "# scripts/setup.sh: started as root outside systemd, mariadbd runs as mysql." \
      "[mysqld]" "user = mysql" | as_root tee "$conf" >/dev/null
  fi
  if ! mariadb-admin -uroot -h127.0.0.1 ping >/dev/null 2>&1 && [ -x /usr/sbin/mariadbd ]; then
    echo "setup: starting MariaDB"
    # The socket's and pid file's folder, which systemd or the init script would make.
    ! id mysql >/dev/null 2>&1 || as_root install -d -o mysql -g mysql /run/mysqld
    as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    for _ in $(seq 60); do mariadb-admin -uroot -h127.0.0.1 ping >/dev/null 2>&1 && break; sleep 0.5; done
    mariadb-admin -uroot -h127.0.0.1 ping >/dev/null 2>&1 \
      || echo "setup: MariaDB does not answer on 127.0.0.1:3306 (mariadbd's log says why)" >&2
  fi
  # A fresh MariaDB lets root in over the socket only, as the system's root (unix_socket):
  # the tests connect as root from 127.0.0.1 without a password, to the database test. With
  # host names resolved (the default) a client from 127.0.0.1 is root@localhost, so that
  # account takes an empty password too ("OR": the socket still works); root@127.0.0.1 is the
  # account of that client on a server that skips name resolution. Set once, over the socket.
  if $fresh_mariadb; then
    echo "setup: letting root in from 127.0.0.1 without a password (MariaDB), database test"
    as_root mariadb -uroot -e "
      ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket
        OR mysql_native_password USING PASSWORD('');
      CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
      GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
      CREATE DATABASE IF NOT EXISTS test;"
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
