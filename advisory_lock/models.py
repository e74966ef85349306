"""The app's models, where Django looks for them.

Each is defined in the module of its concept, with the operations on its rows: ``JobRun``
(the ``job_runs`` ledger) in ``advisory_lock.ledger``, ``JobControl`` (operators' pause,
resume and run-now requests, ``job_controls``) in ``advisory_lock.scheduling.control``,
``SchedulerHeartbeat`` (``job_schedulers``) in ``advisory_lock.scheduling.liveness``,
``StoredEntry`` (``job_schedule_entries``, schedule entries added at run time) in
``advisory_lock.scheduling.stored``,
``PendingTask`` (``task_pending``, the marks of ``enqueue_unique``) in ``advisory_lock.tasks``,
``LockFence`` (``lock_fences``, the fencing tokens of ``advisory_lock(fencing=True)``) in
``advisory_lock.fencing``, ``EntrySeen`` (``job_entries_seen``, when a scheduler first
loaded each scheduled entry) in ``advisory_lock.scheduling.first_seen``, and ``LockName`` and
``LockClient`` (``lock_names``, ``lock_clients``: who holds what, as the holders tell it) in
``advisory_lock.lock_names``.
"""

from advisory_lock.fencing import LockFence
from advisory_lock.ledger import JobRun
from advisory_lock.ledger import JobRunQuerySet
from advisory_lock.lock_names import LockClient
from advisory_lock.lock_names import LockName
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.first_seen import EntrySeen
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from advisory_lock.scheduling.stored import StoredEntry
from advisory_lock.tasks import PendingTask

__all__ = [
    "EntrySeen",
    "JobControl",
    "JobRun",
    "JobRunQuerySet",
    "LockClient",
    "LockFence",
    "LockName",
    "PendingTask",
    "SchedulerHeartbeat",
    "StoredEntry",
]
