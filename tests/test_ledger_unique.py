"""At most one success per slot, enforced by the database itself on every backend: a unique
index on (job, slot, a column that is 1 on a succeeded row and NULL on any other).

Whoever writes the second success (the ORM, ``QuerySet.update()``, raw SQL) gets an
``IntegrityError``; the ledger's own code turns the one place where it can meet it (a run's
end, after a success was written by hand meanwhile) into a recorded failure and
``SlotAlreadySucceeded``. Migration 0004 refuses a ledger that already has two successes in a
slot, naming them, before it changes anything.
"""

from __future__ import annotations

import datetime

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError
from django.db import connections

from advisory_lock import JobRun
from advisory_lock import LockLost
from advisory_lock import SlotAlreadySucceeded
from advisory_lock import run_once
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.scheduler import Scheduler
from tests.databases import new_database
from tests.probes import is_free

UTC = datetime.timezone.utc
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
Status = JobRun.Status


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test."""
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def attempt(ledger, number, status, job_name="report", period="2026-11-29"):
    return ledger.create(
        job_name=job_name, period=period, attempt=number, status=status, started_at=NOW
    )


# The database refuses a second success, whoever writes it.


def test_a_second_success_created_through_the_orm_is_refused(ledger):
    attempt(ledger, 1, Status.SUCCEEDED)
    with pytest.raises(IntegrityError):
        attempt(ledger, 2, Status.SUCCEEDED)
    assert ledger.count() == 1


def test_a_second_success_written_by_queryset_update_is_refused(ledger):
    attempt(ledger, 1, Status.SUCCEEDED)
    failed = attempt(ledger, 2, Status.FAILED)
    with pytest.raises(IntegrityError):
        ledger.filter(pk=failed.pk).update(status=Status.SUCCEEDED)
    assert ledger.get(pk=failed.pk).status == Status.FAILED


def test_a_second_success_written_by_raw_sql_is_refused(ledger, using):
    attempt(ledger, 1, Status.SUCCEEDED)
    failed = attempt(ledger, 2, Status.FAILED)
    with pytest.raises(IntegrityError), connections[using].cursor() as cursor:
        cursor.execute("UPDATE job_runs SET status = 'succeeded' WHERE id = %s", [failed.pk])
    assert ledger.get(pk=failed.pk).status == Status.FAILED


def test_failed_and_abandoned_attempts_are_unlimited_beside_one_success(ledger):
    statuses = [Status.FAILED, Status.ABANDONED, Status.FAILED, Status.ABANDONED, Status.FAILED]
    for number, status in enumerate(statuses, 1):
        attempt(ledger, number, status)
    attempt(ledger, 6, Status.SUCCEEDED)
    assert ledger.filter(status=Status.SUCCEEDED).count() == 1
    assert ledger.filter(job_name="report", period="2026-11-29").count() == 6
    assert {run.succeeded for run in ledger.exclude(status=Status.SUCCEEDED)} == {None}


def test_the_same_slot_of_two_jobs_and_two_slots_of_one_job_can_each_succeed(ledger):
    attempt(ledger, 1, Status.SUCCEEDED, job_name="report")
    attempt(ledger, 1, Status.SUCCEEDED, job_name="export")
    attempt(ledger, 1, Status.SUCCEEDED, job_name="report", period="2026-11-30")
    assert ledger.filter(status=Status.SUCCEEDED).count() == 3


# The ledger's own code, where it can meet the refusal.


def test_finish_after_a_success_written_by_hand_records_the_run_failed_and_says_why(ledger):
    first = ledger.claim("report")
    ledger.finish(first, error="Traceback...\nRuntimeError: boom")
    run = ledger.claim("report")
    assert run.attempt == 2
    # Meanwhile, by hand: the failed attempt is declared the slot's success.
    ledger.filter(pk=first.pk).update(status=Status.SUCCEEDED)
    with pytest.raises(SlotAlreadySucceeded, match="already has a succeeded run") as info:
        ledger.finish(run)
    assert isinstance(info.value, LockLost)
    assert f"run {run.pk} (slot {run.period}, attempt 2)" in str(info.value)
    assert f"succeeded run, {first.pk} (attempt 1)" in str(info.value)
    recorded = ledger.get(pk=run.pk)
    assert recorded.status == Status.FAILED and recorded.finished_at is not None
    assert recorded.error == str(info.value)
    assert run.status == Status.FAILED  # the caller's object says what was recorded
    assert is_free("job:report", ledger.db)  # the claim's lock went all the same


def test_run_once_after_a_success_written_by_hand_raises_slot_already_succeeded(ledger, using):
    with pytest.raises(RuntimeError), run_once("nightly", using=using):
        raise RuntimeError("boom")
    first = ledger.get(job_name="nightly")
    with pytest.raises(SlotAlreadySucceeded), run_once("nightly", using=using) as run:
        assert run is not None and run.attempt == 2
        ledger.filter(pk=first.pk).update(status=Status.SUCCEEDED)
    assert ledger.get(pk=run.pk).status == Status.FAILED
    assert is_free("job:nightly", using)


def test_a_slot_whose_earlier_attempt_was_marked_succeeded_by_hand_is_not_claimed_again(
    ledger,
):
    first = ledger.claim("report")
    ledger.finish(first, error="RuntimeError: boom")
    second = ledger.claim("report")
    ledger.finish(second, error="RuntimeError: boom again")
    ledger.filter(pk=first.pk).update(status=Status.SUCCEEDED)  # by hand
    run, taken = ledger.claim_slot("report")
    assert run is None and taken.pk == first.pk
    assert ledger.count() == 2


def test_the_scheduler_does_not_run_a_slot_whose_earlier_attempt_was_marked_succeeded(
    ledger, using
):
    entry = Entry(name="report", callable="tests.schedule_jobs.tick", every=3600, retries=2)
    period = entry.slot_name(next(entry.slots_before(NOW)))
    attempt(ledger, 1, Status.FAILED, period=period)
    attempt(ledger, 2, Status.FAILED, period=period)
    scheduler = Scheduler({"report": entry}, using=using)
    assert scheduler.due_slots(entry, NOW) == [period]  # its latest attempt failed: retried
    ledger.filter(attempt=1).update(status=Status.SUCCEEDED)  # by hand
    assert Scheduler({"report": entry}, using=using).due_slots(entry, NOW) == []


@pytest.mark.django_db
def test_the_admin_offers_no_edit_of_a_run_even_to_a_superuser(client):
    failed = JobRun.objects.create(
        job_name="report", period="2026-11-29", status=Status.FAILED, started_at=NOW
    )
    client.force_login(User.objects.create_superuser("root", password="pw"))
    change = f"/admin/advisory_lock/jobrun/{failed.pk}/change/"
    assert 'name="_save"' not in client.get(change).content.decode()
    response = client.post(change, {"status": "succeeded", "_save": "Save"})
    assert response.status_code == 403
    assert JobRun.objects.get(pk=failed.pk).status == Status.FAILED


# Migration 0004: a ledger with two successes in a slot is refused, unchanged.

ALIAS = "premigrated"


@pytest.fixture
def at_0003(using, tmp_path):
    """A new database, migrated up to 0003 (before the index), as the alias ALIAS."""
    with new_database(using, tmp_path) as (settings_dict, _):
        connections.settings[ALIAS] = settings_dict
        try:
            call_command("migrate", "advisory_lock", "0003", database=ALIAS, verbosity=0)
            yield connections[ALIAS]
        finally:
            connections[ALIAS].close()
            del connections[ALIAS]
            del connections.settings[ALIAS]


def insert(connection, job_name, period, status, number):
    """A row written as a 0003 ledger holds it (the model of today has one more column)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO job_runs (job_name, period, status, started_at, host, attempt, error,"
            " lock_key) VALUES (%s, %s, %s, '2026-11-29 03:00:00', 'web-1', %s, '', '')",
            [job_name, period, status, number],
        )
        cursor.execute("SELECT MAX(id) FROM job_runs")
        return cursor.fetchone()[0]


