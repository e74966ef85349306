"""Pruning the ``job_runs`` ledger: ``manage.py job_runs --prune --older-than DAYS``.

The finished runs that started more than DAYS ago, by the database server's clock (like every
time of the ledger), are deleted, except the rows that the ledger still reads:

* **A slot that may still be claimed keeps its first and its latest attempt.** A claim's first
  INSERT is attempt 1, refused by the unique (job, slot, attempt) constraint only while
  attempt 1 exists; the next attempt is numbered after the latest, and that number counts
  the slot's attempts (a scheduled entry's ``retries``). Without them a slot that succeeded
  would run again, and a slot out of retries would start over. Those slots are: every
  ``once`` slot (it lives for ever); the current slot of every named period and of every
  scheduled entry, by the database server's clock in the ledger's time zone; and each job's
  newest slot (a job with a callable period: prune can't compute its current slot).
* **Each job's latest success**, whatever its age: the overdue report's "last success".
* **The successes the overdue report reads**: of each declared job, those of the slot that
  the report checks now and of the later slots (``Expectation.checked_since``), so that a
  pruned ledger raises no false alarm.
* **A scheduled entry with** ``catch_up="all"`` keeps the latest attempt of each slot that
  has a run since its oldest kept run: that entry runs the slots after its first run that
  have no row, so a hole would be run again.

Prune also deletes the expired marks of ``enqueue_unique`` (``task_pending``) on that database:
a mark past its ``expires_at`` no longer counts (a call finds it expired and writes its own),
so only a key never enqueued again would keep it. A call that renews a mark meanwhile moves
its ``expires_at`` forward, and the DELETE's condition is checked again on the row it would
delete (PostgreSQL re-reads an updated row under READ COMMITTED; InnoDB's DELETE reads the
latest committed version), so a renewed mark is kept.

A run that is still running when prune looks is never deleted, even if it ends meanwhile.
Prune only sees the jobs declared in code that its process has imported (like the report):
a job declared in ``JOBS`` or by a command is always seen.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db import router
from django.db.models import Max
from django.db.models import Min
from django.db.models import QuerySet

from advisory_lock.backends import inspector_for
from advisory_lock.datetimes import to_field
from advisory_lock.expectations import Expectation
from advisory_lock.ledger import JobRun
from advisory_lock.periods import PERIODS
from advisory_lock.periods import slot
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.overdue import expected_jobs
from advisory_lock.scheduling.overdue import last_success
from advisory_lock.scheduling.overdue import whole_schedule
from advisory_lock.tasks import PendingTask

#: Why an old finished run was kept, in the order they are counted.
CLAIMABLE = "in slots that may still be claimed"
LATEST_SUCCESS = "latest success(es)"
CHECKED = "checked by the overdue report"


@dataclass(frozen=True)
class Pruned:
    """What a prune did: how many old finished runs it deleted, and how many it kept, why."""

    deleted: int
    kept: dict[str, int]
    expired_marks: int = 0

    def describe(self, days: int) -> str:
        said = (
            f"Pruned {self.deleted} finished run(s) older than {days} days (by the database's "
            f"clock)"
        )
        kept = sum(self.kept.values())
        if kept:
            why = ", ".join(f"{count} {reason}" for reason, count in self.kept.items() if count)
            said = f"{said}; kept {kept} older run(s) that the ledger still needs: {why}"
        if self.expired_marks:
            said = f"{said}. Deleted {self.expired_marks} expired enqueue_unique mark(s)"
        return f"{said}."


def prune(using: str, older_than: datetime.timedelta) -> Pruned:
    """Delete the finished runs of ``using``'s ledger that started more than ``older_than``
    ago by the database server's clock, except those the ledger still needs (see above)."""
    rows = JobRun.objects.using(using).order_by()
    now = inspector_for(connections[using]).database_now()
    old = rows.filter(started_at__lt=to_field(now - older_than))
    # Running and enqueued runs have not ended (an enqueued slot ends when its task does).
    unended = [JobRun.Status.RUNNING, JobRun.Status.ENQUEUED]
    running = set(old.filter(status__in=unended).values_list("pk", flat=True))
    jobs = set(old.values_list("job_name", flat=True).distinct())
    schedule = whole_schedule(using)  # settings' and stored: their current slots are claimable
    keep: dict[int, str] = {}
    for reason, kept in (
        (CLAIMABLE, _claimable(rows, old, jobs, now, schedule.values())),
        (LATEST_SUCCESS, _latest_successes(rows, jobs)),
        (CHECKED, _checked_by_the_report(old, jobs, now, expected_jobs(using, schedule))),
    ):
        for pk in kept:
            keep.setdefault(pk, reason)
    for pk in _caught_up(old, jobs, keep, schedule.values()):  # from the rows kept above
        keep.setdefault(pk, CLAIMABLE)
    finished = old.exclude(status__in=unended)
    counts = dict.fromkeys((CLAIMABLE, LATEST_SUCCESS, CHECKED), 0)
    for pk in finished.filter(pk__in=list(keep)).values_list("pk", flat=True):
        counts[keep[pk]] += 1
    # A run that was running above and has ended since is spared too: it was not looked at.
    deleted, _ = finished.exclude(pk__in=[*keep, *running]).delete()
    return Pruned(deleted, counts, _delete_expired_marks(using, now))


