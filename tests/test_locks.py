"""Behaviour of advisory_lock on every backend: scopes, waits, re-entrancy, statement counts."""

from __future__ import annotations

import threading
import time

import pytest
from django.conf import settings
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connections
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.db.utils import ConnectionDoesNotExist
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from advisory_lock import LockLost
from advisory_lock import LockNotAcquired
from advisory_lock import advisory_lock
from tests.commands import HANG
from tests.probes import freed
from tests.probes import in_other_connection
from tests.probes import is_free

# Statements per lock operation: SQLite's locks are files, not SQL.
ONE_STATEMENT = {"default": 0, "postgresql": 1, "mysql": 1}


def hold_in_other_connection(key, using, ready, done, until_waiting=False, **options):
    """Hold ``key`` from another connection until ``done`` is set (thread target), or with
    ``until_waiting`` until the server shows another session waiting for it."""
    from advisory_lock.backends import inspector_for

    with advisory_lock(key, using=using, **options) as handle:
        ready.set()
        # Bounds only against a test that never lets go or never waits (a hang guard, long
        # enough for a loaded machine to start a waiter process).
        if not until_waiting:
            done.wait(HANG)
            return
        inspector = inspector_for(connections[using])
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            listing = inspector.list_locks({handle.db_key: key})
            if any(row.db_key == handle.db_key and not row.granted for row in listing.rows):
                return
            time.sleep(0.01)


class held_elsewhere:
    """Context manager: another connection holds ``key`` for the duration."""

    def __init__(self, key, using, **options):
        import threading

        self.ready, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(
            target=lambda: in_other_connection(
                hold_in_other_connection, key, using, self.ready, self.done, **options
            )
        )

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10), "the other connection did not take the lock"
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(10)


def test_session_lock_is_held_inside_the_block_and_free_after(using):
    with advisory_lock("job", using=using) as handle:
        assert handle.acquired and handle.scope == "session"
        assert not is_free("job", using)
    assert is_free("job", using)


def test_try_lock_yields_a_falsy_handle_when_another_connection_holds_it(using):
    with held_elsewhere("busy", using), advisory_lock("busy", using=using, wait=False) as handle:
        assert not handle
        assert handle.acquired is False


def test_decorator_raises_lock_not_acquired_when_busy_and_runs_when_free(using):
    @advisory_lock("decorated", using=using, wait=False)
    def work(value):
        assert not is_free("decorated", using)
        return value * 2

    assert work(21) == 42
    with held_elsewhere("decorated", using), pytest.raises(LockNotAcquired, match="work"):
        work(1)
    assert is_free("decorated", using)


def test_timeout_raises_lock_not_acquired_naming_key_and_alias(using):
    with held_elsewhere("slow", using), pytest.raises(LockNotAcquired) as excinfo:
        with advisory_lock("slow", using=using, timeout=0.2):
            pytest.fail("the body must not run")
    assert "'slow'" in str(excinfo.value) and repr(using) in str(excinfo.value)


def test_same_holder_can_take_a_key_twice_and_release_counts_down(using):
    with advisory_lock("again", using=using):
        with advisory_lock("again", using=using, wait=False) as inner:
            assert inner.acquired
        assert not is_free("again", using), "the outer hold must survive the inner release"
    assert is_free("again", using)


def test_keys_differing_in_case_are_distinct_locks_on_every_backend(using):
    with advisory_lock("Job", using=using):
        assert is_free("job", using)
        assert not is_free("Job", using)


def test_int_and_pair_keys_lock_independently(using):
    with advisory_lock(42, using=using), advisory_lock((1, 2), using=using):
        assert not is_free(42, using)
        assert not is_free((1, 2), using)
        assert is_free(43, using)
        assert is_free((2, 1), using)
    assert is_free(42, using) and is_free((1, 2), using)


# transaction.atomic awareness


def test_lock_taken_inside_atomic_is_held_until_commit(using):
    with transaction.atomic(using=using):
        with advisory_lock("tx", using=using) as handle:
            assert handle.scope == "transaction"
        assert not is_free("tx", using), "released before the commit"
    assert is_free("tx", using)


# Every backend releases a transaction-scoped lock by the time atomic() has rolled back:
# PostgreSQL itself; MySQL and SQLite when Django discards the transaction's on_commit
# callbacks (see advisory_lock/holds.py). No later lock operation is needed.


