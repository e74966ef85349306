"""The ``job_runs`` ledger: at most one successful run per job and slot, and who ran what.

A run claims its slot by inserting a row (one per job and period); a slot is taken by a
running or succeeded run, and a failed or abandoned one is claimed again as the next
attempt. A run holds a lock during its work; a ``running`` row whose lock is free has lost
its owner and is marked ``abandoned``. Every write is made on a connection of its own, in
autocommit, so that it commits at once whatever transaction the caller is in.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from django.db import IntegrityError
from django.db import connections
from django.db.models import F

from advisory_lock.backends import inspector_for
from advisory_lock.dedicated import DedicatedLock
from advisory_lock.models import JobRun
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period
from advisory_lock.periods import slot
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag

logger = logging.getLogger("advisory_lock")
T = TypeVar("T")
F_ = TypeVar("F_", bound=Callable[..., Any])
MAX_ERROR_LENGTH = 10_000


class run_once:
    """Claim the job's slot, run the body, record ``succeeded`` or ``failed``.

    As a context manager it gives the running ``JobRun``, or ``None`` when the slot is
    already taken or another instance is running the job (the body then returns early). As a
    decorator a skipped call returns ``None`` without running. A lock ``job:<job_name>`` is
    held on a connection of its own during the run, which proves a dead owner's row
    abandoned.
    """

    def __init__(
        self,
        job_name: str,
        *,
        period: Period = "daily",
        using: str | None = None,
        retry_failed: bool = True,
    ) -> None:
        self.job_name = check_job_name(job_name)
        self.period = check_period(period)
        self.using = check_alias(using)
        self.retry_failed = check_flag("retry_failed", retry_failed)
        self._runs = threading.local()  # each thread's (lock, run) stack: nested or shared use

    def __enter__(self) -> JobRun | None:
        stack = self._stack()
        lock = DedicatedLock(f"job:{self.job_name}", using=self.using, label=self.job_name)
        if not lock.acquire(0):
            logger.info("%s: another instance is running it; skipped.", self.job_name)
            lock.close()
            stack.append((lock, None))
            return None
        try:
            run, taken = claim_slot(
                self.using,
                self.job_name,
                self.period,
                self.retry_failed,
                "job:" + self.job_name,
                True,
            )
        except BaseException:
            lock.release()
            raise
        if run is None:
            logger.info("%s: %s; skipped.", self.job_name, describe_taken(taken))
            lock.release()
        stack.append((lock, run))
        return run

    def __exit__(self, exc_type: Any, exc_value: Any, tb: Any) -> None:
        lock, run = self._stack().pop()
        if run is None:
            return
        try:
            error = (
                "".join(traceback.format_exception(exc_type, exc_value, tb)) if exc_type else ""
            )
            finish(self.using, run, error=error)
        finally:
            lock.release()

    def __call__(self, func: F_) -> F_:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self as run:
                if run is None:
                    return None
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def _stack(self) -> list[tuple[DedicatedLock, JobRun | None]]:
        try:
            stack: list[tuple[DedicatedLock, JobRun | None]] = self._runs.stack
        except AttributeError:
            stack = self._runs.stack = []
        return stack


def claim_under_lock(
    job_name: str, period: Period, lock: DedicatedLock
) -> tuple[JobRun | None, JobRun | None]:
    """Claim the slot while holding ``lock`` (a command's): a running row under the same lock
    is orphaned, since we hold its lock."""
    key = lock.key.value if isinstance(lock.key.value, str) else ""
    return claim_slot(lock.using, job_name, period, True, key, True)


def describe_taken(taken: JobRun | None) -> str:
    """Say why a slot can't be claimed: which slot, and who has it."""
    if taken is None:
        return "its slot was taken"
    when = f" at {taken.finished_at:%Y-%m-%d %H:%M:%S%z}" if taken.finished_at else ""
    if taken.status == JobRun.Status.SUCCEEDED:
        return f"slot {taken.period} is already done (succeeded{when} on {taken.host})"
    return f"slot {taken.period} is {taken.status} (attempt {taken.attempt} on {taken.host})"


def record_end(run: JobRun, lock: DedicatedLock, error: str, heartbeat: float) -> None:
    """Record the end of a command's run. After a failure or a lost lock the database may be
    down or out of reach: then it is best effort (bounded after a lost lock) and never hides
    the exception that is propagating (a row left running is marked abandoned by the next
    claim, since its lock is free)."""
    if not lock.lost and not error:
        finish(lock.using, run)  # a success that can't be recorded must not pass silently
        return
    try:
        finish(
            lock.using, run, error=error, timeout=max(2 * heartbeat, 1.0) if lock.lost else None
        )
    except Exception as exc:
        logger.error(
            "%s: could not record the end of run %s (%s); the next run will mark it abandoned.",
            lock.label,
            run.pk,
            exc,
        )


def claim_slot(
    using: str,
    job_name: str,
    period: Period,
    retry_failed: bool,
    lock_key: str = "",
    lock_held: bool = False,
) -> tuple[JobRun | None, JobRun | None]:
    """Claim ``job_name``'s current slot: (the new running run, None), or (None, the run that
    has the slot). ``lock_key`` names a lock the caller holds for the whole run (``lock_held``:
    it holds it now): a running row with the same key whose lock is free has lost its owner."""
    check_job_name(job_name)
    check_period(period)
    check_flag("retry_failed", retry_failed)
    return on_own_connection(
        lambda: _claim(using, job_name, period, retry_failed, lock_key, lock_held)
    )


def finish(using: str, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
    """Record the end of ``run``: succeeded, or failed with the (end of the) traceback.

    ``timeout``: give up (TimeoutError) if the database has not answered by then."""
    status = JobRun.Status.FAILED if error else JobRun.Status.SUCCEEDED

    def record() -> None:
        now = inspector_for(connections[using]).database_now()
        JobRun.objects.using(using).filter(pk=run.pk).update(
            status=status,
            finished_at=now,
            duration=now - run.started_at,
            error=error[-MAX_ERROR_LENGTH:],
        )
        run.refresh_from_db(using=using)

    on_own_connection(record, timeout=timeout)


def mark_abandoned(using: str) -> int:
    """Mark running rows whose owner's lock is free as abandoned; return how many."""

    def mark() -> int:
        running = JobRun.objects.using(using).filter(status=JobRun.Status.RUNNING)
        orphaned = running.exclude(lock_key="")
        return sum(_abandon_if_orphaned(using, run, "", False) for run in orphaned)

    return on_own_connection(mark)


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


def _claim(
    using: str, job_name: str, period: Period, retry_failed: bool, lock_key: str, lock_held: bool
) -> tuple[JobRun | None, JobRun | None]:
    now = inspector_for(connections[using]).database_now()
    rows = JobRun.objects.using(using)
    this_slot = slot(period, now)
    owner = {
        "started_at": now,
        "host": socket.gethostname()[:255],
        "pid": os.getpid(),
        "lock_key": lock_key,
    }
    for _ in range(2):  # twice: the taken row may be pruned between the INSERT and the SELECT
        try:
            # One INSERT; the unique (job_name, period) constraint refuses a taken slot.
            return rows.create(job_name=job_name, period=this_slot, **owner), None
        except IntegrityError:
            taken = rows.filter(job_name=job_name, period=this_slot).first()
        if taken is not None:
            break
    else:
        return None, None
    if taken.status == JobRun.Status.RUNNING:
        _abandon_if_orphaned(using, taken, lock_key, lock_held)
    if retry_failed:
        reclaimed = rows.filter(
            pk=taken.pk, status__in=[JobRun.Status.FAILED, JobRun.Status.ABANDONED]
        ).update(
            status=JobRun.Status.RUNNING,
            attempt=F("attempt") + 1,
            finished_at=None,
            duration=None,
            error="",
            **owner,
        )
        if reclaimed:
            return rows.get(pk=taken.pk), None
    taken.refresh_from_db(using=using)
    return None, taken


def _abandon_if_orphaned(using: str, run: JobRun, lock_key: str, lock_held: bool) -> bool:
    """Mark a running ``run`` abandoned if its owner's lock proves the owner is gone."""
    from advisory_lock.locks import advisory_lock

    if not run.lock_key:
        return False
    if lock_held and run.lock_key == lock_key:
        orphaned = True  # the caller holds the owner's lock: the owner can't be running
    else:
        with advisory_lock(run.lock_key, using=using, wait=False, scope="session") as lock:
            orphaned = lock.acquired
    if not orphaned:
        return False
    return bool(
        JobRun.objects.using(using)
        .filter(pk=run.pk, status=JobRun.Status.RUNNING)
        .update(status=JobRun.Status.ABANDONED)
    )
