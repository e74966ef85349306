"""The control room: scheduler heartbeats, pause and resume, run now, the slot timeline and
the overdue report's use of them, on every backend.

The schedulers are real ``manage.py run_jobs`` processes, started as tests/schedulers.py
starts them (its ``Schedulers``): settings tests/schedule_settings.py on the pytest run's
test database of the alias under test, the schedule from the environment as JSON, the jobs
from tests/schedule_jobs.py, which append a JSON line to ``runs.jsonl`` for each run. Each
starts in a session of its own, and the test ends it and every job process it forked. The
operators' commands (``run_jobs --check/--status/--pause/--resume/--run-now``) are run the
same way, as processes of their own; the timeline and the overdue report, and a few controls
whose timing matters, are called in this process (``call_command``) on the same database.

Every wait is for an event (a row, a status, the database server's clock passing an
instant) with a generous bound that only fails on a hang; every time compared is the
database server's.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import signal
import socket
import subprocess

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import F
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import manual_slot
from advisory_lock.scheduling.first_seen import EntrySeen
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from advisory_lock.scheduling.liveness import live_within
from tests.schedule_jobs import runs
from tests.schedulers import JOBS
from tests.schedulers import Schedulers
from tests.schedulers import alive
from tests.schedulers import long_interval
from tests.schedulers import minute
from tests.schedulers import server_now
from tests.schedulers import wait_for

UTC = datetime.timezone.utc
Status = JobRun.Status
Action = JobControl.Action
#: The hang guard of every wait: only a hang takes this long.
HANG = 60
SECOND = datetime.timedelta(seconds=1)
TIMELINE_KEYS = {"slot", "run_id", "outcome", "attempts", "started", "duration", "host"}


@pytest.fixture
def controls(using):
    """The JobControl rows of ``using`` (pause, resume, run now), empty before and after."""
    rows = JobControl.objects.using(using)
    rows.all().delete()
    yield rows
    rows.all().delete()


@pytest.fixture
def heartbeats(using):
    """The SchedulerHeartbeat rows of ``using``, empty before and after the test."""
    rows = SchedulerHeartbeat.objects.using(using)
    rows.all().delete()
    yield rows
    rows.all().delete()


@pytest.fixture
def schedulers(using, ledger, controls, heartbeats, tmp_path):
    """Starts ``run_jobs`` processes; they (and their jobs) are killed before the rows of the
    ledger, the controls and the heartbeats are deleted."""
    started = Schedulers(using, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


def run_jobs(schedulers: Schedulers, schedule: dict, *argv: str) -> tuple[int, str, str]:
    """``manage.py run_jobs *argv`` as a process of its own: (exit status, stdout, stderr)."""
    return schedulers.finish(schedulers.start(schedule, *argv))


def output(schedulers: Schedulers, process: subprocess.Popen) -> str:
    """What a running ``run_jobs`` has printed so far (it writes unbuffered)."""
    return (schedulers.folder / f"run_jobs.{process.number}.out").read_text()


def command(name: str, *argv: str, schedule=None, **options) -> tuple[int, str, str]:
    """``call_command(name, *argv)`` in this process with ADVISORY_LOCK's SCHEDULE (and
    ``options``) set: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    lock = {**settings.ADVISORY_LOCK, "SCHEDULE": schedule or {}, **options}
    with override_settings(ADVISORY_LOCK=lock):
        try:
            call_command(name, *argv, stdout=out, stderr=err)
        except SystemExit as exit:
            return exit.code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def due(slot: str) -> datetime.datetime:
    """When a slot of an ``every``-second entry fell due (its name, in UTC: the tests' zone)."""
    return datetime.datetime.fromisoformat(slot).replace(tzinfo=UTC)


def naive(moment: datetime.datetime, zone=UTC) -> str:
    """``moment`` as an ISO time without an offset, read in ``zone``."""
    return f"{moment.astimezone(zone):%Y-%m-%dT%H:%M:%S}"


# Liveness: --check and --status follow a real scheduler's heartbeat, and its death.