def _delete_expired_marks(using: str, now: datetime.datetime) -> int:
    """Delete ``using``'s ``enqueue_unique`` marks that expired before ``now``; how many."""
    if not router.allow_migrate_model(using, PendingTask):
        return 0  # the marks live on another database, which has their table
    deleted, _ = PendingTask.objects.using(using).filter(expires_at__lt=to_field(now)).delete()
    return deleted


def _claimable(
    rows: QuerySet[Any],
    old: QuerySet[Any],
    jobs: set[str],
    now: datetime.datetime,
    schedule: Iterable[Entry],
) -> list[int]:
    """The old runs that are the first or the latest attempt of a slot that may still be
    claimed: a ``once`` slot, a current slot, a job's newest slot."""
    current = {slot(period, now) for period in PERIODS}  # "once" included
    for entry in schedule:
        due = next(entry.slots_before(now), None)
        if due is not None:
            current.add(entry.slot_name(due))
    newest = rows.filter(job_name__in=jobs).values("job_name").annotate(top=Max("pk"))
    pairs = set(rows.filter(pk__in=newest.values("top")).values_list("job_name", "period"))
    slots = old.filter(job_name__in=jobs, period__in=current | {p for _, p in pairs})
    bounds = {
        (job, period): (first, last)
        for job, period, first, last in rows.filter(
            job_name__in=jobs, period__in=slots.values("period")
        )
        .values("job_name", "period")
        .annotate(first=Min("attempt"), last=Max("attempt"))
        .values_list("job_name", "period", "first", "last")
        if period in current or (job, period) in pairs
    }
    return [
        pk
        for pk, job, period, attempt in slots.values_list("pk", "job_name", "period", "attempt")
        if attempt in bounds.get((job, period), ())
    ]


def _latest_successes(rows: QuerySet[Any], jobs: set[str]) -> list[int]:
    """Each job's latest success (as the overdue report finds it), whatever its age."""
    found = (last_success(rows, job) for job in sorted(jobs))
    return [run.pk for run in found if run is not None]


def _checked_by_the_report(
    old: QuerySet[Any], jobs: set[str], now: datetime.datetime, expected: dict[str, Expectation]
) -> list[int]:
    """The old successes of each declared job that the overdue report reads, now or later."""
    kept: list[int] = []
    for job in expected.values():
        since = job.checked_since(now) if job.job_name in jobs else None
        if since is not None:
            successes = old.filter(
                job_name=job.job_name,
                status=JobRun.Status.SUCCEEDED,
                started_at__gte=to_field(since),
            )
            kept += successes.values_list("pk", flat=True)
    return kept


def _caught_up(
    old: QuerySet[Any], jobs: set[str], keep: dict[int, str], schedule: Iterable[Entry]
) -> list[int]:
    """For each ``catch_up="all"`` entry, the latest attempt of each slot with an old run
    since the entry's oldest kept run: the scheduler would run such a slot again, were its
    rows gone (it runs each slot without a row since the entry's first run)."""
    kept: list[int] = []
    for entry in schedule:
        if entry.catch_up != "all" or entry.name not in jobs:
            continue
        runs = old.filter(job_name=entry.name)
        since = runs.filter(pk__in=list(keep)).aggregate(since=Min("started_at"))["since"]
        if since is not None:
            latest = runs.filter(started_at__gte=since).values("period").annotate(top=Max("pk"))
            kept += latest.values_list("top", flat=True)
    return kept
