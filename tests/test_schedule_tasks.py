"""Task entries of the schedule (``"task"``): real ``run_jobs`` schedulers enqueue each slot's
task once, on Django Tasks (django-tasks-db's ``db_worker``) and on Celery (Redis, RabbitMQ),
and follow each task to its end.

The schedulers are the real processes of tests/schedulers.py (``Schedulers``); the
workers are those of tests/test_task_queues.py (tests/taskapp/services.py); the tasks are in
tests/taskapp/schedule_tasks.py (Django Tasks) and tests/taskapp/schedule_celery.py (Celery),
and record each execution in a file with their own task id. A task entry's arguments are the
same for each of its slots, so a task is matched with its slot through its id: the one the
slot's ledger row records (``job_runs.task_id``) and the one its queue gives it
(``DBTaskResult.id``, Celery's ``request.id``). Every test has a queue of its own (and on
Redis, keys under it), removed at its end.

Events are told apart by rows and files, never by timings: each wait has a guard against a
hang only (``HANG``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import connections

from advisory_lock import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import set_paused
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.schedulers import Schedulers
from tests.schedulers import alive
from tests.schedulers import long_interval
from tests.schedulers import server_now
from tests.schedulers import settings_with
from tests.taskapp.schedule_bodies import executions
from tests.taskapp.schedule_bodies import fails
from tests.taskapp.services import WorkerProcess
from tests.taskapp.services import ensure_rabbitmq
from tests.taskapp.services import ensure_redis
from tests.taskapp.services import forget_redis_keys
from tests.taskapp.services import missing
from tests.taskapp.services import start_db_worker
from tests.taskapp.services import wait_until
from tests.taskapp.services import worker_env

Status = JobRun.Status
RECORD = "tests.taskapp.schedule_tasks.record"
CELERY_RECORD = "tests.taskapp.schedule_celery.record"
CELERY_UNRECORDED = "tests.taskapp.schedule_celery.unrecorded"
#: A guard against a hang, never a timing: how long any one wait may last.
HANG = 240.0
#: Slots enqueued before the kills, and in all, by the fleet tests (per backend, per broker).
BEFORE_KILLS, SLOTS = 10, 20
#: The line a scheduler logs (once) for an entry whose queue keeps no results.
NO_RESULTS = "its slots stay enqueued."


def token() -> str:
    return uuid.uuid4().hex[:12]


def wait_for(condition, what: str, timeout: float = HANG) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout``."""
    return wait_until(condition, timeout, what)


