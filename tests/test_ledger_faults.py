"""The job_runs ledger when its runs crash, lose their lock, or go through a pooler.

A slot's state is its latest attempt, and every claim is a new row: a run whose lock was
lost can't write over the run that took the slot after it (its finish is fenced), a dead
owner's row is proved abandoned by its guarding lock whatever the lock's key type, and a
single-instance command reports a lost lock as ``LockLost``, never as a KeyboardInterrupt.
Crashes are real processes killed with SIGKILL; lost locks are connections killed by the
server (tests/servers.py).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import LockLost
from advisory_lock import held_locks
from tests.commands import HANG
from tests.commands import finish
from tests.commands import start
from tests.commands import wait_for_line
from tests.probes import freed
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.processes import ROOT
from tests.processes import Worker
from tests.processes import Workers
from tests.servers import kill_connection_of

SERVERS = pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
RUNNING, SUCCEEDED = JobRun.Status.RUNNING, JobRun.Status.SUCCEEDED
FAILED, ABANDONED = JobRun.Status.FAILED, JobRun.Status.ABANDONED


@pytest.fixture
def claim(ledger):
    """``ledger.claim(job_name, period="once")``; a run the test leaves unfinished (it failed
    half-way) is finished at the end, so that its lock's connection does not outlive it."""
    claimed = []

    def claim(job_name):
        run = ledger.claim(job_name, period="once")
        if run is not None:
            claimed.append(run)
        return run

    yield claim
    for run in claimed:
        with contextlib.suppress(Exception):  # finished already, or lost: nothing to let go
            ledger.finish(run)


def attempts(rows, job_name, period="once"):
    """The slot's runs as (attempt, status), oldest first."""
    runs = rows.filter(job_name=job_name, period=period).order_by("attempt")
    return list(runs.values_list("attempt", "status"))


def latest(rows, job_name, period="once"):
    return rows.filter(job_name=job_name, period=period).order_by("-attempt").first()


def lock_settings(**advisory_lock_settings):
    """override_settings(ADVISORY_LOCK=...) that keeps the suite's NAMESPACE."""
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, **advisory_lock_settings})


def holder_of(name, using):
    """The server's id of the session holding the lock ``name``, from the live lock list."""
    with lock_settings(NAMES=[name]):
        ids = [lock.holder_id for lock in held_locks(using) if lock.name == name and lock.granted]
    assert ids, f"nobody holds lock {name!r} on {using!r}"
    return ids[0]


def wait_until_free(key, using, timeout=300.0):
    """Wait (bounded) until another connection could take ``key``: the server has noticed
    that the killed holder's connection is gone."""
    deadline = time.monotonic() + timeout
    while not is_free(key, using):
        assert time.monotonic() < deadline, (
            f"lock {key!r} still held {timeout:g}s after its owner died"
        )
        time.sleep(0.02)


def kill_lock(name, using):
    """Kill, server side, the connection holding ``name``; return once the lock is free."""
    kill_connection_of(using, holder_of(name, using))
    wait_until_free(name, using)


def lose_lock(name, using):
    """Take the lock ``name`` away from its holder, from outside, and return once another
    instance could take it: the server ends the holder's connection (PostgreSQL
    ``pg_terminate_backend``, MySQL ``KILL``); on SQLite the lock's file is removed by hand,
    as an operator's clean-up would."""
    if connections[using].vendor != "sqlite":
        kill_lock(name, using)
        return
    with lock_settings(NAMES=[name]):
        files = [lock.db_key for lock in held_locks(using) if lock.name == name and lock.granted]
    assert files, f"nobody holds lock {name!r} on {using!r}"
    os.unlink(files[0])
    wait_until_free(name, using)


class Child(Worker):
    """One ``python -m tests.ledger_child`` process (a Worker: JSON lines out, cues in)."""

    def __init__(self, args, env):
        self.args = args
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ledger_child", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    def events_until_exit(self, timeout=30.0):
        """Wait for the child to exit; return the events it said that were not read yet."""
        self.proc.wait(timeout)
        lines = (self._buffer + self.proc.stdout.read()).splitlines()
        return [json.loads(line)["event"] for line in lines if line.strip()]


class Children(Workers):
    """Starts ledger children for one test; ``kill_all`` ends every one of them."""

    def start(self, *args):
        child = Child([str(arg) for arg in args], self.env)
        self.started.append(child)
        return child


