"""Schedule entries stored in the database (``StoredEntry``), on every backend: added,
changed, paused and deleted through the admin (Django's test client, a staff user with the
model's permissions, CSRF checks on) and the ORM, validated with the words of the
``SCHEDULE`` entries' problems, and followed by real ``run_jobs`` processes
(tests/schedulers.py) while they run.

The admin's models are routed to the database under test (``LedgerOn``), the users and the
admin's history staying on ``default``, as a project whose ledger has its own database. On
PostgreSQL the schedulers poll once in 10 minutes (``--poll-interval 600``; once a minute at
most while they hear notifications): a change they take up within a test's hang guard was
heard, not polled for. Every wait is for an event (a row, a line of the scheduler's output)
with a bound that only a hang reaches.
"""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.admin.models import ADDITION
from django.contrib.admin.models import CHANGE
from django.contrib.admin.models import DELETION
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import connections
from django.test import Client
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from advisory_lock import JobRun
from advisory_lock.schedule import MAX_ALERT_AFTER
from advisory_lock.schedule import MAX_RETRIES
from advisory_lock.schedule import SETTING
from advisory_lock.schedule import entry_problems
from advisory_lock.scheduling.control import CHANGE_MARGIN
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import is_paused
from advisory_lock.scheduling.control import pending_requests
from advisory_lock.scheduling.stored import TABLE
from advisory_lock.scheduling.stored import StoredEntry
from advisory_lock.validation import MAX_SECONDS
from tests.schedulers import JOBS
from tests.schedulers import long_interval
from tests.schedulers import server_now
from tests.schedulers import settings_with
from tests.schedulers import wait_for
from tests.test_control_room import command
from tests.test_control_room import controls  # noqa: F401 (a fixture)
from tests.test_control_room import heartbeats  # noqa: F401 (a fixture)
from tests.test_control_room import output
from tests.test_control_room import schedulers  # noqa: F401 (a fixture)

Status = JobRun.Status
Action = JobControl.Action
HANG = 120  # seconds: a guard against a hang, not a timing
ADD = "admin:advisory_lock_storedentry_add"
CHANGELIST = "admin:advisory_lock_storedentry_changelist"
#: Each invalid entry the admin's form can express (its fields are typed: a number field
#: takes numbers, floats for seconds), one for each problem of ``entry_problems`` that it can
#: have. The form's errors are that function's messages for it, naming the table.
INVALID = {
    "no target": {"every": 60},
    "two targets": {"command": "check", "callable": f"{JOBS}.tick", "every": 60},
    "unknown command": {"command": "no_such_command", "every": 60},
    "command args not strings": {"command": "check", "args": [1], "every": 60},
    "callable not importable": {"callable": "no.such.function", "every": 60},
    "task not importable": {"task": "no.such.task", "every": 60},
    "not a task": {"task": f"{JOBS}.tick", "every": 60},
    "kwargs without a task": {"callable": f"{JOBS}.tick", "kwargs": {"a": 1}, "every": 60},
    "no when": {"callable": f"{JOBS}.tick"},
    "cron and every": {"callable": f"{JOBS}.tick", "cron": "* * * * *", "every": 60},
    "cron not five fields": {"callable": f"{JOBS}.tick", "cron": "* * *"},
    "cron out of range": {"callable": f"{JOBS}.tick", "cron": "61 * * * *"},
    "unknown cron alias": {"callable": f"{JOBS}.tick", "cron": "@fortnightly"},
    "every below 1": {"callable": f"{JOBS}.tick", "every": 0.5},
    "every above a century": {"callable": f"{JOBS}.tick", "every": float(MAX_SECONDS + 1)},
    "negative retries": {"callable": f"{JOBS}.tick", "every": 60, "retries": -1},
    "too many retries": {"callable": f"{JOBS}.tick", "every": 60, "retries": MAX_RETRIES + 1},
    "zero timeout": {"callable": f"{JOBS}.tick", "every": 60, "timeout": 0.0},
    "negative grace": {"callable": f"{JOBS}.tick", "every": 60, "grace": -1.0},
    "timeout above a century": {"callable": f"{JOBS}.tick", "every": 60, "timeout": 1e12},
    "alert_after 0": {"callable": f"{JOBS}.tick", "every": 60, "alert_after": 0},
    "alert_after too large": {
        "callable": f"{JOBS}.tick",
        "every": 60,
        "alert_after": MAX_ALERT_AFTER + 1,
    },
}


