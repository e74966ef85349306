"""The Django Tasks that the task entries of tests/test_schedule_tasks.py enqueue: run by
django-tasks-db's ``db_worker`` processes on the pytest run's test database of each alias.

A task entry names a task by its dotted path, so the queue can't be chosen per call: it is
read from ADVISORY_LOCK_TEST_QUEUE when the module is imported (the schedulers and workers of
one test share it; "default" elsewhere).
"""

from __future__ import annotations

import logging
import os
import time

from tests.taskapp.schedule_bodies import fails
from tests.taskapp.schedule_bodies import hold_if
from tests.taskapp.schedule_bodies import record_execution

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task

QUEUE = os.environ.get("ADVISORY_LOCK_TEST_QUEUE", "default")

if os.environ.get("ADVISORY_LOCK_TEST_WORKER"):
    # In a scheduler or a worker: the library's INFO lines on stderr, where the test reads
    # them. Imported by the system checks, after Django's logging is configured.
    logging.getLogger("advisory_lock").setLevel(logging.INFO)


@task(queue_name=QUEUE, takes_context=True)
def record(
    context, folder: str, fail_one_in: int = 0, work: float = 0.0, hold_on: str = ""
) -> str:
    """Record this execution in ``folder`` (the task's id, the worker's id), work for
    ``work`` seconds (on the worker ``hold_on``: until it is killed), then fail if the id
    says so (one task in ``fail_one_in``)."""
    task_id = str(context.task_result.id)
    worker = context.task_result.worker_ids[-1]
    record_execution(folder, task_id, worker=worker, pid=os.getpid())
    hold_if(worker, hold_on)
    time.sleep(work)
    if fails(task_id, fail_one_in):
        raise RuntimeError(f"task {task_id} fails on purpose")
    return task_id


def not_a_task(folder: str) -> None:
    """A plain function: not a task (the system check refuses it as a task entry's)."""
