"""The Celery app of tests/test_task_queues.py: the same configuration in the test (which
sends tasks by name) and in the worker processes (which run them, see ``celery_worker``).

Everything this run puts on a broker is under its own name: the queue, and on Redis a key
prefix for every key (queue, unacked messages, results), removed at the end of the test.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu import Queue

from tests.taskapp import bodies

#: A queue left behind on RabbitMQ (a killed test) goes away after 10 minutes unused.
QUEUE_EXPIRES_MS = 600_000
#: The name of ``unique_hold_task``'s task.
UNIQUE_HOLD = "advisory_lock_tests.unique_hold"


def make_app(broker: str, queue: str) -> Celery:
    """An app whose tasks go to ``queue`` on ``broker`` (``redis://`` or ``amqp://``)."""
    app = Celery("advisory_lock_tests", set_as_current=False)
    redis = broker.startswith("redis://")
    options = {"global_keyprefix": f"{queue}:"} if redis else {}
    app.conf.update(
        broker_url=broker,
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        result_backend=broker if redis else "rpc://",
        result_backend_transport_options=options,
        result_expires=600,
        task_default_queue=queue,
        task_queues=[Queue(queue, queue_arguments={"x-expires": QUEUE_EXPIRES_MS})],
        # One task at a time per child, acknowledged when it ends: a second task goes to the
        # other child, never behind a running one, and a killed child's task is not lost
        # silently (it fails with WorkerLostError).
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        # No broadcast traffic: nothing of this run reaches another run's workers.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
    )
    return app


def unique_hold_task(app: Celery) -> Any:
    """The task of tests/test_enqueue_unique.py on ``app`` (the worker's, or the test's, which
    needs the task object itself to call ``enqueue_unique``): say that it started in
    ``folder/<its id>`` (its pid and time), then run until ``release`` exists."""

    @app.task(name=UNIQUE_HOLD, bind=True, shared=False)
    def unique_hold(self: Any, folder: str, release: str) -> dict[str, Any]:
        return bodies.hold(os.path.join(folder, str(self.request.id)), release)

    return unique_hold
