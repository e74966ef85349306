"""What an idle scheduler costs the database server, counted by the server.

A real ``run_jobs`` with 5 entries, then one with 500, none of them due (a yearly cron slot,
``catch_up: "none"``), at the default heartbeat interval. The server's own counters say how
many statements and new connections each made in a window of the server's clock; the test
fails if they grow with the number of entries, or pass the documented budget
(docs/scheduler.md, "What a scheduler costs"). Counts, never timings: the window is only
what the counts are divided by.

Counted so that nothing else on the server can add to them (other tests run at once on the
same servers, in databases of their own):

- PostgreSQL: ``pg_stat_database`` of the test database, which only this test's processes
  use meanwhile (xact_commit + xact_rollback: a statement in autocommit is a transaction;
  ``sessions``: the connections made to it). Read from the maintenance database ``postgres``,
  so the reads are not counted. A backend flushes its counts when it ends, so the counts are
  read once the scheduler's backends have ended (their OS processes gone).
- MariaDB: ``information_schema.USER_STATISTICS`` (``userstat``, switched on by the test) of a
  user of the scheduler's own, which nothing else connects as: its connections and its
  SELECT, UPDATE and other commands, counted by the server at each command's end.
"""

from __future__ import annotations

import dataclasses
import datetime
import signal

import pytest
from django.db import connections

from advisory_lock.conf import DEFAULTS
from tests.schedulers import HANG
from tests.schedulers import JOBS
from tests.schedulers import alive
from tests.schedulers import wait_for
from tests.test_control_room import heartbeats  # noqa: F401 (a fixture)

#: The budget of an idle scheduler, statements a second (docs/scheduler.md), whatever the
#: number of entries; and its connections: one, and PostgreSQL's listening one.
STATEMENTS_A_SECOND = {"postgresql": 1.0, "mysql": 2.0}
CONNECTIONS = {"postgresql": 2, "mysql": 1}
#: The window, in seconds of the server's clock, from the scheduler's first connection:
#: six heartbeats at the default interval, the start-up's statements (the first sweep,
#: the first look at every entry) counted in.
WINDOW = 6 * DEFAULTS["SCHEDULER_HEARTBEAT"]
#: What the statements a second of 500 entries may exceed those of 5 by: what another
#: process of the server may add to a database's counts (autovacuum), never an entry's cost.
NOISE = 0.25
#: The MariaDB user of the scheduler under test (one per xdist worker: its own counts).
USER_PREFIX = "al_costs"


def idle_schedule(size: int) -> dict:
    """``size`` entries that are not due: a yearly slot long past, not caught up."""
    return {
        f"idle{n:03}": {"callable": f"{JOBS}.tick", "cron": "0 0 1 1 *", "catch_up": "none"}
        for n in range(size)
    }


@dataclasses.dataclass
class Counts:
    statements: float
    connections: float


class PostgresCounter:
    """``pg_stat_database`` of the test database, read from the maintenance database."""

    def __init__(self, using: str) -> None:
        import psycopg

        settings_dict = connections[using].settings_dict
        self.database = settings_dict["NAME"]
        self.admin = psycopg.connect(
            host=settings_dict["HOST"],
            port=settings_dict["PORT"] or 5432,
            user=settings_dict["USER"],
            password=settings_dict["PASSWORD"],
            dbname="postgres",
            autocommit=True,
        )
        self.connections_of_test = [using]
        self.user: str | None = None

    def one(self, sql: str, *params):
        return self.admin.execute(sql, params).fetchone()

    def now(self) -> datetime.datetime:
        return self.one("SELECT statement_timestamp()")[0]

    def backends(self) -> list[int]:
        rows = self.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (self.database,)
        )
        return [pid for (pid,) in rows]

    def quiet(self) -> None:
        """Close this process's connections to the database and wait until every backend of
        the database has ended (its counts are flushed as it ends): none counts later."""
        for alias in self.connections_of_test:
            connections[alias].close()
        pids = set()

        def ended() -> bool:
            pids.update(self.backends())
            return not any(alive(pid) for pid in pids)

        wait_for(ended, f"the backends of {self.database} to end")

    def read(self) -> Counts:
        statements, sessions = self.one(
            "SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database "
            "WHERE datname = %s",
            self.database,
        )
        return Counts(statements, sessions)

    def first_connection(self) -> datetime.datetime | None:
        """When the scheduler's first backend started (None: not connected yet)."""
        return self.one(
            "SELECT min(backend_start) FROM pg_stat_activity WHERE datname = %s", self.database
        )[0]

    def close(self) -> None:
        self.admin.close()


