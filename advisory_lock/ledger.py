"""The ``job_runs`` ledger: at most one successful run per job and slot, and who ran what.

``JobRun`` is the table, one row per attempt at a job's slot (``advisory_lock.models`` gives
it to Django); the functions here are its operations, which its queryset and its
``assert_current()`` call on their database.

Each claim of a slot inserts a row: attempt 1, or the next attempt of a slot whose latest
attempt failed or was abandoned. The unique (job, slot, attempt) constraint lets only one of
two racing claimers in; a slot that has a success, or whose latest attempt is running, is
taken. The row's id is its fencing token: it grows with every claim. A second success in a
slot is refused by the database itself, whoever writes it (a unique index, see ``JobRun``).

Every run is guarded by a lock held for its whole duration, named in its row. A ``running``
row whose lock is free has lost its owner: the next claim, or ``mark_abandoned()``, marks it
``abandoned``. A run records its end only while its row is still ``running`` (a fenced
update): a run whose row was taken over meanwhile raises ``LockLost`` and writes nothing.

Every write runs on a connection of its own (``own_connection``), in autocommit, so that it
commits at once whatever transaction the caller is in; locks are taken through the alias's
DIRECT_ALIAS.
Except an atomic run's (``atomic=True``): ``lock_running_row()`` and
``succeed_in_transaction()`` write in the caller's transaction, the one of the job's own
writes, so that its success commits with them or not at all.
``run_once`` (``advisory_lock.once``) and single-instance runs (``GuardedRun``) use them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import traceback
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Container
from typing import Any
from typing import NamedTuple

from django.db import IntegrityError
from django.db import connections
from django.db import models
from django.db import router
from django.db import transaction
from django.db.models import Case
from django.db.models import Value
from django.db.models import When
from django.db.models.functions import Concat

from advisory_lock import metrics
from advisory_lock.backends import inspector_for
from advisory_lock.conf import get_setting
from advisory_lock.conf import require_app
from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field
from advisory_lock.dedicated import DedicatedLock
from advisory_lock.dedicated import direct_alias
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import SlotAlreadySucceeded
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.own_connection import table_checked
from advisory_lock.own_connection import write
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.periods import MAX_PERIOD_LENGTH
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period
from advisory_lock.periods import slot
from advisory_lock.row_reads import rows_in
from advisory_lock.row_writes import insert_row
from advisory_lock.row_writes import update_row_while
from advisory_lock.server_clock import ledger_now
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_text

MAX_ERROR_LENGTH = 10_000


class JobRunQuerySet(models.QuerySet["JobRun"]):
    """The ledger's operations on the rows of one database (``JobRun.objects.using(alias)``):
    the functions below, on this queryset's database."""

    def claim(
        self,
        job_name: str,
        period: Period = "daily",
        *,
        retry_failed: bool = True,
        lock_key: Key | str = "",
    ) -> JobRun | None:
        """Claim ``job_name``'s current slot: the new running JobRun, or None if the slot is
        taken (by a running or succeeded attempt) or the job is running.

        A failed or abandoned slot is claimed again as the next attempt, unless
        ``retry_failed=False``. The claim is written on a connection of its own and commits
        at once, whatever transaction the caller is in. ``lock_key`` names a lock that the
        caller holds for the whole run; without it, the claim takes ``job:<job_name>`` on a
        connection of its own, held by the returned run until ``finish(run)``. Either way
        the run's row names its lock, so that a dead owner's row can be proven abandoned.
        """
        return self.claim_slot(job_name, period, retry_failed=retry_failed, lock_key=lock_key)[0]

    def claim_slot(
        self,
        job_name: str,
        period: Period = "daily",
        *,
        retry_failed: bool = True,
        lock_key: Key | str = "",
    ) -> tuple[JobRun | None, JobRun | None]:
        """Like ``claim()``, and also return the slot's latest run when refused."""
        return claim(self.db, job_name, period, retry_failed=retry_failed, lock_key=lock_key)

    def finish(self, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
        """Record the end of ``run`` (``LockLost`` if another instance took it over;
        ``SlotAlreadySucceeded``, a ``LockLost``, if its slot got a success from elsewhere)."""
        finish(self.db, run, error=error, timeout=timeout)

    def mark_abandoned(
        self, *, job_name: str | None = None, period: str | None = None, force: bool = False
    ) -> int:
        """Mark running rows whose lock is free as abandoned; return how many."""
        return mark_abandoned(self.db, job_name=job_name, period=period, force=force)


# Django defines a model of an installed app only: without the app, say what to do.
require_app()


class JobRun(models.Model):
    """One attempt at a job's slot (period): unique per (job_name, period, attempt)."""

    class Status(models.TextChoices):
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        ABANDONED = "abandoned", "abandoned"
        #: A scheduled task entry's slot: its task was handed to the queue (``task_id``);
        #: the scheduler records its end when the queue tells.
        ENQUEUED = "enqueued", "enqueued"

    job_name = models.CharField(max_length=200)
    period = models.CharField(max_length=64, help_text="The run's slot, e.g. 2026-11-29.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    started_at = models.DateTimeField(help_text="By the database server's clock.")
    finished_at = models.DateTimeField(null=True, blank=True)
    duration = models.DurationField(null=True, blank=True)
    host = models.CharField(max_length=255, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    attempt = models.PositiveIntegerField(default=1)
    error = models.TextField(blank=True, help_text="The end of a failed run's traceback.")
    lock_key = models.TextField(
        blank=True,
        help_text="The lock guarding the run (its key's identity); free means abandoned.",
    )
    task_id = models.CharField(
        max_length=255, blank=True, help_text="An enqueued slot's task, as its queue names it."
    )
    # At most one success per slot, checked by the database whoever writes the row (the ORM,
    # QuerySet.update(), raw SQL): this column is 1 on a succeeded row and NULL on any other,
    # in a unique index with the job and the slot (Meta.constraints). NULLs never collide in
    # a unique index on any of the three databases (PostgreSQL: "two null values are not
    # considered equal" unless NULLS NOT DISTINCT; MySQL: "a UNIQUE index permits multiple
    # NULL values", and MariaDB alike; SQLite: "all NULL values are considered different from
    # all other NULL values"), so failed, abandoned and running attempts stay unlimited. A
    # UniqueConstraint(condition=...) would say the same, but MariaDB/MySQL have no partial
    # indexes and Django skips it there. Stored (db_persist): PostgreSQL before 18 has stored
    # generated columns only, MariaDB first indexed only PERSISTENT (stored) ones, and a
    # stored column is indexed like any other everywhere.
    succeeded = models.GeneratedField(
        expression=Case(When(status=Status.SUCCEEDED, then=Value(1))),
        output_field=models.SmallIntegerField(),
        db_persist=True,
        help_text="1 on a succeeded run, else NULL: a unique index allows one per slot.",
    )

    objects = JobRunQuerySet.as_manager()

    class Meta:
        db_table = "job_runs"
        verbose_name = "job run"
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job_name", "period", "attempt"], name="job_runs_job_period_attempt_uniq"
            ),
            models.UniqueConstraint(
                fields=["job_name", "period", "succeeded"], name="job_runs_one_success_per_slot"
            ),
        ]
        indexes = [
            models.Index(fields=["-started_at"], name="job_runs_started_idx"),
            models.Index(fields=["status", "-started_at"], name="job_runs_status_started_idx"),
            # Serves the admin's job filter, job + status, and their counts (index-only).
            models.Index(
                fields=["job_name", "status", "-started_at"], name="job_runs_job_status_idx"
            ),
        ]

    #: The lock guarding the run, when it was claimed in this process.
    lock: DedicatedLock | None = None
    #: The lock a bare ``claim()`` took for the run, released by ``finish()``.
    claimed_lock: DedicatedLock | None = None

    def __str__(self) -> str:
        return f"{self.job_name} [{self.period}] {self.status}"

    @property
    def fence(self) -> int:
        """The run's fencing token: it grows with every claim of a job, retries included.

        A system the job writes to can store the highest fence it has seen and refuse a
        write with a lower one: a run that lost its lock and was taken over can't
        overwrite its successor's work.
        """
        return int(self.pk)

    def assert_current(self, using: str | None = None) -> None:
        """Raise ``LockLost`` unless this run is still its slot's running attempt and its
        lock is still held; inside ``atomic`` the row stays locked until the commit."""
        assert_current(self, using)


Status = JobRun.Status


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
    # A refused or failed claim lets go of the lock before it returns: released by a
    # statement, it is free the moment let_go() returns, whereas a closed connection's locks
    # are dropped only once the server has noticed the close, which may be after the next
    # claimer has asked.
    try:
        run, taken = claim_slot(
            using, job_name, period, retry_failed, held=lock.key, still_held=lock.verify
        )
    except BaseException:
        lock.let_go()
        raise
    if run is None:
        lock.let_go()
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
    max_attempts: int | None = None,
) -> tuple[JobRun | None, JobRun | None]:
    """Claim ``job_name``'s current slot, guarded by the lock ``held`` (which the caller
    holds): (the new running run, None), or (None, the slot's latest run when taken).

    ``still_held`` asks the database whether the caller still holds it: holding it proves a
    running row under the same lock orphaned, so that proof is checked when it is used.
    ``max_attempts`` (the scheduler's ``1 + retries``): a slot that has had that many
    attempts, fleet-wide, is taken.
    """
    check_lock_key(held)
    run, taken = write(
        using,
        lambda: _claim(using, job_name, period, retry_failed, held, still_held, max_attempts),
    )
    if run is None:
        record_job_run("skipped", job_name, using)
    return run, taken


