"""Signals for metrics and alerting; each is sent with the lock's key and timings.

Arguments: ``key`` (as given), ``name`` (the key when it is a string, else None), ``using``,
``scope`` ("session" or "transaction"), ``wait_time`` (seconds spent taking the lock) and
``hold_time`` (seconds held so far; None when it was not taken). ``sender`` is the
``AdvisoryLock``. They are sent with ``send_robust`` once the hold is recorded: a receiver
that raises is logged and never affects the lock or the caller.
"""

from django.dispatch import Signal

#: A lock was taken.
lock_acquired = Signal()
#: A lock was released (for a transaction-scoped lock: when its transaction ended).
lock_released = Signal()
#: A lock was busy: a try failed, or a bounded wait ran out.
lock_busy = Signal()
#: A held lock was found lost (its connection closed or killed, or a pooler moved it).
lock_lost = Signal()
