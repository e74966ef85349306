"""What ``run_jobs`` says: a run-now request's line, and the end of a run stopped at its
timeout before it could be recorded.

The schedulers are real ``manage.py run_jobs`` processes (tests/schedulers.py) on each
backend's test database; the requests are ``run_jobs --run-now`` processes of their own, and
the lock that keeps a run from claiming its slot is held by a worker process
(tests/worker.py). Every wait is for an event (a row, a line of output) under a hang guard.
"""

from __future__ import annotations

import re

from advisory_lock import JobRun
from advisory_lock.scheduling.scheduler import UNRECORDED
from tests.schedulers import HANG
from tests.schedulers import JOBS
from tests.schedulers import long_interval
from tests.schedulers import wait_for
from tests.test_control_room import controls
from tests.test_control_room import heartbeats
from tests.test_control_room import output
from tests.test_control_room import run_jobs

Status = JobRun.Status

#: The fixtures of tests/test_control_room.py: its rows emptied before and after the test.
FIXTURES = (controls, heartbeats)


def test_run_now_says_it_waits_for_a_run_only_while_one_is_going_on(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    """Regression: ``--run-now`` said "(after a run of NAME going on now)" whether or not a
    run was going on. It now says so only when the ledger shows one running, and which."""
    every = long_interval(using)
    schedule = {
        "report": {"callable": f"{JOBS}.tick", "every": every},
        "long": {"callable": f"{JOBS}.until_go", "every": every},
    }
    schedulers.start(schedule)
    try:
        running = wait_for(
            ledger.filter(job_name="long", status=Status.RUNNING).first, "long's run", HANG
        )
        wait_for(
            ledger.filter(job_name="report", status=Status.SUCCEEDED).exists, "report's run", HANG
        )
        prefix = "a live scheduler starts it"

        status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
        assert status == 0, out + err
        slot = controls.get(job_name="report").slot
        assert out.splitlines() == [
            f"run_jobs: report requested as slot {slot}; {prefix} within 2s."
        ], out

        status, out, err = run_jobs(schedulers, schedule, "--run-now", "long")
        assert status == 0, out + err
        slot = controls.get(job_name="long").slot
        assert out.splitlines() == [
            f"run_jobs: long requested as slot {slot}; {prefix} when the run of long going on "
            f"now ends (slot {running.period}, pid {running.pid} on {running.host}): one run "
            f"of an entry at a time."
        ], out
    finally:
        (tmp_path / "go").touch()


def test_a_run_now_stopped_at_its_timeout_before_it_claimed_its_slot_says_what_is_recorded(
    using, ledger, controls, heartbeats, schedulers, workers
):
    """Regression: a run stopped at its timeout while it waited for its entry's lock was
    said "failed: stopped after its timeout of 5s (not recorded)", which left the reader to
    guess what was not recorded, and why. It now says that the ledger has no row of it."""
    schedule = {
        "report": {"callable": f"{JOBS}.tick", "every": long_interval(using), "timeout": 5}
    }
    process = schedulers.start(schedule)
    wait_for(ledger.filter(job_name="report", status=Status.SUCCEEDED).exists, "its run", HANG)
    # Its scheduler has reaped that run (the entry is free there for the request's run).
    wait_for(lambda: "] succeeded." in output(schedulers, process), "the run's end", HANG)
    holder = workers.start("--using", using, "hold", "schedule:report")
    holder.expect("acquired")

    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    slot = controls.get().slot
    failed = re.compile(rf"^run_jobs: report \[{re.escape(slot)}\] failed.*$", re.M)
    line = wait_for(lambda: failed.search(output(schedulers, process)), "its end", HANG)[0]
    assert line == (
        f"run_jobs: report [{slot}] failed: stopped after its timeout of 5s; {UNRECORDED}: it "
        f"had no running row there (it died before it claimed the slot, or its row was ended "
        f"already)"
    ), line
    assert not ledger.filter(period=slot).exists()
    holder.finish()
