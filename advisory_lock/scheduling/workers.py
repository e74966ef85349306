"""A scheduler's workers: job processes forked once, each given one run at a time.

A worker is forked from its scheduler when the scheduler starts (Django is set up then: no
start-up per run), and runs the slots its scheduler gives it, one after the other, each as a
``GuardedRun`` (the entry's lock, the ledger's claim of the slot, the recorded end) exactly
as a process of its own would. It keeps its connections from one run to the next: Django's
(closed after a failed run, so that the next starts clean; the ledger's writes go on it
between the runs' transactions, else on one kept thread's: see ``keep_ledger_connection``)
and the one it takes entries' locks on (closed only after
trouble: see ``DedicatedLock``), with one watchdog thread for its locks; all three are
closed once it has waited ``IDLE_CLOSE`` seconds for a run, so that an idle fleet holds only
its schedulers' connections.

Runs stay isolated: a run past its timeout, or a worker killed from outside, ends that
worker only (SIGKILL: its connections die with it, and the server frees its lock); the
scheduler records the run's death as before and forks a new worker in its place. A worker
never outlives its scheduler: it watches a pipe whose write end only the scheduler holds
(every worker closes the ends it inherited from its siblings), and kills itself when that
pipe closes, so a retry can never overlap an orphan.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.dedicated import close_dedicated_connection
from advisory_lock.dedicated import dedicated_connection
from advisory_lock.dedicated import direct_alias
from advisory_lock.exceptions import LockLost
from advisory_lock.own_connection import close_kept_connection
from advisory_lock.own_connection import keep_ledger_connection
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.control import REQUEST_EXPIRES
from advisory_lock.server_clock import count_from_readings
from advisory_lock.single_instance.guarded import GuardedRun

logger = logging.getLogger("advisory_lock")

#: What a worker answers after a run: it succeeded (or, a task entry's, was enqueued).
SUCCEEDED = 0
#: ... it failed (the worker recorded it).
FAILED = 1
#: ... it failed, and its lock was lost while it ran (the worker exits after answering).
LOST = 2
#: ... it did not run: the entry's lock was busy, or the slot taken or done.
SKIPPED = 3
#: ... it failed before it started: its lock or its claim was refused (a read-only server,
#: the ledger's tables missing...); nothing was recorded. The answer says why.
NOT_STARTED = 4
#: How many workers a scheduler forks when ``run_jobs --workers`` does not say.
DEFAULT_WORKERS = 4
#: Seconds a worker waits for its next run before it closes its connections.
IDLE_CLOSE = 60.0


@dataclass
class Run:
    """A run given to a worker: the entry, its slot, and when it was given."""

    entry: Entry
    slot: str
    manual: bool
    started: float  # time.monotonic()
    stopped_because: str = ""


class Worker:
    """A job process of the pool, and the run it has now (None: idle)."""

    def __init__(self, process: BaseProcess, jobs: Connection, lifeline: int) -> None:
        self.process = process
        self.jobs = jobs  # the scheduler's end: runs go out, exit statuses come back
        self.lifeline = lifeline  # the write end of the pipe the worker watches
        self.run: Run | None = None

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def give(self, run: Run) -> None:
        self.run = run
        self.jobs.send((run.entry, run.slot, run.manual))

    def answer(self) -> tuple[int, str] | None:
        """The exit status of the worker's run and, if it did not start, why: to be called
        once its jobs pipe is readable (``Pool.answered``), when it does not wait (None: it
        died, and its end of the pipe closed)."""
        if self.run is not None:
            try:
                answer: tuple[int, str] = self.jobs.recv()
            except (EOFError, OSError):
                return None  # it died while it answered: reaped as a death
            return answer
        return None

    def close(self) -> None:
        """After the process has ended: close the scheduler's ends of its pipes."""
        self.jobs.close()
        os.close(self.lifeline)


class Pool:
    """``size`` workers running slots on the database ``using``; each run names its entry
    (sent whole: a worker needs no schedule of its own)."""

    def __init__(self, size: int, using: str) -> None:
        self.size = size
        self.using = using
        self.workers: list[Worker] = []

    def fill(self) -> None:
        """Fork workers until there are ``size``. The scheduler's connections are closed
        first (they reopen on use): a worker must not share their sockets."""
        for worker in list(self.workers):
            if worker.run is None and not worker.process.is_alive():
                # An idle worker that ended: after a run that lost its lock (it exits, see
                # ``_serve``), or killed from outside between runs.
                worker.process.join()
                self.remove(worker)
        if len(self.workers) >= self.size:
            return  # and with a size of 0, none
        connections.close_all()
        while len(self.workers) < self.size:
            self.workers.append(self._fork())

    def idle(self) -> list[Worker]:
        return [
            worker for worker in self.workers if worker.run is None and worker.process.is_alive()
        ]

    def busy(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.run is not None]

    def answers(self) -> list[int]:
        """The file descriptors that become readable when a worker answers."""
        return [worker.jobs.fileno() for worker in self.busy()]

    def answered(self) -> set[Worker]:
        """The busy workers whose answer can be read without waiting (or whose end of the
        pipe closed: they died), in one ``select()`` for them all. A ``Connection`` reads a
        message's exact length from its pipe and keeps nothing buffered, so a pipe with a
        message is readable."""
        busy = {worker.jobs.fileno(): worker for worker in self.busy()}
        readable, _, _ = select.select(list(busy), [], [], 0)
        return {busy[fd] for fd in readable}

    def remove(self, worker: Worker) -> None:
        """A worker that has ended (joined): forget it (``fill`` forks another)."""
        worker.close()
        self.workers.remove(worker)

    def stop(self) -> None:
        """Let the idle workers go (they exit when their jobs pipe closes)."""
        for worker in list(self.workers):
            if worker.run is None:
                worker.jobs.close()  # a closed Connection closes again as a no-op
                worker.process.join()
                self.remove(worker)

    def _fork(self) -> Worker:
        read_end, write_end = os.pipe()
        ours, theirs = multiprocessing.Pipe()
        siblings = [(worker.jobs, worker.lifeline) for worker in self.workers]
        context = multiprocessing.get_context("fork")
        process = context.Process(
            target=_serve,
            args=(self.using, theirs, read_end, write_end, ours, siblings),
            name="run_jobs worker",
        )
        process.start()
        os.close(read_end)
        theirs.close()
        return Worker(process, ours, write_end)