def children_of(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_for_a_poll_after(using: str, pid: int, moment: datetime.datetime) -> None:
    """Wait until the scheduler ``pid`` has finished a poll (its heartbeat, the run-now
    requests, the follow-up of its enqueued tasks) that began after ``moment`` (the
    database's clock): the heartbeat is each poll's first step, so the poll of a beat after
    ``moment`` is over once the next beat is in."""
    beats = SchedulerHeartbeat.objects.using(using).filter(pid=pid)
    first = wait_for(
        lambda: beats.filter(last_seen__gt=moment).values_list("last_seen", flat=True).first(),
        "a poll after that",
    )
    wait_for(lambda: beats.filter(last_seen__gt=first).exists(), "the end of that poll")


def canonical(task_id: str) -> str:
    """A django-tasks-db id as ``str(UUID)``, however it was written."""
    return str(uuid.UUID(str(task_id)))


@pytest.fixture
def queue(monkeypatch):
    """This test's queue: the schedulers and the workers it starts read it from the
    environment (a task entry names its task, not a queue)."""
    name = f"sched-{token()}"
    monkeypatch.setenv("ADVISORY_LOCK_TEST_QUEUE", name)
    return name


@pytest.fixture
def paused_entries(using):
    """The names of the entries the test paused: their control rows go at its end."""
    names: list[str] = []
    yield names
    JobControl.objects.using(using).filter(job_name__in=names).delete()


@pytest.fixture
def task_results(using, queue):
    """django-tasks-db's rows of this test's queue (needs django-tasks-db, and the
    backport on Django 5.2), removed at its end."""
    if "django_tasks_db" not in settings.INSTALLED_APPS:
        missing("django-tasks-db (and on Django 5.2 django-tasks) is not installed")
    from django_tasks_db.models import DBTaskResult

    rows = DBTaskResult.objects.using(using).filter(queue_name=queue)
    yield rows
    rows.delete()


@contextlib.contextmanager
def db_workers(using: str, queue: str, folder: Path, count: int) -> Iterator[list[WorkerProcess]]:
    """``count`` db_worker processes on ``queue``, stopped (killed if need be) at the end."""
    workers = []
    try:
        for number in range(1, count + 1):
            workers.append(start_db_worker(f"w{number}-{queue}", using, queue, folder))
        for worker in workers:
            worker.wait_for("Starting worker")
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and its process group; wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def state_of(pid: int) -> str:
    """The process's state letter (R, S, T for stopped, Z, ...), "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def kill_between_slots(schedulers: Schedulers, scheduler: subprocess.Popen) -> None:
    """SIGKILL ``scheduler`` (and its workers) at a moment none of its workers runs a slot.
    The look and the kill are one step: the scheduler is stopped (SIGSTOP) while the test
    reads what it said, so it can't give a worker a run in between; a slot it said started
    and not yet ended (succeeded, enqueued, failed, skipped: said once its worker answered)
    may be running, and then it goes on (SIGCONT) and the test looks again. Its workers are
    processes of their own group (they ignore the scheduler's signals): killed by pid."""
    out = schedulers.folder / f"run_jobs.{scheduler.number}.out"

    def stopped_between_runs() -> bool:
        os.kill(scheduler.pid, signal.SIGSTOP)
        wait_for(lambda: state_of(scheduler.pid) in ("T", "t"), "the scheduler stopped")
        said = out.read_text()
        started = len(re.findall(r"^run_jobs: .* started \(pid \d+\)\.$", said, re.M))
        ended = len(RUN_ENDED.findall(said))
        if started != ended:
            os.kill(scheduler.pid, signal.SIGCONT)
            return False
        return True

    wait_for(stopped_between_runs, "the scheduler between two slots")
    workers = children_of(scheduler.pid)
    kill_group(scheduler)  # SIGKILL ends a stopped process too
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


#: A run's end as its scheduler says it (a task's end, said later, is not one).
RUN_ENDED = re.compile(r"^run_jobs: \S+ \[[^\]]+\] (succeeded\.|enqueued\.|skipped |failed)", re.M)


def stop(schedulers: Schedulers, fleet: list[subprocess.Popen]) -> str:
    """SIGTERM each scheduler of ``fleet``; each exits 0 once its job processes are done
    (no new claim after the signal). Returns their output. Each is signalled once its
    heartbeat row is there: its handlers are installed by then (before it runs, SIGTERM's
    default action would kill a scheduler still starting: status -15)."""
    beats = SchedulerHeartbeat.objects.using(schedulers.using)
    for process in fleet:
        mine = beats.filter(pid=process.pid)
        wait_for(mine.exists, f"{process.pid}'s heartbeat")
        process.send_signal(signal.SIGTERM)
    outputs = []
    for process in fleet:
        status, out, err = schedulers.finish(process, timeout=HANG)
        assert status == 0, out + err
        outputs.append(out + err)
    return "".join(outputs)


# Django Tasks (django-tasks-db): each slot's task enqueued once, with its ledger mark.


def test_three_schedulers_enqueue_each_slot_once_with_its_mark_through_sigkills(
    using, ledger, schedulers, queue, task_results, paused_entries, tmp_path
):
    """3 schedulers and 2 db_workers; one of each SIGKILLed midway (the worker in the middle
    of a task: its tasks run until it is killed). An atomic task entry's enqueue commits
    with its slot's mark: each slot has one row, each row's task one DBTaskResult, each
    DBTaskResult one row; each task ran once, and its row ends as it did (the killed
    worker's task never ends: django-tasks-db leaves it RUNNING, and its row enqueued)."""
    name = "enqueue-tick"
    folder = tmp_path / "runs"
    folder.mkdir()
    kwargs = {"folder": str(folder), "fail_one_in": 3, "hold_on": "w1-"}
    entry = {"task": RECORD, "kwargs": kwargs, "every": 1, "atomic": True, "retries": 0}
    schedule = {name: entry}
    rows = ledger.filter(job_name=name)
    with_task = rows.exclude(task_id="")
    with db_workers(using, queue, tmp_path, count=2) as workers:
        fleet = [schedulers.start(schedule) for _ in range(3)]
        wait_for(lambda: with_task.count() >= BEFORE_KILLS, f"{BEFORE_KILLS} slots enqueued")
        # The worker, in the middle of a task (held until then): once the task itself has
        # recorded its execution. Its DBTaskResult says RUNNING a little earlier, before the
        # worker has called the task's function, and a kill then leaves no execution.
        killed_worker = workers[0]
        wait_for(
            lambda: any(e["worker"] == killed_worker.name for e in executions(folder)),
            f"{killed_worker.name} running a task",
        )
        kill_group(killed_worker.proc)
        # The scheduler, whatever it is doing: its job process dies with it.
        killed = fleet.pop(0)
        kill_group(killed)
        wait_for(lambda: with_task.count() >= SLOTS, f"{SLOTS} slots enqueued")
        # No new slot: the entry paused, the schedulers stopped. A new scheduler follows the
        # tasks the others enqueued to their end.
        set_paused(using, name, True, "test")
        paused_entries.append(name)
        stop(schedulers, fleet)
        follower = schedulers.start(schedule)
        stuck = [
            r for r in task_results.filter(status="RUNNING") if killed_worker.name in r.worker_ids
        ]

        def all_ended() -> bool:
            ended = {
                canonical(r.id): r.status
                for r in task_results.exclude(status__in=["READY", "RUNNING"])
            }
            recorded = dict(with_task.values_list("task_id", "status"))
            return len(ended) + len(stuck) == task_results.count() and all(
                status != Status.ENQUEUED
                for task_id, status in recorded.items()
                if canonical(task_id) in ended
            )

        wait_for(all_ended, "every task's end, and its row's")
        stop(schedulers, [follower])
    assert len(stuck) == 1  # a db_worker runs one task at a time
    runs = list(rows)
    slots = Counter(run.period for run in runs)
    assert [slot for slot, count in slots.items() if count > 1] == []  # one row per slot
    enqueued = {canonical(run.task_id): run for run in runs if run.task_id}
    assert len(enqueued) >= SLOTS
    # The killed scheduler's job process, killed between its claim and its commit, left a
    # row without a task, or none: still running under a free lock, marked abandoned (a
    # sweep, or a claim of its slot), or failed (a scheduler that saw a job process of that
    # slot die records the slot's running rows whose lock is free: ledger.fail_orphaned).
    # Never a success, and never a second row for its slot (above).
    unfinished = [run for run in runs if not run.task_id]
    assert len(unfinished) <= 1, unfinished
    for run in unfinished:
        assert run.status in (Status.RUNNING, Status.ABANDONED, Status.FAILED), run.error
        assert not alive(run.pid)
    # Each enqueue is its slot's: no task without a row, no row without its task.
    results = {canonical(result.id): result for result in task_results}
    assert sorted(results) == sorted(enqueued)
    # Each row ends as its task did, once the queue said; the killed worker's never did.
    stuck_ids = {canonical(result.id) for result in stuck}
    expected = {"SUCCESSFUL": Status.SUCCEEDED, "FAILED": Status.FAILED}
    for task_id, run in enqueued.items():
        if task_id in stuck_ids:
            assert run.status == Status.ENQUEUED and run.finished_at is None
            continue
        assert run.status == expected[results[task_id].status], (run, results[task_id])
        assert run.finished_at is not None
        if run.status == Status.FAILED:
            assert f"task {task_id} fails on purpose" in run.error
    statuses = Counter(run.status for run in enqueued.values())
    assert statuses[Status.SUCCEEDED] and statuses[Status.FAILED], statuses
    # Each task ran once (the killed worker's too: it started it).
    assert Counter(canonical(e["task_id"]) for e in executions(folder)) == Counter(list(enqueued))


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)  # the scheduler's choice
def test_run_jobs_once_records_how_the_tasks_of_earlier_runs_ended(
    using, ledger, schedulers, queue, task_results, tmp_path
):
    """A fleet run by cron (``run_jobs --once``) follows its tasks one run late: the next
    ``--once`` records the end of the task the previous one enqueued, and enqueues nothing
    more for that slot."""
    name = "cron-driven"
    folder = tmp_path / "runs"
    folder.mkdir()
    kwargs = {"folder": str(folder), "fail_one_in": 0}
    schedule = {name: {"task": RECORD, "kwargs": kwargs, "every": long_interval(using)}}
    rows = ledger.filter(job_name=name)
    with db_workers(using, queue, tmp_path, count=1):
        status, out, err = schedulers.once(schedule)
        assert status == 0, out + err
        [run] = rows.all()
        assert run.status == Status.ENQUEUED
        wait_for(lambda: task_results.filter(status="SUCCESSFUL").exists(), "the task's end")
        status, out, err = schedulers.once(schedule)
        assert status == 0, out + err
    [run] = rows.all()  # the slot was not enqueued again
    assert run.status == Status.SUCCEEDED and run.finished_at is not None, out + err
    assert [canonical(result.id) for result in task_results] == [canonical(run.task_id)]


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)  # the scheduler's choice
def test_a_failed_task_is_enqueued_again_for_its_retries_and_an_enqueued_slot_is_not_rerun(
    using, ledger, schedulers, queue, task_results, tmp_path
):
    """A slot whose task failed is enqueued again while it is the latest, ``retries`` times;
    while its task is in the queue no job process is started for it.

    Regression: an enqueued slot counted as "failed or abandoned" for the scheduler, which
    started a job process for it at each look at the clock (5 a second) until its task
    ended; each found the slot taken and exited."""
    name = "retried"
    folder = tmp_path / "runs"
    folder.mkdir()
    kwargs = {"folder": str(folder), "fail_one_in": 1, "work": 2.0}  # fails after 2 s
    schedule = {name: {"task": RECORD, "kwargs": kwargs, "every": long_interval(using)}}
    rows = ledger.filter(job_name=name)
    with db_workers(using, queue, tmp_path, count=1):
        scheduler = schedulers.start(schedule)
        wait_for(lambda: rows.filter(attempt=2, status=Status.FAILED).exists(), "2 failures")
        done = server_now(using)
        wait_for_a_poll_after(using, scheduler.pid, done)
        output = stop(schedulers, [scheduler])
    runs = list(rows.order_by("attempt"))
    assert [(run.attempt, run.status) for run in runs] == [(1, "failed"), (2, "failed")]
    assert len({run.period for run in runs}) == 1
    assert sorted(canonical(result.id) for result in task_results) == sorted(
        canonical(run.task_id) for run in runs
    )
    assert all("fails on purpose" in run.error for run in runs)
    started = [line for line in output.splitlines() if f"{name} [" in line and " started " in line]
    assert len(started) == 2, output


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)  # the scheduler's choice
def test_slots_whose_task_never_ends_do_not_keep_the_others_from_being_followed(
    using, ledger, schedulers, queue, task_results, tmp_path
):
    """A task that never ends (its worker was killed mid-task; its result was pruned) leaves
    its slot enqueued for ever. More than a poll's worth of them (100) must not stop the
    scheduler from following the others.

    Regression: each poll asked about the 100 oldest enqueued slots of an entry only, so
    once 100 never-ending tasks had piled up no newer slot was ever recorded ended; and each
    poll logged a warning for each of them."""
    name = "followed"
    folder = tmp_path / "runs"
    folder.mkdir()
    schedule = {name: {"task": RECORD, "kwargs": {"folder": str(folder)}, "every": 1}}
    long_ago = server_now(using) - datetime.timedelta(days=1)
    ledger.bulk_create(
        JobRun(
            job_name=name,
            period=f"2020-01-01T00:{number // 60:02d}:{number % 60:02d}",
            status=Status.ENQUEUED,
            started_at=long_ago,
            task_id=str(uuid.uuid4()),  # no such task: its queue can't tell how it ended
        )
        for number in range(150)
    )
    rows = ledger.filter(job_name=name, started_at__gt=long_ago)
    with db_workers(using, queue, tmp_path, count=1):
        scheduler = schedulers.start(schedule)
        wait_for(lambda: rows.filter(status=Status.SUCCEEDED).count() >= 3, "3 slots followed")
        done = server_now(using)
        wait_for_a_poll_after(using, scheduler.pid, done)
        output = stop(schedulers, [scheduler])
    assert ledger.filter(job_name=name, started_at=long_ago, status=Status.ENQUEUED).count() == 150
    # Each is said once, not at each poll.
    unanswered = [line for line in output.splitlines() if "the queue did not say" in line]
    assert len(unanswered) == 150, unanswered[:3]
    assert all("TaskResultDoesNotExist" in line for line in unanswered)


