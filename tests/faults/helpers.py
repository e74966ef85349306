"""Helpers of the fault-injection tests: commands behind a proxy, server restarts, timing."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from tests.commands import ROOT
from tests.commands import command_env

PG_CTLCLUSTER = "/usr/bin/pg_ctlcluster"
PG_ISREADY = "/usr/bin/pg_isready"
MARIADB_ADMIN = "/usr/bin/mariadb-admin"
MARIADBD = "/usr/sbin/mariadbd"
START_STOP_DAEMON = "/usr/sbin/start-stop-daemon"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "")
LOCAL_PORTS = {"postgresql": "5432", "mysql": "3306"}
#: How long a server may take to stop or start before the test fails (it is restarted anyway).
SERVER_TIMEOUT = 60.0
#: How long to wait for another pytest run on this machine to end before a restart.
OTHER_RUNS_TIMEOUT = 120.0


# Commands whose "default" database is reached through a BlackHoleProxy.


def start_through_proxy(
    alias: str,
    proxy_port: int,
    *argv: str,
    idle_timeout: float | None = None,
    keepalive: bool = False,
    layout: str = "default",
) -> subprocess.Popen:
    """``manage.py *argv`` with ``alias``'s server as "default", its lock's connection going
    through the proxy (see tests/faults/proxy_settings.py for ``layout``)."""
    env = {
        **command_env(alias),
        "DJANGO_SETTINGS_MODULE": "tests.faults.proxy_settings",
        "ADVISORY_LOCK_TEST_PROXY_PORT": str(proxy_port),
        "ADVISORY_LOCK_TEST_PROXY_LAYOUT": layout,
    }
    if idle_timeout is not None:
        env["ADVISORY_LOCK_TEST_IDLE_TIMEOUT"] = str(idle_timeout)
    if keepalive:
        env["ADVISORY_LOCK_TEST_KEEPALIVE"] = "1"
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def killed_at_the_end(*processes: subprocess.Popen) -> Iterator[None]:
    """Make sure none of ``processes`` outlives the block (SIGKILL, then reap)."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(Exception):
                process.communicate(timeout=10)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> float:
    """Poll ``predicate`` until true; return the seconds it took. Fail after ``timeout``."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{predicate!r} still false after {timeout:g}s")
        time.sleep(interval)


def report(message: str) -> None:
    """A measured bound, shown in the run's output (``-s``, or the -ra summary on failure)."""
    print(f"\n[faults] {message}", file=sys.stderr)


# Server restarts (as root, on this machine's servers only).


def _skip_or_fail(message: str) -> None:
    """Skip loudly; with CI=true a fault test that can't run is a failure, not a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(message)


def require_restartable(alias: str) -> None:
    """Skip unless this process may restart the local server behind ``alias``."""
    settings_dict = settings.DATABASES.get(alias)
    if settings_dict is None:
        _skip_or_fail(f"no server for {alias!r}")
    if not _local_server(alias):
        _skip_or_fail(f"{alias!r} is not this machine's server on {LOCAL_PORTS[alias]}")
    if os.geteuid() != 0:
        _skip_or_fail("restarting a server needs root")
    tools = {
        "postgresql": [PG_CTLCLUSTER, PG_ISREADY],
        "mysql": [MARIADB_ADMIN, MARIADBD, START_STOP_DAEMON],
    }[alias]
    missing = [tool for tool in tools if not os.access(tool, os.X_OK)]
    if missing or (alias == "postgresql" and not _postgresql_version()):
        _skip_or_fail(f"can't restart {alias!r} here: missing {missing or ['/etc/postgresql']}")


def _local_server(alias: str) -> bool:
    """``alias`` is this machine's server, the one that the commands here restart."""
    settings_dict = settings.DATABASES.get(alias)
    return (
        settings_dict is not None
        and settings_dict.get("HOST", "") in LOCAL_HOSTS
        and str(settings_dict.get("PORT", "")) in ("", LOCAL_PORTS[alias])
    )


