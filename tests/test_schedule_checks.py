"""A bad ``SCHEDULE`` is refused where it would be scheduled, not everywhere.

A typo in one entry is a system check *warning* (``advisory_lock.W011``): ``manage.py check``,
``migrate`` and every other command still run (real processes), while ``run_jobs`` refuses to
start on it. The hint names every key an entry accepts, generated from ``Entry``. The usual
cron aliases (``@hourly`` ... ``@yearly``) are accepted and fire on their cron slots.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys

import pytest
from django.core.checks import WARNING
from django.core.checks import run_checks
from django.test import override_settings

from advisory_lock.schedule import Entry
from advisory_lock.schedule import entry_problems
from tests.commands import HANG
from tests.commands import ROOT

NOOP = "tests.schedule_jobs.tick"
CHECK_ID = "advisory_lock.W011"
#: The keys an entry accepts: the fields of ``Entry``, less its name (the entry's own key).
KEYS = [field.name for field in dataclasses.fields(Entry) if field.name != "name"]
#: Typos in a schedule, each of which once failed every command's system checks.
TYPOS = {
    "misspelt key": {"report": {"callable": NOOP, "every": 60, "cacth_up": "all"}},
    "malformed cron": {"report": {"command": "check", "cron": "61 * * * *"}},
    "unknown command": {"report": {"command": "no_such_command", "every": 60}},
    "not a dict": ["report"],
}
UTC = datetime.timezone.utc
#: A Wednesday, mid-month, mid-year, mid-hour (UTC, the tests' TIME_ZONE).
MOMENT = datetime.datetime(2024, 5, 15, 10, 30, tzinfo=UTC)
#: Each alias: its slot at or before MOMENT and the next one, as cron(8) defines it
#: (@hourly "0 * * * *", @daily and @midnight "0 0 * * *", @weekly "0 0 * * 0", @monthly
#: "0 0 1 * *", @yearly and @annually "0 0 1 1 *").
ALIAS_SLOTS = {
    "@hourly": ("2024-05-15T10:00", "2024-05-15T11:00"),
    "@daily": ("2024-05-15T00:00", "2024-05-16T00:00"),
    "@midnight": ("2024-05-15T00:00", "2024-05-16T00:00"),
    "@weekly": ("2024-05-12T00:00", "2024-05-19T00:00"),  # Sundays
    "@monthly": ("2024-05-01T00:00", "2024-06-01T00:00"),
    "@yearly": ("2024-01-01T00:00", "2025-01-01T00:00"),
    "@annually": ("2024-01-01T00:00", "2025-01-01T00:00"),
}


def schedule_settings(schedule):
    return override_settings(ADVISORY_LOCK={"NAMESPACE": "tests", "SCHEDULE": schedule})


def schedule_messages(schedule):
    """The system check messages about ``schedule``."""
    with schedule_settings(schedule):
        return [message for message in run_checks() if "SCHEDULE" in message.msg]


def manage(using, schedule, *argv):
    """``manage.py *argv`` with ``schedule`` as ADVISORY_LOCK["SCHEDULE"], on the test database
    of ``using``: (exit status, stdout, stderr)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.schedule_settings",
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": using,
        "ADVISORY_LOCK_TEST_SCHEDULE": json.dumps(schedule),
        "PYTHONUNBUFFERED": "1",
    }
    process = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    return process.returncode, process.stdout, process.stderr


@pytest.mark.parametrize("using", ["default"], indirect=True)
@pytest.mark.parametrize("typo", list(TYPOS))
def test_check_succeeds_with_a_typo_in_the_schedule_and_shows_the_warning(using, typo):
    status, out, err = manage(using, TYPOS[typo], "check")
    assert status == 0, (out, err)
    assert CHECK_ID in err and "report" in err, (out, err)


@pytest.mark.parametrize("typo", list(TYPOS))
def test_migrate_succeeds_with_a_typo_in_the_schedule(using, typo):
    status, out, err = manage(using, TYPOS[typo], "migrate", "--noinput")
    assert status == 0, (out, err)
    assert CHECK_ID in err, (out, err)
    assert "No migrations to apply" in out or "Applying" in out or "OK" in out, out


