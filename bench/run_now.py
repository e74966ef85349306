"""The latency of a run-now request on PostgreSQL: LISTEN/NOTIFY against polling.

    .venv/bin/python bench/run_now.py [--requests 20] [--schedulers 1] [--poll-interval 1]
                                      [--only listen,polling] [--seed 1] [--keep]

A fresh ``bench_run_now`` database on the PostgreSQL server of the bench scripts
(``bench/servers.py``). For each variant, ``--schedulers`` processes of ``manage.py run_jobs
--poll-interval SECONDS`` run one entry, ``target`` (``every`` an hour or more, so that no
slot of it falls due during the run); once its first scheduled run is over, ``--requests``
run-now requests are made one after the other: each once every job process started for the
previous one has ended, in a later second of the database's clock (two requests in one
second would be one slot), and after a random pause of up to ``--poll-interval`` (seeded,
``--seed``): a request made just after a run ended would come at the same point of the
schedulers' poll cycle every time (the poll that started that run), and polling would look
slower than it is.

The job (``target``) records, first thing, the database server's clock and how long ago its
process was forked (``/proc``: 10 ms resolution). Per request:

- request -> job start: the job's clock minus the request's ``requested_at`` (both the
  database server's clock): what an operator waits for. It includes the scheduler noticing
  the request, forking the job process, and the job process taking the entry's lock (a
  connection of its own) and claiming the slot (its ``job_runs`` row);
- request -> claim: the run's ``job_runs.started_at`` minus ``requested_at``;
- fork -> job start: the job process's age when the job started (lock and claim included);
- request -> fork: request -> job start minus fork -> job start (the scheduler's part: it
  mixes the server's clock and this host's, the server runs on this host).

Variants (the same schedulers, listening on the ledger's database in both):

- ``listen``: ``advisory_lock.scheduling.control.request_run`` (what ``run_jobs --run-now`` and the
  admin call): its row and its NOTIFY, in one transaction; the notification makes the
  schedulers look for requests at once;
- ``polling``: the same row, written as ``request_run`` writes it but without the NOTIFY
  (as before the notifications existed): the schedulers see it at their next poll, every
  ``--poll-interval``.

No setting makes a scheduler poll without listening and still run its jobs: the one that
stops the listening, ``POOL_MODE`` "transaction" on the alias the scheduler listens through
(its ``DIRECT_ALIAS``; system check W002), makes every job process refuse the session lock
it takes there; and a ``DIRECT_ALIAS`` to another database takes the ledger's writes there
too. Announcing the request or not is the one difference between the variants here.

The script checks in ``pg_stat_activity`` that every scheduler listens on the ledger's
database (one session each) before it measures. Variants run one after the other (the
machine's load may differ between them: compare within one run of the script).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import library_revision  # noqa: E402
from servers import SCHEDULER_SETTINGS  # noqa: E402

from bench.servers import PG_PARAMS  # noqa: E402
from testproject.database_url import parse  # noqa: E402

T = TypeVar("T")
DATABASE = "bench_run_now"
SERVER = f"postgres://{PG_PARAMS['user']}@{PG_PARAMS['host']}:{PG_PARAMS['port']}"
LEDGER_URL = f"{SERVER}/{DATABASE}"
ENTRY = "target"
LISTENER = "%listener (advisory_lock)%"
HANG = 120  # seconds: only a hang waits this long
VARIANTS = ("listen", "polling")
SETTINGS = SCHEDULER_SETTINGS
JOBS = """
import json
import os

from django.db import connection


