"""The operator's console, health at a glance: each entry's last 20 slots on the Schedule page
(each linking to its run or slot), its success rate, the flag of an entry whose last
``alert_after`` slots failed (and ``job_runs --overdue`` saying so), and no ``missed`` slot
from before a scheduler first loaded the entry (which each ``run_jobs`` records once).

On every database; the Schedule page through Django's test client, ``run_jobs`` as real
processes (tests/schedulers.py).
"""

from __future__ import annotations

import datetime
import html
import json
import re

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from advisory_lock.ledger import first_line
from advisory_lock.models import JobRun
from advisory_lock.schedule import MAX_ALERT_AFTER
from advisory_lock.schedule import entry_problems
from advisory_lock.scheduling.first_seen import BATCH_SIZE
from advisory_lock.scheduling.first_seen import EntrySeen
from advisory_lock.scheduling.first_seen import FirstSeen
from advisory_lock.scheduling.health import STRIP
from tests.console import MINUTE
from tests.console import SECOND
from tests.console import client_of
from tests.console import command
from tests.console import console
from tests.console import run
from tests.schedulers import JOBS
from tests.schedulers import minute
from tests.schedulers import server_now
from tests.schedulers import wait_for

S, F, A, R = (JobRun.Status.SUCCEEDED, JobRun.Status.FAILED, JobRun.Status.ABANDONED,
              JobRun.Status.RUNNING)  # fmt: skip
SCHEDULE_PAGE = "admin:advisory_lock_jobrun_schedule"
CELL = re.compile(r'<a class="slot-cell" data-outcome="([^"]*)" href="([^"]*)" title="([^"]*)"')
ENTRY = "health"
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)


def row_of(page: str, name: str) -> str:
    """The Schedule page's row of the entry ``name``."""
    [row] = [row for row in page.split("</tr>") if f"<td>{name}</td>" in row]
    return row


def a_minute_from_its_end(using: str) -> datetime.datetime:
    """The current minute's start on the server's clock, once it is at least 10 s from its
    end: no new slot of a minutely entry falls due during the test (but on a hang)."""
    wait_for(lambda: server_now(using).second < 50, "a minute with 10 s left")
    return server_now(using).replace(second=0, microsecond=0)


def test_the_schedule_page_shows_each_entrys_last_slots_linked_to_their_runs_or_slots(
    using, ledger
):
    current = a_minute_from_its_end(using)
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=current - 30 * MINUTE)
    # The last 20 slots, oldest first: 14 succeeded, 3 failed, 1 abandoned, 1 missed (no
    # run), 1 running (the current one); a slot before them, failed, is not in the strip.
    outcomes = [S] * 7 + [F, A, None] + [S] * 5 + [F, F] + [S] * 2 + [R]
    assert len(outcomes) == STRIP
    slots = [current - (STRIP - 1 - number) * MINUTE for number in range(STRIP)]
    runs = {
        minute(due): run(ledger, ENTRY, minute(due), outcome, due + SECOND)
        for due, outcome in zip(slots, outcomes, strict=True)
        if outcome is not None
    }
    run(ledger, ENTRY, minute(slots[0] - MINUTE), F, slots[0] - MINUTE)
    with console(using, {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}):
        page = client_of("viewer", "view_jobrun").get(reverse(SCHEDULE_PAGE))
        assert page.status_code == 200
        row = row_of(page.content.decode(), ENTRY)
    cells = CELL.findall(row)
    assert [outcome for outcome, _, _ in cells] == [outcome or "missed" for outcome in outcomes]
    for due, (outcome, href, title) in zip(slots, cells, strict=True):
        href = html.unescape(href)
        assert title == f"{minute(due)}: {outcome}"
        if outcome == "missed":
            since = due.isoformat().replace("+", "%2B").replace(":", "%3A")
            assert href == (
                f"{reverse('admin:advisory_lock_jobrun_timeline')}?entry={ENTRY}&since={since}"
                f"#slot-{minute(due)}"
            )
        else:
            pk = runs[minute(due)].pk
            assert href == reverse("admin:advisory_lock_jobrun_change", args=[pk])
    # Of the 19 slots that are over (the running one is not), 14 succeeded: 74 %.
    assert '<td class="success-rate">74% <small>(14/19)</small></td>' in row


def test_the_strip_links_of_a_missed_slot_lead_to_its_row_on_the_timeline(using, ledger):
    current = a_minute_from_its_end(using)
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=current - 2 * MINUTE)
    with console(using, {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}):
        viewer = client_of("viewer", "view_jobrun")
        row = row_of(viewer.get(reverse(SCHEDULE_PAGE)).content.decode(), ENTRY)
        [(outcome, href, _), *_] = CELL.findall(row)
        assert outcome == "missed"
        url, anchor = html.unescape(href).split("#")
        timeline = viewer.get(url).content.decode()
    assert f'<tr id="{anchor}" class="outcome-missed"' in timeline