@pytest.fixture
def children():
    children = Children()
    yield children
    children.kill_all()


def crash(child):
    """SIGKILL ``child`` and reap it: its database connections die with it."""
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(30)


# 1. A crashed run never blocks its slot, whatever its lock's key type.

KEYED_COMMANDS = pytest.mark.parametrize(
    ("command", "key"),
    [("int_key_job", 424242), ("pair_key_job", (4242, 42))],
    ids=["int", "pair"],
)


@KEYED_COMMANDS
def test_a_crashed_once_job_with_a_non_string_key_runs_again_as_attempt_2(
    ledger, using, command, key
):
    holder = start(using, command, "--seconds", "30")
    wait_for_line(holder, "running")
    holder.kill()
    finish(holder)
    wait_until_free(key, using)

    status, out, err = finish(start(using, command))

    assert status == 0 and "finished" in out, err
    assert attempts(ledger, f"lockapp.{command}") == [(1, ABANDONED), (2, SUCCEEDED)]


@KEYED_COMMANDS
def test_job_runs_mark_abandoned_marks_a_crashed_run_with_a_non_string_key(
    ledger, using, command, key
):
    holder = start(using, command, "--seconds", "30")
    wait_for_line(holder, "running")
    holder.kill()
    finish(holder)
    wait_until_free(key, using)

    out = io.StringIO()
    call_command("job_runs", "--mark-abandoned", "--database", using, stdout=out)

    assert "abandoned" in out.getvalue()
    assert attempts(ledger, f"lockapp.{command}") == [(1, ABANDONED)]


@pytest.mark.parametrize(
    ("command", "lock_key"),
    [
        ("int_key_job", "#424242"),
        ("pair_key_job", "#4242,42"),
        ("ledger_job", "tests:command:lockapp.ledger_job"),
    ],
    ids=["int", "pair", "str"],
)
def test_a_commands_run_records_the_identity_of_its_lock(ledger, using, command, lock_key):
    status, _, err = finish(start(using, command))
    assert status == 0, err
    [run] = ledger.filter(job_name=f"lockapp.{command}")
    assert run.lock_key == lock_key


def test_a_claim_holds_the_job_lock_until_it_is_finished(ledger, claim, using):
    run = claim("held-claim")
    assert run is not None and run.lock_key == "tests:job:held-claim"
    assert not is_free("job:held-claim", using)
    ledger.finish(run)
    assert is_free("job:held-claim", using)
    assert attempts(ledger, "held-claim") == [(1, SUCCEEDED)]


def test_a_bare_claim_whose_process_died_is_claimed_again_as_attempt_2(
    ledger, claim, using, children
):
    owner = children.start("--using", using, "claim", "bare-claim")
    owner.expect("claimed")
    crash(owner)
    wait_until_free("job:bare-claim", using)

    run = claim("bare-claim")

    assert run is not None and run.attempt == 2
    ledger.finish(run)
    assert attempts(ledger, "bare-claim") == [(1, ABANDONED), (2, SUCCEEDED)]


def test_mark_abandoned_marks_the_row_of_a_bare_claim_whose_process_died(ledger, using, children):
    owner = children.start("--using", using, "claim", "bare-claim")
    owner.expect("claimed")
    crash(owner)
    wait_until_free("job:bare-claim", using)

    assert ledger.mark_abandoned() == 1
    assert attempts(ledger, "bare-claim") == [(1, ABANDONED)]


def test_job_runs_mark_abandoned_with_job_and_period_checks_only_that_slot(
    ledger, using, children
):
    for job_name in ("dead-a", "dead-b"):
        owner = children.start("--using", using, "claim", job_name)
        owner.expect("claimed")
        crash(owner)
        wait_until_free(f"job:{job_name}", using)

    out = io.StringIO()
    call_command(
        "job_runs", "--mark-abandoned", "--job", "dead-a", "--period", "once",
        "--database", using, stdout=out,
    )  # fmt: skip

    assert "abandoned" in out.getvalue()
    assert attempts(ledger, "dead-a") == [(1, ABANDONED)]
    assert attempts(ledger, "dead-b") == [(1, RUNNING)]


