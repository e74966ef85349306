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

A worker may start the task before its mark is visible (a django.tasks task is only known by
its id once enqueued; the caller's transaction may not have committed the mark): so a Celery
task's mark is written first, under an id chosen here; a task that has already run when
``enqueue()`` returns (an immediate backend) is not marked; and a live mark is checked with
the queue when the queue can say (it stores results): a task that started, ended or is gone
no longer counts as pending.

The receivers of the start signals are connected when the app is ready, for the queue
packages the process has already imported (a worker has imported its own) and for
``django.tasks`` when the project sets ``TASKS``, and again at each call; the app imports no
queue package the project does not use.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib
import json
import logging
import sys
import uuid
from importlib.util import find_spec
from typing import Any

import django
from django.conf import settings
from django.db import connections
from django.db import models
from django.db import router
from django.db import transaction

from advisory_lock.backends import inspector_for
from advisory_lock.conf import require_app
from advisory_lock.locks import advisory_lock
from advisory_lock.queues import CeleryQueue
from advisory_lock.queues import DjangoTasksQueue
from advisory_lock.queues import Queue
from advisory_lock.queues import queue_for
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_seconds

logger = logging.getLogger("advisory_lock")

#: The default ``pending_timeout``: a pending mark's life, in seconds.
PENDING_TIMEOUT = 3600.0
#: The signal modules whose start signal clears a pending mark: module, signal, how the
#: receiver finds the task's id in the signal's arguments.
_START_SIGNALS = (
    ("django.tasks.signals", "task_started", "task_result"),
    ("django_tasks.signals", "task_started", "task_result"),
    ("celery.signals", "task_prerun", "task_id"),
)


# Django defines a model of an installed app only: without the app, say what to do.
require_app()


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

    ``key`` defaults to the task's name and its JSON-encoded arguments. ``pending_timeout``:
    seconds after which a mark whose task never started no longer counts (> 0, at most a
    century). ``using``: the database of the marks and of the lock (default: where the router
    writes ``PendingTask``; the workers clear marks there). ``TypeError`` for what is not a
    task, a key that is not a str, or arguments that JSON can't encode without a ``key``;
    ``ValueError`` for a bad ``pending_timeout`` or a blank key: before anything is taken.
    """
    queue = queue_for(task)
    timeout = check_seconds(
        "pending_timeout", pending_timeout, allow_zero=False, maximum=MAX_SECONDS
    )
    key = _key(queue, task, key, args, kwargs)
    alias = check_alias(using) if using is not None else router.db_for_write(PendingTask)
    connect_start_signals()
    digest = hashlib.sha256(key.encode()).hexdigest()
    marks = PendingTask.objects.using(alias)
    # One call per key at a time, fleet-wide: the mark is read and written under the lock, and
    # committed before it is let go (in autocommit each statement commits; inside the
    # caller's atomic block the lock is the transaction's, held until its commit).
    with advisory_lock(f"enqueue_unique:{digest}", using=alias):
        now = inspector_for(connections[alias]).database_now()
        pending = marks.filter(key_hash=digest, expires_at__gt=now).first()
        if pending is not None:
            handle = _pending_handle(queue, task, pending.task_id)
            if handle is not None:
                return handle
            # The queue says it started, ended or is gone: its mark was not cleared (the
            # worker started it before the mark was visible, or clears marks elsewhere).

        def mark(task_id: str) -> None:
            marks.update_or_create(
                key_hash=digest,
                defaults={
                    "key": key,
                    "task_name": queue.name(task)[:255],
                    "task_id": task_id,
                    "enqueued_at": now,
                    "expires_at": now + datetime.timedelta(seconds=timeout),
                },
            )

        if isinstance(queue, CeleryQueue):
            # The mark first, under the id the task will have: a worker that starts it at
            # once finds the mark to clear.
            task_id = str(uuid.uuid4())
            mark(task_id)
            try:
                return task.apply_async(args=list(args), kwargs=kwargs, task_id=task_id)
            except BaseException:
                marks.filter(key_hash=digest, task_id=task_id).delete()
                raise
        result = queue.submit(task, list(args), kwargs)
        if _has_started(result):
            # Run by enqueue() itself (an immediate backend): it is not pending.
            marks.filter(key_hash=digest).delete()
        else:
            mark(str(result.id))
    return result


def _key(
    queue: Queue, task: Any, key: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The uniqueness key: ``key``, or the task's name and its JSON-encoded arguments."""
    if key is None:
        try:
            arguments = json.dumps([list(args), kwargs], sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"enqueue_unique's default key is the task's name and its arguments encoded "
                f"as JSON, which failed ({exc}): pass key=."
            ) from exc
        return f"{queue.name(task)}:{arguments}"
    if not isinstance(key, str):
        raise TypeError(f"key must be a str or None, not {key!r}.")
    if not key.strip():
        raise ValueError(f"key must be a non-blank str, not {key!r}.")
    return key


def _has_started(result: Any) -> bool:
    """Whether a django.tasks result is past READY (started, or already ended)."""
    status = getattr(result, "status", None)
    return status is not None and str(status) != "READY"


def _pending_handle(queue: Queue, task: Any, task_id: str) -> Any | None:
    """The queue's handle on the marked task ``task_id`` while it may still be pending; None
    when the queue says it started, ended, or no longer has it. A queue that stores no
    results can't say: the mark stands."""
    if isinstance(queue, DjangoTasksQueue):
        if not task.get_backend().supports_get_result:
            return task_id
        try:
            result = task.get_result(task_id)
        except Exception as exc:
            if any(cls.__name__ == "TaskResultDoesNotExist" for cls in type(exc).__mro__):
                return None  # gone (its rows pruned): nothing is pending
            raise
        return None if _has_started(result) else result
    if isinstance(queue, CeleryQueue):
        result = task.AsyncResult(task_id)
        conf = task.app.conf
        stored = conf.result_backend and not (task.ignore_result or conf.task_ignore_result)
        # rpc:// stores nothing: its results are messages to the process that sent the task,
        # which reading the state here could consume (forked processes share the queue).
        stored = stored and str(conf.result_backend).partition(":")[0] != "rpc"
        # PENDING: unknown to the backend, so not started (or started without
        # task_track_started and still running); any other state: it started.
        return None if stored and result.state != "PENDING" else result
    return queue.result(task, task_id)


def task_started(task_id: object) -> None:
    """A worker started the task ``task_id``: it is no longer pending. Never raises: a mark
    that can't be cleared (the table is missing on this worker's database, the database is
    down) must not fail the task; it expires, or the next call finds the task started."""
    try:
        alias = router.db_for_write(PendingTask)
        in_block = connections[alias].in_atomic_block
        with transaction.atomic(using=alias) if in_block else contextlib.nullcontext():
            PendingTask.objects.using(alias).filter(task_id=str(task_id)).delete()
    except Exception:
        logger.warning(
            "enqueue_unique: could not clear the pending mark of task %s", task_id, exc_info=True
        )


def _on_django_task_started(sender: Any, task_result: Any = None, **kwargs: Any) -> None:
    if task_result is not None:
        task_started(task_result.id)


def _on_celery_task_prerun(sender: Any = None, task_id: Any = None, **kwargs: Any) -> None:
    if task_id is not None:
        task_started(task_id)


_RECEIVERS = {"task_result": _on_django_task_started, "task_id": _on_celery_task_prerun}
#: The signal modules whose receiver is connected in this process.
_connected: set[str] = set()


def connect_start_signals() -> None:
    """Connect the start-signal receivers of the queue packages already imported (once
    each: ``dispatch_uid``), and of ``django.tasks`` (or the django-tasks backport) when the
    project sets ``TASKS``: a worker that imports it only after the app is ready (its backend
    loaded on first use) still clears marks."""
    tasks_package = _tasks_package()
    for module_name, signal_name, argument in _START_SIGNALS:
        package = module_name.rsplit(".", 1)[0]
        if module_name in _connected:
            continue  # connect() would find it there, but clears the signal's cache
        if package not in sys.modules and package != tasks_package:
            continue  # not this process's queue: never imported here
        try:
            signal = getattr(importlib.import_module(module_name), signal_name)
        except (ImportError, AttributeError):
            continue
        signal.connect(
            _RECEIVERS[argument], weak=False, dispatch_uid=f"advisory_lock:{module_name}"
        )
        _connected.add(module_name)


def _tasks_package() -> str | None:
    """The package of ``django.tasks`` when the project's settings set ``TASKS``: Django's
    own (6.0) or the backport's."""
    if not settings.configured or not settings.is_overridden("TASKS"):  # type: ignore[misc]
        return None
    if django.VERSION >= (6, 0):
        return "django.tasks"
    return "django_tasks" if find_spec("django_tasks") else None
