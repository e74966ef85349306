"""The randomized fault run, short: the ledger's promises hold while instances of ledger jobs
are SIGKILLed and their locks' connections are terminated by the server.

Four instances (real processes: tests/fault_run_worker.py) run a ``once`` job, a job whose
slot changes every 0.5 s, and an atomic job (``atomic=True``) on the same slots that writes an
effect row on the ledger's database, with a 0.2 s heartbeat, under 3 s of chaos per seed and
backend; then every instance is killed and the run is checked. bench/fault_run.py runs the
same for minutes, with server restarts, and prints the counts.
"""

from __future__ import annotations

import pytest

from tests.fault_run_worker import ATOMIC
from tests.fault_run_worker import FaultRun
from tests.fault_run_worker import check_effects
from tests.processes import Workers


@pytest.fixture
def fault_run(using, tmp_path):
    """Run a FaultRun on ``using`` and print its counts; its rows (and the effects' table) are
    deleted afterwards."""
    runs = []

    def run(**options):
        fault_run = FaultRun(using, directory=tmp_path, env=Workers().env, **options)
        runs.append(fault_run)
        report = fault_run.run()
        print(f"\n{report.summary()}\n(logs in {tmp_path})")
        return report

    yield run
    for fault_run in runs:
        fault_run.clean_up()


@pytest.mark.parametrize("seed", [1, 2])
def test_under_kills_and_lost_locks_slots_succeed_once_and_overlaps_raise_lock_lost(
    fault_run, seed
):
    report = fault_run(seed=seed, instances=4, seconds=3)

    # Report.violations lists every broken promise: more than one succeeded row in a slot, or
    # an attempt after it; a run that succeeded in its instance but not in the ledger; two
    # runs of a job inside their critical sections at once unless the first one's lock was
    # lost (a connection terminated) before, and it then raised LockLost (or was killed)
    # within heartbeat + 1 s; a row still running after `job_runs --mark-abandoned` with
    # every instance gone; a job lock still held then; an exception other than LockLost out
    # of run_once; an instance or one of its threads that died by itself. And for the atomic
    # job: in each slot, as many committed effect rows as succeeded rows (1 or 0), each the
    # effect of the slot's succeeded run; no effect of a failed, abandoned or killed attempt.
    assert report.violations == [], report.summary()
    # The run did something.
    assert report.kills > 0
    assert report.once_succeeded == 1
    assert report.daily_slots_succeeded > 0
    assert report.atomic_slots_succeeded > 0
    assert report.effect_rows == report.atomic_slots_succeeded


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_the_checks_see_overlaps_when_bodies_run_without_a_lock(fault_run):
    report = fault_run(seed=1, instances=3, seconds=1, unlocked=True, settle=0)

    assert report.marker_overlaps > 0
    assert report.overlaps
    assert any("with no lost lock before" in violation for violation in report.violations)


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_the_checks_see_effects_of_failed_attempts_when_the_job_is_not_atomic(fault_run):
    # Without atomic=True the effect commits at once: every attempt here writes it, then
    # fails (or is killed), and the slot is retried; so does each retry.
    report = fault_run(seed=1, instances=3, seconds=1, atomic=False, fail_atomic=1, settle=0)

    assert report.effect_rows > 0
    assert report.atomic_slots_succeeded == 0
    assert any("effect row(s) committed, 0 succeeded" in v for v in report.violations)
    assert any("is committed, but the run is failed" in v for v in report.violations)


def test_check_effects_on_hand_made_rows():
    """Each way the atomic job's effects can disagree with its ledger rows is a violation."""
    runs = [
        (1, "s1", "failed"),
        (2, "s1", "succeeded"),
        (3, "s2", "abandoned"),
        (4, "s2", "succeeded"),
        (5, "s3", "failed"),
        (6, "s4", "running"),
    ]
    good = [(ATOMIC, "s1", "2", 10), (ATOMIC, "s2", "4", 11)]
    checked = check_effects(runs, good)
    assert (checked.slots, checked.succeeded, checked.rows) == (4, 2, 2)
    assert checked.violations == []

    def violations(*effects):
        return check_effects(runs, effects).violations

    slot = f"{ATOMIC} slot"
    # A success without its effect (rolled back, or never written).
    assert violations(good[0]) == [f"{slot} s2: 0 effect row(s) committed, 1 succeeded row(s)"]
    # The effect of a failed attempt (not rolled back), next to the success's.
    assert violations(*good, (ATOMIC, "s1", "1", 12)) == [
        f"{slot} s1: 2 effect row(s) committed, 1 succeeded row(s)",
        f"{slot} s1: the effect row of run 1 (pid 12) is committed, but the run is failed",
    ]
    # The effect of an abandoned (killed) attempt in a slot that never succeeded; of a run
    # still running; of a run that the ledger doesn't know (unguarded).
    assert violations(
        *good, (ATOMIC, "s3", "5", 13), (ATOMIC, "s4", "6", 14), (ATOMIC, "s9", "u1.1", 15)
    ) == [
        f"{slot} s3: 1 effect row(s) committed, 0 succeeded row(s)",
        f"{slot} s4: 1 effect row(s) committed, 0 succeeded row(s)",
        f"{slot} s9: 1 effect row(s) committed, 0 succeeded row(s)",
        f"{slot} s3: the effect row of run 5 (pid 13) is committed, but the run is failed",
        f"{slot} s4: the effect row of run 6 (pid 14) is committed, but the run is running",
        f"{slot} s9: the effect row of run u1.1 (pid 15) is committed, but the run has no "
        f"ledger row",
    ]
    # A succeeded run's effect in the wrong slot: one slot short, the other one too many.
    assert violations(good[0], (ATOMIC, "s3", "4", 11)) == [
        f"{slot} s2: 0 effect row(s) committed, 1 succeeded row(s)",
        f"{slot} s3: 1 effect row(s) committed, 0 succeeded row(s)",
        f"{slot} s3: the effect row of run 4 (pid 11) is committed, but the run's slot is s2",
    ]
