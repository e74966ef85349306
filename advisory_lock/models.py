"""The ``job_runs`` table: one row per job and slot (its logic lives in ``ledger``)."""

from __future__ import annotations

from django.db import models

from advisory_lock.periods import Period


class JobRunQuerySet(models.QuerySet["JobRun"]):
    """The ledger's operations on the rows of one database (``JobRun.objects.using(alias)``)."""

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
    ) -> tuple[JobRun | None, JobRun | None]:
        """Like ``claim()``, and also return the row that has the slot when refused."""
        from advisory_lock import ledger

        return ledger.claim_slot(self.db, job_name, period, retry_failed, lock_key)

    def finish(self, run: JobRun, *, error: str = "", timeout: float | None = None) -> None:
        """Record the end of ``run``: succeeded, or failed with the (end of the) traceback."""
        from advisory_lock import ledger

        ledger.finish(self.db, run, error=error, timeout=timeout)

    def mark_abandoned(self) -> int:
        """Mark running rows whose owner's lock is free as abandoned; return how many."""
        from advisory_lock import ledger

        return ledger.mark_abandoned(self.db)


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
