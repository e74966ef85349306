"""A scheduled entry's health at a glance: its last slots, its success rate, and whether it
is failing (its last ``alert_after`` slots that ran all failed).

The strip is the entry's timeline (``advisory_lock.scheduling.timeline``) cut to its last
``STRIP`` slots. The success rate counts the strip's slots that are over (succeeded, failed,
abandoned, missed), not those still running, enqueued or paused.

"Failing" reads the ledger, not the schedule: the entry's latest slots that ran to an end,
newest first, each slot's latest attempt deciding (a slot retried into success succeeded);
a slot whose latest attempt is still running or enqueued is not over and is passed over, as
are the slots that never ran (missed or paused: the overdue report's ``grace`` is for those).
The entry is failing when the ``alert_after`` latest of them all failed or were abandoned.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from advisory_lock.ledger import JobRun
from advisory_lock.ledger import first_line
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.timeline import MISSED
from advisory_lock.scheduling.timeline import SlotOutcome
from advisory_lock.scheduling.timeline import timeline

#: How many slots the strip shows.
STRIP = 20
#: The outcomes of a slot that is over.
OVER = frozenset({JobRun.Status.SUCCEEDED, JobRun.Status.FAILED, JobRun.Status.ABANDONED, MISSED})
#: A run's statuses that make its slot a failed one.
FAILURES = frozenset({JobRun.Status.FAILED, JobRun.Status.ABANDONED})
#: A run's statuses that are not an end yet.
GOING_ON = (JobRun.Status.RUNNING, JobRun.Status.ENQUEUED)
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
#: Ledger rows read at a time while looking for an entry's latest ended slots.
_PAGE = 100


@dataclass(frozen=True)
class Failing:
    """An entry whose ``runs`` (the latest attempt of each of its last ``alert_after`` slots
    that ran, newest first) all failed."""

    job_name: str
    alert_after: int
    runs: list[Any]  # JobRun

    @property
    def latest(self) -> Any:
        return self.runs[0]

    @property
    def reason(self) -> str:
        """What the overdue report and the Schedule page say about it."""
        error = first_line(self.latest.error)
        said = f": {error}" if error else ""
        return (
            f"its last {self.alert_after} slot(s) that ran failed (alert_after="
            f"{self.alert_after}), the latest {self.latest.period} on {self.latest.host or '?'}"
            f"{said}"
        )


@dataclass(frozen=True)
class Health:
    """An entry's last ``STRIP`` slots (oldest first) and how many of those over succeeded."""

    strip: list[SlotOutcome]
    succeeded: int
    over: int
    failing: Failing | None

    @property
    def success_rate(self) -> float | None:
        """The share of the strip's slots that are over which succeeded (None: none over)."""
        return self.succeeded / self.over if self.over else None


def health(entry: Entry, using: str) -> Health:
    """``entry``'s health now, on the ledger of ``using``."""
    # However far back its last STRIP slots go (a yearly cron entry's: 20 years).
    strip = timeline(entry, using, since=EPOCH, last=STRIP)
    over = [slot for slot in strip if slot.outcome in OVER]
    succeeded = sum(1 for slot in over if slot.outcome == JobRun.Status.SUCCEEDED)
    return Health(strip, succeeded, len(over), failing(entry, using))


def failing(entry: Entry, using: str) -> Failing | None:
    """``Failing`` if the last ``entry.alert_after`` slots of ``entry`` that ran to an end
    all failed, else None (and None while fewer slots have ended). Reads the entry's rows
    newest first, ``_PAGE`` at a time, until it has seen that many slots or a success."""
    runs = JobRun.objects.using(using).filter(job_name=entry.name).order_by("-started_at", "-pk")
    seen: set[str] = set()
    ended: list[Any] = []
    offset = 0
    while len(ended) < entry.alert_after:
        page = list(runs[offset : offset + _PAGE])
        for run in page:
            if run.period in seen:
                continue  # an earlier attempt of a slot whose latest attempt decided
            seen.add(run.period)
            if run.status in GOING_ON:
                continue
            if run.status not in FAILURES:
                return None
            ended.append(run)
            if len(ended) == entry.alert_after:
                break
        if len(page) < _PAGE:
            break
        offset += _PAGE
    if len(ended) < entry.alert_after:
        return None
    return Failing(entry.name, entry.alert_after, ended)
