"""A scheduler's walk over its entries leaves out the quiet ones, and yields exactly what a
walk over every entry would.

``QuietEntries`` keeps the entries that may not be quiet and leaves an entry out once it is
found quiet; the left-out ones come back when their quiet spell ends, when woken, when the
order changes, and at a clear. Checked against the plain rule (every name of the order, less
those quiet at ``now``) over generated histories: the clock moving on by less and more than a
spell, spells of many lengths ending at the same time or not, walks stopped early (as a pass
stops at the first slots not yet run) with entries hushed in the middle of them (as the
scheduler hushes an entry it finds settled), wakes, clears, and new orders with entries
added and removed, in the order the scheduler makes these calls.
"""

from __future__ import annotations

import datetime
import random

import pytest

from advisory_lock.scheduling.quiet import QuietEntries

START = datetime.datetime(2026, 12, 7, 10, 0, tzinfo=datetime.timezone.utc)


class PlainRule:
    """The rule the walk must keep: every name of the order not quiet at ``now``."""

    def __init__(self) -> None:
        self.until: dict[str, datetime.datetime] = {}

    def walk(self, order: list[str], now: datetime.datetime):
        for name in order:
            if name in self.until and now < self.until[name]:
                continue
            yield name

    def hush(self, name: str, until: datetime.datetime) -> None:
        self.until[name] = until

    def wake(self, name: str) -> None:
        self.until.pop(name, None)

    def clear(self) -> None:
        self.until.clear()


def history(seed: int, steps: int = 400) -> int:
    """Play ``steps`` generated calls on both; return how many names the walks yielded."""
    rng = random.Random(seed)
    names = [f"job-{i}" for i in range(rng.choice([1, 5, 40]))]
    order = list(names)
    rng.shuffle(order)
    now = START
    quiet, plain = QuietEntries(), PlainRule()
    yielded = 0
    for step in range(steps):
        action = rng.random()
        if action < 0.55:
            # A pass: walk as far as the caller wants, hushing some of what it is given.
            stop_after = rng.choice([0, 1, 3, len(order), len(order) + 1])
            walked, expected = [], []
            ours, theirs = quiet.walk(order, now), plain.walk(order, now)
            for _ in range(stop_after):
                got, want = next(ours, None), next(theirs, None)
                assert got == want, (seed, step, walked)
                if got is None:
                    break
                walked.append(got)
                expected.append(want)
                if rng.random() < 0.6:
                    spell = datetime.timedelta(seconds=rng.choice([1, 1, 30, 60, 3600]))
                    until = now + spell if rng.random() < 0.9 else now  # over at once too
                    quiet.hush(got, until)
                    plain.hush(got, until)
            yielded += len(walked)
        elif action < 0.75:
            now += datetime.timedelta(seconds=rng.choice([0, 0.5, 1, 2, 29, 30, 31, 61, 4000]))
        elif action < 0.85:
            name = rng.choice(names)
            quiet.wake(name)
            plain.wake(name)
        elif action < 0.88:
            quiet.clear()
            plain.clear()
        else:
            # A new order (the fleet counted again, or the stored entries changed): a new
            # list, with an entry added or removed at times; a changed entry is woken.
            if rng.random() < 0.3:
                names.append(f"job-{len(names) + step * 1000}")
            if rng.random() < 0.3 and len(names) > 1:
                gone = names.pop(rng.randrange(len(names)))
                quiet.wake(gone)
                plain.wake(gone)
            order = list(names)
            rng.shuffle(order)
    # And a last whole walk at every moment up to past the longest spell.
    for _ in range(5):
        assert list(quiet.walk(order, now)) == list(plain.walk(order, now)), seed
        now += datetime.timedelta(seconds=1000)
    return yielded


@pytest.mark.parametrize("seed", range(200))
def test_the_walk_yields_what_a_walk_over_every_entry_would(seed):
    assert history(seed) > 0  # the histories walk: they compare something


def test_a_quiet_entry_is_left_out_of_the_walks_after_it_was_found_quiet():
    """What the walk saves: once hushed, an entry is not even looked at until its spell
    ends (the walk holds the names it goes over)."""
    quiet = QuietEntries()
    order = [f"job-{i}" for i in range(500)]
    for name in quiet.walk(order, START):
        quiet.hush(name, START + datetime.timedelta(minutes=1))
    assert list(quiet.walk(order, START)) == []
    assert quiet.walking() == 0
    quiet.wake("job-7")
    assert list(quiet.walk(order, START)) == ["job-7"]
    assert quiet.walking() == 1
    assert list(quiet.walk(order, START + datetime.timedelta(minutes=1))) == order
