"""Bad input to the commands, lock keys and ledger job names: refused cleanly, or harmless.

Refused cleanly: a usage error (exit status 2) from the command line, a ``CommandError``
from ``call_command``, a ``ValueError``/``TypeError`` before any SQL from the API; never an
SQL error, an OverflowError or a traceback, and nothing held or written afterwards.
Harmless: SQL metacharacters, ``%s``, NUL (in lock keys) and long unicode in lock keys and
job names are ordinary text, on every backend.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import threading

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import connections
from django.db.backends.signals import connection_created
from django.test import Client
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from advisory_lock import single_instance
from advisory_lock.single_instance import GuardedRun
from tests.commands import ROOT
from tests.commands import command_env
from tests.commands import finish
from tests.commands import start
from tests.commands import wait_for_line
from tests.probes import freed
from tests.probes import in_other_connection
from tests.probes import is_free

pytestmark = pytest.mark.faults

KEY = "command:lockapp.decorated_job"
CHANGELIST = "/admin/advisory_lock/jobrun/"
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)


def run_all(processes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Wait for processes started together; kill the rest if one wait fails."""
    try:
        return [finish(process) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


# --lock-wait SECONDS on a @single_instance command.

REJECTED_LOCK_WAITS = ["-1", "-0.5", "abc", "", "inf", "-inf", "nan", "1e400", "0x10", "5s"]
# float() reads the decimal digits of every script: Arabic-Indic 12, fullwidth 12, Devanagari 5.
UNICODE_DIGITS = ["\u0661\u0662", "\uff11\uff12", "\u096b"]


def assert_usage_errors(using: str, values: list[str]) -> None:
    results = run_all([start(using, "decorated_job", "--lock-wait", value) for value in values])
    wrong = {
        value: result
        for value, result in zip(values, results, strict=True)
        if result[0] != 2 or "--lock-wait" not in result[2] or "running" in result[1]
    }
    assert not wrong, f"not a usage error (status, out, err): {wrong}"
    for _, _, err in results:
        assert "usage:" in err and "Traceback" not in err
    assert is_free(KEY, using)


def test_malformed_lock_wait_is_a_usage_error_and_holds_nothing(using):
    assert_usage_errors(using, REJECTED_LOCK_WAITS)


def test_lock_wait_in_non_ascii_digits_is_a_usage_error(using):
    assert_usage_errors(using, UNICODE_DIGITS)


# manage.py job_runs: --limit N, --prune --older-than DAYS.

REJECTED_JOB_RUNS_ARGS = {
    "limit 0": ["--limit", "0"],
    "limit -1": ["--limit", "-1"],
    "limit abc": ["--limit", "abc"],
    "limit 1.5": ["--limit", "1.5"],
    "limit empty": ["--limit", ""],
    "limit 1e3": ["--limit", "1e3"],
    "older-than 0": ["--prune", "--older-than", "0"],
    "older-than -3": ["--prune", "--older-than", "-3"],
    "older-than x": ["--prune", "--older-than", "x"],
    "older-than without prune": ["--older-than", "5"],
    "prune without older-than": ["--prune"],
    "status bogus": ["--status", "bogus"],
    # Once bugs: accepted, or they reached Python's datetime or the database.
    "limit unicode digits": ["--limit", "\u0661\u0662"],
    "limit beyond bigint": ["--limit", "99999999999999999999"],
    "older-than unicode digit": ["--prune", "--older-than", "\u0661"],
    "older-than 800000 days": ["--prune", "--older-than", "800000"],
    "older-than beyond timedelta": ["--prune", "--older-than", "1000000000"],
}


@pytest.fixture
def old_run(using):
    """A finished run that started 400 days ago: a bad --prune must not delete it."""
    rows = JobRun.objects.using(using)
    started = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=400)
    run = rows.create(
        job_name="faults.old", period="old", status=JobRun.Status.SUCCEEDED, started_at=started
    )
    yield run
    rows.filter(job_name="faults.old").delete()


@pytest.mark.parametrize("case", list(REJECTED_JOB_RUNS_ARGS))
def test_job_runs_rejects_bad_numbers_with_a_command_error(using, old_run, case):
    with pytest.raises(CommandError):
        call_command("job_runs", *REJECTED_JOB_RUNS_ARGS[case], database=using)
    assert JobRun.objects.using(using).filter(pk=old_run.pk).exists()