class MariaDBCounter:
    """``USER_STATISTICS`` of a user of the scheduler's own, read as the tests' user."""

    def __init__(self, using: str) -> None:
        import os

        import MySQLdb

        settings_dict = connections[using].settings_dict
        self.database = settings_dict["NAME"]
        self.admin = MySQLdb.connect(
            host=settings_dict["HOST"],
            port=int(settings_dict["PORT"] or 3306),
            user=settings_dict["USER"],
            password=settings_dict["PASSWORD"],
            autocommit=True,
        )
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.user = f"{USER_PREFIX}_{worker}"[:32]
        self.admin.query("SET GLOBAL userstat = 1")  # the counts below; off by default
        for host in ("127.0.0.1", "localhost", "%"):
            account = f"'{self.user}'@'{host}'"
            self.execute(f"CREATE USER IF NOT EXISTS {account}")
            self.execute(f"GRANT ALL ON `{self.database}`.* TO {account}")

    def execute(self, sql: str) -> None:
        cursor = self.admin.cursor()
        cursor.execute(sql)
        cursor.close()

    def one(self, sql: str, *params):
        cursor = self.admin.cursor()
        cursor.execute(sql, params)
        row = cursor.fetchone()
        cursor.close()
        return row

    def now(self) -> datetime.datetime:
        return self.one("SELECT UTC_TIMESTAMP(6)")[0]

    def quiet(self) -> None:
        """Wait until no connection of the scheduler's user is left (a command is counted
        when it ends; a connection that ended has ended them all)."""
        wait_for(
            lambda: (
                not self.one(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = %s",
                    self.user,
                )[0]
            ),
            f"the connections of {self.user} to end",
        )

    def read(self) -> Counts:
        row = self.one(
            "SELECT TOTAL_CONNECTIONS, SELECT_COMMANDS + UPDATE_COMMANDS + OTHER_COMMANDS "
            "FROM information_schema.USER_STATISTICS WHERE USER = %s",
            self.user,
        )
        return Counts(0, 0) if row is None else Counts(int(row[1]), int(row[0]))

    def first_connection(self) -> datetime.datetime | None:
        """The server's clock once the scheduler has connected (None: not connected yet)."""
        connected = self.one(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = %s", self.user
        )[0]
        return self.now() if connected else None

    def close(self) -> None:
        self.admin.close()


COUNTERS = {"postgresql": PostgresCounter, "mysql": MariaDBCounter}


@pytest.fixture
def counter(using):
    made = COUNTERS[using](using)
    try:
        yield made
    finally:
        made.close()


def idle_cost(schedulers, counter, size: int) -> tuple[Counts, float]:
    """(what a scheduler with ``size`` idle entries made, in statements and new connections,
    over the window; the window's length in seconds of the server's clock)."""
    counter.quiet()
    before = counter.read()
    env = {"ADVISORY_LOCK_TEST_HEARTBEAT": str(DEFAULTS["SCHEDULER_HEARTBEAT"])}
    if counter.user is not None:
        env["ADVISORY_LOCK_TEST_DB_USER"] = counter.user
    process = schedulers.start(idle_schedule(size), env=env)
    start = wait_for(counter.first_connection, "the scheduler's first connection")
    wait_for(lambda: counter.now() >= start + datetime.timedelta(seconds=WINDOW), "the window")
    end = counter.now()
    process.send_signal(signal.SIGTERM)
    status, out, err = schedulers.finish(process, timeout=HANG)
    assert status == 0, out + err
    assert "started" not in out, f"an idle entry ran:\n{out}"
    counter.quiet()
    after = counter.read()
    spent = Counts(after.statements - before.statements, after.connections - before.connections)
    return spent, (end - start).total_seconds()


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_an_idle_schedulers_statements_and_connections_do_not_grow_with_its_entries(
    using,
    ledger,
    heartbeats,  # noqa: F811 (the fixture)
    schedulers,
    counter,
):
    few, few_window = idle_cost(schedulers, counter, 5)
    many, many_window = idle_cost(schedulers, counter, 500)
    few_rate, many_rate = few.statements / few_window, many.statements / many_window
    report = f"5 entries: {few} in {few_window:.1f}s; 500 entries: {many} in {many_window:.1f}s"
    print(report)
    assert many.connections <= few.connections <= CONNECTIONS[using], report
    assert many_rate <= few_rate + NOISE, report
    assert many_rate <= STATEMENTS_A_SECOND[using], report