def check_lock_key(key: LockKey) -> None:
    """The row names its lock: a key whose name the ledger can't store (NUL) is refused."""
    try:
        check_text("lock_key", key.identity)
    except ValueError:
        raise ValueError(
            f"lock_key {key.label} contains NUL (\\x00): a lock can have that name, but the "
            f"ledger, which names each run's lock, can't store it on every database. Use a "
            f"key without NUL for a job of the ledger."
        ) from None


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
    max_attempts: int | None = None,
) -> tuple[JobRun | None, JobRun | None]:
    # A slot's attempts are numbered 1, 2, 3...: a claim inserts attempt 1, or the one after
    # the slot's latest, and the unique (job, slot, attempt) constraint lets one claimer alone
    # insert each number. So the latest attempt's number counts the slot's attempts,
    # fleet-wide, and no claim inserts a number above ``max_attempts``, however many race.
    # (Pruning keeps attempt 1 and the latest attempt of every slot that can be claimed.)
    now = ledger_now(using)
    this_slot = slot(period, now)
    rows = JobRun.objects.using(using)
    attempt = 1
    for _ in range(5):  # a racing claimer may take the attempt we chose: look again
        try:
            # One INSERT; the unique (job, slot, attempt) constraint refuses a taken attempt.
            # Inside the caller's transaction (LEDGER_IN_CALLERS_TRANSACTION) the refusal
            # must not doom that transaction (PostgreSQL aborts it on any error), so the
            # INSERT gets a savepoint there; in autocommit it needs none.
            with _savepoint_if_in_transaction(using):
                run = insert_row(
                    JobRun,
                    using,
                    job_name=job_name,
                    period=this_slot,
                    attempt=attempt,
                    status=Status.RUNNING,
                    started_at=to_field(now),
                    host=this_host(),
                    pid=os.getpid(),
                    lock_key=held.identity,
                )
        except IntegrityError:
            pass
        else:
            return run, None
        # Built only once an INSERT is refused: most claims insert at the first try.
        attempts = rows.filter(job_name=job_name, period=this_slot)
        latest = deciding_attempt(attempts)
        if latest is None:
            continue  # pruned meanwhile
        if latest.status == Status.RUNNING:
            if not _abandon_if_orphaned(using, latest, held, still_held):
                return None, latest
            latest.status = Status.ABANDONED
        if latest.status in (Status.SUCCEEDED, Status.ENQUEUED) or not retry_failed:
            return None, latest  # done, or handed to a task queue that will say how it ends
        if max_attempts is not None and latest.attempt >= max_attempts:
            return None, latest  # out of attempts
        attempt = latest.attempt + 1
    return None, deciding_attempt(rows.filter(job_name=job_name, period=this_slot))


