"""The other schedulers' entries: a scheduler through with its own looks at their slots in
the ledger first, in one statement, and keeps for its claims only the slots left to run.

Before, it tried the claims of all of them, read the ledger for those it got (mostly slots
their owners had run and released) and released them: a claim, a read and a release per
batch, for a few hundred entries, by every scheduler of the fleet.
"""

from __future__ import annotations

import datetime

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from advisory_lock import JobRun
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.boundaries import Due
from advisory_lock.scheduling.scheduler import Scheduler

UTC = datetime.timezone.utc
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
Status = JobRun.Status

#: Whether another scheduler's slot whose only attempt (its first, of an entry with one
#: retry) has this status is still claimed here: done, running or enqueued elsewhere, no;
#: failed or abandoned, yes (its retry is due). Every status is listed (checked below).
CLAIMED_AFTER = {
    Status.RUNNING: False,
    Status.SUCCEEDED: False,
    Status.ENQUEUED: False,
    Status.FAILED: True,
    Status.ABANDONED: True,
}


def test_every_status_is_decided():
    assert set(CLAIMED_AFTER) == set(Status)


@pytest.mark.parametrize("status", list(Status))
def test_the_other_schedulers_slots_the_ledger_decides_are_not_claimed(using, ledger, status):
    entries = {
        name: Entry(name=name, callable="tests.schedule_jobs.tick", every=3600, retries=1)
        for name in ("attempted", "never-attempted")
    }
    scheduler = Scheduler(entries, using=using)
    slot = next(entries["attempted"].slots_before(NOW))
    candidates = {name: Due(entry.slot_name(slot), slot, True) for name, entry in entries.items()}
    ledger.create(
        job_name="attempted",
        period=candidates["attempted"].slot,
        attempt=1,
        status=status,
        started_at=NOW,
    )
    with CaptureQueriesContext(connections[using]) as queries:
        scheduler._drop_decided(candidates)
    assert len(queries.captured_queries) == 1  # the ledger's word on them all; no claim
    expected = {"never-attempted"} | ({"attempted"} if CLAIMED_AFTER[status] else set())
    assert set(candidates) == expected
    assert scheduler.claims.held == set()
