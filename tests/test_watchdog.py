"""A dedicated lock's watchdog: a kept connection (a scheduler's worker's) has one watchdog
thread for its locks, one after the other, and a lock watched by it is checked and found lost
as by a thread of its own; a lock on a connection of its own has a thread that ends with it."""

from __future__ import annotations

import threading

import pytest

from advisory_lock.dedicated import DedicatedLock
from advisory_lock.dedicated import close_dedicated_connection
from advisory_lock.dedicated import dedicated_connection
from advisory_lock.dedicated import direct_alias
from tests.servers import kill_connection_of

#: Long enough that no check falls due while a test looks (the lost-lock test sets its own).
QUIET_HEARTBEAT = 3600.0
#: A test that waits for an event fails rather than hangs after this long.
GIVE_UP = 60.0


def watchdog_threads(label: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"advisory_lock:{label}"]


def test_a_kept_connections_locks_are_watched_by_one_thread(using):
    label = f"kept-watchdog-{using}"
    connection = dedicated_connection(direct_alias(using), label)
    seen = []
    try:
        for number in range(3):
            lock = DedicatedLock(
                f"{label}-{number}", using=using, label=label, connection=connection
            )
            assert lock.acquire(0)
            lock.watch(QUIET_HEARTBEAT, lambda: None)
            seen.append(watchdog_threads(label))
            lock.release()
        assert len(seen[0]) == 1
        assert seen == [seen[0]] * 3  # the same thread watched the three locks
        assert seen[0][0].is_alive()  # and waits for the next
    finally:
        close_dedicated_connection(connection)
    assert not seen[0][0].is_alive()  # ended with the connection


def test_a_lock_on_a_connection_of_its_own_has_a_watchdog_that_ends_with_it(using):
    label = f"own-watchdog-{using}"
    lock = DedicatedLock(label, using=using, label=label)
    assert lock.acquire(0)
    lock.watch(QUIET_HEARTBEAT, lambda: None)
    [thread] = watchdog_threads(label)
    lock.release()
    assert not thread.is_alive()
    assert watchdog_threads(label) == []


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_kept_connections_later_lock_is_found_lost(using):
    """The second lock watched by a kept connection's thread is checked too: its session
    killed from the server, the watchdog says so (the first, released, is not reported)."""
    label = f"kept-lost-{using}"
    connection = dedicated_connection(direct_alias(using), label)
    lost: list[str] = []
    found = threading.Event()
    try:
        first = DedicatedLock(f"{label}-1", using=using, label=label, connection=connection)
        assert first.acquire(0)
        first.watch(0.05, lambda: lost.append("first"))
        first.release()
        second = DedicatedLock(f"{label}-2", using=using, label=label, connection=connection)
        assert second.acquire(0)
        session = second.backend.session_id()  # the server's id of the lock's session
        assert session is not None

        def on_lost() -> None:
            lost.append("second")
            found.set()

        second.watch(0.05, on_lost)
        kill_connection_of(using, session)
        assert found.wait(GIVE_UP), "the kept watchdog did not find the second lock lost"
        assert second.lost
        assert lost == ["second"]
        second.stop_watching()
        second.let_go()
        [thread] = watchdog_threads(label)
        assert thread.is_alive()  # it watches the connection's next lock
    finally:
        close_dedicated_connection(connection)


def test_a_kept_connections_later_runs_start_no_thread(using, monkeypatch):
    """Once its watchdog runs, a kept connection's lock is taken, watched, checked and
    released with no thread started: the watchdog's thread keeps the deadlines of the check
    and the release, which run on the caller's thread (SQLite's statements cross no network:
    they need no deadline, nor a thread)."""
    label = f"kept-threads-{using}"
    connection = dedicated_connection(direct_alias(using), label)
    started: list[str] = []
    start = threading.Thread.start

    def counted_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    try:
        for number in range(3):
            if number == 1:
                monkeypatch.setattr(threading.Thread, "start", counted_start)
            lock = DedicatedLock(
                f"{label}-{number}", using=using, label=label, connection=connection
            )
            assert lock.acquire(0)
            lock.watch(QUIET_HEARTBEAT, lambda: None)
            assert lock.verify(QUIET_HEARTBEAT)
            lock.release()
        assert started == []
    finally:
        monkeypatch.undo()
        close_dedicated_connection(connection)
