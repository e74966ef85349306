"""The operator's console, pauses explained: ``run_jobs --pause NAME --reason TEXT`` and the
Schedule page's reason field; who paused, when and why on the Schedule page and in
``run_jobs --list``; every pause, resume and run-now request, from the command line or the
admin, listed read-only in the admin with who asked.

On every database: the commands in this process (``call_command``) and, for run now, a real
``run_jobs`` alive (tests/schedulers.py); the admin through Django's test client with its
CSRF checks.
"""

from __future__ import annotations

import datetime
import json
import re

import pytest
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from advisory_lock.scheduling.control import MAX_REASON_LENGTH
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import command_line_user
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.console import REQUESTS
from tests.console import client_of
from tests.console import command
from tests.console import console
from tests.schedulers import JOBS
from tests.schedulers import long_interval
from tests.schedulers import server_now
from tests.schedulers import wait_for

Action = JobControl.Action
ENTRY = "nightly"
SCHEDULE = {ENTRY: {"callable": f"{JOBS}.tick", "every": 3600}}
SCHEDULE_PAGE = "admin:advisory_lock_jobrun_schedule"
CONTROL = "admin:advisory_lock_jobrun_schedule_control"
REASON = "the <feed> is down until 14:00 (INC-42)"


def post_form(client: Client, action: str, reason: str | None = None):
    """POST the Schedule page's form of ENTRY for ``action``, with its CSRF token."""
    page = client.get(reverse(SCHEDULE_PAGE)).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, "the schedule page has no form with a CSRF token"
    data = {"entry": ENTRY, "action": action, "csrfmiddlewaretoken": token[1]}
    if reason is not None:
        data["reason"] = reason
    return client.post(reverse(CONTROL), data)


def operator(username: str) -> Client:
    client = client_of(username, "view_jobrun", "view_jobcontrol", "pause_job", "run_job_now")
    client.handler.enforce_csrf_checks = True
    return client


def test_run_jobs_pause_keeps_the_reason_and_list_says_who_paused_when_and_why(using, ledger):
    with console(using, SCHEDULE):
        before = server_now(using)
        status, out, _ = command(
            "run_jobs", "--pause", ENTRY, "--reason", REASON, "--database", using
        )
        after = server_now(using)
        assert (status, out.splitlines()) == (0, [f"run_jobs: {ENTRY} paused (fleet-wide)."])
        [pause] = JobControl.objects.using(using).all()
        assert (pause.action, pause.reason) == (Action.PAUSE, REASON)
        assert pause.requested_by == command_line_user()
        _, out, _ = command("run_jobs", "--list", "--json", "--database", using)
        [row] = json.loads(out)
        _, table, _ = command("run_jobs", "--list", "--database", using)
    assert (row["paused"], row["paused_by"], row["pause_reason"]) == (
        True,
        pause.requested_by,
        REASON,
    )
    assert before <= datetime.datetime.fromisoformat(row["paused_at"]) <= after
    assert table.splitlines()[-1] == (
        f"{ENTRY}: paused by {pause.requested_by} at {row['paused_at']}: {REASON}"
    )


def test_a_resumed_entry_lists_no_pause_and_the_resume_keeps_its_reason(using, ledger):
    with console(using, SCHEDULE):
        command("run_jobs", "--pause", ENTRY, "--database", using)
        _, out, _ = command("run_jobs", "--list", "--database", using)
        assert out.splitlines()[-1] == (
            f"{ENTRY}: paused by {command_line_user()} at "
            f"{JobControl.objects.using(using).get().requested_at.isoformat()} "
            f"(no reason given)."
        )
        command("run_jobs", "--resume", ENTRY, "--reason", "fixed", "--database", using)
        _, out, _ = command("run_jobs", "--list", "--json", "--database", using)
        [row] = json.loads(out)
        resume = JobControl.objects.using(using).get(action=Action.RESUME)
    assert (row["paused"], row["paused_by"], row["paused_at"], row["pause_reason"]) == (
        False, None, None, None
    )  # fmt: skip
    assert resume.reason == "fixed"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--reason", "why"], "--reason goes with --pause, --resume or --run-now."),
        (["--list", "--reason", "why"], "--reason goes with --pause, --resume or --run-now."),
        (["--pause", ENTRY, "--reason", "x" * (MAX_REASON_LENGTH + 1)], "holds 500"),
        (["--pause", ENTRY, "--reason", "a\x00b"], "contains NUL"),
    ],
    ids=["alone", "with --list", "too long", "NUL"],
)
def test_a_reason_that_cant_be_kept_is_refused_and_nothing_is_paused(using, ledger, argv, error):
    with console(using, SCHEDULE):
        with pytest.raises(CommandError, match=re.escape(error)) as refused:
            command("run_jobs", *argv, "--database", using)
        # A value the column can't hold is a usage error (2), as for every text option.
        assert refused.value.returncode == (1 if "goes with" in error else 2)
        assert not JobControl.objects.using(using).exists()


