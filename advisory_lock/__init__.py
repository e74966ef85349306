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

__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "LockHandle",
    "LockLost",
    "LockNotAcquired",
    "NotSupportedError",
    "SingleInstanceMixin",
    "advisory_lock",
    "single_instance",
]