def started():
    \"\"\"Record the database's clock and this process's age (since its fork), at once.\"\"\"
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # the start, since boot
        age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        (clock,) = cursor.fetchone()
    from advisory_lock import JobRun

    slot = JobRun.objects.get(pid=os.getpid(), status=JobRun.Status.RUNNING).period
    line = json.dumps({"slot": slot, "clock": clock.isoformat(), "age": age}) + "\\n"
    fd = os.open(os.path.join(os.environ["JOBS_DIR"], "starts.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
"""

settings.configure(
    USE_TZ=True,
    TIME_ZONE="UTC",
    SECRET_KEY="bench",
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
    DATABASES={"default": {}, "pg": parse(LEDGER_URL, None)},
    ADVISORY_LOCK={"NAMESPACE": "bench"},
)
django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from advisory_lock import JobRun  # noqa: E402
from advisory_lock.backends import inspector_for  # noqa: E402
from advisory_lock.scheduling.control import JobControl  # noqa: E402
from advisory_lock.scheduling.control import manual_slot  # noqa: E402
from advisory_lock.scheduling.control import request_run  # noqa: E402
from advisory_lock.scheduling.liveness import SchedulerHeartbeat  # noqa: E402

ALIAS = "pg"
RUN_JOBS = [sys.executable, str(ROOT / "manage.py"), "run_jobs"]


def wait_for(condition: Callable[[], T], what: str, timeout: float = HANG) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise SystemExit(f"not within {timeout}s: {what}")


def server(sql: str) -> None:
    import psycopg

    params = {**PG_PARAMS, "dbname": "postgres"}
    with psycopg.connect(**params, autocommit=True) as connection:
        connection.execute(sql)


def recreate_database() -> None:
    server(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    server(f"CREATE DATABASE {DATABASE}")
    call_command("migrate", database=ALIAS, verbosity=0)


def drop_database() -> None:
    connections[ALIAS].close()
    server(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")


def now() -> datetime.datetime:
    return inspector_for(connections[ALIAS]).database_now()


def long_interval(margin: float = 900) -> int:
    """An ``every`` of an hour or more whose current slot stays the latest for ``margin``
    seconds (the database's clock): no slot falls due during the run."""
    epoch = now().timestamp()
    every = 3600
    while epoch % every > every - margin:
        every += 1
    return every


def listeners() -> list[int]:
    """The OS pids of the processes listening on the ledger's database (their
    application_name)."""
    with connections[ALIAS].cursor() as cursor:
        cursor.execute(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE %s AND query = %s",
            [DATABASE, LISTENER, 'LISTEN "advisory_lock"'],
        )
        names = [name for (name,) in cursor.fetchall()]
    return sorted(int(name.split()[0].removeprefix("pid=")) for name in names)


class Fleet:
    """``run_jobs`` processes of one variant, each in a session of its own."""

    def __init__(self, folder: Path, variant: str, schedule: dict, poll_interval: float) -> None:
        self.variant = variant
        self.folder = folder / variant
        self.folder.mkdir()
        self.poll_interval = poll_interval
        self.processes: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench_run_now_settings",
            "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}",
            "DATABASE_URL": LEDGER_URL,
            "SCHEDULE": json.dumps(schedule),
            "JOBS_DIR": str(self.folder),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> subprocess.Popen:
        number = len(self.processes)
        with (
            open(self.folder / f"run_jobs.{number}.out", "w") as out,
            open(self.folder / f"run_jobs.{number}.err", "w") as err,
        ):
            process = subprocess.Popen(
                [*RUN_JOBS, "--poll-interval", f"{self.poll_interval:g}"],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def output(self) -> str:
        return "".join(
            (self.folder / f"run_jobs.{number}.out").read_text()
            for number in range(len(self.processes))
        )

    def all_ended(self, slot: str) -> bool:
        """Has every job process started for ``slot`` ended (one of them succeeded)?"""
        text = self.output()
        run = f"{ENTRY} [{slot}]"
        ends = sum(text.count(f"{run} {how}") for how in ("succeeded", "skipped", "failed"))
        return text.count(f"{run} succeeded.") == 1 and text.count(f"{run} started") == ends

    def starts(self) -> dict[str, dict]:
        path = self.folder / "starts.jsonl"
        if not path.exists():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return {record["slot"]: record for record in records}

    def wait_for(self, condition: Callable[[], T], what: str) -> T:
        """``wait_for(condition)``, stopping at once if a scheduler exits."""

        def met() -> T:
            if any(process.poll() is not None for process in self.processes):
                raise SystemExit(f"{self.variant}: a scheduler exited; see its log (--keep)")
            return condition()

        return wait_for(met, f"{self.variant}: {what}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)
        for process in self.processes:  # whatever is left of a session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Sample:
    to_start: float  # request -> job start (the database's clock)
    to_claim: float  # request -> job_runs.started_at (the database's clock)
    fork_to_start: float  # the job process's age at the job's start (this host)

    @property
    def to_fork(self) -> float:
        return self.to_start - self.fork_to_start


def unannounced_request(job_name: str, requested_by: str) -> JobControl:
    """The row ``request_run`` writes, without its NOTIFY: seen by polling only."""
    requested_at = now()
    return JobControl.objects.using(ALIAS).create(
        job_name=job_name,
        action=JobControl.Action.RUN_NOW,
        requested_at=requested_at,
        requested_by=requested_by,
        slot=manual_slot(requested_at),
    )


def one_request(
    fleet: Fleet, previous: datetime.datetime, pause: float
) -> tuple[Sample, datetime.datetime]:
    """Request a run in a later second than ``previous``, ``pause`` seconds after that; wait
    until every job process started for it has ended. Return the sample and the request's
    time."""
    wait_for(
        lambda: now().replace(microsecond=0) > previous.replace(microsecond=0), "the next second"
    )
    time.sleep(pause)
    if fleet.variant == "listen":
        request = request_run(ALIAS, ENTRY, "bench/run_now.py")
    else:
        request = unannounced_request(ENTRY, "bench/run_now.py")
    start = fleet.wait_for(lambda: fleet.starts().get(request.slot), f"the run of {request.slot}")
    fleet.wait_for(lambda: fleet.all_ended(request.slot), f"the end of {request.slot}")
    run = JobRun.objects.using(ALIAS).get(period=request.slot, status="succeeded")
    clock = datetime.datetime.fromisoformat(start["clock"])
    sample = Sample(
        to_start=(clock - request.requested_at).total_seconds(),
        to_claim=(run.started_at - request.requested_at).total_seconds(),
        fork_to_start=start["age"],
    )
    return sample, request.requested_at


def measure(
    folder: Path,
    variant: str,
    requests: int,
    schedulers: int,
    poll_interval: float,
    rng: random.Random,
) -> list[Sample]:
    ledger = JobRun.objects.using(ALIAS)
    schedule = {ENTRY: {"callable": "bench_run_now_jobs.started", "every": long_interval()}}
    fleet = Fleet(folder, variant, schedule, poll_interval)
    try:
        pids = sorted(fleet.start().pid for _ in range(schedulers))
        beats = SchedulerHeartbeat.objects.using(ALIAS)
        fleet.wait_for(
            lambda: sorted(beats.filter(pid__in=pids).values_list("pid", flat=True)) == pids,
            "a heartbeat of every scheduler",
        )
        succeeded = ledger.filter(job_name=ENTRY, status="succeeded")
        first = fleet.wait_for(succeeded.first, "the first scheduled run")
        fleet.wait_for(lambda: fleet.all_ended(first.period), "the first run's job processes")
        fleet.wait_for(lambda: listeners() == pids, "a listening session per scheduler")
        samples = []
        previous = first.started_at
        for _ in range(requests):
            pause = rng.uniform(0, poll_interval)
            sample, previous = one_request(fleet, previous, pause)
            samples.append(sample)
        return samples
    finally:
        fleet.stop()
        for model in (JobRun, JobControl, SchedulerHeartbeat):
            model.objects.using(ALIAS).all().delete()


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def cell(values: list[float]) -> str:
    ms = [value * 1000 for value in values]
    return f"{percentile(ms, 0.5):.0f} / {percentile(ms, 0.9):.0f} / {max(ms):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=1, help="the pauses before the requests")
    parser.add_argument("--keep", action="store_true", help="keep the schedulers' logs")
    args = parser.parse_args()
    variants = args.only.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--only: unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-bench-run-now-"))
    (folder / "bench_run_now_settings.py").write_text(SETTINGS)
    (folder / "bench_run_now_jobs.py").write_text(JOBS)
    print(
        f"bench/run_now.py, {library_revision()}, {args.schedulers} scheduler(s), "
        f"--poll-interval {args.poll_interval:g}, {args.requests} requests per variant, "
        f"seed {args.seed}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    results = {}
    try:
        recreate_database()
        for variant in variants:
            rng = random.Random(args.seed)  # the same pauses for every variant
            results[variant] = measure(
                folder, variant, args.requests, args.schedulers, args.poll_interval, rng
            )
    finally:
        drop_database()
        if args.keep:
            print(f"logs: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"load at the end {os.getloadavg()[0]:.2f}; milliseconds, p50 / p90 / max:\n")
    print(
        "| variant | requests | request → job start | request → claim | request → fork "
        "| fork → job start |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for variant, samples in results.items():
        print(
            f"| {variant} | {len(samples)} | {cell([s.to_start for s in samples])} | "
            f"{cell([s.to_claim for s in samples])} | {cell([s.to_fork for s in samples])} | "
            f"{cell([s.fork_to_start for s in samples])} |"
        )
    mean = {variant: statistics.mean(s.to_start for s in results[variant]) for variant in results}
    print(
        "\nmean request → job start: "
        + ", ".join(f"{v} {m * 1000:.0f} ms" for v, m in mean.items())
    )


if __name__ == "__main__":
    main()
