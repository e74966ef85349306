"""How the live schedulers of a fleet share the work: a boundary's due slots, and the looks
for run-now requests.

Each scheduler counts the live schedulers (their heartbeat rows: one statement) and takes its
rank among them. It tries first the entries that fall to it (a stable hash of the name,
modulo the number of live schedulers, against its rank), then the others', each part
shuffled: a claim then rarely finds its entry taken, and a dead scheduler's entries are
still run by the others (after their own). The fleet is counted at the first heartbeats (it
may be starting), then once a minute, or again at the next two heartbeats while the count
changes. Nothing here is needed for correctness: the claims let one scheduler alone start a
slot, whatever the order each tries them in.
"""

from __future__ import annotations

import datetime
import math
import random
import zlib
from collections.abc import Iterable

from advisory_lock.scheduling.liveness import live_schedulers

#: About how many schedulers of a fleet look for requests in each poll interval.
POLLERS = 4


class Sharing:
    """This scheduler's share of the entries ``names``: ``order`` (its own first) and
    ``own``, by its ``rank`` among the ``size`` live schedulers as last counted."""

    def __init__(self, names: Iterable[str]) -> None:
        self.order = list(names)
        random.shuffle(self.order)
        self.own = set(self.order)  # until the fleet is counted: all are
        self.counts_left = 2  # heartbeats at which to count again before once a minute
        self.rank, self.size = 0, 1

    def count(self, using: str, now: datetime.datetime, mine: int | None) -> None:
        """Count the live schedulers (one statement) and take this one's rank among them
        (``mine``: its heartbeat row's key, None before it has one), then order ``names``
        by it. A count that changed is made again at the next two heartbeats."""
        live = sorted(row.pk for row in live_schedulers(using, now))
        rank, size = (live.index(mine), len(live)) if mine in live else (0, 1)
        if (rank, size) != (self.rank, self.size):
            self.counts_left = 2  # the fleet is changing: a scheduler came or went
        self.rank, self.size = rank, size

    def reorder(self, names: Iterable[str]) -> None:
        """``order`` and ``own`` of ``names`` by the fleet as last counted: no statement."""
        own = [name for name in names if zlib.crc32(name.encode()) % self.size == self.rank]
        others = [name for name in names if zlib.crc32(name.encode()) % self.size != self.rank]
        random.shuffle(own)
        random.shuffle(others)
        self.order = own + others
        self.own = set(own)

    def polls_in(self, now: datetime.datetime, interval: float) -> bool:
        """Is the poll interval that holds ``now`` (the server's clock, which the fleet
        shares) this scheduler's turn to look for requests? Always, in a fleet of up to
        ``POLLERS``. In a larger one the intervals take turns: the schedulers whose rank is
        the interval's number modulo ``ceil(size / POLLERS)`` look, so that about
        ``POLLERS`` look in each interval whatever the fleet's size, and a request is still
        seen within an interval (any scheduler can run it: the one that claims its entry).
        A scheduler alone in its turn that died leaves its turns to the others' next look,
        until the fleet is counted again."""
        turns = math.ceil(self.size / POLLERS)
        if turns <= 1:
            return True
        return math.floor(now.timestamp() / interval) % turns == self.rank % turns
