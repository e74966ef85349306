"""Overdue jobs: declared in settings and in code, watched by the ledger's clock and time zone.

A job is overdue when the latest slot that ended more than ``grace`` seconds ago, by the
database server's clock in the ledger's time zone, has no succeeded row. The slot arithmetic
is tested with fixed instants (``last_ended_slot``); the report (``job_runs --overdue``, its
JSON, the ``job_overdue`` signal, the admin's box) with the database's clock set to those
instants on each backend (``database_clock``).
"""

from __future__ import annotations

import datetime
import json
from contextlib import contextmanager
from io import StringIO
from unittest import mock

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management import load_command_class
from django.db import connections
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import expectations
from advisory_lock import signals
from advisory_lock import single_instance
from advisory_lock.backends import inspector_for
from advisory_lock.backends.sqlite import SQLiteInspector
from advisory_lock.checks import check_settings

UTC = datetime.timezone.utc
PARIS = "Europe/Paris"
NEW_YORK = "America/New_York"
CHANGELIST = "/admin/advisory_lock/jobrun/"
#: Installed only here: its command declares "overdueapp.nightly_digest" (daily, grace 3600).
WITH_OVERDUEAPP = override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "tests.overdueapp"])


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


def lock_settings(**options):
    """ADVISORY_LOCK with ``options`` on top of the test settings' (the NAMESPACE kept)."""
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, **options})


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test."""
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


@contextmanager
def database_clock(using: str, now: datetime.datetime):
    """The database server's clock reads ``now`` on the connections opened meanwhile.

    MySQL/MariaDB: ``SET TIMESTAMP`` fixes the session's NOW() and UTC_TIMESTAMP().
    PostgreSQL: a schema put before ``pg_catalog`` in the search path holds a
    ``statement_timestamp()`` that reads the session's ``advisory_lock_clock.now``. SQLite has
    no clock of its own (``database_now`` is this host's): the host clock is frozen.
    """
    connection = connections[using]
    options = connections.settings[using].setdefault("OPTIONS", {})
    if connection.vendor == "sqlite":
        with mock.patch.object(SQLiteInspector, "database_now", lambda self: now):
            yield
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("CREATE SCHEMA IF NOT EXISTS advisory_lock_clock")
            cursor.execute(
                "CREATE OR REPLACE FUNCTION advisory_lock_clock.statement_timestamp() "
                "RETURNS timestamptz LANGUAGE sql STABLE AS "
                "$$ SELECT current_setting('advisory_lock_clock.now')::timestamptz $$"
            )
        name, value = (
            "options",
            (
                "-c search_path=advisory_lock_clock,pg_catalog,public "
                f"-c advisory_lock_clock.now={now.astimezone(UTC):%Y-%m-%dT%H:%M:%S.%f}Z"
            ),
        )
    else:
        name, value = "init_command", f"SET TIMESTAMP = {now.timestamp():.6f}"
    connection.close()  # the next statement opens a connection with the clock set
    saved = dict(options)
    if name in options:  # PostgreSQL's -c flags add up; MySQL runs one init_command
        assert name == "options", f"the test settings already have an {name}"
        value = f"{options[name]} {value}"
    options[name] = value
    try:
        clock = inspector_for(connection).database_now()
        assert abs(clock - now) < datetime.timedelta(seconds=1), f"the server says {clock}"
        yield
    finally:
        options.clear()
        options.update(saved)
        connection.close()


def report(using: str, *args: str) -> tuple[int, str]:
    """``manage.py job_runs --overdue --database using *args``: (exit status, output)."""
    out = StringIO()
    try:
        call_command("job_runs", "--overdue", "--database", using, *args, stdout=out)
    except SystemExit as exit:
        return exit.code, out.getvalue()
    return 0, out.getvalue()


def succeeded(ledger, job_name: str, slot: str, *, finished_at=None, host="worker-1"):
    finished_at = finished_at or datetime.datetime(2026, 1, 1, tzinfo=UTC)
    return ledger.create(
        job_name=job_name, period=slot, status=JobRun.Status.SUCCEEDED,
        started_at=finished_at - datetime.timedelta(seconds=5), finished_at=finished_at,
        duration=datetime.timedelta(seconds=5), host=host,
    )  # fmt: skip


# The slot that should have succeeded: last_ended_slot(period, moment), fixed instants.


@pytest.mark.parametrize(
    ("moment", "slot", "ended_at"),
    [
        # 2026-10-25, Paris: 03:00 CEST becomes 02:00 CET, so 02:00-03:00 comes twice.
        ("2026-10-25T00:30+00:00", "2026-10-25T01", "2026-10-25T00:00+00:00"),  # 02:30 CEST
        ("2026-10-25T01:30+00:00", "2026-10-25T02", "2026-10-25T01:00+00:00"),  # 02:30 CET
        ("2026-10-25T02:30+00:00", "2026-10-25T02+0100", "2026-10-25T02:00+00:00"),  # 03:30
        # 2026-03-29, Paris: 02:00 CET becomes 03:00 CEST, there is no 02 hour.
        ("2026-03-29T01:30+00:00", "2026-03-29T01", "2026-03-29T01:00+00:00"),  # 03:30 CEST
    ],
)
def test_hourly_slots_in_paris_count_the_repeated_hour_twice_and_the_skipped_one_never(
    moment, slot, ended_at
):
    with lock_settings(LEDGER_TIME_ZONE=PARIS):
        assert expectations.last_ended_slot("hourly", at(moment)) == (slot, at(ended_at))


@pytest.mark.parametrize(
    ("moment", "slot", "ended_at"),
    [
        # 2026-11-01, New York: 02:00 EDT becomes 01:00 EST.
        ("2026-11-01T06:30+00:00", "2026-11-01T01", "2026-11-01T06:00+00:00"),  # 01:30 EST
        ("2026-11-01T07:30+00:00", "2026-11-01T01-0500", "2026-11-01T07:00+00:00"),  # 02:30
        ("2026-11-01T08:30+00:00", "2026-11-01T02", "2026-11-01T08:00+00:00"),  # 03:30 EST
    ],
)
def test_hourly_slots_in_new_york_name_the_second_01_hour_with_its_offset(moment, slot, ended_at):
    with lock_settings(LEDGER_TIME_ZONE=NEW_YORK):
        assert expectations.last_ended_slot("hourly", at(moment)) == (slot, at(ended_at))


def test_a_day_ends_at_the_ledgers_midnight_not_utcs():
    before_midnight, after_midnight = at("2026-11-28T22:30+00:00"), at("2026-11-28T23:30+00:00")
    with lock_settings(LEDGER_TIME_ZONE=PARIS):  # 23:30 and 00:30 in Paris
        assert expectations.last_ended_slot("daily", before_midnight) == (
            "2026-11-27",
            at("2026-11-27T23:00+00:00"),
        )
        assert expectations.last_ended_slot("daily", after_midnight) == (
            "2026-11-28",
            at("2026-11-28T23:00+00:00"),
        )
    with lock_settings(LEDGER_TIME_ZONE="UTC"):
        assert expectations.last_ended_slot("daily", after_midnight)[0] == "2026-11-27"


def test_the_day_dst_ends_is_25_hours_long():
    with lock_settings(LEDGER_TIME_ZONE=PARIS):
        # 2026-10-25 began at 22:00 UTC (CEST) and ended at 23:00 UTC (CET).
        assert (
            expectations.last_ended_slot("daily", at("2026-10-25T22:30+00:00"))[0] == "2026-10-24"
        )
        assert expectations.last_ended_slot("daily", at("2026-10-25T23:30+00:00")) == (
            "2026-10-25",
            at("2026-10-25T23:00+00:00"),
        )


def test_a_week_ends_at_monday_midnight_in_the_ledgers_zone_after_a_dst_change():
    with lock_settings(LEDGER_TIME_ZONE=NEW_YORK):
        # Week 44 of 2026 holds the end of DST (Sunday 1 November): it ends on Monday
        # 2 November at 00:00 EST, 05:00 UTC; UTC's Monday began five hours earlier.
        sunday_night = at("2026-11-02T04:30+00:00")  # 23:30 EST, Sunday
        assert expectations.last_ended_slot("weekly", sunday_night) == (
            "2026-W43",
            at("2026-10-26T04:00+00:00"),  # Monday 26 October 00:00 EDT
        )
        assert expectations.last_ended_slot("weekly", at("2026-11-02T05:30+00:00")) == (
            "2026-W44",
            at("2026-11-02T05:00+00:00"),
        )
    with lock_settings(LEDGER_TIME_ZONE="UTC"):
        assert expectations.last_ended_slot("weekly", sunday_night)[0] == "2026-W44"


@pytest.mark.parametrize(
    ("zone", "moment", "slot", "ended_at"),
    [
        # October ends at 00:00 CET on 1 November (it began at 00:00 CEST on 1 October).
        (PARIS, "2026-10-31T22:30+00:00", "2026-09", "2026-09-30T22:00+00:00"),
        (PARIS, "2026-10-31T23:30+00:00", "2026-10", "2026-10-31T23:00+00:00"),
        # March ends at 00:00 EDT on 1 April (DST began on 8 March).
        (NEW_YORK, "2026-04-01T03:30+00:00", "2026-02", "2026-03-01T05:00+00:00"),
        (NEW_YORK, "2026-04-01T04:30+00:00", "2026-03", "2026-04-01T04:00+00:00"),
    ],
)
def test_a_month_ends_at_the_first_midnight_of_the_next_in_the_ledgers_zone(
    zone, moment, slot, ended_at
):
    with lock_settings(LEDGER_TIME_ZONE=zone):
        assert expectations.last_ended_slot("monthly", at(moment)) == (slot, at(ended_at))


def test_the_slot_of_a_once_job_never_ends():
    job = expectations.Expectation("setup", "once", 0)
    assert job.latest_slot(at("2030-01-01T00:00+00:00")) is None


# manage.py job_runs --overdue, with the database's clock set.


def test_overdue_across_midnight_in_the_ledgers_time_zone(ledger, using):
    job = "example.nightly_report"
    with lock_settings(LEDGER_TIME_ZONE=PARIS, JOBS={job: {"period": "daily", "grace": 7200}}):
        yesterday = succeeded(ledger, job, "2026-11-27")
        # 00:30 in Paris: the 28th has ended, but its 2 hours of grace have not.
        with database_clock(using, at("2026-11-28T23:30+00:00")):
            assert report(using) == (0, "No declared job is overdue.\n")
        # 02:30 in Paris: the 28th ended more than 2 hours ago without a success.
        with database_clock(using, at("2026-11-29T01:30+00:00")):
            status, out = report(using)
            assert status == 1
            assert job in out and "2026-11-28" in out and "2026-11-27 on worker-1" in out
            (entry,) = json.loads(report(using, "--json")[1])
            assert entry["missing_slot"] == "2026-11-28"
            assert entry["slot_ended_at"] == "2026-11-28T23:00:00+00:00"
            assert entry["last_success"]["slot"] == yesterday.period
            succeeded(ledger, job, "2026-11-28")
            assert report(using)[0] == 0
    # The same instant by UTC's calendar: the 28th ended at 00:00 UTC, only 1.5 hours ago.
    ledger.filter(period="2026-11-28").delete()
    with lock_settings(LEDGER_TIME_ZONE="UTC", JOBS={job: {"period": "daily", "grace": 7200}}):
        with database_clock(using, at("2026-11-29T01:30+00:00")):
            assert report(using)[0] == 0


def test_overdue_across_the_repeated_hour_when_dst_ends(ledger, using):
    job = "example.hourly_sync"
    with lock_settings(LEDGER_TIME_ZONE=PARIS, JOBS={job: {"period": "hourly", "grace": 600}}):
        succeeded(ledger, job, "2026-10-25T02")  # the first 02:00-03:00 (CEST)
        # 02:15 CET, in the second 02 hour: the first one is the slot that must have succeeded.
        with database_clock(using, at("2026-10-25T01:15+00:00")):
            assert report(using)[0] == 0
        # 03:15 CET: the second 02 hour ended 15 minutes ago, and it is a slot of its own.
        with database_clock(using, at("2026-10-25T02:15+00:00")):
            (entry,) = json.loads(report(using, "--json")[1])
            assert entry["missing_slot"] == "2026-10-25T02+0100"
            assert entry["slot_ended_at"] == "2026-10-25T02:00:00+00:00"
            assert entry["last_success"]["slot"] == "2026-10-25T02"
            succeeded(ledger, job, "2026-10-25T02+0100")
            assert report(using)[0] == 0


def test_overdue_across_the_hour_skipped_when_dst_begins(ledger, using):
    job = "example.hourly_sync"
    with lock_settings(LEDGER_TIME_ZONE=PARIS, JOBS={job: {"period": "hourly", "grace": 0}}):
        succeeded(ledger, job, "2026-03-29T01")
        # 03:30 CEST: the hour before was 01 (02 never happened): nothing is missing.
        with database_clock(using, at("2026-03-29T01:30+00:00")):
            assert report(using)[0] == 0
        with database_clock(using, at("2026-03-29T02:30+00:00")):
            (entry,) = json.loads(report(using, "--json")[1])
            assert entry["missing_slot"] == "2026-03-29T03"


def test_report_lists_only_overdue_declared_jobs_with_their_missing_slot(ledger, using):
    declared = {
        "ok.daily": {"period": "daily", "grace": 3600},
        "late.daily": {"period": "daily", "grace": 3600},
        "late.weekly": {"period": "weekly"},  # grace defaults to 0
        "failed.monthly": {"period": "monthly", "grace": 0},
        "nothing.runs.this": {"period": "hourly", "grace": 0},  # declared, no code: fine
    }
    succeeded(ledger, "ok.daily", "2026-11-30")
    succeeded(ledger, "late.daily", "2026-11-26", host="worker-7")
    succeeded(ledger, "late.weekly", "2026-W47")
    ledger.create(
        job_name="failed.monthly", period="2026-11", status=JobRun.Status.FAILED,
        started_at=at("2026-11-30T00:00+00:00"),
    )  # fmt: skip
    ledger.create(  # a ledger job nobody declared: never overdue, whatever its rows say
        job_name="undeclared.job", period="2026-11-28", status=JobRun.Status.FAILED,
        started_at=at("2026-11-28T00:00+00:00"),
    )  # fmt: skip
    # Tuesday 1 December 2026, 09:00 UTC: the last ended day is the 30th, week W48, month 11.
    with lock_settings(JOBS=declared), database_clock(using, at("2026-12-01T09:00+00:00")):
        status, out = report(using, "--json")
        listed = {entry["job"]: entry for entry in json.loads(out)}
        assert status == 1
        assert set(listed) == {"late.daily", "late.weekly", "failed.monthly", "nothing.runs.this"}
        assert listed["late.daily"]["missing_slot"] == "2026-11-30"
        assert listed["late.daily"]["last_success"]["host"] == "worker-7"
        assert listed["late.weekly"] == {
            "job": "late.weekly",
            "period": "weekly",
            "missing_slot": "2026-W48",
            "slot_ended_at": "2026-11-30T00:00:00+00:00",
            "reason": None,  # not a scheduled entry: no scheduler to blame
            "failing": False,
            "last_success": {
                "slot": "2026-W47",
                "finished_at": "2026-01-01T00:00:00+00:00",
                "host": "worker-1",
            },
        }
        assert listed["failed.monthly"]["missing_slot"] == "2026-11"
        assert listed["failed.monthly"]["last_success"] is None  # a failed run is no success
        assert listed["nothing.runs.this"]["missing_slot"] == "2026-12-01T08"
        table_status, table = report(using)
        assert table_status == 1 and "ok.daily" not in table and "undeclared.job" not in table
        assert "late.daily" in table and "2026-11-30" in table and "never" in table


def test_report_says_none_and_exits_0_when_no_job_is_declared(ledger, using):
    ledger.create(
        job_name="undeclared.job", period="2020-01-01", started_at=at("2020-01-01T00:00+00:00")
    )
    assert report(using) == (0, "No declared job is overdue.\n")
    assert report(using, "--json") == (0, "[]\n")


@WITH_OVERDUEAPP
def test_a_command_is_watched_under_the_name_its_ledger_rows_carry(ledger, using, monkeypatch):
    # @single_instance(ledger="daily", grace=3600) on overdueapp's nightly_digest; its lock
    # and ledger on ``using`` (as @single_instance(using=...) would put them).
    command = type(load_command_class("tests.overdueapp", "nightly_digest"))
    monkeypatch.setattr(command, "lock_using", using)
    with database_clock(using, at("2026-11-29T12:00+00:00")):
        call_command("nightly_digest", stdout=StringIO())
    (run,) = ledger.all()
    assert (run.job_name, run.period, run.status) == (
        "overdueapp.nightly_digest",
        "2026-11-29",
        "succeeded",
    )
    with database_clock(using, at("2026-11-30T01:30+00:00")):
        assert report(using)[0] == 0  # the 29th is past its grace, and succeeded
    with database_clock(using, at("2026-12-01T01:30+00:00")):
        status, out = report(using)
        assert status == 1 and "overdueapp.nightly_digest" in out and "2026-11-30" in out
        # Settings win over code: a longer grace in JOBS.
        slower = {"overdueapp.nightly_digest": {"period": "daily", "grace": 2 * 3600}}
        with lock_settings(JOBS=slower):
            assert report(using)[0] == 0


def test_a_function_is_watched_under_its_module_and_qualname(ledger, using, monkeypatch):
    monkeypatch.setattr(expectations, "_declared_in_code", {})  # forgotten after this test

    @single_instance(ledger="hourly", grace=60, using=using)
    def refresh_rates():
        return "refreshed"

    name = f"{__name__}.test_a_function_is_watched_under_its_module_and_qualname.<locals>"
    with database_clock(using, at("2026-11-29T10:30+00:00")):
        assert refresh_rates() == "refreshed"
    assert ledger.get().job_name == f"{name}.refresh_rates"
    with database_clock(using, at("2026-11-29T11:05+00:00")):
        assert report(using)[0] == 0
    with database_clock(using, at("2026-11-29T12:05+00:00")):
        (entry,) = json.loads(report(using, "--json")[1])
        assert entry["job"] == f"{name}.refresh_rates" and entry["missing_slot"] == "2026-11-29T11"


def test_job_overdue_is_sent_for_each_overdue_job_found_by_the_command(ledger, using):
    received = []

    def receiver(sender, **kwargs):
        received.append(kwargs)

    signals.job_overdue.connect(receiver)
    declared = {"a.daily": {"period": "daily"}, "b.daily": {"period": "daily"}}
    try:
        with lock_settings(JOBS=declared), database_clock(using, at("2026-11-29T09:00+00:00")):
            last = succeeded(ledger, "a.daily", "2026-11-27")
            succeeded(ledger, "b.daily", "2026-11-28")
            assert report(using)[0] == 1
            ledger.filter(job_name="a.daily").update(period="2026-11-28")
            assert report(using)[0] == 0
    finally:
        signals.job_overdue.disconnect(receiver)
    (sent,) = received  # once, for a.daily, by the first report; none by the second
    assert sent["job_name"] == "a.daily" and sent["period"] == "daily"
    assert sent["missing_slot"] == "2026-11-28"
    assert sent["slot_ended_at"] == at("2026-11-29T00:00+00:00")
    assert sent["last_success"].pk == last.pk


# The job runs changelist: the overdue jobs above the list.


class LedgerOn:
    """A database router that keeps the ledger (JobRun) on one alias."""

    def __init__(self, alias):
        self.alias = alias

    def db_for_read(self, model, **hints):
        return self.alias if model is JobRun else None

    db_for_write = db_for_read


@pytest.fixture
def superuser_client(using, client):
    """The test client, logged in as a superuser (on "default", deleted after the test)."""
    user = User.objects.create_superuser("overdue-admin", password="pw")
    client.force_login(user)
    yield client
    user.delete()


def test_the_changelist_shows_the_overdue_jobs_above_the_runs(ledger, using, superuser_client):
    declared = {"late.daily": {"period": "daily"}, "ok.daily": {"period": "daily"}}
    succeeded(ledger, "late.daily", "2026-11-26", host="worker-9")
    succeeded(ledger, "ok.daily", "2026-11-28")
    with (
        lock_settings(JOBS=declared),
        override_settings(DATABASE_ROUTERS=[LedgerOn(using)]),
        database_clock(using, at("2026-11-29T09:00+00:00")),
    ):
        page = superuser_client.get(CHANGELIST).content.decode()
        assert 'id="overdue-jobs"' in page
        start = page.index('id="overdue-jobs"')
        box = page[start : page.index("</table>", start)]
        assert "late.daily" in box and "<strong>2026-11-28</strong>" in box
        assert "2026-11-26" in box and "worker-9" in box
        assert "ok.daily" not in box
        assert page.index('id="overdue-jobs"') < page.index('id="result_list"')  # above
        succeeded(ledger, "late.daily", "2026-11-28")
        page = superuser_client.get(CHANGELIST).content.decode()
        assert 'id="overdue-jobs"' not in page and "late.daily" in page  # the rows remain


# Bad declarations: system check errors naming the job, never a crash at run time.


def job_errors(jobs):
    with lock_settings(JOBS=jobs):
        return [m for m in check_settings() if m.id == "advisory_lock.E010"]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"period": "daily", "grace": 60, "timezone": "UTC"}, "unknown option(s) 'timezone'"),
        ({"period": "fortnightly"}, "'period'] must be one of"),
        ({"grace": 60}, "'period'] must be one of"),
        ({"period": "once", "grace": 60}, None),  # a once job: fine, and never overdue
        ({"period": "daily", "grace": -1}, "'grace'] must be a number of seconds >= 0"),
        ({"period": "daily", "grace": "2h"}, "'grace'] must be a number of seconds >= 0"),
        ({"period": "daily", "grace": True}, "'grace'] must be a number of seconds >= 0"),
        ("daily", "must be a dict with 'period'"),
    ],
)
def test_a_bad_job_entry_is_a_check_error_naming_the_job(entry, says, using):
    errors = job_errors({"example.nightly_report": entry})
    if says is None:
        assert errors == []
        return
    (error,) = errors
    assert "ADVISORY_LOCK['JOBS']['example.nightly_report']" in error.msg and says in error.msg
    assert error.hint and "period" in error.hint
    # The report skips the bad entry instead of crashing on it.
    with lock_settings(JOBS={"example.nightly_report": entry}):
        assert report(using) == (0, "No declared job is overdue.\n")


def test_every_problem_of_an_entry_is_reported_and_the_check_runs_with_the_others():
    errors = job_errors(
        {"a": {"period": "yearly", "grace": -5, "every": 1}, "b": {"period": "daily"}}
    )
    assert len(errors) == 3 and all("['a']" in error.msg for error in errors)
    with lock_settings(JOBS={"a": {"period": "yearly"}}):
        assert "advisory_lock.E010" in {message.id for message in run_checks()}


def test_jobs_that_is_not_a_dict_is_a_check_error():
    (error,) = job_errors([("example.nightly_report", "daily")])
    assert "ADVISORY_LOCK['JOBS'] must be a dict" in error.msg


def test_a_declared_job_that_no_code_runs_is_fine():
    assert job_errors({"nobody.writes.this": {"period": "weekly", "grace": 86400}}) == []
    assert job_errors({}) == []


def test_a_bad_grace_in_code_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="grace"):
        single_instance(ledger="daily", grace=-1)
    with pytest.raises(ValueError, match="named ledger period that ends"):
        single_instance(ledger="once", grace=60)
    with pytest.raises(ValueError, match="named ledger period that ends"):
        single_instance(grace=60)  # no ledger: nothing to watch


def test_the_ledger_time_zone_applies_to_the_database_clocks_instant(ledger, using):
    # 04:30 UTC on the 29th is 23:30 on the 28th in New York: the 27th is the last ended day.
    declared = {"x.daily": {"period": "daily"}}
    with (
        lock_settings(LEDGER_TIME_ZONE=NEW_YORK, JOBS=declared),
        database_clock(using, at("2026-11-29T04:30+00:00")),
    ):
        (entry,) = json.loads(report(using, "--json")[1])
    assert entry["missing_slot"] == "2026-11-27"
    assert entry["slot_ended_at"] == "2026-11-28T05:00:00+00:00"


# Regressions: a scheduled entry, and a JOBS that is not a dict.


def test_a_scheduled_entry_with_a_grace_is_watched_by_its_firing_times(ledger, using):
    schedule = {"poll": {"callable": "os.getcwd", "every": 3600, "grace": 60}}
    with lock_settings(SCHEDULE=schedule), database_clock(using, at("2026-11-29T10:30+00:00")):
        status, out = report(using, "--json")
    (entry,) = json.loads(out)
    assert status == 1 and entry["job"] == "poll"


def test_a_bad_schedule_entry_hides_none_of_the_others_from_the_report(ledger, using):
    # Regression: the report read the schedule as a whole, and one bad entry (a system check
    # error) left every scheduled entry unwatched.
    schedule = {
        "poll": {"callable": "os.getcwd", "every": 3600, "grace": 60},
        "broken": {"callable": "os.getcwd", "every": 0.5, "grace": 60},
    }
    with lock_settings(SCHEDULE=schedule), database_clock(using, at("2026-11-29T10:30+00:00")):
        status, out = report(using, "--json")
    assert status == 1 and [entry["job"] for entry in json.loads(out)] == ["poll"]


def test_jobs_that_is_not_a_dict_does_not_crash_the_report(using):
    with lock_settings(JOBS=[("example.nightly_report", "daily")]):
        assert report(using)[0] == 0
