"""LISTEN/NOTIFY: ``run_jobs`` on PostgreSQL hears operators' requests at once.

The schedulers are real ``manage.py run_jobs`` processes, started as tests/test_control_room.py
starts them (its fixtures, tests/schedulers.py's ``Schedulers``), on the pytest run's test
database of the alias under test; the operators' requests are ``run_jobs --run-now/--pause``
processes of their own. A scheduler started with ``--poll-interval 3600`` would not look for
requests for an hour: on PostgreSQL the request's NOTIFY, sent with its row's transaction,
makes it look at once. The test first waits, by events, until the scheduler has listened and
made its last poll (two heartbeats after its LISTEN: a pass beats at most once, and the pass
after the LISTEN's test notification is heard, milliseconds later, is the one that polls), so
that only the notification can start the run.
(Before the notifications, requests were seen by polling only, every second, and
``--poll-interval`` did not exist.) Pauses are read by every pass, whatever the interval: the
notification only wakes the scheduler.

What the server says is read from ``pg_stat_activity`` of the test database: a scheduler's
listening session has the application_name ``pid=<scheduler pid> host=<host> listener
(advisory_lock)`` and the last statement ``LISTEN "advisory_lock"``.

Every wait is for an event (a row, a session, a line of the scheduler's output) with a
generous bound that only fails on a hang; nothing is timed.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from django.db import connections
from django.db.models import QuerySet

from advisory_lock import JobRun
from advisory_lock.backends import backend_class
from advisory_lock.backends.postgresql import holder_process
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.pgbouncer import PgBouncer
from tests.pgbouncer import start_pgbouncer
from tests.schedulers import JOBS
from tests.schedulers import ROOT
from tests.schedulers import Schedulers
from tests.schedulers import long_interval
from tests.schedulers import server_now
from tests.schedulers import wait_for
from tests.test_control_room import HANG
from tests.test_control_room import controls
from tests.test_control_room import due
from tests.test_control_room import heartbeats
from tests.test_control_room import output
from tests.test_control_room import run_jobs
from tests.test_control_room import schedulers

Status = JobRun.Status
Action = JobControl.Action
HOUR = ["--poll-interval", "3600"]  # polling would see a request an hour later
LISTENER = "listener (advisory_lock)"
SECOND = datetime.timedelta(seconds=1)
T = TypeVar("T")

#: The fixtures of tests/test_control_room.py: its rows emptied before and after the test, its
#: schedulers (and their job processes) killed at the end.
FIXTURES = (controls, heartbeats, schedulers)

on_postgresql = pytest.mark.parametrize("using", ["postgresql"], indirect=True)


@dataclass(frozen=True)
class Session:
    """A listening session, as pg_stat_activity shows it."""

    backend: int  # the server's pid
    process: int | None  # the OS pid of the process that opened it (its application_name)
    query: str
    state: str
    query_start: datetime.datetime


def listener_sessions(using: str) -> list[Session]:
    """The listening sessions on ``using``'s test database, by backend pid."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name, query, state, query_start FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE %s ORDER BY pid",
            [f"%{LISTENER}%"],
        )
        rows = cursor.fetchall()
    return [
        Session(backend, holder_process(application)[0], query, state, started)
        for backend, application, query, state, started in rows
    ]


def alive_until(process: subprocess.Popen, condition: Callable[[], T], what: str) -> T:
    """``wait_for(condition)``, failing at once if the scheduler ``process`` exits."""

    def met() -> T:
        if process.poll() is not None:
            raise AssertionError(f"run_jobs exited with status {process.returncode}: {what}")
        return condition()

    return wait_for(met, what, HANG)


def sessions_of(using: str, pid: int) -> list[Session]:
    return [session for session in listener_sessions(using) if session.process == pid]