def test_check_and_status_follow_a_real_schedulers_heartbeat_and_its_death(
    using, schedulers, heartbeats
):
    idle = {"idle": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    status, out, err = run_jobs(schedulers, idle, "--check")
    assert status == 1 and out == "", out + err
    # Said by the command, and by the no_scheduler_alive alert's ERROR record, which the
    # tests' LOGGING sends to stderr too.
    line = "run_jobs: no scheduler alive: none has run on this database in the last 7 days."
    assert err.splitlines() == [line, line]

    process = schedulers.start(idle)
    # Two beats: the row is there, and its last_seen advances.
    beating = heartbeats.filter(pid=process.pid, last_seen__gt=F("started_at"))
    row = wait_for(beating.first, "the scheduler's second heartbeat", HANG)
    assert row.host == socket.gethostname() and row.version

    status, out, err = run_jobs(schedulers, idle, "--check")
    assert (status, out.splitlines()) == (0, ["run_jobs: 1 scheduler(s) alive."]), err
    status, out, err = run_jobs(schedulers, idle, "--status", "--json")
    assert status == 0, err
    [listed] = json.loads(out)
    assert set(listed) == {"host", "pid", "started", "last_seen"}
    assert listed["host"] == socket.gethostname() and listed["pid"] == process.pid
    assert datetime.datetime.fromisoformat(listed["started"]) == row.started_at
    assert datetime.datetime.fromisoformat(listed["last_seen"]) >= row.last_seen

    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    killed = server_now(using)
    # --check (here, to ask often): alive until the database's clock is past the last
    # heartbeat + live_within(), then "no scheduler alive", and the heartbeat never moves again.
    checks = []

    def check_fails() -> bool:
        before = server_now(using)
        status, _, err = command("run_jobs", "--check", "--database", using)
        checks.append((before, status, server_now(using), err))
        return status == 1

    wait_for(check_fails, "--check failing after the kill", HANG)
    last_seen = heartbeats.get(pid=process.pid).last_seen
    assert last_seen <= killed
    for before, status, _, _ in checks[:-1]:
        assert status == 0 and before <= last_seen + live_within()
    _, _, after, err = checks[-1]
    assert after > last_seen + live_within()
    since = f"run_jobs: no scheduler alive since {last_seen.isoformat()} (the last heartbeat)."
    assert err.splitlines() == [since]
    status, out, err = run_jobs(schedulers, idle, "--check")
    assert (status, out, err.splitlines()) == (1, "", [since, since])  # and the alert's record
    status, out, err = run_jobs(schedulers, idle, "--status", "--json")
    assert (status, json.loads(out)) == (0, []), err
    assert heartbeats.get(pid=process.pid).last_seen == last_seen


# Pause and resume.


def test_the_slots_that_fall_due_while_paused_never_run_and_the_timeline_says_paused(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1}}
    process = schedulers.start(schedule)
    ticks = ledger.filter(job_name="tick")
    wait_for(ticks.filter(status=Status.SUCCEEDED).exists, "a first run", HANG)
    # The pause command reads its time, then commits its row: a scheduler that looks in
    # between, just after a slot fell due, still starts that slot (a window of the command's
    # own latency, milliseconds: not what this test is about). Paused mid-second, in this
    # process (no start-up in between), no slot falls due in that window.
    wait_for(lambda: 0.2 < server_now(using).microsecond / 1e6 < 0.6, "mid-second", HANG)

    def here(*argv):
        return command("run_jobs", *argv, "--database", using, schedule=schedule)

    status, out, _ = here("--pause", "tick")
    assert (status, out.splitlines()) == (0, ["run_jobs: tick paused (fleet-wide)."])
    [pause] = controls.all()
    assert (pause.job_name, pause.action, pause.slot) == ("tick", Action.PAUSE, "")
    paused_at = pause.requested_at
    status, out, _ = here("--pause", "tick")
    assert out.splitlines() == ["run_jobs: tick was already paused: nothing changed."]
    assert status == 0 and controls.count() == 1
    status, out, _ = here("--list", "--json")
    assert [(row["name"], row["paused"]) for row in json.loads(out)] == [("tick", True)]
    # The scheduler goes on beating (and looking at the schedule) while slots fall due.
    later = paused_at + 4 * SECOND
    polling = heartbeats.filter(pid=process.pid, last_seen__gt=later)
    wait_for(polling.exists, "four seconds of pause, the scheduler alive", HANG)

    status, out, err = run_jobs(schedulers, schedule, "--resume", "tick")
    assert (status, out.splitlines()) == (0, ["run_jobs: tick resumed (fleet-wide)."]), err
    resumed_at = controls.get(action=Action.RESUME).requested_at
    assert resumed_at > later

    def run_after_the_resume():
        succeeded = ticks.filter(status=Status.SUCCEEDED).values_list("period", flat=True)
        return max((slot for slot in succeeded if due(slot) >= resumed_at), default=None)

    first_after = wait_for(run_after_the_resume, "a run of a slot after the resume", HANG)
    assert process.poll() is None

    def while_paused(slot: str) -> bool:
        return paused_at <= due(slot) < resumed_at

    assert [run.period for run in ticks if while_paused(run.period)] == []
    assert [run["slot"] for run in runs(tmp_path) if while_paused(run["slot"])] == []
    since = naive(paused_at - 3 * SECOND)
    status, out, _ = command(
        "job_runs", "--timeline", "tick", "--since", since, "--json", "--database", using,
        schedule=schedule,
    )  # fmt: skip
    assert status == 0
    slots = json.loads(out)
    paused = [slot for slot in slots if while_paused(slot["slot"])]
    assert len(paused) >= 4, slots  # 4 s of pause: 4 slots
    assert all(
        (slot["outcome"], slot["attempts"], slot["started"], slot["duration"], slot["host"])
        == ("paused", 0, None, None, "")
        for slot in paused
    ), paused
    assert [slot for slot in slots if slot["outcome"] == "paused"] == paused
    [after] = [slot for slot in slots if slot["slot"] == first_after]
    assert (after["outcome"], after["attempts"]) == ("succeeded", 1)
    assert after["host"] == socket.gethostname()


