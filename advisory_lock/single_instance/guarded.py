"""A run of a job under a lock of its own: the machinery of single-instance commands and
functions, and of ``run_once``.

The lock lives on a connection opened for it alone (``DedicatedLock``), held for the whole
run, watched by a heartbeat thread, and closed at the end. A lost lock interrupts a run in
the main thread at once (the watchdog sends it SIGINT, and the handler installed for the run
raises ``LockLost``). No exception can be delivered into another running thread: there the
body may call ``lock.check()``, and ``LockLost`` is raised when the body returns at the
latest.

Whatever ends a run between the take and the finish (an exception, ``KeyboardInterrupt``, a
cancelled task) lets go of all it took: the watchdog stops, the run is recorded failed, the
lock is released and its connection closed. In async code ``astart()`` and ``aend()`` run
the steps in a worker thread, and a cancellation that arrives while one runs there waits for
its end, undoes what it took, and is raised after.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.db import connections
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError

from advisory_lock.async_locks import _Hop
from advisory_lock.conf import get_setting
from advisory_lock.dedicated import DedicatedLock
from advisory_lock.dedicated import direct_alias
from advisory_lock.exceptions import LockLost
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.periods import Period
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_seconds

if TYPE_CHECKING:
    from advisory_lock.ledger import JobRun

logger = logging.getLogger("advisory_lock")
T = TypeVar("T")

#: What a lost lock does: raise ``LockLost``, log a warning, or call this with the message.
OnLost = Literal["raise", "warn"] | Callable[[str], object]
INTERRUPTED_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: The longest heartbeat: the watchdog waits that long, and the end of a run whose lock was
#: lost twice that long (threading's longest timeout), and a timedelta must hold it.
MAX_HEARTBEAT = min(threading.TIMEOUT_MAX / 2, datetime.timedelta.max.total_seconds())


def check_heartbeat(heartbeat: object) -> float:
    """Seconds between two checks of a run's lock: a number ``> 0`` that the watchdog can
    wait on (at most ``MAX_HEARTBEAT``). Checked before anything is taken: ``1e300`` is
    finite, and would fail (OverflowError) once the lock is held and the slot claimed."""
    try:
        seconds = check_seconds("heartbeat", heartbeat, allow_zero=False)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if seconds > MAX_HEARTBEAT:
        raise ValueError(
            f"heartbeat must be at most {MAX_HEARTBEAT:g} seconds (the longest wait "
            f"threading allows, halved), not {heartbeat!r}."
        )
    return seconds


class GuardedRun:
    """One run of a job under a lock of its own: the machinery of single-instance commands
    and ``run_once``.

    ``start()`` takes the lock on a dedicated connection (waiting at most ``wait`` seconds),
    claims the ledger's slot when there is a ``period``, starts the watchdog and, in the main
    thread, the signal handlers; with ``atomic``, it then opens the body's transaction on the
    ledger's database and locks the run's row in it (``lock_running_row``), and ``end()``
    writes the success in that transaction before it commits (``_commit``). ``end(exc)``
    runs after the body, in this order: the watchdog stops (so a loss can no longer be
    signalled), the handlers are restored, the end is recorded in the ledger (fenced), the
    lock is released. Whatever interrupts either of them, or ``start()`` before it returns,
    lets go of all that was taken (see ``_undo()``). ``astart()`` and ``aend()`` are the
    same in async code, safe to cancel.

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
        max_attempts: int | None = None,
        owns_process: bool = False,
        atomic: bool = False,
        exit_after_loss: bool = False,
        lock_connection: BaseDatabaseWrapper | None = None,
    ) -> None:
        if check_flag("atomic", atomic) and period is None:
            raise ValueError(
                f"{label}: atomic=True commits the run's success in the ledger together with "
                f"its writes: it needs a ledger period."
            )
        self.key = make_key(key)
        #: A command owns its process: SIGTERM and SIGINT end its run (see below).
        self.owns_process = owns_process
        #: A command run from the command line ends its process once its lock is lost:
        #: within ``exit_deadline(heartbeat)`` of the loss, whatever its way out waits for.
        self.exit_after_loss = exit_after_loss
        self.using = using
        self.label = label
        #: The connection to take the lock on, kept by the caller from one run to the next
        #: (a scheduler's worker); None: a new one, closed at the end.
        self.lock_connection = lock_connection
        self.wait = wait
        self.heartbeat = check_heartbeat(heartbeat)
        self.on_lost = on_lost
        self.period = period
        self.retry_failed = retry_failed
        #: At most this many attempts at a slot, fleet-wide (None: no bound).
        self.max_attempts = max_attempts
        #: The body runs in a transaction on the ledger's database that commits its success.
        self.atomic = atomic
        #: That transaction, from the end of ``start()`` to ``end()``.
        self._transaction: contextlib.AbstractContextManager[object] | None = None
        #: Set by the body of a scheduled task entry: the id its queue gave the task. The
        #: run is then recorded ``enqueued`` with it, not ``succeeded``.
        self.enqueued_task_id: str | None = None
        #: The run's lock, once ``start()`` returned True.
        self.lock: DedicatedLock | None = None
        self.run: JobRun | None = None
        #: Why the run did not go ahead (after ``start()`` returned False), and whether it
        #: was because the lock was busy (else the ledger's slot was taken).
        self.skipped = ""
        self.busy = False
        self._interrupted: list[int] = []
        self._handlers: dict[int, Any] = {}
        #: What this run holds from the moment its lock is made until it is let go: the
        #: lock, and with it the run's row (``run``) and the watchdog.
        self._held: DedicatedLock | None = None

    @property
    def holding(self) -> bool:
        """Has the run taken something that ``end()`` must let go of?"""
        return self._held is not None

    def start(self) -> bool:
        """Take the lock and claim the slot: True if the run goes ahead. Whatever interrupts
        it lets go of what it took before propagating (the run is recorded failed)."""
        if self.period is not None:
            # Only a run with a ledger imports it (not when this module loads: its models
            # need Django's app registry, and the app in INSTALLED_APPS, which a plain run
            # does without). Without the app this raises LedgerNotMigrated, saying so,
            # before anything is taken.
            from advisory_lock.ledger import claim_slot
            from advisory_lock.ledger import describe_taken
            from advisory_lock.ledger import lock_running_row
            from advisory_lock.ledger import record_job_run

        if self.atomic:
            _check_not_in_atomic(direct_alias(check_alias(self.using)), self.label)
        lock = self._held = DedicatedLock(
            self.key, using=self.using, label=self.label, connection=self.lock_connection
        )
        try:
            if not lock.acquire(self.wait):
                self.skipped = lock.busy_message()  # it closes the lock's connection
                self._held = None
                self.busy = True
                if self.period is not None:
                    record_job_run("skipped", self.label, lock.using)
                return False
            if self.period is not None:
                run, taken = claim_slot(
                    lock.using,
                    self.label,
                    self.period,
                    self.retry_failed,
                    held=lock.key,
                    still_held=lock.verify,
                    max_attempts=self.max_attempts,
                )
                if run is None:
                    self.skipped = f"{self.label}: skipped, {describe_taken(taken)}."
                    self._held = None
                    lock.let_go()
                    return False
                run.lock = lock
                self.run = run
            in_main_thread = threading.current_thread() is threading.main_thread()
            self.lock = lock
            lock.watch(self.heartbeat, self._lost_handler(in_main_thread))
            if in_main_thread:
                self._handlers = _install_signal_handlers(
                    lock, self._interrupted, self.owns_process
                )
            if self.atomic:
                assert self.run is not None
                # The body's transaction, on this thread's connection to the ledger's
                # database, which the body's writes use too. The claim above committed on a
                # connection of its own; its row is locked here first, until the commit.
                self._transaction = transaction.atomic(using=lock.using)
                self._transaction.__enter__()
                lock_running_row(lock.using, self.run)
            if self.run is not None and not lock.verify(self.heartbeat):
                # Lost since it was taken (between the try and the claim, or while the
                # atomic run's row was being locked): the body must not start unguarded. The
                # last step before the body, so that no statement of the run comes after it.
                raise LockLost(lock.lost_message())
        except BaseException as error:
            self._undo(error, "before the job started")
            raise
        return True

    def end(self, exc: BaseException | None) -> None:
        """After the body (``exc``: what it raised): record the end, release the lock.

        Raises ``LockLost`` (with ``on_lost="raise"``, and unless ``exc`` propagates) if the
        lock was lost, or the run's row was taken over meanwhile. Whatever interrupts it, the
        lock is let go of.
        """
        lock, self._held = self._held, None
        assert lock is not None, "end() after a start() that returned False, or twice"
        raising = exc is None and self.on_lost == "raise"
        problems: list[Exception] = []
        released = False
        try:
            # The watchdog first: while it runs it may still signal, and the run's handler
            # must be the one to catch that.
            lock.stop_watching()
            _restore_signal_handlers(self._handlers)
            self._handlers = {}
            if exc is not None and self._interrupted and not lock.lost:
                logger.warning(
                    "%s: interrupted by signal %d; lock released.",
                    self.label,
                    self._interrupted[0],
                )
            recorded = False
            ended = exc  # what ended the run: the body's error, or its commit's
            if self._transaction is not None:
                ended = self._commit(exc, lock.using)
                recorded = ended is None
                if exc is None and isinstance(ended, Exception):
                    # The run's writes were rolled back: whatever on_lost says, that must
                    # not pass silently.
                    raising = True
                    problems.append(ended)
            # A run taken over, or whose lock was lost, at its commit writes nothing: its
            # row is its successor's to mark abandoned.
            taken_over = exc is None and type(ended) is LockLost
            if self.run is not None and not recorded and not taken_over:
                from advisory_lock.ledger import finish  # a run with a ledger only

                error = _failure(ended, "while the job ran") if ended is not None else ""
                try:
                    # After a lost lock the database may be out of reach: bounded then, so
                    # that a silent network can't hold the process (the row is abandoned
                    # later).
                    timeout = max(2 * self.heartbeat, 1.0) if lock.lost else None
                    task_id = self.enqueued_task_id if ended is None else None
                    finish(lock.using, self.run, error=error, timeout=timeout, task_id=task_id)
                    recorded = True
                except LockLost as lost_row:
                    problems.append(lost_row)
                except Exception as failure:
                    if ended is None and not lock.lost:
                        raise  # a success that can't be recorded must not pass silently
                    logger.error(
                        "%s: could not record the end of run %s (%s); the next run will "
                        "mark it abandoned.",
                        self.label,
                        self.run.pk,
                        failure,
                    )
            released = True  # release() closes the connection, whatever happens
            try:
                lock.release()
            except LockLost as lost:
                if recorded and not lock.lost and not self._overlapped(lock):
                    # The fenced end was recorded (nobody took this slot over), and no run
                    # of the job started before it ended: the lock went after the work was
                    # done.
                    logger.warning("%s (after the run was recorded)", lost)
                else:
                    problems.append(lost)
        finally:
            if not released:
                lock.let_go()
        if problems:
            if self.exit_after_loss and any(isinstance(p, LockLost) for p in problems):
                _exit_within(exit_deadline(self.heartbeat), str(problems[0]))
            if raising:
                raise problems[0]
            loss = next((problem for problem in problems if isinstance(problem, LockLost)), None)
            if (
                loss is not None
                and self.on_lost == "raise"
                and isinstance(exc, Exception)
                and not isinstance(exc, LockLost)
            ):
                # The body failed after its lock was lost: the loss comes first, since
                # exclusion may have been broken while it ran; the body's error is its cause.
                # (An interruption, KeyboardInterrupt or SystemExit, propagates as it is.)
                raise loss from exc
            for problem in problems:
                logger.error("%s", problem)

    async def astart(self) -> bool:
        """``start()`` in a worker thread (the run's connections are its own: they need not
        hold up the thread of Django's async ORM calls).

        A cancellation that arrives while it runs there waits for its end: if it went
        ahead, all it took is let go of (the run recorded failed, "cancelled before the job
        started") before ``CancelledError`` is raised. One that arrives before it began
        there: it never runs.
        """
        try:
            return await _in_worker_thread(self.start)
        except asyncio.CancelledError as cancelled:
            if self._held is not None:
                await _in_worker_thread(
                    self._undo, cancelled, "before the job started", must_run=True
                )
            raise

    async def aend(self, exc: BaseException | None) -> None:
        """``end(exc)`` in a worker thread, run to its end whatever cancellations arrive
        meanwhile (a ``CancelledError`` body is recorded failed, "cancelled"); the
        cancellation is raised after."""
        await _in_worker_thread(self.end, exc, must_run=True)

    def _undo(self, exc: BaseException, when: str) -> None:
        """Let go of what the run took, after ``exc`` interrupted it ``when``: stop the
        watchdog, restore the handlers, record the run failed (if its slot was claimed),
        release the lock and close its connection. Errors are logged, not raised: ``exc``
        is what propagates."""
        lock, self._held, self.lock = self._held, None, None
        if lock is None:
            return
        try:
            if self._transaction is not None:
                self._roll_back(exc)
            lock.stop_watching()
            _restore_signal_handlers(self._handlers)
            self._handlers = {}
            if self.run is not None:
                from advisory_lock.ledger import finish  # a run with a ledger only

                # Bounded: after a lost lock or a failure the database may be out of reach.
                timeout = max(2 * self.heartbeat, 1.0)
                try:
                    finish(lock.using, self.run, error=_failure(exc, when), timeout=timeout)
                except Exception as failure:
                    logger.error(
                        "%s: could not record the end of run %s (%s); the next run will "
                        "mark it abandoned.",
                        self.label,
                        self.run.pk,
                        failure,
                    )
        finally:
            lock.let_go()

    def _commit(self, exc: BaseException | None, using: str) -> BaseException | None:
        """End an atomic run's transaction: the body's writes commit with the run's success
        (fenced), or roll back. What ended the run: ``exc`` (the body's error), the fence's
        ``LockLost`` or ``SlotAlreadySucceeded``, the commit's error; None if committed."""
        from advisory_lock.ledger import record_job_run
        from advisory_lock.ledger import succeed_in_transaction

        run, block = self.run, self._transaction
        assert run is not None and block is not None
        if exc is None:
            try:
                succeed_in_transaction(using, run, self.enqueued_task_id)
            except Exception as failure:
                exc = failure
            except BaseException as interrupted:  # KeyboardInterrupt: the run ends here
                self._roll_back(interrupted)
                raise
        if exc is not None:
            self._roll_back(exc)
            return exc
        self._transaction = None
        try:
            block.__exit__(None, None, None)
        except Exception as failure:  # Atomic rolled back what the commit could not commit
            return failure
        run.refresh_from_db(using=using)
        record_job_run(run.status, run.job_name, using, run)
        return None

    def _roll_back(self, exc: BaseException) -> None:
        """Roll back an atomic run's transaction, which ``exc`` ended. Errors are logged, not
        raised: ``exc`` is what propagates (a rollback that fails closes the connection, and
        a transaction is never committed without its COMMIT)."""
        block, self._transaction = self._transaction, None
        assert block is not None
        try:
            block.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as failure:
            logger.error("%s: could not roll back the run's transaction (%s)", self.label, failure)

    def _overlapped(self, lock: DedicatedLock) -> bool:
        """Did a run of the job (of any slot) start before this one ended? Its lock, lost,
        let another instance in: the fence covers a slot, the lock the whole job. Asked on
        the ledger's own connection, as its writes (none is left open in a worker thread)."""
        from advisory_lock.ledger import JobRun
        from advisory_lock.own_connection import write

        run = self.run
        assert run is not None and run.finished_at is not None
        later = JobRun.objects.using(lock.using).filter(job_name=run.job_name, pk__gt=run.pk)
        return write(lock.using, later.filter(started_at__lt=run.finished_at).exists)

    def _lost_handler(self, in_main_thread: bool) -> Callable[[], None]:
        on_lost, lock = self.on_lost, self.lock
        assert lock is not None

        exit_after_loss, heartbeat = self.exit_after_loss, self.heartbeat

        def lost() -> None:
            message = lock.lost_message()
            logger.error(message)
            if exit_after_loss and on_lost == "raise":
                _exit_within(exit_deadline(heartbeat), message)
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


