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
from django.db import connections

from advisory_lock import JobRun
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.keys import make_key
from tests.replica import connect_mariadb
from tests.replica import mariadb_read_only  # noqa: F401 (a fixture, asked for by name)
from tests.schedulers import JOBS
from tests.schedulers import ROOT
from tests.schedulers import wait_for
from tests.servers import kill_connection_of
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


#: The pair of 32-bit keys (PostgreSQL's two-key advisory locks, apart from the bigint
#: keys the app takes) on which the trigger below holds an atomic run's fence.
FENCE_PAUSE = (31, 1)


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_run_claimed_then_stopped_before_its_body_is_said_failed_not_unstarted(
    using, ledger, schedulers
):
    """Regression (CI, a run through an undeclared transaction pooler): a run whose lock was
    lost after its claim, before its body, was said "did not start ...; nothing was
    recorded" and its entry held back, while the ledger recorded the attempt failed. It is
    said failed, as recorded, and its worker ends (the lock went while it held the run).

    The loss is made between the claim and the body: a trigger makes the atomic run's first
    statement after its claim (the UPDATE that locks its row) wait for a lock that the test
    holds; meanwhile the test terminates the run's lock connection."""
    connection = connections[using]
    table = JobRun._meta.db_table
    schedule = {"fenced": {"callable": f"{JOBS}.tick", "every": 3600, "atomic": True}}
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION pause_the_fence() RETURNS trigger AS $$ BEGIN "
            f"PERFORM pg_advisory_xact_lock_shared({FENCE_PAUSE[0]}, {FENCE_PAUSE[1]}); "
            "RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            f"CREATE TRIGGER pause_the_fence BEFORE UPDATE ON {table} FOR EACH ROW WHEN "
            "(OLD.job_name = 'fenced' AND OLD.status = 'running' AND NEW.status = 'running') "
            "EXECUTE FUNCTION pause_the_fence()"
        )
        cursor.execute("SELECT pg_advisory_lock(%s, %s)", FENCE_PAUSE)
    try:
        process = schedulers.start(schedule)
        wait_for(lambda: _waiting_at_the_fence(using), "the run's fence waiting")
        assert ledger.get(job_name="fenced").status == Status.RUNNING  # claimed
        key = backend_for(connection).db_key(make_key("schedule:fenced"))
        holder = inspector_for(connection).holder(key)
        assert holder is not None
        kill_connection_of(using, holder.id)
        wait_for(lambda: inspector_for(connection).holder(key) is None, "the lock let go")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s, %s)", FENCE_PAUSE)
            cursor.execute(f"DROP TRIGGER pause_the_fence ON {table}")
            cursor.execute("DROP FUNCTION pause_the_fence()")
    failed = wait_for(
        ledger.filter(job_name="fenced", status=Status.FAILED).first, "the run recorded failed"
    )
    assert "lost" in failed.error, failed.error
    said = ("failed.", "did not start")
    wait_for(lambda: any(w in output(schedulers, process) for w in said), "the run's end said")
    process.send_signal(signal.SIGTERM)
    status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    assert f"fenced [{failed.period}] failed." in out, out
    assert "did not start" not in out and "nothing was recorded" not in out, out


def _waiting_at_the_fence(using: str) -> bool:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
            "AND objid = %s AND objsubid = 2 AND NOT granted",
            FENCE_PAUSE,
        )
        return cursor.fetchone() is not None
