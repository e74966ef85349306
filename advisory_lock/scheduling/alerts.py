"""The scheduler's alerts: what an on-call engineer must hear of, as signals and log records.

Each alert is sent once per event, by the one process that found it, with ``send_robust``
(a receiver that raises is logged, never propagated), and logged at ERROR on the
``advisory_lock.alerts`` logger with the same values in the record's ``extra``: an error
tracker's logging integration (Sentry's) or ``AdminEmailHandler`` needs no receiver at all.

- ``slot_failed``: by the scheduler whose worker ran the attempt (its answer, or its death).
- ``slot_missed``: by the scheduler that claims an entry's next slot, about the slots before
  it that no run was started for. The claim is held from that look until the slot's run has
  its row, and the next slot's look starts after that row: no two schedulers look at the same
  gap. Slots that fell due while the entry was paused, or before its first run, are not
  missed.
- ``entry_unhealthy``: by the scheduler that recorded the failure that made the streak.
- ``no_scheduler_alive``: by each ``run_jobs --check`` or ``job_runs --overdue`` that finds
  none (no scheduler is there to find it).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import logging
import operator
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from advisory_lock import signals
from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field
from advisory_lock.ledger import JobRun
from advisory_lock.ledger import deciding_attempt
from advisory_lock.ledger import deciding_attempts
from advisory_lock.ledger import first_line
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.boundaries import Due
from advisory_lock.scheduling.control import MANUAL
from advisory_lock.scheduling.control import pauses_of
from advisory_lock.scheduling.first_seen import first_seen
from advisory_lock.scheduling.health import failing

logger = logging.getLogger("advisory_lock.alerts")

#: At most this many slots of one gap are named in a ``slot_missed`` alert.
MISSED_NAMED = 100


def send(
    signal: Signal,
    message: str,
    *,
    using: str,
    entry: Entry | None,
    slot: str | None,
    run: JobRun | None,
    error: str,
    **more: Any,
) -> None:
    """Log ``message`` at ERROR with the alert's values, then send ``signal`` with them."""
    event = {signal: name for name, signal in _SIGNALS.items()}[signal]
    logger.error(
        message,
        extra={
            "event": event,
            "database": using,
            "job_name": entry.name if entry is not None else None,
            "slot": slot,
            "run_id": run.pk if run is not None else None,
            "attempt": run.attempt if run is not None else None,
            "error": error,
            **more,
        },
    )
    responses = signal.send_robust(
        sender=Entry, using=using, entry=entry, slot=slot, run=run, error=error, **more
    )
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "A receiver of advisory_lock's %s signal (%s) raised: %r.",
                event,
                getattr(receiver, "__qualname__", receiver),
                response,
                exc_info=response,
            )


_SIGNALS = {
    "slot_failed": signals.slot_failed,
    "slot_missed": signals.slot_missed,
    "entry_unhealthy": signals.entry_unhealthy,
    "no_scheduler_alive": signals.no_scheduler_alive,
}


def slot_failed(using: str, entry: Entry, slot: str, how: str = "") -> JobRun | None:
    """Alert that an attempt at ``entry``'s ``slot`` failed; ``how``: what the scheduler
    knows of it (its process died), else the run's recorded error says. Reads the slot's
    deciding attempt (one statement): the run that failed. Returns it."""
    run = deciding_attempt(JobRun.objects.using(using).filter(job_name=entry.name, period=slot))
    error = how or (run.error if run is not None else "") or "it failed"
    attempt = f" (attempt {run.attempt})" if run is not None else ""
    send(
        signals.slot_failed,
        f"{entry.name} [{slot}] failed{attempt}: {first_line(error)}",
        using=using,
        entry=entry,
        slot=slot,
        run=run,
        error=error,
    )
    if run is not None and run.attempt == 1:
        # The slot's first failure: it may make the streak (a later attempt's can't, its
        # slot was counted failed already).
        _unhealthy_now(using, entry, run)
    return run