# Busy: a fleet of 1 against 3 schedulers, on the same due slots.

#: The budget of a due slot, fleet-wide, whatever the number of schedulers (docs/scheduler.md):
#: statements (the idle share included) and new connections.
STATEMENTS_A_SLOT = 15.0
CONNECTIONS_A_SLOT = 0.5
#: Entries due every BUSY_EVERY seconds, run by fleets whose schedulers have BUSY_WORKERS
#: workers each.
BUSY_ENTRIES = 12
BUSY_EVERY = 2
BUSY_WORKERS = 2
#: The two runs of each fleet: until this many slots have succeeded. What the longer run
#: costs more than the shorter, per slot more, is the fleet's cost of a slot: the start-up
#: of the schedulers and of their workers' connections, and their stop, cancel out.
SHORT, LONG = 2 * BUSY_ENTRIES, 6 * BUSY_ENTRIES
#: What 3 schedulers may cost a slot more than 1. Statements: the issue's allowance, one a
#: slot for each further scheduler to learn that the slot is taken (measured: about 0.5 to
#: 0.9 for the two, their claims, looks and heartbeats at each boundary; the code before
#: cost 9.9 more a slot for each). Connections: those a worker opens at its first run (its
#: ledger's, its lock's, Django's), once, if its first run came only in the longer run.
SLOT_NOISE = Counts(statements=2 * 1.0, connections=2 * BUSY_WORKERS * 3 / (LONG - SHORT))


def busy_schedule() -> dict:
    return {
        f"busy{n:02}": {"callable": f"{JOBS}.nothing", "every": BUSY_EVERY}
        for n in range(BUSY_ENTRIES)
    }


def busy_cost(schedulers, counter, ledger, fleet: int, slots: int) -> tuple[Counts, int]:
    """(what a fleet of ``fleet`` schedulers made, in statements and new connections, until
    ``slots`` slots had succeeded (said by the schedulers); the slots run)."""
    ledger.all().delete()
    counter.quiet()
    before = counter.read()
    env = {"ADVISORY_LOCK_TEST_HEARTBEAT": str(DEFAULTS["SCHEDULER_HEARTBEAT"])}
    if counter.user is not None:
        env["ADVISORY_LOCK_TEST_DB_USER"] = counter.user
    processes = [
        schedulers.start(busy_schedule(), "--workers", str(BUSY_WORKERS), env=env)
        for _ in range(fleet)
    ]

    def succeeded() -> bool:
        # The schedulers' own words, not the ledger: the test's reads must not be counted.
        outputs = (schedulers.folder / f"run_jobs.{p.number}.out" for p in processes)
        return sum(path.read_text().count("] succeeded.") for path in outputs) >= slots

    wait_for(succeeded, f"{slots} slots to succeed")
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        status, out, err = schedulers.finish(process, timeout=HANG)
        assert status == 0, out + err
        assert "skipped" not in out, out  # a slot is said once, by the scheduler that ran it
    counter.quiet()
    after = counter.read()
    run = ledger.values_list("job_name", "period").distinct().count()
    assert not ledger.exclude(status="succeeded").exists(), list(ledger.values())
    spent = Counts(after.statements - before.statements, after.connections - before.connections)
    return spent, run


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_due_slot_costs_the_fleet_the_same_whatever_the_number_of_schedulers(
    using,
    ledger,
    heartbeats,  # noqa: F811 (the fixture)
    schedulers,
    counter,
):
    per_slot = {}
    lines = []
    for fleet in (1, 3):
        short, short_slots = busy_cost(schedulers, counter, ledger, fleet, SHORT)
        long, long_slots = busy_cost(schedulers, counter, ledger, fleet, LONG)
        more = long_slots - short_slots
        per_slot[fleet] = Counts(
            (long.statements - short.statements) / more,
            (long.connections - short.connections) / more,
        )
        lines.append(
            f"{fleet} scheduler(s): {short} for {short_slots} slots, {long} for {long_slots}: "
            f"{per_slot[fleet]} a slot"
        )
    report = "\n".join(lines)
    print(report)
    one, three = per_slot[1], per_slot[3]
    assert three.statements <= one.statements + SLOT_NOISE.statements, report
    assert three.connections <= one.connections + SLOT_NOISE.connections, report
    for cost in (one, three):
        assert cost.statements <= STATEMENTS_A_SLOT, report
        assert cost.connections <= CONNECTIONS_A_SLOT, report
