"""Every status a job run can have renders in the admin, on every database.

The cases are generated from ``JobRun.Status`` (and the timeline's own outcomes, ``paused``
and ``missed``), plus a status that no version of the app writes (as ``QuerySet.update()``
can store, and a later version of the app may): a status added to the enum is tested
here without anyone typing it, and fails these tests until the admin gives it a colour of
its own. Through Django's test client, with the app's models routed to the database under
test (the staff user and the session stay on "default").
"""

from __future__ import annotations

import datetime
import itertools
import re

import pytest
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.db import connections
from django.test import Client
from django.test import override_settings
from django.urls import reverse
from django.utils.html import escape

from advisory_lock.backends import inspector_for
from advisory_lock.models import JobRun
from advisory_lock.schedule import entries as schedule_entries
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.first_seen import EntrySeen
from advisory_lock.scheduling.timeline import MISSED
from advisory_lock.scheduling.timeline import PAUSED
from tests.databases import AppOn
from tests.schedulers import JOBS
from tests.schedulers import settings_with

CHANGELIST = "/admin/advisory_lock/jobrun/"
SCHEDULE = "admin:advisory_lock_jobrun_schedule"
TIMELINE = "admin:advisory_lock_jobrun_timeline"
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)
#: A status no version of the app writes, with markup in it (shown escaped); it fits the column.
UNKNOWN = "<i>later</i>"
assert len(UNKNOWN) <= JobRun._meta.get_field("status").max_length
assert UNKNOWN not in JobRun.Status.values
STATUSES = [*JobRun.Status, UNKNOWN]
#: What an entry's timeline can show for a slot: a run's status, or no run.
OUTCOMES = [*JobRun.Status, PAUSED, MISSED, UNKNOWN]
ENTRY = "statuses"
BADGE = re.compile(
    r'<span class="jobrun-status" data-status="(?P<status>[^"]*)" '
    r'style="background:(?P<colour>#[0-9a-f]{6});[^"]*">(?P<label>[^<]*)</span>'
)
TIMELINE_ROW = re.compile(
    r'<tr id="slot-[^"]*" class="outcome-[^"]*" '
    r'style="--outcome-colour:(?P<colour>#[0-9a-f]{6});[^"]*">\s*'
    r"<td>(?P<slot>[^<]*)</td>\s*<td>(?P<outcome>[^<]*)</td>"
)


@pytest.fixture
def viewer(using):
    """The test client logged in as staff with the view permission on job runs (a user of
    "default", deleted after the test), with the app's models on ``using``."""
    user = User.objects.create_user("statuses-viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_jobrun"))
    client = Client()
    client.force_login(user)
    schedule = {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}
    try:
        with override_settings(DATABASE_ROUTERS=[AppOn(using)]), settings_with(schedule):
            yield client
    finally:
        user.delete()
        JobControl.objects.using(using).filter(job_name=ENTRY).delete()
        EntrySeen.objects.using(using).filter(job_name=ENTRY).delete()


def stored(ledger, status, period="2026-11-29", started_at=NOW):
    """A run whose status is ``status``, written as ``QuerySet.update()`` does: unchecked."""
    run = ledger.create(job_name=ENTRY, period=period, started_at=started_at, host="web-1")
    ledger.filter(pk=run.pk).update(status=status)
    return run


def badges(page):
    """The status badges of a page: {status as stored: (colour, label as shown)}."""
    found = {}
    for match in BADGE.finditer(page):
        found[match["status"]] = (match["colour"], match["label"])
    return found


def shown(status):
    """How a status is written in a page: its label, or the stored value, escaped."""
    return escape(status.label if isinstance(status, JobRun.Status) else status)


@pytest.mark.parametrize("status", STATUSES, ids=str)
def test_every_status_renders_on_the_runs_list_the_change_page_and_the_schedule(
    using, ledger, viewer, status
):
    run = stored(ledger, status)
    pages = {
        "runs list": viewer.get(CHANGELIST),
        "change page": viewer.get(f"{CHANGELIST}{run.pk}/change/"),
        "schedule": viewer.get(reverse(SCHEDULE)),
    }
    assert {name: page.status_code for name, page in pages.items()} == dict.fromkeys(pages, 200)
    for name in ("runs list", "change page"):
        found = badges(pages[name].content.decode())
        assert list(found) == [escape(status)], name
        [(_, label)] = found.values()
        assert label == shown(status), name
    # The schedule's "Last status" column: the entry's latest run's status, as stored.
    schedule = pages["schedule"].content.decode()
    [row] = [row for row in schedule.split("</tr>") if f"<td>{ENTRY}</td>" in row]
    assert f"<td>{escape(status)}</td>" in row


def test_each_status_has_a_colour_of_its_own_and_an_unknown_one_the_default(using, ledger, viewer):
    for number, status in enumerate(STATUSES):
        stored(ledger, status, period=f"2026-11-{number + 1:02}")
    page = viewer.get(CHANGELIST)
    assert page.status_code == 200
    colours = {status: colour for status, (colour, _) in badges(page.content.decode()).items()}
    assert set(colours) == {escape(status) for status in STATUSES}
    fallback = colours.pop(escape(UNKNOWN))
    missing = [status for status, colour in colours.items() if colour == fallback]
    assert not missing, f"statuses without a colour of their own: {missing}"
    assert len(set(colours.values())) == len(colours), colours


def test_every_outcome_has_its_colour_on_the_timeline(using, ledger, viewer):
    entry = schedule_entries()[ENTRY]
    now = inspector_for(connections[using]).database_now()
    # The latest slots, newest first: one per outcome; the slot of "missed" has no run.
    slots = dict(
        zip(OUTCOMES, itertools.islice(entry.slots_before(now), len(OUTCOMES)), strict=True)
    )
    for outcome, moment in slots.items():
        if outcome not in (PAUSED, MISSED):
            stored(ledger, outcome, period=entry.slot_name(moment), started_at=moment)
    second = datetime.timedelta(seconds=1)
    # A slot with no run is missed once a scheduler has loaded the entry, not before.
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=min(slots.values()) - second)
    for action, at in (("pause", slots[PAUSED] - second), ("resume", slots[PAUSED] + second)):
        JobControl.objects.using(using).create(job_name=ENTRY, action=action, requested_at=at)
    since = min(slots.values()) - second
    page = viewer.get(reverse(TIMELINE), {"entry": ENTRY, "since": since.isoformat()})
    assert page.status_code == 200
    rows = {row["slot"]: row for row in TIMELINE_ROW.finditer(page.content.decode())}
    colours = {}
    for outcome, moment in slots.items():
        row = rows.get(entry.slot_name(moment))
        assert row is not None, f"no coloured row for the {outcome!r} slot"
        assert row["outcome"] == escape(outcome)
        colours[outcome] = row["colour"]
    fallback = colours.pop(UNKNOWN)
    missing = [outcome for outcome, colour in colours.items() if colour == fallback]
    assert not missing, f"outcomes without a colour of their own: {missing}"