def test_job_runs_bad_numbers_on_the_command_line_are_usage_errors():
    cases = [["--limit", "abc"], ["--limit", "0"], ["--prune", "--older-than", "x"]]
    results = run_all([start("default", "job_runs", *argv) for argv in cases])
    for argv, (status, _, err) in zip(cases, results, strict=True):
        assert status == 2 and "usage:" in err and "Traceback" not in err, (argv, status, err)


# Lock keys: SQL metacharacters, format markers, NUL, 1000 characters of unicode.

ODD_NAMES = {
    "sql injection": "'; DROP TABLE job_runs; --",
    "bobby tables": "Robert'); DROP TABLE job_runs;--",
    "percent s": "%s",
    "pyformat": "%(name)s",
    "qmark": "?",
    "nul": "\x00",
    "backslash x00": "\\x00",
    "quotes": "\"'`",
    "newline": "a\nb",
    "path": "../../../../tmp/x",
    "slash": "/",
    "like wildcards": "_%",
    "1000 e-acute": "é" * 1000,
    "1000 emoji": "😀" * 1000,
    "1000 cjk": "鎖" * 1000,
}


@pytest.mark.parametrize("name", list(ODD_NAMES))
def test_odd_lock_keys_are_ordinary_names(using, name):
    key = ODD_NAMES[name]
    with advisory_lock(key, using=using, wait=False) as handle:
        assert handle.acquired
        assert not is_free(key, using)  # held, as seen from another connection
        assert is_free(key[:-1] + "#", using)  # it is this key that is held, no other
    assert is_free(key, using)
    assert not JobRun.objects.using(using).filter(job_name="faults.absent").exists()  # intact


@pytest.mark.parametrize(
    ("key", "error"),
    [
        ("x" * 1001, ValueError),
        ("é" * 1001, ValueError),
        ("\ud800", ValueError),
        ("", ValueError),
        (" \t\n", ValueError),
        (b"bytes", TypeError),
    ],
    ids=["1001 chars", "1001 e-acute", "lone surrogate", "empty", "blank", "bytes"],
)
def test_unusable_lock_keys_fail_before_any_sql(using, key, error):
    connections[using].close()
    with pytest.raises(error):
        with advisory_lock(key, using=using, wait=False):
            pass
    assert connections[using].connection is None  # no connection was even opened


# Job names of the ledger: the same odd text, up to the column's 200 characters.

ODD_JOB_NAMES = {name: text[:200] for name, text in ODD_NAMES.items() if name != "nul"}


@pytest.fixture
def ledger(using):
    rows = JobRun.objects.using(using)
    yield rows
    rows.exclude(job_name="faults.old").delete()


@pytest.fixture
def new_connections():
    """The aliases of the database connections opened during the test (any thread)."""
    opened = []

    def opened_one(sender, connection, **kwargs):
        opened.append(connection.alias)

    connection_created.connect(opened_one)
    yield opened
    connection_created.disconnect(opened_one)


@pytest.mark.parametrize("name", list(ODD_JOB_NAMES))
def test_odd_job_names_are_claimed_as_given(ledger, name):
    job_name = ODD_JOB_NAMES[name]
    run = ledger.claim(job_name)
    assert run is not None and run.job_name == job_name
    assert ledger.claim(job_name) is None  # the slot is taken
    ledger.finish(run)
    assert ledger.get(pk=run.pk).status == JobRun.Status.SUCCEEDED
    assert ledger.claim(job_name) is None  # and done
    assert ledger.filter(job_name="faults.absent").count() == 0  # the table is still there


def test_a_nul_in_a_job_name_works_or_is_refused_before_any_sql(ledger, using, new_connections):
    try:
        run = ledger.claim("nul:\x00")
    except ValueError:
        assert new_connections == [], "refused only after connecting"
        assert not ledger.filter(job_name__startswith="nul:").exists()
    else:
        assert run.job_name == "nul:\x00"
        ledger.finish(run)


@pytest.mark.parametrize(
    ("job_name", "error"),
    [
        ("x" * 201, ValueError),
        ("😀" * 201, ValueError),
        ("", ValueError),
        ("   ", ValueError),
        (None, TypeError),
        (b"job", TypeError),
    ],
    ids=["201 chars", "201 emoji", "empty", "blank", "None", "bytes"],
)
def test_unusable_job_names_fail_before_any_sql(ledger, new_connections, job_name, error):
    with pytest.raises(error):
        ledger.claim(job_name)
    assert new_connections == []
    assert ledger.count() == 0


