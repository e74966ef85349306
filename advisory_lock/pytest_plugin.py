"""pytest fixtures for testing code that uses advisory locks (see ``advisory_lock.testing``).

Installed with the package (entry point ``pytest11``)::

    def test_report_skips_when_busy(db, advisory_lock_held_elsewhere):
        with advisory_lock_held_elsewhere("reports"):
            assert build_report() is None

    @pytest.mark.usefixtures("isolated_ledger")
    def test_nightly_runs_once(db): ...
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps

from advisory_lock import testing


@pytest.fixture
def advisory_lock_held_elsewhere() -> Callable[..., Any]:
    """``held_elsewhere(key, *, using=None, shared=False)``: a context manager."""
    return testing.held_elsewhere


@pytest.fixture
def assert_lock_held() -> Callable[..., None]:
    """``assert_lock_held(key, *, using=None)``."""
    return testing.assert_lock_held


@pytest.fixture
def assert_lock_free() -> Callable[..., None]:
    """``assert_lock_free(key, *, using=None)``."""
    return testing.assert_lock_free


@pytest.fixture
def isolated_ledger() -> Iterator[None]:
    """The ledger writes in the test's transaction (with pytest-django's ``db``), so that
    its rows are rolled back with the test's."""
    with testing.isolated_ledger:
        yield


@pytest.fixture(autouse=True)
def _advisory_lock_release_test_locks() -> Iterator[None]:
    """After each test (after pytest-django's rollback, which is torn down first): release the
    transaction-scoped locks its rolled back transaction left held (see
    ``testing.release_test_locks``)."""
    yield
    if apps.ready:
        testing.release_test_locks()
