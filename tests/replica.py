"""Servers whose locks exclude nobody on the primary, for the replica tests.

- ``hot_standby(primary)``: a real PostgreSQL hot standby of the test PostgreSQL server. A
  ``pg_basebackup -R -X stream`` of the primary into a temporary folder, started with the
  primary's own major version of ``postgres`` on a free 127.0.0.1 port (as the ``postgres``
  OS user when we are root), streaming WAL from the primary. Ready once it accepts
  connections, its WAL receiver streams and it has replayed the primary's WAL as of its
  start (so the test databases are there).
- ``read_only_mariadb()``: a MariaDB server of its own, started with ``--read-only=1`` on a
  datadir made by ``mariadb-install-db`` in a temporary folder (as the ``mysql`` OS user),
  on a free port and a socket of its own. (A real MariaDB replica would need the primary's
  binary log, which the test server does not keep: what the lock backend checks,
  ``@@global.read_only``, is the same.)

Both log every statement they receive (PostgreSQL's ``log_statement = all``, MariaDB's
general log), so that a test can tell that no lock statement ever reached them. Each is
stopped at the end of its ``with`` block (SIGINT: PostgreSQL's fast shutdown; SIGTERM for
MariaDB, then SIGKILL) and its folder removed. ``pg_standby`` and ``mariadb_read_only`` are
fixtures over them: started by the first test of a module that asks, stopped after its last
one, not at the end of the run: the restart tests, which run last, find the machine's
MariaDB by its executable (``start-stop-daemon --exec /usr/sbin/mariadbd --oknodo``), and a
read-only ``mariadbd`` still running then would pass for it. Without the server programs
the tests are skipped, loudly; with CI=true they fail.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import pytest

#: Bound on every start-up wait: a guard against a server that never comes up, not a delay.
STARTUP_TIMEOUT = 60
#: Settings a hot standby must have at least as high as its primary, or it refuses to run.
STANDBY_MINIMUMS = (
    "max_connections",
    "max_locks_per_transaction",
    "max_prepared_transactions",
    "max_wal_senders",
    "max_worker_processes",
)


@dataclass
class Server:
    """A running server of ours: where it listens, its folder, and the log of its statements."""

    kind: str
    host: str
    port: int
    directory: Path
    statement_log: Path
    #: Seconds from the first command to ready.
    startup_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def log_size(self) -> int:
        """How far the statement log goes now: pass it to ``log_since``."""
        with contextlib.suppress(OSError):
            return self.statement_log.stat().st_size
        return 0

    def log_since(self, offset: int = 0) -> str:
        """The statement log from ``offset`` on (bytes)."""
        try:
            with self.statement_log.open("rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unavailable(message: str) -> None:
    """A program or permission the harness needs is missing: skip, loudly (fail with CI=true)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(f"\n\n*** {message} The replica tests are SKIPPED. ***\n")


def _run_as(user: str) -> dict[str, Any]:
    """subprocess arguments that run a server program as ``user`` when we are root (servers
    refuse to run as root), and as ourselves otherwise."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(user)
    env = {**os.environ, "HOME": entry.pw_dir, "USER": user, "LOGNAME": user}
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "env": env}


def _own(path: Path, user: str) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, user, user)


def _stop(process: subprocess.Popen, stop_signal: int) -> None:
    if process.poll() is not None:
        return
    process.send_signal(stop_signal)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _wait_ready(process: subprocess.Popen, server: Server, ping: list[str]) -> None:
    """Poll with ``ping`` until it succeeds; raise if the server exits or never answers."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while subprocess.run(ping, capture_output=True).returncode:
        if process.poll() is not None:
            raise RuntimeError(
                f"the {server.kind} exited with status {process.returncode} at start-up:\n"
                f"{_tail(server.directory / 'server.log')}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the {server.kind} did not answer in {STARTUP_TIMEOUT}s:\n"
                f"{_tail(server.directory / 'server.log')}"
            )
        time.sleep(0.05)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# PostgreSQL


def _pg_connect(host: str, port: int, user: str, password: str = "", dbname: str = "postgres"):
    import psycopg

    params = {"host": host, "port": port, "user": user, "dbname": dbname, "connect_timeout": 5}
    if password:
        params["password"] = password
    return psycopg.connect(autocommit=True, **params)


