"""Every ledger feature with ``USE_TZ = False``, on every database, in real processes.

With ``USE_TZ = False`` Django stores and reads datetimes naive, in ``TIME_ZONE``, and its
SQLite and MySQL backends refuse an aware one ("... does not support timezone-aware datetimes
when USE_TZ is False"). The processes run with ``tests.use_tz_false_settings``: ``TIME_ZONE``
is UTC+14 and the ledger's time zone UTC-11, so a slot named in the wrong zone, or a time
stored in the wrong one, can't pass. Each test brackets what a process wrote between two
readings of the database server's clock taken before and after it (the clock the ledger
uses), and checks the stored value's wall time in ``TIME_ZONE`` against them, exactly. The
same for ``enqueue_unique``'s marks, and for a ``task`` entry whose task a ``db_worker`` (with
the same settings) runs; and the admin's timeline shows times in ``TIME_ZONE``.

This test process runs with the usual settings (``USE_TZ = True``), so it reads the stored
datetimes with raw SQL: as the database holds them, not as its own settings would read them.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import uuid
import zoneinfo
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import connections

from advisory_lock.models import EntrySeen
from advisory_lock.models import JobControl
from advisory_lock.models import JobRun
from advisory_lock.models import SchedulerHeartbeat
from advisory_lock.tasks import PendingTask
from testproject.example.models import Counter
from tests import use_tz_false_settings
from tests.processes import Worker
from tests.processes import Workers
from tests.schedulers import HANG
from tests.schedulers import JOBS
from tests.schedulers import server_now
from tests.schedulers import wait_for
from tests.taskapp.services import WorkerProcess
from tests.taskapp.services import missing

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = use_tz_false_settings.__name__
STORED_ZONE = zoneinfo.ZoneInfo(use_tz_false_settings.TIME_ZONE)
LEDGER_ZONE = zoneinfo.ZoneInfo(use_tz_false_settings.LEDGER_TIME_ZONE)
UTC = datetime.timezone.utc
SUCCEEDED = JobRun.Status.SUCCEEDED
LEDGER_CHILD = "tests.ledger_child"


@pytest.fixture
def cleanup(using):
    """Empties, after the test, the tables that its processes write to on ``using``."""
    yield
    for model in (JobRun, JobControl, SchedulerHeartbeat, Counter, PendingTask, EntrySeen):
        model.objects.using(using).all().delete()


def environment(using: str, folder: Path, schedule: dict | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": using,
        "ADVISORY_LOCK_TEST_SCHEDULE": json.dumps(schedule or {}),
        "ADVISORY_LOCK_TEST_JOBS_DIR": str(folder),
        "PYTHONUNBUFFERED": "1",
    }


def manage(using: str, folder: Path, *argv: str, schedule: dict | None = None):
    """Run ``manage.py *argv`` with USE_TZ = False on ``using``; its CompletedProcess."""
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env=environment(using, folder, schedule),
        capture_output=True,
        text=True,
        timeout=HANG,
    )


def ok(process: subprocess.CompletedProcess, status: int = 0) -> str:
    """The process's stdout, once it is known to have exited with ``status``."""
    assert process.returncode == status, (process.returncode, process.stdout, process.stderr)
    assert "Traceback" not in process.stderr, process.stderr
    return process.stdout


def wall(moment: datetime.datetime) -> datetime.datetime:
    """``moment`` (aware) as Django stores it with USE_TZ = False: naive, in TIME_ZONE."""
    return moment.astimezone(STORED_ZONE).replace(tzinfo=None)


def stored(
    using: str, table: str, columns: str, pk: object, key: str = "id"
) -> tuple[datetime.datetime, ...]:
    """The datetime ``columns`` of a row (``key`` = ``pk``) as the database holds them, as
    naive wall times in TIME_ZONE: SQLite returns text, MySQL a naive datetime, PostgreSQL
    (timestamptz) an instant, shown here in TIME_ZONE."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {table} WHERE {key} = %s", [pk])
        row = cursor.fetchone()
    values = []
    for value in row:
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is not None:
            value = wall(value)
        values.append(value)
    return tuple(values)


def day(moment: datetime.datetime, zone: zoneinfo.ZoneInfo) -> str:
    return f"{moment.astimezone(zone):%Y-%m-%d}"


def assert_recorded_between(using, run, before, after) -> None:
    """``run`` (a JobRun row) succeeded between the server's clock readings ``before`` and
    ``after``: stored in TIME_ZONE's wall time, its duration within that span, its daily
    slot the ledger's day."""
    started, finished = stored(using, "job_runs", "started_at, finished_at", run.pk)
    assert wall(before) <= started <= finished <= wall(after)
    assert run.status == SUCCEEDED
    assert datetime.timedelta(0) <= run.duration <= after - before


