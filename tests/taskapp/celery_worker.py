"""The Celery worker processes of tests/test_task_queues.py:
``python -m celery -A tests.taskapp.celery_worker worker``.

Configured from the environment that the test sets: ADVISORY_LOCK_TEST_BROKER,
ADVISORY_LOCK_TEST_QUEUE, DJANGO_SETTINGS_MODULE=tests.settings, ADVISORY_LOCK_TEST_WORKER=1
and ADVISORY_LOCK_TEST_DEFAULT (the database alias it uses as "default"). Celery's Django
fix-up sets Django up when the worker starts, as in any Django project.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import current_task
from celery.signals import worker_process_init

from advisory_lock import LockNotAcquired
from advisory_lock import single_instance
from tests.taskapp import bodies
from tests.taskapp.celery_config import make_app
from tests.taskapp.celery_config import unique_hold_task

app = make_app(os.environ["ADVISORY_LOCK_TEST_BROKER"], os.environ["ADVISORY_LOCK_TEST_QUEUE"])
#: The task of tests/test_enqueue_unique.py.
unique_hold = unique_hold_task(app)


@worker_process_init.connect
def log_busy_lines(**kwargs: Any) -> None:
    """The library's INFO lines (the busy line names the holder) on the worker's stderr."""
    logging.getLogger("advisory_lock").setLevel(logging.INFO)


@app.task(name="advisory_lock_tests.hold")
@single_instance(key=lambda run, started, release: f"queue-test:{run}")
def hold(run: str, started: str, release: str) -> dict[str, Any]:
    """Hold the run's lock until the test creates ``release``; None when the lock is busy."""
    return bodies.hold(started, release)


@app.task(
    name="advisory_lock_tests.hold_or_retry",
    autoretry_for=(LockNotAcquired,),
    max_retries=200,
    default_retry_delay=0.05,
)
@single_instance(key=lambda run, started, release: f"queue-test:{run}", on_busy="raise")
def hold_or_retry(run: str, started: str, release: str) -> dict[str, Any]:
    """As ``hold``, but a busy lock raises LockNotAcquired, which Celery retries."""
    return {**bodies.hold(started, release), "retries": current_task.request.retries}