@pytest.mark.parametrize(
    "pair",
    [("Job", "job"), ("cafe", "café"), ("job", "job ")],
    ids=["case", "accent", "trailing space"],
)
def test_job_names_that_differ_only_in_case_accent_or_trailing_space_are_two_jobs(
    ledger, using, pair
):
    first, second = pair
    one = ledger.claim(first)
    assert one is not None
    run = ledger.claim(second)
    assert run is not None and run.job_name == second
    ledger.finish(one)
    ledger.finish(run)


# Issue 19: input that the checks, the options or the API let through to the database or to
# Python's datetime arithmetic. Each test below failed before its fix.

UTC = datetime.timezone.utc
NOOP = "os.getpid"  # an importable callable that does nothing
SERVERS = pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)


def lock_settings(**options):
    """ADVISORY_LOCK with ``options`` on top of the test settings' (the NAMESPACE kept)."""
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, **options})


def start_with(using: str, lock_options: dict, *argv: str) -> subprocess.Popen:
    """``manage.py *argv`` (``using`` as "default") with ADVISORY_LOCK updated by
    ``lock_options`` (tests/faults/lock_settings.py)."""
    env = {
        **command_env(using),
        "DJANGO_SETTINGS_MODULE": "tests.faults.lock_settings",
        "ADVISORY_LOCK_TEST_SETTINGS": json.dumps(lock_options),
    }
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="backslashreplace",
    )


def check_errors(check_id: str) -> list:
    return [message for message in run_checks() if message.id == check_id]


class LedgerOn:
    """A database router that keeps the ledger (JobRun) on one alias."""

    def __init__(self, alias):
        self.alias = alias

    def db_for_read(self, model, **hints):
        return self.alias if model is JobRun else None

    db_for_write = db_for_read


@pytest.fixture
def staff_client(using):
    """The test client logged in as a superuser (on "default", deleted after the test), with
    the ledger read from ``using``."""
    user = User.objects.create_superuser("faults-admin", password="pw")
    client = Client()
    client.force_login(user)
    with override_settings(DATABASE_ROUTERS=[LedgerOn(using)]):
        yield client
    user.delete()


# Item 6: a schedule entry's name is a job name of the ledger (at most 200 characters, no NUL,
# no lone surrogate): W011 says so, and run_jobs refuses to start, instead of forking
# children that die on it.

UNSTORABLE_ENTRY_NAMES = {
    "201 chars": "x" * 201,
    "nul": "nightly\x00report",
    "lone surrogate": "nightly\udcff",
}


def test_the_ledgers_limits_are_the_models():
    from advisory_lock.periods import MAX_JOB_NAME_LENGTH
    from advisory_lock.periods import MAX_PERIOD_LENGTH

    assert JobRun._meta.get_field("job_name").max_length == MAX_JOB_NAME_LENGTH
    assert JobRun._meta.get_field("period").max_length == MAX_PERIOD_LENGTH


@pytest.mark.parametrize("name", list(UNSTORABLE_ENTRY_NAMES))
def test_a_schedule_entry_name_the_ledger_cant_store_is_a_check_warning(name):
    entry_name = UNSTORABLE_ENTRY_NAMES[name]
    schedule = {
        "good": {"callable": NOOP, "every": 60},
        entry_name: {"callable": NOOP, "every": 60},
    }
    with lock_settings(SCHEDULE=schedule):
        errors = check_errors("advisory_lock.W011")
    assert len(errors) == 1, errors
    assert repr(entry_name[:20])[:-1] in errors[0].msg and "job name" in errors[0].msg
    assert errors[0].hint


def test_run_jobs_refuses_an_entry_name_longer_than_the_ledgers_column(using, ledger):
    lock_options = {"SCHEDULE": {"x" * 201: {"callable": NOOP, "every": 1}}}
    status, out, err = finish(start_with(using, lock_options, "run_jobs", "--once"))
    assert status == 1 and "advisory_lock.W011" in err and "Traceback" not in err, (out, err)
    argv = ["run_jobs", "--once", "--skip-checks"]
    status, out, err = finish(start_with(using, lock_options, *argv))
    assert status == 1 and "CommandError" in err and "200" in err, (out, err)
    assert "Traceback" not in err and "started" not in out, (out, err)
    assert not ledger.exists()


# Item 7: numbers the code can't represent (a timedelta, a date that far away) are check
# errors (JOBS) and warnings (SCHEDULE), not an OverflowError in the overdue report, the admin
# or run_jobs.

