"""A scheduler's workers: job processes forked once and given run after run, on every backend.

Real ``manage.py run_jobs`` processes (tests/schedulers.py); each run appends a line to
``runs.jsonl`` with its pid (tests/schedule_jobs.py). Every wait is for a row or a line.
"""

from __future__ import annotations

import pytest

from advisory_lock import JobRun
from tests.schedule_jobs import runs
from tests.schedulers import JOBS
from tests.schedulers import wait_for

Status = JobRun.Status
#: Slots of the ticking entry to see run after the stuck run's worker was stopped.
AFTER = 3


@pytest.mark.parametrize("using", ["default", "postgresql", "mysql"], indirect=True)
def test_runs_reuse_their_workers_and_a_run_past_its_timeout_ends_its_worker_only(
    using, ledger, schedulers, tmp_path
):
    """Regression (issue 30): each slot was a forked process, a Django start-up and new
    connections. Now two workers run every slot of a ticking entry, one after the other; the
    entry stuck past its ``timeout`` is stopped with its worker only, recorded failed, and a
    new worker takes its place while the ticks go on."""
    schedule = {
        "tick": {"callable": f"{JOBS}.tick", "every": 1},
        "stuck": {"callable": f"{JOBS}.sleep_long", "every": 3600, "timeout": 2, "retries": 0},
    }
    process = schedulers.start(schedule, "--workers", "2")
    stuck = ledger.filter(job_name="stuck")
    wait_for(lambda: stuck.filter(status=Status.FAILED).exists(), "the stuck run stopped")
    stopped = stuck.get()
    assert stopped.error == "The run stopped after its timeout of 2s.", stopped.error
    ticks_before = len([run for run in runs(tmp_path) if run["job"] == "tick"])
    wait_for(
        lambda: (
            len([run for run in runs(tmp_path) if run["job"] == "tick"]) >= ticks_before + AFTER
        ),
        f"{AFTER} more ticks",
    )
    process.terminate()
    status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    ticks = [run for run in runs(tmp_path) if run["job"] == "tick"]
    pids = {run["pid"] for run in ticks}
    # Every tick ran in a worker of this scheduler: the two it forked at start, and the one
    # that replaced the stopped worker; never a process per slot.
    assert {run["ppid"] for run in ticks} == {process.pid}
    assert len(pids) <= 3 < len(ticks), ticks
    assert stopped.pid not in {run["pid"] for run in ticks[-AFTER:]}
    assert ledger.filter(job_name="tick").exclude(status=Status.SUCCEEDED).count() == 0
    assert out.count("started (pid") == len(ticks) + 1, out  # each slot said once
