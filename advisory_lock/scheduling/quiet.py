"""The entries a scheduler need not look at until their next boundary, and its walk over
the others.

An entry is quiet when every slot it has due is settled or another scheduler's: nothing of
it can run here before its next boundary (``Boundary.until``). A scheduler walks its entries
at every pass, and a boundary's burst makes hundreds of passes; most entries are quiet by
then. So the walk keeps the entries that may not be quiet, in the scheduler's order, and
leaves an entry out once it is found quiet: a pass costs the entries still to run, not all
of them. The left-out entries come back all at once, by a walk built again from the order:
when the earliest of their quiet spells ends, when one of them is woken, when the order
changes (a new one is a new list), or when all are woken. No statement here.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator


class QuietEntries:
    """The quiet entries (name: until when) and the walk over the others."""

    def __init__(self) -> None:
        self._until: dict[str, datetime.datetime] = {}
        # The entries that may not be quiet, in the order the walk was built from (a dict:
        # ordered, and an entry found quiet is left out of it at once).
        self._walk: dict[str, None] = {}
        self._order: list[str] | None = None  # None: the walk is to be built again
        # The earliest end of a left-out entry's quiet spell: the walk is built again then.
        self._rebuild_at: datetime.datetime | None = None

    def walk(self, order: list[str], now: datetime.datetime) -> Iterator[str]:
        """The names of ``order`` not quiet at ``now``, in that order, each when the caller
        asks for it. An entry hushed meanwhile (``hush``) is left out of the walks after
        this one; the scheduler wakes entries between its walks, not during one."""
        if order is not self._order or (self._rebuild_at is not None and now >= self._rebuild_at):
            self._order, self._rebuild_at = order, None
            self._walk = dict.fromkeys(order)
        for name in list(self._walk):  # a copy: ``hush`` may leave names out meanwhile
            until = self._until.get(name)
            if until is not None and now < until:
                self._leave_out(name, until)
                continue
            yield name

    def walking(self) -> int:
        """How many entries the walk holds now: those it goes over, but for any it brings
        back when it is built again."""
        return len(self._walk)

    def hush(self, name: str, until: datetime.datetime) -> None:
        """``name`` has nothing to run before ``until``."""
        self._until[name] = until
        self._leave_out(name, until)

    def wake(self, name: str) -> None:
        """``name`` may have something to run again: it is walked over again."""
        self._until.pop(name, None)
        if name not in self._walk:
            self._order = None

    def clear(self) -> None:
        """Every entry is walked over again."""
        self._until.clear()
        self._order = None

    def _leave_out(self, name: str, until: datetime.datetime) -> None:
        self._walk.pop(name, None)
        if self._rebuild_at is None or until < self._rebuild_at:
            self._rebuild_at = until
