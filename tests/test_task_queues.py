"""``@single_instance`` under task queues, with real workers: Django Tasks (django-tasks-db's
``db_worker`` processes) and Celery (a prefork worker on Redis or RabbitMQ).

The workers are real processes on the pytest run's test database of each alias (SQLite,
PostgreSQL, MariaDB), started and stopped by each test (tests/taskapp/services.py); the tasks
are in tests/taskapp/. Every lock key, queue and Redis key carries a token of its own, so
that tests and runs sharing a server never meet. Then bad input: refused with a TypeError or
ValueError that says what to do, and never a lock left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management.base import BaseCommand
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import single_instance
from tests.commands import HANG
from tests.probes import is_free
from tests.taskapp.bodies import read_mark
from tests.taskapp.services import ROOT
from tests.taskapp.services import TIMEOUT
from tests.taskapp.services import WorkerProcess
from tests.taskapp.services import ensure_rabbitmq
from tests.taskapp.services import ensure_redis
from tests.taskapp.services import forget_redis_keys
from tests.taskapp.services import missing
from tests.taskapp.services import start_celery_worker
from tests.taskapp.services import start_db_worker
from tests.taskapp.services import wait_until

BUSY_LINE = "skipped, another instance holds lock"


def token() -> str:
    return uuid.uuid4().hex[:12]


QUEUE_PACKAGES = ("celery", "kombu", "django_tasks", "django_tasks_db", "django.tasks")
IMPORT_EVERYTHING = """
import importlib, pkgutil, sys, django
before = set(sys.modules)
django.setup()
import advisory_lock
for module in pkgutil.walk_packages(advisory_lock.__path__, "advisory_lock."):
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError:
        pass  # another optional package (this test's queues are installed)
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_the_library_imports_no_task_queue_package():
    """Celery and Django Tasks are the application's: Django's set-up and every module of
    advisory_lock import none of them (in the demo project, which installs neither)."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    imported = done.stdout.split()
    assert "advisory_lock.single_instance.functions" in imported
    assert [name for name in imported if name.startswith(QUEUE_PACKAGES)] == []


# Django Tasks: db_worker processes.


class TasksOn:
    """A database router: django-tasks-db's table on ``alias``, the database that the workers
    use as "default", so that the test enqueues where they look."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == "django_tasks_database" else None

    db_for_write = db_for_read


@pytest.fixture
def task_module():
    """tests.taskapp.tasks (needs django-tasks-db, and the backport on Django 5.2)."""
    if "django_tasks_db" not in settings.INSTALLED_APPS:
        missing("django-tasks-db (and on Django 5.2 django-tasks) is not installed")
    from tests.taskapp import tasks

    return tasks


@contextlib.contextmanager
def db_workers(using: str, queue: str, folder: Path, count: int = 2) -> Iterator[dict]:
    """``count`` db_worker processes on ``queue``, and the test's enqueues routed to their
    database; yields the workers by worker id."""
    workers: dict[str, WorkerProcess] = {}
    try:
        for number in range(1, count + 1):
            worker_id = f"w{number}-{queue}"
            workers[worker_id] = start_db_worker(worker_id, using, queue, folder)
        for worker in workers.values():
            worker.wait_for("Starting worker")
        with override_settings(DATABASE_ROUTERS=[TasksOn(using)]):
            yield workers
    finally:
        for worker in workers.values():
            worker.stop()


def finished(results: list) -> list:
    """The results among ``results`` that are finished (each refreshed from the database)."""
    for result in results:
        if not result.is_finished:
            result.refresh()
    return [result for result in results if result.is_finished]


def succeeded(result: Any, tasks: Any) -> Any:
    """The task's return value; fail with its traceback if it did not succeed."""
    assert result.status == tasks.TaskResultStatus.SUCCESSFUL, (
        f"{result.status}: {[error.traceback for error in result.errors]}"
    )
    return result.return_value