def table_state(connection):
    """The ledger table's columns, constraints and rows, and the app's applied migrations."""
    introspection = connection.introspection
    with connection.cursor() as cursor:
        columns = [
            column.name for column in introspection.get_table_description(cursor, "job_runs")
        ]
        constraints = set(introspection.get_constraints(cursor, "job_runs"))
        cursor.execute("SELECT id, job_name, period, status, attempt FROM job_runs ORDER BY id")
        rows = [tuple(row) for row in cursor.fetchall()]
        cursor.execute("SELECT name FROM django_migrations WHERE app = 'advisory_lock'")
        applied = {name for (name,) in cursor.fetchall()}
    return columns, constraints, rows, applied


def test_migration_0004_refuses_two_successes_in_a_slot_and_changes_nothing(at_0003):
    first = insert(at_0003, "report", "2026-11-29", "succeeded", 1)
    insert(at_0003, "report", "2026-11-29", "failed", 2)
    second = insert(at_0003, "report", "2026-11-29", "succeeded", 3)
    insert(at_0003, "report", "2026-11-30", "succeeded", 1)  # one success: fine
    insert(at_0003, "export", "2026-11-29", "succeeded", 1)
    before = table_state(at_0003)
    assert "succeeded" not in before[0] and "0004_one_success_per_slot" not in before[3]

    with pytest.raises(CommandError) as info:
        call_command("migrate", "advisory_lock", database=ALIAS, verbosity=0)
    message = str(info.value)
    assert f"job 'report', slot '2026-11-29': succeeded runs (id) {first}, {second}" in message
    assert "1 slot(s)" in message and "Nothing was changed" in message
    assert "2026-11-30" not in message and "export" not in message
    assert "mark the others abandoned" in message and f"migrate --database {ALIAS}" in message
    # No column, no index, no row changed, not recorded as applied: on MariaDB too, whose DDL
    # would have committed at once.
    assert table_state(at_0003) == before


def test_migration_0004_runs_once_the_extra_success_is_resolved(at_0003):
    insert(at_0003, "report", "2026-11-29", "succeeded", 1)
    second = insert(at_0003, "report", "2026-11-29", "succeeded", 2)
    with pytest.raises(CommandError):
        call_command("migrate", "advisory_lock", database=ALIAS, verbosity=0)
    with at_0003.cursor() as cursor:
        cursor.execute("UPDATE job_runs SET status = 'abandoned' WHERE id = %s", [second])
    call_command("migrate", "advisory_lock", database=ALIAS, verbosity=0)
    columns, constraints, rows, applied = table_state(at_0003)
    assert "succeeded" in columns and "job_runs_one_success_per_slot" in constraints
    assert "0004_one_success_per_slot" in applied
    assert [row[3] for row in rows] == ["succeeded", "abandoned"]  # no data changed
    with pytest.raises(IntegrityError), at_0003.cursor() as cursor:
        cursor.execute("UPDATE job_runs SET status = 'succeeded' WHERE id = %s", [second])


@pytest.mark.django_db(databases="__all__")
def test_the_migrations_match_the_models():
    call_command("makemigrations", "advisory_lock", "--check", "--dry-run", verbosity=0)
