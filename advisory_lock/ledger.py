"""``run_once``: run a job at most once per period, recorded in the ``job_runs`` ledger."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS

from advisory_lock.locks import DedicatedLock
from advisory_lock.models import JobRun
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period

logger = logging.getLogger("advisory_lock")
F = TypeVar("F", bound=Callable[..., Any])


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
        if using is not None and not isinstance(using, str):
            raise TypeError(f"using must be a database alias (str) or None, not {using!r}.")
        if not isinstance(retry_failed, bool):
            raise TypeError(f"retry_failed must be True or False, not {retry_failed!r}.")
        self.using = using or DEFAULT_DB_ALIAS
        self.retry_failed = retry_failed
        self._runs: list[tuple[DedicatedLock, JobRun | None]] = []

    def __enter__(self) -> JobRun | None:
        lock = DedicatedLock(f"job:{self.job_name}", using=self.using, label=self.job_name)
        if not lock.acquire(0):
            logger.info("%s: another instance is running it; skipped.", self.job_name)
            lock.close()
            self._runs.append((lock, None))
            return None
        try:
            run, taken = claim_with_lock(
                self.job_name, self.period, lock, using=self.using, retry_failed=self.retry_failed
            )
        except BaseException:
            lock.release()
            raise
        if run is None:
            logger.info("%s: %s; skipped.", self.job_name, describe_taken(taken))
            lock.release()
        self._runs.append((lock, run))
        return run

    def __exit__(self, exc_type: Any, exc_value: Any, tb: Any) -> None:
        lock, run = self._runs.pop()
        if run is None:
            return
        try:
            error = (
                "".join(traceback.format_exception(exc_type, exc_value, tb)) if exc_type else ""
            )
            JobRun.objects.using(self.using).finish(run, error=error)
        finally:
            lock.release()

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self._copy() as run:
                if run is None:
                    return None
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def _copy(self) -> run_once:
        return run_once(
            self.job_name, period=self.period, using=self.using, retry_failed=self.retry_failed
        )


def claim_with_lock(
    job_name: str, period: Period, lock: DedicatedLock, *, using: str, retry_failed: bool
) -> tuple[JobRun | None, JobRun | None]:
    """Claim the slot while holding ``lock``: a running row under the same lock is orphaned."""
    key = lock.key.value if isinstance(lock.key.value, str) else ""
    return JobRun.objects.using(using).claim_slot(
        job_name, period, retry_failed=retry_failed, lock_key=key, lock_held=True
    )


def describe_taken(taken: JobRun | None) -> str:
    """Say why a slot can't be claimed: which slot, and who has it."""
    if taken is None:
        return "its slot was taken"
    when = f" at {taken.finished_at:%Y-%m-%d %H:%M:%S%z}" if taken.finished_at else ""
    if taken.status == JobRun.Status.SUCCEEDED:
        return f"slot {taken.period} is already done (succeeded{when} on {taken.host})"
    return f"slot {taken.period} is {taken.status} (attempt {taken.attempt} on {taken.host})"
