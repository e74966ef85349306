"""The randomized fault run, short: the ledger's promises hold while instances of a ledger job
are SIGKILLed and their locks' connections are terminated by the server.

Four instances (real processes: tests/fault_run_worker.py) run a ``once`` job and a job whose
slot changes every 0.5 s, with a 0.2 s heartbeat, under 3 s of chaos per seed and backend;
then every instance is killed and the run is checked. bench/fault_run.py runs the same for
minutes, with server restarts, and prints the counts.
"""

from __future__ import annotations

import pytest

from tests.fault_run_worker import FaultRun
from tests.processes import Workers


@pytest.fixture
def fault_run(using, tmp_path):
    """Run a FaultRun on ``using`` and print its counts; its rows are deleted afterwards."""
    runs = []

    def run(**options):
        fault_run = FaultRun(using, directory=tmp_path, env=Workers().env, **options)
        runs.append(fault_run)
        report = fault_run.run()
        print(f"\n{report.summary()}\n(logs in {tmp_path})")
        return report

    yield run
    for fault_run in runs:
        fault_run._delete_rows()


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
    # of run_once; an instance or one of its threads that died by itself.
    assert report.violations == [], report.summary()
    # The run did something.
    assert report.kills > 0
    assert report.once_succeeded == 1
    assert report.daily_slots_succeeded > 0


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_the_checks_see_overlaps_when_bodies_run_without_a_lock(fault_run):
    report = fault_run(seed=1, instances=3, seconds=1, unlocked=True, settle=0)

    assert report.marker_overlaps > 0
    assert report.overlaps
    assert any("with no lost lock before" in violation for violation in report.violations)