def test_lock_taken_inside_atomic_is_released_by_rollback(using):
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic(using=using):
            with advisory_lock("tx-rollback", using=using):
                pass
            assert not is_free("tx-rollback", using)
            1 / 0  # noqa: B018
    assert is_free("tx-rollback", using)


def test_lock_inside_atomic_marked_for_rollback_is_released_at_the_end(using):
    with transaction.atomic(using=using):
        with advisory_lock("tx-needs-rollback", using=using):
            transaction.set_rollback(True, using=using)
        assert not is_free("tx-needs-rollback", using)
    assert is_free("tx-needs-rollback", using)


def test_lock_taken_in_a_rolled_back_savepoint_is_released_with_it(using):
    # PostgreSQL releases xact locks at ROLLBACK TO SAVEPOINT; the other backends agree.
    with transaction.atomic(using=using):
        with advisory_lock("outer-part", using=using):
            pass
        with pytest.raises(ZeroDivisionError), transaction.atomic(using=using):
            with advisory_lock("savepoint", using=using):
                pass
            assert not is_free("savepoint", using)
            1 / 0  # noqa: B018
        assert is_free("savepoint", using)
        assert not is_free("outer-part", using)
    assert is_free("outer-part", using)


def test_lock_taken_in_a_released_savepoint_is_held_until_the_outer_commit(using):
    with transaction.atomic(using=using):
        with transaction.atomic(using=using), advisory_lock("nested", using=using):
            pass
        assert not is_free("nested", using)
    assert is_free("nested", using)


def test_reentrant_transaction_lock_is_held_until_commit(using):
    with transaction.atomic(using=using):
        with advisory_lock("tx-twice", using=using), advisory_lock("tx-twice", using=using):
            pass
        assert not is_free("tx-twice", using)
    assert is_free("tx-twice", using)


def test_explicit_session_scope_inside_atomic_is_released_at_block_exit(using):
    with transaction.atomic(using=using):
        with advisory_lock("explicit", using=using, scope="session") as handle:
            assert handle.scope == "session"
        assert is_free("explicit", using)


def test_transaction_scope_outside_atomic_is_an_error(using):
    with pytest.raises(TransactionManagementError, match=r"inside transaction\.atomic"):
        with advisory_lock("no-tx", using=using, scope="transaction"):
            pass


def test_failed_try_inside_atomic_does_not_poison_the_transaction(using):
    from testproject.example.models import Counter

    with held_elsewhere("poison", using):
        with transaction.atomic(using=using):
            with advisory_lock("poison", using=using, wait=False) as handle:
                assert not handle
            Counter.objects.using(using).create(name="after-failed-try")
        assert Counter.objects.using(using).filter(name="after-failed-try").exists()
    Counter.objects.using(using).filter(name="after-failed-try").delete()


def test_timeout_inside_atomic_does_not_poison_the_transaction(using):
    from testproject.example.models import Counter

    with held_elsewhere("poison-timeout", using):
        with transaction.atomic(using=using):
            with pytest.raises(LockNotAcquired):
                with advisory_lock("poison-timeout", using=using, timeout=0.1):
                    pass
            Counter.objects.using(using).create(name="after-timeout")
        assert Counter.objects.using(using).filter(name="after-timeout").exists()
    Counter.objects.using(using).filter(name="after-timeout").delete()


def test_transaction_that_fails_inside_a_session_lock_releases_it_and_keeps_the_error(using):
    from testproject.example.models import Counter

    Counter.objects.using(using).create(name="dup")
    try:
        with pytest.raises(Exception) as excinfo:
            with transaction.atomic(using=using):
                with advisory_lock("failing", using=using, scope="session"):
                    Counter.objects.using(using).create(name="dup")  # IntegrityError
        assert type(excinfo.value).__name__ == "IntegrityError"
        # PostgreSQL refuses the unlock until the rollback: it runs during the rollback.
        assert is_free("failing", using)
        # The connection is usable afterwards.
        assert Counter.objects.using(using).filter(name="dup").count() == 1
    finally:
        Counter.objects.using(using).filter(name="dup").delete()


# Statement counts: exact, per operation.


