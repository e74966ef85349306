"""A scheduler worker's run against the raw driver: what the library's run path costs, beside
the same statements sent by hand.

    .venv/bin/python bench/run_path.py [--processes 4] [--runs 300] [--rounds 3]
                                       [--only postgresql|mysql]

In a database of its own per server (``bench_run_path``, on the machine's servers),
``--processes`` processes at once each run ``--runs`` slots one after the other, as the
workers of one scheduler do at a boundary (4 by default, ``run_jobs``' default). Two sides,
measured in turn in each of ``--rounds`` rounds, in a random order:

- **library**: ``advisory_lock.scheduling.workers.run_slot``, set up as a worker is (its kept
  lock connection and its watchdog, the ledger's writes on its Django connection, the
  server's clock read once a second); the job does nothing;
- **raw**: the statements of such a run from the driver alone (psycopg, MySQLdb), on two
  connections in autocommit: the entry's lock try, the slot's INSERT, the check that the lock
  is still held, the end's UPDATE (fenced by the row's status), the unlock.

For each side: runs a second (all the processes, from the start signal to the last end), the
CPU per run in the client processes (user + system, ``getrusage``), and the ratio library /
raw; the median over the rounds. The server's CPU is not in it. The library's run sends the
same five statements (its server clock reads aside): the difference is the library's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from servers import MY_PARAMS
from servers import PG_PARAMS
from servers import create_database
from servers import databases

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "bench_run_path"
#: Django's DATABASES entry of each server (``bench/servers.py``), on this script's database.
SERVERS = {alias: {**entry, "NAME": DATABASE} for alias, entry in databases().items() if entry}
#: The raw side's statements, per server: (lock, insert, check, update, unlock).
RAW = {
    "postgresql": (
        "SELECT pg_try_advisory_lock(%s)",
        "INSERT INTO job_runs (job_name, period, status, started_at, host, pid, attempt, error, "
        "lock_key, task_id) VALUES (%s, %s, 'running', %s, %s, %s, 1, '', %s, '') RETURNING id",
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid = (%s::bigint >> 32)::oid AND objid = (%s::bigint & 4294967295)::oid "
        "AND objsubid = 1 AND pid = pg_backend_pid())",
        "UPDATE job_runs SET status = 'succeeded', error = '', finished_at = %s, duration = %s "
        "WHERE id = %s AND COALESCE(status, '') = 'running'",
        "SELECT pg_advisory_unlock(%s)",
    ),
    "mysql": (
        "SELECT GET_LOCK(%s, 0)",
        "INSERT INTO job_runs (job_name, period, status, started_at, host, pid, attempt, error, "
        "lock_key, task_id) VALUES (%s, %s, 'running', %s, %s, %s, 1, '', %s, '')",
        "SELECT IS_USED_LOCK(%s) = CONNECTION_ID()",
        "UPDATE job_runs SET status = 'succeeded', error = '', finished_at = %s, duration = %s "
        "WHERE id = %s AND COALESCE(status, '') = 'running'",
        "SELECT RELEASE_LOCK(%s)",
    ),
}


def nothing() -> None:
    """The job of the library's side."""


def configure(server: str) -> None:
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        SECRET_KEY="bench",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
        DATABASES={"default": SERVERS[server]},
        ADVISORY_LOCK={"NAMESPACE": "bench"},
    )
    django.setup()


# A child process: one side, --runs runs once the parent says go, then what it used.


def library_runs(server: str, runs: int, tag: str) -> Any:
    from advisory_lock.dedicated import dedicated_connection
    from advisory_lock.dedicated import direct_alias
    from advisory_lock.own_connection import keep_ledger_connection
    from advisory_lock.schedule import entry_from
    from advisory_lock.scheduling.workers import SUCCEEDED
    from advisory_lock.scheduling.workers import run_slot
    from advisory_lock.server_clock import count_from_readings

    lock_connection = dedicated_connection(direct_alias("default"), "bench run_path")
    keep_ledger_connection()
    count_from_readings()
    entries = [
        entry_from(f"run-{os.getpid()}-{i}", {"callable": "__main__.nothing", "every": 60})
        for i in range(runs)
    ]

    def run(round_tag: str) -> None:
        for entry in entries:
            status, why = run_slot(entry, round_tag, "default", False, lock_connection)
            assert status == SUCCEEDED, (status, why)

    return run


