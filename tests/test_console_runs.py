"""The operator's console, the runs: why a run failed, from the runs list, the run's page and
``job_runs --json``; one time format on every page; the timeline's rows link to their runs.

On every database, through Django's test client (the staff users and their sessions stay on
"default", the app's models are routed to the database under test). The cases over statuses
are generated from ``JobRun.Status``, plus one that no version of the app writes.
"""

from __future__ import annotations

import datetime
import json
import re
import zoneinfo

import pytest
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings
from django.urls import reverse
from django.utils.html import escape

from advisory_lock.ledger import first_line
from advisory_lock.ledger import format_error
from advisory_lock.models import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import set_paused
from advisory_lock.scheduling.first_seen import EntrySeen
from tests.console import CHANGELIST
from tests.console import REQUESTS
from tests.console import SECOND
from tests.console import client_of
from tests.console import command
from tests.console import console
from tests.console import run
from tests.schedulers import JOBS
from tests.schedulers import minute
from tests.schedulers import server_now
from tests.test_locks import held_elsewhere

#: A status no version of the app writes, with markup in it (shown escaped).
UNKNOWN = "<i>later</i>"
STATUSES = [*JobRun.Status, UNKNOWN]
NOW = datetime.datetime(2026, 11, 29, 3, 0, 7, 123456, tzinfo=datetime.timezone.utc)
ENTRY = "console"
SCHEDULE = {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}
#: Every time the console shows: local, to the second, no microseconds.
TIME = re.compile(r"\b\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\b")
KOLKATA = zoneinfo.ZoneInfo("Asia/Kolkata")


def a_traceback(message: str) -> str:
    """A failed run's error as the ledger stores it: the traceback of a chained exception."""
    try:
        try:
            {}["missing"]
        except KeyError:
            raise ValueError(message) from None
    except ValueError as error:
        return format_error(error)


def zone_tables_loaded(using: str) -> bool:
    """Can the database convert to a named time zone (MariaDB, MySQL: only with the time zone
    tables loaded; the others always can)?"""
    connection = connections[using]
    if connection.vendor != "mysql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONVERT_TZ('2026-01-01 00:00:00', 'UTC', 'Asia/Kolkata')")
        return cursor.fetchone()[0] is not None


def cells(page: str, row_pk: int) -> str:
    """The changelist row of the run ``row_pk`` (from its link to the end of the row)."""
    start = page.index(f'href="{CHANGELIST}{row_pk}/change/')
    return page[start : page.index("</tr>", start)]


@pytest.mark.parametrize("status", STATUSES, ids=str)
def test_the_runs_list_shows_each_runs_attempt_duration_host_and_what_failed(
    using, ledger, status
):
    error = a_traceback("the <feed> timed out\nafter 3 tries")
    row = run(ledger, ENTRY, "2026-11-29T03:00", status, NOW, attempt=2, error=error)
    with console(using, SCHEDULE):
        viewer = client_of("viewer", "view_jobrun")
        page = viewer.get(CHANGELIST)
        assert page.status_code == 200
        shown = cells(page.content.decode(), row.pk)
    assert 'data-status="' in shown and escape(status) in shown
    assert '<td class="field-attempt">2</td>' in shown
    ended = status not in (JobRun.Status.RUNNING, JobRun.Status.ENQUEUED)
    assert ('<td class="field-took">2.0 s</td>' if ended else 'field-took">-<') in shown
    assert "web-1 · 4242" in shown
    # The exception's first line, escaped (not the traceback's "Traceback (most recent ...").
    assert first_line(error) == "ValueError: the <feed> timed out"
    assert f'<span title="{escape(first_line(error))}">' in shown
    assert "Traceback (most" not in shown and "after 3 tries" not in shown