def _while(using: str, run: JobRun, status: str) -> models.QuerySet[JobRun]:
    """The row of ``run`` while its status is ``status``: the fence of the ledger's writes.

    The row is found by its primary key alone: its status is compared through an expression
    (``CONCAT(status, '')``) that no index can serve. Compared as a column, MariaDB's
    optimizer reads ``id = ... AND status = 'running'`` through job_runs_status_started_idx
    when few rows are running (EXPLAIN: ``range`` on that index), and InnoDB keeps a lock on
    every index entry a locking read or UPDATE has read until its transaction ends: an
    atomic run's transaction, which updates its row first, would then hold the entries of
    the other running rows, blocking their fenced ends and deadlocking them (error 1213).
    Through the primary key an UPDATE locks its own row only.
    """
    return _fenced_rows().using(using).filter(models.Q(fenced_status=status), pk=run.pk)


@functools.cache
def _fenced_rows() -> models.QuerySet[JobRun]:
    """The rows with ``fenced_status`` (``_while``), built once: each fenced write filters a
    copy (``using()`` and ``filter()`` return new QuerySets; this one is never evaluated)."""
    return JobRun.objects.alias(fenced_status=Concat("status", Value("")))


def _end_running(using: str, run: JobRun, written: dict[str, Any]) -> int:
    """Write ``written`` into the row of ``run`` while it is ``running`` (the fence of a
    run's end): 1, or 0 if it was taken over. One UPDATE through the primary key, as
    ``_while(...).update()`` sends (see ``row_writes.update_row_while``)."""
    return update_row_while(JobRun, using, run.pk, "status", Status.RUNNING.value, **written)


