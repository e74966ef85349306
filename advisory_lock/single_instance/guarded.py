"""A run of a job under a lock of its own: the machinery of single-instance commands and
functions, and of ``run_once``.

The lock lives on a connection opened for it alone (``DedicatedLock``), held for the whole
run, watched by a heartbeat thread, and closed at the end. A lost lock interrupts a run in
the main thread at once (the watchdog sends it SIGINT, and the handler installed for the run
raises ``LockLost``). No exception can be delivered into another running thread: there the
body may call ``lock.check()``, and ``LockLost`` is raised when the body returns at the
latest.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

from advisory_lock.dedicated import DedicatedLock
from advisory_lock.exceptions import LockLost
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.periods import Period

if TYPE_CHECKING:
    from advisory_lock.models import JobRun

logger = logging.getLogger("advisory_lock")

OnLost = str | Callable[[str], Any]
INTERRUPTED_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class GuardedRun:
    """One run of a job under a lock of its own: the machinery of single-instance commands
    and ``run_once``.

    ``start()`` takes the lock on a dedicated connection (waiting at most ``wait`` seconds),
    claims the ledger's slot when there is a ``period``, starts the watchdog and, in the main
    thread, the signal handlers. ``end(exc)`` runs after the body, in this order: the
    watchdog stops (so a loss can no longer be signalled), the handlers are restored, the
    end is recorded in the ledger (fenced), the lock is released.

    A lost lock, with ``on_lost="raise"``, raises ``LockLost``: at once in the main thread (the
    watchdog interrupts it with SIGINT, which the run's handler turns into ``LockLost``); at
    ``end()`` elsewhere, or when the body calls ``lock.check()``.
    """

    def __init__(
        self,
        key: Key | LockKey,
        *,
        using: str | None,
        label: str,
        wait: float = 0,
        heartbeat: float = 10,
        on_lost: OnLost = "raise",
        period: Period | None = None,
        retry_failed: bool = True,
        owns_process: bool = False,
    ) -> None:
        self.key = make_key(key)
        #: A command owns its process: SIGTERM and SIGINT end its run (see below).
        self.owns_process = owns_process
        self.using = using
        self.label = label
        self.wait = wait
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.period = period
        self.retry_failed = retry_failed
        self.lock: DedicatedLock | None = None
        self.run: JobRun | None = None
        #: Why the run did not go ahead (after ``start()`` returned False), and whether it
        #: was because the lock was busy (else the ledger's slot was taken).
        self.skipped = ""
        self.busy = False
        self._interrupted: list[int] = []
        self._handlers: dict[int, Any] = {}

    def start(self) -> bool:
        """Take the lock and claim the slot: True if the run goes ahead."""
        # The ledger needs Django's app registry, which is not ready when this module loads.
        from advisory_lock.ledger import claim_slot
        from advisory_lock.ledger import describe_taken
        from advisory_lock.ledger import finish
        from advisory_lock.ledger import record_job_run

        lock = DedicatedLock(self.key, using=self.using, label=self.label)
        if not lock.acquire(self.wait):
            self.skipped = lock.busy_message()
            self.busy = True
            if self.period is not None:
                record_job_run("skipped", self.label, lock.using)
            return False
        if self.period is not None:
            try:
                run, taken = claim_slot(
                    lock.using,
                    self.label,
                    self.period,
                    self.retry_failed,
                    held=lock.key,
                    still_held=lock.verify,
                )
            except BaseException:
                lock.close()  # closing the connection releases the lock
                raise
            if run is None:
                lock.close()
                self.skipped = f"{self.label}: skipped, {describe_taken(taken)}."
                return False
            run.lock = lock
            self.run = run
            if not lock.verify(self.heartbeat):
                # Lost between the try and the claim: the body must not start unguarded.
                lost = LockLost(lock.lost_message())
                with contextlib.suppress(Exception):
                    finish(lock.using, run, error=f"{lost} (before the job started)")
                lock.close()
                raise lost
        self.lock = lock
        in_main_thread = threading.current_thread() is threading.main_thread()
        lock.watch(self.heartbeat, self._lost_handler(in_main_thread))
        if in_main_thread:
            self._handlers = _install_signal_handlers(lock, self._interrupted, self.owns_process)
        return True

    def end(self, exc: BaseException | None) -> None:
        """After the body (``exc``: what it raised): record the end, release the lock.

        Raises ``LockLost`` (with ``on_lost="raise"``, and unless ``exc`` propagates) if the
        lock was lost, or the run's row was taken over meanwhile.
        """
        from advisory_lock.ledger import finish
        from advisory_lock.ledger import format_error

        lock = self.lock
        assert lock is not None, "end() after a start() that returned False"
        # The watchdog first: while it runs it may still signal, and the run's handler must
        # be the one to catch that.
        lock.stop_watching()
        _restore_signal_handlers(self._handlers)
        if exc is not None and self._interrupted and not lock.lost:
            logger.warning(
                "%s: interrupted by signal %d; lock released.", self.label, self._interrupted[0]
            )
        raising = exc is None and self.on_lost == "raise"
        problems: list[LockLost] = []
        recorded = False
        if self.run is not None:
            error = format_error(exc) if exc is not None else ""
            try:
                # After a lost lock the database may be out of reach: bounded then, so that
                # a silent network can't hold the process (the row is abandoned later).
                timeout = max(2 * self.heartbeat, 1.0) if lock.lost else None
                finish(lock.using, self.run, error=error, timeout=timeout)
                recorded = True
            except LockLost as taken_over:
                problems.append(taken_over)
            except Exception as failure:
                if exc is None and not lock.lost:
                    lock.close()
                    raise  # a success that can't be recorded must not pass silently
                logger.error(
                    "%s: could not record the end of run %s (%s); the next run will mark it "
                    "abandoned.",
                    self.label,
                    self.run.pk,
                    failure,
                )
        try:
            lock.release()
        except LockLost as lost:
            if recorded and not lock.lost and not self._overlapped():
                # The fenced end was recorded (nobody took this slot over), and no run of the
                # job started before it ended: the lock went after the work was done.
                logger.warning("%s (after the run was recorded)", lost)
            else:
                problems.append(lost)
        if problems:
            if raising:
                raise problems[0]
            for problem in problems:
                logger.error("%s", problem)

    def _overlapped(self) -> bool:
        """Did a run of the job (of any slot) start before this one ended? Its lock, lost,
        let another instance in: the fence covers a slot, the lock the whole job."""
        from advisory_lock.models import JobRun

        run, lock = self.run, self.lock
        assert run is not None and lock is not None and run.finished_at is not None
        later = JobRun.objects.using(lock.using).filter(job_name=run.job_name, pk__gt=run.pk)
        return later.filter(started_at__lt=run.finished_at).exists()

    def _lost_handler(self, in_main_thread: bool) -> Callable[[], None]:
        on_lost, lock = self.on_lost, self.lock
        assert lock is not None

        def lost() -> None:
            message = lock.lost_message()
            logger.error(message)
            if on_lost == "warn":
                return
            if callable(on_lost):
                on_lost(message)
                return
            if in_main_thread:
                # A signal wakes the main thread from sleep() and socket waits; the handler
                # installed for the run raises LockLost.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        return lost


# Signals: SIGTERM and SIGINT stop the command through its finally blocks (so the lock is
# released and the run recorded); a lost lock reaches a main thread blocked in sleep() or
# I/O as a SIGINT, which the handler turns into LockLost.


def _install_signal_handlers(
    lock: DedicatedLock, interrupted: list[int], owns_process: bool
) -> dict[int, Any]:
    """The run's handlers. A command owns its process: SIGTERM and SIGINT end the run (its end
    recorded, its lock released) and exit 143 or 130. A function or ``run_once`` runs inside
    someone else's process (a task queue's worker, a web server): only the watchdog's SIGINT is
    ours; any other goes on to the handler that was there before."""
    if not owns_process:
        previous = signal.getsignal(signal.SIGINT)

        def chained(signum: int, frame: Any) -> None:
            if lock.lost:
                raise LockLost(lock.lost_message())
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt  # Python's own default for SIGINT

        return {signal.SIGINT: signal.signal(signal.SIGINT, chained)}

    def handler(signum: int, frame: Any) -> None:
        if lock.lost:
            raise LockLost(lock.lost_message())
        interrupted.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(INTERRUPTED_EXIT_CODES[signal.Signals(signum)])

    return {signum: signal.signal(signum, handler) for signum in INTERRUPTED_EXIT_CODES}


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
