"""The testing kit (advisory_lock.testing, and its pytest plugin) used the way a project would.

The project is tests/kitapp: a view that refreshes prices unless a refresh is running
(``wait=False``), a nightly report made with ``run_once``, an index rebuild under a lock,
and ``send_digest``, a ``@single_instance(ledger="daily")`` command. Its Django TestCase
tests are in tests/kitapp/tests.py (imported below, so that this module runs them too);
here the same with pytest-django's ``db`` and the plugin's fixtures, on each database.
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from advisory_lock import pytest_plugin
from advisory_lock import testing
from advisory_lock.conf import get_setting
from tests.kitapp.jobs import INDEX_LOCK
from tests.kitapp.jobs import nightly_report
from tests.kitapp.jobs import rebuild_search_index
from tests.kitapp.management.commands import send_digest
from tests.kitapp.models import Report
from tests.kitapp.tests import KitTests  # noqa: F401  (the TestCase tests, run here too)
from tests.kitapp.tests import KitTestsOnMariaDB  # noqa: F401
from tests.kitapp.tests import KitTestsOnPostgreSQL  # noqa: F401
from tests.kitapp.views import PRICES_LOCK

ALIASES = {"default": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}
CONFIGURED = [alias for alias in ALIASES if alias in settings.DATABASES]
#: pytest-django's ``db``: each test in a transaction, on every configured database.
in_test_transaction = pytest.mark.django_db(databases=CONFIGURED)


@pytest.fixture(
    params=[
        pytest.param(
            alias,
            id=name,
            marks=pytest.mark.skipif(alias not in settings.DATABASES, reason="no server"),
        )
        for alias, name in ALIASES.items()
    ]
)
def kit_database(request, settings, monkeypatch):
    """The project's database is this alias: its jobs, views and command use it."""
    settings.KITAPP_DATABASE = request.param
    monkeypatch.setattr(send_digest.Command, "lock_using", request.param)
    return request.param


def test_the_plugin_is_installed_with_the_package(request):
    plugin = request.config.pluginmanager.get_plugin("advisory_lock")
    assert plugin is pytest_plugin
    for fixture in ("advisory_lock_held_elsewhere", "assert_lock_held", "assert_lock_free"):
        assert request.getfixturevalue(fixture) is not None


# The ledger: what a test runs is gone for the next test, with one line of set-up. The two
# tests run in this order (a class's tests run as written), the first for each database
# before the second.


@in_test_transaction
@pytest.mark.usefixtures("isolated_ledger")
class TestLedgerRunsLeaveNothingBehind:
    def test_1_a_job_run_twice_in_one_test_is_skipped_the_second_time(self, kit_database):
        assert nightly_report() is not None
        assert nightly_report() is None
        call_command("send_digest", stdout=StringIO())
        with pytest.raises(CommandError, match="already done"):
            call_command("send_digest", stdout=StringIO(), stderr=StringIO())
        runs = JobRun.objects.using(kit_database)
        assert sorted(runs.values_list("job_name", "status")) == [
            ("kitapp.nightly_report", "succeeded"),
            ("kitapp.send_digest", "succeeded"),
        ]

    def test_2_the_next_test_starts_with_an_empty_ledger(self, kit_database):
        assert not JobRun.objects.using(kit_database).exists()
        assert not Report.objects.using(kit_database).exists()
        assert nightly_report() is not None
        call_command("send_digest", stdout=StringIO())


@in_test_transaction
@pytest.mark.usefixtures("isolated_ledger")
def test_the_ledgers_rows_go_with_the_jobs_own_writes_when_a_block_rolls_back(kit_database):
    with pytest.raises(RuntimeError), transaction.atomic(using=kit_database):
        assert nightly_report() is not None
        raise RuntimeError("the test's own block fails")
    assert not Report.objects.using(kit_database).exists()
    assert not JobRun.objects.using(kit_database).exists()
    assert nightly_report() is not None  # the slot is free again


@in_test_transaction
def test_isolated_ledger_is_also_a_context_manager(kit_database):
    assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is False
    with testing.isolated_ledger:
        assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is True
        assert get_setting("NAMESPACE") == "tests"  # the rest of ADVISORY_LOCK is kept
        assert nightly_report() is not None
    assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is False