def deciding_attempt(attempts: models.QuerySet[JobRun]) -> JobRun | None:
    """The attempt that decides whether one slot's ``attempts`` may be claimed: its success,
    if it has one, else its latest attempt.

    The ledger's own runs only ever succeed as a slot's latest attempt; a success written
    by hand on an earlier one (a failed attempt set to ``succeeded``) settles the slot all
    the same, so that no later run of it tries to record a second success, which the unique
    index would refuse.
    """
    return attempts.order_by(models.F("succeeded").desc(nulls_last=True), "-attempt").first()


class Attempt(NamedTuple):
    """A slot's deciding attempt as ``deciding_attempts`` reads it: only what a scheduler
    decides on, no model instance."""

    status: str
    attempt: int
    succeeded: bool


def deciding_attempts(using: str, slots: dict[str, str]) -> dict[str, Attempt]:
    """``deciding_attempt`` of each job's slot in ``slots`` (job name: period), in one
    statement; a job whose slot has no attempt is left out. Read as tuples of five columns
    (``row_reads``): a scheduler's batch may hold the slots of hundreds of entries, most of
    them done."""
    rows = rows_in(
        JobRun,
        using,
        ("job_name", "period", "status", "attempt", "succeeded"),
        job_name=list(slots),
        period=set(slots.values()),
    )
    deciding: dict[str, Attempt] = {}
    for job_name, period, status, attempt, succeeded in rows:
        if slots.get(job_name) != period:
            continue  # another job's period, asked about for that job
        run = Attempt(status, attempt, succeeded is not None)
        best = deciding.get(job_name)
        if best is None or _decides_over(run, best):
            deciding[job_name] = run
    return deciding


def _decides_over(run: Attempt, other: Attempt) -> bool:
    """Does ``run`` decide its slot rather than ``other``, as ``deciding_attempt`` orders
    them: a success first, then the latest attempt."""
    if run.succeeded != other.succeeded:
        return run.succeeded
    return run.attempt > other.attempt