def test_django_task_enqueued_twice_runs_on_one_worker_while_the_other_skips(
    using, tmp_path, task_module
):
    tasks, run = task_module, token()
    key, queue = f"queue-test:{run}", f"alq-{run}"
    started, release = tmp_path / "started", tmp_path / "release"
    job = tasks.hold_job.using(queue_name=queue)
    with db_workers(using, queue, tmp_path) as workers:
        try:
            results = [job.enqueue(run, str(started), str(release)) for _ in range(2)]
            # The one that got the lock runs until released: the other one can only have
            # been taken by the other worker, which found the lock busy.
            (skipped,) = wait_until(lambda: finished(results), what="a task to finish")
            assert succeeded(skipped, tasks) is None
            holder = next(result for result in results if result is not skipped)
            holder.refresh()
            assert holder.status == tasks.TaskResultStatus.RUNNING
            assert not is_free(key, using)
        finally:
            release.touch()
        wait_until(lambda: finished([holder]), what="the holder to finish")
        assert succeeded(holder, tasks)["pid"] == read_mark(started)["pid"]
        assert set(skipped.worker_ids).isdisjoint(holder.worker_ids)
        busy_lines = [
            line
            for line in workers[skipped.worker_ids[0]].output().splitlines()
            if BUSY_LINE in line
        ]
        assert len(busy_lines) == 1, workers[skipped.worker_ids[0]].output()
        assert busy_lines[0].startswith(f"tests.taskapp.tasks.hold_job: {BUSY_LINE} '{key}'")
        assert " by " in busy_lines[0]  # names the holder
    assert is_free(key, using)


def test_django_task_with_a_ledger_runs_once_however_often_it_is_enqueued(
    using, tmp_path, task_module
):
    tasks, run = task_module, token()
    queue = f"alq-{run}"
    ledger = JobRun.objects.using(using).filter(job_name=tasks.ONCE_JOB_LABEL)
    ledger.delete()  # "once" is once per database: this test's slot starts empty
    job = tasks.once_job.using(queue_name=queue)
    try:
        with db_workers(using, queue, tmp_path):
            together = [job.enqueue(run) for _ in range(4)]
            wait_until(lambda: len(finished(together)) == 4, what="the first 4 to finish")
            # The lock is free now: only the ledger can stop these.
            later = [job.enqueue(run) for _ in range(3)]
            wait_until(lambda: len(finished(later)) == 3, what="the next 3 to finish")
        values = [succeeded(result, tasks) for result in together + later]
        assert len([value for value in values if value is not None]) == 1
        assert values[4:] == [None, None, None]
        assert list(ledger.values_list("period", "status")) == [("once", "succeeded")]
        assert is_free(f"queue-test:{run}", using)
    finally:
        ledger.delete()  # the tests after this one start from an empty ledger


# A regression test: GuardedRun used to install its own SIGTERM/SIGINT handlers around a
# function called in the main thread, so SIGTERM aborted the task with SystemExit(143) and
# db_worker never saw it (it went on taking tasks).
@pytest.mark.parametrize("using", ["default"], indirect=True)  # the same on every database
def test_sigterm_to_a_db_worker_mid_task_lets_the_task_finish_then_stops_the_worker(
    using, tmp_path, task_module
):
    tasks, run = task_module, token()
    queue = f"alq-{run}"
    started, release = tmp_path / "started", tmp_path / "release"
    with db_workers(using, queue, tmp_path, count=1) as workers:
        (worker,) = workers.values()
        result = tasks.hold_job.using(queue_name=queue).enqueue(run, str(started), str(release))
        try:
            wait_until(lambda: read_mark(started), HANG, "the task to start")
            worker.proc.send_signal(signal.SIGTERM)  # db_worker: finish the task, then exit
            # The task is let go only once the worker has handled the signal (it says so):
            # before, the task could end before the signal came.
            worker.wait_for("shutting down gracefully", timeout=HANG)
        finally:
            release.touch()
        wait_until(lambda: finished([result]), HANG, "the task to finish")
        assert succeeded(result, tasks) is not None
        assert worker.proc.wait(HANG) == 0


# Celery: a worker with two prefork children.


def require_celery() -> None:
    try:
        import celery  # noqa: F401
    except ImportError:
        missing("celery is not installed")


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request):
    """The URL of a running broker (started if need be)."""
    require_celery()
    return ensure_redis() if request.param == "redis" else ensure_rabbitmq()


@pytest.fixture
def redis_broker():
    require_celery()
    return ensure_redis()


@contextlib.contextmanager
def celery_worker(using: str, broker: str, folder: Path) -> Iterator[tuple[Any, WorkerProcess]]:
    """A Celery worker on a queue of its own; yields the app that sends to it, and the worker."""
    from tests.taskapp.celery_config import make_app

    queue = f"advisory-lock-tests-{token()}"
    app = make_app(broker, queue)
    worker = start_celery_worker("celery", using, broker, queue, folder)
    try:
        worker.wait_for(" ready.")
        yield app, worker
    finally:
        worker.stop()
        if broker.startswith("redis://"):
            forget_redis_keys(f"{queue}:")
        else:
            with app.connection_for_write() as connection:
                connection.default_channel.queue_delete(queue)
        app.close()


