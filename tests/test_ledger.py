"""The job_runs ledger: claims, run_once, periods, abandoned runs, failover."""

from __future__ import annotations

import datetime
import zoneinfo

import pytest
from django.core.management import call_command
from django.db import connections
from django.db import transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from advisory_lock import JobRun
from advisory_lock import LockLost
from advisory_lock import advisory_lock
from advisory_lock import run_once
from advisory_lock.keys import make_key
from advisory_lock.ledger import _claim
from advisory_lock.ledger import finish as record_end
from advisory_lock.periods import slot
from tests.commands import finish
from tests.commands import start
from tests.commands import wait_for_line
from tests.probes import freed
from tests.probes import in_other_connection

UTC = datetime.timezone.utc


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test."""
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def test_claim_takes_a_free_slot_once(ledger):
    run = ledger.claim("report", period="daily")
    assert run is not None and run.status == JobRun.Status.RUNNING and run.attempt == 1
    assert run.period == f"{run.started_at:%Y-%m-%d}"
    assert run.lock_key == "tests:job:report"  # a bare claim holds job:<name> until finish()
    assert ledger.claim("report", period="daily") is None
    ledger.finish(run)


def test_a_succeeded_slot_is_never_claimed_again(ledger):
    run = ledger.claim("report")
    ledger.finish(run)
    run.refresh_from_db(using=ledger.db)
    assert run.status == JobRun.Status.SUCCEEDED and run.duration is not None
    assert ledger.claim("report") is None
    assert ledger.claim("report", retry_failed=True) is None


def test_a_failed_slot_is_claimed_again_unless_retry_failed_is_false(ledger):
    first = ledger.claim("report")
    ledger.finish(first, error="Traceback...\nRuntimeError: boom")
    assert ledger.claim("report", retry_failed=False) is None
    again = ledger.claim("report")
    assert again.attempt == 2 and again.status == JobRun.Status.RUNNING and again.error == ""
    # Each attempt is a row of its own; its id, the fence, grows with every claim.
    assert again.fence > first.fence and ledger.get(pk=first.pk).status == "failed"
    ledger.finish(again)


def test_finish_releases_the_claims_lock_by_a_statement_before_closing_its_connection(
    ledger, using
):
    # A server drops a closed connection's lock only once it has noticed the close: a claim
    # right after finish() could find it still held (it did, once, on a loaded CI run). So
    # finish() unlocks on the lock's own connection first: one statement there. (SQLite's
    # lock is a file lock of this process, let go of when the file is closed: no statement.)
    run = ledger.claim("report")
    lock = run.claimed_lock
    with CaptureQueriesContext(lock.connection) as statements:
        ledger.finish(run, error="boom")
    unlocks = [q["sql"] for q in statements if "unlock" in q["sql"] or "RELEASE_LOCK" in q["sql"]]
    assert len(unlocks) == len(statements) == (0 if using == "default" else 1)
    assert lock.connection.connection is None  # and then closed
    again = ledger.claim("report")  # at once: no wait for the server
    assert again.attempt == 2
    ledger.finish(again)


def test_claim_commits_at_once_even_if_the_callers_transaction_rolls_back(ledger, using):
    runs = []
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=using):
        runs.append(ledger.claim("in-tx"))
        1 / 0  # noqa: B018
    assert ledger.filter(job_name="in-tx").count() == 1
    ledger.finish(runs[0])


def test_a_refused_claim_does_not_poison_the_callers_transaction(ledger, using):
    run = ledger.claim("taken")
    with transaction.atomic(using=using):
        assert ledger.claim("taken") is None
        assert ledger.filter(job_name="taken").count() == 1  # the transaction still works
    ledger.finish(run)


def test_the_claim_is_one_insert_and_a_taken_slot_is_refused_by_the_constraint(ledger, using):
    # Run in this thread (claim() runs it on a connection of its own) to see its statements.
    connection = connections[using]
    held = make_key("job:one-insert")
    with CaptureQueriesContext(connection) as first:
        run, taken = _claim(using, "one-insert", "daily", False, held)
    assert run is not None and taken is None
    assert [q["sql"].split()[0].upper() for q in first if "job_runs" in q["sql"]] == ["INSERT"]
    # The second INSERT fails on the unique constraint (MySQLdb then reports the previous
    # statement's text to Django's log, so it is not counted here).
    from tests.test_locks import held_elsewhere

    with held_elsewhere("job:one-insert", using):  # the first run's owner lives
        run, taken = _claim(using, "one-insert", "daily", False, make_key("job:other"))
    assert run is None and taken.status == JobRun.Status.RUNNING
    assert ledger.filter(job_name="one-insert").count() == 1


def test_run_once_records_success_and_skips_a_done_slot(ledger, using):
    calls = []

    @run_once("nightly", period="daily", using=using)
    def nightly():
        calls.append(1)
        return "done"

    assert nightly() == "done"
    assert nightly() is None
    assert calls == [1]
    run = ledger.get(job_name="nightly")
    assert run.status == JobRun.Status.SUCCEEDED and run.finished_at >= run.started_at


def test_run_once_records_the_traceback_of_a_failure_and_reraises(ledger, using):
    with pytest.raises(RuntimeError, match="boom"):
        with run_once("fragile", using=using) as run:
            assert run is not None
            raise RuntimeError("boom")
    failed = ledger.get(job_name="fragile")
    assert failed.status == JobRun.Status.FAILED
    assert "RuntimeError: boom" in failed.error and "Traceback" in failed.error


def test_run_once_yields_none_while_another_instance_runs_the_job(ledger, using):
    def try_meanwhile():
        with run_once("busy-job", using=using) as run:
            return run

    with run_once("busy-job", using=using) as run:
        assert run is not None
        assert in_other_connection(try_meanwhile) is None


def test_an_orphaned_running_row_is_abandoned_and_reclaimed(ledger, using):
    # The owner died: its row says running, and its lock (job:<name>) is free.
    ledger.create(
        job_name="orphan",
        period=slot("daily", datetime.datetime.now(UTC)),
        started_at=datetime.datetime.now(UTC),
        lock_key="tests:job:orphan",  # the identity of the key "job:orphan"
    )
    with run_once("orphan", using=using) as run:
        assert run is not None and run.attempt == 2
    statuses = (
        ledger.filter(job_name="orphan").order_by("attempt").values_list("status", flat=True)
    )
    assert list(statuses) == [JobRun.Status.ABANDONED, JobRun.Status.SUCCEEDED]


def test_mark_abandoned_spares_rows_whose_owner_still_holds_the_lock(ledger, using):
    now = datetime.datetime.now(UTC)
    ledger.create(job_name="dead", period="p", started_at=now, lock_key="tests:job:dead")
    ledger.create(job_name="alive", period="p", started_at=now, lock_key="tests:job:alive")
    # A row from before locks were recorded: only --force can end it.
    ledger.create(job_name="unknown", period="p", started_at=now)
    with advisory_lock("job:alive", using=using):
        assert ledger.mark_abandoned() == 1
    statuses = dict(ledger.values_list("job_name", "status"))
    assert statuses == {"dead": "abandoned", "alive": "running", "unknown": "running"}


# Bad input: a clear error before any SQL, and no row.


@pytest.mark.parametrize(
    ("job_name", "period", "error"),
    [
        ("", "daily", ValueError),
        ("   ", "daily", ValueError),
        ("x" * 201, "daily", ValueError),
        (None, "daily", TypeError),
        ("job", "fortnightly", ValueError),
        ("job", "", ValueError),
        ("job", 7, TypeError),
        ("job", lambda now: 42, ValueError),
        ("job", lambda now: "", ValueError),
        ("job", lambda now: "x" * 65, ValueError),
    ],
)
def test_bad_job_names_and_periods_are_refused(ledger, job_name, period, error):
    with pytest.raises(error):
        ledger.claim(job_name, period=period)
    assert ledger.count() == 0


def test_run_once_refuses_bad_arguments_at_once():
    with pytest.raises(ValueError, match="period"):
        run_once("job", period="yearly")
    with pytest.raises(TypeError):
        run_once("job", using=1)


# Periods, from the database server's clock, in the ledger's time zone.


def at(text):
    return datetime.datetime.fromisoformat(text)


@pytest.mark.parametrize(
    ("period", "moment", "expected"),
    [
        ("once", "2026-11-29T13:05:00+00:00", "once"),
        ("hourly", "2026-11-29T13:05:00+00:00", "2026-11-29T13"),
        ("daily", "2026-11-29T23:59:59+00:00", "2026-11-29"),
        ("daily", "2026-11-30T00:00:00+00:00", "2026-11-30"),
        ("weekly", "2026-11-29T13:05:00+00:00", "2026-W48"),
        ("weekly", "2026-12-31T12:00:00+00:00", "2026-W53"),
        ("monthly", "2026-11-30T23:59:59+00:00", "2026-11"),
        ("monthly", "2026-12-01T00:00:00+00:00", "2026-12"),
    ],
)
def test_slots_in_utc(period, moment, expected):
    assert slot(period, at(moment)) == expected


@override_settings(ADVISORY_LOCK={"LEDGER_TIME_ZONE": "Europe/Paris"})
def test_midnight_is_the_ledger_time_zones_midnight():
    assert slot("daily", at("2026-11-29T22:59:59+00:00")) == "2026-11-29"
    assert slot("daily", at("2026-11-29T23:00:00+00:00")) == "2026-11-30"


@override_settings(ADVISORY_LOCK={"LEDGER_TIME_ZONE": "America/New_York"})
def test_the_hour_repeated_when_dst_ends_is_two_slots():
    first = slot("hourly", at("2026-11-01T05:30:00+00:00"))  # 01:30 EDT
    second = slot("hourly", at("2026-11-01T06:30:00+00:00"))  # 01:30 EST
    assert first == "2026-11-01T01" and second == "2026-11-01T01-0500"
    assert slot("daily", at("2026-11-01T05:30:00+00:00")) == "2026-11-01"
    assert slot("daily", at("2026-11-02T04:59:59+00:00")) == "2026-11-01"  # a 25-hour day


@override_settings(ADVISORY_LOCK={"LEDGER_TIME_ZONE": "America/New_York"})
def test_the_hour_skipped_when_dst_starts_is_no_slot():
    assert slot("hourly", at("2026-03-08T06:59:00+00:00")) == "2026-03-08T01"
    assert slot("hourly", at("2026-03-08T07:00:00+00:00")) == "2026-03-08T03"


def test_a_callable_period_gets_the_time_in_the_ledger_time_zone():
    seen = []
    with override_settings(ADVISORY_LOCK={"LEDGER_TIME_ZONE": "Asia/Tokyo"}):
        assert slot(lambda now: seen.append(now) or "q4", at("2026-11-29T20:00:00+00:00")) == "q4"
    assert seen[0].tzinfo == zoneinfo.ZoneInfo("Asia/Tokyo") and seen[0].day == 30


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_slots_come_from_the_database_servers_clock_not_the_hosts(ledger, using):
    # MySQL's SET TIMESTAMP moves NOW()/UTC_TIMESTAMP() for a session: a server clock 10 days
    # ahead of this host must give the server's day.
    options = connections.settings[using].setdefault("OPTIONS", {})
    ahead = datetime.datetime.now(UTC) + datetime.timedelta(days=10)
    options["init_command"] = f"SET TIMESTAMP = {int(ahead.timestamp())}"
    try:
        run = ledger.claim("skewed")
    finally:
        del options["init_command"]
    assert run.period == f"{ahead:%Y-%m-%d}"
    ledger.finish(run)


# @single_instance(ledger=...): lock and ledger together, across a failover.


def test_ledger_command_runs_once_per_slot_even_after_the_lock_is_dropped(ledger, using):
    status, out, _ = finish(start(using, "ledger_job"))
    assert status == 0 and "finished" in out
    # A new lock (the old holder's connection is long gone): the slot is still done.
    status, out, err = finish(start(using, "ledger_job"))
    assert status == 3 and "finished" not in out
    assert "slot" in err and "already done" in err
    assert ledger.get(job_name="lockapp.ledger_job").status == JobRun.Status.SUCCEEDED


def test_a_killed_ledger_command_is_abandoned_and_the_next_instance_runs(ledger, using, tmp_path):
    holder = start(using, "ledger_job", "--until", str(tmp_path / "never"))
    wait_for_line(holder, "running")
    holder.kill()
    finish(holder)
    assert ledger.get(job_name="lockapp.ledger_job").status == JobRun.Status.RUNNING
    # The server frees a killed client's lock once it has noticed its connection is gone,
    # a moment after the process is reaped: until then the next instance would find it busy.
    assert freed("command:lockapp.ledger_job", using)
    status, out, err = finish(start(using, "ledger_job"))
    assert status == 0 and "finished" in out, err
    run = ledger.filter(job_name="lockapp.ledger_job").latest("attempt")
    assert run.status == JobRun.Status.SUCCEEDED and run.attempt == 2
    assert ledger.get(attempt=1).status == JobRun.Status.ABANDONED


def test_a_failed_ledger_command_records_the_traceback(ledger, using):
    status, _, err = finish(start(using, "ledger_job", "--fail"))
    assert status == 1 and "failed on purpose" in err
    run = ledger.get(job_name="lockapp.ledger_job")
    assert (
        run.status == JobRun.Status.FAILED
        and "RuntimeError: the job failed on purpose" in run.error
    )


# manage.py job_runs


def test_job_runs_command_lists_filters_and_prunes(ledger, using, capsys):
    old = datetime.datetime.now(UTC) - datetime.timedelta(days=40)
    a_day = datetime.timedelta(days=1)
    ledger.create(job_name="a", period="0", started_at=old - a_day, status="succeeded")
    ledger.create(job_name="a", period="1", started_at=old, status="succeeded")
    ledger.create(job_name="a", period="2", started_at=old, status="running")
    ledger.create(job_name="b", period="1", started_at=datetime.datetime.now(UTC), status="failed")
    call_command("job_runs", "--database", using, "--job", "a")
    listing = capsys.readouterr().out
    assert listing.count("\na ") == 3 and "\nb " not in listing
    call_command("job_runs", "--database", using, "--status", "failed")
    assert "\nb " in capsys.readouterr().out
    call_command("job_runs", "--database", using, "--prune", "--older-than", "30")
    assert "Pruned 1 " in capsys.readouterr().out  # a's older success; its latest one stays
    assert sorted(ledger.values_list("job_name", "period", "status")) == [
        ("a", "1", "succeeded"),
        ("a", "2", "running"),
        ("b", "1", "failed"),
    ]


@pytest.mark.parametrize(
    "argv",
    [["--prune"], ["--older-than", "3"], ["--prune", "--older-than", "0"], ["--limit", "x"]],
)
def test_job_runs_command_refuses_bad_options(argv):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError):
        call_command("job_runs", *argv)


def test_a_failure_whose_message_the_database_cant_store_is_recorded_escaped(ledger, using):
    # Regression: PostgreSQL's text refuses NUL, and no driver encodes a lone surrogate: the
    # failure's traceback was written as it was, the UPDATE failed, and the run stayed running.
    with pytest.raises(ValueError, match="bad"):
        with run_once("unstorable-error", period="once", using=using):
            raise ValueError("bad \x00 byte, and \udcff")
    [run] = ledger.filter(job_name="unstorable-error")
    assert run.status == JobRun.Status.FAILED
    assert "ValueError: bad \\x00 byte, and \\udcff" in run.error


#: Every end that ``finish()`` records: (keyword arguments, the status recorded).
ENDS = {
    "succeeded": ({}, JobRun.Status.SUCCEEDED),
    "failed": ({"error": "Traceback...\nRuntimeError: boom \x00 \udcff"}, JobRun.Status.FAILED),
    "enqueued": ({"task_id": "task-42"}, JobRun.Status.ENQUEUED),
    "refused-success": ({}, JobRun.Status.FAILED),
}
#: The fields that an end writes (``task_id`` for an enqueue).
END_FIELDS = ["status", "error", "finished_at", "duration", "task_id"]


def test_ends_cover_every_status_a_run_ends_with():
    ended = {status for _, status in ENDS.values()}
    # A run starts running; abandoned is a claim's word on someone else's run.
    assert ended == set(JobRun.Status) - {JobRun.Status.RUNNING, JobRun.Status.ABANDONED}


@pytest.mark.parametrize("end", ENDS)
def test_the_ended_run_in_memory_is_the_row_without_reading_it_back(ledger, using, end):
    """The end is the UPDATE alone (and the database's clock): the caller's run object gets
    the values written, which are those the row holds, for every end."""
    kwargs, status = ENDS[end]
    if end == "refused-success":
        earlier = ledger.claim("report")
        ledger.finish(earlier, error="boom")
    run = ledger.claim("report")
    if end == "refused-success":
        ledger.filter(pk=earlier.pk).update(status=JobRun.Status.SUCCEEDED)  # by hand
    connection = connections[using]
    with override_settings(ADVISORY_LOCK={"LEDGER_IN_CALLERS_TRANSACTION": True}):
        with CaptureQueriesContext(connection) as statements:
            try:
                record_end(using, run, **kwargs)
            except LockLost:
                assert end == "refused-success"
    row = ledger.get(pk=run.pk)
    assert row.status == status
    assert {f: getattr(run, f) for f in END_FIELDS} == {f: getattr(row, f) for f in END_FIELDS}
    ledger_statements = [q["sql"] for q in statements if "job_runs" in q["sql"]]
    # Nothing read after the last write. (The refused success: the refused UPDATE, whose
    # text MySQLdb reports as the previous statement's, the success's row, the failed one.)
    assert ledger_statements[-1].split()[0] == "UPDATE"
    if end != "refused-success":
        assert [sql.split()[0] for sql in ledger_statements] == ["UPDATE"]
