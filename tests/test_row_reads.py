"""The scheduler's reads written as SQL (``advisory_lock.row_reads``) answer as the ORM's
queries did, on every backend, in one statement each.

- ``pauses_of`` against ``pauses()`` (the ORM's, one job at a time) for every history of up
  to three pause / resume switches, at every ``since`` around them (the same instant
  included), with ``USE_TZ`` on and off;
- ``deciding_attempts`` against ``deciding_attempt()`` for every pair of statuses;
- ``pending_requests``: only the run-now slots with no attempt, not expired, and the
  changes of stored entries since the time asked.
"""

from __future__ import annotations

import datetime
import itertools

import pytest
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from advisory_lock import JobRun
from advisory_lock.datetimes import to_field
from advisory_lock.ledger import deciding_attempt
from advisory_lock.ledger import deciding_attempts
from advisory_lock.models import JobControl
from advisory_lock.row_reads import rows_in
from advisory_lock.scheduling.control import pauses
from advisory_lock.scheduling.control import pauses_of
from advisory_lock.scheduling.control import pending_requests
from tests.test_control_room import controls  # noqa: F401 (a fixture)

Action = JobControl.Action
Status = JobRun.Status
AT = datetime.datetime(2026, 12, 7, 3, 0, 0, 250000, tzinfo=datetime.timezone.utc)
OFFSETS = (-10, 0, 10)  # minutes from AT of a history's switches, in order


def histories() -> list[tuple[tuple[str, int], ...]]:
    """Every sequence of up to three switches, each a pause or a resume, at OFFSETS."""
    found = []
    for length in range(len(OFFSETS) + 1):
        for actions in itertools.product((Action.PAUSE, Action.RESUME), repeat=length):
            for offsets in itertools.combinations(OFFSETS, length):
                found.append(tuple(zip(actions, offsets, strict=True)))
    return found


def one_statement(using, read):
    with CaptureQueriesContext(connections[using]) as queries:
        answer = read()
    assert len(queries.captured_queries) == 1, queries.captured_queries
    return answer


@pytest.mark.parametrize("use_tz", [True, False], ids=["USE_TZ", "naive"])
def test_pauses_of_answers_as_pauses_for_every_history_and_since(
    using,
    controls,  # noqa: F811 (the fixture)
    use_tz,
):
    with override_settings(USE_TZ=use_tz):
        names = []
        for number, history in enumerate(histories()):
            name = f"job-{number}"
            names.append(name)
            for action, minutes in history:
                controls.create(
                    job_name=name,
                    action=action,
                    requested_at=to_field(AT + datetime.timedelta(minutes=minutes)),
                )
        controls.create(job_name="not-asked", action=Action.PAUSE, requested_at=to_field(AT))
        assert len(names) == 27
        for minutes in (-15, -10, -5, 0, 5, 10, 15):
            since = AT + datetime.timedelta(minutes=minutes)
            found = one_statement(using, lambda at=since: pauses_of(using, names, at))
            expected = {name: pauses(using, name, since) for name in names}
            assert {name: spans for name, spans in found.items() if spans} == {
                name: spans for name, spans in expected.items() if spans
            }, since
            assert any(expected.values())  # each since finds some pauses
        assert pauses_of(using, [], AT) == {}


@pytest.mark.parametrize(
    "statuses", list(itertools.product(list(Status), repeat=2)), ids=lambda pair: "-".join(pair)
)
def test_deciding_attempts_answers_as_deciding_attempt(using, ledger, statuses):
    slot = "2026-12-07T03:00"
    succeeded = 0
    for attempt, status in enumerate(statuses, start=1):
        if status == Status.SUCCEEDED:
            succeeded += 1
            if succeeded > 1:
                continue  # the database refuses a second success of a slot
        ledger.create(
            job_name="report",
            period=slot,
            attempt=attempt,
            status=status,
            started_at=AT,
            lock_key="k",
        )
    ledger.create(job_name="report", period="other", status=Status.SUCCEEDED, started_at=AT)
    ledger.create(job_name="other", period=slot, status=Status.FAILED, started_at=AT)
    asked = {"report": slot, "never": slot}
    found = one_statement(using, lambda: deciding_attempts(using, asked))
    best = deciding_attempt(ledger.filter(job_name="report", period=slot))
    assert best is not None and set(found) == {"report"}
    assert found["report"] == (best.status, best.attempt, best.status == Status.SUCCEEDED)
    assert deciding_attempts(using, {}) == {}


