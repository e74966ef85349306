"""``enqueue_unique`` with real processes: at most one pending task per key, fleet-wide.

Real queues and workers: django-tasks-db on the run's test database of each alias (SQLite,
PostgreSQL, MariaDB) with its ``db_worker`` processes, and Celery on Redis with a prefork
worker (tests/taskapp/services.py). Events are ordered by rows, files and pipes, never by
sleeps: the tasks write ``<folder>/<their id>`` when they start and run until the test creates
their release file (tests/taskapp/bodies.py), pending marks are rows of ``task_pending``, and
expiry is read on the database's clock. Every wait has a guard against a hang (``GUARD``), not
a timing.

- 32 processes released at once enqueue one task, and all get its id back;
- the mark clears when a worker starts the task (its start signal), and a call enqueues again;
  while it is pending (no worker yet), a call returns it and enqueues nothing;
- a mark whose task never starts expires after ``pending_timeout``;
- the default key tells arguments apart, an explicit ``key`` groups them;
- bad input is refused (TypeError, ValueError) and leaves no lock held;
- regression tests: a task that started before its mark could be cleared (an immediate
  backend, an idle Celery worker) or whose mark the workers don't clear (another database)
  blocks nothing; a project that sets TASKS gets its receiver even if django.tasks is
  imported later; a worker whose database lacks ``task_pending`` still runs its tasks.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import importlib
import json
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import django
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import DatabaseError
from django.db import connections
from django.test import override_settings

from advisory_lock.backends import inspector_for
from advisory_lock.tasks import MAX_KEY_LENGTH
from advisory_lock.tasks import PendingTask
from advisory_lock.tasks import enqueue_unique
from tests.probes import is_free
from tests.processes import Worker
from tests.taskapp.bodies import read_mark
from tests.taskapp.services import REDIS_URL
from tests.taskapp.services import ROOT
from tests.taskapp.services import WorkerProcess
from tests.taskapp.services import ensure_redis
from tests.taskapp.services import forget_redis_keys
from tests.taskapp.services import missing
from tests.taskapp.services import start_celery_worker
from tests.taskapp.services import start_db_worker
from tests.taskapp.services import wait_until
from tests.taskapp.services import worker_env
from tests.test_task_queues import TasksOn

#: How many processes call ``enqueue_unique`` at once.
AT_ONCE = 32
#: A guard against a hang (a worker that never starts a task, a process that never answers):
#: generous for a loaded 2-core machine, never a timing.
GUARD = 300.0


def token() -> str:
    return uuid.uuid4().hex[:12]


def lock_name(key: str) -> str:
    """The advisory lock that ``enqueue_unique`` takes for ``key``."""
    return f"enqueue_unique:{hashlib.sha256(key.encode()).hexdigest()}"


def database_now(using: str) -> datetime.datetime:
    return inspector_for(connections[using]).database_now()


def marks(using: str) -> Any:
    return PendingTask.objects.using(using)


def task_id(result: Any) -> str:
    """The id of what ``enqueue_unique`` returned (a TaskResult, an AsyncResult)."""
    return str(result.id)


# Django Tasks: django-tasks-db, its rows and its db_worker.


@pytest.fixture
def tasks():
    """tests.taskapp.tasks (needs django-tasks-db, and the backport on Django 5.2)."""
    if "django_tasks_db" not in settings.INSTALLED_APPS:
        missing("django-tasks-db (and on Django 5.2 django-tasks) is not installed")
    from tests.taskapp import tasks

    return tasks


@pytest.fixture
def django_queue(using, tasks, tmp_path):
    """A queue of this test's own on django-tasks-db on ``using``: the task on it, its rows,
    the folder where its tasks say they started, their release file; rows removed after."""
    from django_tasks_db.models import DBTaskResult

    name = f"alq-{token()}"
    folder = tmp_path / "started"
    folder.mkdir()
    rows = DBTaskResult.objects.using(using).filter(queue_name=name)
    with override_settings(DATABASE_ROUTERS=[TasksOn(using)]):
        yield SimpleNamespace(
            name=name,
            task=tasks.unique_job.using(queue_name=name),
            rows=rows,
            folder=folder,
            release=tmp_path / "release",
        )
    rows.delete()


def row_ids(rows: Any) -> list[str]:
    return sorted(str(pk) for pk in rows.values_list("id", flat=True))


@contextlib.contextmanager
def db_worker(using: str, queue: str, folder: Path) -> Iterator[WorkerProcess]:
    """One db_worker on ``queue`` (it runs one task at a time)."""
    worker = start_db_worker(f"w-{queue}", using, queue, folder)
    try:
        worker.wait_for("Starting worker", timeout=GUARD)
        yield worker
    finally:
        worker.stop()


def refreshed(result: Any) -> Any:
    result.refresh()
    return result


def succeeded(result: Any, tasks: Any) -> Any:
    """The task's return value, once it has finished; fail with its traceback if it did not
    succeed."""
    wait_until(lambda: refreshed(result).is_finished, timeout=GUARD, what=f"{result.id} to end")
    assert result.status == tasks.TaskResultStatus.SUCCESSFUL, (
        f"{result.status}: {[error.traceback for error in result.errors]}"
    )
    return result.return_value


# Celery on Redis.


@pytest.fixture
def celery_queue(tmp_path):
    """A queue of this test's own on Redis, the Celery app that sends to it and its task; its
    keys removed after."""
    try:
        import celery  # noqa: F401
    except ImportError:
        missing("celery is not installed")
    broker = ensure_redis()
    from tests.taskapp.celery_config import make_app
    from tests.taskapp.celery_config import unique_hold_task

    name = f"advisory-lock-tests-{token()}"
    app = make_app(broker, name)
    folder = tmp_path / "started"
    folder.mkdir()
    try:
        yield SimpleNamespace(
            name=name,
            broker=broker,
            app=app,
            task=unique_hold_task(app),
            folder=folder,
            release=tmp_path / "release",
        )
    finally:
        forget_redis_keys(f"{name}:")
        app.close()


def waiting_messages(queue: str) -> list[str]:
    """The ids of the tasks waiting in ``queue`` on Redis (the app's keys are prefixed with
    ``<queue>:``; a priority other than 0 has a list of its own)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        ids = []
        for name in client.scan_iter(match=f"{queue}:{queue}*", count=1000):
            if client.type(name) == b"list":
                for message in client.lrange(name, 0, -1):
                    ids.append(json.loads(message)["headers"]["id"])
        return sorted(ids)
    finally:
        client.close()


