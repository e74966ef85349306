"""A scheduler's runs: those going on in its workers (``Child``), those whose worker died
before it could record their end (``Death``), and the wait of an entry whose runs fail before
they start (``Backoff``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from advisory_lock.ledger import claimed_by_process
from advisory_lock.ledger import fail_orphaned
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.workers import Run
from advisory_lock.scheduling.workers import Worker

#: What the scheduler says, with why, of a dead run whose failure it could not write.
UNRECORDED = "not recorded in the ledger"
#: How long, in seconds, a scheduler waits for the server to free the lock of a job process
#: it saw die before it leaves the run to a sweep. A server frees a session's locks once it
#: has read the end of its connection, which the kernel closes when the process dies: a
#: moment after the scheduler has reaped it, not at the same instant.
LOCK_FREED_AFTER_DEATH = 30.0


@dataclass
class Backoff:
    """How long an entry whose runs fail before they start waits before its next try: 1 s,
    then twice the last wait, at most ``CAP`` seconds (a handful of tries a minute)."""

    FIRST = 1.0
    CAP = 60.0

    wait: float = 0.0
    until: float = 0.0  # time.monotonic()

    def again(self) -> None:
        self.wait = min(2 * self.wait, self.CAP) if self.wait else self.FIRST
        self.until = time.monotonic() + self.wait


@dataclass
class Child:
    """A run going on here: the worker that runs it, and what it runs."""

    worker: Worker
    run: Run

    @property
    def entry(self) -> Entry:
        return self.run.entry

    @property
    def slot(self) -> str:
        return self.run.slot

    @property
    def process(self) -> BaseProcess:
        return self.worker.process


@dataclass
class Death:
    """A job process that died before it could record its run's end, and how."""

    child: Child
    how: str
    since: float  # time.monotonic() when it was reaped
    said_waiting: bool = False

    def record(self, using: str) -> str | None:
        """Record the run failed on ``using``, with how it died, if its row is ``running``
        under a free lock (one statement; one more if not), so that a live owner's run never
        is. None while the server still holds the dead process's lock, for up to
        ``LOCK_FREED_AFTER_DEATH`` seconds: try again later. Else what follows how it died
        when it is said: nothing if it was recorded, else why not."""
        name, slot = self.child.entry.name, self.child.slot
        if fail_orphaned(using, name, slot, f"The run {self.how}."):
            return ""
        if not claimed_by_process(using, name, slot, self.child.process.pid or 0):
            return (
                f"; {UNRECORDED}: it had no running row there (it died before it claimed the "
                f"slot, or its row was ended already)"
            )
        if time.monotonic() - self.since < LOCK_FREED_AFTER_DEATH:
            return None
        return (
            f"; {UNRECORDED}: its lock was still held {LOCK_FREED_AFTER_DEATH:g}s after it "
            f"died, so its row stays running until a sweep finds the lock free and marks it "
            f"abandoned"
        )
