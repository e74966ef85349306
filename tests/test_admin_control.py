"""The admin's control room: live schedulers, pause / resume and run now, the slot timeline.

Through Django's test client with CSRF checks on (as a browser meets them): each action is a
POST carrying the form's CSRF token, needs its own permission, and lands in the admin's
history. The scheduler that acts on a run-now request is a real ``run_jobs`` process
(tests/schedulers.py's ``Schedulers``) on the SQLite test database the admin uses.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from advisory_lock.models import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import is_paused
from advisory_lock.scheduling.first_seen import EntrySeen
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.schedulers import JOBS
from tests.schedulers import Schedulers
from tests.schedulers import long_interval
from tests.schedulers import settings_with

pytestmark = pytest.mark.django_db(transaction=True)
SCHEDULE = "admin:advisory_lock_jobrun_schedule"
CONTROL = "admin:advisory_lock_jobrun_schedule_control"
TIMELINE = "admin:advisory_lock_jobrun_timeline"
UTC = datetime.timezone.utc
HANG = 120  # seconds: a guard against a hang, not a timing


def staff(username, *permissions):
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in permissions:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def browser(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def post_form(client: Client, entry: str, action: str):
    """POST the schedule page's form for ``entry`` and ``action``, with its CSRF token."""
    page = client.get(reverse(SCHEDULE)).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, "the schedule page has no form with a CSRF token"
    return client.post(
        reverse(CONTROL),
        {"entry": entry, "action": action, "csrfmiddlewaretoken": token.group(1)},
    )


@pytest.fixture(autouse=True)
def no_heartbeats():
    """No scheduler left alive by an earlier test (one counts as alive for 3 s after it
    died); the test's own are flushed after it."""
    SchedulerHeartbeat.objects.all().delete()


@pytest.fixture
def schedule():
    with settings_with({"poll": {"callable": f"{JOBS}.tick", "every": 3600}}):
        yield


def test_pause_and_resume_need_the_permission_a_csrf_token_and_are_logged(schedule):
    viewer = browser(staff("viewer", "view_jobrun"))
    assert "Pause</button>" not in viewer.get(reverse(SCHEDULE)).content.decode()
    assert viewer.post(reverse(CONTROL), {"entry": "poll", "action": "pause"}).status_code == 403
    operator = browser(staff("operator", "view_jobrun", "pause_job"))
    # Without the token: Django's CSRF check refuses it, nothing changes.
    refused = operator.post(reverse(CONTROL), {"entry": "poll", "action": "pause"})
    assert refused.status_code == 403 and not is_paused("default", "poll")
    assert operator.get(reverse(CONTROL)).status_code == 405  # a GET changes nothing
    assert post_form(operator, "poll", "pause").status_code == 302
    assert is_paused("default", "poll")
    page = operator.get(reverse(SCHEDULE)).content.decode()
    assert '<strong class="paused">paused</strong>' in page and "Resume</button>" in page
    # Allowed to pause, not to run now.
    assert post_form(operator, "poll", "run_now").status_code == 403
    assert post_form(operator, "poll", "resume").status_code == 302
    assert not is_paused("default", "poll")
    logged = LogEntry.objects.filter(user__username="operator").order_by("action_time")
    assert [entry.get_change_message() for entry in logged] == [
        "Paused the scheduled entry 'poll'.",
        "Resumed the scheduled entry 'poll'.",
    ]
    assert all(entry.content_type.model_class() is JobControl for entry in logged)
    actions = JobControl.objects.order_by("requested_at", "pk")
    assert [(row.action, row.requested_by) for row in actions] == [
        ("pause", "admin user 'operator'"),
        ("resume", "admin user 'operator'"),
    ]


def test_an_unknown_entry_or_action_changes_nothing(schedule):
    operator = browser(staff("operator", "view_jobrun", "pause_job", "run_job_now"))
    response = post_form(operator, "nope", "pause")
    assert response.status_code == 302
    page = operator.get(reverse(SCHEDULE)).content.decode()
    assert "has no entry named &#x27;nope&#x27;" in page
    assert post_form(operator, "poll", "delete").status_code == 403
    assert not JobControl.objects.exists() and not LogEntry.objects.exists()