# Celery, on Redis and on RabbitMQ (results on Redis): each slot's task enqueued once.


def require_celery() -> None:
    try:
        import celery  # noqa: F401
    except ImportError:
        missing("celery is not installed")


@contextlib.contextmanager
def celery_setup(
    monkeypatch, broker: str, results: str, folder: Path, using: str, workers: int
) -> Iterator[list[WorkerProcess]]:
    """``workers`` Celery workers (2 prefork children each) on a queue of this test, for
    the schedulers the test starts next (the environment tells them the broker, the queue
    and the results); the queue and its keys are removed at the end."""
    queue = f"advisory-lock-tests-{token()}"
    environment = {
        "ADVISORY_LOCK_TEST_BROKER": broker,
        "ADVISORY_LOCK_TEST_QUEUE": queue,
        "ADVISORY_LOCK_TEST_RESULTS": results,
    }
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    options = (
        f"--queues {queue} --pool prefork --concurrency 2 -O fair --loglevel INFO "
        "--without-gossip --without-mingle --without-heartbeat"
    )
    command = [sys.executable, "-m", "celery", "-A", "tests.taskapp.schedule_celery", "worker"]
    started: list[WorkerProcess] = []
    try:
        for number in range(1, workers + 1):
            argv = [*command, *options.split(), "--hostname", f"celery{number}@%h"]
            env = worker_env(using, **environment)
            started.append(WorkerProcess(f"celery{number}", argv, env, folder, signal.SIGKILL))
        for worker in started:
            worker.wait_for(" ready.")
        yield started
    finally:
        for worker in started:
            worker.stop()
        if broker.startswith("redis://") or results.startswith("redis://"):
            forget_redis_keys(f"{queue}:")
        if not broker.startswith("redis://"):
            from kombu import Connection

            with Connection(broker) as connection:
                connection.default_channel.queue_delete(queue)


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
@pytest.mark.parametrize("broker_name", ["redis", "rabbitmq"])
def test_three_schedulers_enqueue_each_slot_once_on_celery_through_sigkills(
    using, ledger, schedulers, broker_name, paused_entries, monkeypatch, tmp_path
):
    """3 schedulers and 2 Celery workers; one of each SIGKILLed midway (the worker in the
    middle of a task: its tasks run until it is killed; the scheduler while no job process
    of its own is enqueuing: a Celery enqueue can't commit with its mark). Each slot's task
    is enqueued once and recorded; each task ran, more than once only if the killed worker
    had it (its message went back to the queue: at least once); each row ends as its task
    did, by the results on Redis."""
    require_celery()
    broker = ensure_redis() if broker_name == "redis" else ensure_rabbitmq()
    results = ensure_redis()
    name = "celery-tick"
    folder = tmp_path / "runs"
    folder.mkdir()
    kwargs = {"folder": str(folder), "fail_one_in": 3, "hold_on": "celery1@"}
    schedule = {name: {"task": CELERY_RECORD, "kwargs": kwargs, "every": 1, "retries": 0}}
    rows = ledger.filter(job_name=name)
    with_task = rows.exclude(task_id="")
    with celery_setup(monkeypatch, broker, results, tmp_path, using, workers=2) as workers:
        fleet = [schedulers.start(schedule) for _ in range(3)]
        wait_for(lambda: with_task.count() >= BEFORE_KILLS, f"{BEFORE_KILLS} slots enqueued")
        killed_worker = workers[0]
        killed_host = f"{killed_worker.name}@"
        wait_for(
            lambda: any(e["worker"].startswith(killed_host) for e in executions(folder)),
            f"{killed_worker.name} running a task",
        )
        kill_group(killed_worker.proc)
        killed = fleet.pop(0)
        # Between two of its slots: its job process, were it killed between the broker's
        # "accepted" and the row's update, would leave a task without a mark (docs).
        kill_between_slots(schedulers, killed)
        wait_for(lambda: with_task.count() >= SLOTS, f"{SLOTS} slots enqueued")
        set_paused(using, name, True, "test")
        paused_entries.append(name)
        stop(schedulers, fleet)
        follower = schedulers.start(schedule)
        wait_for(
            lambda: not rows.filter(status__in=[Status.ENQUEUED, Status.RUNNING]).exists(),
            "every task's end recorded",
        )
        stop(schedulers, [follower])
    runs = list(rows)
    slots = Counter(run.period for run in runs)
    assert [slot for slot, count in slots.items() if count > 1] == []
    assert all(run.task_id for run in runs)  # no job process died before its mark
    enqueued = {run.task_id: run for run in runs}
    assert len(enqueued) >= SLOTS
    ran = executions(folder)
    # Each enqueue is its slot's: every task that ran has a row, every row's task ran.
    assert sorted({e["task_id"] for e in ran}) == sorted(enqueued)
    # At least once: the killed worker's tasks ran again on the other; a task ran twice
    # only if the killed worker had it.
    hosts: dict[str, list[str]] = {}
    for execution in ran:
        hosts.setdefault(execution["task_id"], []).append(execution["worker"])
    killed_tasks = {
        task_id for task_id, seen in hosts.items() if any(h.startswith(killed_host) for h in seen)
    }
    assert killed_tasks
    for task_id, seen in hosts.items():
        on_the_other = [host for host in seen if not host.startswith(killed_host)]
        assert len(on_the_other) == 1, (task_id, seen)
        assert len(seen) == 1 or task_id in killed_tasks, (task_id, seen)
    for task_id, run in enqueued.items():
        failed = fails(task_id, 3)
        assert run.status == (Status.FAILED if failed else Status.SUCCEEDED), run
        assert run.finished_at is not None
        if failed:
            assert f"task {task_id} fails on purpose" in run.error
    statuses = Counter(run.status for run in runs)
    assert statuses[Status.SUCCEEDED] and statuses[Status.FAILED], statuses