def listening(using: str, process: subprocess.Popen, *, other_than: int | None = None) -> Session:
    """Wait until ``process`` listens (on a session other than ``other_than``), then until it
    has made the poll that follows (a pass polls after it listened): its heartbeat moves
    twice after the LISTEN, and a pass beats at most once. From then on, with
    ``--poll-interval 3600``, only a notification makes it look for requests."""

    def listens() -> Session | None:
        for session in sessions_of(using, process.pid):
            if session.backend != other_than and session.query == 'LISTEN "advisory_lock"':
                return session
        return None

    session = alive_until(process, listens, f"a listening session of scheduler {process.pid}")
    beats_after(using, process, session.query_start, 2)
    assert process.poll() is None
    return session


def beats_after(
    using: str, process: subprocess.Popen, moment: datetime.datetime, count: int
) -> datetime.datetime:
    """Wait until ``process`` has recorded ``count`` heartbeats after ``moment`` (the
    database's clock), and return the last. A pass beats (at most once) before it polls and
    starts what is due: the passes before the last beat have ended."""
    beats = SchedulerHeartbeat.objects.using(using).filter(pid=process.pid)
    for number in range(1, count + 1):
        later = beats.filter(last_seen__gt=moment).values_list("last_seen", flat=True)
        moment = alive_until(
            process, later.first, f"heartbeat {number} of {count} of scheduler {process.pid}"
        )
    return moment


def ended_here(schedulers: Schedulers, process: subprocess.Popen, name: str, slot: str) -> str:
    """Wait until ``process`` has reaped the run of ``slot`` (it says so after it forgot the
    child: the entry is free for its next run there)."""
    line = f"{name} [{slot}] succeeded."
    return alive_until(
        process, lambda: line in output(schedulers, process) and line, f"the end of {line}"
    )


def scheduled_run(ledger: QuerySet[JobRun], process: subprocess.Popen, name: str) -> JobRun:
    """The first run of ``name`` (a new entry runs its latest due slot at once), succeeded."""
    succeeded = ledger.filter(job_name=name, status=Status.SUCCEEDED)
    return alive_until(process, succeeded.first, f"{name}'s first run")


def manual_run(ledger: QuerySet[JobRun], process: subprocess.Popen, request: JobControl) -> JobRun:
    """The run of a run-now ``request``, succeeded."""
    succeeded = ledger.filter(period=request.slot, status=Status.SUCCEEDED)
    return alive_until(process, succeeded.first, f"the run of {request.slot}")


def settings_module(folder: Path, name: str, **lock: object) -> list[str]:
    """argv for ``manage.py``: tests/schedule_settings.py with ``lock`` added to
    ADVISORY_LOCK, as the module ``name`` written in ``folder``."""
    (folder / f"{name}.py").write_text(
        "from tests.schedule_settings import *  # noqa: F403\n"
        "from tests.schedule_settings import ADVISORY_LOCK\n\n"
        f"ADVISORY_LOCK = {{**ADVISORY_LOCK, **{lock!r}}}\n"
    )
    return ["--settings", name, "--pythonpath", str(folder)]


def all_ended(schedulers: Schedulers, process: subprocess.Popen, name: str) -> str:
    """The scheduler's output once each job process it started for ``name`` has ended
    (and been said), else ''."""
    text = output(schedulers, process)
    started = len(re.findall(rf"^run_jobs: {name} \[.+\] started", text, re.M))
    ended = len(re.findall(rf"^run_jobs: {name} \[.+\] (succeeded|failed|skipped)", text, re.M))
    return text if started and started == ended else ""


def polled_since_its_runs(
    using: str, schedulers: Schedulers, process: subprocess.Popen, name: str
) -> None:
    """Wait until the job processes that ``process`` started for ``name`` have ended, then
    for two heartbeats: the pass that says a run's end looks for requests (or the next one
    does), and has ended by then (a pass beats at most once). With ``--poll-interval 3600``,
    only a notification or a poll every second can then see a request."""
    alive_until(process, lambda: all_ended(schedulers, process, name), f"the runs of {name}")
    beats_after(using, process, server_now(using), 2)


# Requests are heard at once, not at the next poll.