@pytest.mark.parametrize("using", ["default"], indirect=True)  # the worker needs no server
def test_a_killed_worker_leaves_nothing_in_the_systems_temporary_directory(
    using, redis_broker, tmp_path
):
    # `make test` leaves nothing in the temporary directory: a Celery worker's prefork pool
    # makes a pymp-* folder there that only a clean exit removes, and the tests stop their
    # workers with SIGKILL. Their TMPDIR is in the run's folder (worker_env), which the run
    # removes at its end.
    system_temporary = Path(os.environ["ADVISORY_LOCK_TEST_DIR"]).parent
    before = set(system_temporary.glob("pymp-*"))
    with celery_worker(using, redis_broker, tmp_path) as (_app, worker):
        assert worker.proc.poll() is None  # its pool is up: it said " ready."
    assert worker.proc.returncode == -signal.SIGKILL
    assert set(system_temporary.glob("pymp-*")) - before == set()
    run_folder = Path(os.environ["ADVISORY_LOCK_TEST_DIR"], "tmp")
    assert list(run_folder.glob("pymp-*")), "the worker's pool made its folder in the run's"


def hold(app: Any, run: str, started: Path, release: Path, name: str = "hold") -> Any:
    return app.send_task(f"advisory_lock_tests.{name}", args=[run, str(started), str(release)])


def test_celery_task_sent_twice_runs_in_one_child_while_the_other_skips(using, broker, tmp_path):
    run = token()
    key = f"queue-test:{run}"
    started, release = tmp_path / "started", tmp_path / "release"
    with celery_worker(using, broker, tmp_path) as (app, worker):
        try:
            results = [hold(app, run, started, release) for _ in range(2)]
            skipped = wait_until(
                lambda: next((result for result in results if result.ready()), None),
                what="a task to finish",
            )
            assert skipped.get(timeout=TIMEOUT) is None
            holder = next(result for result in results if result is not skipped)
            assert wait_until(lambda: read_mark(started), what="the holder to start")
            assert not holder.ready()
            assert not is_free(key, using)
        finally:
            release.touch()
        assert holder.get(timeout=TIMEOUT)["pid"] == read_mark(started)["pid"]
        assert f"tests.taskapp.celery_worker.hold: {BUSY_LINE} '{key}'" in worker.output()
    assert is_free(key, using)


def test_celery_child_killed_mid_task_frees_the_lock_at_once_and_the_next_task_runs(
    using, redis_broker, tmp_path
):
    run = token()
    key = f"queue-test:{run}"
    with celery_worker(using, redis_broker, tmp_path) as (app, worker):
        first = hold(app, run, tmp_path / "started-1", tmp_path / "release-1")
        try:
            child = wait_until(lambda: read_mark(tmp_path / "started-1"))["pid"]
            assert child != worker.proc.pid
            assert not is_free(key, using)
            os.kill(child, signal.SIGKILL)
            killed_at = time.monotonic()
            wait_until(lambda: is_free(key, using), timeout=10, what="the lock to be free")
            freed_after = time.monotonic() - killed_at
            (tmp_path / "release-2").touch()
            sent_at = time.monotonic()
            second = hold(app, run, tmp_path / "started-2", tmp_path / "release-2")
            ran = second.get(timeout=TIMEOUT)
        finally:
            (tmp_path / "release-1").touch()
        assert not first.successful()  # Celery marks it failed (WorkerLostError) later
    print(
        f"\n{using}: lock free {freed_after * 1000:.0f} ms after SIGKILL; the next task "
        f"started {(ran['started_at'] - sent_at) * 1000:.0f} ms after it was sent"
    )
    assert freed_after < 10  # generous for a loaded machine (the figures are printed)
    # It ran (a lock with a time-to-live would keep it out until the TTL ran out), at once:
    # tens of milliseconds on an idle machine, the bound leaves room for a loaded one.
    assert ran is not None and ran["pid"] != child
    assert ran["started_at"] - sent_at < 20
    assert is_free(key, using)


def test_celery_task_that_raises_when_busy_is_retried_until_the_lock_is_free(
    using, redis_broker, tmp_path
):
    run = token()
    with celery_worker(using, redis_broker, tmp_path) as (app, worker):
        first = hold(app, run, tmp_path / "started-1", tmp_path / "release-1")
        try:
            wait_until(lambda: read_mark(tmp_path / "started-1"), what="the first to start")
            (tmp_path / "release-2").touch()
            retried = hold(
                app, run, tmp_path / "started-2", tmp_path / "release-2", "hold_or_retry"
            )
            wait_until(lambda: "LockNotAcquired" in worker.output(), what="a retry")
            assert not retried.ready()
        finally:
            (tmp_path / "release-1").touch()
        assert first.get(timeout=TIMEOUT) is not None
        assert retried.get(timeout=TIMEOUT)["retries"] >= 1
    assert is_free(f"queue-test:{run}", using)


