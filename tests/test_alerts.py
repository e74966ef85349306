"""The scheduler's alerts (issue 32, item 3): ``slot_failed``, ``slot_missed``,
``entry_unhealthy`` and ``no_scheduler_alive``, each sent once per event with the entry,
slot, run and error, and logged at ERROR with the same values as the record's ``extra``.

The schedulers are real ``run_jobs`` processes; tests/alertapp writes down, in each of them,
every signal received and every record of the ``advisory_lock.alerts`` logger. Two
schedulers run each schedule: an alert must come from one of them only.
"""

from __future__ import annotations

import datetime
import json
from io import StringIO

import pytest
from django.core.management import call_command

from advisory_lock import JobRun
from advisory_lock import signals
from advisory_lock.datetimes import to_field
from advisory_lock.schedule import _entry
from advisory_lock.scheduling.control import Action
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.first_seen import EntrySeen
from tests.schedulers import server_now
from tests.schedulers import wait_for

FAILED, SUCCEEDED = JobRun.Status.FAILED, JobRun.Status.SUCCEEDED
ALERTS = ("slot_failed", "slot_missed", "entry_unhealthy", "no_scheduler_alive")


def alerts(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def start_two(schedulers, schedule, path):
    env = {"ADVISORY_LOCK_TEST_ALERTS": str(path)}
    return [schedulers.start(schedule, env=env) for _ in range(2)]


def sent(path, name: str) -> list[dict]:
    return [line for line in alerts(path) if line.get("signal") == name]


def logged(path, name: str) -> list[dict]:
    return [line for line in alerts(path) if line["kind"] == "log" and line.get("event") == name]


def assert_logged_as_sent(path, name: str) -> None:
    """Each signal sent has its ERROR record, with the same values in ``extra``."""
    keys = ("database", "job_name", "slot", "run_id", "attempt", "error")
    signals_sent = sorted(tuple(str(line[key]) for key in keys) for line in sent(path, name))
    records = logged(path, name)
    assert {record["level"] for record in records} <= {"ERROR"}
    assert sorted(tuple(str(record[key]) for key in keys) for record in records) == signals_sent


def test_every_failed_attempt_is_alerted_once_by_the_scheduler_that_ran_it(
    schedulers, ledger, using, tmp_path
):
    path = tmp_path / "alerts.jsonl"
    schedule = {"boom": {"callable": "tests.schedule_jobs.fail", "every": 1, "retries": 1}}
    start_two(schedulers, schedule, path)
    wait_for(lambda: len(sent(path, "slot_failed")) >= 4, "4 failed attempts alerted")
    schedulers.kill_all()
    failed = {run.pk: run for run in ledger.filter(job_name="boom", status=FAILED)}
    alerted = sent(path, "slot_failed")
    # Once each: no attempt alerted twice, by one scheduler or by both.
    assert len({line["run_id"] for line in alerted}) == len(alerted)
    for line in alerted:
        run = failed[line["run_id"]]  # the failed row of that attempt
        assert (line["job_name"], line["slot"], line["attempt"]) == (
            "boom",
            run.period,
            run.attempt,
        )
        assert line["sender"] == "Entry"
        assert line["database"] == "default"  # the schedulers' alias for the test database
        assert "the scheduled job failed on purpose" in line["error"]
    assert_logged_as_sent(path, "slot_failed")
    assert any(
        "the scheduled job failed on purpose" in r["message"] for r in logged(path, "slot_failed")
    )


def test_a_run_past_its_timeout_is_alerted_as_failed_with_how(schedulers, ledger, using, tmp_path):
    path = tmp_path / "alerts.jsonl"
    schedule = {
        "slow": {
            "callable": "tests.schedule_jobs.sleep_long",
            "every": 3600,
            "timeout": 1,
            "retries": 0,
        }
    }
    start_two(schedulers, schedule, path)
    line = wait_for(lambda: sent(path, "slot_failed"), "the timeout alerted")[0]
    run = ledger.get(pk=line["run_id"])
    assert run.status == FAILED and line["slot"] == run.period
    assert "stopped after its timeout of 1s" in line["error"]
    assert_logged_as_sent(path, "slot_failed")


def test_the_slots_no_run_started_for_are_alerted_once_by_the_next_slots_scheduler(
    schedulers, ledger, using, tmp_path
):
    # Three entries due each minute. "gap" last ran 6 minutes before its current slot: the
    # 5 minutes between were missed. "paused" too, but it was paused over the 3 oldest of
    # them. "new" was never seen by a scheduler: none of its slots before is missed.
    path = tmp_path / "alerts.jsonl"
    options = {"callable": "tests.schedule_jobs.nothing", "cron": "* * * * *"}
    entry = _entry("gap", options)
    now = server_now(using)
    current = next(entry.slots_before(now))
    minute = datetime.timedelta(minutes=1)
    for name in ("gap", "paused"):
        # Known to the schedulers for 10 minutes (a scheduler first loaded it then).
        EntrySeen.objects.using(using).create(
            job_name=name, first_seen=to_field(current - 10 * minute)
        )
        old = current - 6 * minute
        ledger.create(
            job_name=name, period=entry.slot_name(old), attempt=1, status=SUCCEEDED,
            started_at=to_field(old), finished_at=to_field(old), host="elsewhere",
        )  # fmt: skip
    for action, at in (
        (Action.PAUSE, current - 5.5 * minute),
        (Action.RESUME, current - 2.5 * minute),
    ):
        JobControl.objects.using(using).create(
            job_name="paused", action=action, requested_at=to_field(at), requested_by="ops"
        )
    schedule = {name: options for name in ("gap", "paused", "new")}
    start_two(schedulers, schedule, path)
    fleets = ledger.exclude(host="elsewhere")
    wait_for(
        lambda: {"gap", "paused", "new"} <= set(fleets.values_list("job_name", flat=True)),
        "each entry's current slot started by the fleet",
    )
    wait_for(lambda: len(sent(path, "slot_missed")) >= 2, "the two gaps alerted")
    schedulers.kill_all()
    missed = {line["job_name"]: line for line in sent(path, "slot_missed")}
    assert len(sent(path, "slot_missed")) == 2 and set(missed) == {"gap", "paused"}
    for name, line in missed.items():
        # The slots between the last run and the first one this fleet started, newest first:
        # the fleet's first slot may be a minute after ``current`` if a minute passed.
        started = min(
            datetime.datetime.fromisoformat(period)
            for period in fleets.filter(job_name=name).values_list("period", flat=True)
        )
        expected = []
        slot = started.replace(tzinfo=current.tzinfo) - minute
        while slot > current - 6 * minute:
            if name != "paused" or slot > current - 2.5 * minute:
                expected.append(entry.slot_name(slot))
            slot -= minute
        assert line["slots"] == expected
        assert line["slot"] == expected[0] and line["run_id"] is None
        assert "no run of it started while it was due" in line["error"]
    assert_logged_as_sent(path, "slot_missed")


def test_no_scheduler_alive_is_alerted_by_the_check(ledger, using, caplog):
    received = []

    def receiver(sender, **kwargs):
        received.append(kwargs)

    signals.no_scheduler_alive.connect(receiver)
    try:
        with pytest.raises(SystemExit) as exit_status:
            call_command(
                "run_jobs", "--check", "--database", using, stdout=StringIO(), stderr=StringIO()
            )
    finally:
        signals.no_scheduler_alive.disconnect(receiver)
    assert exit_status.value.code == 1
    assert len(received) == 1
    assert received[0]["using"] == using and received[0]["entry"] is None
    assert "no scheduler alive" in received[0]["error"]
    records = [r for r in caplog.records if getattr(r, "event", None) == "no_scheduler_alive"]
    assert [r.levelname for r in records] == ["ERROR"]
    assert records[0].error == received[0]["error"]


def test_an_entry_is_alerted_unhealthy_once_when_its_last_alert_after_slots_have_failed(
    schedulers, ledger, using, tmp_path
):
    path = tmp_path / "alerts.jsonl"
    schedule = {
        "flaky": {
            "callable": "tests.schedule_jobs.fail",
            "every": 1,
            "retries": 0,
            "alert_after": 3,
        }
    }
    start_two(schedulers, schedule, path)
    # Twice as many failed slots as it takes: the streak goes on, and is not said again.
    wait_for(lambda: len(sent(path, "slot_failed")) >= 6, "6 failed slots")
    schedulers.kill_all()
    unhealthy = sent(path, "entry_unhealthy")
    assert len(unhealthy) == 1, unhealthy
    failed = sorted(ledger.filter(job_name="flaky", status=FAILED), key=lambda run: run.started_at)
    third = failed[2]  # the failure that made the streak
    assert (unhealthy[0]["slot"], unhealthy[0]["run_id"]) == (third.period, third.pk)
    assert "its last 3 slot(s) that ran failed" in unhealthy[0]["error"]
    assert_logged_as_sent(path, "entry_unhealthy")