HUGE = 1e300
TOO_LARGE = {
    "every 1e300": ("W011", {"SCHEDULE": {"big": {"callable": NOOP, "every": HUGE}}}),
    "every 1e12": ("W011", {"SCHEDULE": {"big": {"callable": NOOP, "every": 1e12}}}),
    "grace 1e300": ("W011", {"SCHEDULE": {"big": {"callable": NOOP, "every": 60, "grace": HUGE}}}),
    "timeout 1e300": (
        "W011",
        {"SCHEDULE": {"big": {"callable": NOOP, "every": 60, "timeout": HUGE}}},
    ),
    "retries 2**31": (
        "W011",
        {"SCHEDULE": {"big": {"callable": NOOP, "every": 60, "retries": 2**31}}},
    ),
    "jobs grace 1e300": ("E010", {"JOBS": {"big": {"period": "daily", "grace": HUGE}}}),
}
#: Those that crashed the overdue report: a declared job's slot, that far back.
OVERDUE_CRASHES = {
    "schedule grace": {"SCHEDULE": {"big": {"callable": NOOP, "every": 60, "grace": HUGE}}},
    "schedule every": {"SCHEDULE": {"big": {"callable": NOOP, "every": HUGE, "grace": 60}}},
    "jobs grace": {"JOBS": {"big": {"period": "daily", "grace": HUGE}}},
}


@pytest.mark.parametrize("case", list(TOO_LARGE))
def test_a_number_too_large_to_compute_with_is_reported_by_the_checks(case):
    check_id, lock_options = TOO_LARGE[case]
    with lock_settings(**lock_options):
        errors = check_errors(f"advisory_lock.{check_id}")
    assert len(errors) == 1 and "'big'" in errors[0].msg and "at most" in errors[0].msg, errors
    assert errors[0].hint


@pytest.mark.parametrize("case", list(OVERDUE_CRASHES))
def test_the_overdue_report_on_a_number_too_large_is_a_check_message_not_a_traceback(using, case):
    lock_options = OVERDUE_CRASHES[case]
    status, out, err = finish(start_with(using, lock_options, "job_runs", "--overdue"))
    assert "Traceback" not in err, (status, out, err)
    assert "advisory_lock.E010" in err or "advisory_lock.W011" in err, (status, out, err)
    argv = ["job_runs", "--overdue", "--skip-checks"]
    status, out, err = finish(start_with(using, lock_options, *argv))
    assert (status, out, "Traceback" in err) == (0, "No declared job is overdue.\n", False), err


def test_run_jobs_on_an_every_too_large_is_a_check_error_not_a_traceback(using, ledger):
    lock_options = {"SCHEDULE": {"big": {"callable": NOOP, "every": HUGE}}}
    for argv in (["run_jobs", "--once"], ["run_jobs", "--list", "--skip-checks"]):
        status, out, err = finish(start_with(using, lock_options, *argv))
        assert status == 1 and "'big'" in err and "Traceback" not in err, (argv, out, err)
    assert not ledger.exists()


@pytest.mark.parametrize("case", list(OVERDUE_CRASHES))
@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_the_admin_pages_on_a_number_too_large_are_not_a_500(staff_client, case):
    with lock_settings(**OVERDUE_CRASHES[case]):
        changelist = staff_client.get(CHANGELIST)
        schedule = staff_client.get(f"{CHANGELIST}schedule/")
    assert changelist.status_code == 200
    assert schedule.status_code == 200
    if "SCHEDULE" in OVERDUE_CRASHES[case]:
        assert 'class="errornote"' in schedule.content.decode()


def test_slots_of_a_long_every_stop_at_the_earliest_date_instead_of_overflowing():
    from advisory_lock.schedule import Entry

    now = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
    century = Entry("big", callable=NOOP, every=3e9)  # about 95 years
    slots = list(century.slots_before(now))
    assert slots[0] <= now < slots[0] + datetime.timedelta(seconds=3e9)
    assert slots == sorted(slots, reverse=True) and len(slots) == 21
    before_the_epoch = datetime.datetime(1969, 12, 31, 23, 30, tzinfo=UTC)
    hourly = Entry("hourly", callable=NOOP, every=3600)
    assert next(hourly.slots_before(before_the_epoch)) == datetime.datetime(
        1969, 12, 31, 23, 0, tzinfo=UTC
    )


# Item 9: a wait longer than the database can wait is refused up front, naming the maximum:
# --lock-wait (a CommandError, exit status 2 as for any bad --lock-wait) and
# @single_instance(wait=...) (a ValueError when decorating, else before taking anything).

OVER_THE_MAXIMUM = {"postgresql": 2147483.648, "mysql": 2**31}


