"""The ``job_runs`` ledger: at most one successful run per job and slot, and who ran what.

Each claim of a slot inserts a row: attempt 1, or the next attempt of a slot whose latest
attempt failed or was abandoned. The unique (job, slot, attempt) constraint lets only one of
two racing claimers in; a slot whose latest attempt is running or succeeded is taken. The
row's id is its fencing token: it grows with every claim.

Every run is guarded by a lock held for its whole duration, named in its row. A ``running``
row whose lock is free has lost its owner: the next claim, or ``mark_abandoned()``, marks it
``abandoned``. A run records its end only while its row is still ``running`` (a fenced
update): a run whose row was taken over meanwhile raises ``LockLost`` and writes nothing.

Every write runs on a connection of its own, in autocommit, so that it commits at once
whatever transaction the caller is in; locks are taken through the alias's DIRECT_ALIAS.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.db import IntegrityError
from django.db import connections
from django.db import router
from django.db import transaction

from advisory_lock import metrics
from advisory_lock.backends import inspector_for
from advisory_lock.conf import get_setting
from advisory_lock.dedicated import DedicatedLock
from advisory_lock.dedicated import direct_alias
from advisory_lock.exceptions import LockLost
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.models import JobRun
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period
from advisory_lock.periods import slot
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_seconds

if TYPE_CHECKING:
    from advisory_lock.single_instance import GuardedRun

logger = logging.getLogger("advisory_lock")
T = TypeVar("T")
Func = TypeVar("Func", bound=Callable[..., Any])
MAX_ERROR_LENGTH = 10_000
Status = JobRun.Status


class run_once:
    """Claim the job's slot, run the body, record ``succeeded`` or ``failed``.

    As a context manager it gives the running ``JobRun``, or ``None`` when the slot is
    already taken or another instance is running the job (the body then returns early). As a
    decorator a skipped call returns ``None`` without running. The lock ``job:<job_name>``
    is held on a connection of its own during the run and watched every ``heartbeat``
    seconds, as for single-instance commands: a lost lock raises ``LockLost``.
    """

    def __init__(
        self,
        job_name: str,
        *,
        period: Period = "daily",
        using: str | None = None,
        retry_failed: bool = True,
        heartbeat: float = 10,
    ) -> None:
        self.job_name = check_job_name(job_name)
        self.period = check_period(period)
        self.using = check_alias(using)
        self.retry_failed = check_flag("retry_failed", retry_failed)
        self.heartbeat = check_seconds("heartbeat", heartbeat, allow_zero=False)
        self._stacks: dict[object, list[GuardedRun | None]] = {}

    def __enter__(self) -> JobRun | None:
        guarded = self._guarded()
        started = guarded.start()
        self._push(guarded if started else None)
        if not started:
            logger.info("%s", guarded.skipped)
            return None
        return guarded.run

    def __exit__(self, exc_type: Any, exc_value: BaseException | None, tb: Any) -> None:
        guarded = self._pop()
        if guarded is not None:
            guarded.end(exc_value)

    async def __aenter__(self) -> JobRun | None:
        # The lock's connection and the ledger's writes are connections of their own: their
        # statements may run in any thread, without holding up the thread of the ORM calls.
        guarded = self._guarded()
        started = await sync_to_async(guarded.start, thread_sensitive=False)()
        self._push(guarded if started else None)
        if not started:
            logger.info("%s", guarded.skipped)
            return None
        return guarded.run

    async def __aexit__(self, exc_type: Any, exc_value: BaseException | None, tb: Any) -> None:
        guarded = self._pop()
        if guarded is not None:
            await sync_to_async(guarded.end, thread_sensitive=False)(exc_value)

    def __call__(self, func: Func) -> Func:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                async with self as run:
                    if run is None:
                        return None
                    return await func(*args, **kwargs)

            return async_inner  # type: ignore[return-value]

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self as run:
                if run is None:
                    return None
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def _guarded(self) -> GuardedRun:
        from advisory_lock.single_instance import GuardedRun

        return GuardedRun(
            f"job:{self.job_name}",
            using=self.using,
            label=self.job_name,
            heartbeat=self.heartbeat,
            period=self.period,
            retry_failed=self.retry_failed,
        )

    # The runs this object is in, innermost last: per asyncio task in async code, else per
    # thread (one object may be used by several at once).

    def _push(self, guarded: GuardedRun | None) -> None:
        self._stacks.setdefault(_owner(), []).append(guarded)

    def _pop(self) -> GuardedRun | None:
        owner = _owner()
        stack = self._stacks[owner]
        guarded = stack.pop()
        if not stack:
            del self._stacks[owner]
        return guarded


def _owner() -> object:
    """The asyncio task running this code, else the thread."""
    with contextlib.suppress(RuntimeError):  # no running event loop: sync code
        return asyncio.current_task()
    return threading.get_ident()


def claim(
    using: str, job_name: str, period: Period, *, retry_failed: bool = True, lock_key: Any = ""
) -> tuple[JobRun | None, JobRun | None]:
    """``JobRun.objects.claim_slot()``: claim under ``lock_key`` (held by the caller), or
    under ``job:<job_name>`` taken here on a connection of its own and kept by the returned
    run until ``finish()``. (None, None) when that lock is busy: the job is running."""
    check_job_name(job_name)
    check_period(period)
    check_flag("retry_failed", retry_failed)
    if lock_key:
        return claim_slot(using, job_name, period, retry_failed, held=make_key(lock_key))
    lock = DedicatedLock(f"job:{job_name}", using=using, label=job_name)
    if not lock.acquire(0):
        lock.close()
        record_job_run("skipped", job_name, using)
        return None, None
    try:
        run, taken = claim_slot(
            using, job_name, period, retry_failed, held=lock.key, still_held=lock.verify
        )
    except BaseException:
        lock.close()
        raise
    if run is None:
        lock.close()
    else:
        run.lock = run.claimed_lock = lock
    return run, taken


def claim_slot(
    using: str,
    job_name: str,
    period: Period,
    retry_failed: bool,
    *,
    held: LockKey,
    still_held: Callable[[], bool] | None = None,
) -> tuple[JobRun | None, JobRun | None]:
    """Claim ``job_name``'s current slot, guarded by the lock ``held`` (which the caller
    holds): (the new running run, None), or (None, the slot's latest run when taken).

    ``still_held`` asks the database whether the caller still holds it: holding it proves a
    running row under the same lock orphaned, so that proof is checked when it is used.
    """
    run, taken = write(
        using, lambda: _claim(using, job_name, period, retry_failed, held, still_held)
    )
    if run is None:
        record_job_run("skipped", job_name, using)
    return run, taken


def record_job_run(status: str, job_name: str, using: str, run: JobRun | None = None) -> None:
    """Count a run (and its duration, when it has one) in the metrics, if they are on."""
    if metrics.recorder is not None:
        duration = run.duration.total_seconds() if run and run.duration else None
        metrics.recorder.job_run(status, job_name, connections[using].vendor, using, duration)


def _savepoint_if_in_transaction(using: str) -> contextlib.AbstractContextManager[object]:
    if connections[using].in_atomic_block:
        return transaction.atomic(using=using)
    return contextlib.nullcontext()


def _claim(
    using: str,
    job_name: str,
    period: Period,
    retry_failed: bool,
    held: LockKey,
    still_held: Callable[[], bool] | None = None,
) -> tuple[JobRun | None, JobRun | None]:
    now = inspector_for(connections[using]).database_now()
    this_slot = slot(period, now)
    rows = JobRun.objects.using(using)
    attempts = rows.filter(job_name=job_name, period=this_slot).order_by("-attempt")
    attempt = 1
    for _ in range(5):  # a racing claimer may take the attempt we chose: look again
        try:
            # One INSERT; the unique (job, slot, attempt) constraint refuses a taken attempt.
            # Inside the caller's transaction (LEDGER_IN_CALLERS_TRANSACTION) the refusal
            # must not doom that transaction (PostgreSQL aborts it on any error), so the
            # INSERT gets a savepoint there; in autocommit it needs none.
            with _savepoint_if_in_transaction(using):
                run = rows.create(
                    job_name=job_name,
                    period=this_slot,
                    attempt=attempt,
                    status=Status.RUNNING,
                    started_at=now,
                    host=socket.gethostname()[:255],
                    pid=os.getpid(),
                    lock_key=held.identity,
                )
        except IntegrityError:
            pass
        else:
            return run, None
        latest = attempts.first()
        if latest is None:
            continue  # pruned meanwhile
        if latest.status == Status.RUNNING:
            if not _abandon_if_orphaned(using, latest, held, still_held):
                return None, latest
            latest.status = Status.ABANDONED
        if latest.status == Status.SUCCEEDED or not retry_failed:
            return None, latest
        attempt = latest.attempt + 1
    return None, attempts.first()


def finish(using: str, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
    """Record the end of ``run``: succeeded, or failed with the (end of the) traceback.

    Fenced: only while its row is still ``running``. A run whose row was taken over (marked
    abandoned because its lock was found free) raises ``LockLost`` and writes nothing.
    ``timeout``: give up (TimeoutError) if the database has not answered by then. The lock a
    bare ``claim()`` took for the run is released.
    """
    status = Status.FAILED if error else Status.SUCCEEDED

    def record() -> int:
        now = inspector_for(connections[using]).database_now()
        return (
            JobRun.objects.using(using)
            .filter(pk=run.pk, status=Status.RUNNING)
            .update(
                status=status,
                finished_at=now,
                duration=now - run.started_at,
                error=error[-MAX_ERROR_LENGTH:],
            )
        )

    try:
        recorded = write(using, record, timeout=timeout)
    finally:
        if run.claimed_lock is not None:
            run.claimed_lock.close()  # closing the connection releases the lock
            run.claimed_lock = None
    if not recorded:
        run.refresh_from_db(using=using)
        raise LockLost(
            f"{run.job_name}: run {run.pk} (slot {run.period}, attempt {run.attempt}) was "
            f"marked {run.status} while it ran: its lock was found free, so another instance "
            f"may have run the job at the same time, and its work may have overlapped this "
            f"run's. Nothing was recorded for this run."
        )
    run.refresh_from_db(using=using)
    record_job_run(run.status, run.job_name, using, run)


def assert_current(run: JobRun, using: str | None = None) -> None:
    """Raise ``LockLost`` unless ``run`` is still its slot's running attempt and its lock is
    still held. Inside ``atomic`` on the ledger's database the row stays locked until the
    commit (SELECT ... FOR UPDATE), so the check holds for the writes made in the transaction:
    nobody can take the run over before they are committed."""
    using = using or router.db_for_write(JobRun, instance=run)
    rows = JobRun.objects.using(using).filter(pk=run.pk, status=Status.RUNNING)
    if connections[using].in_atomic_block:
        rows = rows.select_for_update()
    if not rows.exists():
        raise LockLost(
            f"{run.job_name}: run {run.pk} (slot {run.period}, attempt {run.attempt}) is no "
            f"longer its slot's running attempt: another instance took it over."
        )
    if run.lock is not None and not run.lock.verify():
        raise LockLost(run.lock.lost_message())


def mark_abandoned(
    using: str, *, job_name: str | None = None, period: str | None = None, force: bool = False
) -> int:
    """Mark running rows whose lock is free as abandoned; return how many. With ``force``
    (``job_name`` and ``period`` required), mark that slot's running row abandoned whatever
    its lock says: for when the operator knows better."""
    if force and not (job_name and period):
        raise ValueError("force=True needs the job name and the period of the slot.")

    def mark() -> int:
        running = JobRun.objects.using(using).filter(status=Status.RUNNING)
        if job_name:
            running = running.filter(job_name=job_name)
        if period:
            running = running.filter(period=period)
        if force:
            abandoned = list(running.values_list("job_name", flat=True))
            marked = running.update(status=Status.ABANDONED)
            if metrics.recorder is not None:
                for job in abandoned[:marked]:
                    metrics.recorder.job_run("abandoned", job, connections[using].vendor, using)
            return marked
        return sum(_abandon_if_orphaned(using, run, None) for run in running)

    return write(using, mark)


def _abandon_if_orphaned(
    using: str,
    run: JobRun,
    held: LockKey | None,
    still_held: Callable[[], bool] | None = None,
) -> bool:
    """Mark a running ``run`` abandoned if its lock proves its owner gone; True if marked."""
    marked = is_orphaned(using, run, held, still_held) and bool(
        JobRun.objects.using(using)
        .filter(pk=run.pk, status=Status.RUNNING)
        .update(status=Status.ABANDONED)
    )
    if marked and metrics.recorder is not None:
        vendor = connections[using].vendor
        metrics.recorder.job_run("abandoned", run.job_name, vendor, using)
    return marked


def is_orphaned(
    using: str,
    run: JobRun,
    held: LockKey | None,
    still_held: Callable[[], bool] | None = None,
) -> bool:
    """Has ``run`` lost its owner? True when the lock that guards it is free (or held by the
    caller: ``held``, proven by ``still_held`` when given)."""
    from advisory_lock.locks import advisory_lock

    if not run.lock_key:
        return False  # a row from before locks were recorded: only --force can end it
    if held is not None and run.lock_key == held.identity:
        # We hold the lock that guards it, so its owner can't be running under it: as long
        # as we still do (a lock lost since it was taken proves nothing).
        if still_held is not None and not still_held():
            raise LockLost(
                f"{run.job_name}: the lock {held.label} was lost before slot {run.period} "
                f"could be claimed."
            )
        return True
    key = LockKey.from_identity(run.lock_key)
    with advisory_lock(key, using=direct_alias(using), wait=False, scope="session") as lock:
        return lock.acquired


def describe_taken(taken: JobRun | None) -> str:
    """Say why a slot can't be claimed: which slot, and who has it."""
    if taken is None:
        return "another instance is running it"
    when = f" at {taken.finished_at:%Y-%m-%d %H:%M:%S%z}" if taken.finished_at else ""
    if taken.status == Status.SUCCEEDED:
        return f"slot {taken.period} is already done (succeeded{when} on {taken.host})"
    return f"slot {taken.period} is {taken.status} (attempt {taken.attempt} on {taken.host})"


def format_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def write(using: str, func: Callable[[], T], timeout: float | None = None) -> T:
    """Run the ledger's ``func`` on a connection of its own (see ``on_own_connection``), or,
    with ``ADVISORY_LOCK["LEDGER_IN_CALLERS_TRANSACTION"]`` (for tests: see
    ``advisory_lock.testing``), in a savepoint of the caller's transaction, so that a test's
    rollback takes the ledger's rows with it."""
    if get_setting("LEDGER_IN_CALLERS_TRANSACTION"):
        with transaction.atomic(using=using):
            return func()
    return on_own_connection(func, timeout=timeout)


def on_own_connection(func: Callable[[], T], timeout: float | None = None) -> T:
    """Run ``func`` in a short-lived thread: Django gives a thread connections of its own,
    in autocommit, so what it writes commits at once whatever transaction the caller is in."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = func()
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            connections.close_all()

    # Bounded: a daemon thread, left behind if the database does not answer in time.
    thread = threading.Thread(
        target=target, name="advisory_lock-ledger", daemon=timeout is not None
    )
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the database did not answer within {timeout:g}s")
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


def fail_orphaned(using: str, job_name: str, period: str, error: str) -> int:
    """Mark the slot's running rows whose lock is free failed, with ``error``: their run's
    process died before it could say (the scheduler knows how it ended)."""

    def mark() -> int:
        marked = 0
        running = JobRun.objects.using(using).filter(
            job_name=job_name, period=period, status=Status.RUNNING
        )
        for run in running:
            if is_orphaned(using, run, None):
                now = inspector_for(connections[using]).database_now()
                marked += (
                    JobRun.objects.using(using)
                    .filter(pk=run.pk, status=Status.RUNNING)
                    .update(
                        status=Status.FAILED,
                        finished_at=now,
                        duration=now - run.started_at,
                        error=error[-MAX_ERROR_LENGTH:],
                    )
                )
                if metrics.recorder is not None:
                    vendor = connections[using].vendor
                    metrics.recorder.job_run("failed", job_name, vendor, using)
        return marked

    return write(using, mark)
