"""A long-lived scheduler's memory of settled slots stays bounded.

A scheduler remembers the slots it knows done (``_settled``), so that a pass does not ask the
ledger about them again. Only the slots of each entry's current boundary are ever looked up
there: the sweep (once a minute) forgets the others. Before this, the set grew by one item
per slot run, for as long as the scheduler lived (500 entries due each minute: 720,000 a
day).
"""

from __future__ import annotations

import datetime

from advisory_lock import JobRun
from advisory_lock.schedule import _entry
from advisory_lock.scheduling.scheduler import Scheduler
from tests.test_overdue import at
from tests.test_prune import row

#: Noon of Sunday 29 November 2026: in the past, so that the host's clock finds it old too.
NOON = at("2026-11-29T12:00+00:00")


def test_a_sweep_forgets_the_settled_slots_of_earlier_boundaries(ledger, using):
    options = {"callable": "tests.schedule_jobs.nothing", "every": 60}
    entries = {name: _entry(name, options) for name in ("a", "b", "c")}
    scheduler = Scheduler(entries, using=using)
    minutes = 30
    for minute in range(minutes):
        moment = NOON + datetime.timedelta(minutes=minute)
        for entry in entries.values():
            slot = entry.slot_name(next(entry.slots_before(moment)))
            row(ledger, entry.name, slot, moment, JobRun.Status.SUCCEEDED)
            # Done: the ledger says so, and the scheduler remembers it.
            assert scheduler.due_slots(entry, moment) == []
    assert len(scheduler._settled) == minutes * len(entries)
    scheduler.sweep()
    # The current boundary's slots alone are kept: one per entry.
    last = NOON + datetime.timedelta(minutes=minutes - 1)
    assert scheduler._settled == {(name, entry.slot_name(last)) for name, entry in entries.items()}
