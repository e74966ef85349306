"""The randomized fault run, minutes long: instances of three ledger jobs (a ``once`` job, a
job on 0.5 s slots, and an ``atomic=True`` job on the same slots that writes an effect row)
under chaos (SIGKILLs, lock and transaction connections terminated by the server, server
restarts); then the ledger's invariants, the atomic job's effects (committed once per
succeeded slot, never for a failed or killed attempt), and the counts for bench/README.md.

    .venv/bin/python bench/fault_run.py [--seconds 120] [--instances 8] [--seeds 1,2]
        [--only sqlite,postgresql,mysql] [--restart-every 30 | --no-restarts] [--heartbeat 0.2]

The harness and the instances are tests/fault_run_worker.py (tests/test_fault_run.py runs the
same for seconds). Each backend runs on a database of its own (``bench_fault_run``; a temp
file for SQLite), migrated here; the atomic job's table (``fault_run_effects``) is made by
the harness and emptied at the start of each run. Restarts (PostgreSQL: ``pg_ctlcluster ...
restart``; MariaDB: ``mariadb-admin shutdown``, then ``start-stop-daemon``) break every
connection to the server, other programs' included: don't run them beside a test run
(``--no-restarts``). The servers are left running, also on failure or Ctrl-C. Exits with
status 1 if an invariant broke.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

DATABASE = "bench_fault_run"
RUN_DIR = Path(tempfile.mkdtemp(prefix="advisory-lock-fault-run-"))
SETTINGS = {
    "USE_TZ": True,
    "TIME_ZONE": "UTC",
    "SECRET_KEY": "bench",
    "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    "INSTALLED_APPS": ["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
    "DATABASES": {
        "default": {},
        "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(RUN_DIR / "db.sqlite3")},
        "postgresql": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": DATABASE,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        },
        "mysql": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": DATABASE,
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": "3306",
            "OPTIONS": {"charset": "utf8mb4"},
        },
    },
}
settings.configure(**SETTINGS)
django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from tests.fault_run_worker import FaultRun  # noqa: E402
from tests.fault_run_worker import Report  # noqa: E402

ALIASES = ("sqlite", "postgresql", "mysql")
MARIADBD = "/usr/sbin/mariadbd"
SERVER_TIMEOUT = 60.0


# The servers.


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=SERVER_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + SERVER_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} after {SERVER_TIMEOUT:g}s")
        time.sleep(0.1)


def _is_up(alias: str) -> bool:
    argv = (
        ["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432"]
        if alias == "postgresql"
        else ["mariadb-admin", "-uroot", "-h127.0.0.1", "ping"]
    )
    return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


def _mariadbd_running() -> bool:
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if name.isdigit() and os.readlink(f"/proc/{name}/exe").startswith(MARIADBD):
                return True
    return False


def _pg_cluster() -> str:
    return sorted(os.listdir("/etc/postgresql"))[0]


def start_server(alias: str) -> None:
    if alias == "postgresql":
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", _pg_cluster(), "main", "start"],
            capture_output=True,
            timeout=SERVER_TIMEOUT,
        )  # exit status 2: already running
    else:
        # mariadb-admin shutdown returns when the server stops answering, maybe before exit.
        _wait(lambda: not _mariadbd_running(), "mariadbd still running")
        _run("start-stop-daemon", "--start", "--oknodo", "--background", "--exec", MARIADBD)
    _wait(lambda: _is_up(alias), f"{alias} not answering")


def restart_server(alias: str) -> None:
    if alias == "postgresql":
        _run("pg_ctlcluster", "--skip-systemctl-redirect", _pg_cluster(), "main", "restart")
        _wait(lambda: _is_up(alias), "postgresql not answering")
    else:
        _run("mariadb-admin", "-uroot", "-h127.0.0.1", "shutdown")
        start_server(alias)


def ensure_servers_running(aliases: list[str]) -> None:
    for alias in aliases:
        if alias != "sqlite" and not _is_up(alias):
            print(f"starting {alias} again", flush=True)
            start_server(alias)


def create_database(alias: str) -> None:
    if alias == "postgresql":
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
            if not c.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]
            ).fetchone():
                c.execute(f"CREATE DATABASE {DATABASE}")
    elif alias == "mysql":
        import MySQLdb

        c = MySQLdb.connect(host="127.0.0.1", user="root")
        c.cursor().execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE} CHARACTER SET utf8mb4")
        c.close()
    call_command("migrate", database=alias, verbosity=0)


# The runs.


def revision() -> str:
    result = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120, help="of chaos, per run")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--seeds", default="1,2", help="comma-separated")
    parser.add_argument("--only", help="comma-separated: sqlite, postgresql, mysql")
    parser.add_argument("--restart-every", type=float, default=30, help="seconds (about)")
    parser.add_argument("--no-restarts", action="store_true")
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--slot-seconds", type=float, default=0.5)
    options = parser.parse_args()
    aliases = options.only.split(",") if options.only else list(ALIASES)
    if not set(aliases) <= set(ALIASES):
        parser.error(f"--only: choose among {', '.join(ALIASES)}")
    seeds = [int(seed) for seed in options.seeds.split(",")]
    env = {
        **os.environ,
        "FAULT_RUN_SETTINGS": json.dumps(SETTINGS),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    restarts = (
        "no restarts" if options.no_restarts else f"restarts every ~{options.restart_every:g}s"
    )
    print(
        f"fault run, revision {revision()}, {datetime.date.today()}: {options.instances} "
        f"instances, {options.seconds:g}s of chaos per run, heartbeat {options.heartbeat:g}s, "
        f"daily slots of {options.slot_seconds:g}s, {restarts}; run folders in {RUN_DIR}\n",
        flush=True,
    )
    reports: list[Report] = []
    try:
        for alias in aliases:
            create_database(alias)
            for seed in seeds:
                restart = None
                if alias != "sqlite" and not options.no_restarts:
                    restart = functools.partial(restart_server, alias)
                directory = RUN_DIR / f"{alias}-{seed}"
                directory.mkdir()
                run = FaultRun(
                    alias,
                    seed=seed,
                    directory=directory,
                    env=env,
                    instances=options.instances,
                    seconds=options.seconds,
                    heartbeat=options.heartbeat,
                    slot_seconds=options.slot_seconds,
                    restart=restart,
                    restart_every=options.restart_every,
                    pause=(0.1, 0.6),
                )
                report = run.run()
                reports.append(report)
                print(report.summary() + "\n", flush=True)
            connections[alias].close()
    finally:
        ensure_servers_running(aliases)
        if reports:
            print(Report.HEADER)
            for report in reports:
                print(report.row())
    broken = [report for report in reports if report.violations]
    for report in broken:
        print(f"\n{report.backend}, seed {report.seed}:")
        for violation in report.violations:
            print(f"  VIOLATION: {violation}")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
