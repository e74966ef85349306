"""A private PgBouncer in front of the test PostgreSQL server, for the pooler tests.

``start_pgbouncer(pool_mode=..., default_pool_size=...)`` is a context manager that runs
``/usr/sbin/pgbouncer`` on a free 127.0.0.1 port with a config of its own in a temporary
folder, waits until the port accepts connections, and stops it (SIGTERM, then SIGKILL) at the
end: the server connections close with it, and so do the advisory locks left on them.
Without pgbouncer the tests are skipped, loudly; with CI=true they fail.
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
from pathlib import Path

import pytest

PGBOUNCER = os.environ.get("TEST_PGBOUNCER", "/usr/sbin/pgbouncer")
# PgBouncer refuses to run as root: it switches to this user (``-u``) when started as root.
RUN_AS = "postgres"
INSTALL_HINT = "install the Debian package pgbouncer (scripts/setup.sh --servers does)"


@dataclass
class PgBouncer:
    """A running PgBouncer: its address and the folder with its config and log."""

    host: str
    port: int
    pool_mode: str
    default_pool_size: int
    directory: Path

    def conninfo(self, dbname: str, **params: str) -> str:
        """A libpq connection string to ``dbname`` through this PgBouncer."""
        items = {"host": self.host, "port": str(self.port), "dbname": dbname, **params}
        return " ".join(f"{key}={value}" for key, value in items.items())

    def log(self) -> str:
        """PgBouncer's log so far (its logfile, then whatever it wrote to stderr)."""
        parts = []
        for name in ("pgbouncer.log", "stderr.log"):
            with contextlib.suppress(OSError):
                parts.append((self.directory / name).read_text(errors="replace"))
        return "\n".join(parts)


def require_pgbouncer() -> str:
    """The pgbouncer executable; skip (fail with CI=true) when it is not installed."""
    path = PGBOUNCER if os.access(PGBOUNCER, os.X_OK) else shutil.which("pgbouncer")
    if path:
        return path
    message = f"pgbouncer is not installed ({PGBOUNCER} is missing): {INSTALL_HINT}."
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(f"\n\n*** {message} The pooler tests are SKIPPED. ***\n")


@contextlib.contextmanager
def start_pgbouncer(
    *,
    pool_mode: str = "transaction",
    default_pool_size: int = 2,
    server_host: str = "127.0.0.1",
    server_port: int = 5432,
    server_user: str = "postgres",
    startup_timeout: float = 10,
) -> Iterator[PgBouncer]:
    """Run a private PgBouncer for the duration of the ``with`` block."""
    if pool_mode not in ("session", "transaction", "statement"):
        raise ValueError(f"pool_mode must be session, transaction or statement: {pool_mode!r}")
    executable = require_pgbouncer()
    as_root = os.geteuid() == 0
    directory = Path(tempfile.mkdtemp(prefix="advisory-lock-pgbouncer-"))
    try:
        port = _free_port()
        config = directory / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port} user={server_user}\n"
            "\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            # "any": no password; every server login is made as the database line's user.
            "auth_type = any\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {default_pool_size}\n"
            "max_client_conn = 100\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {directory / 'pgbouncer.log'}\n"
            f"pidfile = {directory / 'pgbouncer.pid'}\n"
        )
        command = [executable, str(config)]
        if as_root:
            user = pwd.getpwnam(RUN_AS)
            for path in (directory, config):
                os.chown(path, user.pw_uid, user.pw_gid)
            directory.chmod(0o755)
            command = [executable, "-u", RUN_AS, str(config)]
        with (directory / "stderr.log").open("wb") as stderr:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
            )
        bouncer = PgBouncer("127.0.0.1", port, pool_mode, default_pool_size, directory)
        try:
            _wait_until_listening(process, bouncer, startup_timeout)
            yield bouncer
        finally:
            _stop(process)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_listening(process: subprocess.Popen, bouncer: PgBouncer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"pgbouncer exited with status {process.returncode} at start-up:\n{bouncer.log()}"
            )
        try:
            socket.create_connection((bouncer.host, bouncer.port), 0.5).close()
        except OSError:
            time.sleep(0.02)  # polling the port: nothing to wait on but the socket
        else:
            return
    _stop(process)
    raise RuntimeError(
        f"pgbouncer did not listen on port {bouncer.port} in {timeout}s:\n{bouncer.log()}"
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # PgBouncer's immediate shutdown
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
