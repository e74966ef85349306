"""Signals for metrics and alerting; each is sent with the lock's key and timings.

Arguments: ``key`` (as given), ``name`` (its registered name, else the key's text),
``using``, ``scope`` ("session" or "transaction"), ``wait_time`` (seconds waited) and, where it
applies, ``hold_time`` (seconds held). ``sender`` is the ``AdvisoryLock`` (or, for commands and
the ledger, the ``DedicatedLock``).
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
