"""Declared jobs: what the overdue report (``advisory_lock.scheduling.overdue``) expects of
the ledger.

A job is declared with the period it runs in and a grace in seconds, in settings::

    ADVISORY_LOCK = {"JOBS": {"example.nightly_report": {"period": "daily", "grace": 7200}}}

or where it is defined: ``@single_instance(ledger="daily", grace=7200)`` (a command's job name
is ``<app_label>.<command>``; a function's ``<module>.<qualname>``). A scheduled entry with a
``grace`` (``ADVISORY_LOCK["SCHEDULE"]``) is declared too. Only declared jobs are watched.

No model here: the single-instance decorators declare their jobs while the app registry is
still loading.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from advisory_lock.conf import get_setting
from advisory_lock.periods import PERIODS
from advisory_lock.periods import check_job_name
from advisory_lock.periods import ledger_time_zone
from advisory_lock.periods import slot
from advisory_lock.schedule import Entry
from advisory_lock.schedule import usable_entries
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_seconds

JOB_OPTIONS = ("period", "grace")
UTC = datetime.timezone.utc
Source = TypeVar("Source", bound=Callable[[], Iterable["Expectation"]])


@dataclass(frozen=True)
class Expectation:
    """A declared job: it runs every ``period``, and is overdue ``grace`` seconds after."""

    job_name: str
    period: str
    grace: float = 0
    #: A scheduled job's entry (``ADVISORY_LOCK["SCHEDULE"]``): its slots are its firing times.
    entry: Entry | None = None

    def latest_slot(self, now: datetime.datetime) -> tuple[str, datetime.datetime] | None:
        """The slot that should have succeeded by ``now``, and when it ended (None if none).

        A period's slot must succeed within ``grace`` after it ended; a scheduled slot (an
        instant), within ``grace`` after it fell due.
        """
        moment = now - datetime.timedelta(seconds=self.grace)
        if self.entry is not None:
            due = next(self.entry.slots_before(moment), None)
            return None if due is None else (self.entry.slot_name(due), due)
        if self.period == "once":
            return None  # the slot of a once job never ends
        return last_ended_slot(self.period, moment)

    def checked_since(self, now: datetime.datetime) -> datetime.datetime | None:
        """When the slot the report checks at ``now`` began (None if it checks none): the
        report reads the successes of that slot from then on, then of the later slots, and
        each of their runs started at that instant or after it."""
        latest = self.latest_slot(now)
        if latest is None:
            return None
        if self.entry is not None:
            return latest[1]  # a scheduled slot is the instant it fell due
        # The slot that ended at latest[1] began where the slot before it ended.
        return last_ended_slot(self.period, latest[1] - datetime.timedelta(microseconds=1))[1]


# Jobs declared in code by @single_instance on functions: {job name: Expectation}.
_declared_in_code: dict[str, Expectation] = {}
# Functions that find the jobs declared elsewhere in code, registered by the modules that know
# where to look (the single-instance commands: ``advisory_lock.single_instance.commands``).
_sources: list[Callable[[], Iterable[Expectation]]] = []


def declare(job_name: str, period: str, grace: float) -> None:
    """Declare a job from its code (``@single_instance(ledger=..., grace=...)``)."""
    _declared_in_code[job_name] = Expectation(job_name, period, grace)


def declaration_source(source: Source) -> Source:
    """Register ``source``, a function returning jobs declared in code, for ``declared_jobs()``
    to call each time (a decorator)."""
    if source not in _sources:
        _sources.append(source)
    return source


def declared_jobs() -> dict[str, Expectation]:
    """Every declared job: ADVISORY_LOCK["JOBS"], then the project's single-instance commands
    and the functions imported so far (settings win over code)."""
    jobs = dict(_declared_in_code)
    for source in _sources:
        jobs.update((job.job_name, job) for job in source())
    for name, entry in usable_entries().items():  # a bad entry hides none of the others
        if entry.grace is not None:
            schedule = entry.cron or f"every {entry.every:g}s"
            jobs[name] = Expectation(name, schedule, entry.grace, entry)
    jobs_setting = get_setting("JOBS")
    for job_name, entry in jobs_setting.items() if isinstance(jobs_setting, dict) else ():
        if not job_problems(job_name, entry):
            jobs[job_name] = Expectation(job_name, entry["period"], entry.get("grace", 0))
    return jobs


def job_problems(job_name: object, entry: object) -> list[str]:
    """What is wrong with one JOBS entry (for the system checks); empty if it is fine."""
    if not isinstance(job_name, str) or not job_name.strip():
        return [f"ADVISORY_LOCK['JOBS'] has a job name that is not a non-blank str: {job_name!r}."]
    where = f"ADVISORY_LOCK['JOBS'][{job_name!r}]"
    try:
        check_job_name(job_name, "its name")  # a job name of the ledger, which it looks up
    except ValueError as error:
        return [f"{where} names no job the ledger can hold: {error}"]
    if not isinstance(entry, dict):
        return [f"{where} must be a dict with 'period' and optionally 'grace', not {entry!r}."]
    problems = []
    unknown = sorted(set(entry) - set(JOB_OPTIONS), key=str)
    if unknown:
        problems.append(
            f"{where} has unknown option(s) {', '.join(map(repr, unknown))}; the options are "
            f"{', '.join(map(repr, JOB_OPTIONS))}."
        )
    if entry.get("period") not in PERIODS:
        problems.append(
            f"{where}['period'] must be one of {', '.join(map(repr, PERIODS))}, not "
            f"{entry.get('period')!r}."
        )
    grace = entry.get("grace", 0)
    try:
        check_seconds("grace", grace, maximum=MAX_SECONDS)
    except ValueError:
        problems.append(
            f"{where}['grace'] must be a number of seconds >= 0 and at most {MAX_SECONDS} (a "
            f"century: a slot that long ago can be computed), not {grace!r}."
        )
    return problems


def last_ended_slot(period: str, moment: datetime.datetime) -> tuple[str, datetime.datetime]:
    """The latest slot of ``period`` that had ended at ``moment``, and when it ended (the
    start of the slot ``moment`` is in), in the ledger's time zone."""
    local = moment.astimezone(ledger_time_zone())
    if period == "hourly":
        # replace() keeps the fold: the hour that repeats when DST ends starts twice.
        start = local.replace(minute=0, second=0, microsecond=0)
    elif period in ("daily", "weekly", "monthly"):
        day = local.date()
        if period == "weekly":
            day -= datetime.timedelta(days=day.weekday())
        elif period == "monthly":
            day = day.replace(day=1)
        start = datetime.datetime.combine(day, datetime.time(), tzinfo=local.tzinfo)
    else:
        raise ValueError(f"No slot end for the period {period!r}.")
    # In UTC: wall-clock arithmetic in a zone with DST would be off by the shift.
    ended_at = start.astimezone(UTC)
    return slot(period, ended_at - datetime.timedelta(microseconds=1)), ended_at
