"""Overdue jobs: the ledger says what ran; the jobs' declarations (``advisory_lock.expectations``)
say what should have. A job is overdue when the latest slot that ended more than ``grace``
seconds ago, by the database server's clock in the ledger's time zone, has no ``succeeded``
run. A ``once`` job's slot never ends: it is never overdue. A scheduled entry with a ``grace``
(``ADVISORY_LOCK["SCHEDULE"]``) is declared too: its latest slot that fell due more than
``grace`` ago must have succeeded. A scheduled entry whose last ``alert_after`` slots that
ran all failed (``advisory_lock.scheduling.health``) is reported too, with that reason, grace
or not: its ``missing_slot`` is the latest failed one.

The report reads, of each declared job, the successes of the slot it checks (and, as time
goes on, of the later ones: ``Expectation.checked_since``) and the job's latest success
(``last_success``). Pruning the ledger (``advisory_lock.scheduling.pruning``) keeps those
rows, so that a pruned ledger raises no false alarm and still knows each job's last success.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from django.db import connections
from django.db.models import F
from django.db.models import QuerySet

from advisory_lock.backends import inspector_for
from advisory_lock.datetimes import from_field
from advisory_lock.expectations import Expectation
from advisory_lock.expectations import declared_jobs
from advisory_lock.ledger import JobRun
from advisory_lock.schedule import Entry
from advisory_lock.schedule import usable_entries
from advisory_lock.scheduling.control import fell_due_while_paused
from advisory_lock.scheduling.health import failing
from advisory_lock.scheduling.liveness import live_schedulers
from advisory_lock.scheduling.liveness import no_scheduler_alive
from advisory_lock.scheduling.stored import stored_entries
from advisory_lock.validation import check_alias


@dataclass(frozen=True)
class OverdueJob:
    """A job whose ``missing_slot`` has no successful run, ``grace`` seconds after it ended."""

    job_name: str
    period: str
    missing_slot: str
    slot_ended_at: datetime.datetime
    last_success: Any  # the job's latest succeeded JobRun, or None
    #: Why it is late, when the report knows: a scheduled entry with no scheduler alive, or
    #: one whose last slots all failed.
    reason: str = ""
    #: A scheduled entry whose last ``alert_after`` slots that ran all failed.
    failing: bool = False

    def as_dict(self) -> dict[str, Any]:
        last = self.last_success
        return {
            "job": self.job_name,
            "period": self.period,
            "missing_slot": self.missing_slot,
            "slot_ended_at": self.slot_ended_at.isoformat(),
            "reason": self.reason or None,
            "failing": self.failing,
            "last_success": None
            if last is None
            else {
                "slot": last.period,
                "finished_at": from_field(last.finished_at).isoformat()
                if last.finished_at
                else None,
                "host": last.host,
            },
        }


def whole_schedule(using: str) -> dict[str, Entry]:
    """The schedule's entries that can run: the settings' (a bad one is the system checks'
    to report) and those stored on ``using`` (``scheduling.stored``)."""
    return {**stored_entries(using)[0], **usable_entries()}


def expected_jobs(using: str, schedule: dict[str, Entry] | None = None) -> dict[str, Expectation]:
    """Every declared job (``declared_jobs``), and the stored entries of ``using`` with a
    ``grace``: what the report checks."""
    declared = declared_jobs()
    for name, entry in (whole_schedule(using) if schedule is None else schedule).items():
        if entry.grace is not None and name not in declared:  # a stored one
            when = entry.cron or f"every {entry.every:g}s"
            declared[name] = Expectation(name, when, entry.grace, entry)
    return declared


def overdue_jobs(using: str | None = None) -> list[OverdueJob]:
    """The declared jobs that are overdue now, by the ledger on ``using``'s clock, and the
    scheduled entries that are failing, by job name. A scheduled entry's slot that fell due
    while the entry was paused is not overdue; a late one's ``reason`` says when no
    scheduler is alive, a failing one's which slots failed and the latest error."""
    using = check_alias(using)
    now = inspector_for(connections[using]).database_now()
    runs = JobRun.objects.using(using)
    overdue = []
    schedule = whole_schedule(using)
    for job in sorted(expected_jobs(using, schedule).values(), key=lambda job: job.job_name):
        latest = job.latest_slot(now)
        if latest is None:
            continue
        missing, ended_at = latest
        succeeded = runs.filter(job_name=job.job_name, status=JobRun.Status.SUCCEEDED)
        if succeeded.filter(period=missing).exists():
            continue
        reason = ""
        if job.entry is not None:
            if fell_due_while_paused(using, job.job_name, ended_at):
                continue
            if not live_schedulers(using):
                reason = no_scheduler_alive(using)
        last = last_success(runs, job.job_name)
        overdue.append(OverdueJob(job.job_name, job.period, missing, ended_at, last, reason))
    late = {job.job_name: number for number, job in enumerate(overdue)}
    for name, entry in sorted(schedule.items()):
        failed = failing(entry, using)
        if failed is None:
            continue
        if name in late:  # late and failing: one line, both reasons
            known = overdue[late[name]]
            reason = "; ".join(filter(None, [known.reason, failed.reason]))
            overdue[late[name]] = replace(known, reason=reason, failing=True)
            continue
        when = entry.cron or f"every {entry.every:g}s"
        latest = failed.latest
        overdue.append(
            OverdueJob(
                name,
                when,
                latest.period,
                from_field(latest.started_at),
                last_success(runs, name),
                failed.reason,
                failing=True,
            )
        )
    return sorted(overdue, key=lambda job: job.job_name)


def last_success(runs: QuerySet[Any], job_name: str) -> Any:
    """The job's latest succeeded run among ``runs`` (a JobRun queryset), or None: the one
    the report shows, and the one pruning keeps whatever its age."""
    succeeded = runs.filter(job_name=job_name, status=JobRun.Status.SUCCEEDED)
    return succeeded.order_by(F("finished_at").desc(nulls_last=True), "-pk").first()
