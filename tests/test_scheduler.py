"""``manage.py run_jobs``: real scheduler processes, on every backend, each slot run once.

The schedulers are real ``run_jobs`` processes (settings: tests/schedule_settings.py, which
reads the schedule from the environment) on the pytest run's test databases; the jobs are
the callables of tests/schedule_jobs.py, which record each run (its slot, pid and
``time.monotonic()`` start and end) so that overlaps can be seen. Each scheduler starts in a
session of its own: the test ends it and every job process it forked, whatever happened.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from advisory_lock import JobRun
from advisory_lock.keys import make_key
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.probes import is_free
from tests.schedule_jobs import runs
from tests.schedulers import HANG
from tests.schedulers import JOBS
from tests.schedulers import UTC
from tests.schedulers import Schedulers
from tests.schedulers import alive
from tests.schedulers import at
from tests.schedulers import long_interval
from tests.schedulers import minute
from tests.schedulers import second
from tests.schedulers import server_now
from tests.schedulers import settings_with
from tests.schedulers import wait_for

Status = JobRun.Status
#: The fleet of ``run_jobs --once`` per backend. Each instance is a Django start-up, about
#: 0.5 s of CPU: 64 would take half a minute of make test on two cores; bench/scheduler.py
#: starts 64 on each backend.
FLEET = {"default": 8, "postgresql": 16, "mysql": 8}
DJANGO_ADMIN = [str(Path(sys.executable).parent / "django-admin")]
PYTHON_M_DJANGO = [sys.executable, "-m", "django"]


@pytest.fixture
def ledger(using):
    """The JobRun rows of ``using``, emptied after the test."""
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def wait_until_up(schedulers: Schedulers, fleet: list[subprocess.Popen]) -> None:
    """Wait for each scheduler of ``fleet`` to record its heartbeat: its signal handlers are
    installed by then (before, SIGTERM's default action would kill a scheduler still
    starting: status -15)."""
    beats = SchedulerHeartbeat.objects.using(schedulers.using)
    for process in fleet:
        wait_for(beats.filter(pid=process.pid).exists, f"{process.pid}'s heartbeat", HANG)


def succeeded_slots(ledger, job_name: str) -> set[str]:
    return set(
        ledger.filter(job_name=job_name, status=Status.SUCCEEDED).values_list("period", flat=True)
    )


# A fleet of schedulers: each slot once, none missed, no overlap.


def test_three_schedulers_run_every_slot_of_an_every_second_entry_once_without_overlap(
    using, ledger, schedulers, tmp_path
):
    # catch_up="all": a slot that falls due while every scheduler is slowed down (a loaded
    # machine) is run late, not skipped for the newer one ("latest"), so none is missed.
    schedule = {"tick": {"callable": f"{JOBS}.tick", "every": 1, "catch_up": "all"}}
    fleet = [schedulers.start(schedule) for _ in range(3)]
    wait_for(lambda: ledger.filter(status=Status.SUCCEEDED).exists(), "a first run", HANG)
    window_start = server_now(using)
    time.sleep(10)  # the window's length, not an ordering: what follows waits for events
    window_end = server_now(using)
    # Every slot that fell due in the window, at least a second before the end, is to run
    # once: the fleet is stopped only once each of them has (a slot missed is never run:
    # the wait then fails), and once each scheduler is up to handle the signal.
    expected = {
        second(at(s))
        for s in range(math.ceil(window_start.timestamp()), int(window_end.timestamp()))
    }
    wait_for(lambda: expected <= succeeded_slots(ledger, "tick"), "every slot of the window", HANG)
    wait_until_up(schedulers, fleet)
    for process in fleet:
        process.send_signal(signal.SIGTERM)
    for process in fleet:
        status, _, err = schedulers.finish(process, timeout=HANG)
        assert status == 0, err
    succeeded = Counter(ledger.filter(status=Status.SUCCEEDED).values_list("period", flat=True))
    assert len(expected) >= 9
    assert sorted(expected - set(succeeded)) == []  # missing
    assert [slot for slot, count in succeeded.items() if count > 1] == []  # duplicates
    assert not ledger.exclude(status=Status.SUCCEEDED).exists()
    recorded = sorted(runs(tmp_path), key=lambda run: run["start"])
    assert sorted(run["slot"] for run in recorded) == sorted(succeeded.elements())
    overlaps = [(a, b) for a, b in pairwise(recorded) if b["start"] < a["end"]]
    assert overlaps == []


def test_a_scheduler_killed_mid_run_takes_its_job_with_it_and_another_retries_the_slot(
    using, ledger, schedulers, tmp_path
):
    schedule = {
        "slow": {
            "callable": f"{JOBS}.slow_the_first_time",
            "every": long_interval(using),
            "retries": 1,
        },
        # catch_up="all": a tick slowed down past its second (a loaded machine) runs late.
        "tick": {"callable": f"{JOBS}.tick", "every": 1, "catch_up": "all"},
    }
    fleet = [schedulers.start(schedule) for _ in range(3)]
    pid_file = tmp_path / "slow.pid"
    wait_for(pid_file.exists, "the slow job's start", HANG)
    job, parent = map(int, pid_file.read_text().split())
    [victim] = [process for process in fleet if process.pid == parent]
    victim.kill()  # SIGKILL: no handler runs, nothing is recorded
    wait_for(lambda: not alive(job), "the job process dying with its scheduler", HANG)
    # Killed mid-run, not gone at the end of its two minutes: a run that ends records itself.
    assert [run for run in runs(tmp_path) if run["pid"] == job] == []
    # Its row keeps "running" under a free lock; another scheduler retries the slot, which is
    # still the most recent due one.
    attempts = wait_for(
        lambda: (
            ledger.filter(job_name="slow", attempt=2, status=Status.SUCCEEDED).exists()
            and list(ledger.filter(job_name="slow").order_by("attempt"))
        ),
        "the retry",
        HANG,
    )
    assert [run.attempt for run in attempts] == [1, 2]
    assert attempts[0].period == attempts[1].period and attempts[0].pid == job
    assert attempts[0].status in (Status.ABANDONED, Status.FAILED)
    [retry] = [run for run in runs(tmp_path) if run["job"] == "slow"]
    assert retry["ppid"] != parent and retry["ppid"] in {process.pid for process in fleet}
    # The two others never stop scheduling: the next seconds still run.
    after = math.ceil(server_now(using).timestamp())
    due = {second(at(after)), second(at(after + 1))}
    wait_for(lambda: due <= succeeded_slots(ledger, "tick"), "the next two seconds' ticks", HANG)
    others = [process for process in fleet if process is not victim]
    assert all(process.poll() is None for process in others)
    wait_until_up(schedulers, others)
    for process in others:
        process.send_signal(signal.SIGTERM)
    assert [schedulers.finish(process, timeout=HANG)[0] for process in others] == [0, 0]


def test_catch_up_is_honoured_when_a_scheduler_starts_after_all_were_stopped(
    using, ledger, schedulers, tmp_path
):
    # The history of a fleet stopped for several slots: each entry's last run, long ago.
    now = server_now(using)
    every2 = int(now.timestamp()) // 2 * 2 - 10  # a 2-second slot, five slots ago
    hour_ago = now - datetime.timedelta(hours=1, minutes=3)
    cron = f"{hour_ago.minute} * * * *"  # fired 3 to 4 minutes ago, an hour ago, ...
    schedule = {
        "latest": {"callable": f"{JOBS}.tick", "every": 2, "catch_up": "latest"},
        "all": {"callable": f"{JOBS}.tick", "every": 2, "catch_up": "all"},
        "none": {"callable": f"{JOBS}.tick", "cron": cron, "catch_up": "none"},
        "none-every": {"callable": f"{JOBS}.tick", "every": 2, "catch_up": "none"},
    }
    seeded = {name: second(at(every2)) for name in ("latest", "all", "none-every")}
    seeded["none"] = minute(hour_ago)
    for name, period in seeded.items():
        ledger.create(job_name=name, period=period, status=Status.SUCCEEDED, started_at=now)
    status, out, err = schedulers.once(schedule)
    assert status == 0, out + err
    new = {name: [] for name in schedule}  # the slots each entry ran, oldest first
    for name, period in ledger.order_by("period").values_list("job_name", "period"):
        if period != seeded[name]:
            new[name].append(period)
    current = second(at(int(now.timestamp()) // 2 * 2))
    # all: each missed slot once, oldest first, up to the one due when it started.
    last = datetime.datetime.fromisoformat(new["all"][-1]).replace(tzinfo=UTC).timestamp()
    assert new["all"] == [second(at(s)) for s in range(every2 + 2, int(last) + 1, 2)]
    assert new["all"][-1] >= current
    # latest: one run, of the most recent due slot.
    assert len(new["latest"]) == 1 and new["latest"][0] >= current
    # none: no missed slot; only a slot that falls due at start-up (for an every entry, the
    # current one).
    assert new["none"] == []
    assert len(new["none-every"]) == 1 and new["none-every"][0] >= current
    assert not ledger.exclude(status=Status.SUCCEEDED).exists()
    ran = Counter((run["job"], run["slot"]) for run in runs(tmp_path))
    assert sorted(ran) == sorted((name, slot) for name, slots in new.items() for slot in slots)
    assert set(ran.values()) == {1}


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_the_due_slot_comes_from_the_database_servers_clock_not_the_hosts(
    using, ledger, schedulers
):
    # MySQL's SET TIMESTAMP moves NOW()/UTC_TIMESTAMP() for a session: every connection of
    # the scheduler and its job starts 10 days ahead of this host.
    ahead = (datetime.datetime.now(UTC) + datetime.timedelta(days=10)).replace(microsecond=0)
    schedule = {"skewed": {"callable": f"{JOBS}.tick", "every": 60}}
    status, out, err = schedulers.once(schedule, server_clock=ahead)
    assert status == 0, out + err
    run = ledger.get(job_name="skewed")
    assert run.period == minute(ahead) and run.status == Status.SUCCEEDED
    assert run.started_at == ahead
    status, out, err = schedulers.finish(
        schedulers.start(schedule, "--list", "--json", server_clock=ahead)
    )
    assert status == 0, err
    [entry] = json.loads(out)
    next_minute = ahead.replace(second=0) + datetime.timedelta(minutes=1)
    assert datetime.datetime.fromisoformat(entry["next_run"]) == next_minute


def test_a_fleet_of_run_jobs_once_started_together_runs_the_due_slot_once(
    using, ledger, schedulers, tmp_path
):
    # The run takes 2 s: the instances that start meanwhile find the entry's lock busy, the
    # later ones find the slot done.
    schedule = {"fleet": {"callable": f"{JOBS}.nap", "every": long_interval(using)}}
    fleet = [schedulers.start(schedule, "--once") for _ in range(FLEET[using])]
    results = [schedulers.finish(process) for process in fleet]
    assert [status for status, _, _ in results if status != 0] == [], results
    [run] = ledger.all()
    assert run.job_name == "fleet" and run.status == Status.SUCCEEDED
    assert [(r["slot"], r["pid"]) for r in runs(tmp_path)] == [(run.period, run.pid)]
    outputs = "".join(out for _, out, _ in results)
    assert outputs.count(" succeeded.") == 1


# Stopping.


def test_sigterm_stops_claiming_lets_running_jobs_finish_within_the_grace_then_stops_them(
    using, ledger, schedulers
):
    every = long_interval(using)
    schedule = {
        "short": {"callable": f"{JOBS}.until_go", "every": every},  # until the test says
        "long": {"callable": f"{JOBS}.sleep_long", "every": every},  # 2 min
        "tick": {"callable": f"{JOBS}.tick", "every": 1},
    }
    process = schedulers.start(schedule, "--stop-grace", "10")
    wait_for(
        lambda: ledger.filter(job_name__in=["short", "long"], status=Status.RUNNING).count() == 2,
        "both jobs running",
        HANG,
    )
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    (schedulers.folder / "go").touch()  # the short job ends within the grace (10 s)
    status, out, err = schedulers.finish(process)
    took = time.monotonic() - started
    assert status == 0, err
    assert 9.5 < took < HANG, (took, out)  # it waited for the grace (the long job's)
    assert ledger.get(job_name="short").status == Status.SUCCEEDED  # finished within grace
    long = ledger.get(job_name="long")
    assert long.status == Status.FAILED and "stopped with the scheduler" in long.error
    assert not ledger.filter(status=Status.RUNNING).exists()
    # No claim after the signal: at most the run whose start the signal interrupted (the
    # scheduler says so when its handler runs), none after it.
    _, signal_line, after_signal = out.partition("run_jobs: signal 15")
    assert signal_line, out
    assert after_signal.count("] started (pid") <= 1, after_signal
    assert is_free("schedule:long", using) and is_free("schedule:short", using)


def test_sigterm_to_the_whole_process_group_does_not_cut_the_grace_short(
    using, ledger, schedulers
):
    """Regression: the job processes shared the scheduler's process group and kept SIGTERM's
    default action, so a signal to the group (Ctrl-C, systemd's control-group kill) killed
    them at once and the grace was never given."""
    every = long_interval(using)
    schedule = {"short": {"callable": f"{JOBS}.nap", "every": every}}  # 2 s
    process = schedulers.start(schedule, "--stop-grace", "10")
    wait_for(lambda: ledger.filter(job_name="short", status=Status.RUNNING).exists(), "the job")
    os.killpg(process.pid, signal.SIGTERM)  # the scheduler and, before the fix, its jobs
    status, _, err = schedulers.finish(process)
    assert status == 0, err
    assert ledger.get(job_name="short").status == Status.SUCCEEDED


def test_a_running_row_left_on_a_slot_nobody_claims_again_is_swept_to_abandoned(
    using, ledger, schedulers
):
    """Regression: a row left ``running`` by a dead scheduler on a slot that is no longer the
    most recent due one stayed ``running`` for ever (only a claim of that slot looked)."""
    every = long_interval(using)
    stale = ledger.create(
        job_name="stale",
        period="2020-01-01T00:00:00",
        attempt=1,
        status=Status.RUNNING,
        started_at=server_now(using) - datetime.timedelta(days=3),
        host="gone",
        pid=2**22 + 1,
        lock_key=make_key("schedule:stale").identity,  # a free lock: its owner is gone
    )
    schedule = {"stale": {"callable": f"{JOBS}.tick", "every": every}}
    process = schedulers.start(schedule)
    wait_for(lambda: ledger.get(pk=stale.pk).status == Status.ABANDONED, "the sweep")
    process.send_signal(signal.SIGTERM)
    assert schedulers.finish(process)[0] == 0


# Exit status, listing, and how the project is started.


def test_run_jobs_once_exits_with_status_1_when_a_run_failed(using, ledger, schedulers):
    every = long_interval(using)
    schedule = {
        "ok": {"callable": f"{JOBS}.tick", "every": every},
        "boom": {"callable": f"{JOBS}.fail", "every": every, "retries": 0},
        "checks": {"command": "check", "every": every},
    }
    status, out, err = schedulers.once(schedule)
    assert status == 1 and "a scheduled run failed" in err, out + err
    runs_by_name = {run.job_name: run for run in ledger.all()}
    assert runs_by_name["ok"].status == runs_by_name["checks"].status == Status.SUCCEEDED
    boom = runs_by_name["boom"]
    assert boom.status == Status.FAILED
    assert "RuntimeError: the scheduled job failed on purpose" in boom.error


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
@pytest.mark.parametrize("program", [DJANGO_ADMIN, PYTHON_M_DJANGO], ids=["django-admin", "-m"])
def test_run_jobs_once_runs_the_same_from_django_admin_and_python_m_django(
    program, using, ledger, schedulers
):
    every = long_interval(using)
    schedule = {
        "ok": {"callable": f"{JOBS}.tick", "every": every},
        "boom": {"callable": f"{JOBS}.fail", "every": every},
    }
    status, out, err = schedulers.once(schedule, program=program)
    assert status == 1 and "a scheduled run failed" in err, out + err
    assert dict(ledger.values_list("job_name", "status")) == {"ok": "succeeded", "boom": "failed"}


def test_run_jobs_list_shows_each_entry_with_its_next_run_and_its_last_run(using, ledger):
    started = server_now(using).replace(microsecond=0) - datetime.timedelta(minutes=5)
    ledger.create(
        job_name="report", period=minute(started), status=Status.SUCCEEDED, started_at=started,
        duration=datetime.timedelta(seconds=42),
    )  # fmt: skip
    schedule = {
        "report": {"callable": f"{JOBS}.tick", "cron": "*/5 * * * *"},
        "poll": {"callable": f"{JOBS}.tick", "every": 30},
    }
    table, listing = io.StringIO(), io.StringIO()
    with settings_with(schedule):
        call_command("run_jobs", "--list", "--database", using, stdout=table)
        call_command("run_jobs", "--list", "--json", "--database", using, stdout=listing)
    lines = table.getvalue().splitlines()
    assert any(line.startswith("report ") and "succeeded" in line for line in lines), lines
    assert any(line.startswith("poll ") for line in lines), lines
    rows = {row["name"]: row for row in json.loads(listing.getvalue())}
    assert set(rows) == {"report", "poll"}
    now = server_now(using)
    for row in rows.values():
        next_run = datetime.datetime.fromisoformat(row["next_run"])
        assert (
            now - datetime.timedelta(seconds=1) < next_run <= now + datetime.timedelta(minutes=5)
        )
    assert rows["report"]["last_status"] == "succeeded"
    assert datetime.datetime.fromisoformat(rows["report"]["last_started"]) == started
    assert rows["poll"]["last_status"] is None and rows["poll"]["last_started"] is None


# The admin's Schedule page (it reads the ledger of the default database: SQLite here).


@pytest.mark.django_db
def test_the_admin_schedule_page_shows_each_entry_its_next_slot_and_its_last_run(admin_client):
    now = datetime.datetime.now(UTC).replace(microsecond=0)
    JobRun.objects.create(
        job_name="report", period="2026-11-29T03:00", status=Status.SUCCEEDED, started_at=now,
        duration=datetime.timedelta(seconds=42),
    )  # fmt: skip
    schedule = {
        "report": {"callable": f"{JOBS}.tick", "cron": "0 3 * * *"},
        "poll": {"callable": f"{JOBS}.tick", "every": 60},
    }
    with settings_with(schedule):
        before = datetime.datetime.now(UTC)
        response = admin_client.get(reverse("admin:advisory_lock_jobrun_schedule"))
        after = datetime.datetime.now(UTC)
    page = response.content.decode()
    assert response.status_code == 200 and 'class="errornote"' not in page, page
    rows = page.split("<tbody>")[1].split("</tr>")
    [report] = [row for row in rows if "<td>report</td>" in row]
    [poll] = [row for row in rows if "<td>poll</td>" in row]
    tomorrow_3am = (before - datetime.timedelta(hours=3)).date() + datetime.timedelta(days=1)
    assert f"<td>{tomorrow_3am:%Y-%m-%d}T03:00</td>" in report
    assert "<td>succeeded</td>" in report and " · 42.0 s</small>" in report  # the last run
    next_minutes = {minute(t + datetime.timedelta(minutes=1)) for t in (before, after)}
    assert any(f"<td>{name}</td>" in poll for name in next_minutes), poll
    assert "overdue" not in report and "overdue" not in poll


@pytest.mark.django_db
def test_the_admin_schedule_page_marks_an_entry_overdue_past_its_grace(admin_client):
    now = datetime.datetime.now(UTC)
    for ago in (0, 60, 120):  # "punctual" succeeded in every recent minute
        moment = now - datetime.timedelta(seconds=ago)
        JobRun.objects.create(
            job_name="punctual", period=minute(moment), status=Status.SUCCEEDED,
            started_at=moment,
        )  # fmt: skip
    schedule = {
        "late": {"callable": f"{JOBS}.tick", "every": 60, "grace": 30},
        "punctual": {"callable": f"{JOBS}.tick", "every": 60, "grace": 30},
    }
    with settings_with(schedule):
        response = admin_client.get(reverse("admin:advisory_lock_jobrun_schedule"))
    page = response.content.decode()
    assert 'class="errornote"' not in page, page
    rows = page.split("<tbody>")[1].split("</tr>")
    [late] = [row for row in rows if "<td>late</td>" in row]
    [punctual] = [row for row in rows if "<td>punctual</td>" in row]
    assert 'class="overdue"' in late and "overdue: " in late
    assert "overdue" not in punctual


# Bad schedules: reported by the system checks (a warning: other commands run), refused by
# run_jobs, before anything runs.

BAD_ENTRIES = {
    "malformed cron": {"callable": f"{JOBS}.tick", "cron": "61 * * * *"},
    "every below 1": {"callable": f"{JOBS}.tick", "every": 0.5},
    "command and callable": {"command": "check", "callable": f"{JOBS}.tick", "every": 60},
    "neither command nor callable": {"every": 60},
    "unknown command": {"command": "no_such_command", "every": 60},
    "callable not importable": {"callable": f"{JOBS}.no_such_job", "every": 60},
    "unknown key": {"callable": f"{JOBS}.tick", "every": 60, "cacth_up": "all"},
    "atomic not a bool": {"callable": f"{JOBS}.tick", "every": 60, "atomic": "yes"},
}


@pytest.mark.parametrize("entry", BAD_ENTRIES.values(), ids=BAD_ENTRIES)
def test_a_bad_entry_is_a_system_check_warning_naming_it_and_run_jobs_refuses_it(entry):
    schedule = {"good": {"callable": f"{JOBS}.tick", "every": 60}, "the-bad-one": entry}
    with settings_with(schedule):
        errors = [message for message in run_checks() if message.id == "advisory_lock.W011"]
        assert errors and all("'the-bad-one'" in error.msg for error in errors), errors
        with pytest.raises(CommandError, match="the-bad-one"):
            call_command("run_jobs", "--once")


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_run_jobs_does_not_start_on_a_bad_schedule(using, ledger, schedulers):
    schedule = {
        "good": {"callable": f"{JOBS}.tick", "every": 1},
        "the-bad-one": BAD_ENTRIES["malformed cron"],
    }
    status, out, err = schedulers.once(schedule)
    assert status != 0 and "advisory_lock.W011" in err and "the-bad-one" in err, out + err
    process = schedulers.start(schedule, "--skip-checks")  # forever, were it to start
    status, out, err = schedulers.finish(process)
    assert status != 0 and "CommandError" in err and "the-bad-one" in err, out + err
    assert not ledger.exists()
