"""Locks, fencing tokens and the scheduler through a real failover (issue 31, item 1).

The cluster is tests/patroni.py's: etcd, two PostgreSQL 15 nodes run by Patroni, HAProxy in
front; one for the module. The clients are processes of their own on tests/patroni_settings.py,
reaching the primary through libpq's multi-host string (``target_session_attrs=read-write``)
or through HAProxy. The operations are Patroni's scripted switchover and a hard failover
(SIGKILL of the primary's postmaster). Every wait is for an event: a child's line, a row,
Patroni's and the servers' own view of the cluster; the time bounds are guards against a hang
(tests/processes.py's, tests/patroni.py's ``GUARD``).

What is asserted is what docs/semantics.md promises across a failover: a heartbeat learns that
its lock is gone (its session died with the old primary, and the new primary has no such
session), while another process takes the lock on the new primary; a superseded holder's
fenced write changes nothing once the new holder wrote; and a fleet of ``run_jobs`` rides
out the switchover with one success per slot. The notice times are printed (``-s``); the
figures over many failovers are bench/failover.py's (bench/README.md, "Through failover").
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.helpers import report
from tests.patroni import ROUTES
from tests.patroni import Cluster
from tests.patroni import Operation
from tests.patroni import Schedulers
from tests.patroni import child_environment
from tests.patroni import migrate
from tests.patroni import patroni_cluster
from tests.patroni import require_patroni
from tests.patroni import server_time
from tests.patroni import slot_of_second
from tests.patroni import wait_for
from tests.processes import Worker
from tests.schedule_jobs import runs

pytestmark = [pytest.mark.patroni, pytest.mark.faults]

#: The holders' heartbeat, in seconds.
BEAT = 1.0
TABLE = "fenced_effects"
JOBS = "tests.schedule_jobs"
#: Slots (of one second) after the new primary is up that must each run once.
WINDOW = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_patroni()
    with patroni_cluster() as running:
        migrate(running)
        yield running


class Holders:
    """tests/failover_child.py processes on the cluster; none outlives its test."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.started: list[Worker] = []

    def start(self, route: str) -> Worker:
        worker = Worker(
            ["--using", route],
            child_environment(self.cluster, route),
            module="tests.failover_child",
        )
        self.started.append(worker)
        worker.expect("ready")
        return worker

    def kill_all(self) -> None:
        for worker in self.started:
            worker.kill()


@pytest.fixture
def holders(cluster: Cluster) -> Iterator[Holders]:
    started = Holders(cluster)
    try:
        yield started
    finally:
        started.kill_all()


def order(worker: Worker, do: str, **fields: Any) -> None:
    worker.send(json.dumps({"do": do, **fields}))


def heartbeat_checked(cluster: Cluster, holder: Worker) -> bool:
    """Has the holder's heartbeat asked the primary whether its lock is held? (The server's
    own view: the app names each of its connections ``pid=<the process's pid> ...``, and the
    heartbeat's last statement reads pg_locks.)"""
    rows = cluster.sql(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s "
        "AND query LIKE %s AND pid <> pg_backend_pid()",
        [f"pid={holder.proc.pid} %", "%pg_locks%"],
    )
    return int(rows[0][0]) >= 1