def _unhealthy_now(using: str, entry: Entry, run: JobRun) -> None:
    """Alert ``entry_unhealthy`` if ``run``'s failure made the entry failing: its last
    ``alert_after`` slots that ran failed (``health.failing``), this run's the latest, and
    the one before them did not (else it was failing already, and said so then)."""
    now = failing(entry, using)
    if now is None or now.latest.pk != run.pk:
        return
    if failing(dataclasses.replace(entry, alert_after=entry.alert_after + 1), using):
        return  # the streak is longer: it was failing before this run
    send(
        signals.entry_unhealthy,
        f"{entry.name} is failing: {now.reason}",
        using=using,
        entry=entry,
        slot=run.period,
        run=run,
        error=now.reason,
    )


def missed_before(
    using: str,
    entries: dict[str, Entry],
    starting: dict[str, Due],
    known: Callable[[str, str], bool],
) -> None:
    """Alert of the slots that no run was started for before the slots in ``starting``
    (entry name: the slot about to get its first attempt, and the one before it if known);
    ``known(name, slot)``: the scheduler knows that slot was attempted. The previous slots
    not known are looked up in one statement; only a gap costs more (each entry's latest
    run before it, and the pauses): it is rare."""
    previous: dict[str, tuple[str, datetime.datetime]] = {}
    for name, due in starting.items():
        entry = entries[name]
        if entry.catch_up == "all":
            continue  # its missed slots are run, not missed
        at = due.at
        before = due.before
        if before is None:
            before = next(entry.slots_before(at - datetime.timedelta(microseconds=1)), None)
        if before is not None and not known(name, slot := entry.slot_name(before)):
            previous[name] = (slot, before)
    if not previous:
        return
    attempted = deciding_attempts(using, {name: slot for name, (slot, _at) in previous.items()})
    runs = JobRun.objects.using(using).exclude(period__startswith=MANUAL)
    gaps: dict[str, list[datetime.datetime]] = {}
    for name, (_slot, at) in previous.items():
        if name in attempted:
            continue
        last = (
            runs.filter(job_name=name, started_at__lt=to_field(at))
            .order_by("-started_at")
            .values_list("started_at", flat=True)
            .first()
        )
        if last is None:
            continue  # a new entry: no slot of it before its first run is missed
        # A slot that was run has started_at at or after the slot: the slots after the
        # latest start before the gap were never started.
        after_it = functools.partial(operator.lt, from_field(last))  # slot > its start
        never = itertools.takewhile(after_it, entries[name].slots_before(at))
        if slots := list(itertools.islice(never, MISSED_NAMED)):
            gaps[name] = slots
    if not gaps:
        return
    seen = first_seen(using, gaps)
    spans = pauses_of(using, list(gaps), min(slots[-1] for slots in gaps.values()))
    for name, slots in gaps.items():
        entry = entries[name]
        paused = spans.get(name, [])
        since = seen.get(name)
        missed = [
            entry.slot_name(slot)
            for slot in slots
            if (since is None or slot >= since) and not any(span.covers(slot) for span in paused)
        ]
        if not missed:
            continue
        more = f" and {len(missed) - 1} slot(s) before it" if len(missed) > 1 else ""
        error = (
            f"no run of it started while it was due (catch_up {entry.catch_up!r}): no "
            f"scheduler was alive then, or none could start it in time"
        )
        send(
            signals.slot_missed,
            f"{name} [{missed[0]}]{more} missed: {error}.",
            using=using,
            entry=entry,
            slot=missed[0],
            run=None,
            error=error,
            slots=missed,
        )


def reaches_stderr() -> bool:
    """Do the alerts' records go to standard error by themselves? They do where logging is
    not configured for them: Python then writes a record of WARNING or above there
    (``logging.lastResort``), and a command need not say the same line again."""
    return not logger.hasHandlers()


def alert_no_scheduler_alive(using: str, why: str) -> None:
    """Alert that no scheduler is alive on ``using``; ``why`` says since when. Its message
    is ``run_jobs``' line: "run_jobs: <why>." """
    send(
        signals.no_scheduler_alive,
        f"run_jobs: {why}.",
        using=using,
        entry=None,
        slot=None,
        run=None,
        error=why,
    )