def test_a_new_entrys_slots_before_a_scheduler_first_loaded_it_are_not_missed(using, ledger):
    # An entry every 15 s that a scheduler first loaded 5 minutes ago (and that never ran):
    # 20 or 21 missed slots, not the 7 days' worth before it existed.
    now = server_now(using)
    EntrySeen.objects.using(using).create(job_name=ENTRY, first_seen=now - 5 * MINUTE)
    schedule = {ENTRY: {"callable": f"{JOBS}.tick", "every": 15}}
    with console(using, schedule):
        viewer = client_of("viewer", "view_jobrun")
        timeline = viewer.get(reverse("admin:advisory_lock_jobrun_timeline"), {"entry": ENTRY})
        counts = re.search(r'<p id="timeline-counts">([^<]*)</p>', timeline.content.decode())
        status, out, _ = command("job_runs", "--timeline", ENTRY, "--json", "--database", using)
    missed = int(counts[1].removeprefix("missed: "))
    assert 20 <= missed <= 21, counts[1]
    slots = json.loads(out)
    assert status == 0 and len(slots) in (missed, missed + 1)
    assert {slot["outcome"] for slot in slots} == {"missed"}
    # Newest first.
    assert [slot["slot"] for slot in slots] == sorted(
        (slot["slot"] for slot in slots), reverse=True
    )


def test_an_entry_no_scheduler_has_loaded_has_no_missed_slot_but_those_that_ran(using, ledger):
    current = a_minute_from_its_end(using)
    ran = run(ledger, ENTRY, minute(current - 3 * MINUTE), F, current - 3 * MINUTE)
    with console(using, {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}):
        _, out, _ = command("job_runs", "--timeline", ENTRY, "--json", "--database", using)
    assert [(slot["slot"], slot["outcome"]) for slot in json.loads(out)] == [
        (ran.period, "failed")
    ]


#: Each entry's runs, oldest slot first (a tuple: a slot's attempts), and whether the entry
#: is failing with ``alert_after`` 3 (the default).
STREAKS = {
    "the last 3 slots failed": ([S, F, F, F], True),
    "the last 2 failed, the one before succeeded": ([F, S, F, F], False),
    "a retry succeeded the latest slot": ([F, F, (F, S)], False),
    "a retry failed the latest slot too": ([F, F, (F, F)], True),
    "abandoned is failed": ([F, A, F], True),
    "the slot running now is not over: passed over": ([F, F, F, R], True),
    "a retry running now: passed over": ([F, F, F, (F, R)], True),
    "fewer slots ran than alert_after": ([F, F], False),
}


def write_runs(ledger, history) -> list[JobRun]:
    """The runs of ``history``, a slot a minute from NOW - len(history) minutes on."""
    written = []
    for number, attempts in enumerate(history):
        due = NOW - (len(history) - number) * MINUTE
        for attempt, status in enumerate(attempts if isinstance(attempts, tuple) else [attempts]):
            started = due + (1 + 10 * attempt) * SECOND
            error = f"Traceback (most recent call last):\n  ...\nValueError: slot {number}"
            written.append(
                run(ledger, ENTRY, minute(due), status, started, attempt=attempt + 1, error=error)
            )
    return written


@pytest.mark.parametrize("case", list(STREAKS))
def test_an_entry_whose_last_slots_failed_is_flagged_on_the_schedule_and_by_overdue(
    using, ledger, case
):
    history, flagged = STREAKS[case]
    written = write_runs(ledger, history)
    with console(using, {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}):
        page = client_of("viewer", "view_jobrun").get(reverse(SCHEDULE_PAGE))
        row = row_of(page.content.decode(), ENTRY)
        status, out, _ = command("job_runs", "--overdue", "--json", "--database", using)
        table_status, table, _ = command("job_runs", "--overdue", "--database", using)
    assert ('class="failing-flag"' in row) is flagged
    listed = {job["job"]: job for job in json.loads(out)}
    if not flagged:
        assert (status, listed, table_status) == (0, {}, 0)
        return
    latest_attempts = {run.period: run for run in written}  # each slot's last attempt
    latest_failed = [run for run in latest_attempts.values() if run.status in (F, A)][-1]
    assert status == 1 and table_status == 1
    job = listed[ENTRY]
    assert job["failing"] is True and job["missing_slot"] == latest_failed.period
    assert job["reason"] == (
        f"its last 3 slot(s) that ran failed (alert_after=3), the latest "
        f"{latest_failed.period} on web-1: {first_line(latest_failed.error)}"
    )
    assert f"Failing: {ENTRY}: {job['reason']}." in table.splitlines()
    assert "failing: last 3 failed" in row and html.escape(job["reason"]) in row


