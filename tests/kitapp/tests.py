"""The app's tests, written with Django's TestCase and advisory_lock.testing.

``KitTests`` runs on the "default" database; its subclasses run the same tests as if the
project's database were PostgreSQL or MariaDB (``KITAPP_DATABASE``, and the command's
``lock_using`` where ``@single_instance(using=...)`` would put it).
"""

from __future__ import annotations

from io import StringIO
from unittest import mock
from unittest import skipUnless

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import TestCase
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from advisory_lock.testing import assert_lock_free
from advisory_lock.testing import assert_lock_held
from advisory_lock.testing import held_elsewhere
from advisory_lock.testing import isolated_ledger
from tests.kitapp.jobs import INDEX_LOCK
from tests.kitapp.jobs import nightly_report
from tests.kitapp.jobs import rebuild_search_index
from tests.kitapp.management.commands import send_digest
from tests.kitapp.models import Report
from tests.kitapp.views import PRICES_LOCK

TEST_TRANSACTION_LOCK = "kitapp.test-transaction"


@isolated_ledger
@override_settings(ROOT_URLCONF="tests.kitapp.urls")
class KitTests(TestCase):
    databases = {"default"}
    using = "default"

    def runs(self):
        return JobRun.objects.using(self.using)

    # The ledger: a job run twice in a test runs once; the next test starts afresh. The
    # numbers fix the order (unittest sorts a class's tests by name).

    # Regression: with isolated_ledger the second claim raised TransactionManagementError
    # instead of being skipped (the refused INSERT broke the test's transaction).
    def test_1_a_job_run_twice_in_one_test_is_skipped_the_second_time(self):
        self.assertIsNotNone(nightly_report())
        self.assertIsNone(nightly_report())
        call_command("send_digest", stdout=StringIO())
        with self.assertRaisesMessage(CommandError, "already done"):
            call_command("send_digest", stdout=StringIO(), stderr=StringIO())
        self.assertEqual(
            sorted(self.runs().values_list("job_name", "status")),
            [("kitapp.nightly_report", "succeeded"), ("kitapp.send_digest", "succeeded")],
        )

    def test_2_the_next_test_starts_with_an_empty_ledger(self):
        self.assertFalse(self.runs().exists())
        self.assertFalse(Report.objects.using(self.using).exists())
        self.assertIsNotNone(nightly_report())
        call_command("send_digest", stdout=StringIO())

    # Regression: a transaction-scoped lock taken in a test was still held in the next test
    # on MariaDB and SQLite (the test's transaction rolls back, and Django runs no hook on a
    # rollback); isolated_ledger on the class releases it after each test.

    def test_3_a_lock_taken_in_the_test_transaction_is_held_to_its_end(self):
        with advisory_lock(TEST_TRANSACTION_LOCK, using=self.using, scope="transaction"):
            pass
        assert_lock_held(TEST_TRANSACTION_LOCK, using=self.using)

    def test_4_the_next_test_finds_it_free(self):
        assert_lock_free(TEST_TRANSACTION_LOCK, using=self.using)

    # Locks: busy elsewhere, held while the code works, free once it is done.

    def test_prices_are_not_refreshed_while_another_process_refreshes_them(self):
        with held_elsewhere(PRICES_LOCK, using=self.using):
            response = self.client.post("/prices/refresh/")
        self.assertEqual(response.status_code, 409)
        self.assertEqual(self.client.post("/prices/refresh/").status_code, 200)
        assert_lock_free(PRICES_LOCK, using=self.using)

    def test_the_index_is_rebuilt_under_its_lock_and_the_lock_is_let_go(self):
        steps = []

        def progress(step):
            assert_lock_held(INDEX_LOCK, using=self.using)
            steps.append(step)

        rebuild_search_index(progress)
        self.assertEqual(steps, ["drop", "fill", "swap"])
        assert_lock_free(INDEX_LOCK, using=self.using)

    def test_a_lock_held_elsewhere_is_held_for_the_block_only(self):
        with held_elsewhere(INDEX_LOCK, using=self.using):
            assert_lock_held(INDEX_LOCK, using=self.using)
        assert_lock_free(INDEX_LOCK, using=self.using)


@skipUnless("postgresql" in settings.DATABASES, "no PostgreSQL server")
@override_settings(KITAPP_DATABASE="postgresql")
@mock.patch.object(send_digest.Command, "lock_using", "postgresql")
class KitTestsOnPostgreSQL(KitTests):
    databases = {"postgresql"}
    using = "postgresql"


@skipUnless("mysql" in settings.DATABASES, "no MariaDB/MySQL server")
@override_settings(KITAPP_DATABASE="mysql")
@mock.patch.object(send_digest.Command, "lock_using", "mysql")
class KitTestsOnMariaDB(KitTests):
    databases = {"mysql"}
    using = "mysql"
