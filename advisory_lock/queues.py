"""Task queues, as the scheduler's task entries and ``enqueue_unique`` use them.

Two kinds of task, told apart by what they have (the app imports no queue package: the
project's tasks bring theirs):

- a ``django.tasks`` task (Django 6.0; the django-tasks backport on 5.2): ``task.enqueue(*args,
  **kwargs)`` returns a ``TaskResult`` whose ``id`` names it; ``task.get_result(id)`` reads it
  back when the task's backend stores results (``supports_get_result``);
- a Celery task: ``task.apply_async(args, kwargs)`` returns an ``AsyncResult`` whose ``id``
  names it; ``task.AsyncResult(id).state`` is the task's state when the app has a result
  backend (``result_backend``) and the task does not ignore its result.
"""

from __future__ import annotations

import datetime
from abc import ABC
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any
from typing import Protocol
from typing import TypeVar

from advisory_lock.datetimes import from_field

UTC = datetime.timezone.utc


class Identified(Protocol):
    """A queue's own handle on a task (a ``TaskResult``, an ``AsyncResult``): its ``id``
    names the task in its queue."""

    @property
    def id(self) -> str: ...


#: The queue's own handle on a task: what ``enqueue()`` / ``apply_async()`` return.
Handle = TypeVar("Handle", bound=Identified, covariant=True)


class DjangoTask(Protocol[Handle]):
    """A ``django.tasks`` task (or the backport's), as ``queue_for`` tells it: ``enqueue()``
    and ``get_result()``, both returning its ``TaskResult``. The arguments are the task's
    own (a ``ParamSpec``, which no signature with keyword-only arguments of its own can
    carry): any arguments here."""

    def enqueue(self, *args: Any, **kwargs: Any) -> Handle: ...

    def get_result(self, result_id: str, /) -> Handle: ...


class CeleryTask(Protocol[Handle]):
    """A Celery task, as ``queue_for`` tells it: ``apply_async()`` and ``AsyncResult()``,
    both returning its ``AsyncResult``."""

    def apply_async(self, *args: Any, **kwargs: Any) -> Handle: ...

    def AsyncResult(self, task_id: str, /) -> Handle: ...


class ResultsNotStored(Exception):
    """The task's queue keeps no results: how its tasks end can't be known."""


@dataclass(frozen=True)
class Outcome:
    """How a task ended: ``succeeded`` or ``failed`` (with the error), and when if known."""

    succeeded: bool
    error: str = ""
    finished_at: datetime.datetime | None = None


class Queue(ABC):
    """What the app does with a task of one kind of queue."""

    @abstractmethod
    def submit(self, task: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Hand ``task(*args, **kwargs)`` to the queue; return the queue's own handle on it
        (a ``TaskResult``, an ``AsyncResult``), whose ``id`` names it."""

    def enqueue(self, task: Any, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Hand ``task(*args, **kwargs)`` to the queue; return the queue's id for it."""
        return str(self.submit(task, args, kwargs).id)

    @abstractmethod
    def outcome(self, task: Any, task_id: str) -> Outcome | None:
        """How the task ``task_id`` ended, or None while it has not (pending, running);
        ``ResultsNotStored`` if its queue can't say."""

    @abstractmethod
    def result(self, task: Any, task_id: str) -> Any:
        """The queue's own handle on the task ``task_id`` (a ``TaskResult``, an
        ``AsyncResult``), or the id itself where the queue can't give one."""

    @abstractmethod
    def name(self, task: Any) -> str:
        """The task's name (its dotted path)."""


class DjangoTasksQueue(Queue):
    """``django.tasks`` (and the django-tasks backport): any backend."""

    def submit(self, task: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        return task.enqueue(*args, **kwargs)

    def outcome(self, task: Any, task_id: str) -> Outcome | None:
        if not task.get_backend().supports_get_result:
            raise ResultsNotStored(f"the backend of {self.name(task)} stores no results")
        result = task.get_result(task_id)
        status = str(result.status)  # TaskResultStatus: READY, RUNNING, FAILED, SUCCESSFUL
        # A django.tasks backend's times follow Django's rule for datetimes (django-tasks-db's
        # are DateTimeFields, the others' timezone.now()): naive in TIME_ZONE with USE_TZ =
        # False, which from_field reads as such.
        finished_at = None if result.finished_at is None else from_field(result.finished_at)
        if status == "SUCCESSFUL":
            return Outcome(True, finished_at=finished_at)
        if status == "FAILED":
            errors = getattr(result, "errors", None) or []
            error = errors[-1].traceback if errors else "The task failed."
            return Outcome(False, error or "The task failed.", finished_at)
        return None

    def result(self, task: Any, task_id: str) -> Any:
        if not task.get_backend().supports_get_result:
            return task_id
        return task.get_result(task_id)

    def name(self, task: Any) -> str:
        return str(task.module_path)


class CeleryQueue(Queue):
    """A Celery task, on any broker; results with the app's result backend."""

    def submit(
        self, task: Any, args: list[Any], kwargs: dict[str, Any], task_id: str | None = None
    ) -> Any:
        """``task_id``: the id to send it under (by default, one Celery chooses)."""
        if task_id is None:
            return task.apply_async(args=args, kwargs=kwargs)
        return task.apply_async(args=args, kwargs=kwargs, task_id=task_id)

    def outcome(self, task: Any, task_id: str) -> Outcome | None:
        conf = task.app.conf
        if not conf.result_backend or task.ignore_result or conf.task_ignore_result:
            raise ResultsNotStored(
                f"{self.name(task)} stores no result (no result_backend, or ignore_result)"
            )
        if str(conf.result_backend).partition(":")[0] == "rpc":
            # rpc:// sends a task's result to the process that sent the task (a slot's job
            # process, gone), as messages that a reader consumes: another process that asks
            # is told PENDING, or takes them from a queue it shares by accident.
            raise ResultsNotStored(
                f"{self.name(task)} sends its results by rpc://, to the process that enqueued "
                f"it only (a result_backend that stores them, e.g. Redis, can be followed)"
            )
        result = task.AsyncResult(task_id)
        state = result.state
        finished_at = result.date_done
        if finished_at is not None and finished_at.tzinfo is None:
            finished_at = finished_at.replace(tzinfo=UTC)  # Celery stores UTC
        if state == "SUCCESS":
            return Outcome(True, finished_at=finished_at)
        if state in ("FAILURE", "REVOKED"):
            error = result.traceback or f"The task ended {state}: {result.result!r}"
            return Outcome(False, error, finished_at)
        return None

    def result(self, task: Any, task_id: str) -> Any:
        return task.AsyncResult(task_id)

    def name(self, task: Any) -> str:
        return str(task.name)


def queue_for(task: object) -> Queue:
    """The queue of ``task``; TypeError if it is neither a ``django.tasks`` nor a Celery
    task."""
    if callable(getattr(task, "enqueue", None)) and callable(getattr(task, "get_result", None)):
        return DjangoTasksQueue()
    if callable(getattr(task, "apply_async", None)) and callable(
        getattr(task, "AsyncResult", None)
    ):
        return CeleryQueue()
    raise TypeError(
        f"{task!r} is not a task: a django.tasks task (with enqueue()) or a Celery task (with "
        f"apply_async())."
    )