def finish(
    using: str,
    run: JobRun,
    *,
    error: str = "",
    timeout: float | None = None,
    task_id: str | None = None,
) -> None:
    """Record the end of ``run``: succeeded, or failed with the (end of the) traceback; with
    ``task_id``, ``enqueued`` (a task entry's slot, handed to its queue).

    Fenced: only while its row is still ``running``. A run whose row was taken over (marked
    abandoned because its lock was found free) raises ``LockLost`` and writes nothing. A
    success that the database refuses, because another row of the slot has succeeded
    (written by hand: claims refuse such a slot), is recorded failed with the reason, and
    raises ``SlotAlreadySucceeded``.
    ``timeout``: give up (TimeoutError) if the database has not answered by then. The lock a
    bare ``claim()`` took for the run is released.
    """
    status = Status.FAILED if error else Status.SUCCEEDED if task_id is None else Status.ENQUEUED
    refused: list[str] = []  # why the success could not be recorded, if it could not

    def record() -> int:
        now = ledger_now(using)
        end: dict[str, Any] = {
            "finished_at": to_field(now),
            "duration": now - from_field(run.started_at),
        }
        if status == Status.ENQUEUED:
            end = {"task_id": task_id}  # it ends when its task does
        written = {"status": status.value, "error": storable_error(error), **end}
        try:
            # Inside the caller's transaction (LEDGER_IN_CALLERS_TRANSACTION) a refused
            # UPDATE must not doom it (PostgreSQL aborts it on any error): a savepoint.
            with _savepoint_if_in_transaction(using):
                updated = _end_running(using, run, written)
        except IntegrityError:
            # The UPDATE changes no column of the (job, slot, attempt) constraint: only the
            # one-success-per-slot index can refuse it, for a success, when another row of
            # the slot has succeeded. Record the run failed, saying so.
            success = (
                JobRun.objects.using(using)
                .filter(job_name=run.job_name, period=run.period, status=Status.SUCCEEDED)
                .first()
            )
            if status != Status.SUCCEEDED or success is None:
                raise
            refused.append(_already_succeeded(run, success))
            written = {"status": Status.FAILED.value, "error": refused[0], **end}
            updated = _end_running(using, run, written)
        if updated:
            # The row holds what was written (the fence matched it by primary key): the
            # same values in memory, without reading them back.
            for field, value in written.items():
                setattr(run, field, value)
        else:
            # Taken over: what it was marked with, for the message. Read here, not in the
            # caller's thread: a worker thread of async code would keep the connection
            # that read opened.
            run.refresh_from_db(using=using)
        return updated

    try:
        recorded = write(using, record, timeout=timeout)
    finally:
        if run.claimed_lock is not None:
            # Released, not only closed: free when finish() returns (see claim()).
            run.claimed_lock.let_go()
            run.claimed_lock = None
    if not recorded:
        raise LockLost(
            f"{run.job_name}: run {run.pk} (slot {run.period}, attempt {run.attempt}) was "
            f"marked {run.status} while it ran: its lock was found free, so another instance "
            f"may have run the job at the same time, and its work may have overlapped this "
            f"run's. Nothing was recorded for this run."
        )
    record_job_run(run.status, run.job_name, using, run)
    if refused:
        raise SlotAlreadySucceeded(refused[0])


def lock_running_row(using: str, run: JobRun) -> None:
    """Lock ``run``'s row in the caller's transaction on ``using`` until it ends, or raise
    ``LockLost`` if it is no longer its slot's running attempt: the first statement of an
    atomic run's transaction (``run_once(atomic=True)``).

    An UPDATE of the row to the status it must have is the fence, the row lock and the
    transaction's write lock at once. ``QuerySet.update()`` returns the number of rows
    matched, changed or not: 0 means the run was taken over. On PostgreSQL and MySQL an
    UPDATE locks the rows it matches until the transaction ends (PostgreSQL: against
    UPDATE, DELETE and SELECT ... FOR UPDATE; InnoDB: an exclusive record lock), so a claim
    that would mark the run abandoned waits for this transaction to end, and then finds the
    row no longer running. SQLite has no row locks (Django ignores ``select_for_update()``
    there) but one writer per database file: a transaction that starts with a read and then
    writes gets SQLITE_BUSY at once, without waiting, if another connection wrote meanwhile
    ("database is locked"); one whose first statement is a write takes the write lock then,
    waiting for it up to the connection's busy timeout (the ``timeout`` option, 5 seconds by
    default), and keeps it, and so the whole file, until it ends.
    """
    running = _while(using, run, Status.RUNNING)
    if not running.update(status=Status.RUNNING):
        raise LockLost(_taken_over(run))