@on_postgresql
def test_a_run_now_request_is_heard_at_once_with_an_hour_between_polls(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    process = schedulers.start(schedule, *HOUR)
    scheduled = scheduled_run(ledger, process, "report")
    ended_here(schedulers, process, "report", scheduled.period)
    listening(using, process)

    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    assert request.action == Action.RUN_NOW
    manual = manual_run(ledger, process, request)
    assert manual.job_name == "report" and manual.started_at >= request.requested_at
    assert f"report [{request.slot}] started" in output(schedulers, process)
    assert process.poll() is None


@on_postgresql
def test_a_pause_stops_the_slots_that_fall_due_after_it_with_an_hour_between_polls(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1}}
    process = schedulers.start(schedule, *HOUR)
    scheduled_run(ledger, process, "tick")
    listening(using, process)

    status, out, err = run_jobs(schedulers, schedule, "--pause", "tick")
    assert (status, out.splitlines()) == (0, ["run_jobs: tick paused (fleet-wide)."]), err
    # The pause is committed: a slot that falls due from now on is looked at by a pass whose
    # clock was read after the commit, and whose look at the pauses comes after that. (Pauses
    # are read by every pass: the notification only wakes the scheduler.)
    committed = server_now(using)
    # A heartbeat 3 s later: the passes before it have looked at the slots that fell due
    # meanwhile, and said "started" for each slot they started.
    beats_after(using, process, committed + 3 * SECOND, 1)
    started = re.findall(r"^run_jobs: tick \[(.+)\] started", output(schedulers, process), re.M)
    assert started, "the slots before the pause were started"
    assert [slot for slot in started if due(slot) >= committed] == []
    assert not [run for run in ledger.filter(job_name="tick") if due(run.period) >= committed]
    assert process.poll() is None


# One listening session per scheduler process.


@on_postgresql
def test_each_scheduler_process_listens_on_one_session_of_its_own(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1}}
    fleet = [schedulers.start(schedule) for _ in range(2)]
    for process in fleet:
        listening(using, process)
    # Job processes were forked meanwhile (each inherits its scheduler's listening socket):
    # none listens, and no scheduler opened a second session.
    wait_for(lambda: ledger.filter(status=Status.SUCCEEDED).count() >= 3, "3 runs", HANG)
    sessions = listener_sessions(using)
    for process in fleet:
        [session] = [session for session in sessions if session.process == process.pid]
        assert (session.query, session.state) == ('LISTEN "advisory_lock"', "idle"), session
    jobs = set(ledger.values_list("pid", flat=True))
    assert [session for session in sessions if session.process in jobs] == []
    assert all(process.poll() is None for process in fleet)


# A lost listening session is replaced, and requests are heard again.


@on_postgresql
def test_a_terminated_listening_session_is_replaced_and_requests_are_heard_again(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    process = schedulers.start(schedule, *HOUR)
    scheduled = scheduled_run(ledger, process, "report")
    ended_here(schedulers, process, "report", scheduled.period)
    first = listening(using, process)
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [first.backend])
        assert cursor.fetchone() == (True,)

    second = listening(using, process, other_than=first.backend)
    assert second.backend != first.backend
    assert [session.backend for session in sessions_of(using, process.pid)] == [second.backend]
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    manual_run(ledger, process, request)
    assert process.poll() is None
    err = (schedulers.folder / f"run_jobs.{process.number}.err").read_text()
    assert err.count("Listening for notifications on database 'default' failed") == 1, err


# MariaDB and SQLite have no notifications: schedulers poll.


@pytest.mark.parametrize("using", ["default", "mysql"], indirect=True)
def test_without_notifications_there_is_no_listener_and_run_now_is_polled(
    using, ledger, controls, heartbeats, schedulers
):
    connection = connections[using]
    assert not backend_class(connection).notifications
    assert backend_class(connection).listener(connection, "advisory_lock") is None
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    process = schedulers.start(schedule)
    scheduled = scheduled_run(ledger, process, "report")
    ended_here(schedulers, process, "report", scheduled.period)
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    manual = manual_run(ledger, process, request)
    assert manual.started_at >= request.requested_at
    assert process.poll() is None
    errors = (schedulers.folder / f"run_jobs.{process.number}.err").read_text()
    assert "listen" not in errors.lower(), errors


# A transaction-mode pooler without a direct alias: W002, no listener, polling.