# A queue that keeps no results: the slot stays enqueued, said once.

NO_RESULT_CASES = {
    # The task ignores its result (ignore_result=True), on the Redis broker and backend.
    "ignore-result": ("redis", "broker", CELERY_UNRECORDED, "stores no result"),
    # Results by rpc://: they go back to the process that sent the task (the slot's job
    # process, gone), not to the scheduler that asks. Regression: the scheduler asked, and
    # read some of them from the reply queue it shared with its forked job processes (their
    # oid), on the broker connection they shared too (reset by RabbitMQ).
    "rpc-results": ("rabbitmq", "broker", CELERY_RECORD, "sends its results by rpc://"),
}


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
@pytest.mark.parametrize("case", NO_RESULT_CASES.values(), ids=NO_RESULT_CASES)
def test_a_task_whose_queue_keeps_no_result_leaves_its_slots_enqueued_and_says_so_once(
    using, ledger, schedulers, case, monkeypatch, tmp_path
):
    """Its tasks run, and their slots stay ``enqueued`` (how they ended is known nowhere);
    the scheduler says why once, however many slots and polls follow."""
    require_celery()
    broker_name, results, task, why = case
    broker = ensure_redis() if broker_name == "redis" else ensure_rabbitmq()
    name = "no-results"
    folder = tmp_path / "runs"
    folder.mkdir()
    schedule = {name: {"task": task, "kwargs": {"folder": str(folder)}, "every": 1}}
    rows = ledger.filter(job_name=name)
    with celery_setup(monkeypatch, broker, results, tmp_path, using, workers=1):
        scheduler = schedulers.start(schedule)
        # Three slots enqueued, and their tasks done; then a poll after that.
        wait_for(lambda: rows.filter(status=Status.ENQUEUED).count() >= 3, "3 slots enqueued")
        enqueued = set(rows.filter(status=Status.ENQUEUED).values_list("task_id", flat=True))
        wait_for(lambda: enqueued <= {e["task_id"] for e in executions(folder)}, "their tasks run")
        done = server_now(using)
        wait_for_a_poll_after(using, scheduler.pid, done)
        output = stop(schedulers, [scheduler])
    assert set(rows.filter(task_id__in=enqueued).values_list("status", flat=True)) == {
        Status.ENQUEUED
    }
    assert not rows.exclude(status=Status.ENQUEUED).exists(), list(rows.values())
    lines = [line for line in output.splitlines() if NO_RESULTS in line]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"run_jobs: {name}: advisory_lock_tests.scheduled.")
    assert why in lines[0]