def test_isolated_ledger_nests():
    """Regression: a nested ``with isolated_ledger`` replaced the outer override, so the outer
    exit disabled the inner one again and left the setting overridden for ever."""
    with testing.isolated_ledger:
        with testing.isolated_ledger:
            assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is True
        assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is True
    assert get_setting("LEDGER_IN_CALLERS_TRANSACTION") is False


# Regression: a transaction-scoped lock taken in a test was still held in the next test on
# MariaDB and SQLite (pytest-django rolls the test's transaction back, and Django runs no hook
# on a rollback). The plugin releases it after each test. The two tests run in this order.

TEST_TRANSACTION_LOCK = "kit.pytest-transaction"


@in_test_transaction
class TestTransactionLocksEndWithTheTest:
    def test_1_a_lock_taken_in_the_test_transaction_is_held_to_its_end(self, kit_database):
        with advisory_lock(TEST_TRANSACTION_LOCK, using=kit_database, scope="transaction"):
            pass
        testing.assert_lock_held(TEST_TRANSACTION_LOCK, using=kit_database)

    def test_2_the_next_test_finds_it_free(self, kit_database):
        testing.assert_lock_free(TEST_TRANSACTION_LOCK, using=kit_database)


# Locks: busy elsewhere; held while the code works, free after.


@in_test_transaction
@pytest.mark.urls("tests.kitapp.urls")
def test_prices_are_not_refreshed_while_another_process_refreshes_them(
    kit_database, client, advisory_lock_held_elsewhere, assert_lock_free
):
    with advisory_lock_held_elsewhere(PRICES_LOCK, using=kit_database):
        response = client.post("/prices/refresh/")
        assert response.status_code == 409
    response = client.post("/prices/refresh/")
    assert response.status_code == 200 and response.content == b"Prices refreshed."
    assert_lock_free(PRICES_LOCK, using=kit_database)


@in_test_transaction
def test_the_index_is_rebuilt_under_its_lock_and_the_lock_is_let_go(
    kit_database, assert_lock_held, assert_lock_free
):
    steps = []

    def progress(step):
        assert_lock_held(INDEX_LOCK, using=kit_database)
        steps.append(step)

    assert_lock_free(INDEX_LOCK, using=kit_database)
    rebuild_search_index(progress)
    assert steps == ["drop", "fill", "swap"]
    assert_lock_free(INDEX_LOCK, using=kit_database)


@in_test_transaction
def test_the_assertions_fail_with_the_key_and_the_database(
    kit_database, assert_lock_held, assert_lock_free, advisory_lock_held_elsewhere
):
    with pytest.raises(AssertionError, match=f"'kitapp:nothing' on database '{kit_database}'"):
        assert_lock_held("kitapp:nothing", using=kit_database)
    with advisory_lock_held_elsewhere("kitapp:taken", using=kit_database):
        with pytest.raises(AssertionError, match=r"'kitapp:taken' .* is held"):
            assert_lock_free("kitapp:taken", using=kit_database)


@in_test_transaction
def test_held_elsewhere_shared_lets_the_code_share_but_not_take_the_lock(
    kit_database, advisory_lock_held_elsewhere
):
    if kit_database == "mysql":
        # MySQL and MariaDB have no shared named locks: said at once, not a hang.
        with pytest.raises(AssertionError, match="Shared locks are not supported"):
            with advisory_lock_held_elsewhere("kitapp:catalog", using=kit_database, shared=True):
                pass
        return
    with advisory_lock_held_elsewhere("kitapp:catalog", using=kit_database, shared=True):
        with advisory_lock(
            "kitapp:catalog", using=kit_database, shared=True, wait=False, scope="session"
        ) as reading:
            assert reading
        with advisory_lock(
            "kitapp:catalog", using=kit_database, wait=False, scope="session"
        ) as writing:
            assert not writing


def test_held_elsewhere_works_without_a_test_transaction(using):
    # The suite's own ``using`` fixture: database access with no transaction around the test.
    with testing.held_elsewhere("kitapp:plain", using=using):
        with advisory_lock("kitapp:plain", using=using, wait=False) as handle:
            assert not handle
        testing.assert_lock_held("kitapp:plain", using=using)
    testing.assert_lock_free("kitapp:plain", using=using)