def settled_every(using: str, margin: float = 150) -> int:
    """An ``every`` of about an hour whose latest slot fell due at least ``margin`` seconds
    ago and whose next falls due at least ``margin`` seconds from now (server clock): the
    same slot is the latest due one for the whole test."""
    now = server_now(using).timestamp()
    every = 3600
    while not margin <= now % every <= every - margin:
        every += 1
    return every


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
def test_run_once_records_its_slot_and_times(using, cleanup, atomic):
    job = f"naive-{'atomic' if atomic else 'plain'}"
    block = ["atomic", job, job] if atomic else ["run-once", job]
    env = Workers({"DJANGO_SETTINGS_MODULE": SETTINGS}).env
    started: list[Worker] = []

    def start() -> Worker:
        started.append(Worker(["--using", using, *block, "--period", "daily"], env, LEDGER_CHILD))
        return started[-1]

    try:
        before = server_now(using)
        first = start()
        claimed = first.expect("wrote" if atomic else "running")
        first.send("go")
        first.expect("leaving")
        first.expect("done")
        first.finish()
        after = server_now(using)
        # The slot is done: the next run finds it so, from the rows it reads back.
        again = start()
        again.expect("skipped")
        again.finish()
    finally:
        for worker in started:
            worker.kill()
    run = JobRun.objects.using(using).get(pk=claimed["pk"])
    assert_recorded_between(using, run, before, after)
    assert run.period in {day(before, LEDGER_ZONE), day(after, LEDGER_ZONE)}
    assert run.period != day(after, STORED_ZONE)  # the ledger's day, not TIME_ZONE's
    assert Counter.objects.using(using).filter(name=job).count() == int(atomic)


def test_a_single_instance_command_with_a_ledger_runs_once_per_slot(using, cleanup, tmp_path):
    before = server_now(using)
    assert "finished" in ok(manage(using, tmp_path, "ledger_job"))
    after = server_now(using)
    again = manage(using, tmp_path, "ledger_job")
    assert again.returncode == 3 and "finished" not in again.stdout, again.stderr
    assert "already done" in again.stderr and "Traceback" not in again.stderr
    [run] = JobRun.objects.using(using).filter(job_name="lockapp.ledger_job")
    assert_recorded_between(using, run, before, after)
    assert run.period in {day(before, LEDGER_ZONE), day(after, LEDGER_ZONE)}


