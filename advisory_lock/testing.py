"""Helpers for testing code that takes advisory locks or runs ledger jobs.

- ``held_elsewhere(key)``: a block during which another connection holds the lock (another
  open file on SQLite), so that the code under test finds it busy.
- ``assert_lock_held(key)`` / ``assert_lock_free(key)``: checked from another connection.
- ``isolated_ledger``: the ledger writes in the test's transaction, so that a ``TestCase``
  (or pytest-django's ``db`` fixture) rolls its rows back with the test's. Decorate a
  ``TestCase`` class or a test with it, or use it as a context manager.

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
from django.test import override_settings

from advisory_lock.keys import Key
from advisory_lock.locks import advisory_lock

__all__ = ["assert_lock_free", "assert_lock_held", "held_elsewhere", "isolated_ledger"]

_DEADLINE = 10  # seconds for the other connection to take or let go of the lock


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


class _IsolatedLedger:
    """``override_settings`` of ``ADVISORY_LOCK["LEDGER_IN_CALLERS_TRANSACTION"]``, made when
    used so that the rest of the test settings' ADVISORY_LOCK is kept."""

    def _override(self) -> Any:
        current = getattr(settings, "ADVISORY_LOCK", {})
        return override_settings(ADVISORY_LOCK={**current, "LEDGER_IN_CALLERS_TRANSACTION": True})

    def __call__(self, decorated: Any) -> Any:
        return self._override()(decorated)

    def __enter__(self) -> None:
        self._active = self._override()
        self._active.enable()

    def __exit__(self, *exc: object) -> None:
        self._active.disable()


#: Decorate a ``TestCase`` class or a test function, or use as a context manager: the ledger
#: writes in the test's transaction, and its rows go with the test's rollback.
isolated_ledger = _IsolatedLedger()