# A job process killed between its claim and its enqueue.


@contextlib.contextmanager
def table_locked(using: str, table: str) -> Iterator[None]:
    """Writes to ``table`` wait while this lasts (on a connection of its own): reads don't
    (PostgreSQL's EXCLUSIVE mode), or are the workers' only (MariaDB's LOCK TABLES)."""
    locker = connections.create_connection(using)
    try:
        quoted = locker.ops.quote_name(table)
        if locker.vendor == "postgresql":
            locker.set_autocommit(False)
            with locker.cursor() as cursor:
                cursor.execute(f"LOCK TABLE {quoted} IN EXCLUSIVE MODE")
            yield
            locker.rollback()
        else:
            with locker.cursor() as cursor:
                cursor.execute(f"LOCK TABLES {quoted} WRITE")
            yield
            with locker.cursor() as cursor:
                cursor.execute("UNLOCK TABLES")
    finally:
        locker.close()


def waiting_insert(using: str, table: str) -> int | None:
    """A statement inserting into ``table`` that waits for a lock: its server session."""
    with connections[using].cursor() as cursor:
        if connections[using].vendor == "postgresql":
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE %s",
                [f'INSERT INTO "{table}"%'],
            )
        else:
            cursor.execute(
                "SELECT id FROM information_schema.processlist WHERE state LIKE 'Waiting%%' "
                "AND info LIKE %s",
                [f"INSERT INTO `{table}`%"],
            )
        row = cursor.fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "not-atomic"])