def exit_deadline(heartbeat: float) -> float:
    """Seconds from a lost lock to the end of its command's process at the latest: the way
    out (the ledger's end, bounded by 2 heartbeats; the release and the close, by one each)
    with room to spare, and never under 10 s."""
    return max(10.0, 5 * heartbeat)


_exit_timers: list[threading.Timer] = []


def _exit_within(seconds: float, message: str) -> None:
    """End this process with status 1 in ``seconds`` unless it has ended by then.

    A command whose lock was lost must stop: another instance may be running. Its way out
    runs statements (the ledger's end, the release, closing connections, Django's
    ``connections.close_all()`` after the command, the project's at-exit handlers), and a
    socket read waits for as long as the kernel keeps the connection: on a silent network,
    for ever. So a timer (a daemon thread: a process that exits on its own does not wait
    for it) ends the process then, with ``os._exit()``, which runs nothing more. Armed once.
    """
    if _exit_timers:
        return

    def exit_now() -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.write(
                f"{message}\nThe process did not end within {seconds:g}s of the loss (its "
                f"way out waits on the network): exiting now, with status 1.\n"
            )
            sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.name = "advisory_lock:exit-after-loss"
    timer.daemon = True
    _exit_timers.append(timer)
    timer.start()


def _check_not_in_atomic(using: str, label: str) -> None:
    """An atomic run commits its success when its body ends: it can't run inside an atomic
    block on the ledger's database, whose commit (or rollback) comes later. Except in tests
    whose ledger writes in the test's transaction (``LEDGER_IN_CALLERS_TRANSACTION``, the
    testing kit's ``isolated_ledger``): there the run is a savepoint of it, its writes and
    its success released together, and rolled back with the test's."""
    if get_setting("LEDGER_IN_CALLERS_TRANSACTION"):
        return
    if connections[using].in_atomic_block:
        raise TransactionManagementError(
            f"{label}: atomic=True runs the job in a transaction of its own on database "
            f"{using!r} and commits the run's success with its writes, so it can't run "
            f"inside an atomic block there: that block could still roll the success back. "
            f"Run it outside the atomic block."
        )