# Bad input: refused before any lock, with a message that says what to do.


@pytest.mark.parametrize("on_busy", ["wait", "Skip", "raise ", "", True, 0, ["skip"]])
def test_on_busy_other_than_skip_or_raise_is_refused_at_decoration(using, on_busy):
    key = f"bad-input:{token()}"

    def job():
        pass

    for decorate in (
        lambda: single_instance(key=key, using=using, on_busy=on_busy),
        lambda: single_instance(job, key=key, using=using, on_busy=on_busy),
    ):
        with pytest.raises((TypeError, ValueError), match="on_busy must be 'skip' or 'raise'"):
            decorate()
    assert is_free(key, using)


def test_on_busy_on_a_command_is_a_type_error():
    with pytest.raises(TypeError, match="on_busy= is for functions"):

        @single_instance(on_busy="raise")
        class Command(BaseCommand):
            pass


def key_of(n: int, key: str) -> str:
    """A key callable: the key for n == 1, KeyError for anything else."""
    return {1: key}[n]


def test_key_callable_that_raises_is_a_value_error_and_takes_no_lock(using):
    key, calls = f"bad-input:{token()}", []

    @single_instance(using=using, key=lambda n: key_of(n, key))
    def job(n):
        calls.append(n)

    with pytest.raises(ValueError, match=r"key callable of @single_instance on .*job raised"):
        job(2)
    assert calls == []
    assert is_free(key, using)
    assert is_free(f"task:{job.__module__}.{job.__qualname__}", using)
    job(1)  # nothing was left held: the next call runs
    assert calls == [1]


def test_key_callable_of_an_async_function_that_raises_is_a_value_error(using):
    key, calls = f"bad-input:{token()}", []

    @single_instance(using=using, key=lambda n: key_of(n, key))
    async def job(n):
        calls.append(n)

    with pytest.raises(ValueError, match=r"key callable of @single_instance on .*job raised"):
        asyncio.run(job(2))
    assert calls == []
    assert is_free(key, using)
    asyncio.run(job(1))
    assert calls == [1]


NOT_KEYS = {
    "None": None,
    "an empty str": "",
    "a blank str": "   ",
    "a float": 3.5,
    "a bool": True,
    "an int out of 64-bit range": 2**63,
    "a 1-tuple": (1,),
    "a 3-tuple": (1, 2, 3),
    "a pair out of 32-bit range": (2**31, 0),
    "bytes": b"key",
    "a list": ["key"],
    "an object": object(),
}


@pytest.mark.parametrize("returned", NOT_KEYS.values(), ids=NOT_KEYS.keys())
def test_key_callable_that_returns_no_key_is_refused_before_any_lock(using, returned):
    key, calls = f"bad-input:{token()}", []

    @single_instance(using=using, key=lambda n: key if n == 1 else returned)
    def job(n):
        calls.append(n)

    with pytest.raises((TypeError, ValueError), match=r"key callable .* on .*job returned"):
        job(2)
    assert calls == []
    assert is_free(key, using)
    job(1)
    assert calls == [1]


def test_call_with_arguments_that_do_not_fit_releases_the_lock(using):
    key = f"bad-input:{token()}"

    @single_instance(using=using, key=key)
    def job(n):
        pass

    with pytest.raises(TypeError, match="positional argument"):
        job(1, 2)
    assert is_free(key, using)


class NotACommand:
    def method(self):
        pass


class CallableObject:
    def __call__(self):
        pass


def function():
    pass


NEITHER_COMMAND_NOR_FUNCTION = {
    "a class that is not a command": NotACommand,
    "an instance of a callable class": CallableObject(),
    "a bound method": NotACommand().method,
    "a functools.partial": functools.partial(function),
    "a builtin": len,
    "a staticmethod object": staticmethod(function),
    "a classmethod object": classmethod(function),
    "a key passed positionally": "nightly-report",
    "an int": 42,
}


@pytest.mark.parametrize(
    "target", NEITHER_COMMAND_NOR_FUNCTION.values(), ids=NEITHER_COMMAND_NOR_FUNCTION.keys()
)
def test_single_instance_on_neither_a_command_nor_a_function_is_a_type_error(target):
    message = "decorates a BaseCommand subclass or a function"
    with pytest.raises(TypeError, match=message):
        single_instance(target)
    with pytest.raises(TypeError, match=message):
        single_instance(wait=1)(target)


def test_busy_exit_code_on_a_function_is_a_type_error():
    with pytest.raises(TypeError, match="busy_exit_code= is for commands"):
        single_instance(function, busy_exit_code=3)