def test_a_slot_whose_job_process_died_between_claim_and_enqueue_is_enqueued_by_another(
    using, ledger, schedulers, queue, task_results, atomic, tmp_path
):
    """The slot's job process claims it, then waits in its enqueue (the test holds a lock on
    django-tasks-db's table) until its scheduler is SIGKILLed: its row stays ``running``
    under a free lock. The other scheduler marks it abandoned and enqueues the slot again.

    Atomic, the dead process's enqueue never commits: the slot has one task. Not atomic, its
    INSERT, already sent, commits on its own once the lock is let go: the one window of a
    task entry without ``atomic`` (a task the queue accepted, whose id no row records)."""
    name = "blocked"
    folder = tmp_path / "runs"
    folder.mkdir()
    every = long_interval(using)
    entry = {"task": RECORD, "kwargs": {"folder": str(folder)}, "every": every, "atomic": atomic}
    rows = ledger.filter(job_name=name)
    table = task_results.model._meta.db_table
    with db_workers(using, queue, tmp_path, count=1):
        with table_locked(using, table):
            fleet = [schedulers.start({name: entry}) for _ in range(2)]
            first = wait_for(lambda: rows.filter(status=Status.RUNNING).first(), "the claim")
            wait_for(lambda: waiting_insert(using, table), "the enqueue waiting")
            [victim] = [process for process in fleet if process.pid == parent_of(first.pid)]
            kill_group(victim)
            wait_for(lambda: not alive(first.pid), "the job process dying with its scheduler")
        [other] = [process for process in fleet if process is not victim]
        again = rows.filter(attempt=2, status=Status.SUCCEEDED)
        retry = wait_for(again.first, "the slot enqueued again, and its task's end")
        output = stop(schedulers, [other])
    first.refresh_from_db()
    assert first.status == Status.ABANDONED and first.task_id == ""
    assert retry.period == first.period
    assert f"{name} [{retry.period}] started (pid {retry.pid})" in output  # the other's
    results = sorted(canonical(result.id) for result in task_results)
    recorded = canonical(retry.task_id)
    ran = sorted(canonical(e["task_id"]) for e in executions(folder))
    if atomic:
        assert results == ran == [recorded]
    else:
        # The dead process's task: accepted by the queue, run, and in no row.
        [orphan] = [task_id for task_id in results if task_id != recorded]
        assert not ledger.filter(task_id=orphan).exists()
        wait_for(lambda: len(executions(folder)) == 2, "the orphan task run too")