def test_job_runs_force_marks_a_live_owners_row_abandoned_and_its_finish_then_fails(
    ledger, using, children
):
    owner = children.start("--using", using, "claim", "stuck")
    owner.expect("claimed")
    assert not is_free("job:stuck", using)  # the owner is alive and holds the job's lock

    call_command(
        "job_runs", "--mark-abandoned", "--job", "stuck", "--period", "once", "--force",
        "--database", using, stdout=io.StringIO(),
    )  # fmt: skip
    assert attempts(ledger, "stuck") == [(1, ABANDONED)]

    owner.send("finish")
    lost = owner.expect("lost")
    assert "LockLost" in lost["error"]
    assert attempts(ledger, "stuck") == [(1, ABANDONED)]  # its finish wrote nothing


# 2. A run that lost its lock can't write over the run that took the slot after it.


def test_a_retry_is_a_new_row_with_a_larger_fence(ledger, claim, using):
    first = claim("retried")
    ledger.finish(first, error="Traceback...\nRuntimeError: boom")
    second = claim("retried")

    assert second is not None and second.pk != first.pk
    assert second.attempt == 2 and second.fence > first.fence
    ledger.finish(second)
    assert attempts(ledger, "retried") == [(1, FAILED), (2, SUCCEEDED)]


@SERVERS
def test_finish_of_a_run_that_lost_its_lock_raises_lock_lost_and_writes_nothing(
    ledger, claim, using
):
    first = claim("fenced")
    kill_lock("job:fenced", using)
    second = claim("fenced")
    assert second is not None and second.attempt == 2 and second.fence > first.fence

    with pytest.raises(LockLost, match=r"(?i)overlap"):
        ledger.finish(first)

    assert attempts(ledger, "fenced") == [(1, ABANDONED), (2, RUNNING)]
    assert latest(ledger, "fenced").finished_at is None
    ledger.finish(second)
    assert attempts(ledger, "fenced") == [(1, ABANDONED), (2, SUCCEEDED)]


@SERVERS
def test_assert_current_raises_lock_lost_once_the_run_lost_its_lock(ledger, claim, using):
    run = claim("asserted")
    run.assert_current()  # held, and the row is running
    kill_lock("job:asserted", using)
    with pytest.raises(LockLost):
        run.assert_current()


@SERVERS
def test_assert_current_in_atomic_locks_the_row_until_commit(ledger, claim, using):
    run = claim("row-locked")

    def try_to_lock_the_row():
        with transaction.atomic(using=using):
            ledger.select_for_update(nowait=True).get(pk=run.pk)

    with transaction.atomic(using=using):
        run.assert_current()
        with pytest.raises(DatabaseError):
            in_other_connection(try_to_lock_the_row)
    in_other_connection(try_to_lock_the_row)  # committed: the row is free again
    ledger.finish(run)


@SERVERS
def test_two_run_once_processes_never_both_succeed_when_the_first_loses_its_lock(
    ledger, using, children
):
    first = children.start("--using", using, "run-once", "overlap")
    assert first.expect("running")["attempt"] == 1
    kill_lock("job:overlap", using)  # the first run's lock is gone; it does not know yet
    second = children.start("--using", using, "run-once", "overlap")
    assert second.expect("running")["attempt"] == 2

    first.send("finish")  # the first run's body ends, after the second run has begun
    events = first.events_until_exit()
    # The second run's row is still running: the first one wrote nothing over it. Its own row
    # was marked abandoned by the second's claim or, if its watchdog noticed the lost lock
    # before the second process claimed (a slow start on a loaded machine), failed by
    # itself; never succeeded either way...
    first_row, second_row = attempts(ledger, "overlap")
    assert second_row == (2, RUNNING), events
    assert first_row in [(1, ABANDONED), (1, FAILED)], events
    # ...and it ended with LockLost (at the latest when its block ended), not a success.
    assert "lost" in events and "done" not in events
    assert first.proc.returncode == 1

    second.send("finish")
    second.expect("leaving")
    second.expect("done")
    statuses = [status for _, status in attempts(ledger, "overlap")]
    assert statuses.count(SUCCEEDED) == 1
    assert latest(ledger, "overlap").status == SUCCEEDED


