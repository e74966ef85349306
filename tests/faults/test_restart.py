"""The database server restarts under a running @single_instance(ledger="daily") command.

A restart drops every advisory lock (they live in the server's memory) and every connection;
the job_runs rows survive it. These tests stop and start this machine's PostgreSQL and
MariaDB: they run after every other test (see conftest.py), wait for other pytest runs on the
machine to end first, and always leave the server running.
"""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError
from django.db import connections

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from tests.commands import finish
from tests.commands import start
from tests.commands import wait_for_line
from tests.faults.helpers import killed_at_the_end
from tests.faults.helpers import report
from tests.faults.helpers import require_restartable
from tests.faults.helpers import server_is_up
from tests.faults.helpers import start_server
from tests.faults.helpers import stop_server
from tests.faults.helpers import wait_for_other_pytest_runs
from tests.probes import is_free

pytestmark = [
    pytest.mark.faults,
    pytest.mark.restarts_servers,
    pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True),
]

JOB = "lockapp.ledger_job"
KEY = f"command:{JOB}"
BUSY = 3  # busy_exit_code of ledger_job
HEARTBEAT = 0.5  # heartbeat of ledger_job
#: How long the holder may take to exit once the server is stopping before the test counts it
#: as hung: a guard, not a timing (about heartbeat + 1 s on an idle machine; printed).
HANG = 120.0


@pytest.fixture
def ledger(using):
    """The alias's job_runs rows of ledger_job, empty before and after; the server may be
    restarted: this waits for other test runs on the machine, and starts it again at the end
    whatever happened."""
    require_restartable(using)
    wait_for_other_pytest_runs()
    rows = JobRun.objects.using(using).filter(job_name=JOB)
    rows.delete()
    try:
        yield rows
    finally:
        if not server_is_up(using):
            start_server(using)
        connections[using].close()
        rows.delete()


def restart(alias: str) -> float:
    """Stop and start the server; return how long it was down."""
    stopped_at = time.monotonic()
    try:
        stop_server(alias)
    finally:
        start_server(alias)
    return time.monotonic() - stopped_at


def test_a_slot_done_before_a_restart_stays_done_after_it(using, ledger):
    status, out, err = finish(start(using, "ledger_job"))
    assert status == 0 and "finished" in out, err
    assert ledger.get().status == JobRun.Status.SUCCEEDED

    down_for = restart(using)
    connections[using].close()  # this process's connection died with the server

    # Every lock vanished with the restart, so only the ledger can refuse the second run.
    assert is_free(KEY, using)
    status, out, err = finish(start(using, "ledger_job"))
    assert status == BUSY, err
    assert "running" not in out
    assert "is already done" in err and "succeeded" in err, err
    run = ledger.get()
    assert run.status == JobRun.Status.SUCCEEDED and run.attempt == 1
    report(f"{using}: restarted in {down_for:.2f}s; the done slot was refused after it")


def test_a_run_killed_by_a_restart_is_run_again_as_attempt_2(using, ledger, tmp_path):
    done = tmp_path / "done"
    holder = start(using, "ledger_job", "--until", str(done))
    with killed_at_the_end(holder):
        wait_for_line(holder, "running")
        assert ledger.get().status == JobRun.Status.RUNNING
        assert not is_free(KEY, using)
        connections[using].ensure_connection()  # to see what a restart does to it, below

        # Stop, wait for the holder, then start: the holder finds the server down both for
        # its watchdog check and for recording the end of its run.
        stopped_at = time.monotonic()
        try:
            stop_server(using)
            # Before the server starts again: the holder exits while it is down.
            status, out, err = finish(holder, timeout=HANG)
            noticed_after = time.monotonic() - stopped_at
        finally:
            start_server(using)
        down_for = time.monotonic() - stopped_at
    assert status == 1, err
    assert "was lost" in err, err
    report(
        f"{using}: the holder exited (status 1, lock lost) {noticed_after:.2f}s after the "
        f"server began to stop; the server was down {down_for:.2f}s"
    )

    # This process's own connection died with the server: the next lock statement on it
    # fails as a DatabaseError (no hang, no wrong answer); a new connection then works.
    with pytest.raises(DatabaseError), advisory_lock("faults:stale", using=using, wait=False):
        pass
    connections[using].close()
    with advisory_lock("faults:after-restart", using=using, wait=False) as handle:
        assert handle.acquired
        assert not is_free("faults:after-restart", using)
    assert is_free("faults:after-restart", using)

    # The holder could not record its end (the server was down): the row still says running,
    # its lock is free, so the next instance marks it abandoned and runs attempt 2.
    assert ledger.get().status in (JobRun.Status.RUNNING, JobRun.Status.FAILED)
    assert is_free(KEY, using)
    status, out, second_err = finish(start(using, "ledger_job"))
    assert status == 0 and "finished" in out, second_err
    run = ledger.latest("attempt")  # each attempt is a row of its own
    assert run.status == JobRun.Status.SUCCEEDED and run.attempt == 2, (run.status, run.attempt)

    # Last, what the README promises on stderr: "CommandError: ... was lost ...".
    assert "CommandError:" in err and "was lost" in err and "Traceback" not in err, err
