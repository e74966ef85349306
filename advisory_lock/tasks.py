"""Unique enqueues: ``enqueue_unique(task, *args, key=None, **kwargs)`` keeps at most one
*pending* task (enqueued, not yet started) per key, fleet-wide, on any ``django.tasks``
backend and on Celery (``advisory_lock.queues``).

A pending task is a row of ``task_pending`` (``PendingTask``) on the ledger's database: the
key's digest (unique), the task's id in its queue, when it was enqueued, when the mark
expires. A call takes an advisory lock named after the key, so that calls for one key run one
at a time fleet-wide; under it, a live mark means "one is pending": its result (the queue's
own handle) is returned and nothing is enqueued; else the task is enqueued and its mark
written, before the lock is let go. The worker clears the mark when it starts the task (the
queues' start signals: ``task_started`` of ``django.tasks``, Celery's ``task_prerun``), after
which a new call enqueues again. A mark whose task never starts (the queue dropped it, the
worker died first) expires after ``pending_timeout`` seconds.

The receivers of the start signals are connected when the app is ready, for the queue
packages the process has already imported (a worker has imported its own), and again at
each call; the app imports none itself.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import sys
from typing import Any

from django.db import connections
from django.db import models
from django.db import router

from advisory_lock.backends import inspector_for
from advisory_lock.locks import advisory_lock
from advisory_lock.queues import queue_for
from advisory_lock.validation import check_seconds

#: The default ``pending_timeout``: a pending mark's life, in seconds.
PENDING_TIMEOUT = 3600.0
#: The signal modules whose start signal clears a pending mark: module, signal, how the
#: receiver finds the task's id in the signal's arguments.
_START_SIGNALS = (
    ("django.tasks.signals", "task_started", "task_result"),
    ("django_tasks.signals", "task_started", "task_result"),
    ("celery.signals", "task_prerun", "task_id"),
)


class PendingTask(models.Model):
    """A task enqueued by ``enqueue_unique`` that no worker has started yet."""

    key_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the key.")
    key = models.TextField(help_text="The uniqueness key (by default the task and its arguments).")
    task_name = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255, db_index=True)
    enqueued_at = models.DateTimeField(help_text="By the database server's clock.")
    expires_at = models.DateTimeField(help_text="By the database server's clock.")

    class Meta:
        db_table = "task_pending"
        verbose_name = "pending task"

    def __str__(self) -> str:
        return f"{self.task_name} {self.task_id} (pending since {self.enqueued_at})"


def enqueue_unique(
    task: Any,
    *args: Any,
    key: str | None = None,
    pending_timeout: float = PENDING_TIMEOUT,
    using: str | None = None,
    **kwargs: Any,
) -> Any:
    """Enqueue ``task(*args, **kwargs)`` unless one of its ``key`` is pending (enqueued, not
    started); return the queue's handle on the one enqueued or pending (a ``TaskResult``, or
    Celery's ``AsyncResult``; for a pending task of a backend that can't read results back,
    its id).

    ``key`` defaults to the task's name and its JSON-encoded arguments. ``using``: the
    database of the marks and of the lock (default: where the router writes ``PendingTask``).
    """
    queue = queue_for(task)
    check_seconds("pending_timeout", pending_timeout)
    connect_start_signals()
    if key is None:
        key = f"{queue.name(task)}:{json.dumps([list(args), kwargs], sort_keys=True)}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    alias = using or router.db_for_write(PendingTask)
    marks = PendingTask.objects.using(alias)
    # One call per key at a time, fleet-wide: the mark is read and written under the lock, and
    # committed before it is let go (in autocommit each statement commits; inside the
    # caller's atomic block the lock is the transaction's, held until its commit).
    with advisory_lock(f"enqueue_unique:{digest}", using=alias):
        now = inspector_for(connections[alias]).database_now()
        pending = marks.filter(key_hash=digest, expires_at__gt=now).first()
        if pending is not None:
            return queue.result(task, pending.task_id)
        result = queue.submit(task, list(args), kwargs)
        marks.update_or_create(
            key_hash=digest,
            defaults={
                "key": key,
                "task_name": queue.name(task)[:255],
                "task_id": str(result.id),
                "enqueued_at": now,
                "expires_at": now + datetime.timedelta(seconds=pending_timeout),
            },
        )
    return result


def task_started(task_id: object) -> None:
    """A worker started the task ``task_id``: it is no longer pending."""
    PendingTask.objects.using(router.db_for_write(PendingTask)).filter(
        task_id=str(task_id)
    ).delete()


def _on_django_task_started(sender: Any, task_result: Any = None, **kwargs: Any) -> None:
    if task_result is not None:
        task_started(task_result.id)


def _on_celery_task_prerun(sender: Any = None, task_id: Any = None, **kwargs: Any) -> None:
    if task_id is not None:
        task_started(task_id)


_RECEIVERS = {"task_result": _on_django_task_started, "task_id": _on_celery_task_prerun}


def connect_start_signals() -> None:
    """Connect the start-signal receivers of the queue packages already imported (once
    each: ``dispatch_uid``)."""
    for module_name, signal_name, argument in _START_SIGNALS:
        package = module_name.rsplit(".", 1)[0]
        if package not in sys.modules:
            continue  # not this process's queue: never imported here
        try:
            signal = getattr(importlib.import_module(module_name), signal_name)
        except (ImportError, AttributeError):
            continue
        signal.connect(
            _RECEIVERS[argument], weak=False, dispatch_uid=f"advisory_lock:{module_name}"
        )
