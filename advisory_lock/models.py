"""The ``job_runs`` table: one row per attempt at a job's slot (its logic lives in ``ledger``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models

from advisory_lock.keys import Key
from advisory_lock.periods import Period

if TYPE_CHECKING:
    from advisory_lock.dedicated import DedicatedLock


class JobRunQuerySet(models.QuerySet["JobRun"]):
    """The ledger's operations on the rows of one database (``JobRun.objects.using(alias)``);
    they live in ``advisory_lock.ledger``."""

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
        from advisory_lock import ledger

        return ledger.claim(
            self.db, job_name, period, retry_failed=retry_failed, lock_key=lock_key
        )

    def finish(self, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
        """Record the end of ``run`` (``LockLost`` if another instance took it over)."""
        from advisory_lock import ledger

        ledger.finish(self.db, run, error=error, timeout=timeout)

    def mark_abandoned(
        self, *, job_name: str | None = None, period: str | None = None, force: bool = False
    ) -> int:
        """Mark running rows whose lock is free as abandoned; return how many."""
        from advisory_lock import ledger

        return ledger.mark_abandoned(self.db, job_name=job_name, period=period, force=force)


class JobRun(models.Model):
    """One attempt at a job's slot (period): unique per (job_name, period, attempt)."""

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
    lock_key = models.TextField(
        blank=True,
        help_text="The lock guarding the run (its key's identity); free means abandoned.",
    )

    objects = JobRunQuerySet.as_manager()

    class Meta:
        db_table = "job_runs"
        verbose_name = "job run"
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job_name", "period", "attempt"], name="job_runs_job_period_attempt_uniq"
            )
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
        from advisory_lock import ledger

        ledger.assert_current(self, using)
