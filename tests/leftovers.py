"""What a run may leave behind in this process and on the server: its lock connections
(``DedicatedLock``), its watchdog and check threads, its server sessions. For the tests of
cancelled and interrupted runs."""

from __future__ import annotations

import threading
import time

from django.db import connections

from advisory_lock import directory
from advisory_lock.dedicated import DedicatedLock
from tests.commands import HANG
from tests.probes import in_other_connection


def track_dedicated_locks(monkeypatch):
    """A list that receives every ``DedicatedLock`` made from now on (until the monkeypatch
    is undone): the lock connections of the runs."""
    made = []
    original = DedicatedLock.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(DedicatedLock, "__init__", init)
    return made


def open_lock_connections(locks):
    """The lock connections still open (on SQLite: still holding a lock file)."""
    return [
        lock
        for lock in locks
        if lock.connection.connection is not None
        or getattr(lock.backend, "held_count", lambda: 0)()
    ]


def run_threads():
    """The watchdog, check and ledger threads alive in this process, once the lock
    directory's writer (which ends by itself a moment after its last note) has ended."""
    if directory.recorder is not None:
        assert directory.recorder.settle(HANG), "the lock directory's writer did not end"
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("advisory_lock"))


def lock_sessions(using):
    """Server sessions on the test database other than the asking one (on PostgreSQL, only
    those of lock connections, named by their application_name); None on SQLite."""
    vendor = connections[using].vendor
    if vendor == "sqlite":
        return None

    def count():
        with connections[using].cursor() as cursor:
            if vendor == "postgresql":
                # "pid=<pid> host=<host> <label>": the process comes first, and a long
                # label loses its end (its "(advisory_lock)") to PostgreSQL's 63 bytes.
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND application_name ~ %s",
                    [r"^pid=[0-9]+ "],
                )
            else:
                cursor.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
                )
            return cursor.fetchone()[0]

    return in_other_connection(count)


def wait_for_sessions(using, at_most, timeout=10.0):
    """Return once the server counts at most ``at_most`` such sessions (it notices closed
    connections a moment after the client closed them); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (sessions := lock_sessions(using)) is not None and sessions > at_most:
        assert time.monotonic() < deadline, f"{sessions} sessions left, expected {at_most}"
        time.sleep(0.02)