def test_uncontended_try_and_release_are_one_statement_each(using):
    connection = connections[using]
    connection.ensure_connection()
    lock = advisory_lock("count", using=using, wait=False)
    with CaptureQueriesContext(connection) as acquire:
        lock.__enter__()
    with CaptureQueriesContext(connection) as release:
        lock.__exit__(None, None, None)
    assert len(acquire) == ONE_STATEMENT[using]
    assert len(release) == ONE_STATEMENT[using]


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_lock_statements_are_logged_exactly_when_django_logs_queries(using):
    # However DEBUG changes, the lock's statements are logged exactly when Django logs its own.
    connection = connections[using]
    connection.ensure_connection()

    def lock_statements_logged():
        connection.queries_log.clear()
        with advisory_lock("logged", using=using, wait=False):
            pass
        return len(connection.queries_log)

    expected = 2 * ONE_STATEMENT[using]
    debug = settings.DEBUG
    try:
        settings.DEBUG = False  # assigned, as Django's test runner does
        assert lock_statements_logged() == 0
        settings.DEBUG = True
        assert lock_statements_logged() == expected
        with override_settings(DEBUG=False):
            assert lock_statements_logged() == 0
            with CaptureQueriesContext(connection) as queries:
                assert lock_statements_logged() == expected
            assert len(queries) == expected
            with override_settings(DEBUG=True):
                assert lock_statements_logged() == expected
            assert lock_statements_logged() == 0
        assert lock_statements_logged() == expected
        settings.DEBUG = False
        assert lock_statements_logged() == 0
    finally:
        settings.DEBUG = debug
        connection.queries_log.clear()


def test_uncontended_blocking_acquire_is_one_statement(using):
    connection = connections[using]
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as queries:
        with advisory_lock("count-blocking", using=using):
            assert len(queries) == ONE_STATEMENT[using]
    assert len(queries) == 2 * ONE_STATEMENT[using]


def test_uncontended_bounded_wait_outside_atomic_is_one_statement(using):
    connection = connections[using]
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as queries:
        with advisory_lock("count-bounded", using=using, timeout=1.5):
            assert len(queries) == ONE_STATEMENT[using]


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_lock_inside_atomic_on_postgresql_is_one_statement_in_all(using):
    connection = connections[using]
    with transaction.atomic(using=using):
        with CaptureQueriesContext(connection) as queries:
            with advisory_lock("count-tx", using=using):
                pass
        assert len(queries) == 1
        assert "pg_try_advisory_xact_lock" in queries[0]["sql"]


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_uncontended_bounded_wait_inside_atomic_is_at_most_three_statements(using):
    connection = connections[using]
    with transaction.atomic(using=using):
        with CaptureQueriesContext(connection) as queries:
            with advisory_lock("count-tx-bounded", using=using, timeout=2):
                pass
        assert 1 <= len(queries) <= 3


@pytest.mark.parametrize("using", ["default", "mysql"], indirect=True)
def test_lock_inside_atomic_without_native_xact_locks_is_released_with_one_statement(using):
    connection = connections[using]
    with CaptureQueriesContext(connection) as queries:
        with transaction.atomic(using=using):
            with advisory_lock("count-emulated", using=using):
                pass
    lock_sql = [q["sql"] for q in queries if "LOCK" in q["sql"].upper()]
    assert len(lock_sql) == 2 * ONE_STATEMENT[using]


# Losing the connection.


# SQLite's file lock does not live on the database connection: these are server backends only.
@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_connection_closed_inside_the_block_raises_lock_lost(using):
    with pytest.raises(LockLost, match="closed"):
        with advisory_lock("closed", using=using):
            connections[using].close()
    # The server drops a closed connection's locks once it has noticed the close.
    assert freed("closed", using)


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_lock_released_on_a_dead_connection_closes_it_and_raises_lock_lost(using):
    from tests.servers import kill_connection_of

    with pytest.raises(LockLost):
        with advisory_lock("killed", using=using):
            kill_connection_of(using)
    assert connections[using].connection is None, "the broken connection must be closed"
    assert freed("killed", using)  # once the killed session has ended in the server
    with advisory_lock("killed", using=using) as handle:  # the alias reconnects
        assert handle


