"""An entry's next boundary, computed ahead while the scheduler waits for it, is the one the
scheduler would compute at the boundary.

At a boundary every scheduler of a fleet starts its slots at once; a scheduler computes each
entry's next boundary before, halfway to it (``Boundaries.prepare``), so that this pass and
the runs after it do no cron arithmetic. The boundary computed ahead must be exactly the one
computed at it: the same slots, named the same, the same slot before them, and the same next
boundary. Generated here
for cron and ``every`` entries and each ``catch_up`` that is computed ahead, in three ledger
time zones, walking 200 boundaries from a little before each of Paris's DST changes of 2026
(a cron time that does not exist, an hour that repeats); the daily entry's 200 days cross
Santiago's changes too (April and September).
"""

from __future__ import annotations

import datetime
import itertools

import pytest
from django.test import override_settings

from advisory_lock.schedule import CATCH_UP
from advisory_lock.schedule import Entry
from advisory_lock.schedule import _entry
from advisory_lock.scheduling.boundaries import Boundaries

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
#: A little before each DST change of 2026 in Europe (Paris).
STARTS = [
    datetime.datetime(2026, 3, 28, 23, 0, tzinfo=UTC),
    datetime.datetime(2026, 10, 24, 23, 0, tzinfo=UTC),
]
#: Boundaries walked from each start.
STEPS = 200


def no_missed_slots(entry: Entry, latest: datetime.datetime) -> list[datetime.datetime]:
    raise AssertionError("only asked for catch_up='all'")


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
        options = {"callable": "tests.schedule_jobs.nothing", "catch_up": catch_up, **when}
        entry = _entry("entry", options)
        entries = {entry.name: entry}
        ahead = Boundaries(no_missed_slots)
        for start in STARTS:
            moment = start
            for _ in range(STEPS):
                ahead.dues(entry, moment)
                current = ahead.current[entry.name]
                ahead.prepare(entries, current.latest)
                assert entry.name not in ahead.ahead  # not before halfway to the next slot
                ahead.prepare(entries, current.halfway)
                following = ahead.ahead[entry.name]
                assert following.latest == current.until
                # At the next boundary, and just before the one after it.
                for at in (following.latest, following.until - datetime.timedelta(microseconds=1)):
                    fresh = Boundaries(no_missed_slots)
                    assert fresh.dues(entry, at) == ahead.dues(entry, at)
                    # The slot before it, which the look for missed slots takes from here
                    # instead of the cron arithmetic it did before.
                    for due in fresh.dues(entry, at):
                        earlier = due.at - datetime.timedelta(microseconds=1)
                        assert due.before == next(entry.slots_before(earlier)), due
                    assert fresh.current[entry.name] == ahead.current[entry.name]
                assert entry.name not in ahead.ahead  # taken, not computed again
                moment = following.latest


@pytest.mark.parametrize("when", WHEN)
def test_a_boundary_computed_ahead_and_passed_unused_is_computed_again(when):
    """A scheduler busy past an entry's next boundary (its runs, an outage) finds the one it
    computed ahead passed: it computes the current one, and the next ahead again."""
    entry = _entry("entry", {"callable": "tests.schedule_jobs.nothing", **when})
    entries = {entry.name: entry}
    boundaries = Boundaries(no_missed_slots)
    boundaries.dues(entry, STARTS[0])
    boundaries.prepare(entries, boundaries.current[entry.name].until)
    passed = boundaries.ahead[entry.name]
    later = passed.until + datetime.timedelta(days=3)  # boundaries skipped
    assert boundaries.dues(entry, later) == Boundaries(no_missed_slots).dues(entry, later)
    current = boundaries.current[entry.name]
    assert current.latest > passed.latest
    boundaries.prepare(entries, current.until)
    assert boundaries.ahead[entry.name].latest == current.until


def test_the_sweep_reads_again_only_the_missed_slots_of_catch_up_all():
    """The sweep (once a minute) forgets the boundaries of the ``catch_up="all"`` entries,
    whose missed slots the ledger says, and of entries no longer scheduled; the others' due
    slots are their schedule's alone, and are kept."""
    asked: list[str] = []

    def missed(entry: Entry, latest: datetime.datetime) -> list[datetime.datetime]:
        asked.append(entry.name)
        return [latest]

    entries = {
        name: _entry(name, {"callable": "tests.schedule_jobs.nothing", "every": 60, **options})
        for name, options in {
            **{f"catch_up-{catch_up}": {"catch_up": catch_up} for catch_up in CATCH_UP},
            "removed": {},
        }.items()
    }
    boundaries = Boundaries(missed)
    for entry in entries.values():
        boundaries.dues(entry, STARTS[0])
    assert asked == ["catch_up-all"]
    del entries["removed"]
    boundaries.forget_missed(entries)
    assert set(boundaries.current) == {
        f"catch_up-{catch_up}" for catch_up in CATCH_UP if catch_up != "all"
    }
    for entry in entries.values():
        boundaries.dues(entry, STARTS[0])
    assert asked == ["catch_up-all", "catch_up-all"]