OPERATIONS: dict[str, Callable[[Cluster], Operation]] = {
    "switchover": Cluster.switchover,
    "failover": Cluster.fail_over,
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_heartbeat_holder_learns_of_its_loss_through_a_switchover_and_a_failover(
    cluster: Cluster, holders: Holders, route: str
) -> None:
    noticed = {}
    for kind, operate in OPERATIONS.items():
        key = f"import:{uuid.uuid4()}"
        primary = cluster.leader()
        holder = holders.start(route)
        order(holder, "hold", key=key, beat=BEAT)
        assert holder.expect("holding")["port"] == primary.port
        # The heartbeat watches the lock on the old primary, and finds it held.
        wait_for(
            lambda holder=holder: heartbeat_checked(cluster, holder),
            "the heartbeat's first check",
        )
        assert holder.poll() is None, "a loss reported while the lock was held"

        operation = operate(cluster)
        new_primary = cluster.node(operation.new)
        lost = holder.expect("lost")
        assert lost["flag"] is True and lost["key"] == key
        assert lost["at"] > operation.started
        noticed[kind] = lost["at"] - operation.started

        # While the holder's block still runs, another process takes the lock on the new
        # primary: the old one's lock went with its session.
        other = holders.start(route)
        order(other, "hold", key=key, wait=False)
        assert other.expect("holding")["port"] == new_primary.port
        order(holder, "check")
        checked = holder.expect("checked")["error"]
        assert "was lost during the block" in checked, checked
        order(holder, "release")
        ended = holder.expect("released")["error"]
        assert ended.startswith("LockLost: ") and "was lost during the block" in ended, ended
        order(other, "release")
        assert other.expect("released")["error"] == ""
        holder.finish()
        other.finish()
    report(
        f"{route}: the heartbeat ({BEAT:g}s) noticed the loss "
        + ", ".join(f"{seconds:.2f}s after the {kind}" for kind, seconds in noticed.items())
    )


def test_a_holder_superseded_through_a_failover_writes_nothing(
    cluster: Cluster, holders: Holders
) -> None:
    route = "multihost"
    cluster.sql(f"DROP TABLE IF EXISTS {TABLE}")
    cluster.sql(
        f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, value VARCHAR(40) NOT NULL, "
        f"fence BIGINT NOT NULL)"
    )
    cluster.sql(f"INSERT INTO {TABLE} (id, value, fence) VALUES (1, '', 0)")
    key = f"import:{uuid.uuid4()}"
    superseded = holders.start(route)
    order(superseded, "hold", key=key, beat=BEAT, fencing=True)
    old_token = superseded.expect("holding")["token"]
    assert old_token >= 1

    operation = cluster.fail_over()
    superseded.expect("lost")
    # The token was committed on the old primary before the holder said "holding", and
    # Patroni's synchronous mode had it on the replica promoted since: the new holder's is
    # larger.
    later = holders.start(route)
    order(later, "hold", key=key, fencing=True, wait=False)
    held = later.expect("holding")
    assert held["port"] == cluster.node(operation.new).port
    assert held["token"] > old_token
    order(later, "write", table=TABLE, value="later holder")
    assert later.expect("wrote") == {
        "event": "wrote",
        "rows": 1,
        "port": held["port"],
        "error": "",
    }

    # The superseded holder goes on and writes, on the new primary: nothing changes.
    order(superseded, "write", table=TABLE, value="superseded holder")
    wrote = superseded.expect("wrote")
    assert (wrote["rows"], wrote["port"], wrote["error"]) == (0, held["port"], "")
    assert cluster.sql(f"SELECT value, fence FROM {TABLE} WHERE id = 1") == [
        ("later holder", held["token"])
    ]
    order(later, "release")
    assert later.expect("released")["error"] == ""
    order(superseded, "release")
    assert "was lost during the block" in superseded.expect("released")["error"]


@pytest.fixture
def fleet(cluster: Cluster, tmp_path: Path) -> Iterator[Schedulers]:
    started = Schedulers(cluster, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()
        cluster.sql("DELETE FROM job_runs")


def ledger(cluster: Cluster, job: str) -> list[tuple[str, str, int, int, str]]:
    """(slot, status, attempt, pid, error) of each of ``job``'s runs."""
    return cluster.sql(
        "SELECT period, status, attempt, pid, error FROM job_runs WHERE job_name = %s "
        "ORDER BY period, attempt",
        [job],
    )


def test_three_schedulers_ride_out_a_switchover_and_run_each_slot_due_after_it_once(
    cluster: Cluster, fleet: Schedulers, tmp_path: Path
) -> None:
    # "tick" catches up every slot it missed, so every slot after the switchover must run,
    # once. "slow" is in the middle of its run at the switchover: its lock goes with the old
    # primary, its job process is stopped (the lost-lock rules), and its slot runs again.
    now = server_time(cluster)
    every = 3600
    while now % every > every - 150:  # its slot stays the latest due one for the test
        every += 1
    schedule = {
        "tick": {"callable": f"{JOBS}.tick", "every": 1, "catch_up": "all"},
        "slow": {"callable": f"{JOBS}.slow_the_first_time", "every": every, "retries": 1},
    }
    for _ in range(3):
        fleet.start("haproxy", schedule, "--stop-grace", "10")

    def at_work() -> bool:
        return (
            all(" started (pid " in fleet.out(number) for number in range(3))
            and (tmp_path / "slow.pid").exists()
            and any(row[1] == "succeeded" for row in ledger(cluster, "tick"))
        )

    fleet.wait(at_work, "the fleet at work: each scheduler started a job, the slow one runs")
    slow_job = int((tmp_path / "slow.pid").read_text().split()[0])

    operation = cluster.switchover()
    back = server_time(cluster)
    first = math.ceil(back)
    last = first + WINDOW

    def caught_up() -> bool:
        slots = {row[0] for row in ledger(cluster, "tick") if row[1] == "succeeded"}
        slow = [row[1] for row in ledger(cluster, "slow")]
        return slot_of_second(last) in slots and "succeeded" in slow

    fleet.wait(caught_up, f"the {WINDOW} slots after the switchover, and the slow slot's retry")
    assert fleet.exited() == []
    running = cluster.sql("SELECT job_name, period FROM job_runs WHERE status = 'running'")
    statuses = fleet.stop()
    assert statuses == [0, 0, 0], [fleet.err(number) for number in range(3)]

    ticks = ledger(cluster, "tick")
    succeeded = Counter(slot for slot, status, *_ in ticks if status == "succeeded")
    assert [slot for slot, count in succeeded.items() if count > 1] == []
    expected = {slot_of_second(second) for second in range(first, last + 1)}
    assert sorted(expected - set(succeeded)) == [], (
        f"{[row for row in ticks if row[0] in expected]}\n"
        f"{[fleet.own_log(number) for number in range(3)]}\n{cluster.logs()}"
    )
    ran = Counter(run["slot"] for run in runs(tmp_path) if run["job"] == "tick")
    assert [slot for slot in expected if ran[slot] != 1] == []
    assert [slot for slot, count in ran.items() if count > 1] == []  # no body ran twice
    # The slow slot: attempt 1 died with its lock, and the ledger says so; attempt 2 ran.
    slow = ledger(cluster, "slow")
    assert [(attempt, pid == slow_job) for _, _, attempt, pid, _ in slow] == [
        (1, True),
        (2, False),
    ]
    assert slow[0][1] in ("failed", "abandoned"), slow[0]
    assert slow[1][1] == "succeeded"
    # Nothing was left running by the switchover: the runs it cut were recorded (a tick of a
    # slot after the window may be running when the window's last slot is done).
    left = [row for row in running if row[0] == "slow" or row[1] <= slot_of_second(last)]
    assert left == []
    cut = [(slot, status) for slot, status, *_ in ticks if status in ("failed", "abandoned")]
    warned = [sum(level == "WARNING" for level, _ in fleet.own_log(number)) for number in range(3)]
    errors = [line for number in range(3) for line in fleet.own_log(number) if line[0] == "ERROR"]
    # The slot_failed alerts (ERROR, advisory_lock.alerts) of the runs the switchover cut, each
    # once fleet-wide; nothing else at ERROR.
    alerts = [message for _, message in errors if " failed (attempt " in message]
    assert len(alerts) == len(set(alerts)), alerts
    assert [line for line in errors if " failed (attempt " not in line[1]] == [], errors
    report(
        f"fleet of 3 through HAProxy, {operation.kind} {operation.old} -> {operation.new}: "
        f"new primary up {operation.primary_up['haproxy'] - operation.started:.2f}s after "
        f"the request; {len(expected)} slots after it each ran once, {sum(succeeded.values())} "
        f"tick slots succeeded in all, {len(cut)} cut ({cut}); slow: attempt 1 "
        f"{slow[0][1]}, attempt 2 succeeded; scheduler warnings {warned}"
    )
