"""``retries`` holds fleet-wide: a slot gets at most ``1 + retries`` attempts, whatever the
number of schedulers (issue 19, item 5).

Each scheduler is a real process (tests/scheduler_child.py) that decides, as ``run_jobs``
does, whether it wants a slot, then runs it in a forked job process that takes the entry's
lock and claims the slot. The race of the issue: every scheduler saw "no row yet" and
decided to run; the first one's attempt failed and freed the entry's lock; a scheduler that
got the lock after that claimed a second attempt of a ``retries: 0`` entry. The tests order
the steps by the events the processes say, never by sleeps.
"""

from __future__ import annotations

import pytest

from advisory_lock import JobRun
from tests.processes import SchedulerChild
from tests.processes import Workers

FAILED = JobRun.Status.FAILED
#: An entry that always fails and may not be retried.
ALWAYS_FAILS = {"callable": "tests.schedule_jobs.fail", "every": 3600, "retries": 0}
FLEET = 3


@pytest.fixture
def fleet(using):
    """FLEET scheduler processes on ``using``, each ready; all killed after the test."""
    workers = Workers()
    try:
        children = []
        for _ in range(FLEET):
            child = SchedulerChild(["--using", using], workers.env)
            workers.started.append(child)
            children.append(child)
        for child in children:
            child.expect("ready", timeout=60)
        yield children
    finally:
        workers.kill_all()


def attempts(ledger, name, slot):
    rows = ledger.filter(job_name=name, period=slot).order_by("attempt")
    return list(rows.values_list("attempt", "status"))


def all_decide(fleet, slot, name, options):
    """Every scheduler decides on ``slot``; each must want it (no row yet)."""
    for child in fleet:
        child.command("decide", slot, name, options)
    assert [child.expect("decided")["wants"] for child in fleet] == [True] * len(fleet)


def test_a_scheduler_that_saw_no_row_does_not_retry_a_slot_out_of_retries(ledger, fleet):
    # The interleaving, made certain: all three saw "no row yet"; then each runs the
    # slot only once the one before it has ended (its attempt failed, its lock is free).
    name, slot = "always-fails", "2026-12-01T10:00"
    all_decide(fleet, slot, name, ALWAYS_FAILS)
    outcomes = []
    for child in fleet:
        child.command("run", slot, name, ALWAYS_FAILS)
        outcomes.append(child.expect("ended", timeout=60)["outcome"])
    assert attempts(ledger, name, slot) == [(1, FAILED)]
    assert outcomes == ["failed", "skipped", "skipped"]


@pytest.mark.parametrize("retries", [1, 2])
def test_retries_bound_the_attempts_of_a_slot_fleet_wide(ledger, fleet, retries):
    # The same with retries: a slot gets 1 + retries attempts, however many schedulers run it.
    name, slot = f"fails-retries-{retries}", "2026-12-01T10:00"
    options = {**ALWAYS_FAILS, "retries": retries}
    all_decide(fleet, slot, name, options)
    outcomes = []
    for child in fleet + fleet:
        child.command("run", slot, name, options)
        outcomes.append(child.expect("ended", timeout=60)["outcome"])
    assert attempts(ledger, name, slot) == [(n, FAILED) for n in range(1, retries + 2)]
    assert outcomes.count("failed") == retries + 1


ROUNDS = 15


def test_three_schedulers_racing_on_each_slot_never_make_a_second_attempt(ledger, fleet):
    # The race itself: in each round the three decide (no row yet), then all three are told
    # to run at once, and race for the entry's lock and the slot.
    name = "always-fails-racing"
    over = {}
    for round_ in range(ROUNDS):
        slot = f"2026-12-01T10:{round_:02d}"
        all_decide(fleet, slot, name, ALWAYS_FAILS)
        for child in fleet:
            child.command("run", slot, name, ALWAYS_FAILS)
        for child in fleet:
            child.expect("ended", timeout=60)
        found = attempts(ledger, name, slot)
        if len(found) > 1:
            over[slot] = found
    assert over == {}, f"{len(over)} of {ROUNDS} slots got more than one attempt: {over}"
