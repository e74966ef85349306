"""Exactly-once effects: ``atomic=True`` runs a job's body in a transaction on the ledger's
database and writes the run's success in it, so the job's writes and the success commit
together or not at all.

The job's write is a ``Counter`` row named after the run (the name is unique: a second
commit of it would fail). Crashes are real processes killed with SIGKILL after they said
that they wrote (tests/ledger_child.py); lost locks are connections killed by the server.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from advisory_lock import JobRun
from advisory_lock import LockLost
from advisory_lock import SlotAlreadySucceeded
from advisory_lock import ledger as ledger_module
from advisory_lock import run_once
from advisory_lock import single_instance
from advisory_lock.testing import isolated_ledger
from testproject.example.models import Counter
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.schedulers import JOBS
from tests.schedulers import long_interval
from tests.test_ledger_faults import SERVERS
from tests.test_ledger_faults import attempts
from tests.test_ledger_faults import children  # noqa: F401 (a fixture)
from tests.test_ledger_faults import crash
from tests.test_ledger_faults import kill_lock
from tests.test_ledger_faults import lose_lock
from tests.test_ledger_faults import wait_until_free
from tests.test_ledger_faults import waiting_for_a_job_runs_row

RUNNING, SUCCEEDED = JobRun.Status.RUNNING, JobRun.Status.SUCCEEDED
FAILED, ABANDONED = JobRun.Status.FAILED, JobRun.Status.ABANDONED


@pytest.fixture
def effects(using):
    """The Counter rows of ``using`` (the jobs' writes), emptied after the test."""
    rows = Counter.objects.using(using)
    yield rows
    rows.all().delete()


def committed(using, job_name):
    """(Is the job's write committed, the status of its latest run), as another connection
    sees them."""

    def look():
        run = JobRun.objects.using(using).filter(job_name=job_name).order_by("-attempt").first()
        wrote = Counter.objects.using(using).filter(name=job_name).exists()
        return wrote, run and run.status

    return in_other_connection(look)


# 1. Success, failure, and a misplaced call.


def test_a_success_commits_the_jobs_writes_and_the_success_together(ledger, effects, using):
    with run_once("paid", period="once", using=using, atomic=True) as run:
        effects.create(name="paid")
        assert connections[using].in_atomic_block
        assert committed(using, "paid") == (False, RUNNING)  # neither is committed yet

    assert committed(using, "paid") == (True, SUCCEEDED)
    assert run.status == SUCCEEDED and run.finished_at is not None
    assert attempts(ledger, "paid") == [(1, SUCCEEDED)]


def test_a_decorated_atomic_job_runs_once_per_slot(ledger, effects, using):
    @run_once("decorated", period="once", using=using, atomic=True)
    def job():
        effects.create(name="decorated")
        return "done"

    assert job() == "done"
    assert job() is None  # the slot is done: the body does not run again
    assert committed(using, "decorated") == (True, SUCCEEDED)


def test_a_body_that_raises_rolls_back_its_writes_and_records_the_traceback(
    ledger, effects, using
):
    with (
        pytest.raises(RuntimeError, match="boom"),
        run_once("broken", period="once", using=using, atomic=True),
    ):
        effects.create(name="broken")
        raise RuntimeError("boom")

    assert committed(using, "broken") == (False, FAILED)
    assert "RuntimeError: boom" in ledger.get(job_name="broken").error
    assert not connections[using].in_atomic_block


def test_a_failed_atomic_run_is_retried_and_its_writes_commit_once(ledger, effects, using):
    @run_once("flaky", period="once", using=using, atomic=True)
    def job(fail):
        effects.create(name="flaky")
        if fail:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        job(fail=True)
    job(fail=False)

    assert attempts(ledger, "flaky") == [(1, FAILED), (2, SUCCEEDED)]
    assert effects.filter(name="flaky").count() == 1


def test_inside_an_outer_atomic_block_nothing_is_claimed_locked_or_run(ledger, using):
    with transaction.atomic(using=using):
        with (
            pytest.raises(TransactionManagementError, match="atomic block"),
            run_once("nested", period="once", using=using, atomic=True),
        ):
            pytest.fail("the body ran")
        assert is_free("job:nested", using)
    assert not ledger.filter(job_name="nested").exists()


def test_in_a_test_with_an_isolated_ledger_an_atomic_run_nests_in_the_tests_transaction(
    ledger, effects, using
):
    with isolated_ledger, transaction.atomic(using=using):  # a TestCase's transaction
        with run_once("kit", period="once", using=using, atomic=True) as run:
            effects.create(name="kit")
        assert run.status == SUCCEEDED
        assert ledger.get(job_name="kit").status == SUCCEEDED and effects.filter(name="kit")
        transaction.set_rollback(True, using=using)  # the test ends

    assert not ledger.exists() and not effects.exists()
    assert is_free("job:kit", using)


def test_atomic_is_refused_without_a_ledger_and_in_async_code():
    with pytest.raises(ValueError, match="ledger period"):
        single_instance(atomic=True)
    with pytest.raises(TypeError, match="sync code"):

        @run_once("async-job", atomic=True)
        async def job():
            pass

    with pytest.raises(TypeError, match="sync code"):

        @single_instance(ledger="once", atomic=True)
        async def task():
            pass

    async def block():
        async with run_once("async-block", period="once", atomic=True):
            pytest.fail("the body ran")

    with pytest.raises(TypeError, match="sync code"):
        asyncio.run(block())


def test_an_atomic_single_instance_function_commits_with_its_success(ledger, effects, using):
    @single_instance(key="task:atomic", using=using, ledger="once", atomic=True)
    def task(fail):
        effects.create(name="task")
        if fail:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        task(fail=True)
    assert not effects.filter(name="task").exists()
    task(fail=False)

    assert effects.filter(name="task").count() == 1
    assert sorted(ledger.values_list("attempt", "status")) == [(1, FAILED), (2, SUCCEEDED)]


def test_an_atomic_ledger_command_commits_with_its_success(ledger, effects, using):
    with pytest.raises(RuntimeError, match="on purpose"):
        call_command("atomic_ledger_job", "by-command", "--database", using, "--fail")
    assert not effects.filter(name="by-command").exists()

    call_command("atomic_ledger_job", "by-command", "--database", using)

    assert effects.filter(name="by-command").count() == 1
    assert attempts(ledger, "lockapp.atomic_ledger_job") == [(1, FAILED), (2, SUCCEEDED)]


def test_an_atomic_ledger_command_inside_an_outer_atomic_block_does_not_run(
    ledger, effects, using
):
    with (
        transaction.atomic(using=using),
        pytest.raises((TransactionManagementError, CommandError), match="atomic block"),
    ):
        call_command("atomic_ledger_job", "nested-command", "--database", using)
    assert not ledger.exists() and not effects.exists()


# 2. Nobody can take a run over while its writes are pending; a run that lost its lock
# commits nothing.


def test_the_runs_row_stays_locked_until_its_transaction_commits(ledger, effects, using):
    with run_once("row-locked", period="once", using=using, atomic=True) as run:
        effects.create(name="row-locked")
        with pytest.raises(Exception, match=r"(?i)lock"):
            # A forced takeover waits for the row (SQLite: for the database's write
            # lock); here it gives up at once.
            in_other_connection(force_abandon, using, run.pk)

    assert committed(using, "row-locked") == (True, SUCCEEDED)


def force_abandon(using, pk):
    """Mark the run ``pk`` abandoned, without waiting for its row."""
    connection = connections[using]
    with transaction.atomic(using=using):
        if connection.vendor == "sqlite":
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA busy_timeout = 0")
        rows = JobRun.objects.using(using).filter(pk=pk)
        list(rows.select_for_update(nowait=True))  # SQLite has no row locks: a no-op there
        rows.update(status=ABANDONED)


@SERVERS
def test_a_run_whose_lock_is_lost_and_taken_over_rolls_back_and_raises_lock_lost(
    ledger, effects, using
):
    taken = {}

    def take_over():
        try:
            taken["run"] = JobRun.objects.using(using).claim("lost", period="once")
        except BaseException as error:  # reported below
            taken["error"] = error
        finally:
            connections.close_all()

    taker = threading.Thread(target=take_over)
    with (
        pytest.raises(LockLost),
        run_once("lost", period="once", using=using, atomic=True, heartbeat=3600),
    ):
        effects.create(name="lost")
        kill_lock("job:lost", using)  # another instance may now run the job...
        taker.start()
        # ...and tries to take the run over: it waits for the run's row, locked until the
        # end of this block.
        deadline = time.monotonic() + 60  # a hang guard
        while not row_waits(using) and not taken:
            assert time.monotonic() < deadline, "the taker never waited for the run's row"
            time.sleep(0.2)  # MariaDB refreshes INNODB_TRX only after 0.1 s unread
        assert not taken, taken  # it did not end: it waits
    taker.join(60)

    assert "error" not in taken, taken
    assert committed(using, "lost") == (False, RUNNING)  # the taker's attempt 2
    assert attempts(ledger, "lost") == [(1, ABANDONED), (2, RUNNING)]
    assert ledger.get(job_name="lost", attempt=1).finished_at is None  # it wrote nothing
    ledger.finish(taken["run"])


def test_a_run_taken_over_before_its_body_starts_raises_lock_lost_and_never_runs(
    ledger, effects, using, monkeypatch
):
    lock_running_row = ledger_module.lock_running_row

    def taken_over_first(alias, run):
        # Between the claim and the body's first statement, an operator forces the run's
        # row abandoned (job_runs --mark-abandoned --force) from another connection.
        in_other_connection(
            lambda: JobRun.objects.using(using).filter(pk=run.pk).update(status=ABANDONED)
        )
        lock_running_row(alias, run)

    monkeypatch.setattr(ledger_module, "lock_running_row", taken_over_first)
    with (
        pytest.raises(LockLost, match="took it over"),
        run_once("early", period="once", using=using, atomic=True),
    ):
        pytest.fail("the body ran")

    assert attempts(ledger, "early") == [(1, ABANDONED)]
    assert ledger.get(job_name="early").finished_at is None  # nothing written on it
    assert not connections[using].in_atomic_block
    assert is_free("job:early", using)


def row_waits(using):
    """How many statements wait for a job_runs row now, asked on a connection of its own in
    autocommit (PostgreSQL's statistics views give one snapshot per transaction)."""
    observer = connections.create_connection(using)
    try:
        observer.ensure_connection()
        # waiting_for_a_job_runs_row() asks connections[using]: lend it the observer.
        current, connections[using] = connections[using], observer
        try:
            return waiting_for_a_job_runs_row(using)
        finally:
            connections[using] = current
    finally:
        observer.close()


# PostgreSQL only: on MariaDB the hand-written UPDATE waits for the run's transaction to end
# (its unique check meets the run's locked row), so it can't come in the middle of the run.
@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_success_written_by_hand_meanwhile_rolls_the_run_back_and_records_it_failed(
    ledger, effects, using
):
    with pytest.raises(RuntimeError), run_once("by-hand", period="once", using=using):
        raise RuntimeError("attempt 1 fails")

    with (
        pytest.raises(SlotAlreadySucceeded, match="rolled back"),
        run_once("by-hand", period="once", using=using, atomic=True) as run,
    ):
        assert run.attempt == 2
        effects.create(name="by-hand")
        # Meanwhile, by hand, on another connection: attempt 1 is the slot's success.
        in_other_connection(
            lambda: ledger.filter(job_name="by-hand", attempt=1).update(status=SUCCEEDED)
        )

    assert attempts(ledger, "by-hand") == [(1, SUCCEEDED), (2, FAILED)]
    assert "rolled back" in ledger.get(job_name="by-hand", attempt=2).error
    assert not effects.filter(name="by-hand").exists()


# 3. Crashes and concurrency, with real processes.


def test_a_run_killed_after_its_write_commits_nothing_and_the_slot_runs_again_once(
    ledger,
    effects,
    using,
    children,  # noqa: F811 (the fixture)
):
    child = children.start("--using", using, "atomic", "crashed", "crashed")
    assert child.expect("wrote")["attempt"] == 1
    crash(child)  # in the body: its write is not committed
    wait_until_free("job:crashed", using)

    assert committed(using, "crashed") == (False, RUNNING)
    with run_once("crashed", period="once", using=using, atomic=True) as run:
        assert run is not None and run.attempt == 2
        effects.create(name="crashed")

    assert attempts(ledger, "crashed") == [(1, ABANDONED), (2, SUCCEEDED)]
    assert effects.filter(name="crashed").count() == 1


@pytest.mark.parametrize("using", ["default"], indirect=True, ids=["sqlite"])
def test_several_processes_run_atomic_jobs_at_once_on_sqlite_without_database_is_locked(
    ledger,
    effects,
    using,
    children,  # noqa: F811 (the fixture)
):
    jobs = 10
    workers = [
        children.start("--using", using, "atomic-jobs", f"p{number}", "--jobs", jobs)
        for number in range(4)
    ]
    for worker in workers:
        worker.expect("ready")
    for worker in workers:
        worker.send("go")
    for worker in workers:
        done = worker.expect("done")
        assert done == {"event": "done", "succeeded": jobs, "errors": []}

    assert effects.count() == 4 * jobs
    assert ledger.filter(status=SUCCEEDED).count() == 4 * jobs


# 4. A schedule entry's "atomic": True.


def test_an_atomic_schedule_entry_commits_its_writes_with_its_success(
    ledger,
    effects,
    using,
    schedulers,
):
    every = long_interval(using)
    schedule = {
        "kept": {"callable": f"{JOBS}.write_effect", "every": every, "atomic": True},
        "undone": {
            "callable": f"{JOBS}.write_effect_then_fail",
            "every": every,
            "retries": 0,
            "atomic": True,
        },
    }
    status, out, err = schedulers.once(schedule)

    assert status == 1 and "a scheduled run failed" in err, out + err
    assert dict(ledger.values_list("job_name", "status")) == {"kept": SUCCEEDED, "undone": FAILED}
    assert "RuntimeError" in ledger.get(job_name="undone").error
    assert list(effects.values_list("name", flat=True)) == ["kept"]


def test_a_command_with_lock_ledger_atomic_and_no_ledger_is_a_system_check_error():
    def errors():
        return [message for message in run_checks() if message.id == "advisory_lock.E012"]

    assert errors() == []
    with override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "tests.atomicapp"]):
        [error] = errors()
    assert "atomicapp.atomic_without_ledger" in error.msg and "without a lock_ledger" in error.msg
    assert "lock_ledger" in error.hint


