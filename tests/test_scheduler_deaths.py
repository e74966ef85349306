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
from tests.processes import SchedulerChild
from tests.processes import Workers
from tests.schedulers import long_interval
from tests.schedulers import wait_for

JOBS = "tests.schedule_jobs"
Status = JobRun.Status
#: A guard against a hang, never a timing: how long any one wait may last.
HANG = 240.0
WAITING = "its lock is not free yet"
GAVE_UP = "not recorded in the ledger"


def output(folder: Path, number: int) -> str:
    return (folder / f"run_jobs.{number}.out").read_text()


def word_on_the_dead_run(folder: Path, number: int) -> list[str]:
    """The scheduler's lines that say the dead run is not recorded, yet or at all."""
    return [
        line for line in output(folder, number).splitlines() if WAITING in line or GAVE_UP in line
    ]


def ended_lines(folder: Path, number: int) -> list[str]:
    """The scheduler's lines that say how the dead run ended (after recording it)."""
    return [line for line in output(folder, number).splitlines() if "] failed: " in line]


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


def it_waits_for_the_lock(folder: Path, process, ledger, run, heir: int, end_the_run) -> None:
    """``end_the_run``; the scheduler ``process`` must then say that it waits for the dead
    run's lock, and wait, still running, with the row running; then let the heir go."""
    try:
        end_the_run()
        said = wait_for(lambda: word_on_the_dead_run(folder, process.number), "a word", HANG)
        assert WAITING in said[0], said
        assert process.poll() is None  # still waiting for the lock
        assert ledger.get(pk=run.pk).status == Status.RUNNING
    finally:
        let_the_heir_go(folder, heir)


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
    # The scheduler says how the run ended after it has recorded it.
    said = wait_for(lambda: ended_lines(tmp_path, process.number), "the run's end", HANG)
    assert said == [f"run_jobs: heir [{run.period}] failed: its process died (exit status -9)"]
    run = ledger.get(pk=run.pk)
    assert run.status == Status.FAILED, run
    assert run.error == "The run its process died (exit status -9).", run.error
    # The slot's retry (retries: 1) starts only after the failure is recorded: before the
    # fix, a pass that found the lock free started it first, and its claim marked the dead
    # run abandoned.
    lines = output(tmp_path, process.number).splitlines()
    before_the_failure = lines[: lines.index(said[0])]
    assert [line for line in before_the_failure if " started (pid " in line] == [
        f"run_jobs: heir [{run.period}] started (pid {run.pid})."
    ], lines


def test_a_scheduler_stopping_records_the_job_it_killed_once_its_lock_is_free(
    using, ledger, schedulers, tmp_path
):
    """Regression: a scheduler stopped by SIGTERM kills the jobs still running after its
    grace, and recorded them failed only if the server had freed their lock by then; now it
    waits for that before it exits."""
    schedule = {"heir": {"callable": f"{JOBS}.fork_an_heir", "every": long_interval(using)}}
    process, heir, run = heir_of(using, ledger, schedule, schedulers, "--stop-grace", "0")
    it_waits_for_the_lock(
        tmp_path, process, ledger, run, heir, lambda: process.send_signal(signal.SIGTERM)
    )
    status, out, err = schedulers.finish(process, timeout=HANG)
    assert status == 0, err
    run = ledger.get(pk=run.pk)
    assert run.status == Status.FAILED, run
    assert run.error == "The run stopped with the scheduler.", run.error
    assert "failed: stopped with the scheduler" in out and GAVE_UP not in out, out


def test_no_run_of_the_entry_starts_while_its_dead_run_waits_to_be_recorded(
    using, ledger, tmp_path
):
    """Regression: a pass looked at its deaths while the server still held the dead run's
    lock, the server freed it, and the same pass then found the slot's row running under a
    free lock and started the retry; the retry's claim marked the dead run abandoned, and how
    it died was lost (CI, on PostgreSQL). Each step here is one pass of a real scheduler
    process (tests/scheduler_child.py), in the order the race took."""
    entry = {"callable": f"{JOBS}.fork_an_heir", "every": long_interval(using)}
    workers = Workers({"ADVISORY_LOCK_TEST_JOBS_DIR": str(tmp_path)})
    try:
        # The job reads its row on "default" (tests/schedule_jobs.py): let it be ``using``.
        env = {**workers.env, "ADVISORY_LOCK_TEST_DEFAULT": using}
        scheduler = SchedulerChild(["--using", using], env)
        workers.started.append(scheduler)
        scheduler.expect("ready")
        scheduler.command("pass", "-", "heir", entry)
        (job,) = scheduler.expect("passed")["running"]
        heir_file = tmp_path / "heir.pid"
        heir = int(wait_for(lambda: heir_file.exists() and heir_file.read_text(), "heir", HANG))
        run = wait_for(lambda: ledger.filter(pid=job, status=Status.RUNNING).first(), "row", HANG)
        dead_run = f"run_jobs: heir [{run.period}]"
        try:
            os.kill(job, signal.SIGKILL)
            scheduler.command("reap", "-", "heir", entry)
            assert scheduler.expect("reaped")["said"] == [
                f"{dead_run} died (its process died (exit status -9)); its lock is not free yet."
            ]
        finally:
            let_the_heir_go(tmp_path, heir)
        wait_for(lambda: is_free("schedule:heir", using), "the dead run's lock freed", HANG)

        # The slot's row is running under a free lock, and not yet recorded failed.
        scheduler.command("pass", "-", "heir", entry)
        assert scheduler.expect("passed") == {"event": "passed", "said": [], "running": []}
        assert ledger.get(pk=run.pk).status == Status.RUNNING

        scheduler.command("reap", "-", "heir", entry)
        assert scheduler.expect("reaped")["said"] == [
            f"{dead_run} failed: its process died (exit status -9)"
        ]
        run = ledger.get(pk=run.pk)
        assert (run.status, run.error) == (
            Status.FAILED,
            "The run its process died (exit status -9).",
        )

        # Recorded: the next pass starts the slot's retry (retries: 1), attempt 2.
        scheduler.command("pass", "-", "heir", entry)
        (retry,) = scheduler.expect("passed")["running"]
        retried = wait_for(lambda: ledger.filter(pid=retry).first(), "the retry's row", HANG)
        assert (retried.period, retried.attempt) == (run.period, 2)
        assert ledger.get(pk=run.pk).status == Status.FAILED
    finally:
        workers.kill_all()


def test_run_jobs_once_records_its_dead_job_once_its_lock_is_free(
    using, ledger, schedulers, tmp_path
):
    """Regression: ``run_jobs --once`` returned when its last job process died, and a death
    whose lock the server still held was never recorded (the row stayed running until a
    sweep). It now waits for the lock, as a stopping scheduler does."""
    schedule = {"heir": {"callable": f"{JOBS}.fork_an_heir", "every": long_interval(using)}}
    process, heir, run = heir_of(using, ledger, schedule, schedulers, "--once")
    it_waits_for_the_lock(
        tmp_path, process, ledger, run, heir, lambda: os.kill(run.pid, signal.SIGKILL)
    )
    status, out, err = schedulers.finish(process, timeout=HANG)
    assert status == 1, err  # a run failed
    run = ledger.get(pk=run.pk)
    assert (run.status, run.error) == (Status.FAILED, "The run its process died (exit status -9).")
    assert f"heir [{run.period}] failed: its process died (exit status -9)" in out, out
    assert GAVE_UP not in out, out