def test_a_pause_lets_the_run_going_on_finish(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"long": {"callable": f"{JOBS}.until_go", "every": long_interval(using)}}
    process = schedulers.start(schedule)
    running = wait_for(
        ledger.filter(job_name="long", status=Status.RUNNING).first, "the run", HANG
    )
    status, out, err = run_jobs(schedulers, schedule, "--pause", "long")
    assert (status, out.splitlines()) == (0, ["run_jobs: long paused (fleet-wide)."]), err
    paused_at = controls.get(action=Action.PAUSE).requested_at
    # The scheduler has looked at the schedule since the pause: its job goes on.
    seen = heartbeats.filter(pid=process.pid, last_seen__gt=paused_at + SECOND)
    wait_for(seen.exists, "a heartbeat after the pause", HANG)
    assert alive(running.pid) and ledger.get(pk=running.pk).status == Status.RUNNING
    (tmp_path / "go").touch()
    wait_for(lambda: ledger.get(pk=running.pk).status != Status.RUNNING, "the run's end", HANG)
    run = ledger.get(pk=running.pk)
    assert run.status == Status.SUCCEEDED and run.started_at < paused_at < run.finished_at
    assert [(r["job"], r["pid"]) for r in runs(tmp_path)] == [("long", running.pid)]
    assert ledger.count() == 1


# Run now.


