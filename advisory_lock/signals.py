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
#: The alerts of the scheduler (``advisory_lock.scheduling.alerts``), each sent once per event,
#: in the process that found it, and logged at ERROR with the same values as the record's
#: ``extra``. Arguments: ``using``, ``entry`` (an ``Entry``, None for
#: ``no_scheduler_alive``), ``slot`` (str or None), ``run`` (a ``JobRun`` or None), ``error``
#: (a sentence). ``sender`` is ``advisory_lock.schedule.Entry``.
#: A scheduled slot's run failed (each failed attempt: its job raised, its lock was lost, it
#: passed its timeout or its process died).
slot_failed = Signal()
#: A slot of a scheduled entry fell due and was never started (no scheduler alive, or none
#: in time), found by the scheduler that starts the entry's next slot. More arguments:
#: ``slots``, every slot missed in that gap (newest first, at most 100; ``slot`` is the first).
slot_missed = Signal()
#: The last ``alert_after`` slots of a scheduled entry have all failed (sent when the streak
#: reaches it, not again until a slot succeeds).
entry_unhealthy = Signal()
#: ``run_jobs --check`` or ``job_runs --overdue`` found no scheduler alive (once per check).
no_scheduler_alive = Signal()
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
