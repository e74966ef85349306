"""django-advisory-lock: database advisory locks that know about ``transaction.atomic``."""

from advisory_lock.commands import SingleInstanceMixin
from advisory_lock.commands import single_instance
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.locks import AdvisoryLock
from advisory_lock.locks import LockHandle
from advisory_lock.locks import advisory_lock

# The ledger needs Django's app registry: import it on first use, not with the package.
_LAZY = {"JobRun": "advisory_lock.models", "run_once": "advisory_lock.ledger"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'advisory_lock' has no attribute {name!r}")


__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "JobRun",
    "LockHandle",
    "LockLost",
    "LockNotAcquired",
    "NotSupportedError",
    "SingleInstanceMixin",
    "advisory_lock",
    "run_once",
    "single_instance",
]