def succeed_in_transaction(using: str, run: JobRun, task_id: str | None = None) -> None:
    """Record ``run`` succeeded (with ``task_id``: enqueued) in the caller's transaction on
    ``using``, whose first statement was ``lock_running_row(using, run)``: the mark commits
    with the job's writes (a task queue's on that database: the enqueued task), or not at
    all. Fenced as ``finish()``: ``LockLost`` if the run is no longer its slot's running
    attempt or its lock is lost, ``SlotAlreadySucceeded`` if the database refuses a second
    success in the slot; the caller then rolls the transaction back."""
    now = inspector_for(connections[using]).database_now()
    running = _while(using, run, Status.RUNNING)
    end: dict[str, Any] = {
        "finished_at": to_field(now),
        "duration": now - from_field(run.started_at),
    }
    status = Status.SUCCEEDED
    if task_id is not None:
        status, end = Status.ENQUEUED, {"task_id": task_id}
    try:
        # A savepoint: PostgreSQL answers nothing more in a transaction that a failed
        # statement aborted, and the refusal's message names the slot's success.
        with transaction.atomic(using=using):
            updated = running.update(status=status, error="", **end)
    except IntegrityError:
        success = (
            JobRun.objects.using(using)
            .filter(job_name=run.job_name, period=run.period, status=Status.SUCCEEDED)
            .first()
        )
        if success is None:
            raise
        raise SlotAlreadySucceeded(_already_succeeded(run, success, rolled_back=True)) from None
    if not updated:
        raise LockLost(_taken_over(run))
    if run.lock is not None and not run.lock.verify():
        raise LockLost(run.lock.lost_message())


def _taken_over(run: JobRun) -> str:
    return (
        f"{run.job_name}: run {run.pk} (slot {run.period}, attempt {run.attempt}) is no "
        f"longer its slot's running attempt: another instance took it over."
    )


def _already_succeeded(run: JobRun, success: JobRun, *, rolled_back: bool = False) -> str:
    work = (
        "its writes were rolled back" if rolled_back else "its work may have repeated that run's"
    )
    return (
        f"{run.job_name}: run {run.pk} (slot {run.period}, attempt {run.attempt}) ended "
        f"without error, but its slot already has a succeeded run, {success.pk} (attempt "
        f"{success.attempt}), written outside the ledger's claims (a hand-written UPDATE?). "
        f"The database allows one success per slot: this run was recorded failed, and {work}."
    )


def assert_current(run: JobRun, using: str | None = None) -> None:
    """Raise ``LockLost`` unless ``run`` is still its slot's running attempt and its lock is
    still held. Inside ``atomic`` on the ledger's database the row stays locked until the
    commit (SELECT ... FOR UPDATE), so the check holds for the writes made in the transaction:
    nobody can take the run over before they are committed."""
    using = using or router.db_for_write(JobRun, instance=run)
    rows = _while(using, run, Status.RUNNING)
    if connections[using].in_atomic_block:
        rows = rows.select_for_update()
    if not rows.exists():
        raise LockLost(_taken_over(run))
    if run.lock is not None and not run.lock.verify():
        raise LockLost(run.lock.lost_message())


def mark_abandoned(
    using: str, *, job_name: str | None = None, period: str | None = None, force: bool = False
) -> int:
    """Mark running rows whose lock is free as abandoned; return how many. With ``force``
    (``job_name`` and ``period`` required), mark that slot's running row abandoned whatever
    its lock says: for when the operator knows better."""
    if job_name is not None:
        check_text("job_name", job_name, max_length=MAX_JOB_NAME_LENGTH)
    if period is not None:
        check_text("period", period, max_length=MAX_PERIOD_LENGTH)
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


def abandon_orphans(
    using: str, job_names: Collection[str], alive: Container[tuple[str, str]] = ()
) -> int:
    """The scheduler's sweep: mark abandoned the running rows of ``job_names`` whose lock is
    free; return how many. One SELECT of the running rows (the ``status`` index) whatever the
    number of jobs, then a try of the lock of each row found (none while nothing runs) but
    those in ``alive`` ((job name, period) of runs the caller knows alive: its own job
    processes hold their locks anyway).

    On the caller's connection, not one of its own (``write``): a scheduler is in autocommit,
    so each update commits at once, and an idle sweep opens no connection."""

    def mark() -> int:
        running = JobRun.objects.using(using).filter(status=Status.RUNNING)
        return sum(
            _abandon_if_orphaned(using, run, None)
            for run in list(running)
            if run.job_name in job_names and (run.job_name, run.period) not in alive
        )

    if get_setting("LEDGER_IN_CALLERS_TRANSACTION"):
        return write(using, mark)  # in a savepoint of the caller's transaction
    with table_checked(using):
        return mark()


