"""Fixtures: run each behaviour test on every database, with real servers."""

from __future__ import annotations

import os
import shutil

import pytest
from django.conf import settings
from django.db import connections

from tests.processes import Workers

BACKENDS = ["default", "postgresql", "mysql"]
BACKEND_IDS = {"default": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment, django_db_blocker):
    """Create the test databases of every configured alias, whatever the tests ask for."""
    from django.test.utils import setup_databases
    from django.test.utils import teardown_databases

    with django_db_blocker.unblock():
        config = setup_databases(verbosity=0, interactive=False, aliases=set(settings.DATABASES))
    yield
    with django_db_blocker.unblock():
        connections.close_all()
        teardown_databases(config, verbosity=0)


@pytest.fixture(params=BACKENDS, ids=BACKEND_IDS.get)
def using(request, django_db_setup, django_db_blocker):
    """A database alias with real access (no test transaction around the test)."""
    alias = request.param
    if alias not in settings.DATABASES:
        pytest.skip(f"no server for {alias!r} (see the warning at the start of the run)")
    with django_db_blocker.unblock():
        yield alias
        connections[alias].close()


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test, with the entries' first-seen
    times that schedulers wrote (test files that need other rows define a ``ledger`` of
    their own)."""
    from advisory_lock import JobRun
    from advisory_lock.scheduling.first_seen import EntrySeen

    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()
    EntrySeen.objects.using(using).all().delete()


@pytest.fixture
def schedulers(using, tmp_path):
    """Starts ``run_jobs`` processes on ``using`` (tests/schedulers.py); they and their jobs
    are killed at the end of the test (test files that need more cleaned up define a
    ``schedulers`` of their own)."""
    from tests.schedulers import Schedulers

    started = Schedulers(using, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


def pytest_sessionfinish(session, exitstatus):
    """Remove the run's folder (SQLite files, lock files) if this process made it."""
    if os.environ.get("ADVISORY_LOCK_TEST_DIR_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["ADVISORY_LOCK_TEST_DIR"], ignore_errors=True)


@pytest.fixture
def workers():
    """Worker processes for this test (tests/worker.py); none of them outlives it."""
    assert "ADVISORY_LOCK_TEST_DIR" in os.environ, "tests.settings sets it for the workers"
    started = Workers()
    try:
        yield started
    finally:
        started.kill_all()