def test_a_run_whose_lock_was_lost_ends_with_lock_lost_even_when_its_body_fails(
    ledger, using, children
):
    """The lock goes, another instance starts the job, then the first run's body fails: what
    it raises is LockLost (exclusion may have been broken), with the body's error as its
    cause, not the body's error alone."""
    first = children.start("--using", using, "run-once", "overlap", "--heartbeat", "3600")
    assert first.expect("running")["attempt"] == 1
    lose_lock("job:overlap", using)  # its watchdog won't look for an hour
    second = children.start("--using", using, "run-once", "overlap")
    assert second.expect("running")["attempt"] == 2

    first.send("fail")  # the first run's body raises, after the second run has begun
    lost = first.expect("lost")
    assert lost["error"].startswith("LockLost: ") and "RuntimeError" in lost["cause"], lost
    assert first.events_until_exit() == []
    assert first.proc.returncode == 1
    assert attempts(ledger, "overlap") == [(1, ABANDONED), (2, RUNNING)]

    second.send("finish")
    second.expect("leaving")
    second.expect("done")


# 3. A lock lost while the command's finish waits is LockLost, not a KeyboardInterrupt.


@contextlib.contextmanager
def row_locked(using, pk):
    """Hold SELECT ... FOR UPDATE on the job_runs row ``pk`` from another connection."""
    locked, release, errors = threading.Event(), threading.Event(), []

    def hold():
        try:
            with transaction.atomic(using=using):
                JobRun.objects.using(using).select_for_update().get(pk=pk)
                locked.set()
                release.wait(60)
        except BaseException as exc:  # reported below
            errors.append(exc)
            locked.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(20) and not errors, errors
    try:
        yield
    finally:
        release.set()
        thread.join(30)


def waiting_for_a_job_runs_row(using):
    """How many statements on job_runs wait for a row lock now, as the server tells."""
    sql = {
        "postgresql": (
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE '%job_runs%' AND pid <> pg_backend_pid()"
        ),
        "mysql": (
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX "
            "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE '%job_runs%'"
        ),
    }[connections[using].vendor]
    with connections[using].cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]


@SERVERS
def test_a_lock_lost_while_finish_waits_for_a_row_lock_is_no_keyboard_interrupt(
    ledger, using, tmp_path
):
    done = tmp_path / "done"
    command = start(using, "ledger_job", "--until", str(done))
    try:
        wait_for_line(command, "running")
        run = ledger.get(job_name="lockapp.ledger_job", status=RUNNING)
        with row_locked(using, run.pk):
            done.touch()  # the body ends: the command records its end, and waits for the row
            deadline = time.monotonic() + HANG
            while not waiting_for_a_job_runs_row(using):
                assert time.monotonic() < deadline, "the command never wrote its run's end"
                time.sleep(0.2)  # MariaDB refreshes INNODB_TRX only after 0.1 s unread
            kill_connection_of(using, holder_of("command:lockapp.ledger_job", using))
            time.sleep(2.0)  # four heartbeats: room for the watchdog to find the loss
        status, _, err = finish(command)
    finally:
        if command.poll() is None:
            command.kill()
            finish(command)
    assert status not in (130, -signal.SIGINT) and "KeyboardInterrupt" not in err, err
    assert ledger.get(pk=run.pk).status != RUNNING, err


# 4. call_command in a worker thread: LockLost from self.lock.check(), or at the end.


@pytest.fixture
def thread_job(using, monkeypatch):
    """Run the command thread_job by call_command in a worker thread, locking on ``using``."""
    from tests.lockapp.management.commands import thread_job as module

    monkeypatch.setattr(module.Command, "lock_using", using)
    outcome = {}

    def run(*args):
        started = threading.Event()
        out = io.StringIO()

        def target():
            try:
                call_command("thread_job", *args, started=started, stdout=out)
            except BaseException as exc:  # checked by the test
                outcome["error"] = exc
            finally:
                outcome["ended_at"] = time.monotonic()
                outcome["out"] = out.getvalue()
                connections.close_all()

        thread = threading.Thread(target=target)
        thread.start()
        assert started.wait(HANG), "thread_job did not start"
        return thread

    run.outcome = outcome
    return run


@SERVERS
def test_a_command_in_a_thread_that_polls_lock_check_gets_lock_lost_soon_after_a_kill(
    using, thread_job
):
    thread = thread_job("--poll", "--seconds", "20")
    time.sleep(1.0)  # the lock is killed about one second into the run
    assert thread.is_alive(), thread_job.outcome
    kill_connection_of(using, holder_of("command:lockapp.thread_job", using))
    killed_at = time.monotonic()
    thread.join(30)
    assert isinstance(thread_job.outcome.get("error"), LockLost), thread_job.outcome
    # heartbeat (1 s) + 2 s when idle; generous for a loaded machine
    assert thread_job.outcome["ended_at"] - killed_at < 40
    assert "finished" not in thread_job.outcome["out"]