def _failure(exc: BaseException, when: str) -> str:
    """What the ledger records of a run that ``exc`` ended: the traceback; for a cancelled
    task, saying so first; for a lock lost before the body, the loss."""
    from advisory_lock.ledger import format_error

    if isinstance(exc, asyncio.CancelledError):
        return f"cancelled {when}: the task running the job was cancelled.\n{format_error(exc)}"
    if isinstance(exc, LockLost) and when == "before the job started":
        return f"{exc} ({when})"
    return format_error(exc)


async def _in_worker_thread(func: Callable[..., T], *args: object, must_run: bool = False) -> T:
    """``func(*args)`` in a worker thread (not the thread of Django's async ORM calls).

    If the task is cancelled meanwhile, a call that started is awaited to its end, through
    any further cancellation (a thread can't be interrupted, and the caller must know what
    the call took); a call that had not started is dropped, or with ``must_run`` run all the
    same. ``CancelledError`` is raised after.
    """
    cancelled: asyncio.CancelledError | None = None
    while True:
        hop = _Hop(func)
        try:
            result: T = await sync_to_async(hop, thread_sensitive=False)(*args)
        except asyncio.CancelledError as error:
            cancelled = cancelled or error
            if not hop.abandon():
                break  # it runs on in its thread: wait for its end below
            if must_run:
                continue  # it never started: run it again
            raise
        if cancelled is not None:  # cancelled before an earlier try started: now it ran
            raise cancelled
        return result
    outcome = asyncio.wrap_future(hop.outcome)
    while not outcome.done():
        # Never raises the call's own error; cancelled again, the call still runs: wait on.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({outcome})
    failure = None if outcome.cancelled() else outcome.exception()
    if failure is not None and not isinstance(failure, asyncio.CancelledError):
        logger.error(
            "%s, interrupted by a cancellation, failed: %r",
            getattr(func, "__qualname__", func),
            failure,
        )
    assert cancelled is not None
    raise cancelled


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