def test_pending_requests_are_the_run_now_requests_with_no_attempt_and_the_changes(
    using,
    controls,  # noqa: F811 (the fixture)
    ledger,
):
    for name in ("report", "asked-and-run"):
        controls.create(job_name=name, action=Action.RUN_NOW, requested_at=AT, slot=f"s-{name}")
    controls.create(
        job_name="report",
        action=Action.RUN_NOW,
        requested_at=AT - datetime.timedelta(hours=2),  # expired
        slot="old",
    )
    controls.create(job_name="stored", action=Action.CHANGE, requested_at=AT)
    controls.create(job_name="report", action=Action.PAUSE, requested_at=AT)
    ledger.create(job_name="asked-and-run", period="s-asked-and-run", started_at=AT, lock_key="k")
    now = AT + datetime.timedelta(minutes=1)
    found = one_statement(using, lambda: pending_requests(using, now, AT))
    assert [(row.action, row.job_name, row.slot) for row in found] == [
        (Action.RUN_NOW, "report", "s-report"),
        (Action.CHANGE, "stored", ""),
    ]
    run_now = controls.get(slot="s-report")
    assert found[0].pk == run_now.pk
    # No changes asked for, and the changes' rows are older than asked for.
    assert [row.job_name for row in pending_requests(using, now)] == ["report"]
    later = AT + datetime.timedelta(seconds=1)
    assert [row.action for row in pending_requests(using, now, later)] == [Action.RUN_NOW]


def test_rows_in_reads_the_columns_of_the_rows_named(using, ledger):
    for name, period in (("a", "1"), ("a", "2"), ("b", "1"), ("c", "1")):
        ledger.create(job_name=name, period=period, started_at=AT, attempt=3)
    read = one_statement(
        using,
        lambda: rows_in(JobRun, using, ("job_name", "attempt"), job_name=["a", "b"], period=["1"]),
    )
    assert sorted(read) == [("a", 3), ("b", 3)]
    assert rows_in(JobRun, using, ("job_name",), job_name=[], period=["1"]) == []


#: How each backend shows a statement's plan (which names the indexes it reads).
EXPLAIN = {"postgresql": "EXPLAIN ", "mysql": "EXPLAIN ", "sqlite": "EXPLAIN QUERY PLAN "}
#: The statistics each backend's planner reads to choose between an index and the table.
ANALYZE = {
    "postgresql": "ANALYZE job_controls",
    "mysql": "ANALYZE TABLE job_controls",
    "sqlite": "ANALYZE job_controls",
}


def test_the_look_for_requests_reads_an_index_not_the_whole_table(
    using,
    controls,  # noqa: F811 (the fixture)
):
    """job_controls keeps every request, pause and change of every job; the schedulers look
    for the pending ones several times a second. Before migration 0011 its one index led with
    the job's name, which the look does not give: each look read the whole table. Now the
    plan each database makes reads job_controls_pending_idx, on a table of a year's requests."""
    connection = connections[using]
    actions = list(Action)
    old = [
        JobControl(
            job_name=f"job-{number % 200}",
            action=actions[number % len(actions)],
            requested_at=to_field(AT - datetime.timedelta(days=365, minutes=-number)),
            slot=f"s-{number}",
        )
        for number in range(20_000)
    ]
    controls.bulk_create(old, batch_size=1000)
    controls.create(job_name="report", action=Action.RUN_NOW, requested_at=to_field(AT), slot="s")
    controls.create(job_name="stored", action=Action.CHANGE, requested_at=to_field(AT))
    statements = []

    def keep(execute, sql, params, many, context):
        statements.append((sql, params))
        return execute(sql, params, many, context)

    now = AT + datetime.timedelta(minutes=1)
    with connection.cursor() as cursor:
        cursor.execute(ANALYZE[connection.vendor])
        if cursor.description is not None:
            cursor.fetchall()  # MariaDB's ANALYZE TABLE answers with a result set
    with connection.execute_wrapper(keep):
        found = pending_requests(using, now, AT)
    assert [(row.action, row.job_name) for row in found] == [
        (Action.RUN_NOW, "report"),
        (Action.CHANGE, "stored"),
    ]
    [(sql, params)] = statements
    with connection.cursor() as cursor:
        cursor.execute(EXPLAIN[connection.vendor] + sql, params)
        plan = "\n".join(" ".join(str(value) for value in row) for row in cursor.fetchall())
    assert "job_controls_pending_idx" in plan, plan