@pytest.fixture
def held_elsewhere(using):
    """Hold a key on another connection of ``using`` while the test runs (a context)."""

    @contextlib.contextmanager
    def hold(key):
        ready, done = threading.Event(), threading.Event()

        def holder():
            with advisory_lock(key, using=using):
                ready.set()
                done.wait(30)

        thread = threading.Thread(target=in_other_connection, args=(holder,))
        thread.start()
        try:
            assert ready.wait(10), "the other connection did not take the lock"
            yield
        finally:
            done.set()
            thread.join(30)

    return hold


@SERVERS
@pytest.mark.parametrize("lock", ["busy", "free"])
def test_lock_wait_above_the_servers_maximum_is_refused_naming_it(using, lock):
    holder = start(using, "decorated_job", "--seconds", "30") if lock == "busy" else None
    try:
        if holder:
            wait_for_line(holder, "running")
        wait = f"{OVER_THE_MAXIMUM[connections[using].vendor]!r}"
        status, out, err = finish(start(using, "decorated_job", "--lock-wait", wait))
    finally:
        if holder:
            holder.kill()
            finish(holder)
    assert status == 2 and "CommandError" in err and "--lock-wait" in err, (status, out, err)
    assert "2147483" in err and "Traceback" not in err and "running" not in out, err
    # Both processes have exited: the server frees what they held once it notices.
    assert freed(KEY, using)


@SERVERS
def test_single_instance_wait_above_the_servers_maximum_is_refused_when_decorating(using):
    wait = OVER_THE_MAXIMUM[connections[using].vendor]

    def job():
        pass

    with pytest.raises(ValueError, match=r"wait=.*at most 2147483"):
        single_instance(wait=wait, using=using)(job)
    with pytest.raises(ValueError, match=r"wait=.*at most 2147483"):
        single_instance(wait=wait, using=using)(type("Command", (BaseCommand,), {}))
    single_instance(wait=LONGEST_WAIT[connections[using].vendor], using=using)(job)  # the limit


LONGEST_WAIT = {"postgresql": 2147483.647, "mysql": 2**31 - 1}


@SERVERS
def test_a_wait_above_the_servers_maximum_is_refused_before_taking_anything(
    using, held_elsewhere, new_connections
):
    wait = OVER_THE_MAXIMUM[connections[using].vendor]
    run = GuardedRun("faults:long-wait", using=using, label="faults.long_wait", wait=wait)
    with held_elsewhere("faults:long-wait"):
        new_connections.clear()
        with pytest.raises(ValueError, match="at most 2147483"):
            run.start()
        assert new_connections == [], "refused only after connecting"
    assert is_free("faults:long-wait", using)


# Item 10: text that the database can't store or compare (NUL, a lone surrogate) or longer
# than the ledger's columns is refused by the app, at every entry point, never by the driver.

UNSTORABLE_SLOTS = {
    "nul": "2026-11-29\x00",
    "lone surrogate": "2026-11-29\udcff",
    "65 chars": "x" * 65,
}


@pytest.mark.parametrize("slot", list(UNSTORABLE_SLOTS))
def test_a_period_callable_returning_text_the_ledger_cant_store_is_a_clear_error(
    ledger, using, slot
):
    value = UNSTORABLE_SLOTS[slot]
    with pytest.raises(ValueError, match="period callable") as excinfo:
        ledger.claim("faults.period", period=lambda now: value)
    assert not isinstance(excinfo.value, UnicodeError)  # ours, not the driver's encoder
    assert not ledger.filter(job_name="faults.period").exists()
    assert is_free("job:faults.period", using)


JOB_RUNS_UNDECODABLE = {
    "--job": ["--job", "nightly\udcff"],
    "--mark-abandoned --job": ["--mark-abandoned", "--job", "nightly\udcff"],
    "--mark-abandoned --period": ["--mark-abandoned", "--period", "2026\udcff"],
}


def test_job_runs_options_with_undecodable_bytes_are_command_errors(using):
    """``job_runs --job $'\\xff'``: Python reads the byte as a lone surrogate."""
    cases = list(JOB_RUNS_UNDECODABLE.values())
    results = run_all([start(using, "job_runs", *argv) for argv in cases])
    for argv, (status, _, err) in zip(cases, results, strict=True):
        assert status == 2 and "CommandError" in err and "Traceback" not in err, (argv, err)
        assert f"{argv[-2]} " in err and "UTF-8" in err, (argv, err)