def test_run_now_runs_the_entry_once_in_a_slot_of_its_own_with_three_schedulers_alive(
    using, ledger, controls, heartbeats, schedulers, tmp_path
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    fleet = [schedulers.start(schedule) for _ in range(3)]
    # A new entry runs its most recent due slot first: that one stays the latest due.
    scheduled = wait_for(
        ledger.filter(job_name="report", status=Status.SUCCEEDED).first,
        "the scheduled slot's run",
        HANG,
    )
    pids = {process.pid for process in fleet}
    wait_for(lambda: set(heartbeats.values_list("pid", flat=True)) == pids, "3 heartbeats", HANG)

    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 0, out + err
    [request] = controls.all()
    assert (request.job_name, request.action) == ("report", Action.RUN_NOW)
    assert request.slot == manual_slot(request.requested_at)
    assert request.slot == f"manual:{request.requested_at.replace(microsecond=0).isoformat()}"
    assert f"report requested as slot {request.slot}" in out
    manual = wait_for(
        ledger.filter(period=request.slot, status=Status.SUCCEEDED).first, "the manual run", HANG
    )
    # Every scheduler has looked for requests since the run was claimed (none starts it any
    # more), and every job process they started for it has ended.
    claimed = server_now(using)
    wait_for(
        lambda: heartbeats.filter(pid__in=pids, last_seen__gt=claimed).count() == 3,
        "a heartbeat of each scheduler after the claim",
        HANG,
    )
    run = f"report [{request.slot}]"

    def all_ended():
        text = "".join(output(schedulers, process) for process in fleet)
        ends = sum(text.count(f"{run} {how}") for how in ("succeeded", "skipped", "failed"))
        return text.count(f"{run} started") == ends and text

    text = wait_for(all_ended, "the end of each job process started for the request", HANG)
    assert text.count(f"{run} started") >= 1
    assert text.count(f"{run} succeeded.") == 1 and f"{run} failed" not in text, text
    assert list(ledger.filter(period=request.slot)) == [manual]
    assert manual.attempt == 1 and manual.started_at >= request.requested_at
    # The scheduled slot is untouched: its one run, and no other run of the entry.
    assert list(ledger.exclude(pk=manual.pk)) == [scheduled] and scheduled.attempt == 1
    recorded = sorted((r["slot"], r["pid"]) for r in runs(tmp_path))
    assert recorded == sorted([(scheduled.period, scheduled.pid), (manual.period, manual.pid)])
    # The timeline lists it, at the time it was requested.
    status, out, _ = command(
        "job_runs", "--timeline", "report", "--json", "--database", using, schedule=schedule
    )
    slots = {slot["slot"]: slot for slot in json.loads(out)}
    assert (slots[request.slot]["outcome"], slots[request.slot]["attempts"]) == ("succeeded", 1)
    assert slots[scheduled.period]["outcome"] == "succeeded"
    assert list(slots).index(request.slot) < list(slots).index(scheduled.period)  # newest first
    assert all(process.poll() is None for process in fleet)


def test_run_now_is_refused_with_no_scheduler_alive_and_for_an_unknown_entry(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"report": {"callable": f"{JOBS}.tick", "every": long_interval(using)}}
    now = server_now(using)
    gone = heartbeats.create(
        host="gone", pid=2**22 + 1, started_at=now - datetime.timedelta(hours=1),
        last_seen=now - 10 * SECOND,
    )  # fmt: skip
    gone.refresh_from_db()
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "report")
    assert status == 1 and out == "", out + err
    assert f"no scheduler alive since {gone.last_seen.isoformat()}" in err
    assert "nobody would run 'report'" in err
    status, out, err = run_jobs(schedulers, schedule, "--run-now", "nope")
    assert status != 0 and "ADVISORY_LOCK['SCHEDULE'] has no entry named 'nope'" in err, err
    status, out, err = run_jobs(schedulers, schedule, "--pause", "nope")
    assert status != 0 and "ADVISORY_LOCK['SCHEDULE'] has no entry named 'nope'" in err, err
    assert not controls.exists() and not ledger.exists()


# The timeline's JSON, on rows written here for a fixed schedule.


