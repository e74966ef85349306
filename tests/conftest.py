"""Fixtures: run each behaviour test on every database, with real servers."""

from __future__ import annotations

import contextlib
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


# The browser tests (tests/browser.py says how one runs): a module asks for ``admin_page`` (a
# logged-in page of the admin), ``admin_site`` (its server and database) and
# ``admin_schedulers`` (run_jobs on the same database and schedule), and sets the schedule
# by defining a fixture ``admin_schedule`` of its own.


@pytest.fixture(scope="module")
def admin_schedule():
    """``ADVISORY_LOCK["SCHEDULE"]`` of the admin's server: a test module that needs entries
    defines an ``admin_schedule`` fixture of its own."""
    return {}


@pytest.fixture(scope="module")
def chromium():
    """Debian's chromium under Playwright, for the test module (tests/browser.py's
    ``launched()``: Playwright is stopped at the module's end); skipped loudly without it,
    failing with CI=true."""
    from tests.browser import find_chromium
    from tests.browser import launched
    from tests.browser import missing

    executable = find_chromium()
    if executable is None:
        missing("no chromium program (Debian's package chromium; scripts/setup.sh --servers)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing("no Playwright (pyproject.toml's test group; scripts/setup.sh installs it)")
    with launched(executable) as browser:
        yield browser


@pytest.fixture(scope="module", params=BACKENDS, ids=BACKEND_IDS.get)
def admin_site(request, admin_schedule, django_db_setup, django_db_blocker, tmp_path_factory):
    """The admin served by a real HTTP server in a process of its own (tests/browser.py's
    ``serve_admin()``), on one database's test database, with a superuser to log in as; once
    per test module and database."""
    from django.contrib.auth.models import User

    from tests.browser import AdminSite
    from tests.browser import serve_admin

    alias = request.param
    if alias not in settings.DATABASES:
        pytest.skip(f"no server for {alias!r} (see the warning at the start of the run)")
    folder = tmp_path_factory.mktemp(f"admin-{alias}")
    with django_db_blocker.unblock():
        users = User.objects.db_manager(alias)
        users.filter(username="admin").delete()  # left by a test that did not clean up
        user = users.create_superuser("admin", "admin@example.com", "admin-password")
        try:
            with serve_admin(alias, admin_schedule, folder) as server:
                yield AdminSite(alias, server, "admin", "admin-password")
        finally:
            user.delete()  # its sessions' rows stay: they name no user row
            connections[alias].close()


@pytest.fixture
def admin_database(admin_site, django_db_blocker):
    """The admin's database alias, the rows of every model of the app there deleted after the
    test (JobRun, JobControl, heartbeats, ...), and the admin's history."""
    from django.apps import apps
    from django.contrib.admin.models import LogEntry

    with django_db_blocker.unblock():
        yield admin_site.using
        for model in apps.get_app_config("advisory_lock").get_models():
            # Model._default_manager is documented ("Default managers"): not every model of
            # the app need name its manager objects.
            model._default_manager.using(admin_site.using).all().delete()
        LogEntry.objects.using(admin_site.using).all().delete()


@contextlib.contextmanager
def _browser_page(chromium, **options):
    """A page in a new browser context (1280x800; ``options``: Playwright's ``new_context``
    options), closed when the block ends."""
    from tests.browser import HANG_MS
    from tests.browser import VIEWPORT

    context = chromium.new_context(viewport=VIEWPORT, **options)
    context.set_default_timeout(HANG_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def browser_page(chromium):
    """A page in a fresh browser context (no cookies), 1280x800, closed after the test."""
    with _browser_page(chromium) as page:
        yield page


@pytest.fixture(scope="module")
def admin_session(chromium, admin_site):
    """The cookies of ``admin_site``'s superuser, logged in through the login form once per
    test module and database (Playwright's storage state)."""
    from tests.browser import log_in

    with _browser_page(chromium) as page:
        log_in(page, admin_site)
        return page.context.storage_state()


@pytest.fixture
def admin_page(chromium, admin_session, admin_database):
    """A page of the admin in a browser context of its own, logged in as ``admin_site``'s
    superuser; closed after the test."""
    with _browser_page(chromium, storage_state=admin_session) as page:
        yield page


@pytest.fixture
def admin_schedulers(admin_site, admin_schedule, admin_database, tmp_path):
    """Starts ``run_jobs`` on the admin's database (tests/schedulers.py's ``Schedulers``;
    ``start(admin_schedule)`` runs the schedule the admin shows); killed after the test,
    before ``admin_database`` deletes the rows."""
    from tests.schedulers import Schedulers

    started = Schedulers(admin_database, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()