JOB_RUNS_UNSTORABLE = {
    "list --job nul": {"job": "nightly\x00"},
    "list --job 201 chars": {"job": "x" * 201},
    "mark --job nul": {"mark_abandoned": True, "job": "nightly\x00"},
    "mark --period nul": {"mark_abandoned": True, "period": "2026\x00"},
    "mark --period 65 chars": {"mark_abandoned": True, "period": "x" * 65},
}


@pytest.mark.parametrize("case", list(JOB_RUNS_UNSTORABLE))
def test_job_runs_options_the_ledger_cant_hold_are_command_errors(using, old_run, case):
    with pytest.raises(CommandError, match=r"--job|--period") as excinfo:
        call_command("job_runs", database=using, **JOB_RUNS_UNSTORABLE[case])
    assert excinfo.value.returncode == 2
    assert JobRun.objects.using(using).filter(pk=old_run.pk).exists()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"job_name": "nightly\x00"}, ValueError),
        ({"period": "2026\x00"}, ValueError),
        ({"job_name": "nightly\udcff"}, ValueError),
        ({"job_name": "x" * 201}, ValueError),
        ({"period": "x" * 65}, ValueError),
        ({"job_name": 5}, TypeError),
    ],
    ids=["job nul", "period nul", "job lone surrogate", "job 201 chars", "period 65", "job int"],
)
def test_mark_abandoned_refuses_text_the_ledger_cant_hold_before_any_sql(
    ledger, new_connections, options, error
):
    with pytest.raises(error):
        ledger.mark_abandoned(**options)
    assert new_connections == []


def test_a_lock_key_the_ledger_cant_store_is_refused_before_any_sql(ledger, new_connections):
    with pytest.raises(ValueError, match="lock_key"):
        ledger.claim("faults.key", lock_key="job\x00key")
    assert new_connections == []
    assert not ledger.filter(job_name="faults.key").exists()


def test_a_guarded_run_whose_lock_the_ledger_cant_name_is_refused_and_releases_it(ledger, using):
    run = GuardedRun("job\x00key", using=using, label="faults.nul_key", period="daily")
    with pytest.raises(ValueError, match="NUL"):
        run.start()
    assert not ledger.filter(job_name="faults.nul_key").exists()
    assert is_free("job\x00key", using)


#: A filter of the changelist whose value no job run can hold: (query string, parameter).
ADMIN_FILTERS = {
    "job nul": ("job_name=%00", "job_name"),
    "job nul inside": ("job_name=nightly%00report", "job_name"),
    "job 201 chars": ("job_name=" + "x" * 201, "job_name"),
    "status nul": ("status__exact=%00", "status__exact"),
    "search nul": ("q=nightly%00", "q"),
}


@pytest.mark.parametrize("case", list(ADMIN_FILTERS))
def test_the_admin_changelist_with_a_filter_the_ledger_cant_hold_is_not_a_500(
    ledger, using, staff_client, case
):
    ledger.create(job_name="nightly", period="p", status="succeeded", started_at=NOW)
    query, parameter = ADMIN_FILTERS[case]
    response = staff_client.get(f"{CHANGELIST}?{query}")
    assert response.status_code == 200
    page = response.content.decode()
    [message] = [m for m in page.split("<li") if 'class="warning"' in m]
    assert f"{parameter}=" in message and "ignored" in message, message


UNKNOWN_ALIASES = {
    "advisory_locks --using": ["advisory_locks", "--using", "nope"],
    "job_runs --database": ["job_runs", "--database", "nope"],
    "job_runs --overdue --database": ["job_runs", "--overdue", "--database", "nope"],
    "run_jobs --database": ["run_jobs", "--once", "--database", "nope"],
    "run_jobs --list --database": ["run_jobs", "--list", "--database", "nope"],
}


def test_an_unknown_database_alias_is_a_command_error_naming_the_configured_ones():
    cases = list(UNKNOWN_ALIASES.values())
    results = run_all([start("default", *argv) for argv in cases])
    for argv, (status, _, err) in zip(cases, results, strict=True):
        assert status == 2 and "CommandError" in err and "Traceback" not in err, (argv, err)
        assert f"{argv[-2]} 'nope'" in err and "'default'" in err, (argv, err)


@pytest.mark.parametrize("argv", list(UNKNOWN_ALIASES.values()), ids=list(UNKNOWN_ALIASES))
def test_an_unknown_database_alias_from_call_command_is_a_command_error(argv):
    with pytest.raises(CommandError, match=r"'nope'.*'default'"):
        call_command(*argv)
