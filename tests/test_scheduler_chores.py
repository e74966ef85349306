"""A scheduler's once-a-minute chores wait while it hands out due slots.

A sweep (a lock try per running row of the other schedulers, then every slot looked at again)
or a new reading of the server's clock with a count of the fleet, falling due in the first
second of a boundary, would take that second from the boundary's runs. Each waits while the
scheduler has due slots to hand out, for at most ``_CHORES_WAIT`` seconds; at start and after
an outage the sweep never waits. The statements are counted on the scheduler's own connection,
with real workers running the slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from django.db import connections
from django.test.utils import CaptureQueriesContext

from advisory_lock.schedule import entry_from
from advisory_lock.scheduling.scheduler import _CHORES_WAIT
from advisory_lock.scheduling.scheduler import _SWEEP
from advisory_lock.scheduling.scheduler import Scheduler

#: A new entry's first run is its most recent due slot: due at once.
DUE = {"callable": "tests.schedule_jobs.nothing", "every": 3600}
#: Not due: its one slot a year, and a missed one is not run ("none").
NOT_DUE = {"callable": "tests.schedule_jobs.nothing", "cron": "0 0 1 1 *", "catch_up": "none"}


def scheduler_of(using: str, options: dict[str, object], count: int = 4) -> Scheduler:
    entries = {f"e{i}": entry_from(f"e{i}", options) for i in range(count)}
    return Scheduler(entries, using=using, workers=1, say=lambda line: None)


def statements(using: str, chore: Callable[[], object]) -> int:
    with CaptureQueriesContext(connections[using]) as queries:
        chore()
    return len(queries.captured_queries)


def test_a_sweep_waits_while_due_slots_are_handed_out(using, ledger):
    scheduler = scheduler_of(using, DUE)
    try:
        assert statements(using, scheduler.sweep_if_due) > 0  # at start: at once
        scheduler.start_due()  # one slot to the one worker, the others claimed and waiting
        assert scheduler._ready
        scheduler._next_sweep = time.monotonic()  # due now
        assert statements(using, scheduler.sweep_if_due) == 0
        scheduler._next_sweep = time.monotonic() - _CHORES_WAIT  # due for the longest wait
        assert statements(using, scheduler.sweep_if_due) > 0
        assert scheduler._next_sweep > time.monotonic()  # the next one in a minute
    finally:
        scheduler.shut_down()


def test_a_sweep_due_with_nothing_to_hand_out_runs_at_once(using, ledger):
    scheduler = scheduler_of(using, NOT_DUE)
    try:
        scheduler.sweep_if_due()
        scheduler.start_due()
        assert not scheduler._ready and not scheduler.children
        scheduler._next_sweep = time.monotonic()
        assert statements(using, scheduler.sweep_if_due) > 0
    finally:
        scheduler.shut_down()


def test_the_sweep_after_an_outage_never_waits(using, ledger):
    scheduler = scheduler_of(using, DUE)
    try:
        scheduler.sweep_if_due()
        scheduler.start_due()
        assert scheduler._ready
        scheduler._next_sweep = 0.0  # as an outage leaves it
        assert statements(using, scheduler.sweep_if_due) > 0
    finally:
        scheduler.shut_down()


def test_the_clock_and_the_fleet_are_read_again_after_the_slots_are_handed_out(using, ledger):
    scheduler = scheduler_of(using, DUE)
    try:
        scheduler.beat_if_due()  # the clock read, the heartbeat, the fleet counted
        scheduler.sharing.counts_left = 0  # the fleet is the same at the next heartbeats
        scheduler.start_due()
        assert scheduler._ready
        assert scheduler._clock is not None
        read, at = scheduler._clock
        scheduler._clock = (read, at - _SWEEP)  # last read a minute ago
        scheduler._next_beat = 0.0
        assert statements(using, scheduler.beat_if_due) == 1  # the heartbeat alone
        reading = statements(using, scheduler.read_clock)  # SQLite's clock is the host's: 0
        assert scheduler._clock is not None
        read, at = scheduler._clock
        scheduler._clock = (read, at - _SWEEP - _CHORES_WAIT)
        scheduler._next_beat = 0.0
        # The clock, the heartbeat and the count of the fleet.
        assert statements(using, scheduler.beat_if_due) == reading + 2
    finally:
        scheduler.shut_down()
