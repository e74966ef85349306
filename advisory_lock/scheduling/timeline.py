"""A scheduled entry's slot timeline: each slot since a moment, with how it went.

Derived from the schedule and the ledger's rows; nothing is written for a slot that never ran.
A slot's outcome is its latest attempt's status (``succeeded``, ``failed``, ``running``,
``abandoned``); a slot with no attempt is ``paused`` if it fell due while the entry was paused
(``advisory_lock.scheduling.control``), else ``missed``. A slot with no attempt that fell due
before a scheduler first loaded the entry (``advisory_lock.scheduling.first_seen``), or while
none has yet, is not listed: nobody was meant to run it. Run-now slots (``manual:...``) of the
span are listed too, at the time they were requested.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.utils.dateparse import parse_date
from django.utils.dateparse import parse_datetime

from advisory_lock.backends import inspector_for
from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field
from advisory_lock.ledger import JobRun
from advisory_lock.periods import ledger_time_zone
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.control import MANUAL
from advisory_lock.scheduling.control import pauses
from advisory_lock.scheduling.first_seen import first_seen

#: At most this many slots (the latest ones).
MAX_SLOTS = 1000
#: Without ``since``: the last 7 days.
DEFAULT_SPAN = datetime.timedelta(days=7)
PAUSED = "paused"
MISSED = "missed"
_CHUNK = 500  # slot names per IN (...) list


@dataclass(frozen=True)
class SlotOutcome:
    """One slot of an entry and how it went (the latest attempt's, if any)."""

    slot: str
    due: datetime.datetime
    outcome: str
    attempts: int
    started: datetime.datetime | None
    duration: float | None
    host: str
    #: The latest attempt's primary key in the ledger (None: no attempt).
    run_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "run_id": self.run_id,
            "outcome": self.outcome,
            "attempts": self.attempts,
            "started": self.started.isoformat() if self.started else None,
            "duration": self.duration,
            "host": self.host,
        }


def parse_since(text: str) -> datetime.datetime:
    """An ISO 8601 date or date and time; without an offset, in the ledger's time zone."""
    moment = parse_datetime(text)
    if moment is None:
        day = parse_date(text)
        if day is None:
            raise ValueError(f"{text!r} is not an ISO 8601 date or date and time.")
        moment = datetime.datetime.combine(day, datetime.time())
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ledger_time_zone())
    return moment


def timeline(
    entry: Entry,
    using: str,
    since: datetime.datetime | None = None,
    *,
    last: int = MAX_SLOTS,
) -> list[SlotOutcome]:
    """Every slot of ``entry`` from ``since`` (default: 7 days ago) to now, by the database
    server's clock, oldest first: at most ``last`` (up to ``MAX_SLOTS``), the latest ones."""
    now = inspector_for(connections[using]).database_now()
    since = now - DEFAULT_SPAN if since is None else since
    last = min(last, MAX_SLOTS)
    due: dict[str, datetime.datetime] = {}
    for moment in entry.slots_before(now):
        if moment < since or len(due) == last:
            break
        due[entry.slot_name(moment)] = moment
    runs = JobRun.objects.using(using).filter(job_name=entry.name)
    attempts: dict[str, list[JobRun]] = {}
    names = list(due)
    for start in range(0, len(names), _CHUNK):
        for run in runs.filter(period__in=names[start : start + _CHUNK]):
            attempts.setdefault(run.period, []).append(run)
    earliest = min(due.values(), default=since)
    for run in runs.filter(period__startswith=MANUAL, started_at__gte=to_field(earliest)):
        if run.period not in due:
            requested = parse_datetime(run.period.removeprefix(MANUAL))
            due[run.period] = requested or from_field(run.started_at)
        attempts.setdefault(run.period, []).append(run)
    spans = pauses(using, entry.name, earliest)
    seen = first_seen(using, [entry.name]).get(entry.name)
    outcomes = []
    for name, moment in due.items():
        tried = attempts.get(name)
        if tried:
            latest = max(tried, key=lambda run: (run.attempt, run.pk))
            outcomes.append(
                SlotOutcome(
                    slot=name,
                    due=moment,
                    outcome=latest.status,
                    attempts=len(tried),
                    started=from_field(latest.started_at),
                    duration=(
                        latest.duration.total_seconds() if latest.duration is not None else None
                    ),
                    host=latest.host,
                    run_id=latest.pk,
                )
            )
        elif seen is None or moment < seen:
            continue  # not yet due to any scheduler: not missed
        else:
            paused = any(span.covers(moment) for span in spans)
            outcomes.append(
                SlotOutcome(name, moment, PAUSED if paused else MISSED, 0, None, None, "")
            )
    outcomes.sort(key=lambda outcome: outcome.due)
    return outcomes[-last:]
