"""A lock is released whatever the code around it does: signal receivers that raise, views that
never leave the block, ``on_commit`` hooks that raise, the garbage collector in another thread.

Each test runs on every database (fixture ``using``) and looks at the lock from another
connection (``is_free``). On MySQL and SQLite a transaction-scoped lock is released right
after COMMIT; when Django skips that (a failing hook, a rollback), it is released at the
latest by the next lock operation on that connection in that thread, or at request end.
PostgreSQL's transaction-level locks end with the transaction by themselves.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
from django.db import connections
from django.db import transaction
from django.test import Client
from django.test import override_settings

from advisory_lock import advisory_lock
from advisory_lock import lock_acquired
from advisory_lock import lock_released
from tests.leaky_views import HookFailed
from tests.leaky_views import raise_hook_failed
from tests.probes import is_free

LEAKY_VIEWS = "tests.leaky_views"


class ReceiverFailed(Exception):
    """Raised by the signal receivers below."""


def failing_receiver(**kwargs):
    raise ReceiverFailed("this receiver always fails")


def logged(caplog, level):
    """The records of the "advisory_lock" logger at exactly ``level``, formatted with any
    traceback (a logged exception may be in the message or in the traceback)."""
    formatter = logging.Formatter("%(message)s")
    return [
        formatter.format(record)
        for record in caplog.records
        if record.levelno == level
        and (record.name == "advisory_lock" or record.name.startswith("advisory_lock."))
    ]


def use_another_lock(using):
    """One lock operation on ``using`` in this thread (on a key nobody else uses)."""
    with advisory_lock("release-safety:another-key", using=using) as handle:
        assert handle.acquired


# Signal receivers that raise


def test_a_raising_lock_acquired_receiver_is_logged_and_the_block_runs_under_the_lock(
    using, caplog
):
    key = "release-safety:acquired-receiver"
    lock_acquired.connect(failing_receiver)
    try:
        ran = False
        with advisory_lock(key, using=using) as handle:
            ran = True
            assert handle.acquired
            assert not is_free(key, using)
    finally:
        lock_acquired.disconnect(failing_receiver)
    assert ran
    assert is_free(key, using)
    assert any("this receiver always fails" in text for text in logged(caplog, logging.ERROR))


def test_a_raising_lock_acquired_receiver_inside_atomic_leaves_the_lock_free_after_commit(
    using, caplog
):
    key = "release-safety:acquired-receiver-in-atomic"
    lock_acquired.connect(failing_receiver)
    try:
        with transaction.atomic(using=using):
            with advisory_lock(key, using=using) as handle:
                assert handle.scope == "transaction"
            assert not is_free(key, using), "a transaction-scoped lock is held until commit"
    finally:
        lock_acquired.disconnect(failing_receiver)
    assert is_free(key, using)
    assert any("this receiver always fails" in text for text in logged(caplog, logging.ERROR))


def test_a_raising_lock_released_receiver_does_not_turn_a_normal_exit_into_an_error(using, caplog):
    key = "release-safety:released-receiver"
    lock_released.connect(failing_receiver)
    try:
        with advisory_lock(key, using=using):
            pass
    finally:
        lock_released.disconnect(failing_receiver)
    assert is_free(key, using)
    assert any("this receiver always fails" in text for text in logged(caplog, logging.ERROR))


def test_a_raising_lock_released_receiver_at_commit_is_logged_and_the_lock_is_free(using, caplog):
    key = "release-safety:released-receiver-at-commit"
    lock_released.connect(failing_receiver)
    try:
        with transaction.atomic(using=using):
            with advisory_lock(key, using=using):
                pass
    finally:
        lock_released.disconnect(failing_receiver)
    assert is_free(key, using)
    # Logged by the library (the receiver's error is not left to Django's on_commit logger).
    assert any("this receiver always fails" in text for text in logged(caplog, logging.ERROR))


# A lock a view never released


def test_a_lock_a_view_never_released_is_free_after_the_request_and_logged(using, caplog):
    key = "release-safety:left-held-by-a-view"
    # At request end a real server's close_old_connections has already closed Django's
    # connection (CONN_MAX_AGE=0); the test client skips that, so start without one.
    connections[using].close()
    with override_settings(ROOT_URLCONF=LEAKY_VIEWS):
        response = Client().get(f"/leak/{using}/{key}/")
    assert response.content == b"leaked"
    assert is_free(key, using)
    assert any(key in text for text in logged(caplog, logging.ERROR)), (
        "the error must name the key the view left held"
    )


# Transaction-scoped locks whose COMMIT hook did not run


def test_a_lock_whose_commit_hook_was_skipped_is_released_by_the_next_lock_operation(
    using, caplog
):
    key = "release-safety:commit-hook-skipped"
    with pytest.raises(HookFailed) as excinfo:
        with transaction.atomic(using=using):
            # Not robust: when it raises at commit, Django runs none of the later hooks.
            transaction.on_commit(raise_hook_failed, using=using)
            with advisory_lock(key, using=using):
                pass
    use_another_lock(using)
    assert is_free(key, using)
    if connections[using].vendor != "postgresql":  # there the server ended it with the commit
        assert any(key in text for text in logged(caplog, logging.WARNING)), (
            "a warning must name the lock released late"
        )
    # The error, its traceback and the frames it holds are still alive here, as they are
    # for whoever catches and keeps such an error (a test, an error reporter).
    assert "on_commit hook" in str(excinfo.value)


def test_a_lock_whose_commit_hook_was_skipped_in_a_view_is_free_after_the_request(using):
    key = "release-safety:commit-hook-skipped-in-a-view"
    with override_settings(ROOT_URLCONF=LEAKY_VIEWS), pytest.raises(HookFailed) as excinfo:
        Client().get(f"/on-commit-raises/{using}/{key}/")
    assert is_free(key, using)
    assert "on_commit hook" in str(excinfo.value)  # kept alive until after the check


# A rolled-back transaction's pending release, freed by the garbage collector elsewhere

#: A statement that keeps the connection busy for about a second.
SLOW_STATEMENT = {
    "postgresql": "SELECT pg_sleep(1)",
    "mysql": "SELECT SLEEP(1)",
    "sqlite": (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000000) "
        "SELECT count(*) FROM n"
    ),
}


def put_the_pending_hooks_in_a_reference_cycle(using):
    """Make Django's list of this transaction's on_commit hooks (which holds the pending
    release of a lock taken in it) part of a reference cycle: only the garbage collector
    frees it once Django drops it."""
    hooks = connections[using].run_on_commit
    transaction.on_commit(lambda: hooks, using=using)  # hooks -> this hook -> hooks


def collect_garbage_in_another_thread_during_a_statement(using):
    """Run gc.collect() in another thread while this thread's connection runs a statement,
    as any allocation in any thread may start a collection at any time."""
    running = threading.Event()
    collected = threading.Event()

    def collect():
        if running.wait(10):
            time.sleep(0.3)
            gc.collect()
            collected.set()

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        with connections[using].cursor() as cursor:
            running.set()
            cursor.execute(SLOW_STATEMENT[connections[using].vendor])
    finally:
        running.set()
        collector.join(30)
    assert collected.is_set(), "the other thread did not collect"


def test_a_pending_release_collected_in_another_thread_neither_errs_nor_leaks(using, caplog):
    key = "release-safety:collected-in-another-thread"
    gc.collect()
    gc.disable()  # only the other thread collects the cycle
    try:
        with pytest.raises(ZeroDivisionError):
            with transaction.atomic(using=using):
                with advisory_lock(key, using=using):
                    pass
                put_the_pending_hooks_in_a_reference_cycle(using)
                1 / 0  # noqa: B018 (roll back)
        collect_garbage_in_another_thread_during_a_statement(using)
    finally:
        gc.enable()
    assert logged(caplog, logging.ERROR) == []
    use_another_lock(using)
    assert is_free(key, using)