def _postgresql_version() -> str:
    with contextlib.suppress(OSError):
        versions = sorted(os.listdir("/etc/postgresql"))
        if versions:
            return versions[0]
    return ""


def _run(*argv: str, timeout: float = SERVER_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def server_is_up(alias: str) -> bool:
    if alias == "postgresql":
        return _run(PG_ISREADY, "-q", "-h", "127.0.0.1", "-p", "5432", timeout=10).returncode == 0
    return _run(MARIADB_ADMIN, "-uroot", "-h127.0.0.1", "ping", timeout=10).returncode == 0


def stop_server(alias: str) -> None:
    """Stop the server (PostgreSQL: fast shutdown; MariaDB: mariadb-admin shutdown)."""
    if alias == "postgresql":
        result = _run(
            PG_CTLCLUSTER, "--skip-systemctl-redirect", _postgresql_version(), "main", "stop"
        )
    else:
        result = _run(MARIADB_ADMIN, "-uroot", "-h127.0.0.1", "shutdown")
    assert result.returncode == 0, f"stopping {alias} failed: {result.stderr}"
    wait_until(lambda: not server_is_up(alias), SERVER_TIMEOUT, interval=0.1)
    if alias == "mysql":
        # mariadb-admin returns once the server stops answering, maybe before it has exited.
        wait_until(lambda: not _mariadbd_running(), SERVER_TIMEOUT, interval=0.05)


def start_server(alias: str) -> None:
    """Start the server and wait until it answers."""
    if alias == "postgresql":
        result = _run(
            PG_CTLCLUSTER, "--skip-systemctl-redirect", _postgresql_version(), "main", "start"
        )
        # "already running" (exit status 2) is fine: we only want it up.
        assert result.returncode in (0, 2), f"starting postgresql failed: {result.stderr}"
    else:
        result = _run(START_STOP_DAEMON, "--start", "--oknodo", "--background", "--exec", MARIADBD)
        assert result.returncode == 0, f"starting mariadb failed: {result.stderr}"
    wait_until(lambda: server_is_up(alias), SERVER_TIMEOUT, interval=0.1)


def _mariadbd_running() -> bool:
    for pid in _pids():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/exe").startswith(MARIADBD):
                return True
    return False


def ensure_servers_running() -> list[str]:
    """Start whichever local server a restart test left stopped; return the ones started."""
    started = []
    for alias in ("postgresql", "mysql"):
        if not _local_server(alias) or os.geteuid() != 0 or server_is_up(alias):
            continue
        with contextlib.suppress(Exception):
            if alias == "mysql" and _mariadbd_running():
                wait_until(lambda: not _mariadbd_running(), SERVER_TIMEOUT)  # still stopping
            start_server(alias)
            started.append(alias)
    return started


# Other test runs on this machine: a restart would break them.


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _ours(pid: int) -> bool:
    """True for this process, its ancestors and its descendants."""
    me = os.getpid()
    ancestors = set()
    walker = me
    while walker > 1:
        ancestors.add(walker)
        walker = _parent(walker)
    if pid in ancestors:
        return True
    walker = pid
    while walker > 1:
        if walker == me:
            return True
        walker = _parent(walker)
    return False


def other_pytest_runs() -> list[str]:
    """Command lines of the processes that mention pytest and are not this run."""
    found = []
    for pid in _pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"pytest" in cmdline and not _ours(pid):
            words = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {words}")
    return found


def wait_for_other_pytest_runs(timeout: float = OTHER_RUNS_TIMEOUT) -> None:
    """Wait (up to ``timeout``) until no other pytest runs here; else skip, loudly."""
    deadline = time.monotonic() + timeout
    while others := other_pytest_runs():
        if time.monotonic() > deadline:
            _skip_or_fail(
                f"\n\n*** Another pytest run is still going after {timeout:g}s; restarting "
                f"the server would break it, so this test is SKIPPED: {others[:3]} ***\n"
            )
        time.sleep(1)