def test_run_now_without_a_live_scheduler_says_so_and_records_nothing(schedule):
    operator = browser(staff("runner", "view_jobrun", "run_job_now"))
    page = operator.get(reverse(SCHEDULE)).content.decode()
    assert 'id="no-scheduler"' in page and "No scheduler alive" in page
    assert post_form(operator, "poll", "run_now").status_code == 302
    page = operator.get(reverse(SCHEDULE)).content.decode()
    assert "nobody would run &#x27;poll&#x27;, so it was not requested" in page
    assert not JobControl.objects.exists() and not LogEntry.objects.exists()


def test_run_now_is_run_by_a_live_scheduler_in_a_slot_of_its_own(tmp_path):
    every = long_interval("default")
    entry = {"callable": f"{JOBS}.tick", "every": every, "catch_up": "none"}
    schedulers = Schedulers("default", tmp_path)
    try:
        with settings_with({"poll": entry}):
            schedulers.start({"poll": entry})
            # The scheduler is live once its heartbeat row is there, and its first pass has
            # run the entry's current slot (a new entry's first run) once that row succeeded.
            deadline = time.monotonic() + HANG
            while not (
                SchedulerHeartbeat.objects.exists()
                and JobRun.objects.filter(job_name="poll", status="succeeded").exists()
            ):
                assert time.monotonic() < deadline, "no scheduler came up"
                time.sleep(0.05)
            operator = browser(staff("runner", "view_jobrun", "run_job_now"))
            page = operator.get(reverse(SCHEDULE)).content.decode()
            assert "Live schedulers (1)" in page and f"pid {schedulers.started[0].pid}" in page
            assert post_form(operator, "poll", "run_now").status_code == 302
            [request] = JobControl.objects.filter(action="run_now")
            assert request.slot.startswith("manual:")
            while not JobRun.objects.filter(period=request.slot, status="succeeded").exists():
                assert time.monotonic() < deadline, "the requested run never succeeded"
                time.sleep(0.05)
            [logged] = LogEntry.objects.all()
            assert logged.user.username == "runner"
            assert logged.get_change_message() == (
                f"Requested a run of the scheduled entry 'poll' now (slot {request.slot})."
            )
            scheduled = JobRun.objects.filter(job_name="poll").exclude(period=request.slot)
            assert scheduled.count() == 1  # the scheduled slot ran once, and only it
            timeline = operator.get(reverse(TIMELINE), {"entry": "poll"}).content.decode()
            assert f"<td>{request.slot}</td>" in timeline and "succeeded: 2" in timeline
    finally:
        schedulers.kill_all()


def test_the_timeline_page_shows_each_slot_with_its_outcome():
    now = datetime.datetime.now(UTC).replace(second=0, microsecond=0)
    minute = datetime.timedelta(minutes=1)
    ran = now - 3 * minute
    EntrySeen.objects.create(job_name="poll", first_seen=now - 6 * minute)
    failed = JobRun.objects.create(
        job_name="poll", period=f"{ran:%Y-%m-%dT%H:%M}", status="failed", started_at=ran,
        duration=datetime.timedelta(seconds=2), host="web-9",
    )  # fmt: skip
    with settings_with({"poll": {"callable": f"{JOBS}.tick", "every": 60}}):
        viewer = browser(staff("viewer", "view_jobrun"))
        since = (now - 5 * minute).isoformat()
        page = viewer.get(reverse(TIMELINE), {"entry": "poll", "since": since}).content.decode()
        assert f"<td>{ran:%Y-%m-%dT%H:%M}</td>\n        <td>failed</td>" in page
        assert "<td>web-9</td>" in page and "missed: " in page
        run_page = reverse("admin:advisory_lock_jobrun_change", args=[failed.pk])
        assert f'<a class="run-link" href="{run_page}">run {failed.pk}</a>' in page
        schedule = viewer.get(reverse(SCHEDULE)).content.decode()
        assert f"{reverse(TIMELINE)}?entry=poll" in schedule
        bad = viewer.get(reverse(TIMELINE), {"entry": "poll", "since": "yesterday"})
        assert 'class="errornote"' in bad.content.decode()
        nobody = browser(staff("nobody"))
        assert nobody.get(reverse(TIMELINE), {"entry": "poll"}).status_code == 403
