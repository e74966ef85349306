"""``job_runs --prune --older-than DAYS`` (issue 19, items 3 and 11).

Pruning deletes old finished runs, but never a row the ledger still needs: a slot that can
still be claimed keeps its first and latest attempts (so that it is neither claimed again
nor given more attempts than its retries), each job keeps its latest success, and every
declared job keeps the successes the overdue report reads. The age is measured by the
database server's clock, like every other time of the ledger. The clock is set per backend
with ``database_clock`` (tests/test_overdue.py).
"""

from __future__ import annotations

import datetime
import json
from io import StringIO

import pytest
from django.core.management import call_command

from advisory_lock import JobRun
from advisory_lock.schedule import _entry
from advisory_lock.scheduling.scheduler import Scheduler
from tests.test_overdue import PARIS
from tests.test_overdue import at
from tests.test_overdue import database_clock
from tests.test_overdue import lock_settings
from tests.test_overdue import report

UTC = datetime.timezone.utc
SUCCEEDED, FAILED = JobRun.Status.SUCCEEDED, JobRun.Status.FAILED
#: Sunday 29 November 2026, noon UTC: the last day of ISO week 2026-W48 (from Monday the 23rd).
#: The tests' instants are in the past, so that the host's clock finds the rows as old too.
SUNDAY = at("2026-11-29T12:00+00:00")


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test."""
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def row(ledger, job_name, slot, started, status=SUCCEEDED, attempt=1):
    """A finished run of ``slot`` that started at ``started`` and took a minute."""
    started = at(started) if isinstance(started, str) else started
    return ledger.create(
        job_name=job_name, period=slot, status=status, attempt=attempt, started_at=started,
        finished_at=started + datetime.timedelta(minutes=1),
        duration=datetime.timedelta(minutes=1), host="worker-1",
    )  # fmt: skip


def prune(using, days) -> str:
    out = StringIO()
    call_command("job_runs", "--database", using, "--prune", "--older-than", str(days), stdout=out)
    return out.getvalue()


def claim_again(ledger, job_name, period):
    """Try to claim the job's current slot, as the next instance would; the run (finished at
    once) or None."""
    run = ledger.claim(job_name, period=period)
    if run is not None:
        ledger.finish(run)
    return run


def slots(ledger, job_name):
    return sorted(ledger.filter(job_name=job_name).values_list("period", "attempt"))


# Item 3: a slot that can still be claimed keeps its rows, so it is not run again.


def quarter(now):
    return f"{now.year}-Q{(now.month - 1) // 3 + 1}"


@pytest.mark.parametrize(
    ("period", "clock", "done", "old_slot", "days", "zone"),
    [
        # A once job's slot lives for ever: its success is 400 days old.
        ("once", SUNDAY, "2025-11-01T03:00+00:00", None, 30, "UTC"),
        # The week's success on Monday is 6.4 days old on Sunday: older than 5 days.
        ("weekly", SUNDAY, "2026-11-23T01:00+00:00", "2026-W46", 5, "UTC"),
        ("monthly", SUNDAY, "2026-11-01T00:30+00:00", "2026-09", 20, "UTC"),
        # A callable period: prune can't compute its slots, the job's newest slot is kept.
        (quarter, SUNDAY, "2026-10-02T00:30+00:00", "2026-Q3", 30, "UTC"),
        # 25 October 2026 in Paris lasts 25 hours: at 23:30 its success at 00:10 is a day old.
        ("daily", at("2026-10-25T22:30+00:00"), "2026-10-24T22:10+00:00", "2026-10-23", 1, PARIS),
    ],
    ids=["once", "weekly", "monthly", "callable", "daily-25-hours"],
)  # fmt: skip
def test_prune_never_re_arms_a_slot_that_already_succeeded(
    ledger, using, period, clock, done, old_slot, days, zone
):
    job = "example.job"
    with lock_settings(LEDGER_TIME_ZONE=zone), database_clock(using, clock):
        from advisory_lock.periods import slot

        current = slot(period, clock)
        if old_slot:  # an older slot's success: prune may delete it
            row(ledger, job, old_slot, at(done) - datetime.timedelta(days=40))
        row(ledger, job, current, done)
        out = prune(using, days)
        assert claim_again(ledger, job, period) is None, "the slot was claimed again"
    assert slots(ledger, job) == [(current, 1)]
    assert f"Pruned {1 if old_slot else 0} finished run(s)" in out


def test_prune_keeps_the_first_and_latest_attempts_of_a_current_scheduled_slot(ledger, using):
    # An entry every 10 days (its current slot began on 23 November), retries 1: both
    # attempts of the current slot failed 6 days ago. Were they deleted, the slot would look
    # new to every scheduler, and run twice more.
    options = {"callable": "tests.schedule_jobs.fail", "every": 10 * 86400, "retries": 1}
    entry = _entry("every-10-days", options)
    scheduler = Scheduler({entry.name: entry}, using=using)
    current = next(entry.slots_before(SUNDAY))
    name = entry.slot_name(current)
    with lock_settings(SCHEDULE={entry.name: options}), database_clock(using, SUNDAY):
        started = SUNDAY - datetime.timedelta(days=6)
        for attempt in (1, 2):
            row(ledger, entry.name, name, started, FAILED, attempt)
        assert started >= current  # the slot is the current one
        prune(using, 5)
        assert scheduler.due_slots(entry, scheduler.now()) == []
    assert slots(ledger, entry.name) == [(name, 1), (name, 2)]


def test_a_catch_up_all_entry_keeps_a_run_of_each_slot_since_its_oldest_kept_run(ledger, using):
    # A daily entry with catch_up "all" last succeeded on 1 October and has failed every day
    # since. Its success is kept (the latest); were the failed slots after it deleted, the
    # scheduler would take them for missed slots and run them all again.
    options = {"callable": "tests.schedule_jobs.fail", "every": 86400, "catch_up": "all"}
    entry = _entry("daily-catch-up", {**options, "retries": 0})
    scheduler = Scheduler({entry.name: entry}, using=using)
    with lock_settings(SCHEDULE={entry.name: options}), database_clock(using, SUNDAY):
        day = at("2026-10-01T00:00+00:00")
        row(ledger, entry.name, entry.slot_name(day), day)
        while (day := day + datetime.timedelta(days=1)) <= SUNDAY:
            row(ledger, entry.name, entry.slot_name(day), day, FAILED)
        out = prune(using, 30)
        assert scheduler.due_slots(entry, scheduler.now()) == []
    assert "Pruned 0 finished run(s)" in out
    assert ledger.filter(job_name=entry.name).count() == 60


def test_prune_keeps_attempt_1_so_that_a_claim_cannot_start_the_slot_over(ledger, using):
    # Three failed attempts of this week's slot, all older than the cutoff: attempt 1 and the
    # latest stay (the claim's first INSERT is attempt 1; the next attempt follows the latest).
    job = "weekly.export"
    with database_clock(using, SUNDAY):
        for attempt, day in ((1, "2026-11-23"), (2, "2026-11-23"), (3, "2026-11-24")):
            row(ledger, job, "2026-W48", f"{day}T0{attempt}:00+00:00", FAILED, attempt)
        out = prune(using, 5)
        run = ledger.claim(job, period="weekly")
        assert run is not None and run.attempt == 4
        ledger.finish(run)
    assert "Pruned 1 finished run(s)" in out
    assert slots(ledger, job) == [("2026-W48", 1), ("2026-W48", 3), ("2026-W48", 4)]


def test_prune_measures_the_age_by_the_database_servers_clock(ledger, using):
    # The database's clock is 40 days ahead of this host's: by it, the run of two days ago
    # (by this host) is 42 days old, and goes; the newer one is the job's latest success.
    host_now = datetime.datetime.now(UTC)
    with database_clock(using, host_now + datetime.timedelta(days=40)):
        two_days_ago = host_now - datetime.timedelta(days=2)
        row(ledger, "daily.report", f"{two_days_ago:%Y-%m-%d}", two_days_ago)
        yesterday = host_now - datetime.timedelta(days=1)
        row(ledger, "daily.report", f"{yesterday:%Y-%m-%d}", yesterday)
        out = prune(using, 30)
    assert "Pruned 1 finished run(s)" in out
    assert slots(ledger, "daily.report") == [(f"{yesterday:%Y-%m-%d}", 1)]


def test_prune_says_how_many_old_runs_it_deleted_and_which_it_kept(ledger, using):
    with database_clock(using, SUNDAY):
        row(ledger, "setup", "once", "2025-01-01T00:00+00:00")
        row(ledger, "weekly.sync", "2026-W40", "2026-09-28T00:00+00:00")
        row(ledger, "weekly.sync", "2026-W41", "2026-10-05T00:00+00:00", FAILED)
        row(ledger, "weekly.sync", "2026-W42", "2026-10-12T00:00+00:00", FAILED)
        out = prune(using, 30)
    assert out == (
        "Pruned 1 finished run(s) older than 30 days (by the database's clock); kept 3 "
        "older run(s) that the ledger still needs: 2 in slots that may still be claimed, "
        "1 latest success(es).\n"
    )
    assert slots(ledger, "weekly.sync") == [("2026-W40", 1), ("2026-W42", 1)]


# Item 11: the overdue report does not depend on rows that pruning deletes.


WEEKLY = {"period": "weekly", "grace": 3600}


def test_a_weekly_job_whose_old_success_was_pruned_is_not_reported_overdue(ledger, using):
    # Wednesday 25 November: last week (W47) is the slot that must have succeeded. "ok" did,
    # on Monday 16 November, 9 days ago; "late" did not (its last success is W46's).
    wednesday = at("2026-11-25T12:00+00:00")
    declared = {"ok.weekly": WEEKLY, "late.weekly": WEEKLY}
    with lock_settings(JOBS=declared), database_clock(using, wednesday):
        row(ledger, "ok.weekly", "2026-W47", "2026-11-16T02:00+00:00")
        row(ledger, "late.weekly", "2026-W45", "2026-11-02T02:00+00:00")
        row(ledger, "late.weekly", "2026-W46", "2026-11-09T02:00+00:00")
        prune(using, 7)
        status, out = report(using, "--json")
    (late,) = json.loads(out)  # the control: "late" is still overdue, "ok" is not
    assert status == 1 and late["job"] == "late.weekly" and late["missing_slot"] == "2026-W47"
    assert late["last_success"]["slot"] == "2026-W46"  # its latest success is kept
    assert slots(ledger, "late.weekly") == [("2026-W46", 1)]


def test_a_weekly_job_keeps_last_weeks_success_after_this_weeks(ledger, using):
    # Sunday of W48: the job succeeded in W47 and in W48, both more than 5 days ago. W48 is
    # its latest success and the current slot; W47 is what the report checks until Monday.
    with lock_settings(JOBS={"sync.weekly": WEEKLY}), database_clock(using, SUNDAY):
        row(ledger, "sync.weekly", "2026-W46", "2026-11-09T02:00+00:00")
        row(ledger, "sync.weekly", "2026-W47", "2026-11-16T02:00+00:00")
        row(ledger, "sync.weekly", "2026-W48", "2026-11-23T02:00+00:00")
        out = prune(using, 5)
        assert report(using) == (0, "No declared job is overdue.\n")
        assert claim_again(ledger, "sync.weekly", "weekly") is None
    assert "Pruned 1 finished run(s)" in out
    assert slots(ledger, "sync.weekly") == [("2026-W47", 1), ("2026-W48", 1)]


def test_a_scheduled_entry_keeps_the_success_its_grace_reaches_back_to(ledger, using):
    # Hourly, with 2 days of grace: the report checks the slot of 48 hours ago; it succeeded,
    # then so did the slot after it, and both are older than the 1 day of the prune.
    schedule = {"poll": {"callable": "os.getcwd", "every": 3600, "grace": 2 * 86400}}
    checked = SUNDAY - datetime.timedelta(days=2)
    with lock_settings(SCHEDULE=schedule), database_clock(using, SUNDAY):
        for hours in (-1, 0, 1):
            moment = checked + datetime.timedelta(hours=hours)
            row(ledger, "poll", f"{moment:%Y-%m-%dT%H:%M}", moment)
        out = prune(using, 1)
        assert report(using) == (0, "No declared job is overdue.\n")
    assert "Pruned 1 finished run(s)" in out
    assert slots(ledger, "poll") == [(f"{checked:%Y-%m-%dT%H:%M}", 1), ("2026-11-27T13:00", 1)]
