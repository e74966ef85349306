"""django-advisory-lock: database advisory locks that know about ``transaction.atomic``."""

from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.exceptions import ReplicaError
from advisory_lock.exceptions import SlotAlreadySucceeded
from advisory_lock.holds import LockHandle
from advisory_lock.locks import AdvisoryLock
from advisory_lock.locks import advisory_lock
from advisory_lock.signals import entry_unhealthy
from advisory_lock.signals import job_overdue
from advisory_lock.signals import lock_acquired
from advisory_lock.signals import lock_busy
from advisory_lock.signals import lock_lost
from advisory_lock.signals import lock_released
from advisory_lock.signals import no_scheduler_alive
from advisory_lock.signals import slot_failed
from advisory_lock.signals import slot_missed
from advisory_lock.single_instance import SingleInstanceMixin
from advisory_lock.single_instance import single_instance

#: The distribution's version; pyproject.toml reads it from here (the one place it is set).
__version__ = "0.1.0"

# Imported on first use, not with the package: the ledger and inspection need Django's app
# registry, and the pool reset needs psycopg.
_LAZY = {
    "HeldLock": "advisory_lock.inspection",
    "JobRun": "advisory_lock.models",
    "held_locks": "advisory_lock.inspection",
    "reset_pooled_connection": "advisory_lock.backends.postgresql",
    "run_once": "advisory_lock.once",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'advisory_lock' has no attribute {name!r}")


__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "HeldLock",
    "JobRun",
    "LedgerNotMigrated",
    "LockHandle",
    "LockLost",
    "LockNotAcquired",
    "NotSupportedError",
    "ReplicaError",
    "SingleInstanceMixin",
    "SlotAlreadySucceeded",
    "advisory_lock",
    "entry_unhealthy",
    "held_locks",
    "job_overdue",
    "lock_acquired",
    "lock_busy",
    "lock_lost",
    "lock_released",
    "no_scheduler_alive",
    "reset_pooled_connection",
    "run_once",
    "single_instance",
    "slot_failed",
    "slot_missed",
]
