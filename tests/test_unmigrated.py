"""The ledger on a database where ``migrate`` never ran: every way in says to run it.

Each test gets a new, empty database on the server of its backend (SQLite: a new file): in
this process as the alias "unmigrated", and for the demo project's processes
(``testproject.settings``) as their DATABASE_URL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import LedgerNotMigrated
from advisory_lock import run_once
from tests.commands import ROOT
from tests.databases import new_database
from tests.probes import is_free

ALIAS = "unmigrated"
#: Every table of the app's models, named in the message (generated: a model added later is
#: named too).
APP_TABLES = ", ".join(
    sorted(model._meta.db_table for model in apps.get_app_config("advisory_lock").get_models())
)
NOT_MIGRATED = "The ledger's tables (" + APP_TABLES + ") do not all exist on database {alias!r}"
MIGRATE_HERE = re.escape(f"Run 'manage.py migrate --database {ALIAS}', then try again.")


@pytest.fixture
def unmigrated(using, tmp_path):
    """The new database's DATABASE_URL; the alias "unmigrated" reaches it meanwhile."""
    with new_database(using, tmp_path) as (settings_dict, url):
        connections.settings[ALIAS] = settings_dict
        try:
            yield url
        finally:
            connections[ALIAS].close()
            del connections[ALIAS]
            del connections.settings[ALIAS]


def manage(url, *argv):
    """``manage.py *argv`` of the demo project on the database ``url``: (status, stderr)."""
    process = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings", "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return process.returncode, process.stderr


def has_ledger_table():
    connection = connections[ALIAS]
    with connection.cursor() as cursor:
        return "job_runs" in connection.introspection.table_names(cursor)


@pytest.mark.parametrize(
    "argv",
    [
        ["job_runs"],
        ["job_runs", "--mark-abandoned"],
        ["job_runs", "--prune", "--older-than", "30"],
        ["nightly_report", "--seconds", "0"],  # @single_instance(ledger="daily")
    ],
    ids=["list", "mark-abandoned", "prune", "ledger-command"],
)
def test_a_ledger_command_before_migrate_exits_1_saying_to_run_migrate(unmigrated, argv):
    status, err = manage(unmigrated, *argv)
    assert status == 1, err
    assert f"CommandError: {NOT_MIGRATED.format(alias='default')}" in err
    assert "Run 'manage.py migrate', then try again." in err
    assert "Traceback" not in err
    assert not has_ledger_table()


def test_the_ledgers_api_before_migrate_raises_ledger_not_migrated(unmigrated):
    with pytest.raises(LedgerNotMigrated, match=MIGRATE_HERE) as info:
        JobRun.objects.using(ALIAS).claim("report")
    assert NOT_MIGRATED.format(alias=ALIAS) in str(info.value)
    assert isinstance(info.value, ImproperlyConfigured)
    assert is_free("job:report", ALIAS)  # the claim's lock went with the error
    with pytest.raises(LedgerNotMigrated, match=MIGRATE_HERE):
        with run_once("report", using=ALIAS):
            pytest.fail("the body of a run that could not be recorded ran")
    assert is_free("job:report", ALIAS)
    assert not has_ledger_table()


def test_a_ledger_command_called_before_migrate_raises_command_error(unmigrated):
    with pytest.raises(CommandError, match=MIGRATE_HERE):
        call_command("job_runs", "--database", ALIAS)
    schedule = {"report": {"command": "nightly_report", "every": 60}}
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "tests", "SCHEDULE": schedule}):
        with pytest.raises(CommandError, match=re.escape(NOT_MIGRATED.format(alias=ALIAS))):
            call_command("run_jobs", "--list", "--database", ALIAS)


def test_the_control_room_before_its_migration_says_to_run_migrate(unmigrated):
    # A ledger from before the control room (migrations up to 0004): job_runs exists, the
    # control room's tables don't.
    call_command("migrate", "advisory_lock", "0004", database=ALIAS, verbosity=0)
    assert has_ledger_table()
    schedule = {"report": {"command": "nightly_report", "every": 60}}
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "tests", "SCHEDULE": schedule}):
        for argv in (
            ["run_jobs", "--check"],
            ["run_jobs", "--status"],
            ["run_jobs", "--pause", "report"],
            ["run_jobs", "--run-now", "report"],
            ["job_runs", "--timeline", "report"],
        ):
            with pytest.raises(CommandError, match=MIGRATE_HERE):
                call_command(*argv, "--database", ALIAS)
