"""The lock's statements through the drivers' low-level calls: round trips, transactions
left as Django expects them, and waits that a signal still interrupts."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

import pytest
from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from psycopg import IsolationLevel
from psycopg import pq

from advisory_lock import advisory_lock
from advisory_lock.backends import inspector_for
from tests.probes import is_free
from tests.processes import DEFAULT_TIMEOUT
from tests.test_locks import held_elsewhere
from tests.wire import round_trips

servers = pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
postgresql_only = pytest.mark.parametrize("using", ["postgresql"], indirect=True)


@servers
def test_an_uncontended_try_and_release_are_one_round_trip_each(using):
    for _ in range(3):  # the first ones learn the server pid and prepare the statements
        with advisory_lock("trips", using=using, wait=False):
            pass
    for wait in (False, True):
        with round_trips(using) as trips:
            with advisory_lock("trips", using=using, wait=wait) as handle:
                assert handle.acquired
        assert trips.count == 2


@postgresql_only
def test_a_transaction_lock_that_is_the_first_statement_sends_the_begin_with_it(using):
    connection = connections[using]
    with advisory_lock("first-statement", using=using):  # the connection's first check
        pass
    with transaction.atomic(using=using):
        with round_trips(using) as trips:
            with advisory_lock("first-statement", using=using):
                pass
        assert trips.count == 1
        pgconn = connection.connection.pgconn
        assert pgconn.transaction_status == pq.TransactionStatus.INTRANS
        assert not is_free("first-statement", using)
    assert pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert is_free("first-statement", using)


@postgresql_only
def test_a_transaction_lock_leaves_the_begin_to_psycopg_when_it_adds_options(using):
    connection = connections[using]
    connection.ensure_connection()
    connection.connection.isolation_level = IsolationLevel.SERIALIZABLE
    try:
        with transaction.atomic(using=using):
            with advisory_lock("isolation", using=using):
                pass
            with connection.cursor() as cursor:
                cursor.execute("SHOW transaction_isolation")
                assert cursor.fetchone()[0] == "serializable"
            assert not is_free("isolation", using)
        assert is_free("isolation", using)
    finally:
        connection.close()


@postgresql_only
@pytest.mark.parametrize("logged", [False, True], ids=["unlogged", "logged"])
def test_a_release_during_the_rollback_leaves_autocommit_as_django_restores_it(using, logged):
    # The session lock's block ends in a failed transaction: its release runs while Django
    # rolls back, before it restores autocommit, which must still succeed.
    connection = connections[using]
    with override_settings(DEBUG=logged):
        with pytest.raises(DatabaseError) as excinfo:
            with transaction.atomic(using=using):
                with advisory_lock("aborted", using=using, scope="session"):
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT 1/0")
        assert "division by zero" in str(excinfo.value)
        assert connection.get_autocommit()
        assert connection.connection.pgconn.transaction_status == pq.TransactionStatus.IDLE
        assert is_free("aborted", using)
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")


@pytest.mark.parametrize("using", ["default", "postgresql"], indirect=True)
def test_a_blocking_wait_is_interrupted_by_ctrl_c(using, workers):
    # PostgreSQL's wait polls its connection's socket (a psycopg cursor's wait, inside a
    # transaction), so Python's signal handlers run; SQLite waits in flock(), which a signal
    # interrupts. (A blocking libpq call would defer the handler until the lock came.)
    key = f"interruptible-{uuid.uuid4().hex[:8]}"
    with held_elsewhere(key, using) as holder:
        waiter = workers.start("--using", using, "hold", key)
        # Until the waiter is seen waiting: the database's view, or the kernel's for SQLite.
        inspector = inspector_for(connections[using])
        deadline = time.monotonic() + DEFAULT_TIMEOUT  # a guard against a waiter that never comes
        while not any(not row.granted for row in inspector.list_locks({}).rows):
            if time.monotonic() > deadline:
                pytest.fail("the waiter never showed up waiting")
            time.sleep(0.01)
        os.kill(waiter.proc.pid, signal.SIGINT)
        try:
            status = waiter.proc.wait(DEFAULT_TIMEOUT)  # a guard against a hang, not a timing
        except subprocess.TimeoutExpired:
            pytest.fail(f"the waiter ignored SIGINT; its stderr:\n{waiter.stderr()}")
        assert status != 0 and "KeyboardInterrupt" in waiter.stderr()
        assert holder.thread.is_alive()  # the lock was still held throughout


@servers
def test_a_key_busy_at_its_last_try_is_waited_for_at_once(using):
    # Under contention a try before each wait would cost a round trip per acquisition: a key
    # found busy is waited for without one (and tried again after a few acquisitions).
    key = f"contended-{uuid.uuid4().hex[:8]}"
    counts = []
    for _ in range(2):
        with held_elsewhere(key, using, until_waiting=True):
            with CaptureQueriesContext(connections[using]) as queries:
                with advisory_lock(key, using=using) as handle:
                    assert handle.acquired
        counts.append(len([q for q in queries if "LOCK" in q["sql"].upper()]))
    assert counts == [3, 2]  # try, wait, release; then wait, release


class Interrupted(Exception):
    """What the test's signal handler raises (as a watchdog's or a SIGTERM handler's would)."""


