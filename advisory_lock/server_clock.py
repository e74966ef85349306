"""The database server's clock for the ledger's claims and ends: asked each time, or, in a
process that runs job after job (a scheduler's worker, see ``count_from_readings``), read at
most once a second and counted on from there with this host's monotonic clock.

The ledger stamps a run's start and end with the server's clock, so that hosts whose clocks
disagree still agree on what happened when. Counting on from a reading keeps that: a
reading is the server's clock, and ``time.monotonic()`` (CLOCK_MONOTONIC) runs at the rate of
this host's clock, which NTP keeps within a few hundred parts per million of the server's: at
most a second from a reading, the two differ by well under a millisecond, as much as the
round trip of the statement that would read it. A step of the server's clock (set by hand,
or by NTP after a long drift) shows at the next reading, a second later at most.
"""

from __future__ import annotations

import datetime
from time import monotonic

from django.db import connections

from advisory_lock.backends import inspector_for

#: Seconds a reading of a server's clock is counted on from before it is read again.
MAX_AGE = 1.0

_counting = False
#: Per alias: the server's clock at the last reading, and ``monotonic()`` just after it.
_readings: dict[str, tuple[datetime.datetime, float]] = {}


def count_from_readings() -> None:
    """From now on, this process reads each server's clock at most once in ``MAX_AGE``
    seconds for the ledger's claims and ends: for a process that runs job after job."""
    global _counting
    _counting = True


def ledger_now(using: str) -> datetime.datetime:
    """The clock of the database server of ``using`` (aware, UTC)."""
    if not _counting:
        return inspector_for(connections[using]).database_now()
    reading = _readings.get(using)
    elapsed = monotonic() - reading[1] if reading is not None else MAX_AGE
    if reading is None or not 0 <= elapsed < MAX_AGE:
        now = inspector_for(connections[using]).database_now()
        _readings[using] = (now, monotonic())
        return now
    return reading[0] + datetime.timedelta(seconds=elapsed)
