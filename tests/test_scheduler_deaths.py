"""A job process that the scheduler saw die, while the server still holds its lock.

A server frees a dead client's locks once it has read the end of its connection, a moment
after the process died: the scheduler must record the run failed then, not give up at once
and leave the row running until a sweep marks it abandoned. The job here forks an heir that
keeps its connections open after the job is killed, so the server "notices" when the test
lets the heir exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from advisory_lock import JobRun
from tests.probes import is_free
from tests.schedulers import long_interval
from tests.schedulers import wait_for

JOBS = "tests.schedule_jobs"
Status = JobRun.Status
#: A guard against a hang, never a timing: how long any one wait may last.
HANG = 240.0
WAITING = "its lock is not free yet"
GAVE_UP = "(not recorded)"


def output(folder: Path, number: int) -> str:
    return (folder / f"run_jobs.{number}.out").read_text()


def word_on_the_dead_run(folder: Path, number: int) -> list[str]:
    """The scheduler's lines that say the dead run is not recorded, yet or at all."""
    return [
        line for line in output(folder, number).splitlines() if WAITING in line or GAVE_UP in line
    ]


def heir_of(using: str, ledger, schedule: dict, schedulers, *argv: str):
    """Start a scheduler of ``schedule``; return it, the heir's pid and the run's row."""
    process = schedulers.start(schedule, *argv)
    heir_file = schedulers.folder / "heir.pid"
    heir = int(wait_for(lambda: heir_file.exists() and heir_file.read_text(), "the heir", HANG))
    run = wait_for(
        lambda: ledger.filter(job_name="heir", status=Status.RUNNING).first(),
        "the run's row",
        HANG,
    )
    return process, heir, run


def let_the_heir_go(folder: Path, heir: int) -> None:
    (folder / "go").touch()
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.kill(heir, signal.SIGKILL)


def test_a_dead_job_is_recorded_failed_once_the_server_has_freed_its_lock(
    using, ledger, schedulers, tmp_path
):
    """Regression: the scheduler tried the dead job's lock once, at once, and when the server
    had not yet freed it, said "(not recorded)" and left the row running (CI: a run stopped
    with the scheduler stayed running). It now tries again at its next passes, and records
    the run failed once the lock is free."""
    schedule = {"heir": {"callable": f"{JOBS}.fork_an_heir", "every": long_interval(using)}}
    process, heir, run = heir_of(using, ledger, schedule, schedulers)
    try:
        os.kill(run.pid, signal.SIGKILL)
        said = wait_for(lambda: word_on_the_dead_run(tmp_path, process.number), "a word", HANG)
        assert WAITING in said[0], said
        # The heir keeps the lock: the run is not recorded yet.
        assert ledger.get(pk=run.pk).status == Status.RUNNING
        assert not is_free("schedule:heir", using)
    finally:
        let_the_heir_go(tmp_path, heir)
    wait_for(lambda: ledger.get(pk=run.pk).status != Status.RUNNING, "the run's end", HANG)
    run = ledger.get(pk=run.pk)
    assert run.status == Status.FAILED, run
    assert run.error == "The run its process died (exit status -9).", run.error
    out = output(tmp_path, process.number)
    assert "heir [" in out and "failed: its process died (exit status -9)" in out, out
    assert GAVE_UP not in out, out


def test_a_scheduler_stopping_records_the_job_it_killed_once_its_lock_is_free(
    using, ledger, schedulers, tmp_path
):
    """Regression: a scheduler stopped by SIGTERM kills the jobs still running after its
    grace, and recorded them failed only if the server had freed their lock by then; now it
    waits for that before it exits."""
    schedule = {"heir": {"callable": f"{JOBS}.fork_an_heir", "every": long_interval(using)}}
    process, heir, run = heir_of(using, ledger, schedule, schedulers, "--stop-grace", "0")
    try:
        process.send_signal(signal.SIGTERM)
        said = wait_for(lambda: word_on_the_dead_run(tmp_path, process.number), "a word", HANG)
        assert WAITING in said[0], said
        assert process.poll() is None  # still waiting for the lock
        assert ledger.get(pk=run.pk).status == Status.RUNNING
    finally:
        let_the_heir_go(tmp_path, heir)
    status, out, err = schedulers.finish(process, timeout=HANG)
    assert status == 0, err
    run = ledger.get(pk=run.pk)
    assert run.status == Status.FAILED, run
    assert run.error == "The run stopped with the scheduler.", run.error
    assert "failed: stopped with the scheduler" in out and GAVE_UP not in out, out