@pytest.mark.parametrize(
    ("using", "target"),
    [
        ("default", "main thread"),
        ("postgresql", "main thread"),
        # Handled by another thread, the main thread's handler runs when it next runs Python:
        # SQLite's flock() does not return for that; PostgreSQL's wait wakes up regularly.
        ("postgresql", "another thread"),
    ],
    indirect=["using"],
)
def test_a_signal_handler_ends_a_blocking_wait_and_leaves_the_connection_usable(using, target):
    # PostgreSQL's wait is a prepared statement sent without blocking, then a poll of the
    # socket: a handler that raises (a watchdog's SIGINT, a SIGTERM handler) ends it, the
    # statement is cancelled, and the session waits no more.
    key = f"signalled-{uuid.uuid4().hex[:8]}"
    for _ in range(3):  # the server pid is known, the statements prepared
        with advisory_lock(key, using=using):
            pass
    main = threading.get_ident()
    errors = []

    def signal_once_waiting():
        try:
            inspector = inspector_for(connections[using])  # this thread's connection
            deadline = time.monotonic() + DEFAULT_TIMEOUT  # a guard against a hang
            while not any(not row.granted for row in inspector.list_locks({}).rows):
                assert time.monotonic() < deadline, "the waiter never showed up waiting"
                time.sleep(0.01)
            if target == "main thread":
                signal.pthread_kill(main, signal.SIGUSR1)
            else:  # to this thread: Python's C handler runs here, the main thread's later
                signal.raise_signal(signal.SIGUSR1)
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            connections.close_all()

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with held_elsewhere(key, using) as holder:
            signaller = threading.Thread(target=signal_once_waiting)
            signaller.start()
            with pytest.raises(Interrupted), advisory_lock(key, using=using):
                pytest.fail("the lock was taken while another connection held it")
            signaller.join(DEFAULT_TIMEOUT)
            assert not errors, errors
            assert holder.thread.is_alive()  # still held: the handler ended the wait
            inspector = inspector_for(connections[using])
            assert not any(not row.granted for row in inspector.list_locks({}).rows)
            with connections[using].cursor() as cursor:
                cursor.execute("SELECT 1")
                assert cursor.fetchone() == (1,)
            if using == "postgresql":
                pgconn = connections[using].connection.pgconn
                assert pgconn.transaction_status == pq.TransactionStatus.IDLE
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with advisory_lock(key, using=using, wait=False) as handle:
        assert handle.acquired


def stopped(pid):
    """Is the process ``pid`` stopped (SIGSTOP), as the kernel says?"""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def waiting_rows(using):
    rows = inspector_for(connections[using]).list_locks({}).rows
    return [row for row in rows if not row.granted]


def wait_for(predicate, what):
    deadline = time.monotonic() + DEFAULT_TIMEOUT  # a guard against a hang, not a timing
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@servers
def test_a_wait_interrupted_just_as_the_lock_is_granted_leaves_it_free(using, workers):
    """The lock is granted to a waiter whose Ctrl-C is already on its way: the waiter is
    stopped (SIGSTOP) while it waits, the holder lets go, the database grants the waiter the
    lock, and only then does the waiter get SIGINT and run on (SIGCONT). Whichever comes
    first in the waiter, the interruption or the lock, the lock must not stay held by a
    session that has no hold for it. (SQLite is not in it: the kernel grants a flock() only
    to a waiter that runs, so the grant can't come first.)"""
    key = f"granted-{uuid.uuid4().hex[:8]}"
    holder = workers.start("--using", using, "hold", key)
    holder.expect("acquired")
    waiter = workers.start("--using", using, "interrupted-wait", key)
    waiter.expect("waiting")
    wait_for(lambda: waiting_rows(using), "the waiter never showed up waiting")
    os.kill(waiter.proc.pid, signal.SIGSTOP)
    wait_for(lambda: stopped(waiter.proc.pid), "the waiter did not stop")
    holder.send("release")
    holder.expect("releasing")
    holder.expect("released")
    # The database has given the lock to the stopped waiter: nobody waits, and it is held.
    wait_for(lambda: not waiting_rows(using), "the lock was not granted to the waiter")
    assert not is_free(key, using)
    os.kill(waiter.proc.pid, signal.SIGINT)
    os.kill(waiter.proc.pid, signal.SIGCONT)

    outcome = waiter.message()["event"]
    assert outcome in ("interrupted", "acquired"), outcome
    assert is_free(key, using), f"{outcome}, and the waiter's session still holds the lock"
    waiter.send("exit")
