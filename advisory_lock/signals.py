"""Signals for metrics and alerting; each is sent with the lock's key and timings.

Arguments: ``key`` (as given), ``name`` (the key when it is a string, else None), ``using``,
``scope`` ("session" or "transaction"), ``wait_time`` (seconds spent taking the lock) and
``hold_time`` (seconds held so far; None when it was not taken). ``sender`` is the
``AdvisoryLock``. They are sent with ``send_robust`` once the hold is recorded: a receiver
that raises is logged and never affects the lock or the caller.
"""

from __future__ import annotations

import logging
from time import monotonic
from typing import Protocol

from django.dispatch import Signal

from advisory_lock.keys import Key
from advisory_lock.keys import LockKey

logger = logging.getLogger("advisory_lock")

#: A lock was taken.
lock_acquired = Signal()
#: A lock was released (for a transaction-scoped lock: when its transaction ended).
lock_released = Signal()
#: A lock was busy: a try failed, or a bounded wait ran out.
lock_busy = Signal()
#: A held lock was found lost (its connection closed or killed, or a pooler moved it).
lock_lost = Signal()
#: ``manage.py job_runs --overdue`` found a declared job overdue. Arguments: ``job_name``,
#: ``period``, ``missing_slot``, ``slot_ended_at``, ``last_success`` (a JobRun or None).
job_overdue = Signal()


class Handle(Protocol):
    """What the signals tell of a lock's handle (a ``LockHandle``)."""

    @property
    def key(self) -> Key: ...

    @property
    def lock_key(self) -> LockKey: ...

    @property
    def using(self) -> str: ...

    @property
    def scope(self) -> str: ...

    @property
    def wait_time(self) -> float: ...

    @property
    def acquired_at(self) -> float | None: ...


def send(signal: Signal, sender: object, handle: Handle) -> None:
    """Send a lock signal to its receivers; one that raises is logged, never propagated."""
    if not signal.receivers:  # the common case, checked without building any arguments
        return
    held = monotonic() - handle.acquired_at if handle.acquired_at is not None else None
    responses = signal.send_robust(
        sender=sender,
        key=handle.key,
        name=handle.key if isinstance(handle.key, str) else None,
        using=handle.using,
        scope=handle.scope,
        wait_time=handle.wait_time,
        hold_time=held,
    )
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "A receiver of an advisory_lock signal (%s) raised for lock %s on database "
                "%r: %r. The lock is unaffected.",
                getattr(receiver, "__qualname__", receiver),
                handle.lock_key.label,
                handle.using,
                response,
                exc_info=response,
            )