def check(folder: Path, name: str, **lock: object) -> tuple[int, str]:
    """``manage.py check`` as a process, on PostgreSQL's test database as "default" (the
    schedulers' settings), with a schedule and ``lock`` in ADVISORY_LOCK: (status, output)."""
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": 3600}}
    argv = settings_module(folder, name, SCHEDULE=schedule, **lock)
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check", *argv],
        cwd=ROOT,
        env={
            **os.environ,
            "ADVISORY_LOCK_TEST_WORKER": "1",
            "ADVISORY_LOCK_TEST_DEFAULT": "postgresql",
            "PYTHONPATH": str(ROOT),
        },
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    return done.returncode, done.stdout + done.stderr


@on_postgresql
def test_w002_for_a_transaction_pooler_without_a_direct_alias(using, tmp_path):
    status, out = check(tmp_path, "pooled", POOL_MODE={"default": "transaction"})
    assert status == 0 and out.count("advisory_lock.W002") == 1, out
    assert "The schedule's job processes on database alias 'default' can't run" in out, out
    # The same database through another alias, with no pooler: listened on.
    status, out = check(
        tmp_path,
        "direct",
        POOL_MODE={"default": "transaction"},
        DIRECT_ALIAS={"default": "postgresql"},
    )
    assert status == 0 and "W002" not in out, out