def test_a_runs_page_shows_its_traceback_under_its_status(using, ledger):
    error = a_traceback("boom")
    row = run(ledger, ENTRY, "2026-11-29T03:00", JobRun.Status.FAILED, NOW, error=error)
    with console(using, SCHEDULE):
        page = client_of("viewer", "view_jobrun").get(f"{CHANGELIST}{row.pk}/change/")
        text = page.content.decode()
    assert page.status_code == 200
    status, trace, host = (text.index(label) for label in ("Status:", "Traceback:", "Host:"))
    assert status < trace < host
    assert escape("ValueError: boom") in text


def test_a_run_without_an_error_shows_a_dash(using, ledger):
    row = run(ledger, ENTRY, "2026-11-29T03:00", JobRun.Status.SUCCEEDED, NOW)
    with console(using, SCHEDULE):
        page = client_of("viewer", "view_jobrun").get(CHANGELIST).content.decode()
    assert '<td class="field-error_line">—</td>' in cells(page, row.pk)


@override_settings(TIME_ZONE="Asia/Kolkata")  # +05:30 all year
def test_every_page_shows_times_one_way_local_to_the_second_and_names_the_zone_once(using, ledger):
    started = server_now(using) - 30 * SECOND  # with microseconds, as the server gives it
    row = run(ledger, ENTRY, minute(started), JobRun.Status.FAILED, started, error="x")
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=started - 60 * SECOND)
    with console(using, SCHEDULE, LEDGER_TIME_ZONE="UTC"):  # the slots' names: UTC
        set_paused(using, ENTRY, True, "alice@ops (pid 1)", "the feed is down")
        admin = client_of("root", superuser=True)
        since = (started - 60 * SECOND).replace(microsecond=0).isoformat()
        pages = {
            "run page": admin.get(f"{CHANGELIST}{row.pk}/change/"),
            "schedule": admin.get(reverse("admin:advisory_lock_jobrun_schedule")),
            "timeline": admin.get(
                reverse("admin:advisory_lock_jobrun_timeline"), {"entry": ENTRY, "since": since}
            ),
            "requests": admin.get(REQUESTS),
            "locks": admin.get(reverse("admin:advisory_lock_jobrun_locks")),
        }
        # The runs list's date hierarchy truncates dates in the zone on the server, which
        # MariaDB and MySQL can do only with their time zone tables loaded (Django's
        # "Time zones" documentation; mysql_tzinfo_to_sql).
        if zone_tables_loaded(using):
            pages["runs list"] = admin.get(CHANGELIST)
        texts = {name: page.content.decode() for name, page in pages.items()}
        [pause] = JobControl.objects.using(using).all()
    assert {name: page.status_code for name, page in pages.items()} == dict.fromkeys(pages, 200)
    for name, text in texts.items():
        assert text.count("Times in Asia/Kolkata") == 1, name
        assert f".{started.microsecond:06}" not in text, name
        assert "a.m." not in text and "p.m." not in text, name
    local = started.astimezone(KOLKATA)
    for name in {"runs list", "run page", "schedule", "timeline"} & set(texts):
        assert f"{local:%Y-%m-%d %H:%M:%S}" in texts[name], name
    assert f"{local + 2 * SECOND:%Y-%m-%d %H:%M:%S}" in texts["run page"]  # finished
    # The pause: by the database server's clock, shown in the zone like every other time.
    paused_at = f"{pause.requested_at.astimezone(KOLKATA):%Y-%m-%d %H:%M:%S}"
    assert TIME.findall(texts["requests"].split('id="result_list"', 1)[1]) == [paused_at]
    assert paused_at in texts["schedule"]