@SERVERS
def test_a_command_in_a_thread_that_does_not_poll_gets_lock_lost_when_it_returns(
    using, thread_job, tmp_path
):
    go = tmp_path / "go"
    thread = thread_job("--until", str(go))  # its body runs until the test creates "go"
    assert thread.is_alive(), thread_job.outcome
    kill_connection_of(using, holder_of("command:lockapp.thread_job", using))
    # The kill only signals the session: the lock is lost once the server has ended it.
    assert freed("command:lockapp.thread_job", using)
    go.touch()
    thread.join(HANG)
    assert not thread.is_alive(), "thread_job did not return"
    assert isinstance(thread_job.outcome.get("error"), LockLost), thread_job.outcome
    assert "finished" in thread_job.outcome["out"]  # the body ran to its end, then LockLost


# 6. Orphan checks take their locks through DIRECT_ALIAS, never through a pooled alias.


@contextlib.contextmanager
def copy_of_alias(alias, using):
    """Add ``alias``: a second alias to ``using``'s test database."""
    settings_dict = copy.deepcopy(connections.settings[using])
    settings_dict["NAME"] = connections[using].settings_dict["NAME"]
    settings_dict["TEST"] = {**settings_dict.get("TEST", {}), "MIRROR": None}
    connections.settings[alias] = settings_dict
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


@pytest.fixture
def pooled(using):
    """An alias declared behind a transaction-mode pooler, with ``using`` as its direct alias.

    On PostgreSQL it is a real PgBouncer in transaction mode (tests/pgbouncer.py); on SQLite
    and MariaDB, which have no such pooler, a second alias to the same database declared so.
    """
    with contextlib.ExitStack() as stack:
        if using == "postgresql":
            from tests.pgbouncer import start_pgbouncer
            from tests.test_poolers import database_alias

            bouncer = stack.enter_context(start_pgbouncer(pool_mode="transaction"))
            alias = stack.enter_context(
                database_alias("bouncer", HOST=bouncer.host, PORT=str(bouncer.port))
            )
        else:
            alias = stack.enter_context(copy_of_alias("pooled", using))
        stack.enter_context(
            lock_settings(POOL_MODE={alias: "transaction"}, DIRECT_ALIAS={alias: using})
        )
        yield alias


def crash_a_ledger_command(using):
    """Start ledger_job, SIGKILL it mid-run: its row stays running, its lock is free."""
    holder = start(using, "ledger_job", "--seconds", "30")
    wait_for_line(holder, "running")
    holder.kill()
    finish(holder)
    wait_until_free("command:lockapp.ledger_job", using)


def latest_ledger_job_run(rows):
    return rows.filter(job_name="lockapp.ledger_job").order_by("-attempt").first()


def test_mark_abandoned_through_a_pooled_alias_checks_the_lock_on_the_direct_alias(
    ledger, using, pooled
):
    crash_a_ledger_command(using)

    assert JobRun.objects.using(pooled).mark_abandoned() == 1

    assert latest_ledger_job_run(ledger).status == ABANDONED


def test_a_claim_through_a_pooled_alias_abandons_a_dead_owners_run_through_the_direct_alias(
    ledger, using, pooled
):
    crash_a_ledger_command(using)
    rows = JobRun.objects.using(pooled)

    run = rows.claim("lockapp.ledger_job", period="daily")

    try:
        assert run is not None and run.attempt == 2
    finally:
        if run is not None:
            rows.finish(run)
    assert latest_ledger_job_run(ledger).status == SUCCEEDED


# 7. A plain function as a command's ledger period.


def quarter(now):
    return f"{now:%Y}-Q{(now.month - 1) // 3 + 1}"


def test_a_plain_function_as_a_commands_ledger_period_names_the_slot(ledger, using):
    status, out, err = finish(start(using, "function_period_job"))

    assert status == 0 and "finished" in out, err
    [run] = ledger.filter(job_name="lockapp.function_period_job")
    assert run.status == SUCCEEDED
    assert run.period == quarter(run.started_at.astimezone(datetime.timezone.utc))