class LedgerOn:
    """A router that puts the app's tables on one alias (the others on ``default``)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model, **hints):
        return self.alias if model._meta.app_label == "advisory_lock" else None

    db_for_write = db_for_read


@pytest.fixture
def stored(using):
    """The StoredEntry rows of ``using``, empty before and after the test; the app's models
    routed there (the admin's too). Their changes' rows of job_controls, the users and the
    admin's history (on ``default``) are deleted after the test: no test transaction rolls
    back rows on two databases."""
    rows = StoredEntry.objects.using(using)
    changes = JobControl.objects.using(using).filter(action=Action.CHANGE)
    rows.all().delete()
    changes.delete()
    try:
        with override_settings(DATABASE_ROUTERS=[LedgerOn(using)]):
            yield rows
    finally:
        rows.all().delete()
        changes.delete()
        LogEntry.objects.all().delete()
        User.objects.all().delete()


def staff(username: str, *permissions: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in permissions:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


EDITOR = ("view_storedentry", "add_storedentry", "change_storedentry", "delete_storedentry")


def browser(*permissions: str) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff("editor", *permissions))
    return client


def token(client: Client, url: str) -> str:
    """The CSRF token of the form on ``url``."""
    page = client.get(url)
    assert page.status_code == 200, page
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert found, f"no form with a CSRF token on {url}"
    return found.group(1)


def form_data(name: str, options: dict) -> dict[str, str]:
    """What a browser posts for the entry ``name`` with ``options`` (the form's fields)."""
    data = {"name": name, "catch_up": "latest", "retries": "1", "alert_after": "3"}
    for key, value in options.items():
        if key in ("args", "kwargs"):
            data[key] = json.dumps(value)
        elif key == "atomic":
            if value:
                data[key] = "on"
        else:
            data[key] = str(value)
    return data


def save_in_admin(client: Client, name: str, options: dict, row: StoredEntry | None = None):
    """Post the add form (or ``row``'s change form) filled with ``options``."""
    url = reverse("admin:advisory_lock_storedentry_change", args=[row.pk]) if row else reverse(ADD)
    data = {**form_data(name, options), "csrfmiddlewaretoken": token(client, url)}
    return client.post(url, data)


def form_errors(response) -> list[str]:
    form = response.context["adminform"].form
    return sorted(message for messages in form.errors.values() for message in messages)


def ran(rows, name: str, pattern: str):
    """The runs of ``name`` whose slot matches ``pattern``."""
    return [run for run in rows.filter(job_name=name) if re.fullmatch(pattern, run.period)]


SECONDS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"  # a slot of an ``every`` below a minute
MINUTES = r"\d{4}-\d\d-\d\dT\d\d:\d\d"  # a cron slot


def scheduler_argv(using: str) -> tuple[str, ...]:
    """PostgreSQL: a poll interval that no test waits for, so a change is heard."""
    return ("--poll-interval", "600") if using == "postgresql" else ()


# Validation: the words of the SCHEDULE entries' problems, as form errors.


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_entry_gets_the_schedule_entries_problems_as_form_errors(using, stored, case):
    options = INVALID[case]
    response = save_in_admin(browser(*EDITOR), "report", options)
    assert response.status_code == 200  # the form again, with its errors
    expected = entry_problems("report", options, schedule=TABLE)
    assert expected, f"{case}: not a problem of a SCHEDULE entry"
    # The same words as the setting's entry, but for the schedule they name.
    assert expected == [
        problem.replace(SETTING, TABLE, 1) for problem in entry_problems("report", options)
    ]
    assert form_errors(response) == sorted(expected)
    assert not stored.exists() and not LogEntry.objects.exists()


def test_each_problem_is_on_the_field_it_names(using, stored):
    client = browser(*EDITOR)
    response = save_in_admin(client, "report", INVALID["every below 1"])
    form = response.context["adminform"].form
    assert list(form.errors) == ["every"]
    response = save_in_admin(client, "other", INVALID["no target"])
    assert list(response.context["adminform"].form.errors) == ["__all__"]


def test_the_orm_refuses_an_invalid_entry_with_the_same_problems(using, stored):
    options = {"callable": f"{JOBS}.tick", "every": 60, "catch_up": "sometimes"}
    with pytest.raises(ValidationError) as refused:
        stored.create(name="report", **options)
    assert refused.value.messages == entry_problems("report", options, schedule=TABLE)
    assert refused.value.messages == [
        f"{TABLE}['report']['catch_up'] must be one of 'latest', 'all', 'none', not 'sometimes'."
    ]
    assert not stored.exists()


def test_a_name_of_the_settings_schedule_is_refused_as_a_form_error(using, stored):
    with settings_with({"report": {"command": "check", "cron": "@daily"}}):
        client = browser(*EDITOR)
        response = save_in_admin(client, "report", {"callable": f"{JOBS}.tick", "every": 60})
        assert response.status_code == 200
        assert response.context["adminform"].form.errors == {
            "name": [
                f"{SETTING} has an entry named 'report' too: a name is in one schedule only "
                f"(rename this one, or remove that one from the settings)."
            ]
        }
        with pytest.raises(ValidationError):
            stored.create(name="report", callable=f"{JOBS}.tick", every=60)
        # The settings' entries are shown beside the stored ones, read-only.
        page = client.get(reverse(CHANGELIST)).content.decode()
        assert '<tr class="configured-entry"><td>report</td>' in page
        assert "/storedentry/add/" in page  # the stored ones can be added
    assert not stored.exists()


# Permissions and history.


def test_each_change_needs_its_permission_and_is_in_the_admins_history(using, stored):
    viewer = browser("view_storedentry")
    assert viewer.get(reverse(ADD)).status_code == 403
    tick = {"callable": f"{JOBS}.tick", "every": 60}
    adder = Client(enforce_csrf_checks=True)
    adder.force_login(staff("adder", *EDITOR))
    assert save_in_admin(adder, "report", tick).status_code == 302
    row = stored.get(name="report")
    assert (row.callable, row.every) == (f"{JOBS}.tick", 60.0)
    assert row.created_at == row.updated_at
    assert save_in_admin(adder, "report", {**tick, "every": 120}, row).status_code == 302
    row.refresh_from_db()
    assert row.every == 120.0 and row.updated_at >= row.created_at
    # Without the token: Django's CSRF check refuses it.
    delete = reverse("admin:advisory_lock_storedentry_delete", args=[row.pk])
    assert adder.post(delete, {"post": "yes"}).status_code == 403
    assert viewer.post(delete, {"post": "yes"}).status_code == 403
    response = adder.post(delete, {"post": "yes", "csrfmiddlewaretoken": token(adder, delete)})
    assert response.status_code == 302 and not stored.exists()
    logged = LogEntry.objects.filter(user__username="adder").order_by("action_time", "pk")
    assert [entry.action_flag for entry in logged] == [ADDITION, CHANGE, DELETION]
    assert all(entry.content_type.model_class() is StoredEntry for entry in logged)
    assert all(entry.object_repr == "report" for entry in logged)
    # Each change is a row of job_controls too: what the schedulers look for.
    changes = JobControl.objects.using(using).filter(action=Action.CHANGE)
    assert list(changes.values_list("job_name", flat=True)) == ["report"] * 3


def test_pause_and_resume_in_the_admin_need_the_pause_permission_and_are_logged(
    using,
    stored,
    controls,  # noqa: F811 (the fixture)
):
    row = stored.create(name="report", callable=f"{JOBS}.tick", every=60)
    editor = browser(*EDITOR)
    changelist = reverse(CHANGELIST)
    page = editor.get(changelist).content.decode()
    assert 'value="pause"' not in page  # not offered without advisory_lock.pause_job
    operator = Client(enforce_csrf_checks=True)
    operator.force_login(staff("operator", "view_storedentry", "pause_job"))
    assert 'value="pause"' in operator.get(changelist).content.decode()

    def act(client: Client, action: str):
        return client.post(
            changelist,
            {
                "action": action,
                "_selected_action": [row.pk],
                "csrfmiddlewaretoken": token(client, changelist),
            },
        )

    act(editor, "pause")
    assert not is_paused(using, "report")
    assert act(operator, "pause").status_code == 302
    assert is_paused(using, "report")
    assert '<td class="field-state">paused</td>' in operator.get(changelist).content.decode()
    assert act(operator, "resume").status_code == 302
    assert not is_paused(using, "report")
    logged = LogEntry.objects.filter(user__username="operator").order_by("action_time", "pk")
    assert [entry.get_change_message() for entry in logged] == [
        "Paused the scheduled entry 'report'.",
        "Resumed the scheduled entry 'report'.",
    ]
    assert [row.action for row in JobControl.objects.using(using).order_by("pk")] == [
        Action.CHANGE,  # its creation
        Action.PAUSE,
        Action.RESUME,
    ]


# Live schedulers.


def test_a_live_scheduler_runs_an_entry_added_in_the_admin_then_its_new_schedule_then_none(
    using,
    ledger,
    stored,
    schedulers,  # noqa: F811 (the fixture)
):
    # A settings entry beside: what the scheduler does meanwhile shows it has moved on.
    beat = {"beat": {"callable": f"{JOBS}.tick", "every": 1}}
    with settings_with(beat):
        process = schedulers.start(beat, *scheduler_argv(using))
        beats = ledger.filter(job_name="beat", status=Status.SUCCEEDED)
        wait_for(beats.exists, "the settings' entry running", HANG)
        client = browser(*EDITOR)
        added = save_in_admin(client, "added", {"callable": f"{JOBS}.tick", "every": 1})
        assert added.status_code == 302
        wait_for(lambda: "stored entries added: added." in output(schedulers, process), "taken up")
        successes = ledger.filter(job_name="added", status=Status.SUCCEEDED)
        wait_for(lambda: successes.count() >= 2, "two runs of the added entry", HANG)
        assert len(ran(ledger, "added", SECONDS)) == ledger.filter(job_name="added").count()

        # Changed to a cron entry: its slots are minutes from then on.
        row = stored.get(name="added")
        changed = save_in_admin(
            client, "added", {"callable": f"{JOBS}.tick", "cron": "* * * * *"}, row
        )
        assert changed.status_code == 302
        wait_for(
            lambda: "stored entries changed: added." in output(schedulers, process), "taken up"
        )
        wait_for(lambda: ran(ledger, "added", MINUTES), "a run of the new schedule", HANG)
        before = len(ran(ledger, "added", SECONDS))
        mark = beats.count()
        wait_for(lambda: beats.count() >= mark + 3, "three more runs of the other entry", HANG)
        assert len(ran(ledger, "added", SECONDS)) == before  # the old schedule's are over

        # Deleted: no more runs.
        delete = reverse("admin:advisory_lock_storedentry_delete", args=[row.pk])
        deleted = client.post(
            delete, {"post": "yes", "csrfmiddlewaretoken": token(client, delete)}
        )
        assert deleted.status_code == 302
        wait_for(
            lambda: "stored entries removed: added." in output(schedulers, process), "taken up"
        )
        attempts = ledger.filter(job_name="added").count()
        mark = beats.count()
        wait_for(lambda: beats.count() >= mark + 3, "three more runs of the other entry", HANG)
        assert ledger.filter(job_name="added").count() == attempts


def test_a_live_scheduler_runs_an_entry_created_with_the_orm_with_nothing_in_the_settings(
    using,
    ledger,
    stored,
    schedulers,  # noqa: F811 (the fixture)
):
    process = schedulers.start({}, *scheduler_argv(using))
    wait_for(
        lambda: "only the stored entries" in (schedulers.folder / "run_jobs.0.err").read_text(),
        "started",
    )
    for name in ("one", "two"):
        stored.create(name=name, callable=f"{JOBS}.tick", every=1)
    for name in ("one", "two"):
        runs = ledger.filter(job_name=name, status=Status.SUCCEEDED)
        wait_for(lambda runs=runs: runs.count() >= 2, f"two runs of {name}", HANG)
    stored.filter(name="one").delete()  # a queryset's delete is heard too
    wait_for(lambda: "stored entries removed: one." in output(schedulers, process), "taken up")
    attempts = ledger.filter(job_name="one").count()
    twos = ledger.filter(job_name="two", status=Status.SUCCEEDED)
    mark = twos.count()
    wait_for(lambda: twos.count() >= mark + 3, "three more runs of the other entry", HANG)
    assert ledger.filter(job_name="one").count() == attempts


def test_a_run_of_an_entry_deleted_while_it_runs_ends_recorded_by_its_row(
    using,
    ledger,
    stored,
    schedulers,  # noqa: F811 (the fixture)
):
    process = schedulers.start({}, *scheduler_argv(using))
    stored.create(name="long", callable=f"{JOBS}.until_go", every=long_interval(using))
    running = ledger.filter(job_name="long", status=Status.RUNNING)
    wait_for(running.exists, "the run going on", HANG)
    stored.get(name="long").delete()
    wait_for(lambda: "stored entries removed: long." in output(schedulers, process), "taken up")
    assert running.exists()  # not stopped: it ends as a run of the entry it was given
    (schedulers.folder / "go").touch()
    [run] = wait_for(
        lambda: list(ledger.filter(job_name="long", status=Status.SUCCEEDED)), "its end"
    )
    assert ledger.filter(job_name="long").count() == 1
    # The worker records the end before it answers the scheduler, which then says it.
    said = f"run_jobs: long [{run.period}] succeeded."
    wait_for(lambda: said in output(schedulers, process), "the scheduler's word on its end")


def test_a_stored_entry_whose_name_the_settings_took_is_not_scheduled_and_said_so(
    using,
    ledger,
    stored,
    schedulers,  # noqa: F811 (the fixture)
):
    stored.create(name="twice", callable=f"{JOBS}.fail", every=1)  # no such name in settings yet
    settings_entry = {"twice": {"callable": f"{JOBS}.tick", "every": 1}}
    process = schedulers.start(settings_entry, *scheduler_argv(using))
    said = f"run_jobs: a stored entry is not scheduled: {SETTING} has an entry named 'twice' too"
    wait_for(lambda: said in output(schedulers, process), "said", HANG)
    runs = ledger.filter(job_name="twice")
    wait_for(lambda: runs.filter(status=Status.SUCCEEDED).count() >= 2, "the settings' runs", HANG)
    assert not runs.filter(status=Status.FAILED).exists()  # the stored one (fail) never ran
    assert output(schedulers, process).count(said) == 1


def test_the_command_line_knows_the_stored_entries(using, stored, controls):  # noqa: F811
    stored.create(name="report", callable=f"{JOBS}.tick", every=60)
    status, out, _ = command("run_jobs", "--pause", "report", "--database", using)
    assert (status, out.splitlines()) == (0, ["run_jobs: report paused (fleet-wide)."])
    assert is_paused(using, "report")
    status, out, _ = command("job_runs", "--timeline", "report", "--json", "--database", using)
    assert status == 0 and {slot["outcome"] for slot in json.loads(out)} <= {"paused", "missed"}
    status, out, _ = command("run_jobs", "--list", "--json", "--database", using)
    [listed] = json.loads(out)
    assert (listed["name"], listed["paused"]) == ("report", True)
    with pytest.raises(CommandError, match="nor has job_schedule_entries"):
        command("run_jobs", "--pause", "nope", "--database", using)
    with pytest.raises(CommandError, match="nor has job_schedule_entries"):
        command("job_runs", "--timeline", "nope", "--database", using)


def test_the_look_for_requests_finds_the_changes_of_stored_entries_in_the_same_statement(
    using,
    stored,
    controls,  # noqa: F811 (the fixture)
):
    now = server_now(using)
    since = now - CHANGE_MARGIN
    with CaptureQueriesContext(connections[using]) as idle:
        assert pending_requests(using, now, since) == []
    stored.create(name="report", callable=f"{JOBS}.tick", every=60)
    row = stored.get(name="report")
    row.every = 120
    row.save()
    stored.all().delete()
    now = server_now(using)
    with CaptureQueriesContext(connections[using]) as look:
        found = pending_requests(using, now, since)
    assert [(row.action, row.job_name) for row in found] == [(Action.CHANGE, "report")] * 3
    assert len(idle) == len(look) == 1
    assert pending_requests(using, server_now(using)) == []  # not asked for
