"""The real ``manage.py run_jobs`` processes that the scheduler tests start (``Schedulers``;
tests take them through the ``schedulers`` fixture of tests/conftest.py), and the helpers
those tests share: hang-guarded waits, slot names, the database server's clock."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.db import connections
from django.test import override_settings

from advisory_lock.backends import inspector_for
from advisory_lock.scheduling.liveness import SchedulerHeartbeat

ROOT = Path(__file__).resolve().parent.parent
UTC = datetime.timezone.utc
JOBS = "tests.schedule_jobs"
#: A guard against a hang, never a timing: how long a wait for an event may last.
HANG = 240.0


def schedule_env(using: str, schedule: dict, folder: Path) -> dict[str, str]:
    """The environment of a process of the test project on ``using``'s test database with
    ``schedule`` as ``ADVISORY_LOCK["SCHEDULE"]`` (tests/schedule_settings.py), its jobs
    recording their runs in ``folder``: a ``run_jobs`` (``Schedulers``), or the admin's server
    that the browser tests drive (tests/browser.py), which must see the same schedule."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.schedule_settings",
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": using,
        "ADVISORY_LOCK_TEST_SCHEDULE": json.dumps(schedule),
        "ADVISORY_LOCK_TEST_JOBS_DIR": str(folder),
        "PYTHONPATH": str(ROOT),  # django-admin does not put the current folder first
        "PYTHONUNBUFFERED": "1",
    }


class Schedulers:
    """Starts ``run_jobs`` processes on one database; ``kill_all`` ends them and their jobs."""

    def __init__(self, using: str, folder: Path) -> None:
        self.using, self.folder = using, folder
        self.started: list[subprocess.Popen] = []

    def start(
        self, schedule, *argv, program=None, server_clock=None, env=None
    ) -> subprocess.Popen:
        """``run_jobs *argv`` with ``schedule``; ``env``: more environment variables."""
        number = len(self.started)
        env = {**schedule_env(self.using, schedule, self.folder), **(env or {})}
        if server_clock is not None:
            env["ADVISORY_LOCK_TEST_SERVER_CLOCK"] = str(int(server_clock.timestamp()))
        # Files, not pipes: a job process inherits them, and may outlive a killed scheduler.
        with (
            open(self.folder / f"run_jobs.{number}.out", "w") as out,
            open(self.folder / f"run_jobs.{number}.err", "w") as err,
        ):
            process = subprocess.Popen(
                [*(program or [sys.executable, str(ROOT / "manage.py")]), "run_jobs", *argv],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        process.number = number
        self.started.append(process)
        return process

    def finish(self, process, timeout: float = HANG) -> tuple[int, str, str]:
        """Wait for ``process``; return (exit status, stdout, stderr)."""
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run_jobs still running after {timeout}s") from None
        out = (self.folder / f"run_jobs.{process.number}.out").read_text()
        err = (self.folder / f"run_jobs.{process.number}.err").read_text()
        return process.returncode, out, err

    def once(self, schedule, *argv, **options) -> tuple[int, str, str]:
        return self.finish(self.start(schedule, "--once", *argv, **options))

    def kill_all(self) -> None:
        """SIGKILL every scheduler and its jobs, and delete their heartbeat rows: a killed
        scheduler counts as alive for 3 s, which the next test must not see."""
        for process in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        pids = [process.pid for process in self.started]
        SchedulerHeartbeat.objects.using(self.using).filter(pid__in=pids).delete()


def server_now(using: str) -> datetime.datetime:
    return inspector_for(connections[using]).database_now()


def wait_for(condition, what: str, timeout: float = HANG):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def long_interval(using: str, margin: float = 150) -> int:
    """An ``every`` of about an hour whose current slot ends at least ``margin`` seconds from
    now (server clock): that slot stays the most recent due one for the whole test."""
    now = server_now(using).timestamp()
    every = 3600
    while now % every > every - margin:
        every += 1
    return every


def second(moment: datetime.datetime) -> str:
    """The slot name of an entry with ``every`` below a minute (UTC: the tests' time zone)."""
    return f"{moment:%Y-%m-%dT%H:%M:%S}"


def minute(moment: datetime.datetime) -> str:
    return f"{moment:%Y-%m-%dT%H:%M}"


def at(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, UTC)


def alive(pid: int) -> bool:
    """Is ``pid`` running (neither gone nor a zombie waiting to be reaped)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def settings_with(schedule):
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, "SCHEDULE": schedule})
