"""Django Tasks run by the ``db_worker`` processes of tests/test_task_queues.py.

``django.tasks`` on Django 6.0, the django-tasks backport on 5.2; the worker is
django-tasks-db's ``db_worker`` command on the pytest run's test database (see
tests/settings.py). Each key carries the test's ``run`` token: server-wide lock names never
collide with another test or another run.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from advisory_lock import single_instance
from tests.taskapp import bodies

try:
    from django.tasks import TaskResultStatus
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus
    from django_tasks import task

__all__ = ["ONCE_JOB_LABEL", "TaskResultStatus", "hold_job", "once_job", "unique_job"]

#: The ledger's job name of ``once_job``: ``<module>.<qualname>`` of the function.
ONCE_JOB_LABEL = "tests.taskapp.tasks.once_job"

if os.environ.get("ADVISORY_LOCK_TEST_WORKER"):
    # In the worker: the library's INFO lines (the busy line names the holder) on stderr,
    # where the test reads them. Imported when the first task runs, after Django's logging.
    logging.getLogger("advisory_lock").setLevel(logging.INFO)


@task()
@single_instance(key=lambda run, started, release: f"queue-test:{run}")
def hold_job(run: str, started: str, release: str) -> dict[str, Any]:
    """Hold the run's lock until the test creates ``release``."""
    return bodies.hold(started, release)


@task()
@single_instance(key=lambda run: f"queue-test:{run}", ledger="once")
def once_job(run: str) -> dict[str, Any]:
    """Work for a moment (long enough for other calls to find the lock busy), once ever."""
    time.sleep(0.3)
    return {"pid": os.getpid()}


@task(takes_context=True)
def unique_job(context: Any, folder: str, release: str) -> dict[str, Any]:
    """The task of tests/test_enqueue_unique.py: say that it started in ``folder/<its id>``
    (its pid and time), then run until ``release`` exists. No lock of its own."""
    return bodies.hold(os.path.join(folder, str(context.task_result.id)), release)