@SERVERS
def test_an_atomic_runs_transaction_does_not_hold_up_other_runs_fenced_ends(ledger, using):
    # An UPDATE that finds its row by primary key locks that row only (see the next test).
    ended: dict[str, object] = {}

    def end_the_other_run():
        try:
            ledger.finish(other)
            ended["status"] = JobRun.objects.using(using).get(pk=other.pk).status
        except Exception as error:  # reported below
            ended["error"] = error

    with run_once("atomic-job", period="once", using=using, atomic=True):
        # Claimed once the atomic run's row is locked, when it was the only running row.
        other = ledger.claim("other-job", period="once")
        assert other is not None
        thread = threading.Thread(target=end_the_other_run)
        thread.start()
        thread.join(300)  # a guard against a hang: it needs nothing this transaction holds
        assert not thread.is_alive(), "the other run's end waited for this run's transaction"
    assert ended == {"status": SUCCEEDED}, ended
    assert attempts(ledger, "atomic-job") == [(1, SUCCEEDED)]


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_the_fence_finds_the_row_by_its_primary_key_alone(ledger, using):
    # Regression (MariaDB; the randomized fault run's deadlocks, error 1213): the fence
    # compared status as a column, and with one running row MariaDB reads "id = ... AND
    # status = 'running'" through job_runs_status_started_idx, whose entries InnoDB keeps
    # locked until the transaction ends: an atomic run's transaction, whose first statement
    # is that UPDATE, held other running rows' entries, blocking their ends and deadlocking.
    started = timezone.now()
    ledger.bulk_create(
        JobRun(job_name="history", period=str(day), status=SUCCEEDED, started_at=started)
        for day in range(500)
    )
    run = ledger.claim("the-only-running-run", period="once")
    assert run is not None and ledger.filter(status=RUNNING).count() == 1
    with transaction.atomic(using=using):
        with CaptureQueriesContext(connections[using]) as queries:
            ledger_module.lock_running_row(using, run)
    [update] = [query["sql"] for query in queries if query["sql"].startswith("UPDATE")]
    with connections[using].cursor() as cursor:
        cursor.execute(f"EXPLAIN {update}")
        columns = [column[0] for column in cursor.description]
        plan = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    assert [step["key"] for step in plan] == ["PRIMARY"], plan
    ledger.finish(run)


def test_a_lock_lost_between_the_claim_and_the_body_ends_the_run_with_lock_lost(
    ledger,
    effects,
    using,
    children,  # noqa: F811 (the fixture)
):
    """The claim is made, then the lock is taken away (another instance may now run the
    job) before the run's first statement on the ledger's database: the body must not
    start, and the run ends with LockLost, its write never made."""
    child = children.start("--using", using, "atomic-fenced", "gone", "gone")
    child.expect("fencing")
    assert committed(using, "gone") == (False, RUNNING)  # claimed
    lose_lock("job:gone", using)
    child.send("go")

    assert child.expect("lost")["error"].startswith("LockLost: ")
    assert child.events_until_exit() == []  # it never wrote
    assert child.proc.returncode == 1
    assert not effects.filter(name="gone").exists()
    assert attempts(ledger, "gone") != [(1, SUCCEEDED)]