# The system checks, and the listing.

TASKS = "tests.taskapp.schedule_tasks"
BAD_TASK_ENTRIES = {
    "task not importable": (
        {"task": f"{TASKS}.no_such_task", "every": 60},
        "['task'] = 'tests.taskapp.schedule_tasks.no_such_task' can't be imported",
    ),
    "task is a plain function": (
        {"task": f"{TASKS}.not_a_task", "every": 60},
        "is not a task: a django.tasks task (with enqueue()) or a Celery task",
    ),
    "args not JSON": (
        {"task": RECORD, "args": [{1, 2}], "every": 60},
        "'args' and 'kwargs' must be JSON-serialisable (a queue stores them): Object of type set",
    ),
    "kwargs not JSON": (
        {"task": RECORD, "kwargs": {"folder": b"bytes"}, "every": 60},
        "must be JSON-serialisable (a queue stores them): Object of type bytes",
    ),
    "kwargs not a dict": (
        {"task": RECORD, "kwargs": ["folder"], "every": 60},
        "['kwargs'] must be a dict with str keys",
    ),
    "task and callable": (
        {"task": RECORD, "callable": f"{TASKS}.not_a_task", "every": 60},
        "needs exactly one of 'command', 'callable' and 'task'",
    ),
    "kwargs without a task": (
        {"callable": f"{TASKS}.not_a_task", "kwargs": {}, "every": 60},
        "['kwargs'] goes with 'task' only",
    ),
}