def _abandon_if_orphaned(
    using: str,
    run: JobRun,
    held: LockKey | None,
    still_held: Callable[[], bool] | None = None,
) -> bool:
    """Mark a running ``run`` abandoned if its lock proves its owner gone; True if marked."""
    marked = is_orphaned(using, run, held, still_held) and bool(
        _while(using, run, Status.RUNNING).update(status=Status.ABANDONED)
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
    when = f" at {from_field(taken.finished_at):%Y-%m-%d %H:%M:%S%z}" if taken.finished_at else ""
    if taken.status == Status.SUCCEEDED:
        return f"slot {taken.period} is already done (succeeded{when} on {taken.host})"
    return f"slot {taken.period} is {taken.status} (attempt {taken.attempt} on {taken.host})"


def storable_error(text: str) -> str:
    """The end of a traceback (its last ``MAX_ERROR_LENGTH`` characters) as every database
    can store it: PostgreSQL's text refuses NUL ("invalid byte sequence"), and no driver can
    encode a lone surrogate (Python's make of bytes that are not UTF-8). Both are written
    escaped, as ``repr()`` would show them, so that a failure whose message holds one is
    still recorded."""
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[-MAX_ERROR_LENGTH:]


def format_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def first_line(error: str) -> str:
    """What failed, in one line: of a traceback (what the ledger keeps of a failed run, its
    end), the first line of the exception, which ``traceback.format_exception`` writes after
    the last frame (the frames' lines are indented, the exception's are not); of any other
    error (a queue's word on a task), its first line. "" for no error."""
    lines = [line for line in error.splitlines() if line.strip()]
    frames = [number for number, line in enumerate(lines) if line[:1].isspace()]
    after = lines[frames[-1] + 1 :] if frames else lines
    return (after or lines or [""])[0].strip()


def end_enqueued(
    using: str,
    run: JobRun,
    *,
    succeeded: bool,
    error: str = "",
    finished_at: datetime.datetime | None = None,
) -> bool:
    """Record the end of an enqueued slot's task (the queue said how it ended): succeeded,
    or failed with ``error``; ``finished_at`` by the queue's clock if it said, else the
    database's. Fenced: only while the row is still ``enqueued`` (another scheduler may have
    recorded it first); True if this call did."""

    def record() -> int:
        end = finished_at or inspector_for(connections[using]).database_now()
        return _while(using, run, Status.ENQUEUED).update(
            status=Status.SUCCEEDED if succeeded else Status.FAILED,
            finished_at=to_field(end),
            duration=max(end - from_field(run.started_at), datetime.timedelta(0)),
            error="" if succeeded else storable_error(error or "The task failed."),
        )

    recorded = bool(write(using, record))
    if recorded:
        record_job_run("succeeded" if succeeded else "failed", run.job_name, using, run)
    return recorded


def this_host() -> str:
    """This host's name, as a run's row records it."""
    return socket.gethostname()[:255]


def claimed_by_process(using: str, job_name: str, period: str, pid: int) -> bool:
    """Is a running row of the slot claimed by the OS process ``pid`` of this host?"""
    return (
        JobRun.objects.using(using)
        .filter(job_name=job_name, period=period, status=Status.RUNNING, host=this_host(), pid=pid)
        .exists()
    )


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
                marked += _while(using, run, Status.RUNNING).update(
                    status=Status.FAILED,
                    finished_at=to_field(now),
                    duration=now - from_field(run.started_at),
                    error=storable_error(error),
                )
                if metrics.recorder is not None:
                    vendor = connections[using].vendor
                    metrics.recorder.job_run("failed", job_name, vendor, using)
        return marked

    return write(using, mark)