def test_run_jobs_once_and_the_job_runs_reports(using, cleanup, tmp_path):
    every = settled_every(using)
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": every, "grace": 1}}
    now = server_now(using)
    due = datetime.datetime.fromtimestamp(now.timestamp() // every * every, UTC)
    slot = f"{due.astimezone(LEDGER_ZONE):%Y-%m-%dT%H:%M}"

    # Nothing ran yet: the entry is overdue, and no scheduler has ever been alive.
    overdue = manage(using, tmp_path, "job_runs", "--overdue", "--json", schedule=schedule)
    [late] = json.loads(ok(overdue, status=1))
    assert (late["job"], late["missing_slot"]) == ("tick", slot)
    assert datetime.datetime.fromisoformat(late["slot_ended_at"]) == due
    assert "no scheduler alive" in late["reason"]
    dead = manage(using, tmp_path, "run_jobs", "--check", schedule=schedule)
    assert dead.returncode == 1 and "no scheduler alive" in dead.stderr, dead.stderr

    before = server_now(using)
    assert "succeeded" in ok(manage(using, tmp_path, "run_jobs", "--once", schedule=schedule))
    after = server_now(using)
    [run] = JobRun.objects.using(using).filter(job_name="tick")
    assert run.period == slot
    assert_recorded_between(using, run, before, after)
    # The scheduler noted when it first loaded the entry: TIME_ZONE's wall time too.
    (first_seen,) = stored(using, "job_entries_seen", "first_seen", "tick", key="job_name")
    assert wall(before) <= first_seen <= wall(after)
    # The slot is done: a second --once finds it so and runs nothing.
    ok(manage(using, tmp_path, "run_jobs", "--once", schedule=schedule))
    assert JobRun.objects.using(using).filter(job_name="tick").count() == 1

    done = manage(using, tmp_path, "job_runs", "--overdue", schedule=schedule)
    assert "No declared job is overdue." in ok(done)
    listing = ok(manage(using, tmp_path, "job_runs", "--job", "tick", schedule=schedule))
    (started,) = stored(using, "job_runs", "started_at", run.pk)
    started_utc = started.replace(tzinfo=STORED_ZONE).astimezone(UTC)
    assert f"{started_utc:%Y-%m-%d %H:%M:%S}" in listing  # its column says "started (UTC)"
    timeline = manage(
        using, tmp_path, "job_runs", "--timeline", "tick", "--json", schedule=schedule
    )
    slots = {row["slot"]: row for row in json.loads(ok(timeline))}
    assert slots[slot]["outcome"] == SUCCEEDED
    assert datetime.datetime.fromisoformat(slots[slot]["started"]) == started_utc
    listed = manage(using, tmp_path, "run_jobs", "--list", "--json", schedule=schedule)
    [entry] = json.loads(ok(listed))
    assert (entry["last_slot"], entry["last_status"]) == (slot, SUCCEEDED)
    assert datetime.datetime.fromisoformat(entry["last_started"]) == started_utc
    pruned = manage(using, tmp_path, "job_runs", "--prune", "--older-than", "1", schedule=schedule)
    ok(pruned)
    assert JobRun.objects.using(using).filter(job_name="tick").count() == 1


def test_a_live_scheduler_its_status_check_pause_and_run_now(using, cleanup, tmp_path):
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": settled_every(using)}}
    before = server_now(using)
    with (tmp_path / "run_jobs.err").open("w") as err:
        scheduler = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "run_jobs"],
            cwd=ROOT,
            env=environment(using, tmp_path, schedule),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        heartbeats = SchedulerHeartbeat.objects.using(using).filter(pid=scheduler.pid)
        wait_for(
            lambda: heartbeats.exists() or scheduler.poll() is not None,
            "the scheduler's heartbeat",
        )
        assert scheduler.poll() is None, (tmp_path / "run_jobs.err").read_text()

        alive = manage(using, tmp_path, "run_jobs", "--check", schedule=schedule)
        assert "scheduler(s) alive" in ok(alive)
        status = manage(using, tmp_path, "run_jobs", "--status", "--json", schedule=schedule)
        after = server_now(using)
        [row] = [row for row in json.loads(ok(status)) if row["pid"] == scheduler.pid]
        started = datetime.datetime.fromisoformat(row["started"])
        seen = datetime.datetime.fromisoformat(row["last_seen"])
        assert before <= started <= seen <= after
        table = manage(using, tmp_path, "run_jobs", "--status", schedule=schedule)
        assert str(scheduler.pid) in ok(table)

        paused = manage(using, tmp_path, "run_jobs", "--pause", "tick", schedule=schedule)
        assert "tick paused" in ok(paused)
        resumed = manage(using, tmp_path, "run_jobs", "--resume", "tick", schedule=schedule)
        assert "tick resumed" in ok(resumed)

        asked = server_now(using)
        requested = manage(using, tmp_path, "run_jobs", "--run-now", "tick", schedule=schedule)
        out = ok(requested)
        manual = out.split("requested as slot ", 1)[1].split(";", 1)[0]
        assert manual.startswith("manual:") and manual.endswith("-11:00"), manual
        assert datetime.datetime.fromisoformat(manual.removeprefix("manual:")) >= asked.replace(
            microsecond=0
        )
        runs = JobRun.objects.using(using).filter(job_name="tick", period=manual)
        wait_for(
            lambda: runs.filter(status=SUCCEEDED).exists() or scheduler.poll() is not None,
            "the run-now slot's success",
        )
        assert scheduler.poll() is None, (tmp_path / "run_jobs.err").read_text()
        timeline = manage(using, tmp_path, "job_runs", "--timeline", "tick", schedule=schedule)
        assert manual in ok(timeline)
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(HANG) == 0
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
            scheduler.wait()
    errors = (tmp_path / "run_jobs.err").read_text()
    assert "Traceback" not in errors and "Error" not in errors, errors