def test_job_runs_json_lists_the_runs_newest_first_with_their_errors(using, ledger):
    older = run(ledger, "a", "2026-11-28", JobRun.Status.FAILED, NOW - 60 * SECOND, error="x")
    newer = run(ledger, "b", "2026-11-29", JobRun.Status.SUCCEEDED, NOW, attempt=3)
    status, out, _ = command("job_runs", "--json", "--database", using)
    assert status == 0
    listed = json.loads(out)
    assert listed == [
        {"id": newer.pk, "job": "b", "period": "2026-11-29", "status": "succeeded",
         "attempt": 3, "started_at": NOW.isoformat(),
         "finished_at": (NOW + 2 * SECOND).isoformat(), "duration": 2.0, "host": "web-1",
         "pid": 4242, "error": "", "task_id": None},
        {"id": older.pk, "job": "a", "period": "2026-11-28", "status": "failed",
         "attempt": 1, "started_at": (NOW - 60 * SECOND).isoformat(),
         "finished_at": (NOW - 58 * SECOND).isoformat(), "duration": 2.0, "host": "web-1",
         "pid": 4242, "error": "x", "task_id": None},
    ]  # fmt: skip
    _, out, _ = command("job_runs", "--json", "--status", "failed", "--database", using)
    assert [row["id"] for row in json.loads(out)] == [older.pk]
    _, out, _ = command("job_runs", "--json", "--job", "b", "--limit", "1", "--database", using)
    assert [row["id"] for row in json.loads(out)] == [newer.pk]


def test_job_runs_table_shows_what_failed(using, ledger):
    run(ledger, "a", "2026-11-28", JobRun.Status.FAILED, NOW, error=a_traceback("the feed"))
    _, out, _ = command("job_runs", "--database", using)
    header, *rows = out.splitlines()
    assert header.split()[-2:] == ["try", "error"]
    assert rows[0].endswith("ValueError: the feed")


@pytest.mark.parametrize("other", ["--prune", "--mark-abandoned"])
def test_job_runs_json_does_not_go_with_prune_or_mark_abandoned(using, other):
    with pytest.raises(CommandError, match="--json goes with the list of runs"):
        command("job_runs", "--json", other, "--database", using)


def test_each_timeline_row_that_ran_links_to_its_run(using, ledger):
    now = server_now(using).replace(second=0, microsecond=0)
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=now - 4 * 60 * SECOND)
    ran = {
        ago: run(ledger, ENTRY, minute(now - ago * 60 * SECOND), status, now - ago * 60 * SECOND)
        for ago, status in ((3, JobRun.Status.FAILED), (1, JobRun.Status.SUCCEEDED))
    }
    with console(using, SCHEDULE):
        since = (now - 3 * 60 * SECOND - SECOND).isoformat()
        page = client_of("viewer", "view_jobrun").get(
            reverse("admin:advisory_lock_jobrun_timeline"), {"entry": ENTRY, "since": since}
        )
    text = page.content.decode()
    rows = {
        slot: row
        for slot, row in re.findall(r'<tr id="slot-([^"]+)"(.*?)</tr>', text, flags=re.DOTALL)
    }
    for row in ran.values():
        url = reverse("admin:advisory_lock_jobrun_change", args=[row.pk])
        assert f'href="{url}"' in rows[row.period]
    missed = minute(now - 2 * 60 * SECOND)
    assert "missed" in rows[missed] and 'class="run-link"' not in rows[missed]


def test_the_locks_page_puts_how_long_and_terminate_before_the_wide_columns(using, ledger):
    """At 1280 px beside the sidebar, the columns an operator acts on come first: held /
    waited and the superuser's Terminate link before the session and the query, which are
    last and cut (the table scrolls in its box, not the page)."""
    with console(using, SCHEDULE), held_elsewhere("console:stuck", using):
        page = client_of("root", superuser=True).get(
            reverse("admin:advisory_lock_jobrun_locks"), {"using": using}
        )
        text = page.content.decode()
    assert page.status_code == 200
    headers = re.findall(r"<th>([^<]*)</th>", text.split('id="held-locks"', 1)[1])
    assert headers == [
        "Name", "State", "Held / waited", "Holder", "Process", "", "Latest run", "Session",
        "Query",
    ]  # fmt: skip
    [row] = [row for row in text.split("<tr>") if "console:stuck" in row]
    held, terminate, query = (
        row.index(part) for part in ('class="held-for"', "Terminate holder", 'class="query"')
    )
    assert held < terminate < query
    assert re.search(r'<td class="held-for">\d+ s</td>', row)
    assert '<div class="held-locks-box">' in text
