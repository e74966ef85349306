"""The Celery app and tasks that the task entries of tests/test_schedule_tasks.py enqueue:
``python -m celery -A tests.taskapp.schedule_celery worker`` runs them; the schedulers import
them by their dotted paths.

Configured from the environment that the test sets for both: ADVISORY_LOCK_TEST_BROKER and
ADVISORY_LOCK_TEST_QUEUE (as tests/taskapp/celery_worker.py), and ADVISORY_LOCK_TEST_RESULTS:
where results go, a Redis URL (under the queue's key prefix, as on the Redis broker) or
"broker" for the app's own choice (tests/taskapp/celery_config.py: Redis, or rpc:// on
RabbitMQ). Defaults let the module be imported anywhere (the system checks of the test).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tests.taskapp.celery_config import make_app
from tests.taskapp.schedule_bodies import fails
from tests.taskapp.schedule_bodies import hold_if
from tests.taskapp.schedule_bodies import record_execution

BROKER = os.environ.get("ADVISORY_LOCK_TEST_BROKER", "memory://")
QUEUE = os.environ.get("ADVISORY_LOCK_TEST_QUEUE", "advisory-lock-tests")
RESULTS = os.environ.get("ADVISORY_LOCK_TEST_RESULTS", "broker")
#: A killed worker's unacknowledged task goes back to the Redis queue after this many seconds
#: (the other worker looks every second); RabbitMQ gives it back when the worker's connection
#: closes.
VISIBILITY_TIMEOUT = 5

app = make_app(BROKER, QUEUE)
if BROKER.startswith("redis://"):
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if RESULTS.startswith("redis://"):
    app.conf.result_backend = RESULTS
    app.conf.result_backend_transport_options = {"global_keyprefix": f"{QUEUE}:"}

if os.environ.get("ADVISORY_LOCK_TEST_WORKER"):
    # In a scheduler: the library's INFO lines on stderr, where the test reads them.
    logging.getLogger("advisory_lock").setLevel(logging.INFO)


@app.task(bind=True, name="advisory_lock_tests.scheduled.record")
def record(self: Any, folder: str, fail_one_in: int = 0, hold_on: str = "") -> str:
    """Record this execution in ``folder`` (the task's id, the worker), run until killed on
    the worker ``hold_on``, then fail if the id says so (one task in ``fail_one_in``)."""
    task_id = str(self.request.id)
    worker = str(self.request.hostname)
    record_execution(folder, task_id, worker=worker, pid=os.getpid())
    hold_if(worker, hold_on)
    if fails(task_id, fail_one_in):
        raise RuntimeError(f"task {task_id} fails on purpose")
    return task_id


@app.task(bind=True, name="advisory_lock_tests.scheduled.unrecorded", ignore_result=True)
def unrecorded(self: Any, folder: str) -> None:
    """Record this execution in ``folder``; its result is stored nowhere (ignore_result)."""
    record_execution(folder, str(self.request.id), worker=self.request.hostname)
