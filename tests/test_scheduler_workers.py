"""A scheduler's workers: job processes forked once and given run after run, on every backend.

Real ``manage.py run_jobs`` processes (tests/schedulers.py); each run appends a line to
``runs.jsonl`` with its pid (tests/schedule_jobs.py). Every wait is for a row or a line.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from django.db import connections

from advisory_lock import JobRun
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.keys import make_key
from tests.schedule_jobs import runs
from tests.schedulers import JOBS
from tests.schedulers import alive
from tests.schedulers import wait_for
from tests.servers import kill_connection_of
from tests.test_control_room import controls  # noqa: F401 (a fixture)

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


def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid``, as the kernel lists them."""
    listed = subprocess.run(
        ["ps", "--ppid", str(pid), "-o", "pid=,stat="], capture_output=True, text=True, check=False
    ).stdout.split("\n")
    return {int(line.split()[0]) for line in listed if line.strip() and "Z" not in line.split()[1]}


@pytest.mark.parametrize("using", ["default", "postgresql", "mysql"], indirect=True)
def test_an_idle_worker_killed_from_outside_is_replaced(
    using,
    ledger,
    controls,  # noqa: F811 (the fixture: its run-now row is deleted after the test)
    schedulers,
    tmp_path,
):
    """Regression: an idle worker that died (an operator's SIGKILL, the OOM killer) stayed in
    its pool as a dead worker that was never given a run nor replaced: with one worker, its
    scheduler ran nothing more. Now the pool forks another in its place."""
    schedule = {"hourly": {"callable": f"{JOBS}.tick", "every": 3600}}
    process = schedulers.start(schedule, "--workers", "1")
    out = schedulers.folder / f"run_jobs.{process.number}.out"
    # The scheduler has its worker's answer: the worker is idle, waiting for its next run
    # (nothing is due for an hour).
    wait_for(lambda: "succeeded." in out.read_text(), "the entry's first slot run")
    [first] = runs(tmp_path)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(first["pid"]), "the killed worker reaped by its scheduler")
    status, out, err = run_jobs_command(schedulers, schedule, "--run-now", "hourly")
    assert status == 0, out + err
    request = controls.get(job_name="hourly")
    manual = wait_for(
        ledger.filter(period=request.slot, status=Status.SUCCEEDED).first, "the run-now slot"
    )
    assert manual.pid not in (first["pid"], 0)
    assert children_of(process.pid) == {manual.pid}  # one worker, the new one
    process.terminate()
    status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    assert "Traceback" not in err, err


def run_jobs_command(schedulers, schedule: dict, *argv: str) -> tuple[int, str, str]:
    return schedulers.finish(schedulers.start(schedule, *argv))


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_run_whose_lock_is_lost_ends_its_worker(using, ledger, schedulers, tmp_path):
    """Regression (CI, the MariaDB server restart): a worker whose run lost its lock went on
    to the next run, while what the job left behind (a thread, a child) might still be at
    work without its lock. Now it ends with its run, like a job process of its own, and a new
    worker runs the next slots."""
    schedule = {
        "stuck": {"callable": f"{JOBS}.sleep_long", "every": 3600, "retries": 0},
        "tick": {"callable": f"{JOBS}.tick", "every": 1},
    }
    process = schedulers.start(schedule, "--workers", "2")
    stuck = ledger.filter(job_name="stuck")
    running = wait_for(stuck.filter(status=Status.RUNNING).first, "the stuck run")
    connection = connections[using]
    key = backend_for(connection).db_key(make_key("schedule:stuck"))
    holder = wait_for(lambda: inspector_for(connection).holder(key), "the stuck run's lock")
    kill_connection_of(using, holder.id)
    failed = wait_for(stuck.filter(status=Status.FAILED).first, "the lost run recorded failed")
    assert "lost" in failed.error, failed.error
    wait_for(lambda: not alive(running.pid), "the lost run's worker ended")
    ticks_before = len([run for run in runs(tmp_path) if run["job"] == "tick"])
    wait_for(
        lambda: len([run for run in runs(tmp_path) if run["job"] == "tick"]) > ticks_before + 1,
        "ticks after the loss",
    )
    assert len(children_of(process.pid)) == 2  # the lost run's worker replaced
    process.terminate()
    status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    assert "stuck [" in out and "failed." in out, out
