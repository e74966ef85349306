"""An entry's due slots, as a scheduler computes them: once per boundary, and ahead.

A boundary is the moment an entry's next slot falls due. Between two boundaries an entry's
due slots are the same (but for ``catch_up="all"``: its missed slots are the ledger's word),
so a scheduler computes them once per boundary and keeps them (``Boundaries.dues``): a pass
over 500 cron entries then does no cron arithmetic. It also computes each entry's next
boundary ahead, halfway to it (``Boundaries.prepare``): at a boundary every scheduler of a
fleet starts its slots at once, and the cron arithmetic of all its entries would take the CPU
from those runs. No statement here; the missed slots of ``"all"`` are asked of the caller.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from collections.abc import Iterable
from typing import NamedTuple

from advisory_lock.schedule import Entry


class Due(NamedTuple):
    """A slot of an entry that may run now: its name in the ledger, when it fell due,
    whether it is the entry's most recent due slot (only that one is retried), and the
    entry's slot before it when the boundary knew it for free (None: not known; the slot
    missed before it is looked for there)."""

    slot: str
    at: datetime.datetime
    latest: bool
    before: datetime.datetime | None = None


class Boundary(NamedTuple):
    """An entry's due slots as last looked at: its latest slot, the next one (when they must
    be looked at again), and the slots that may run."""

    latest: datetime.datetime
    until: datetime.datetime
    dues: list[Due]

    @property
    def halfway(self) -> datetime.datetime:
        """When the boundary after this one is computed ahead."""
        return self.latest + (self.until - self.latest) / 2


class Boundaries:
    """Each entry's current boundary (``current``) and the next one, once computed ahead
    (``ahead``). ``missed(entry, latest)``: the slots up to ``latest`` of a
    ``catch_up="all"`` entry that have no run, oldest first."""

    def __init__(self, missed: Callable[[Entry, datetime.datetime], list[datetime.datetime]]):
        self.missed = missed
        self.current: dict[str, Boundary] = {}
        self.ahead: dict[str, Boundary] = {}
        # When the next boundary is to be computed ahead (None: every one is).
        self._prepare_at: datetime.datetime | None = None
        # The earliest ``Boundary.until`` still to come (None: to be looked for again).
        self._next: datetime.datetime | None = None

    def dues(self, entry: Entry, now: datetime.datetime) -> list[Due]:
        """The slots of ``entry`` that may run now, oldest first, by its ``catch_up``: no
        statement, but for ``"all"`` (its missed slots). Which of them do run is the
        ledger's word."""
        boundary = self.current.get(entry.name)
        if boundary is None or not boundary.latest <= now < boundary.until:
            boundary = self._enter(entry, now)
            if boundary is None:
                return []
        if entry.catch_up == "none" and (now - boundary.latest).total_seconds() >= entry.interval:
            return []
        return boundary.dues

    def _enter(self, entry: Entry, now: datetime.datetime) -> Boundary | None:
        """A new boundary of ``entry`` (or its first look): the one computed ahead, or its
        schedule read again."""
        ahead = self.ahead.pop(entry.name, None)
        if ahead is not None and ahead.latest <= now < ahead.until:
            boundary = ahead
        else:
            if ahead is not None and now < ahead.latest:
                self.ahead[entry.name] = ahead  # still to come (one passed is let go)
            previous = entry.slots_before(now)
            latest = next(previous, None)
            if latest is None:
                return None
            if entry.catch_up == "all":
                slots = self.missed(entry, latest)
                dues = [Due(entry.slot_name(slot), slot, slot == latest) for slot in slots]
            else:
                dues = [Due(entry.slot_name(latest), latest, True, next(previous, None))]
            boundary = Boundary(latest, entry.next_slot(now), dues)
        self.current[entry.name] = boundary
        if self._prepare_at is None or boundary.halfway < self._prepare_at:
            self._prepare_at = boundary.halfway
        if self._next is not None and boundary.until < self._next:
            self._next = boundary.until
        return boundary

    def prepare(self, entries: dict[str, Entry], now: datetime.datetime) -> None:
        """Compute the next boundary of each entry of ``current`` once ``now`` is halfway
        to it. An entry's next slot is its ``Boundary.until``, and stays its latest until
        the slot after that. Not for ``catch_up="all"``, whose due slots are the ledger's
        word then."""
        if self._prepare_at is None or now < self._prepare_at:
            return
        later: datetime.datetime | None = None
        for name, boundary in self.current.items():
            entry = entries[name]
            if name in self.ahead or entry.catch_up == "all":
                continue
            if now < boundary.halfway:
                later = boundary.halfway if later is None else min(later, boundary.halfway)
                continue
            until = boundary.until
            due = Due(entry.slot_name(until), until, True, boundary.latest)
            self.ahead[name] = Boundary(until, entry.next_slot(until), [due])
        self._prepare_at = later

    def next_after(self, now: datetime.datetime) -> datetime.datetime | None:
        """The earliest ``Boundary.until`` after ``now`` of the entries looked at (None:
        none). An entry busy through its boundary is looked at (and its slots computed
        again) only once its run is over."""
        if self._next is None or self._next <= now:
            self._next = min(
                (boundary.until for boundary in self.current.values() if boundary.until > now),
                default=None,
            )
        return self._next

    def forget(self, names: Iterable[str]) -> None:
        """Compute the boundaries of ``names`` again at their next look (their entry
        changed, or the ledger may say other missed slots)."""
        for name in names:
            self.current.pop(name, None)
            self.ahead.pop(name, None)
        self._next = None

    def forget_missed(self, entries: dict[str, Entry]) -> None:
        """Forget the boundaries of the ``catch_up="all"`` entries of ``entries`` (and of
        any name not in it): their missed slots are read again. The others' due slots are the
        same (their schedule alone says)."""
        self.forget(
            [
                name
                for name in self.current
                if name not in entries or entries[name].catch_up == "all"
            ]
        )