def _postgres_bindir(major: int) -> Path:
    """The server programs of PostgreSQL ``major`` (a standby must run the primary's)."""
    candidates = [Path(f"/usr/lib/postgresql/{major}/bin")]
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        output = subprocess.run(["pg_config", "--bindir"], capture_output=True, check=True)
        candidates.append(Path(output.stdout.decode().strip()))
    for bindir in candidates:
        postgres = bindir / "postgres"
        if os.access(postgres, os.X_OK) and os.access(bindir / "pg_basebackup", os.X_OK):
            version = subprocess.run([postgres, "--version"], capture_output=True, text=True)
            if version.stdout.split()[-1].split(".")[0] == str(major):
                return bindir
    unavailable(
        f"no PostgreSQL {major} server programs (postgres, pg_basebackup) for a standby of the "
        f"test server: install the Debian package postgresql-{major}."
    )
    raise AssertionError("unreachable")


@contextlib.contextmanager
def hot_standby(primary: dict[str, Any]) -> Iterator[Server]:
    """A hot standby streaming from the PostgreSQL server of ``primary`` (Django settings:
    HOST, PORT, USER, PASSWORD) for the duration of the ``with`` block."""
    started = time.monotonic()
    host, port = primary["HOST"] or "127.0.0.1", int(primary["PORT"] or 5432)
    user, password = primary["USER"] or "postgres", primary["PASSWORD"] or ""
    with _pg_connect(host, port, user, password) as connection:
        major = int(connection.execute("SHOW server_version_num").fetchone()[0]) // 10000
        minimums = dict(
            connection.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                [list(STANDBY_MINIMUMS)],
            ).fetchall()
        )
        primary_lsn = connection.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    bindir = _postgres_bindir(major)
    run_as = _run_as("postgres")
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-standby-"))
    try:
        _own(folder, "postgres")
        data, log = folder / "data", folder / "server.log"
        environment = dict(run_as.get("env", os.environ))
        if password:
            environment["PGPASSWORD"] = password
        backup = subprocess.run(
            [bindir / "pg_basebackup", "-h", host, "-p", str(port), "-U", user, "-D", data,
             "-R", "-X", "stream", "--checkpoint=fast", "--no-sync", "--no-password"],
            capture_output=True, text=True, cwd=folder, **{**run_as, "env": environment},
        )  # fmt: skip
        if backup.returncode:
            if any(what in backup.stderr for what in ("pg_hba.conf", "wal_level", "wal_senders")):
                unavailable(
                    f"the PostgreSQL server at {host}:{port} refuses a base backup for a "
                    f"standby ({backup.stderr.strip()}): allow replication connections from "
                    f"this host (scripts/setup.sh --servers does on this machine)."
                )
            raise RuntimeError(f"pg_basebackup failed:\n{backup.stderr}")
        # Debian keeps the primary's configuration outside its data folder: the standby's is
        # on the command line (which overrides the postgresql.auto.conf copied from the
        # primary), with trust for local connections to this private server.
        (data / "postgresql.conf").write_text("# See tests/replica.py: settings are passed.\n")
        (data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        (data / "pg_ident.conf").write_text("")
        for name in ("postgresql.conf", "pg_hba.conf", "pg_ident.conf"):
            _own(data / name, "postgres")
        standby_port = free_port()
        name = f"advisory-lock-standby-{standby_port}"
        settings = {
            "port": standby_port,
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": "",
            "hot_standby": "on",
            # The WAL receiver's application_name: the primary's pg_stat_replication shows it.
            "cluster_name": name,
            "fsync": "off",
            "log_statement": "all",
            "log_line_prefix": "%m [%p] %a: ",
            **minimums,
        }
        options = [part for key, value in settings.items() for part in ("-c", f"{key}={value}")]
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [bindir / "postgres", "-D", data, *options],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=folder,
                **run_as,
            )  # fmt: skip
        server = Server("PostgreSQL hot standby", "127.0.0.1", standby_port, folder, log)
        server.extra.update(cluster_name=name, user=user, password=password)
        try:
            ping = [str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(standby_port)]
            _wait_ready(process, server, ping)
            _wait_streaming(server, primary_lsn)
            server.startup_seconds = time.monotonic() - started
            yield server
        finally:
            _stop(process, signal.SIGINT)  # fast shutdown: ends the sessions and the receiver
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait_streaming(server: Server, primary_lsn: str) -> None:
    """Until the WAL receiver streams and the standby has replayed up to ``primary_lsn``."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    with connect_standby(server) as connection:
        while True:
            status, caught_up = connection.execute(
                "SELECT (SELECT status FROM pg_stat_wal_receiver),"
                " pg_last_wal_replay_lsn() >= %s::pg_lsn",
                [primary_lsn],
            ).fetchone()
            if status == "streaming" and caught_up:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the standby is not streaming from its primary after {STARTUP_TIMEOUT}s "
                    f"(WAL receiver: {status}):\n{_tail(server.statement_log)}"
                )
            time.sleep(0.05)


def connect_standby(server: Server, dbname: str = "postgres"):
    """A psycopg connection (autocommit) to the standby, outside Django and the app."""
    return _pg_connect(
        server.host, server.port, server.extra["user"], server.extra["password"], dbname
    )


# MariaDB


def _mariadb_program(name: str) -> str | None:
    return shutil.which(name) or next(
        (path for path in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(path, os.X_OK)),
        None,
    )


@contextlib.contextmanager
def read_only_mariadb() -> Iterator[Server]:
    """A MariaDB server of its own started with ``--read-only=1``; root without a password."""
    started = time.monotonic()
    programs = {name: _mariadb_program(name) for name in ("mariadbd", "mariadb-install-db")}
    admin = _mariadb_program("mariadb-admin")
    if not all(programs.values()) or admin is None:
        unavailable("no MariaDB server programs (Debian package mariadb-server).")
    user = ["--user=mysql"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-read-only-"))
    try:
        _own(folder, "mysql")
        data, log, port = folder / "data", folder / "general.log", free_port()
        install = subprocess.run(
            [programs["mariadb-install-db"], "--no-defaults", f"--datadir={data}", *user,
             "--auth-root-authentication-method=normal", "--skip-test-db",
             "--skip-name-resolve"],
            capture_output=True, text=True,
        )  # fmt: skip
        if install.returncode:
            raise RuntimeError(f"mariadb-install-db failed:\n{install.stdout}{install.stderr}")
        with (folder / "server.log").open("wb") as stderr:
            process = subprocess.Popen(
                [programs["mariadbd"], "--no-defaults", f"--datadir={data}", *user,
                 f"--socket={folder / 'sock'}", f"--port={port}", "--bind-address=127.0.0.1",
                 f"--pid-file={folder / 'pid'}", "--skip-name-resolve", "--read-only=1",
                 "--general-log=1", f"--general-log-file={log}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        server = Server("read-only MariaDB server", "127.0.0.1", port, folder, log)
        try:
            ping = [admin, "-uroot", "-h127.0.0.1", f"-P{port}", "--connect-timeout=2", "ping"]
            _wait_ready(process, server, ping)
            server.startup_seconds = time.monotonic() - started
            yield server
        finally:
            _stop(process, signal.SIGTERM)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def connect_mariadb(server: Server, database: str = "mysql"):
    """A MySQLdb connection (autocommit) to the server, outside Django and the app."""
    import MySQLdb

    connection = MySQLdb.connect(
        host=server.host, port=server.port, user="root", database=database, connect_timeout=5
    )
    connection.autocommit(True)
    return connection


# Fixtures: started by the first test of a module that asks, stopped after its last one
# (see the module's docstring: not at the end of the run).


@pytest.fixture(scope="module")
def pg_standby(django_db_setup) -> Iterator[Server]:
    """A hot standby of the "postgresql" test server (made after its test database)."""
    from django.db import connections

    if "postgresql" not in connections.settings:
        pytest.skip("no server for 'postgresql' (see the warning at the start of the run)")
    with hot_standby(connections.settings["postgresql"]) as server:
        yield server


@pytest.fixture(scope="module")
def mariadb_read_only() -> Iterator[Server]:
    """A MariaDB server of its own, started read-only."""
    with read_only_mariadb() as server:
        yield server
