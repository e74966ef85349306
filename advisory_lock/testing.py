"""Helpers for testing code that takes advisory locks or runs ledger jobs.

- ``held_elsewhere(key)``: a block during which another connection holds the lock (another
  open file on SQLite), so that the code under test finds it busy.
- ``assert_lock_held(key)`` / ``assert_lock_free(key)``: checked from another connection.
- ``isolated_ledger``: the ledger writes in the test's transaction, so that a ``TestCase``
  (or pytest-django's ``db`` fixture) rolls its rows back with the test's. Decorate a
  ``TestCase`` class or a test with it, or use it as a context manager.
- ``release_test_locks()``: after a test's rollback, release the transaction-scoped locks
  its code took (MySQL and SQLite; PostgreSQL releases them itself). ``isolated_ledger`` on a
  ``TestCase`` class and the pytest plugin call it after every test.

The pytest plugin (``advisory_lock.pytest_plugin``, installed with the package) offers the
same as fixtures.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connections
from django.test import SimpleTestCase
from django.test import override_settings

from advisory_lock.holds import end_rolled_back_holds
from advisory_lock.keys import Key
from advisory_lock.locks import advisory_lock

__all__ = [
    "assert_lock_free",
    "assert_lock_held",
    "held_elsewhere",
    "isolated_ledger",
    "release_test_locks",
]

#: Seconds for the other connection to take or let go of the lock: a guard against a hang on a
#: busy machine, not a timing.
_DEADLINE = 120


@contextmanager
def held_elsewhere(key: Key, *, using: str | None = None, shared: bool = False) -> Iterator[None]:
    """Hold ``key`` from another connection (another thread's) for the block's duration."""
    taken, done = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            with advisory_lock(key, using=using, shared=shared, timeout=_DEADLINE):
                taken.set()
                done.wait()
        except BaseException as error:
            failure.append(error)
            taken.set()
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold, name="advisory_lock-held_elsewhere", daemon=True)
    holder.start()
    taken.wait()
    if failure:
        raise AssertionError(f"Lock {key!r} could not be taken elsewhere: {failure[0]}")
    try:
        yield
    finally:
        done.set()
        holder.join(_DEADLINE)


def assert_lock_held(key: Key, *, using: str | None = None) -> None:
    """Fail unless someone (this test's code included) holds ``key`` right now."""
    if _free_elsewhere(key, using):
        raise AssertionError(f"Lock {key!r} on database {using or 'default'!r} is free.")


def assert_lock_free(key: Key, *, using: str | None = None) -> None:
    """Fail if anyone (this test's code included) holds ``key`` right now."""
    if not _free_elsewhere(key, using):
        raise AssertionError(f"Lock {key!r} on database {using or 'default'!r} is held.")


def _free_elsewhere(key: Key, using: str | None) -> bool:
    """Can another connection take ``key`` now? (It lets go at once.)"""
    outcome: list[Any] = []

    def attempt() -> None:
        try:
            with advisory_lock(key, using=using, wait=False) as handle:
                outcome.append(handle.acquired)
        except BaseException as error:
            outcome.append(error)
        finally:
            connections.close_all()

    checker = threading.Thread(target=attempt, name="advisory_lock-check")
    checker.start()
    checker.join(_DEADLINE)
    if not outcome or isinstance(outcome[0], BaseException):
        raise AssertionError(f"Lock {key!r} could not be checked: {outcome[:1]}")
    return bool(outcome[0])


def release_test_locks() -> None:
    """Release the transaction-scoped locks left held by a test whose transaction rolled back.

    Django's ``TestCase`` rolls each test back, and Django runs no hook on a rollback. On
    PostgreSQL the rollback drops the test's transaction-scoped locks; on MySQL and SQLite the
    library releases them at its next chance outside a transaction, which inside a
    ``TestCase`` never comes, so the next test would find them busy. Call this in
    ``tearDown`` (``isolated_ledger`` on a ``TestCase`` class, and the pytest plugin, do).
    """
    end_rolled_back_holds()


class _IsolatedLedger:
    """``override_settings`` of ``ADVISORY_LOCK["LEDGER_IN_CALLERS_TRANSACTION"]``, made when
    used so that the rest of the test settings' ADVISORY_LOCK is kept. Overrides nest."""

    def __init__(self) -> None:
        self._active: list[override_settings] = []

    def _override(self) -> override_settings:
        current = getattr(settings, "ADVISORY_LOCK", {})
        return override_settings(ADVISORY_LOCK={**current, "LEDGER_IN_CALLERS_TRANSACTION": True})

    def __call__(self, decorated: Any) -> Any:
        if isinstance(decorated, type) and issubclass(decorated, SimpleTestCase):
            _release_locks_after_each_test(decorated)
        return self._override()(decorated)

    def __enter__(self) -> None:
        override = self._override()
        override.enable()
        self._active.append(override)

    def __exit__(self, *exc: object) -> None:
        self._active.pop().disable()


def _release_locks_after_each_test(case: type[SimpleTestCase]) -> None:
    set_up = case.setUp

    def setUp(self: SimpleTestCase) -> None:
        # Registered first, so it runs last of the cleanups: after the test's own code, just
        # before TestCase rolls the test's transaction back (nothing runs in it after that).
        self.addCleanup(release_test_locks)
        set_up(self)

    case.setUp = setUp  # type: ignore[method-assign,assignment]


#: Decorate a ``TestCase`` class or a test function, or use as a context manager: the ledger
#: writes in the test's transaction, and its rows go with the test's rollback.
isolated_ledger = _IsolatedLedger()