def _serve(
    using: str,
    jobs: Connection,
    read_end: int,
    write_end: int,
    ours: Connection,
    siblings: list[tuple[Connection, int]],
) -> None:
    """A worker's life: run what the scheduler gives, answer each run's exit status; end
    when the scheduler closes the jobs pipe, or dies."""
    os.close(write_end)
    ours.close()
    for sibling_jobs, sibling_lifeline in siblings:  # their ends are the scheduler's alone
        sibling_jobs.close()
        os.close(sibling_lifeline)

    def die_with_the_scheduler() -> None:
        while os.read(read_end, 1):  # nothing is ever written: this returns at EOF
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_scheduler, daemon=True).start()
    # The scheduler alone stops a run (SIGKILL, after its timeout or its --stop-grace): a
    # SIGTERM or SIGINT sent to the scheduler's whole process group or cgroup (a terminal's
    # Ctrl-C, systemd) must not cut the grace short. Its own process group, too.
    os.setpgid(0, 0)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    lock_connection = dedicated_connection(direct_alias(using), "run_jobs worker")
    keep_ledger_connection()  # the ledger's writes on kept connections, not one each
    count_from_readings()  # the server's clock read once a second, not at each claim and end
    while True:
        try:
            if not jobs.poll(IDLE_CLOSE):
                # Idle for a while: its connections go, so that an idle fleet holds only its
                # schedulers' (they reopen at the next run).
                connections.close_all()
                close_kept_connection()
                close_dedicated_connection(lock_connection)  # and its watchdog's thread
            entry, slot, manual = jobs.recv()
        except (EOFError, OSError):
            _exit(0)
        status, why = run_slot(entry, slot, using, manual, lock_connection)
        if status in (FAILED, LOST, NOT_STARTED):
            connections.close_all()  # the next run starts on fresh connections
        sys.stdout.flush()
        sys.stderr.flush()
        jobs.send((status, why))
        if status == LOST:
            # The run's lock went while it ran: whatever the job left behind (a thread, a
            # child process) may still be at work without it, so the worker ends with its
            # run, as a job process of its own would; the scheduler forks another.
            _exit(0)


def run_slot(
    entry: Entry, slot: str, using: str, manual: bool, lock_connection: BaseDatabaseWrapper
) -> tuple[int, str]:
    """Take the entry's lock, claim the slot, run the job, record its end: SUCCEEDED,
    FAILED, LOST or SKIPPED; NOT_STARTED with why when it failed before its claim, nothing
    recorded (the scheduler says it, once). A
    ``manual`` (run-now) slot waits for a run of the entry going on elsewhere (its request
    is pending until its slot has an attempt, an hour at most), and is attempted once."""
    run = GuardedRun(
        entry.lock_key(),
        using=using,
        label=entry.name,
        period=lambda _now: slot,
        wait=REQUEST_EXPIRES.total_seconds() if manual else 0,
        retry_failed=not manual,
        max_attempts=1 if manual else 1 + entry.retries,  # counted in the ledger: fleet-wide
        atomic=entry.atomic,
        lock_connection=lock_connection,
    )
    try:
        started = run.start()
    except Exception as exc:
        if run.run is not None:
            # Claimed, then stopped before its body (its lock lost since it was taken):
            # start() recorded the attempt failed, so it counts, and is said, as one.
            logger.error("%s [%s] failed before its body: %r", entry.name, slot, exc)
            return _failed(run, exc), ""
        logger.debug("%s [%s] failed before it started: %r", entry.name, slot, exc)
        summary = (str(exc).strip().splitlines() or [""])[0]
        return NOT_STARTED, f"{type(exc).__name__}: {summary}"
    if not started:
        logger.debug("%s", run.skipped)
        return SKIPPED, ""
    try:
        done = entry.target()()
        if entry.task is not None:
            run.enqueued_task_id = done  # the slot's row says which task is its run
    except BaseException as exc:
        with contextlib.suppress(BaseException):  # a LockLost: the run is recorded failed
            run.end(exc)
        logger.error("%s [%s] failed: %r", entry.name, slot, exc)
        return _failed(run, exc), ""
    try:
        run.end(None)
    except Exception as exc:
        logger.error("%s [%s] failed: %r", entry.name, slot, exc)
        return _failed(run, exc), ""
    return SUCCEEDED, ""


def _failed(run: GuardedRun, exc: BaseException) -> int:
    """LOST if the run's lock went while it ran, else FAILED."""
    lost = isinstance(exc, LockLost) or (run.lock is not None and run.lock.lost)
    return LOST if lost else FAILED


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