def test_the_timeline_gives_each_slot_its_outcome_attempts_start_duration_and_host(
    using, ledger, controls
):
    schedule = {"minutely": {"callable": f"{JOBS}.tick", "every": 60}}
    current = server_now(using).replace(second=0, microsecond=0)

    def slot(ago: int) -> datetime.datetime:
        return current - datetime.timedelta(minutes=ago)

    def attempt(ago, status, number=1, *, host="web-1", seconds=1.5, period=None):
        started = slot(ago) + 2 * SECOND
        ended = status != Status.RUNNING
        return ledger.create(
            job_name="minutely", period=period or minute(slot(ago)), attempt=number,
            status=status, started_at=started, host=host,
            finished_at=started + datetime.timedelta(seconds=seconds) if ended else None,
            duration=datetime.timedelta(seconds=seconds) if ended else None,
        )  # fmt: skip

    attempt(5, Status.SUCCEEDED)
    attempt(4, Status.FAILED)
    retried = attempt(4, Status.SUCCEEDED, 2, host="web-2", seconds=3)
    # 3 minutes ago: no run, missed. 2 minutes ago: no run, paused.
    controls.create(job_name="minutely", action=Action.PAUSE, requested_at=slot(2) - 10 * SECOND)
    controls.create(job_name="minutely", action=Action.RESUME, requested_at=slot(2) + SECOND)
    attempt(1, Status.FAILED)
    manual = attempt(
        1, Status.SUCCEEDED, period=manual_slot(slot(1) + 30 * SECOND), host="web-9", seconds=2
    )
    running = attempt(0, Status.RUNNING, host="web-3")
    # A scheduler first loaded the entry 6 minutes ago: its slots since then that did not
    # run are missed (or paused).
    EntrySeen.objects.using(using).create(job_name="minutely", first_seen=slot(6))
    status, out, _ = command(
        "job_runs", "--timeline", "minutely", "--since", naive(slot(5) - 30 * SECOND),
        "--json", "--database", using, schedule=schedule,
    )  # fmt: skip
    assert status == 0
    rows = json.loads(out)
    assert all(set(row) == TIMELINE_KEYS for row in rows), rows
    if len(rows) == 8:  # the next minute fell due meanwhile: no run yet
        assert rows.pop(0)["outcome"] == "missed"

    def started(run):
        return run.started_at.isoformat()

    first = ledger.get(period=minute(slot(5)))
    failed = ledger.get(period=minute(slot(1)))
    # Newest first.
    assert rows == [
        {"slot": minute(slot(0)), "run_id": running.pk, "outcome": "running", "attempts": 1,
         "started": started(running), "duration": None, "host": "web-3"},
        {"slot": manual.period, "run_id": manual.pk, "outcome": "succeeded", "attempts": 1,
         "started": started(manual), "duration": 2.0, "host": "web-9"},
        {"slot": minute(slot(1)), "run_id": failed.pk, "outcome": "failed", "attempts": 1,
         "started": started(failed), "duration": 1.5, "host": "web-1"},
        {"slot": minute(slot(2)), "run_id": None, "outcome": "paused", "attempts": 0,
         "started": None, "duration": None, "host": ""},
        {"slot": minute(slot(3)), "run_id": None, "outcome": "missed", "attempts": 0,
         "started": None, "duration": None, "host": ""},
        {"slot": minute(slot(4)), "run_id": retried.pk, "outcome": "succeeded", "attempts": 2,
         "started": started(retried), "duration": 3.0, "host": "web-2"},
        {"slot": minute(slot(5)), "run_id": first.pk, "outcome": "succeeded", "attempts": 1,
         "started": started(first), "duration": 1.5, "host": "web-1"},
    ]  # fmt: skip
    assert all(type(row["attempts"]) is int for row in rows)
    assert all(datetime.datetime.fromisoformat(row["started"]) for row in rows if row["started"])
    # The table says the same.
    status, out, _ = command(
        "job_runs", "--timeline", "minutely", "--since", naive(slot(5) - 30 * SECOND),
        "--database", using, schedule=schedule,
    )  # fmt: skip
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["slot", "outcome", "attempts"]
    [paused_line] = [line for line in lines if line.startswith(minute(slot(2)))]
    assert paused_line.split()[1:3] == ["paused", "0"]


def test_since_without_an_offset_is_in_the_ledgers_time_zone_and_a_bad_one_is_refused(
    using, ledger
):
    schedule = {"minutely": {"callable": f"{JOBS}.tick", "every": 60}}
    kolkata = datetime.timezone(datetime.timedelta(hours=5, minutes=30))  # no DST
    start = server_now(using).replace(second=0, microsecond=0) - datetime.timedelta(minutes=2)
    expected = f"{start.astimezone(kolkata):%Y-%m-%dT%H:%M}"  # slot names: the ledger's zone
    EntrySeen.objects.using(using).create(job_name="minutely", first_seen=start - 60 * SECOND)
    for since in (naive(start, kolkata), naive(start, kolkata) + "+05:30", naive(start) + "Z"):
        status, out, _ = command(
            "job_runs", "--timeline", "minutely", "--since", since, "--json",
            "--database", using, schedule=schedule, LEDGER_TIME_ZONE="Asia/Kolkata",
        )  # fmt: skip
        slots = [row["slot"] for row in json.loads(out)]
        assert status == 0 and slots[-1] == expected and len(slots) in (3, 4), (since, slots)
    with pytest.raises(CommandError, match="--since: 'last tuesday' is not an ISO 8601 date"):
        command(
            "job_runs", "--timeline", "minutely", "--since", "last tuesday",
            "--database", using, schedule=schedule,
        )  # fmt: skip
    with pytest.raises(CommandError, match="--since goes with --timeline"):
        command("job_runs", "--since", naive(start), "--database", using, schedule=schedule)
    with pytest.raises(CommandError, match="has no entry named 'hourly'"):
        command("job_runs", "--timeline", "hourly", "--database", using, schedule=schedule)