# 32 processes at once.


class Enqueuers(Worker):
    """``python -m tests.taskapp.enqueuers``: one process that forks the callers, talking JSON
    lines (tests/processes.py's reading, with its time bounds)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.taskapp.enqueuers", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )


def at_once(kind: str, env: dict[str, str], queue: str, folder: Path, release: Path) -> list[str]:
    """Fork ``AT_ONCE`` processes, let them all call ``enqueue_unique(task, folder, release)``
    at once; the task ids they got back, one per process."""
    args = ["--count", AT_ONCE, "--kind", kind, "--queue", queue]
    args += ["--folder", folder, "--release", release]
    enqueuers = Enqueuers([str(arg) for arg in args], env)
    try:
        ready: set[int] = set()
        forked: list[int] = []
        while len(ready) < AT_ONCE or not forked:
            message = enqueuers.message(GUARD)
            if message["event"] == "forked":
                forked = message["pids"]
            elif message["event"] == "ready":
                ready.add(message["pid"])
            else:
                raise AssertionError(f"before go: {message}")
        assert ready == set(forked)
        enqueuers.send("go")
        answers = [enqueuers.message(GUARD) for _ in range(AT_ONCE)]
        errors = [answer for answer in answers if answer["event"] != "enqueued"]
        assert errors == [], errors[0].get("traceback")
        assert {answer["pid"] for answer in answers} == ready
        done = enqueuers.expect("done", GUARD)
        assert set(done["statuses"].values()) == {0}
        enqueuers.finish(GUARD)
    finally:
        enqueuers.kill()
    handles = {answer["handle"] for answer in answers}
    assert handles == ({"TaskResult"} if kind == "django" else {"AsyncResult"})
    return [answer["id"] for answer in answers]


def test_32_processes_at_once_enqueue_one_django_task(using, django_queue):
    queue = django_queue
    ids = at_once("django", worker_env(using), queue.name, queue.folder, queue.release)
    assert len(ids) == AT_ONCE
    assert len(set(ids)) == 1
    assert row_ids(queue.rows) == ids[:1]  # one task in the queue: the one they all got
    (mark,) = marks(using).filter(task_id=ids[0])
    assert mark.task_name == "tests.taskapp.tasks.unique_job"
    assert is_free(lock_name(mark.key), using)
    mark.delete()


def test_32_processes_at_once_send_one_celery_task(using, celery_queue):
    queue = celery_queue
    env = worker_env(
        using, ADVISORY_LOCK_TEST_BROKER=queue.broker, ADVISORY_LOCK_TEST_QUEUE=queue.name
    )
    ids = at_once("celery", env, queue.name, queue.folder, queue.release)
    assert len(ids) == AT_ONCE
    assert len(set(ids)) == 1
    assert waiting_messages(queue.name) == ids[:1]  # one message on the broker
    (mark,) = marks(using).filter(task_id=ids[0])
    assert mark.task_name == "advisory_lock_tests.unique_hold"
    assert is_free(lock_name(mark.key), using)
    mark.delete()


# The mark clears when a worker starts the task.


def test_pending_django_task_is_returned_until_the_db_worker_starts_it(using, tasks, django_queue):
    queue = django_queue
    args = (queue.task, str(queue.folder), str(queue.release))
    first = enqueue_unique(*args, using=using)
    again = enqueue_unique(*args, using=using)  # no worker yet: still pending
    assert task_id(again) == task_id(first)
    assert again.status == tasks.TaskResultStatus.READY
    assert row_ids(queue.rows) == [task_id(first)]  # nothing more enqueued
    assert marks(using).filter(task_id=task_id(first)).count() == 1
    try:
        with db_worker(using, queue.name, queue.folder.parent):
            wait_until(
                lambda: read_mark(queue.folder / task_id(first)), GUARD, "the first to start"
            )
            # The worker's task_started receiver ran before the task's body wrote its file.
            assert not marks(using).filter(task_id=task_id(first)).exists()
            second = enqueue_unique(*args, using=using)
            assert task_id(second) != task_id(first)
            assert row_ids(queue.rows) == sorted([task_id(first), task_id(second)])
            # The only worker is busy with the first: the second is pending, and returned.
            third = enqueue_unique(*args, using=using)
            assert task_id(third) == task_id(second)
            assert refreshed(second).status == tasks.TaskResultStatus.READY
            queue.release.touch()
            started = read_mark(queue.folder / task_id(first))
            assert succeeded(first, tasks)["pid"] == started["pid"]
            assert succeeded(second, tasks)
    finally:
        queue.release.touch()
    assert read_mark(queue.folder / task_id(second))
    assert len(row_ids(queue.rows)) == 2
    assert not marks(using).filter(task_id__in=[task_id(first), task_id(second)]).exists()


def test_pending_celery_task_is_returned_until_the_worker_starts_it(using, celery_queue, tmp_path):
    queue = celery_queue
    args = (queue.task, str(queue.folder), str(queue.release))
    first = enqueue_unique(*args, using=using)
    again = enqueue_unique(*args, using=using)
    assert task_id(again) == task_id(first)
    assert type(again).__name__ == "AsyncResult"
    assert waiting_messages(queue.name) == [task_id(first)]
    assert marks(using).filter(task_id=task_id(first)).count() == 1
    # One prefork child: one task at a time.
    worker = start_celery_worker("celery", using, queue.broker, queue.name, tmp_path, 1)
    try:
        worker.wait_for(" ready.", timeout=GUARD)
        wait_until(lambda: read_mark(queue.folder / task_id(first)), GUARD, "the first to start")
        # task_prerun's receiver, in the worker's child, ran before the task's body.
        assert not marks(using).filter(task_id=task_id(first)).exists()
        second = enqueue_unique(*args, using=using)
        assert task_id(second) != task_id(first)
        third = enqueue_unique(*args, using=using)  # the child is busy: the second waits
        assert task_id(third) == task_id(second)
        queue.release.touch()
        assert first.get(timeout=GUARD)["pid"] == read_mark(queue.folder / task_id(first))["pid"]
        assert second.get(timeout=GUARD)
    finally:
        queue.release.touch()
        worker.stop()
    assert read_mark(queue.folder / task_id(second))
    assert not marks(using).filter(task_id__in=[task_id(first), task_id(second)]).exists()


# A mark whose task never starts expires.


def test_pending_mark_expires_after_pending_timeout_by_the_database_clock(
    using, tasks, django_queue
):
    queue = django_queue
    args = (queue.task, str(queue.folder), str(queue.release))
    first = enqueue_unique(*args, pending_timeout=1, using=using)
    mark = marks(using).get(task_id=task_id(first))
    assert mark.expires_at - mark.enqueued_at == datetime.timedelta(seconds=1)
    again = enqueue_unique(*args, pending_timeout=1, using=using)
    if database_now(using) < mark.expires_at:  # the call read the clock before this did
        assert task_id(again) == task_id(first)
    wait_until(lambda: database_now(using) > mark.expires_at, GUARD, "the mark to expire")
    later = enqueue_unique(*args, pending_timeout=1, using=using)
    assert task_id(later) != task_id(first)
    assert task_id(later) not in {task_id(first), task_id(again)}
    ids = {task_id(first), task_id(again), task_id(later)}
    assert row_ids(queue.rows) == sorted(ids)  # what was returned, and nothing else
    # The expired mark was replaced: one per key.
    (replaced,) = marks(using).filter(key_hash=mark.key_hash)
    assert replaced.task_id == task_id(later)
    replaced.delete()


def test_prune_deletes_the_expired_marks_and_keeps_the_live_ones(using, capsys):
    # A key never enqueued again would keep its expired mark for ever: prune deletes it.
    now = database_now(using)
    hour = datetime.timedelta(hours=1)
    rows = {}
    for name, expires_at in [("expired", now - hour), ("live", now + hour)]:
        rows[name] = marks(using).create(
            key_hash=hashlib.sha256(f"prune-{name}-{token()}".encode()).hexdigest(),
            key=f"prune:{name}",
            task_name="tests.prune",
            task_id=str(uuid.uuid4()),
            enqueued_at=now - 2 * hour,
            expires_at=expires_at,
        )
    call_command("job_runs", "--database", using, "--prune", "--older-than", "30")
    assert "Deleted 1 expired enqueue_unique mark(s)." in capsys.readouterr().out
    assert list(marks(using).filter(pk__in=[row.pk for row in rows.values()])) == [rows["live"]]
    rows["live"].delete()


# Keys.


def test_default_key_tells_arguments_apart_and_an_explicit_key_groups_them(
    using, django_queue, tmp_path
):
    queue = django_queue
    task, release = queue.task, str(queue.release)
    a = enqueue_unique(task, str(tmp_path / "a"), release, using=using)
    b = enqueue_unique(task, str(tmp_path / "b"), release, using=using)
    assert task_id(a) != task_id(b)
    assert task_id(enqueue_unique(task, str(tmp_path / "a"), release, using=using)) == task_id(a)
    assert task_id(enqueue_unique(task, str(tmp_path / "b"), release, using=using)) == task_id(b)
    (mark,) = marks(using).filter(task_id=task_id(a))
    expected = json.dumps([[str(tmp_path / "a"), release], {}], sort_keys=True)
    assert mark.key == f"tests.taskapp.tasks.unique_job:{expected}"
    # The same arguments as keywords are another key (the arguments as they were passed).
    c = enqueue_unique(task, folder=str(tmp_path / "a"), release=release, using=using)
    assert task_id(c) not in {task_id(a), task_id(b)}

    key = f"report:{token()}"
    d = enqueue_unique(task, str(tmp_path / "d"), release, key=key, using=using)
    e = enqueue_unique(task, str(tmp_path / "e"), release, key=key, using=using)
    assert task_id(e) == task_id(d)
    assert marks(using).get(task_id=task_id(d)).key == key
    assert row_ids(queue.rows) == sorted(task_id(result) for result in (a, b, c, d))
    marks(using).filter(task_id__in=row_ids(queue.rows)).delete()


# Bad input.


def function(folder: str, release: str) -> None:
    pass


NOT_TASKS = {
    "a function": function,
    "a task's name": "tests.taskapp.tasks.unique_job",
    "None": None,
    "an object": object(),
}


@pytest.mark.parametrize("not_a_task", NOT_TASKS.values(), ids=NOT_TASKS.keys())
def test_what_is_not_a_task_is_a_type_error_that_says_what_a_task_is(
    using, django_queue, not_a_task
):
    key = f"bad-input:{token()}"
    message = r"is not a task: a django\.tasks task .* or a Celery task"
    with pytest.raises(TypeError, match=message):
        enqueue_unique(not_a_task, "folder", "release", key=key, using=using)
    assert not marks(using).filter(key=key).exists()
    assert is_free(lock_name(key), using)


BAD_TIMEOUTS = {
    "negative": -1,
    "zero": 0,
    "NaN": float("nan"),
    "infinite": float("inf"),
    "beyond a century": 1e300,
    "a str": "60",
    "a bool": True,
    "None": None,
}


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS.values(), ids=BAD_TIMEOUTS.keys())
def test_bad_pending_timeout_is_a_value_error_before_anything_is_enqueued(
    using, django_queue, timeout
):
    queue = django_queue
    key = f"bad-input:{token()}"
    with pytest.raises(ValueError, match="pending_timeout must be"):
        enqueue_unique(queue.task, "f", "r", key=key, pending_timeout=timeout, using=using)
    assert row_ids(queue.rows) == []
    assert not marks(using).filter(key=key).exists()
    assert is_free(lock_name(key), using)


BAD_KEYS = {"an empty str": ("", ValueError), "a blank str": ("  ", ValueError)}
BAD_KEYS |= {"an int": (42, TypeError), "bytes": (b"key", TypeError)}


@pytest.mark.parametrize(("key", "error"), BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_bad_key_is_refused_before_anything_is_enqueued(using, django_queue, key, error):
    queue = django_queue
    with pytest.raises(error, match="key must be"):
        enqueue_unique(queue.task, "f", "r", key=key, using=using)
    assert row_ids(queue.rows) == []


class QueueKind(enum.Enum):
    """The queues of these tests, named after their fixture."""

    DJANGO = "django_queue"
    CELERY = "celery_queue"


@pytest.fixture(params=QueueKind, ids=lambda kind: kind.name.lower())
def any_queue(request):
    """The task of ``django_queue`` or of ``celery_queue``, and ``handed()``: the ids of the
    tasks handed to that queue (django-tasks-db's rows, the messages waiting on Redis)."""
    queue = request.getfixturevalue(request.param.value)
    if request.param is QueueKind.DJANGO:
        return SimpleNamespace(task=queue.task, handed=lambda: row_ids(queue.rows))
    return SimpleNamespace(task=queue.task, handed=lambda: waiting_messages(queue.name))


#: How many times a caller tries again after an error.
RETRIES = 3


class Unstorable(enum.Enum):
    """A key that not every database can store, and what its ``ValueError`` says."""

    NUL = ("digest\x00:1", "NUL")
    LONE_SURROGATE = ("digest:\udcff", "lone surrogate")
    TOO_LONG = ("k" * (MAX_KEY_LENGTH + 1), f"the limit is {MAX_KEY_LENGTH}")


@pytest.mark.parametrize("defect", Unstorable, ids=lambda defect: defect.name.lower())
def test_a_key_not_every_database_can_store_is_a_value_error_before_anything_is_enqueued(
    using, any_queue, defect
):
    """Regression test: a NUL in the key enqueued the task, then failed writing its mark on
    PostgreSQL (DataError), one more task at each retry; a lone surrogate was a
    UnicodeEncodeError; a key of any length was taken (a mark beyond the server's packet size
    fails after the enqueue on MariaDB)."""
    key, says = defect.value
    before = marks(using).count()
    for _ in range(RETRIES):
        with pytest.raises(ValueError, match=f"^key .*{re.escape(says)}"):
            enqueue_unique(any_queue.task, "f", "r", key=key, using=using)
    assert any_queue.handed() == []
    assert marks(using).count() == before


def test_a_default_key_too_long_is_a_value_error_that_says_pass_key(using, django_queue):
    """The default key (the task's name and its arguments as JSON) is checked as a key is."""
    queue = django_queue
    with pytest.raises(ValueError, match=f"the limit is {MAX_KEY_LENGTH}. Pass key="):
        enqueue_unique(queue.task, "f" * MAX_KEY_LENGTH, "r", using=using)
    assert row_ids(queue.rows) == []
    result = enqueue_unique(queue.task, "f" * MAX_KEY_LENGTH, "r", key=token(), using=using)
    assert row_ids(queue.rows) == [task_id(result)]
    marks(using).filter(task_id=task_id(result)).delete()


@contextlib.contextmanager
def marks_table_gone_after_the_hand_off(using: str, queue: str) -> Iterator[list[str]]:
    """At the first hand-off of a task of ``queue`` (``task_enqueued``, sent by the backend
    once it has stored the task), rename ``task_pending`` away, as a database would fail
    under the mark's write after the enqueue; rename it back on leaving. Yields the ids of
    the tasks that were handed off with the table gone."""
    package = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
    signal = importlib.import_module(f"{package}.signals").task_enqueued
    gone: list[str] = []

    def rename_away(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.task.queue_name == queue and not gone:
            with connections[using].cursor() as cursor:
                cursor.execute("ALTER TABLE task_pending RENAME TO task_pending_away")
            gone.append(str(task_result.id))

    signal.connect(rename_away, weak=False)
    try:
        yield gone
    finally:
        signal.disconnect(rename_away)
        if gone:
            with connections[using].cursor() as cursor:
                cursor.execute("ALTER TABLE task_pending_away RENAME TO task_pending")


def test_a_failure_after_the_hand_off_leaves_no_second_pending_task(using, django_queue):
    """Regression test: the mark was written after the enqueue, so a write that failed there
    (here: its table is gone) left a task and no mark, and each retry enqueued one more. The
    mark is written before the hand-off and kept: the retries find the key pending (its id
    unknown, so they return None), and enqueue nothing until it expires."""
    queue = django_queue
    key = f"hand-off:{token()}"
    args = (queue.task, str(queue.folder), str(queue.release))
    with marks_table_gone_after_the_hand_off(using, queue.name) as gone:
        with pytest.raises(DatabaseError):
            enqueue_unique(*args, key=key, pending_timeout=600, using=using)
    assert row_ids(queue.rows) == gone  # handed off, then the write failed
    retries = [enqueue_unique(*args, key=key, using=using) for _ in range(RETRIES)]
    assert row_ids(queue.rows) == gone  # no second pending task
    assert retries == [None] * RETRIES
    (mark,) = marks(using).filter(key=key)
    assert mark.task_id == ""
    assert mark.expires_at - mark.enqueued_at == datetime.timedelta(seconds=600)
    assert is_free(lock_name(key), using)
    # Once its mark expires, the key enqueues again.
    marks(using).filter(pk=mark.pk).update(expires_at=mark.enqueued_at)
    later = enqueue_unique(*args, key=key, using=using)
    assert row_ids(queue.rows) == sorted([*gone, task_id(later)])
    marks(using).filter(key=key).delete()


def test_arguments_that_json_cannot_encode_need_a_key(using, django_queue):
    queue = django_queue
    with pytest.raises(TypeError, match="pass key="):
        enqueue_unique(queue.task, {1, 2}, "r", using=using)
    assert row_ids(queue.rows) == []


def test_a_queue_that_refuses_the_task_leaves_no_mark_and_no_lock(using, django_queue):
    """The enqueue fails under the lock (django.tasks wants JSON arguments): the error
    propagates, nothing is marked, the lock is free, and the next call enqueues."""
    queue = django_queue
    key = f"refused:{token()}"
    with pytest.raises((TypeError, ValueError)):
        enqueue_unique(queue.task, {1, 2}, "r", key=key, using=using)
    assert row_ids(queue.rows) == []
    assert not marks(using).filter(key=key).exists()
    assert is_free(lock_name(key), using)
    result = enqueue_unique(queue.task, "f", "r", key=key, using=using)
    assert row_ids(queue.rows) == [task_id(result)]
    marks(using).filter(key=key).delete()


# Regression tests: a task that started before its mark could be cleared.


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_a_task_run_as_it_is_enqueued_leaves_no_pending_mark(using, tasks, tmp_path):
    """Django's ImmediateBackend runs the task inside enqueue(), so its start signal came
    before the mark was written: the mark used to be left, and the next call for an hour
    returned the finished task's id and ran nothing."""
    backend = (
        "django.tasks.backends.immediate.ImmediateBackend"
        if django.VERSION >= (6, 0)
        else "django_tasks.backends.immediate.ImmediateBackend"
    )
    release = tmp_path / "release"
    release.touch()
    with override_settings(TASKS={**settings.TASKS, "immediate": {"BACKEND": backend}}):
        task = tasks.unique_job.using(backend="immediate")
        first = enqueue_unique(task, str(tmp_path), str(release), using=using)
        assert first.status == tasks.TaskResultStatus.SUCCESSFUL
        assert not marks(using).filter(task_id=task_id(first)).exists()
        second = enqueue_unique(task, str(tmp_path), str(release), using=using)
        assert task_id(second) != task_id(first)
        assert second.status == tasks.TaskResultStatus.SUCCESSFUL
    assert read_mark(tmp_path / task_id(first))
    assert read_mark(tmp_path / task_id(second))


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_a_celery_task_run_eagerly_leaves_no_pending_mark(using, celery_queue):
    """task_always_eager: apply_async() runs the task in the caller, whose task_prerun
    receiver clears the mark written just before."""
    queue = celery_queue
    queue.app.conf.task_always_eager = True
    queue.release.touch()
    first = enqueue_unique(queue.task, str(queue.folder), str(queue.release), using=using)
    assert first.successful()
    assert not marks(using).filter(task_id=task_id(first)).exists()
    second = enqueue_unique(queue.task, str(queue.folder), str(queue.release), using=using)
    assert second.successful()
    assert task_id(second) != task_id(first)
    assert read_mark(queue.folder / task_id(first)) and read_mark(queue.folder / task_id(second))
    assert waiting_messages(queue.name) == []


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_mark_the_workers_do_not_clear_is_dropped_once_its_task_has_started(
    using, tasks, django_queue
):
    """The marks on MariaDB (``using="mysql"``), the tasks and their worker on PostgreSQL,
    whose start signal clears marks there: the queue says that the task started, and the
    next call enqueues (it used to return the started task until the mark expired)."""
    if "mysql" not in settings.DATABASES:
        pytest.skip("no server for 'mysql'")
    queue = django_queue
    args = (queue.task, str(queue.folder), str(queue.release))
    first = enqueue_unique(*args, using="mysql")
    try:
        with db_worker(using, queue.name, queue.folder.parent):
            wait_until(
                lambda: read_mark(queue.folder / task_id(first)), GUARD, "the first to start"
            )
            assert marks("mysql").filter(task_id=task_id(first)).exists()  # not cleared
            second = enqueue_unique(*args, using="mysql")
            assert task_id(second) != task_id(first)
            third = enqueue_unique(*args, using="mysql")  # the worker is busy: pending
            assert task_id(third) == task_id(second)
            queue.release.touch()
            assert succeeded(first, tasks) and succeeded(second, tasks)
    finally:
        queue.release.touch()
        marks("mysql").filter(task_id__in=row_ids(queue.rows)).delete()
        connections["mysql"].close()


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_celery_task_started_at_once_by_an_idle_worker_leaves_no_mark(
    using, celery_queue, tmp_path
):
    """An idle worker may start the task as soon as it is sent, before a mark written after
    the send exists: the mark is written first, under the id the task is then sent with, so
    the worker's task_prerun always finds it."""
    queue = celery_queue
    queue.release.touch()  # the tasks end at once
    worker = start_celery_worker("celery", using, queue.broker, queue.name, tmp_path, 1)
    try:
        worker.wait_for(" ready.", timeout=GUARD)
        for attempt in range(20):
            result = enqueue_unique(
                queue.task,
                str(queue.folder),
                str(queue.release),
                key=f"at-once:{attempt}",
                using=using,
            )
            assert result.get(timeout=GUARD)
            assert read_mark(queue.folder / task_id(result))
            assert not marks(using).filter(task_id=task_id(result)).exists(), attempt
    finally:
        worker.stop()


SETS_TASKS = """
import sys, django
from django.conf import settings
package = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    TASKS={"default": {"BACKEND": package + ".backends.immediate.ImmediateBackend"}},
)
imported_before = package in sys.modules
django.setup()
signal = sys.modules[package + ".signals"].task_started
uids = [entry[0][0] for entry in signal.receivers]
print(imported_before, f"advisory_lock:{package}.signals" in uids)
"""


def test_a_project_that_sets_tasks_has_the_receiver_before_it_imports_django_tasks(tasks):
    """A worker may import django.tasks only when it loads its backend, after the app is
    ready: the app connects its receiver when the settings set TASKS (and imports nothing
    when they don't: test_the_library_imports_no_task_queue_package)."""
    done = subprocess.run(
        [sys.executable, "-c", SETS_TASKS],
        cwd=ROOT, capture_output=True, text=True, timeout=GUARD, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_a_worker_whose_database_lacks_the_marks_table_still_runs_its_tasks(
    using, tasks, django_queue
):
    """The start signal's receiver runs in every task's worker: on a database where
    ``migrate`` has not made ``task_pending``, it logs a warning and the task runs (its
    exception used to propagate through the signal and fail every task)."""
    queue = django_queue
    queue.release.touch()
    with connections[using].cursor() as cursor:
        cursor.execute("ALTER TABLE task_pending RENAME TO task_pending_away")
    try:
        with db_worker(using, queue.name, queue.folder.parent) as worker:
            result = queue.task.enqueue(str(queue.folder), str(queue.release))
            assert succeeded(result, tasks)
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute("ALTER TABLE task_pending_away RENAME TO task_pending")
    assert read_mark(queue.folder / task_id(result))
    assert f"could not clear the pending mark of task {task_id(result)}" in worker.output()
