"""An entry's next boundary, computed ahead while the scheduler waits for it, is the one the
scheduler would compute at the boundary.

At a boundary every scheduler of a fleet starts its slots at once; a scheduler computes each
entry's next boundary before, halfway to it (``Scheduler.prepare``), so that this pass and
the runs after it do no cron arithmetic. The boundary computed ahead must be exactly the one
computed at it: the same slots, named the same, and the same next boundary. Generated here
for cron and ``every`` entries, each ``catch_up`` that is computed ahead, and the ledger's
time zones through their DST changes (a cron time that does not exist, an hour that
repeats).
"""

from __future__ import annotations

import datetime
import itertools

import pytest
from django.test import override_settings

from advisory_lock.schedule import CATCH_UP
from advisory_lock.schedule import _entry
from advisory_lock.scheduling.scheduler import Scheduler

UTC = datetime.timezone.utc
WHEN = [
    {"cron": "* * * * *"},
    {"cron": "30 2 * * *"},  # 02:30 is skipped in spring, repeated in autumn (Paris)
    {"cron": "*/20 1-3 * * *"},
    {"cron": "@hourly"},
    {"every": 1},
    {"every": 45},
    {"every": 1800},
]
ZONES = ["UTC", "Europe/Paris", "America/Santiago"]
#: From a little before each DST change of 2026 in Europe (Paris) to after it.
STARTS = [
    datetime.datetime(2026, 3, 28, 23, 0, tzinfo=UTC),
    datetime.datetime(2026, 10, 24, 23, 0, tzinfo=UTC),
]
#: Boundaries walked from each start.
STEPS = 200


@pytest.mark.parametrize(
    ("when", "catch_up", "zone"),
    [
        (when, catch_up, zone)
        for when, catch_up, zone in itertools.product(WHEN, CATCH_UP, ZONES)
        if catch_up != "all"  # its due slots are read from the ledger at the boundary
    ],
)
def test_the_boundary_computed_ahead_is_the_one_computed_at_it(when, catch_up, zone):
    with override_settings(TIME_ZONE=zone):
        entry = _entry(
            "entry", {"callable": "tests.schedule_jobs.nothing", "catch_up": catch_up, **when}
        )
        ahead = Scheduler({entry.name: entry})
        for start in STARTS:
            moment = start
            for _ in range(STEPS):
                ahead._candidates(entry, moment)
                current = ahead._due[entry.name]
                ahead.prepare(current.latest)
                assert entry.name not in ahead._ahead  # not before halfway to the next slot
                ahead.prepare(current.latest + (current.until - current.latest) / 2)
                following = ahead._ahead[entry.name]
                assert following.latest == current.until
                # At the next boundary, and just before the one after it.
                for at in (following.latest, following.until - datetime.timedelta(microseconds=1)):
                    fresh = Scheduler({entry.name: entry})
                    assert fresh._candidates(entry, at) == ahead._candidates(entry, at)
                    assert fresh._due[entry.name] == ahead._due[entry.name]
                assert entry.name not in ahead._ahead  # taken, not computed again
                moment = following.latest


@pytest.mark.parametrize("when", WHEN)
def test_a_boundary_computed_ahead_and_passed_unused_is_computed_again(when):
    """A scheduler busy past an entry's next boundary (its runs, an outage) finds the one it
    computed ahead passed: it computes the current one, and the next ahead again."""
    entry = _entry("entry", {"callable": "tests.schedule_jobs.nothing", **when})
    scheduler = Scheduler({entry.name: entry})
    start = STARTS[0]
    scheduler._candidates(entry, start)
    current = scheduler._due[entry.name]
    scheduler.prepare(current.until)
    passed = scheduler._ahead[entry.name]
    later = passed.until + datetime.timedelta(days=3)  # boundaries skipped
    assert scheduler._candidates(entry, later) == Scheduler({entry.name: entry})._candidates(
        entry, later
    )
    current = scheduler._due[entry.name]
    assert current.latest > passed.latest
    scheduler.prepare(current.until)
    assert scheduler._ahead[entry.name].latest == current.until