def raw_runs(server: str, runs: int, tag: str) -> Any:
    import datetime

    lock, insert, check, update, unlock = RAW[server]
    if server == "postgresql":
        import psycopg

        def connect() -> Any:
            return psycopg.connect(**{**PG_PARAMS, "dbname": DATABASE}, autocommit=True)

        def key(i: int) -> Any:
            return (os.getpid() << 20) + i

        def moment() -> Any:
            return datetime.datetime.now(datetime.UTC)

        def duration(delta: datetime.timedelta) -> Any:
            return delta

    else:
        import MySQLdb

        def connect() -> Any:
            connection = MySQLdb.connect(**{**MY_PARAMS, "database": DATABASE})
            connection.autocommit(True)
            return connection

        def key(i: int) -> Any:
            return f"bench:run-{os.getpid()}-{i}"

        def moment() -> Any:
            return datetime.datetime.now(datetime.UTC).replace(tzinfo=None)

        def duration(delta: datetime.timedelta) -> Any:
            return delta // datetime.timedelta(microseconds=1)

    locks, ledger = connect().cursor(), connect().cursor()
    host = os.uname().nodename

    def run(round_tag: str) -> None:
        for i in range(runs):
            k = key(i)
            locks.execute(lock, (k,))
            assert locks.fetchone()[0]
            started = moment()
            name = f"raw-{os.getpid()}-{i}"
            ledger.execute(insert, (name, round_tag, started, host, os.getpid(), str(k)))
            row_id = ledger.fetchone()[0] if server == "postgresql" else ledger.lastrowid
            locks.execute(check, (k,) * check.count("%s"))
            assert locks.fetchone()[0]
            finished = moment()
            ledger.execute(update, (finished, duration(finished - started), row_id))
            assert ledger.rowcount == 1
            locks.execute(unlock, (k,))
            assert locks.fetchone()[0]

    return run


def child(side: str, server: str, runs: int, tag: str) -> None:
    configure(server)
    run = (library_runs if side == "library" else raw_runs)(server, runs, tag)
    run(f"{tag}-warm")  # connections opened, code paths warm
    print("ready", flush=True)
    sys.stdin.readline()  # go
    before = resource.getrusage(resource.RUSAGE_SELF)
    run(tag)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps({"cpu": cpu}), flush=True)


# The parent.


def measure(side: str, server: str, processes: int, runs: int, tag: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", side, "--only", server]
    command += ["--runs", str(runs), "--tag", tag]
    children = [
        subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for _ in range(processes)
    ]
    for process in children:
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a {side} process did not start: {line!r}")
    started = time.perf_counter()
    for process in children:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    cpu = 0.0
    for process in children:
        assert process.stdout is not None
        cpu += json.loads(process.stdout.readline())["cpu"]
    took = time.perf_counter() - started
    for process in children:
        if process.wait():
            raise SystemExit(f"a {side} process failed: exit status {process.returncode}")
    total = processes * runs
    return {"runs/s": total / took, "cpu ms/run": 1000 * cpu / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="postgresql,mysql")
    parser.add_argument("--child", choices=("library", "raw", "migrate"), help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child == "migrate":
        configure(args.only)
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        return
    if args.child:
        child(args.child, args.only, args.runs, args.tag)
        return
    print(
        f"bench/run_path.py: {args.processes} processes x {args.runs} runs, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print()
    print("| database | side | runs/s | CPU per run, clients (ms) | runs/s, library / raw |")
    print("| --- | --- | ---: | ---: | ---: |")
    for server in args.only.split(","):
        create_database(server, DATABASE)
        # In a process of its own: Django is configured for one server per process.
        subprocess.run(
            [sys.executable, __file__, "--child", "migrate", "--only", server], check=True
        )
        results: dict[str, list[dict[str, float]]] = {"library": [], "raw": []}
        for round_number in range(args.rounds):
            sides = ["library", "raw"]
            random.shuffle(sides)
            for side in sides:
                tag = f"r{round_number}-{side}-{time.time():.0f}"
                results[side].append(measure(side, server, args.processes, args.runs, tag))
        medians = {
            side: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            for side, rounds in results.items()
        }
        ratio = medians["library"]["runs/s"] / medians["raw"]["runs/s"]
        for side in ("library", "raw"):
            median = medians[side]
            print(
                f"| {server} | {side} | {median['runs/s']:.0f} | {median['cpu ms/run']:.2f} | "
                f"{ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
