"""Bad input to the commands, lock keys and ledger job names: refused cleanly, or harmless.

Refused cleanly: a usage error (exit status 2) from the command line, a ``CommandError``
from ``call_command``, a ``ValueError``/``TypeError`` before any SQL from the API; never an
SQL error, an OverflowError or a traceback, and nothing held or written afterwards.
Harmless: SQL metacharacters, ``%s``, NUL (in lock keys) and long unicode in lock keys and
job names are ordinary text, on every backend.
"""

from __future__ import annotations

import datetime
import subprocess

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.db.backends.signals import connection_created

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from tests.commands import finish
from tests.commands import start
from tests.probes import is_free

pytestmark = pytest.mark.faults

KEY = "command:lockapp.decorated_job"


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
