"""The scheduler and what it stands on: ``manage.py run_jobs`` and the control room.

The package's third part, above the locks and the ledger (it imports them, they import
nothing here):

- ``scheduler``: the loop behind ``run_jobs``: due slots, job processes, the sweep;
  ``boundaries``, each entry's due slots, computed once per boundary and ahead; ``claims``,
  which scheduler starts a slot; ``sharing``, how the live schedulers share a boundary's
  slots; ``workers``, the job processes forked once; ``children``, the runs going on in
  them and those whose worker died; ``outages``, how a database outage is ridden out;
- ``control``: operators' pause, resume and run-now requests (``JobControl``);
- ``stored``: the schedule entries stored in the database (``StoredEntry``), and ``admin``,
  their admin pages;
- ``liveness``: the schedulers' heartbeats (``SchedulerHeartbeat``);
- ``notifications``: PostgreSQL's LISTEN/NOTIFY that wakes a scheduler for a request;
- ``timeline``, ``overdue``: what the schedule and the declared jobs expect of the ledger;
- ``pruning``: ``job_runs --prune``, which keeps what those reports still read.

The entries themselves (``advisory_lock.schedule``) are plain declarations below the ledger,
since the declared jobs and the single-instance decorators read them too.
"""