@pytest.mark.parametrize(("entry", "says"), BAD_TASK_ENTRIES.values(), ids=BAD_TASK_ENTRIES)
def test_a_bad_task_entry_is_a_system_check_warning_naming_it(entry, says, task_module_installed):
    schedule = {"good": {"task": RECORD, "kwargs": {"folder": "/tmp"}, "every": 60}}
    schedule["the-bad-one"] = entry
    with settings_with(schedule):
        errors = [message for message in run_checks() if message.id == "advisory_lock.W011"]
    assert [error.msg for error in errors if "'the-bad-one'" in error.msg and says in error.msg]
    assert all("'the-bad-one'" in error.msg for error in errors), errors


@pytest.fixture
def task_module_installed():
    if "django_tasks_db" not in settings.INSTALLED_APPS:
        missing("django-tasks-db (and on Django 5.2 django-tasks) is not installed")


def test_good_task_entries_pass_the_checks_and_run_jobs_list_shows_them(
    using, ledger, task_module_installed
):
    require_celery()
    schedule = {
        "django-task": {"task": RECORD, "args": ["/tmp"], "kwargs": {"work": 0}, "every": 30},
        "celery-task": {"task": CELERY_RECORD, "kwargs": {"folder": "/tmp"}, "cron": "0 * * * *"},
    }
    started = server_now(using).replace(microsecond=0) - datetime.timedelta(minutes=1)
    ledger.create(
        job_name="django-task", period="2026-01-01T00:00:00", status=Status.ENQUEUED,
        started_at=started, task_id="1234",
    )  # fmt: skip
    table, listing = io.StringIO(), io.StringIO()
    with settings_with(schedule):
        assert [m for m in run_checks() if m.id.startswith("advisory_lock.")] == []
        call_command("run_jobs", "--list", "--database", using, stdout=table)
        call_command("run_jobs", "--list", "--json", "--database", using, stdout=listing)
    lines = table.getvalue().splitlines()
    assert any(line.startswith("django-task ") and "enqueued" in line for line in lines), lines
    assert any(line.startswith("celery-task ") and "0 * * * *" in line for line in lines)
    rows = {row["name"]: row for row in json.loads(listing.getvalue())}
    assert rows["django-task"]["schedule"] == "every 30s"
    assert rows["django-task"]["last_status"] == "enqueued"
    assert rows["celery-task"]["last_status"] is None