# Shared locks let both threads hold the key through one object (MySQL has none).
@pytest.mark.parametrize("using", ["default", "postgresql"], indirect=True)
def test_one_lock_object_used_by_two_threads_keeps_their_holds_apart(using):
    """A decorated function is one lock object: each thread must release its own hold.

    Thread A enters first and leaves first, while B is still inside: A must release A's
    hold, not the last one taken on the object (B's).
    """
    import threading

    lock = advisory_lock("shared-object", using=using, shared=True, wait=False)
    a_in, a_out = threading.Event(), threading.Event()
    outcomes = {}

    def thread_a():
        try:
            with lock as handle:
                outcomes["a"] = handle.acquired
                a_in.set()
                assert b_in.wait(10)
        except Exception as exc:
            outcomes["a"] = exc
        finally:
            a_out.set()
            connections.close_all()

    b_in = threading.Event()

    def thread_b():
        assert a_in.wait(10)
        try:
            with lock as handle:
                outcomes["b"] = handle.acquired
                b_in.set()
                assert a_out.wait(10)
        except Exception as exc:
            outcomes["b"] = exc
        finally:
            b_in.set()
            connections.close_all()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert outcomes == {"a": True, "b": True}
    assert is_free("shared-object", using)


def test_a_lock_runs_on_djangos_connection_for_the_alias_in_each_thread(using):
    """A lock runs on exactly the connection Django gives for the alias, in this thread and
    in another."""
    import threading

    seen = {}

    def in_thread(name):
        try:
            with advisory_lock(f"thread-{name}", using=using) as handle:
                seen[name] = (handle.connection, connections[using])
        finally:
            connections.close_all()

    with advisory_lock("thread-main", using=using) as handle:
        assert handle.connection is connections[using]
    other = threading.Thread(target=in_thread, args=("other",))
    other.start()
    other.join(20)
    locked_on, djangos = seen["other"]
    assert locked_on is djangos
    assert locked_on is not connections[using]


def test_a_connection_assigned_to_connections_is_the_one_locked_on(using):
    """``connections[alias] = wrapper`` (as LiveServerTestCase does) is followed at once."""
    original = connections[using]
    original.ensure_connection()
    replacement = connections.create_connection(using)
    connections[using] = replacement
    try:
        with advisory_lock("assigned", using=using) as handle:
            assert handle.connection is replacement
            assert not is_free("assigned", using)
    finally:
        connections[using] = original
        replacement.close()
    with advisory_lock("assigned", using=using) as handle:
        assert handle.connection is original
    with pytest.raises(ConnectionDoesNotExist):
        advisory_lock("assigned", using="no-such-alias").__enter__()


def test_in_async_code_a_sync_lock_is_refused_as_django_refuses_sync_queries(using):
    """Async code gets its own connections from Django, which it may not use synchronously: a
    sync lock there must neither run on the sync thread's open connection nor block the
    event loop (SQLite's file locks included)."""
    import asyncio

    from asgiref.sync import sync_to_async

    sync_connection = connections[using]
    sync_connection.ensure_connection()

    async def lock_in_async_code():
        assert connections[using] is not sync_connection
        try:
            with advisory_lock("async", using=using):
                return "taken"
        except SynchronousOnlyOperation:
            return "refused"

    assert asyncio.run(lock_in_async_code()) == "refused"

    def lock_in_a_sync_thread():
        try:
            with advisory_lock("async", using=using) as handle:
                return handle.acquired, handle.connection is connections[using]
        finally:
            connections.close_all()

    async def through_sync_to_async():
        return await sync_to_async(lock_in_a_sync_thread, thread_sensitive=False)()

    assert asyncio.run(through_sync_to_async()) == (True, True)
    assert is_free("async", using)


@pytest.mark.parametrize("outcome", ["commit", "rollback", "savepoint-rollback"])
def test_lock_released_is_sent_once_when_a_transaction_lock_ends(using, outcome):
    # Every backend tells lock_released at the moment the transaction (or savepoint) that
    # held the lock ends, commit or rollback: PostgreSQL's server releases it then, and the
    # others release it then.
    from advisory_lock import lock_released

    heard = []
    this_thread = threading.get_ident()

    def receiver(sender, key, **kwargs):
        if threading.get_ident() == this_thread:  # not the probe's own lock in its thread
            heard.append((key, is_free(key, using)))

    lock_released.connect(receiver)
    try:
        with transaction.atomic(using=using):
            try:
                with transaction.atomic(using=using):
                    with advisory_lock("signalled", using=using):
                        assert heard == []
                    if outcome == "savepoint-rollback":
                        raise ZeroDivisionError
                if outcome == "rollback":
                    transaction.set_rollback(True, using=using)
            except ZeroDivisionError:
                assert heard == [("signalled", True)]
            else:
                assert heard == []
        assert heard == [("signalled", True)]
    finally:
        lock_released.disconnect(receiver)