#: ``run_once`` in a process whose settings come from ``settings.configure()`` (Django then
#: leaves the process's own time zone alone: the TZ variable, here UTC, not TIME_ZONE), on the
#: alias ``argv[1]``, for the job ``argv[2]``; it prints the run's pk.
CONFIGURED = """
import sys

import django
from django.conf import settings

from tests import use_tz_false_settings as values

settings.configure(**{name: getattr(values, name) for name in dir(values) if name.isupper()})
django.setup()

from advisory_lock import run_once

with run_once(sys.argv[2], period="daily", using=sys.argv[1]) as run:
    print(run.pk)
"""


def test_run_once_with_settings_configure_in_a_process_of_another_time_zone(
    using, cleanup, tmp_path
):
    env = {**environment(using, tmp_path), "TZ": "UTC"}
    del env["DJANGO_SETTINGS_MODULE"]
    before = server_now(using)
    child = subprocess.run(
        [sys.executable, "-c", CONFIGURED, using, "configured"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    after = server_now(using)
    run = JobRun.objects.using(using).get(pk=int(ok(child)))
    assert_recorded_between(using, run, before, after)
    assert run.period in {day(before, LEDGER_ZONE), day(after, LEDGER_ZONE)}


# enqueue_unique's marks, and the task entries of the schedule, on django-tasks-db.


@pytest.fixture
def task_queue(using, monkeypatch):
    """A django-tasks-db queue of this test's own on ``using``: its name (in the environment
    of the processes the test starts, where tests/taskapp/schedule_tasks.py reads it) and its
    rows, removed at the end."""
    if "django_tasks_db" not in settings.INSTALLED_APPS:
        missing("django-tasks-db (and on Django 5.2 django-tasks) is not installed")
    from django_tasks_db.models import DBTaskResult

    name = f"naive-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("ADVISORY_LOCK_TEST_QUEUE", name)
    rows = DBTaskResult.objects.using(using).filter(queue_name=name)
    yield SimpleNamespace(name=name, rows=rows)
    rows.delete()


#: ``enqueue_unique`` of ``tests.taskapp.tasks.unique_job`` on the queue ``argv[1]`` with the
#: key ``argv[2]`` and the pending_timeout ``argv[3]``; it prints the id it got back.
ENQUEUE = """
import sys

import django

django.setup()

from advisory_lock.tasks import enqueue_unique
from tests.taskapp.tasks import unique_job

task = unique_job.using(queue_name=sys.argv[1])
timeout = float(sys.argv[3])
result = enqueue_unique(task, "unused", "unused", key=sys.argv[2], pending_timeout=timeout)
print(result.id)
"""


def enqueue(using: str, folder: Path, queue: str, key: str, pending_timeout: float) -> str:
    """``enqueue_unique`` in a process with USE_TZ = False; the task id it returned."""
    child = subprocess.run(
        [sys.executable, "-c", ENQUEUE, queue, key, str(pending_timeout)],
        cwd=ROOT,
        env=environment(using, folder),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    return ok(child).strip()


def test_enqueue_unique_marks_a_pending_task_and_prune_deletes_it_once_expired(
    using, cleanup, task_queue, tmp_path
):
    """No worker runs: the task stays pending. A second call (another process) within the
    pending window returns it and enqueues nothing; the mark's times are stored as wall
    times in TIME_ZONE; once a mark has expired by the server's clock, prune deletes it and
    keeps the live one."""
    hour = 3600
    before = server_now(using)
    first = enqueue(using, tmp_path, task_queue.name, "naive-live", hour)
    after = server_now(using)
    again = enqueue(using, tmp_path, task_queue.name, "naive-live", hour)
    assert again == first
    assert [str(pk) for pk in task_queue.rows.values_list("id", flat=True)] == [first]
    [live] = PendingTask.objects.using(using).filter(key="naive-live")
    assert live.task_id == first
    enqueued_at, expires_at = stored(using, "task_pending", "enqueued_at, expires_at", live.pk)
    assert wall(before) <= enqueued_at <= wall(after)
    assert expires_at - enqueued_at == datetime.timedelta(seconds=hour)

    brief = enqueue(using, tmp_path, task_queue.name, "naive-brief", 1)
    [expiring] = PendingTask.objects.using(using).filter(key="naive-brief")
    assert expiring.task_id == brief != first
    (ends,) = stored(using, "task_pending", "expires_at", expiring.pk)
    ends_at = ends.replace(tzinfo=STORED_ZONE)
    wait_for(lambda: server_now(using) > ends_at, "the brief mark's expiry, by the server's clock")
    pruned = manage(using, tmp_path, "job_runs", "--prune", "--older-than", "1")
    assert "expired enqueue_unique mark(s)" in ok(pruned)
    assert list(PendingTask.objects.using(using).values_list("key", flat=True)) == ["naive-live"]


def db_worker(using: str, queue: str, folder: Path) -> WorkerProcess:
    """django-tasks-db's ``db_worker`` on ``queue``, with USE_TZ = False (as the project's
    other processes: tests/taskapp/services.py's start their workers with the usual
    settings)."""
    name = f"w-{queue}"
    options = f"--queue-name {queue} --worker-id {name} --interval 0.05 --no-startup-delay"
    args = [sys.executable, "-m", "django", "db_worker", *options.split(), "--no-reload"]
    return WorkerProcess(name, args, environment(using, folder), folder)


def test_a_task_entry_run_by_run_jobs_once_ends_succeeded(using, cleanup, task_queue, tmp_path):
    """A ``task`` entry's slot is enqueued by ``run_jobs --once``, run by a db_worker, and
    recorded succeeded by the next ``--once``, which reads the task's end from the queue
    (django.tasks' ``finished_at``, naive in TIME_ZONE)."""
    folder = tmp_path / "runs"
    folder.mkdir()
    record = "tests.taskapp.schedule_tasks.record"
    entry = {"task": record, "kwargs": {"folder": str(folder)}, "every": settled_every(using)}
    schedule = {"naive-task": entry}
    runs = JobRun.objects.using(using).filter(job_name="naive-task")
    worker = db_worker(using, task_queue.name, tmp_path)
    try:
        worker.wait_for("Starting worker")
        before = server_now(using)
        ok(manage(using, tmp_path, "run_jobs", "--once", schedule=schedule))
        [run] = runs.all()
        assert run.status == JobRun.Status.ENQUEUED and run.task_id, (run.status, run.error)
        wait_for(
            lambda: task_queue.rows.filter(status="SUCCESSFUL").exists(), "the task's success"
        )
    finally:
        worker.stop()
    out = ok(manage(using, tmp_path, "run_jobs", "--once", schedule=schedule))
    after = server_now(using)
    assert f"task {run.task_id} succeeded" in out, out
    [run] = runs.all()  # read again; the slot was not enqueued again
    assert_recorded_between(using, run, before, after)
    [result] = task_queue.rows
    assert uuid.UUID(str(result.id)) == uuid.UUID(run.task_id)


#: The admin's timeline page of the entry ``argv[1]``, as a logged-in superuser sees it,
#: through Django's test client: its status and its HTML, as JSON.
ADMIN_PAGE = """
import json
import os
import sys

import django

django.setup()

from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment
from django.urls import reverse

setup_test_environment()  # the test client's host, "testserver", is allowed
user = User.objects.create_superuser(f"naive-{os.getpid()}", password="unused")
try:
    client = Client()
    client.force_login(user)
    page = client.get(reverse("admin:advisory_lock_jobrun_timeline"), {"entry": sys.argv[1]})
finally:
    user.delete()
print(json.dumps({"status": page.status_code, "html": page.content.decode()}))
"""


def test_the_admin_timeline_shows_the_start_in_time_zone(using, cleanup, tmp_path):
    """With USE_TZ = False the fields hold wall times in TIME_ZONE: the timeline's start of a
    run is its wall time in TIME_ZONE, as the job runs' list shows the field, not UTC's."""
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": settled_every(using)}}
    ok(manage(using, tmp_path, "run_jobs", "--once", schedule=schedule))
    [run] = JobRun.objects.using(using).filter(job_name="tick")
    (started,) = stored(using, "job_runs", "started_at", run.pk)
    page = subprocess.run(
        [sys.executable, "-c", ADMIN_PAGE, "tick"],
        cwd=ROOT,
        env=environment(using, tmp_path, schedule),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    answer = json.loads(ok(page))
    assert answer["status"] == 200, answer["html"]
    utc = started.replace(tzinfo=STORED_ZONE).astimezone(UTC).replace(tzinfo=None)
    # The admin's one format: the wall time to the second (the page names the zone once).
    local_text, utc_text = (f"{moment:%Y-%m-%d %H:%M:%S}" for moment in (started, utc))
    assert local_text in answer["html"] and utc_text not in answer["html"], (local_text, utc_text)