def test_the_schedule_page_pauses_with_a_reason_and_says_who_paused_when_and_why(using, ledger):
    with console(using, SCHEDULE):
        alice = operator("alice")
        assert post_form(alice, "pause", REASON).status_code == 302
        [pause] = JobControl.objects.using(using).all()
        page = alice.get(reverse(SCHEDULE_PAGE)).content.decode()
    assert (pause.requested_by, pause.reason) == ("admin user 'alice'", REASON)
    [row] = [row for row in page.split("</tr>") if f"<td>{ENTRY}</td>" in row]
    assert '<strong class="paused">paused</strong>' in row
    assert f"by {escape(pause.requested_by)}, " in row
    assert f'<q class="pause-reason">{escape(REASON)}</q>' in row


def test_the_schedule_page_refuses_a_reason_too_long_and_pauses_nothing(using, ledger):
    with console(using, SCHEDULE):
        alice = operator("alice")
        response = post_form(alice, "pause", "x" * (MAX_REASON_LENGTH + 1))
        assert response.status_code == 302
        page = alice.get(response.url).content.decode()
        assert "Nothing was done: the reason" in page and "holds 500" in page
        assert not JobControl.objects.using(using).exists()


def test_every_request_from_the_command_line_or_the_admin_is_listed_with_who_asked(
    using, ledger, schedulers
):
    schedule = {ENTRY: {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    with console(using, schedule):
        process = schedulers.start(schedule)  # alive: a run-now request is taken
        try:
            beating = SchedulerHeartbeat.objects.using(using).filter(pid=process.pid)
            wait_for(lambda: beating.exists() or process.poll() is not None, "a heartbeat")
            assert process.poll() is None
            alice = operator("alice")
            cli = command_line_user()
            command(
                "run_jobs", "--pause", ENTRY, "--reason", "from the shell", "--database", using
            )
            assert post_form(alice, "resume", "back").status_code == 302
            assert post_form(alice, "run_now", "one more").status_code == 302
            command("run_jobs", "--run-now", ENTRY, "--database", using)
            assert post_form(alice, "pause").status_code == 302
            requests = list(JobControl.objects.using(using).order_by("requested_at", "pk"))
            page = alice.get(REQUESTS).content.decode()
            pages = {
                row.pk: alice.get(f"{REQUESTS}{row.pk}/change/").content.decode()
                for row in requests
            }
            add = alice.get(f"{REQUESTS}add/")
            change = alice.post(f"{REQUESTS}{requests[0].pk}/change/", {"reason": "edited"})
            delete = alice.post(f"{REQUESTS}{requests[0].pk}/delete/", {"post": "yes"})
            viewer = client_of("viewer", "view_jobrun")
            refused = viewer.get(REQUESTS)
        finally:
            schedulers.kill_all()
        kept = list(JobControl.objects.using(using).order_by("requested_at", "pk"))
    assert [(row.action, row.requested_by, row.reason) for row in requests] == [
        (Action.PAUSE, cli, "from the shell"),
        (Action.RESUME, "admin user 'alice'", "back"),
        (Action.RUN_NOW, "admin user 'alice'", "one more"),
        (Action.RUN_NOW, cli, ""),
        (Action.PAUSE, "admin user 'alice'", ""),
    ]
    for row in requests:
        assert f"{REQUESTS}{row.pk}/change/" in page
        assert escape(row.requested_by) in page and escape(row.requested_by) in pages[row.pk]
    assert "from the shell" in page and "one more" in page
    # Read-only: no add, change or delete, whoever asks; the rows are the entries' history.
    assert f"{REQUESTS}add/" not in page and 'name="_save"' not in pages[requests[0].pk]
    assert (add.status_code, change.status_code, delete.status_code) == (403, 403, 403)
    assert [(row.pk, row.reason) for row in kept] == [(row.pk, row.reason) for row in requests]
    # Staff without the view permission on the requests don't see them.
    assert refused.status_code == 403


#: Every action a request can have, and one that no version of the app writes (markup in it).
ACTIONS = [*JobControl.Action, "<i>later</i>"]


@pytest.mark.parametrize("action", ACTIONS)
def test_every_requests_action_renders_in_the_requests_admin_and_on_the_schedule_page(
    using, ledger, action
):
    # A request of each action (the stored entries' "change" included, added after the
    # requests' admin), and one of an action the app does not know: no page fails on it.
    with console(using, SCHEDULE):
        row = JobControl.objects.using(using).create(
            job_name=ENTRY, action=action, requested_at=server_now(using),
            requested_by="someone", reason="why not",
        )  # fmt: skip
        alice = client_of("alice", "view_jobrun", "view_jobcontrol")
        listed = alice.get(REQUESTS)
        filtered = alice.get(REQUESTS, {"action": action})
        page = alice.get(f"{REQUESTS}{row.pk}/change/")
        schedule = alice.get(reverse(SCHEDULE_PAGE))
    assert (listed.status_code, filtered.status_code, page.status_code) == (200, 200, 200)
    assert schedule.status_code == 200
    label = dict(JobControl.Action.choices).get(action, action)
    assert escape(label) in listed.content.decode()
    assert escape(label) in page.content.decode()
