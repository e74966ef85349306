"""The app's models, where Django looks for them: ``JobRun``, the ``job_runs`` table.

It is defined in ``advisory_lock.ledger`` with the operations on its rows (claims, fenced
ends, abandoned runs), which its queryset and its methods call: one concept, one module.
"""

from advisory_lock.ledger import JobRun
from advisory_lock.ledger import JobRunQuerySet

__all__ = ["JobRun", "JobRunQuerySet"]
