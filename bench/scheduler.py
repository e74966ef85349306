"""A fleet of ``run_jobs`` schedulers for minutes: each slot once, none missed, no overlap.

    .venv/bin/python bench/scheduler.py [--schedulers 8] [--seconds 120] [--kill-every 20]
                                        [--instances 64] [--seed 1]
                                        [--only sqlite,postgresql,mysql]

On each database (a fresh ``bench_scheduler`` database per server, a temporary file for
SQLite), ``--schedulers`` processes of ``manage.py run_jobs`` run one schedule for
``--seconds``:

- ``tick``: every second, a 0.2 s job (tests/schedule_jobs.py ``tick``);
- ``work``: every 3 seconds, a 2 s job (``nap``), ``retries: 1``.

Every ``--kill-every`` seconds (with a seeded jitter) one scheduler that is running a
``work`` job at that moment is killed with SIGKILL, as long as more than two are left
(there are no restarts). Each job records its slot, pid and ``time.monotonic()`` start and
end; the ledger says which slots succeeded. Reported per database and entry:

- ``slots``: the slots that fell due in the window (from the fleet's first run to the end,
  less one interval);
- ``runs``: succeeded rows; ``missing``: due slots without one; ``duplicates``: slots with
  more than one; ``overlaps``: two recorded runs of the entry overlapping in time;
- ``kills``: schedulers killed; the slowest death of a killed scheduler's job process after
  it (it must die with its scheduler); ``retried``: killed runs whose slot another
  scheduler ran again (attempt 2 succeeded); ``left running``: rows still ``running`` after
  the fleet stopped, and the other statuses.

Then ``--instances`` processes of ``run_jobs --once`` are started together on an entry whose
slot is due (a 2 s run): one run of the slot, the others skip (exit status 0).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import library_revision  # noqa: E402
from servers import SCHEDULER_SETTINGS  # noqa: E402

from testproject.database_url import parse  # noqa: E402

DATABASE = "bench_scheduler"
FOLDER = Path(tempfile.mkdtemp(prefix="advisory-lock-bench-scheduler-"))
URLS = {
    "sqlite": f"sqlite:///{FOLDER}/scheduler.sqlite3",
    "postgresql": f"postgres://postgres@127.0.0.1:5432/{DATABASE}",
    "mysql": f"mysql://root@127.0.0.1:3306/{DATABASE}",
}
SCHEDULE = {
    "tick": {"callable": "tests.schedule_jobs.tick", "every": 1},
    "work": {"callable": "tests.schedule_jobs.nap", "every": 3, "retries": 1},
}
SETTINGS = SCHEDULER_SETTINGS

settings.configure(
    USE_TZ=True,
    TIME_ZONE="UTC",
    SECRET_KEY="bench",
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
    DATABASES={"default": {}, **{alias: parse(url, None) for alias, url in URLS.items()}},
    ADVISORY_LOCK={"NAMESPACE": "bench"},
)
django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from advisory_lock import JobRun  # noqa: E402
from advisory_lock.backends import inspector_for  # noqa: E402
from tests.schedule_jobs import runs  # noqa: E402


def recreate_database(alias: str) -> None:
    if alias == "sqlite":
        return
    if alias == "postgresql":
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            c.execute(f"CREATE DATABASE {DATABASE}")
    else:
        import MySQLdb

        c = MySQLdb.connect(host="127.0.0.1", user="root")
        c.cursor().execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        c.cursor().execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
        c.close()


def drop_database(alias: str) -> None:
    connections[alias].close()
    if alias == "postgresql":
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    elif alias == "mysql":
        import MySQLdb

        c = MySQLdb.connect(host="127.0.0.1", user="root")
        c.cursor().execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        c.close()


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class Fleet:
    """``run_jobs`` processes on one database, each in a session of its own."""

    def __init__(self, alias: str, folder: str = "") -> None:
        self.alias = alias
        self.folder = FOLDER / (folder or alias)
        self.folder.mkdir()
        self.processes: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench_scheduler_settings",
            "PYTHONPATH": f"{FOLDER}{os.pathsep}{ROOT}",
            "DATABASE_URL": URLS[alias],
            "ADVISORY_LOCK_TEST_JOBS_DIR": str(self.folder),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, *argv: str, schedule: dict | None = None) -> subprocess.Popen:
        number = len(self.processes)
        env = {**self.env, "SCHEDULE": json.dumps(schedule or SCHEDULE)}
        with (
            open(self.folder / f"run_jobs.{number}.out", "w") as out,
            open(self.folder / f"run_jobs.{number}.err", "w") as err,
        ):
            process = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "run_jobs", *argv],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def running(self) -> list[subprocess.Popen]:
        return [process for process in self.processes if process.poll() is None]

    def stop(self) -> list[int | None]:
        for process in self.running():
            process.send_signal(signal.SIGTERM)
        statuses = []
        for process in self.processes:
            try:
                statuses.append(process.wait(90))
            except subprocess.TimeoutExpired:
                statuses.append(None)
        for process in self.processes:  # whatever is left of a session: its job processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        return statuses


def now(alias: str) -> datetime.datetime:
    return inspector_for(connections[alias]).database_now()


def run(
    alias: str,
    schedulers: int,
    seconds: float,
    kill_every: float,
    instances: int,
    rng: random.Random,
) -> dict:
    recreate_database(alias)
    call_command("migrate", database=alias, verbosity=0)
    ledger = JobRun.objects.using(alias)
    fleet = Fleet(alias)
    kills = []
    try:
        for _ in range(schedulers):
            fleet.start()
        deadline = time.monotonic() + 120
        while not ledger.filter(status="succeeded").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{alias}: no run within 120 s")
            time.sleep(0.1)
        window_start = now(alias)
        end = time.monotonic() + seconds
        next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
        while time.monotonic() < end:
            time.sleep(0.05)
            if time.monotonic() < next_kill or len(fleet.running()) <= 2:
                continue
            by_pid = {process.pid: process for process in fleet.running()}
            candidates = [
                (row, by_pid[parent_of(row.pid)])
                for row in ledger.filter(job_name="work", status="running")
                if parent_of(row.pid) in by_pid
            ]
            if not candidates:
                continue
            row, victim = rng.choice(candidates)
            victim.kill()
            killed = time.monotonic()
            while alive(row.pid) and time.monotonic() - killed < 10:
                time.sleep(0.005)
            kills.append(
                {"slot": row.period, "pid": row.pid, "died_after": time.monotonic() - killed}
            )
            next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
        window_end = now(alias)
    finally:
        statuses = fleet.stop()
    report = {
        "alias": alias,
        "schedulers": schedulers,
        "seconds": (window_end - window_start).total_seconds(),
        "exit statuses": collections.Counter(statuses),
        "kills": kills,
        "entries": {},
    }
    recorded = runs(fleet.folder)
    for name, entry in SCHEDULE.items():
        every = entry["every"]
        first = int(window_start.timestamp()) // every * every + every
        due = {
            f"{datetime.datetime.fromtimestamp(s, datetime.timezone.utc):%Y-%m-%dT%H:%M:%S}"
            for s in range(first, int(window_end.timestamp()) - every + 1, every)
        }
        rows = ledger.filter(job_name=name)
        succeeded = collections.Counter(
            rows.filter(status="succeeded").values_list("period", flat=True)
        )
        own = sorted((r for r in recorded if r["job"] == name), key=lambda r: r["start"])
        report["entries"][name] = {
            "slots": len(due),
            "runs": sum(succeeded[slot] for slot in due),
            "missing": sorted(due - set(succeeded)),
            "duplicates": sorted(slot for slot, count in succeeded.items() if count > 1),
            "overlaps": sum(b["start"] < a["end"] for a, b in pairwise(own)),
            "statuses": collections.Counter(rows.values_list("status", flat=True)),
            "retries": rows.filter(status="succeeded", attempt__gt=1).count(),
        }
    for kill in kills:
        attempts = dict(
            ledger.filter(job_name="work", period=kill["slot"]).values_list("attempt", "status")
        )
        kill["attempts"] = attempts
    report["once"] = once_fleet(alias, instances)
    drop_database(alias)
    return report


def once_fleet(alias: str, instances: int) -> dict:
    """``instances`` processes of ``run_jobs --once`` started together, on an entry whose
    slot is due (a 2 s run): one run, the others skip."""
    epoch = now(alias).timestamp()
    every = 3600
    while epoch % every > every - 300:  # the slot stays the latest one for 5 minutes
        every += 1
    schedule = {"fleet": {"callable": "tests.schedule_jobs.nap", "every": every}}
    fleet = Fleet(alias, f"{alias}-once")
    started = time.monotonic()
    processes = [fleet.start("--once", schedule=schedule) for _ in range(instances)]
    statuses = collections.Counter(process.wait(300) for process in processes)
    took = time.monotonic() - started
    rows = JobRun.objects.using(alias).filter(job_name="fleet")
    return {
        "instances": instances,
        "seconds": took,
        "exit statuses": statuses,
        "rows": collections.Counter(rows.values_list("status", flat=True)),
        "slots": rows.values("period").distinct().count(),
        "runs": len([r for r in runs(fleet.folder) if r["job"] == "fleet"]),
    }


def show(report: dict) -> None:
    alias = report["alias"]
    print(
        f"\n{alias}: {report['schedulers']} schedulers, {report['seconds']:.0f} s window, "
        f"exit statuses {dict(report['exit statuses'])}"
    )
    print("| entry | slots | runs | missing | duplicates | overlaps | retries | rows by status |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, entry in report["entries"].items():
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(entry["statuses"].items()))
        print(
            f"| {name} | {entry['slots']} | {entry['runs']} | {len(entry['missing'])} | "
            f"{len(entry['duplicates'])} | {entry['overlaps']} | {entry['retries']} | {statuses} |"
        )
    kills = report["kills"]
    retried = sum(kill["attempts"].get(2) == "succeeded" for kill in kills)
    left = sum("running" in kill["attempts"].values() for kill in kills)
    slowest = max((kill["died_after"] for kill in kills), default=0)
    print(
        f"kills: {len(kills)}; job process gone after its scheduler's SIGKILL within "
        f"{slowest:.3f} s at most; killed slots retried: {retried}; killed slots left "
        f"running: {left}"
    )
    for name, entry in report["entries"].items():
        if entry["missing"] or entry["duplicates"]:
            print(
                f"  {name}: missing {entry['missing'][:10]}, duplicates {entry['duplicates'][:10]}"
            )
    for kill in kills:
        print(f"  killed run of slot {kill['slot']}: attempts {kill['attempts']}")
    once = report["once"]
    print(
        f"run_jobs --once x {once['instances']} started together: {once['runs']} run(s) of "
        f"{once['slots']} due slot, rows {dict(once['rows'])}, exit statuses "
        f"{dict(once['exit statuses'])}, {once['seconds']:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedulers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--kill-every", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--instances", type=int, default=64, help="the run_jobs --once fleet")
    parser.add_argument("--only", default="sqlite,postgresql,mysql")
    parser.add_argument("--keep", action="store_true", help="keep the logs and run records")
    args = parser.parse_args()
    (FOLDER / "bench_scheduler_settings.py").write_text(SETTINGS)
    rng = random.Random(args.seed)
    load = os.getloadavg()[0]
    print(f"bench/scheduler.py, {library_revision()}, seed {args.seed}, load {load:.2f}")
    print(f"schedule: {json.dumps(SCHEDULE)}")
    try:
        for alias in args.only.split(","):
            report = run(
                alias, args.schedulers, args.seconds, args.kill_every, args.instances, rng
            )
            show(report)
    finally:
        if args.keep:
            print(f"logs and run records: {FOLDER}")
        else:
            shutil.rmtree(FOLDER, ignore_errors=True)


if __name__ == "__main__":
    main()
