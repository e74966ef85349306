"""The database traps each backend must handle, tested on the real servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import OperationalError
from django.db import connections
from django.db import transaction
from django.test.utils import CaptureQueriesContext

from advisory_lock import AdvisoryLockError
from advisory_lock import LockLost
from advisory_lock import LockNotAcquired
from advisory_lock import NotSupportedError
from advisory_lock import advisory_lock
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.keys import make_key
from tests.commands import HANG
from tests.probes import freed
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.servers import backend_id
from tests.servers import kill_connection_of
from tests.servers import prepare_statement_sql
from tests.test_locks import held_elsewhere
from tests.wire import round_trips

postgresql_only = pytest.mark.parametrize("using", ["postgresql"], indirect=True)
mysql_only = pytest.mark.parametrize("using", ["mysql"], indirect=True)


def show(using, setting):
    with connections[using].cursor() as cursor:
        cursor.execute(f"SHOW {setting}")
        return cursor.fetchone()[0]


# PostgreSQL


@postgresql_only
@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "atomic"])
@pytest.mark.parametrize("busy", [False, True], ids=["free", "busy"])
def test_bounded_wait_does_not_leak_lock_timeout(using, in_transaction, busy):
    with connections[using].cursor() as cursor:
        cursor.execute("SET lock_timeout = '7s'")
    holder = held_elsewhere("leak", using) if busy else None
    if holder:
        holder.__enter__()
    try:
        with transaction.atomic(using=using) if in_transaction else _nothing():
            try:
                with advisory_lock("leak", using=using, timeout=0.05, scope="session"):
                    assert show(using, "lock_timeout") == "7s"
            except LockNotAcquired:
                assert busy
            assert show(using, "lock_timeout") == "7s"
        assert show(using, "lock_timeout") == "7s"
    finally:
        if holder:
            holder.__exit__(None, None, None)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@postgresql_only
def test_a_server_lock_timeout_is_lock_not_acquired(using):
    with connections[using].cursor() as cursor:
        cursor.execute("SET lock_timeout = '100ms'")
    with held_elsewhere("server-timeout", using), pytest.raises(LockNotAcquired):
        with advisory_lock("server-timeout", using=using):
            pass


@postgresql_only
def test_a_statement_timeout_is_not_lock_not_acquired(using):
    with connections[using].cursor() as cursor:
        cursor.execute("SET statement_timeout = '100ms'")
    with held_elsewhere("statement-timeout", using):
        with pytest.raises(OperationalError, match="statement timeout") as excinfo:
            with advisory_lock("statement-timeout", using=using):
                pass
    assert not isinstance(excinfo.value, LockNotAcquired)
    assert excinfo.value.__cause__.sqlstate == "57014"


def prepared_lock_statements(using):
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE starts_with(name, 'advisory_lock_')"
        )
        return cursor.fetchone()[0]


@postgresql_only
def test_prepared_lock_statements_survive_deallocate_and_stay_one_round_trip_each(using):
    connection = connections[using]
    for _ in range(4):
        with advisory_lock("prepared", using=using, wait=False):
            pass
    # The try, unguarded until the first statement told the server pid, and the guarded try
    # and unlock: each prepared once on this server session.
    assert prepared_lock_statements(using) == 3
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    # The first statement finds its prepared statement gone (a round trip), and runs plain;
    # each is prepared again at its next use (a round trip), then one round trip each.
    counts = []
    for _ in range(4):
        with round_trips(using) as trips:
            with advisory_lock("prepared", using=using, wait=False) as handle:
                assert handle.acquired
        counts.append(trips.count)
    assert counts == [4, 3, 2, 2]
    assert prepared_lock_statements(using) == 2  # the guarded try and unlock
    assert is_free("prepared", using)


@postgresql_only
def test_lock_statements_already_prepared_on_the_server_connection_are_used(using):
    # A server connection can outlive its client (a pooler that does not DISCARD ALL between
    # clients): the next client finds our statements prepared under their names.
    connection = connections[using]
    connection.close()
    with connection.cursor() as cursor:  # a new server session, before any lock statement
        for function in ("pg_try_advisory_lock", "pg_advisory_unlock"):
            for guarded in (False, True):
                cursor.execute(prepare_statement_sql(function, False, guarded))
    for _ in range(4):
        with advisory_lock("prepared-before", using=using, wait=False) as handle:
            assert handle.acquired and not is_free("prepared-before", using)
    assert prepared_lock_statements(using) == 4
    assert is_free("prepared-before", using)


@postgresql_only
@pytest.mark.fills_lock_table
def test_a_full_lock_table_raises_an_error_naming_max_locks_per_transaction(using):
    """The lock table is the server's, shared by every session: while it is full, any other
    connection's start or lock fails with "out of shared memory" (a db_worker of another
    test died of it). So this test runs alone (the marker; make test's second step)."""
    locks = []
    try:
        with pytest.raises(AdvisoryLockError, match="max_locks_per_transaction"):
            for number in range(1_000_000):
                lock = advisory_lock(number, using=using)
                lock.__enter__()
                locks.append(lock)
        assert len(locks) > 1000
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock_all()")
    assert is_free(0, using)


@postgresql_only
def test_shared_locks_allow_many_readers_and_no_writer(using):
    with advisory_lock("readers", using=using, shared=True):
        assert is_free("readers", using, shared=True)
        assert not is_free("readers", using)
    assert is_free("readers", using)


# MySQL and MariaDB


@mysql_only
def test_get_lock_returning_null_is_an_error_not_busy(using):
    """KILL QUERY of a waiting GET_LOCK makes it return NULL."""
    waiter_id = {}
    started = threading.Event()

    def wait_for_lock():
        waiter_id["id"] = backend_id(using)
        started.set()
        # It waits until killed: the bound is a guard against a hang, not a timing.
        with advisory_lock("null", using=using, timeout=HANG):
            pass

    def waiting():
        """Does the server show the waiter blocked in its waiting GET_LOCK (not the try)?"""
        with connections[using].cursor() as cursor:
            cursor.execute(
                "SELECT STATE, INFO FROM information_schema.PROCESSLIST WHERE ID = %s",
                [waiter_id["id"]],
            )
            row = cursor.fetchone()
        if row is None:
            return False
        state, info = row
        return state == "User lock" and "GET_LOCK" in (info or "") and not info.endswith(", 0)")

    with held_elsewhere("null", using):
        outcome = {}

        def waiter():
            try:
                outcome["error"] = _raised(wait_for_lock)
            finally:
                connections.close_all()

        thread = threading.Thread(target=waiter)
        thread.start()
        assert started.wait(HANG)
        # Kill its query once the server shows it waiting in GET_LOCK: killed before, the
        # kill would find no query to end.
        deadline = time.monotonic() + HANG
        while not in_other_connection(waiting):
            assert time.monotonic() < deadline, "the waiter never waited in GET_LOCK"
            time.sleep(0.01)

        def kill_query():
            with connections[using].cursor() as cursor:
                cursor.execute(f"KILL QUERY {int(waiter_id['id'])}")

        in_other_connection(kill_query)
        thread.join(HANG)
        assert not thread.is_alive(), "the killed GET_LOCK did not return"
    assert isinstance(outcome["error"], AdvisoryLockError)
    assert not isinstance(outcome["error"], LockNotAcquired)
    assert "NULL" in str(outcome["error"])


def _raised(func, *args):
    try:
        func(*args)
    except Exception as exc:
        return exc
    return None


@mysql_only
def test_fractional_timeout_is_honoured_on_mariadb(using):
    with held_elsewhere("fraction", using):
        started = time.monotonic()
        with CaptureQueriesContext(connections[using]) as queries:
            with pytest.raises(LockNotAcquired):
                with advisory_lock("fraction", using=using, timeout=0.3):
                    pass
        waited = time.monotonic() - started
    # It waited, and the server was asked for 0.3 s, not a bound rounded up to a second (the
    # time is only a sanity check, generous for a loaded machine).
    waits = [query["sql"] for query in queries if "GET_LOCK" in query["sql"]]
    assert waits[-1].endswith(", 0.3)"), waits
    assert 0.25 <= waited < 9


@mysql_only
def test_waiting_for_ever_sends_no_negative_timeout_to_mariadb(using):
    # A busy lock: the try finds it held, then the wait for ever is sent; the holder lets go
    # once the server shows that wait.
    with held_elsewhere("forever", using, until_waiting=True):
        with CaptureQueriesContext(connections[using]) as queries:
            with advisory_lock("forever", using=using):
                pass
    sql = [query["sql"] for query in queries if "GET_LOCK" in query["sql"]]
    assert len(sql) == 2 and sql[0].endswith(", 0)")
    assert "-1" not in sql[1]
    assert "2147483647" in sql[1]


@mysql_only
@pytest.mark.parametrize(
    "name", ["test/plain:name~x", "it's", "back\\slash", "nul\x00", "ünïcode"], ids=repr
)
def test_lock_names_that_need_escaping_are_escaped_by_the_driver(using, name):
    # Lock names are quoted without the driver when no server would escape them; any other
    # name (none is made by db_key(), but the backend takes any) goes through its escaping.
    backend = backend_for(connections[using])
    assert backend.acquire(name, shared=False, transaction=False, timeout=0)

    def used(name):
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT IS_USED_LOCK(%s) IS NOT NULL", [name])
            return cursor.fetchone()[0]

    try:
        assert in_other_connection(used, name) == 1  # held under exactly that name
    finally:
        assert backend.release(name, shared=False)
    assert in_other_connection(used, name) == 0


@mysql_only
def test_shared_locks_are_not_supported_on_mysql(using):
    with pytest.raises(NotSupportedError, match="mysql"):
        with advisory_lock("shared", using=using, shared=True):
            pass


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_killed_holder_connection_frees_the_lock(using):
    def take_and_get_killed():
        with pytest.raises(Exception):  # noqa: B017  (LockLost at release)
            with advisory_lock("victim", using=using):
                kill_connection_of(using)
                # pg_terminate_backend and KILL return before the session has ended.
                assert freed("victim", using)

    in_other_connection(take_and_get_killed)


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_plain_lock_lost_during_its_block_says_that_exclusion_may_have_been_broken(using):
    """Regression (issue 31): the holder learned of the loss at the block's end as "could not
    be released ... the connection was closed, which releases it", which reads like a hiccup,
    while another process had held the lock meanwhile."""
    raised: list[LockLost] = []

    def take_and_get_killed():
        with pytest.raises(LockLost) as lost:
            with advisory_lock("import:tenant-42", using=using):
                kill_connection_of(using)
                # Another session can take the lock: the block no longer runs alone.
                assert freed("import:tenant-42", using)
        raised.append(lost.value)

    in_other_connection(take_and_get_killed)
    [error] = raised
    message = str(error)
    assert "was lost during the block" in message, message
    assert "may not have run alone" in message, message
    assert "which releases it" not in message, message


# SQLite

sqlite_only = pytest.mark.parametrize("using", ["default"], indirect=True)

_FLOCK_WITHOUT_RECORD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@sqlite_only
def test_a_holder_is_named_by_the_kernel_not_by_a_stale_record(using):
    # A holder caught between its flock and writing its record: the file still names the
    # previous holder. The busy side must name the process that holds the flock.
    db_key = backend_for(connections[using]).db_key(make_key("report:stale-record"))
    inspector = inspector_for(connections[using])
    with advisory_lock("report:stale-record", using=using):
        # The record a holder killed with SIGKILL leaves in the file (it never removed it).
        record = Path(db_key).read_text()
    Path(db_key).write_text(record)
    holder = subprocess.Popen(
        [sys.executable, "-c", _FLOCK_WITHOUT_RECORD, db_key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with advisory_lock("report:stale-record", using=using, wait=False) as handle:
            assert not handle
        found = inspector.holder(db_key)
        assert found.id == holder.pid != os.getpid()
        assert found.since is None  # the record in the file is not this holder's
    finally:
        holder.communicate("")
    assert inspector.holder(db_key) is None  # nobody holds it now


def test_an_unsupported_engine_is_named_in_the_error():
    from django.db.backends.dummy.base import DatabaseWrapper

    wrapper = DatabaseWrapper({"ENGINE": "django.db.backends.dummy"}, alias="legacy")
    with pytest.raises(NotSupportedError, match=r"'legacy'.*django\.db\.backends\.dummy"):
        backend_for(wrapper)