@on_postgresql
def test_a_scheduler_behind_a_transaction_pooler_does_not_listen_and_polls(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    # The latest due slot is done (run once, without the pooler): the scheduler behind it
    # starts no run of the entry, whose end would look for requests (its runs fail, below).
    status, out, err = schedulers.once(schedule)
    assert (status, ledger.get().status) == (0, Status.SUCCEEDED), out + err
    pooled = settings_module(tmp_path, "pooled", POOL_MODE={"default": "transaction"})
    before = server_now(using)
    process = schedulers.start(schedule, *HOUR, *pooled)
    # Two heartbeats: it has waited between passes (where it would open its listener), and
    # made the poll of its start; the next poll of the interval is an hour away.
    beats_after(using, process, before, 2)
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    # Polled every second, whatever --poll-interval (a defect, fixed: it waited for the
    # next poll of the interval, an hour): the request's run is started. It does not get
    # its lock: the entry's lock is a session lock, which POOL_MODE "transaction" refuses on
    # the alias, and the scheduler says so (once: tests/test_scheduler_refusals.py). (With a
    # DIRECT_ALIAS, runs lock, and the scheduler listens, through that one: below.)
    started = f"report [{request.slot}] started"
    alive_until(process, lambda: started in output(schedulers, process), "the request's start")
    refused = (
        f"report [{request.slot}] did not start (NotSupportedError: Session-scoped locks "
        f"can't work on database 'default'"
    )
    alive_until(process, lambda: refused in output(schedulers, process), "its refusal")
    assert sessions_of(using, process.pid) == []
    assert process.poll() is None
    errors = (schedulers.folder / f"run_jobs.{process.number}.err").read_text()
    assert errors.count("Not listening for notifications: ADVISORY_LOCK['POOL_MODE']") == 1


@on_postgresql
def test_with_a_direct_alias_the_scheduler_listens_there_and_hears_requests(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    direct = settings_module(
        tmp_path,
        "direct",
        POOL_MODE={"default": "transaction"},
        DIRECT_ALIAS={"default": "postgresql"},  # the same test database, no pooler
    )
    process = schedulers.start(schedule, *HOUR, *direct)
    scheduled = scheduled_run(ledger, process, "report")
    ended_here(schedulers, process, "report", scheduled.period)
    listening(using, process)
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    manual_run(ledger, process, request)
    [session] = sessions_of(using, process.pid)
    assert session.query == 'LISTEN "advisory_lock"'


# A transaction-mode pooler that nobody declared: the scheduler finds out that it hears
# nothing, says so once, and polls for requests every second.


def bounced_settings(folder: Path, name: str, bouncer: PgBouncer) -> list[str]:
    """argv for ``manage.py``: tests/schedule_settings.py with "default" reaching its test
    database through ``bouncer``, and no POOL_MODE (the pooler undeclared), as the module
    ``name`` written in ``folder``."""
    (folder / f"{name}.py").write_text(
        "from tests.schedule_settings import *  # noqa: F403\n"
        "from tests.schedule_settings import DATABASES\n\n"
        f"DATABASES = {{**DATABASES, 'default': {{**DATABASES['default'], "
        f"'HOST': {bouncer.host!r}, 'PORT': '{bouncer.port}'}}}}\n"
    )
    return ["--settings", name, "--pythonpath", str(folder)]


UNHEARD = "Listening for notifications on database alias 'default' hears nothing"


@on_postgresql
def test_behind_an_undeclared_transaction_pooler_requests_are_polled_every_second_said_once(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    """Regression: through PgBouncer in transaction mode, undeclared, the scheduler listened
    on a session that the pooler hands to other clients between transactions, and whose
    notifications it drops ("got packet 'A' from server when not linked"): it heard nothing,
    said nothing, and with ``--poll-interval 3600`` a run-now waited for the next poll, an
    hour. Now its listening connection's own test notification never arrives: it says so
    once, and looks for requests every second.

    The entry's slots fall due once a year, and a slot that fell due over a minute ago is
    not caught up (``catch_up: "none"``): no run of it goes on before the request, whose
    session locks the pooler would scatter over its server connections (one left on a
    server connection that the request's claim then meets: an undeclared pooler breaks
    session locks, which is why the warning says to declare it)."""
    schedule = {"report": {"callable": f"{JOBS}.tick", "cron": "0 0 1 1 *", "catch_up": "none"}}
    with start_pgbouncer(pool_mode="transaction") as bouncer:
        bounced = bounced_settings(tmp_path, "bounced", bouncer)
        process = schedulers.start(schedule, *HOUR, *bounced)
        # The warning, then two heartbeats: the pass that said it has ended, and so have the
        # polls of the scheduler's start. The next poll of the interval is an hour away, the
        # hang guard a minute.
        errors = schedulers.folder / f"run_jobs.{process.number}.err"
        alive_until(process, lambda: UNHEARD in errors.read_text(), "the warning")
        beats_after(using, process, server_now(using), 2)

        status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
        assert status == 0, out + err
        [request] = controls.filter(action=JobControl.Action.RUN_NOW)
        started = f"report [{request.slot}] started"
        alive_until(process, lambda: started in output(schedulers, process), "the request's run")

        # Said once: two more heartbeats, then the scheduler stopped.
        beats_after(using, process, server_now(using), 2)
        process.send_signal(signal.SIGTERM)
        status, out, err = schedulers.finish(process)
    assert status == 0, out + err
    assert err.count(UNHEARD) == 1, err
    [warning] = [line for line in err.splitlines() if UNHEARD in line]
    assert "POOL_MODE" in warning and "DIRECT_ALIAS" in warning, warning
    assert "Listening for notifications on database 'default' failed" not in err, err


# A defect (fixed; this failed before): a request heard while its entry runs here waited for
# the next poll.


@on_postgresql
def test_a_request_heard_while_its_entry_runs_here_starts_when_the_run_ends(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"long": {"callable": f"{JOBS}.until_go", "every": long_interval(using)}}
    process = schedulers.start(schedule, *HOUR)
    running = alive_until(
        process, ledger.filter(job_name="long", status=Status.RUNNING).first, "the scheduled run"
    )
    listening(using, process)
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "long")
    assert status == 0, out + err
    [request] = controls.all()
    # Heard while the entry runs here, and polled for in the pass after it: not started there
    # (one run of an entry at a time). The notification reaches the listener as its row's
    # transaction commits: three heartbeats after that, the pass that polled has ended.
    beats_after(using, process, server_now(using), 3)
    assert f"long [{request.slot}] started" not in output(schedulers, process)
    (tmp_path / "go").touch()
    ended_here(schedulers, process, "long", running.period)
    # The entry is free here. Two heartbeats later, a whole pass has run since: one that
    # looks at the pending requests would have started this one.
    beats_after(using, process, server_now(using), 2)
    assert f"long [{request.slot}] started" in output(schedulers, process)
    manual_run(ledger, process, request)
