"""Fault-injection tests: server restarts run last, and no server is left stopped."""

from __future__ import annotations

import warnings

import pytest

from tests.faults.helpers import ensure_servers_running

RESTARTS_SERVERS = "restarts_servers"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{RESTARTS_SERVERS}: restarts a database server (breaks every open connection); "
        f"such tests run after all others",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Move the tests that restart servers to the very end of the run.

    A hook in this conftest.py receives the session's whole list of items (pytest calls
    collection hooks on every registered conftest, not only on the items below it), and
    ``trylast`` runs it after pytest-django's reordering: so this holds for ``pytest`` over
    the whole suite too, as long as tests/faults is collected.
    """
    restarting = [item for item in items if item.get_closest_marker(RESTARTS_SERVERS)]
    if restarting:
        others = [item for item in items if not item.get_closest_marker(RESTARTS_SERVERS)]
        items[:] = others + restarting


@pytest.fixture(scope="session", autouse=True)
def servers_left_running(django_db_setup):
    """At the end of the run, start whichever local server a failed restart left stopped.

    It depends on django_db_setup, so it is torn down first: the test databases are then
    dropped on running servers.
    """
    yield
    started = ensure_servers_running()
    if started:
        warnings.warn(f"tests/faults left {started} stopped; started again.", stacklevel=1)