@pytest.mark.parametrize("alert_after", [1, 2, 5])
def test_alert_after_sets_how_many_failed_slots_flag_an_entry(using, ledger, alert_after):
    write_runs(ledger, [S] + [F] * alert_after)
    for failed, flagged in ((alert_after - 1, False), (alert_after, True)):
        ledger.all().delete()
        write_runs(ledger, [S] + [F] * failed)
        entry = {"callable": f"{JOBS}.tick", "every": 60, "alert_after": alert_after}
        with console(using, {ENTRY: entry}):
            status, out, _ = command("job_runs", "--overdue", "--json", "--database", using)
        assert (status, [job["job"] for job in json.loads(out)]) == (
            (1, [ENTRY]) if flagged else (0, [])
        ), failed


def test_a_failing_entry_that_is_also_late_is_one_line_with_both_reasons(using, ledger):
    write_runs(ledger, [F, F, F])  # long ago: the entry's latest slot has no success
    entry = {"callable": f"{JOBS}.tick", "every": 60, "grace": 0}
    with console(using, {ENTRY: entry}):
        _, out, _ = command("job_runs", "--overdue", "--json", "--database", using)
    [job] = json.loads(out)  # one line for the entry
    assert job["failing"] is True
    late, failing = job["reason"].split("; ")  # no scheduler is alive here: that is said first
    assert "no scheduler" in late.lower(), late
    assert failing.startswith("its last 3 slot(s) that ran failed"), failing


BAD_ALERT_AFTER = [0, -1, 2.5, "3", True, None, MAX_ALERT_AFTER + 1]


@pytest.mark.parametrize("value", BAD_ALERT_AFTER, ids=repr)
def test_a_bad_alert_after_is_a_problem_of_the_entry(value):
    problems = entry_problems(
        ENTRY, {"callable": f"{JOBS}.tick", "every": 60, "alert_after": value}
    )
    assert problems == [
        f"ADVISORY_LOCK['SCHEDULE']['{ENTRY}']['alert_after'] must be a whole number >= 1 and "
        f"at most {MAX_ALERT_AFTER} (the slots that must all have failed to flag the entry), "
        f"not {value!r}."
    ]


@pytest.mark.parametrize("value", [1, 3, MAX_ALERT_AFTER])
def test_a_good_alert_after_is_no_problem(value):
    assert (
        entry_problems(ENTRY, {"callable": f"{JOBS}.tick", "every": 60, "alert_after": value})
        == []
    )


# First seen: written by each scheduler once, at its start.


def test_a_scheduler_records_when_it_first_loaded_each_entry_and_a_later_one_keeps_it(
    using, ledger, schedulers
):
    schedule = {
        "first": {"callable": f"{JOBS}.tick", "every": 3600},
        "second": {"callable": f"{JOBS}.tick", "every": 3600},
    }
    before = server_now(using)
    status, _, err = schedulers.once(schedule)
    after = server_now(using)
    assert status == 0, err
    seen = {row.job_name: row.first_seen for row in EntrySeen.objects.using(using)}
    assert set(seen) == {"first", "second"}
    assert all(before <= moment <= after for moment in seen.values()), (before, seen, after)
    status, _, err = schedulers.once({**schedule, "third": schedule["first"]})
    assert status == 0, err
    again = {row.job_name: row.first_seen for row in EntrySeen.objects.using(using)}
    assert {name: again[name] for name in seen} == seen  # kept: the first scheduler's time
    assert again["third"] > after


def test_noting_the_entries_is_one_insert_per_batch_once_per_scheduler(using, ledger):
    names = [f"entry-{number}" for number in range(2 * BATCH_SIZE + 1)]
    EntrySeen.objects.using(using).create(job_name=names[0], first_seen=NOW)
    first_seen = FirstSeen(using)
    connection = connections[using]
    with CaptureQueriesContext(connection) as start:
        first_seen.note(names, lambda: NOW + MINUTE)
    inserts = [query for query in start.captured_queries if "INSERT" in query["sql"].upper()]
    assert len(inserts) == 3  # 1001 entries, 500 a statement
    with CaptureQueriesContext(connection) as later:
        first_seen.note(names, lambda: NOW + 2 * MINUTE)
    assert later.captured_queries == []  # every pass after the start: no statement
    seen = dict(EntrySeen.objects.using(using).values_list("job_name", "first_seen"))
    assert len(seen) == len(names) and seen[names[0]] == NOW  # a row already there is kept
    assert {seen[name] for name in names[1:]} == {NOW + MINUTE}