@pytest.mark.parametrize("using", ["default"], indirect=True)
@pytest.mark.parametrize("typo", list(TYPOS))
def test_run_jobs_refuses_to_start_on_a_typo_in_the_schedule(using, ledger, typo):
    for argv in (["run_jobs", "--once"], ["run_jobs", "--once", "--skip-checks"]):
        status, out, err = manage(using, TYPOS[typo], *argv)
        assert status == 1, (argv, out, err)
        assert "CommandError: ADVISORY_LOCK['SCHEDULE']" in err, (argv, out, err)
        assert "Traceback" not in err, (argv, err)
    assert not ledger.exists()


@pytest.mark.parametrize("typo", list(TYPOS))
def test_a_typo_in_the_schedule_is_a_warning_with_its_id(typo):
    messages = schedule_messages(TYPOS[typo])
    assert messages, "the typo went unreported"
    assert {(message.id, message.level) for message in messages} == {(CHECK_ID, WARNING)}


@pytest.mark.parametrize("key", KEYS)
def test_the_checks_hint_names_every_key_an_entry_accepts(key):
    (message,) = schedule_messages(TYPOS["misspelt key"])
    assert re.search(rf"\b{key}\b", message.hint), message.hint


def test_the_keys_an_entry_accepts_are_the_fields_of_entry():
    problems = entry_problems("report", {"callable": NOOP, "every": 60, "cacth_up": "all"})
    (unknown,) = [problem for problem in problems if "unknown key" in problem]
    assert unknown.endswith(f"the keys are {', '.join(KEYS)}."), unknown


def test_the_docs_table_of_keys_names_every_key():
    text = (ROOT / "docs" / "scheduler.md").read_text()
    table = text.split("| key | | |", 1)[1].split("\n\n", 1)[0]
    named = {name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row[:60])}
    assert set(KEYS) <= named, set(KEYS) - named


@pytest.mark.parametrize("alias", list(ALIAS_SLOTS))
def test_a_cron_alias_is_accepted_and_fires_on_its_cron_slots(alias):
    options = {"callable": NOOP, "cron": alias}
    assert entry_problems("report", options) == []
    assert schedule_messages({"report": options}) == []
    entry = Entry(name="report", callable=NOOP, cron=alias)
    latest, following = ALIAS_SLOTS[alias]
    assert entry.slot_name(next(entry.slots_before(MOMENT))) == latest
    assert entry.slot_name(entry.next_slot(MOMENT)) == following
    # From a slot itself: that slot, then the one after it.
    slot = entry.next_slot(MOMENT)
    assert next(entry.slots_before(slot)) == slot
    assert entry.slot_name(entry.next_slot(slot)) != following


def test_every_alias_the_schedule_accepts_is_tested():
    from advisory_lock.schedule import CRON_ALIASES

    assert set(CRON_ALIASES) == set(ALIAS_SLOTS)


@pytest.mark.parametrize("alias", ["@reboot", "@fortnightly", "@Daily"])
def test_another_alias_is_refused_naming_those_accepted(alias):
    (problem,) = entry_problems("report", {"callable": NOOP, "cron": alias})
    assert repr(alias) in problem and all(name in problem for name in ALIAS_SLOTS), problem


def test_schedule_problems_lists_every_problem_of_every_entry():
    from advisory_lock.schedule import schedule_problems

    schedule = {
        "good": {"callable": NOOP, "every": 60},
        "first": {"callable": NOOP, "every": 60, "cacth_up": "all"},
        "second": {"callable": NOOP, "cron": "61 * * * *"},
    }
    with schedule_settings(schedule):
        problems = schedule_problems()
    assert len(problems) == 2 and "'first'" in problems[0] and "'second'" in problems[1]
    with schedule_settings(["report"]):
        (problem,) = schedule_problems()
    assert "must be a dict" in problem
    with schedule_settings({"good": {"callable": NOOP, "every": 60}}):
        assert schedule_problems() == []


@pytest.mark.parametrize("using", ["default"], indirect=True)
@pytest.mark.parametrize("typo", list(TYPOS))
def test_the_admin_schedule_page_shows_the_problem(using, typo):
    from django.contrib.auth.models import User
    from django.test import Client
    from django.utils.html import escape

    from advisory_lock.schedule import schedule_problems

    user = User.objects.create_superuser("schedule-admin", password="pw")
    try:
        client = Client()
        client.force_login(user)
        with schedule_settings(TYPOS[typo]):
            response = client.get("/admin/advisory_lock/jobrun/schedule/")
            first = schedule_problems()[0]
    finally:
        user.delete()
    assert response.status_code == 200
    assert escape(first) in response.content.decode(), response.content.decode()
