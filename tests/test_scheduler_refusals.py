"""A scheduler on a database that takes no lock rides it out, and says so once.

Issue 31: ``run_jobs`` against a database that can't be locked started a job process for the
same slot on every pass, for ever (a read-only MariaDB: 46 per slot in 10 s, each dying with
a ``ReplicaError`` traceback; a declared transaction pooler without ``DIRECT_ALIAS``: 553 in
two minutes). With claims and workers (issue 30) the read-only server stopped the scheduler
instead, with a traceback. Now:

- a read-only server (a replica, a primary demoted by a failover): the claims are refused
  before any run is given to a worker; one WARNING, the scheduler retries at most
  ``RETRY_CAP`` seconds apart, on new connections, and runs the entry once the server takes
  locks again (here ``SET GLOBAL read_only = 0``), without a restart;
- a run refused in its worker (the pooler declared, no ``DIRECT_ALIAS``): said once with the
  reason, and the entry's next runs are held back for 1 s, then twice as long each time.

Real ``manage.py run_jobs`` processes (tests/schedulers.py), a real read-only MariaDB server
of the test's own (tests/replica.py). Every wait is for a line, a row or a server's log.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys

import pytest

from advisory_lock import JobRun
from tests.replica import connect_mariadb
from tests.replica import mariadb_read_only  # noqa: F401 (a fixture, asked for by name)
from tests.schedulers import JOBS
from tests.schedulers import ROOT
from tests.schedulers import wait_for
from tests.test_control_room import heartbeats  # noqa: F401 (a fixture)

Status = JobRun.Status
#: The database of the read-only server that the schedulers use.
APP_DATABASE = "advisory_lock_refusals"
#: Retries of the refused claims to see before the server is made writable again.
RETRIES = 3
#: Seconds of the server's clock to watch a held-back entry for.
WATCHED = 10
#: The most runs a held-back entry may start in ``WATCHED`` seconds: the first, then one
#: after 1, 2, 4 and 8 s at most (the waits double from 1 s).
MOST_RUNS = 5


def output(schedulers, process) -> str:
    return (schedulers.folder / f"run_jobs.{process.number}.out").read_text()


def errors(schedulers, process) -> str:
    return (schedulers.folder / f"run_jobs.{process.number}.err").read_text()


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_a_scheduler_on_a_read_only_server_waits_and_runs_once_it_takes_locks(
    using,
    schedulers,
    mariadb_read_only,  # noqa: F811 (the fixture)
):
    """Regression: the scheduler stopped with a ReplicaError traceback (and before issue 30,
    forked a job process per pass)."""
    server = mariadb_read_only
    admin = connect_mariadb(server)
    cursor = admin.cursor()
    cursor.execute(f"DROP DATABASE IF EXISTS {APP_DATABASE}")
    cursor.execute(f"CREATE DATABASE {APP_DATABASE} CHARACTER SET utf8mb4")  # root may write
    env = {
        "ADVISORY_LOCK_TEST_DB_PORT": str(server.port),
        "ADVISORY_LOCK_TEST_DB_NAME": APP_DATABASE,
    }
    migrate = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.schedule_settings",
            "ADVISORY_LOCK_TEST_WORKER": "1",
            "ADVISORY_LOCK_TEST_DEFAULT": using,
            "PYTHONPATH": str(ROOT),
            **env,
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1}}
    try:
        logged = server.log_size()
        process = schedulers.start(schedule, env=env)
        wait_for(lambda: "takes no lock now" in errors(schedulers, process), "the warning")
        # It tries again, each time on a new connection (the server logs each "Connect").
        warned = server.log_size()
        wait_for(
            lambda: server.log_since(warned).count("Connect\troot@") >= RETRIES,
            f"{RETRIES} more tries",
        )
        assert process.poll() is None, errors(schedulers, process)
        assert "started" not in output(schedulers, process)  # no run given to a worker
        assert "GET_LOCK" not in server.log_since(logged)  # refused before any lock statement
        cursor.execute("SET GLOBAL read_only = 0")  # the primary is back
        ran = wait_for(lambda: _succeeded(admin, "tick"), "a run once the server takes locks")
        assert ran >= 1
    finally:
        cursor.execute("SET GLOBAL read_only = 1")
    process.send_signal(signal.SIGTERM)
    status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    assert "Traceback" not in err, err
    assert err.count("takes no lock now") == 1, err
    cursor.execute(f"DROP DATABASE {APP_DATABASE}")
    admin.close()


def _succeeded(admin, job_name: str) -> int:
    cursor = admin.cursor()
    cursor.execute(
        f"SELECT COUNT(*) FROM {APP_DATABASE}.job_runs WHERE job_name = %s AND status = %s",
        [job_name, Status.SUCCEEDED.value],
    )
    (count,) = cursor.fetchone()
    return count


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_runs_refused_in_their_worker_are_held_back_and_said_once(
    using,
    ledger,
    heartbeats,  # noqa: F811 (the fixture)
    schedulers,
):
    """Regression: a declared transaction pooler without DIRECT_ALIAS: each pass started a
    run (a job process before issue 30, a worker's run after) that was refused at once, 5 a
    second, each with an ERROR line."""
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1}}
    process = schedulers.start(schedule, env={"ADVISORY_LOCK_TEST_POOL_MODE": "transaction"})
    wait_for(lambda: "did not start" in output(schedulers, process), "the first refused run")
    row = wait_for(heartbeats.first, "the scheduler's heartbeat")
    first_seen = row.last_seen
    wait_for(
        lambda: (
            heartbeats.get(pk=row.pk).last_seen >= first_seen + datetime.timedelta(seconds=WATCHED)
        ),
        f"{WATCHED}s of the scheduler's heartbeats",
    )
    out = output(schedulers, process)
    process.send_signal(signal.SIGTERM)
    status, rest, err = schedulers.finish(process)
    assert status == 0, rest + err
    assert out.count("did not start") == 1, out
    assert 1 <= out.count("started (pid") <= MOST_RUNS + 1, out
    assert "ERROR" not in err and "Traceback" not in err, err
    assert not ledger.exists()  # refused before its claim: nothing recorded
