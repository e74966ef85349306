"""Stored schedule entries are the schedule too for the ledger's other readers: pruning keeps
the rows of their slots that can still be claimed, and the overdue report checks their
``grace`` and flags them failing by their ``alert_after``, as it does ``SCHEDULE``'s entries.

Before, both read ``ADVISORY_LOCK["SCHEDULE"]`` alone: pruning could delete the attempts of a
stored entry's current slot (which then ran again), and the report never named one.
"""

from __future__ import annotations

import datetime
import json

from advisory_lock import JobRun
from tests.schedulers import JOBS
from tests.test_overdue import database_clock
from tests.test_overdue import report
from tests.test_prune import SUNDAY
from tests.test_prune import prune
from tests.test_prune import row
from tests.test_prune import slots
from tests.test_stored_entries import stored  # noqa: F401 (a fixture)

FAILED = JobRun.Status.FAILED


def test_prune_keeps_the_first_and_latest_attempts_of_a_stored_entrys_current_slot(
    stored,  # noqa: F811
    ledger,
    using,
):
    # Every 10 days (its current slot began on 23 November), retries 1: both attempts of the
    # current slot failed 6 days ago. Deleted, the slot would look new and run twice more.
    entry = stored.create(
        name="every-10-days", callable=f"{JOBS}.fail", every=10 * 86400, retries=1
    ).entry()
    name = entry.slot_name(next(entry.slots_before(SUNDAY)))
    with database_clock(using, SUNDAY):
        started = SUNDAY - datetime.timedelta(days=6)
        for attempt in (1, 2):
            row(ledger, entry.name, name, started, FAILED, attempt)
        # A run-now since: the job's newest slot (kept for that) is not the current one.
        manual = "manual:2026-11-24T00:00:00+00:00"
        row(ledger, entry.name, manual, started + datetime.timedelta(hours=12))
        prune(using, 5)
    assert sorted(slots(ledger, entry.name)) == [(name, 1), (name, 2), (manual, 1)]


def test_the_overdue_report_checks_a_stored_entrys_grace(stored, ledger, using):  # noqa: F811
    stored.create(name="hourly", callable=f"{JOBS}.tick", cron="0 * * * *", grace=600)
    with database_clock(using, SUNDAY):
        status, out = report(using, "--json")
    assert status == 1
    [job] = json.loads(out)
    assert (job["job"], job["missing_slot"]) == ("hourly", "2026-11-29T11:00")


def test_the_overdue_report_flags_a_failing_stored_entry_by_its_alert_after(
    stored,  # noqa: F811
    ledger,
    using,
):
    stored.create(name="flaky", callable=f"{JOBS}.fail", every=3600, alert_after=2)
    with database_clock(using, SUNDAY):
        for hours in (3, 2):
            moment = SUNDAY - datetime.timedelta(hours=hours)
            row(ledger, "flaky", f"{moment:%Y-%m-%dT%H:%M}", moment, FAILED)
        status, out = report(using, "--json")
    assert status == 1
    [job] = json.loads(out)
    assert job["job"] == "flaky" and job["failing"] is True
    assert "its last 2 slot(s) that ran failed" in job["reason"]