# The overdue report.


def overdue(using: str, schedule: dict, **options) -> tuple[int, dict[str, dict]]:
    """``job_runs --overdue --json``: (exit status, {job: its entry})."""
    status, out, _ = command(
        "job_runs", "--overdue", "--json", "--database", using, schedule=schedule, **options
    )
    return status, {job["job"]: job for job in json.loads(out)}


def test_overdue_skips_a_slot_that_fell_due_while_paused_and_says_no_scheduler_is_alive(
    using, ledger, controls, heartbeats, schedulers
):
    schedule = {"poll": {"callable": f"{JOBS}.tick", "every": long_interval(using), "grace": 5}}
    nightly = {"JOBS": {"example.nightly": {"period": "daily"}}}  # declared, not scheduled
    # Never run, no scheduler ever seen.
    status, jobs = overdue(using, schedule, **nightly)
    assert status == 1 and set(jobs) == {"poll", "example.nightly"}
    assert jobs["poll"]["reason"] == (
        "no scheduler alive: none has run on this database in the last 7 days"
    )
    assert jobs["example.nightly"]["reason"] is None  # no scheduler runs it
    status, out, _ = command("job_runs", "--overdue", "--database", using, schedule=schedule)
    assert status == 1 and out.splitlines()[-1] == f"Why: {jobs['poll']['reason']}.", out
    # The last heartbeat, a minute ago.
    now = server_now(using)
    gone = heartbeats.create(
        host="gone", pid=2**22 + 1, started_at=now - datetime.timedelta(hours=1),
        last_seen=now - datetime.timedelta(minutes=1),
    )  # fmt: skip
    gone.refresh_from_db()
    status, jobs = overdue(using, schedule)
    fell_due = datetime.datetime.fromisoformat(jobs["poll"]["slot_ended_at"])
    assert status == 1 and jobs["poll"]["reason"] == (
        f"no scheduler alive since {gone.last_seen.isoformat()} (the last heartbeat)"
    )
    # Paused before the slot fell due, and still paused: that slot is not overdue.
    controls.create(job_name="poll", action=Action.PAUSE, requested_at=fell_due - 10 * SECOND)
    assert overdue(using, schedule) == (0, {})
    # Resumed before it fell due: it is.
    controls.create(job_name="poll", action=Action.RESUME, requested_at=fell_due - 5 * SECOND)
    status, jobs = overdue(using, schedule)
    assert status == 1 and set(jobs) == {"poll"}
    # A live scheduler (of another schedule: it does not run "poll"): no reason given.
    process = schedulers.start({})
    wait_for(heartbeats.filter(pid=process.pid).exists, "a live scheduler's heartbeat", HANG)

    def reported_with_no_reason():
        jobs = overdue(using, schedule)[1]
        return jobs["poll"]["reason"] is None and jobs

    jobs = wait_for(reported_with_no_reason, "the report with a scheduler alive", HANG)
    assert jobs["poll"]["missing_slot"] and process.poll() is None
    assert not ledger.filter(job_name="poll").exists()


#: SCHEDULER_HEARTBEAT values that are not a number of seconds in (0, 3600].
BAD_HEARTBEATS = [0, -1, "5", True, None, float("nan"), float("inf"), 3601]


@pytest.mark.parametrize("heartbeat", BAD_HEARTBEATS, ids=repr)
def test_a_bad_scheduler_heartbeat_is_a_check_warning_and_run_jobs_refuses_it(heartbeat):
    lock = {**settings.ADVISORY_LOCK, "SCHEDULER_HEARTBEAT": heartbeat}
    with override_settings(ADVISORY_LOCK=lock):
        [warning] = [message for message in run_checks() if message.id == "advisory_lock.W013"]
        with pytest.raises(CommandError, match=re.escape("ADVISORY_LOCK['SCHEDULER_HEARTBEAT']")):
            call_command("run_jobs", "--check")
    assert "ADVISORY_LOCK['SCHEDULER_HEARTBEAT']" in warning.msg


def test_a_good_scheduler_heartbeat_sets_the_liveness_window():
    with override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, "SCHEDULER_HEARTBEAT": 2.5}):
        assert not [message for message in run_checks() if message.id == "advisory_lock.W013"]
        assert live_within() == datetime.timedelta(seconds=7.5)
