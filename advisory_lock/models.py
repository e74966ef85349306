"""The ``job_runs`` ledger: one row per job and period, the durable record of who ran what."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from django.db import connections
from django.db import models
from django.db.models import F
from django.db.models.constants import OnConflict
from django.db.models.sql import InsertQuery

from advisory_lock.backends import backend_for
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period
from advisory_lock.periods import slot

T = TypeVar("T")
MAX_ERROR_LENGTH = 10_000


class JobRunQuerySet(models.QuerySet):
    def claim(
        self,
        job_name: str,
        period: Period = "daily",
        *,
        retry_failed: bool = True,
        lock_key: str = "",
    ) -> JobRun | None:
        """Claim ``job_name``'s current slot: the new running JobRun, or None if it is taken.

        A slot is taken by a running or succeeded run. A failed or abandoned one is claimed
        again (``attempt`` + 1) unless ``retry_failed=False``. The claim is written on a
        connection of its own and commits at once, whatever transaction the caller is in.
        ``lock_key`` names a lock that the caller holds for the whole run: a running row with
        the same lock key, whose lock is free (or held by the caller), has lost its owner.
        """
        return self.claim_slot(job_name, period, retry_failed=retry_failed, lock_key=lock_key)[0]

    def claim_slot(
        self,
        job_name: str,
        period: Period = "daily",
        *,
        retry_failed: bool = True,
        lock_key: str = "",
        lock_held: bool = False,
    ) -> tuple[JobRun | None, JobRun | None]:
        """Like ``claim()``, and also return the row that took the slot when refused."""
        check_job_name(job_name)
        check_period(period)
        if not isinstance(retry_failed, bool):
            raise TypeError(f"retry_failed must be True or False, not {retry_failed!r}.")
        alias = self.db
        return on_own_connection(
            lambda: _claim(alias, job_name, period, retry_failed, lock_key, lock_held)
        )

    def finish(self, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
        """Record the end of ``run``: succeeded, or failed with the (end of the) traceback.

        ``timeout``: give up (TimeoutError) if the database has not answered by then."""
        alias = self.db
        status = JobRun.Status.FAILED if error else JobRun.Status.SUCCEEDED

        def record() -> None:
            now = backend_for(alias).database_now()
            JobRun.objects.using(alias).filter(pk=run.pk).update(
                status=status,
                finished_at=now,
                duration=now - run.started_at,
                error=error[-MAX_ERROR_LENGTH:],
            )
            run.refresh_from_db(using=alias)

        on_own_connection(record, timeout=timeout)

    def mark_abandoned(self) -> int:
        """Mark running rows whose owner's lock is free as abandoned; return how many."""
        alias = self.db

        def mark() -> int:
            running = JobRun.objects.using(alias).filter(status=JobRun.Status.RUNNING)
            orphaned = running.exclude(lock_key="")
            return sum(_abandon_if_orphaned(alias, run, "", False) for run in orphaned)

        return on_own_connection(mark)


class JobRun(models.Model):
    """One run of a job in one period (slot); unique per (job_name, period)."""

    class Status(models.TextChoices):
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        ABANDONED = "abandoned", "abandoned"

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
    lock_key = models.CharField(
        max_length=255, blank=True, help_text="The lock held during the run, if any."
    )

    objects = JobRunQuerySet.as_manager()

    class Meta:
        db_table = "job_runs"
        verbose_name = "job run"
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(fields=["job_name", "period"], name="job_runs_job_period_uniq")
        ]
        indexes = [
            models.Index(fields=["-started_at"], name="job_runs_started_idx"),
            models.Index(fields=["status", "-started_at"], name="job_runs_status_started_idx"),
            # Serves the admin's job filter, job + status, and their counts (index-only).
            models.Index(
                fields=["job_name", "status", "-started_at"], name="job_runs_job_status_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_name} [{self.period}] {self.status}"


def on_own_connection(func: Callable[[], T], timeout: float | None = None) -> T:
    """Run ``func`` in a short-lived thread: Django gives it connections of its own, in
    autocommit, so what it writes commits at once whatever transaction the caller is in."""
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
    return outcome["value"]


def _claim(
    alias: str, job_name: str, period: Period, retry_failed: bool, lock_key: str, lock_held: bool
) -> tuple[JobRun | None, JobRun | None]:
    now = backend_for(alias).database_now()
    run = JobRun(
        job_name=job_name,
        period=slot(period, now),
        status=JobRun.Status.RUNNING,
        started_at=now,
        host=socket.gethostname()[:255],
        pid=os.getpid(),
        lock_key=lock_key,
    )
    rows = JobRun.objects.using(alias)
    same_slot = rows.filter(job_name=job_name, period=run.period)
    for _ in range(2):  # twice: the taken row may be pruned between the INSERT and the SELECT
        if _insert_unless_taken(run, alias):
            return same_slot.get(), None
        taken = same_slot.first()
        if taken is not None:
            break
    else:
        return None, None
    if taken.status == JobRun.Status.RUNNING:
        _abandon_if_orphaned(alias, taken, lock_key, lock_held)
    if retry_failed:
        reclaimed = rows.filter(
            pk=taken.pk, status__in=[JobRun.Status.FAILED, JobRun.Status.ABANDONED]
        ).update(
            status=JobRun.Status.RUNNING,
            attempt=F("attempt") + 1,
            started_at=now,
            finished_at=None,
            duration=None,
            host=run.host,
            pid=run.pid,
            error="",
            lock_key=lock_key,
        )
        if reclaimed:
            return rows.get(pk=taken.pk), None
    taken.refresh_from_db(using=alias)
    return None, taken


def _insert_unless_taken(run: JobRun, alias: str) -> bool:
    """INSERT the row, or nothing if (job_name, period) exists: one statement, no
    IntegrityError (ON CONFLICT DO NOTHING, INSERT IGNORE, INSERT OR IGNORE)."""
    query = InsertQuery(JobRun, on_conflict=OnConflict.IGNORE)
    query.insert_values([f for f in JobRun._meta.concrete_fields if not f.primary_key], [run])
    with connections[alias].cursor() as cursor:
        for sql, params in query.get_compiler(using=alias).as_sql():
            cursor.execute(sql, params)
        return cursor.rowcount == 1


def _abandon_if_orphaned(alias: str, run: JobRun, lock_key: str, lock_held: bool) -> bool:
    """Mark a running ``run`` abandoned if its owner's lock proves the owner is gone."""
    from advisory_lock.locks import advisory_lock

    if not run.lock_key:
        return False
    if lock_held and run.lock_key == lock_key:
        orphaned = True  # the caller holds the owner's lock: the owner can't be running
    else:
        with advisory_lock(run.lock_key, using=alias, wait=False, scope="session") as lock:
            orphaned = lock.acquired
    if not orphaned:
        return False
    return bool(
        JobRun.objects.using(alias)
        .filter(pk=run.pk, status=JobRun.Status.RUNNING)
        .update(status=JobRun.Status.ABANDONED)
    )
