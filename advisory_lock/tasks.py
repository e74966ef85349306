"""Unique enqueues: ``enqueue_unique(task, *args, key=None, **kwargs)`` keeps at most one
*pending* task (enqueued, not yet started) per key, fleet-wide, on any ``django.tasks``
backend and on Celery (``advisory_lock.queues``).

A pending task is a row of ``task_pending`` (``PendingTask``) on the ledger's database: the
key's digest (unique), the task's id in its queue, when it was enqueued, when the mark
expires. A call takes an advisory lock named after the key, so that calls for one key run one
at a time fleet-wide; under it, a live mark means "one is pending": its result (the queue's
own handle) is returned and nothing is enqueued; else the mark is written, the task enqueued
and its id recorded in the mark, before the lock is let go. The worker clears the mark when it
starts the task (the queues' start signals: ``task_started`` of ``django.tasks``, Celery's
``task_prerun``), after which a new call enqueues again. A mark whose task never starts (the
queue dropped it, the worker died first) expires after ``pending_timeout`` seconds.

The mark comes before the hand-off because a queue can't take a task back: a failure after it
(the database, the process) must not leave a task without its mark, which the next call would
take for "none pending". A Celery task is sent under an id chosen here; a django.tasks task
gets its id from its backend, so its mark has none ("") until ``enqueue()`` returns, and one
that never gets it counts as pending, with no handle (``None``), until it expires.

A worker may start the task before its id is in its mark (a django.tasks task is only known
by its id once enqueued; the caller's transaction may not have committed the mark): so a task
that has already run when ``enqueue()`` returns (an immediate backend) has its mark deleted,
and a live mark is checked with the queue when the queue can say (it stores results): a task
that started, ended or is gone no longer counts as pending.

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
from typing import overload

import django
from django.conf import settings
from django.db import connections
from django.db import models
from django.db import router
from django.db import transaction

from advisory_lock.backends import inspector_for
from advisory_lock.conf import require_app
from advisory_lock.datetimes import to_field
from advisory_lock.locks import advisory_lock
from advisory_lock.queues import CeleryQueue
from advisory_lock.queues import CeleryTask
from advisory_lock.queues import DjangoTask
from advisory_lock.queues import DjangoTasksQueue
from advisory_lock.queues import Handle
from advisory_lock.queues import Queue
from advisory_lock.queues import queue_for
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_seconds
from advisory_lock.validation import check_text

logger = logging.getLogger("advisory_lock")

#: The default ``pending_timeout``: a pending mark's life, in seconds.
PENDING_TIMEOUT = 3600.0
#: The longest key, in characters. A key names a task, it is no payload: it is stored whole
#: in its mark, and at 4 bytes a character at most this stays far below the largest statement
#: each server takes by default (MariaDB's ``max_allowed_packet``, 16 MiB), so the same keys
#: are taken on every database.
MAX_KEY_LENGTH = 10_000
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


@overload
def enqueue_unique(
    task: DjangoTask[Handle],
    *args: object,
    key: str | None = None,
    pending_timeout: float = PENDING_TIMEOUT,
    using: str | None = None,
    **kwargs: object,
) -> Handle | str | None: ...


@overload
def enqueue_unique(
    task: CeleryTask[Handle],
    *args: object,
    key: str | None = None,
    pending_timeout: float = PENDING_TIMEOUT,
    using: str | None = None,
    **kwargs: object,
) -> Handle: ...


def enqueue_unique(
    task: DjangoTask[Handle] | CeleryTask[Handle],
    *args: object,
    key: str | None = None,
    pending_timeout: float = PENDING_TIMEOUT,
    using: str | None = None,
    **kwargs: object,
) -> Handle | str | None:
    """Enqueue ``task(*args, **kwargs)`` unless one of its ``key`` is pending (enqueued, not
    started); return the queue's handle on the one enqueued or pending (a ``TaskResult``, or
    Celery's ``AsyncResult``; for a pending task of a backend that can't read results back,
    its id; ``None`` for a pending ``django.tasks`` task whose id was never recorded, the
    database having failed after it was enqueued).

    ``key`` defaults to the task's name and its JSON-encoded arguments. ``pending_timeout``:
    seconds after which a mark whose task never started no longer counts (> 0, at most a
    century). ``using``: the database of the marks and of the lock (default: where the router
    writes ``PendingTask``; the workers clear marks there). ``TypeError`` for what is not a
    task, a key that is not a str, or arguments that JSON can't encode without a ``key``;
    ``ValueError`` for a bad ``pending_timeout``, or a key that is blank, longer than
    ``MAX_KEY_LENGTH`` or not storable (NUL, a lone surrogate): before anything is taken.
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
        # The server's clock is aware; the fields take what Django stores (to_field: naive
        # in TIME_ZONE with USE_TZ = False, which SQLite's and MySQL's backends require).
        pending = marks.filter(key_hash=digest, expires_at__gt=to_field(now)).first()
        if pending is not None:
            if not pending.task_id:
                # Handed to its queue, its id never recorded: pending until it expires.
                return None
            handle: Handle | str | None = _pending_handle(queue, task, pending.task_id)
            if handle is not None:
                return handle
            # The queue says it started, ended or is gone: its mark was not cleared (the
            # worker started it before the mark was visible, or clears marks elsewhere).
        # The mark is written before the hand-off and kept whatever fails after it: the
        # queue can't take a task back (a sent message, a row of another database), so a
        # task without a mark would let the next call enqueue a second one. A Celery task is
        # sent under an id chosen here; a django.tasks task gets its id from its backend, so
        # its mark says "" (not known yet) until enqueue() returns.
        task_id = str(uuid.uuid4()) if isinstance(queue, CeleryQueue) else ""
        marks.update_or_create(
            key_hash=digest,
            defaults={
                "key": key,
                "task_name": queue.name(task)[:255],
                "task_id": task_id,
                "enqueued_at": to_field(now),
                "expires_at": to_field(now + datetime.timedelta(seconds=timeout)),
            },
        )
        result: Handle
        try:
            if isinstance(queue, CeleryQueue):
                result = queue.submit(task, list(args), kwargs, task_id=task_id)
            else:
                result = queue.submit(task, list(args), kwargs)
        except BaseException:
            # The queue refused the task (it raised before returning a handle on it): the
            # next call must be free to enqueue.
            marks.filter(key_hash=digest, task_id=task_id).delete()
            raise
        # Handed off. A failure from here leaves the mark: at worst the key waits for
        # pending_timeout, never two of its tasks pending.
        if isinstance(queue, CeleryQueue):
            # Marked under its id already: a worker that started it at once (or apply_async
            # itself, under task_always_eager) found the mark and cleared it.
            return result
        if _has_started(result):
            # Run by enqueue() itself (an immediate backend): it is not pending.
            marks.filter(key_hash=digest).delete()
        else:
            marks.filter(key_hash=digest, task_id="").update(task_id=str(result.id))
    return result


def _key(
    queue: Queue,
    task: object,
    key: object,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> str:
    """The uniqueness key: ``key``, or the task's name and its JSON-encoded arguments;
    ``ValueError`` for one that not every database can store."""
    if key is None:
        try:
            arguments = json.dumps([list(args), kwargs], sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"enqueue_unique's default key is the task's name and its arguments encoded "
                f"as JSON, which failed ({exc}): pass key=."
            ) from exc
        name = "the default key (the task's name and its arguments as JSON)"
        try:
            return _storable(name, f"{queue.name(task)}:{arguments}")
        except ValueError as error:
            raise ValueError(f"{error} Pass key=.") from None
    if not isinstance(key, str):
        raise TypeError(f"key must be a str or None, not {key!r}.")
    if not key.strip():
        raise ValueError(f"key must be a non-blank str, not {key!r}.")
    return _storable("key", key)


def _storable(name: str, key: str) -> str:
    """``key`` if it is at most ``MAX_KEY_LENGTH`` characters and every database can store it
    (``check_text``: no NUL, no lone surrogate); ``ValueError`` naming ``name`` otherwise."""
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"{name} {key[:40]!r}... is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}."
        )
    return check_text(name, key)


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
