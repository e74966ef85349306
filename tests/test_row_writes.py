"""The ledger's claim INSERT and fenced end UPDATE, built without the query compiler
(``advisory_lock.row_writes``), write what the ORM wrote, on every backend.

Each is one statement; the row comes back as ``QuerySet.create()`` returned it (saved, on its
database, its generated column None), and the fenced UPDATE writes only while the row's
status is the one asked for: every status is tried.
"""

from __future__ import annotations

import datetime

import pytest
from django.db import IntegrityError
from django.db import connections
from django.test.utils import CaptureQueriesContext

from advisory_lock import JobRun
from advisory_lock.row_writes import insert_row
from advisory_lock.row_writes import update_row_while

Status = JobRun.Status
STARTED = datetime.datetime(2026, 12, 6, 23, 0, 0, 123456, tzinfo=datetime.timezone.utc)


def claim(using: str, **values: object) -> JobRun:
    fields = {
        "job_name": "report",
        "period": "2026-12-06T23:00",
        "attempt": 1,
        "status": Status.RUNNING,
        "started_at": STARTED,
        "host": "web-1",
        "pid": 4242,
        "lock_key": "app:schedule:report",
        **values,
    }
    with CaptureQueriesContext(connections[using]) as queries:
        run = insert_row(JobRun, using, **fields)
    assert len(queries.captured_queries) == 1
    return run


def columns(run: JobRun) -> dict[str, object]:
    return {field.name: getattr(run, field.name) for field in JobRun._meta.concrete_fields}


def test_a_claim_inserts_the_row_the_orm_would_and_returns_it_saved(using, ledger):
    run = claim(using)
    stored = ledger.get(pk=run.pk)
    assert columns(run) == {**columns(stored), "succeeded": None}
    assert stored.succeeded is None  # generated: NULL while it has not succeeded
    assert (run.error, run.task_id, run.finished_at, run.duration) == ("", "", None, None)
    # Saved, on its database: a save() updates the row instead of inserting another.
    assert run._state.adding is False and run._state.db == using
    run.host = "web-2"
    run.save(update_fields=["host"])
    assert ledger.get(pk=run.pk).host == "web-2"
    assert ledger.count() == 1


def test_a_second_claim_of_the_same_attempt_is_refused(using, ledger):
    claim(using)
    with pytest.raises(IntegrityError):
        claim(using)
    assert ledger.count() == 1


@pytest.mark.parametrize("status", list(Status))
def test_an_end_writes_only_while_the_row_has_the_status_asked_for(using, ledger, status):
    run = claim(using)
    ledger.filter(pk=run.pk).update(status=status)
    finished = STARTED + datetime.timedelta(seconds=3, microseconds=250)
    end = {
        "status": Status.SUCCEEDED.value,
        "error": "",
        "finished_at": finished,
        "duration": finished - STARTED,
    }
    with CaptureQueriesContext(connections[using]) as queries:
        updated = update_row_while(JobRun, using, run.pk, "status", Status.RUNNING.value, **end)
    assert len(queries.captured_queries) == 1
    stored = ledger.get(pk=run.pk)
    if status == Status.RUNNING:
        assert updated == 1
        assert (stored.status, stored.finished_at, stored.duration) == (
            Status.SUCCEEDED,
            finished,
            finished - STARTED,
        )
        assert stored.succeeded == 1
    else:
        assert updated == 0
        assert (stored.status, stored.finished_at) == (status, None)


def test_a_second_success_of_a_slot_is_refused_by_the_database(using, ledger):
    first, second = claim(using), claim(using, attempt=2)
    succeed = {"status": Status.SUCCEEDED.value}
    assert update_row_while(JobRun, using, first.pk, "status", Status.RUNNING.value, **succeed)
    with pytest.raises(IntegrityError):
        update_row_while(JobRun, using, second.pk, "status", Status.RUNNING.value, **succeed)
