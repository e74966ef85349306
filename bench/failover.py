"""Locks, fencing tokens and a fleet of ``run_jobs`` through many real failovers (issue 31,
item 4).

    .venv/bin/python bench/failover.py [--operations 20] [--beat 1] [--holders 2]
                                       [--fleet-route multihost|haproxy] [--seed 1]

The cluster is tests/patroni.py's (the failover tests' harness): etcd, two PostgreSQL 15
nodes run by Patroni in synchronous mode, HAProxy in front, started in a temporary folder on
free ports and removed at the end. ``--operations`` operations, a random mix (``--seed``) of
Patroni's scripted switchover (REST ``POST /switchover``) and a hard failover (SIGKILL of the
primary's postmaster), half of each, one after the other; each ends once the new primary
answers through both routes and the old one streams from it again.

For each operation:

- ``--holders`` lock holders per route (libpq's multi-host string, HAProxy), each a
  tests/failover_child.py process holding ``advisory_lock(key, heartbeat=--beat,
  fencing=True)`` on the primary; the operation starts once each holder's heartbeat has
  checked its lock there (the server's ``pg_stat_activity``), and a random part of a beat
  later (``--seed``), so that it falls anywhere in the heartbeats' cycle. Notice: from the
  operation's start (the kill, or the switchover request) to the holder's ``on_lost``
  (``time.monotonic()`` in both processes: one clock). The target is 2 x the heartbeat + the
  reconnect, the time until the new primary answers through the holder's route: a sample
  meets it when its notice is at most that.
- Then, per holder, a second process takes the same key on the new primary (``fencing=True``,
  ``wait=False``), and does the fenced write of docs/semantics.md on a table of the key's own;
  then the superseded holder does the same write. An overlapping fenced effect is a write of a
  superseded holder that changed a row: there must be none.
- A fleet of 3 ``manage.py run_jobs`` (``--fleet-route``) runs the whole time: ``tick`` every
  second (a 0.2 s job) and ``work`` every 3 s (a 2 s job, ``retries: 1``, which an operation
  cuts), both ``catch_up: "all"``. The next operation starts once the fleet has run the tick
  slot 3 s after the new primary was up. Counted from the ledger (``job_runs``) and the jobs'
  own records: slots with two successes, scheduler exits, and the tick slots due after each new
  primary was up (from its first whole second to 2 s before the next operation) that ran
  once; the work runs cut (``failed`` / ``abandoned``), and those retried (docs/scheduler.md:
  a slot is retried only while it is the entry's latest due one, and a cut 3 s slot seldom
  is once the new primary is up).

Prints a Markdown table (bench/README.md, "Through failover").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.patroni import ROUTES  # noqa: E402
from tests.patroni import Cluster  # noqa: E402
from tests.patroni import Operation  # noqa: E402
from tests.patroni import Schedulers  # noqa: E402
from tests.patroni import child_environment  # noqa: E402
from tests.patroni import migrate  # noqa: E402
from tests.patroni import missing  # noqa: E402
from tests.patroni import patroni_cluster  # noqa: E402
from tests.patroni import server_time  # noqa: E402
from tests.patroni import slot_of_second  # noqa: E402
from tests.patroni import wait_for  # noqa: E402
from tests.processes import Worker  # noqa: E402
from tests.schedule_jobs import runs  # noqa: E402

JOBS = "tests.schedule_jobs"
SCHEDULE = {
    "tick": {"callable": f"{JOBS}.tick", "every": 1, "catch_up": "all"},
    "work": {"callable": f"{JOBS}.nap", "every": 3, "retries": 1, "catch_up": "all"},
}
#: Tick slots the fleet must have run after a new primary before the next operation.
SETTLE = 3


def order(worker: Worker, do: str, **fields: Any) -> None:
    worker.send(json.dumps({"do": do, **fields}))


def row(label: str, value: object) -> None:
    print(f"| {label} | {value} |")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


class Holder:
    """One key of one route: the process that holds it with a heartbeat, and the one that
    takes it after the operation."""

    def __init__(self, cluster: Cluster, route: str, number: int) -> None:
        self.route = route
        self.key = f"bench:{route}:{number}"
        self.table = f"fenced_{route}_{number}"
        environment = child_environment(cluster, route)
        args = ["--using", route]
        self.holder = Worker(args, environment, module="tests.failover_child")
        self.taker = Worker(args, environment, module="tests.failover_child")
        cluster.sql(f"DROP TABLE IF EXISTS {self.table}")
        cluster.sql(
            f"CREATE TABLE {self.table} (id INTEGER PRIMARY KEY, value VARCHAR(40) NOT NULL, "
            f"fence BIGINT NOT NULL)"
        )
        cluster.sql(f"INSERT INTO {self.table} (id, value, fence) VALUES (1, '', 0)")

    def ready(self) -> None:
        self.holder.expect("ready")
        self.taker.expect("ready")

    def kill(self) -> None:
        self.holder.kill()
        self.taker.kill()


def heartbeats_checked(cluster: Cluster, pids: list[int]) -> bool:
    """Has the heartbeat of each holder process asked the primary whether its lock is held?
    (Its connection's application_name starts with the process's pid, its last statement
    reads pg_locks.)"""
    rows = cluster.sql(
        "SELECT application_name FROM pg_stat_activity WHERE query LIKE %s", ["%pg_locks%"]
    )
    names = [name for (name,) in rows]
    return all(any(name.startswith(f"pid={pid} ") for name in names) for pid in pids)


def one_operation(
    cluster: Cluster, kind: str, holders: list[Holder], beat: float, phase: float
) -> tuple[Operation, list[dict[str, Any]]]:
    primary = cluster.leader()
    tokens = {}
    for holder in holders:
        order(holder.holder, "hold", key=holder.key, beat=beat, fencing=True)
    for holder in holders:
        held = holder.holder.expect("holding")
        assert held["port"] == primary.port, (held, primary)
        tokens[holder.key] = held["token"]
    pids = [holder.holder.proc.pid for holder in holders]
    wait_for(lambda: heartbeats_checked(cluster, pids), "every holder's heartbeat checked")
    # Pacing, not ordering: the operation falls anywhere in the heartbeats' cycle, not always
    # just after a check.
    time.sleep(phase)
    operation = cluster.switchover() if kind == "switchover" else cluster.fail_over()
    new_port = cluster.node(operation.new).port
    samples = []
    for holder in holders:
        lost = holder.holder.expect("lost")
        samples.append(
            {
                "kind": kind,
                "route": holder.route,
                "notice": lost["at"] - operation.started,
                "reconnect": operation.primary_up[holder.route] - operation.started,
            }
        )
    for sample, holder in zip(samples, holders, strict=True):
        order(holder.taker, "hold", key=holder.key, fencing=True, wait=False)
        taken = holder.taker.expect("holding")
        sample["taken_on_new_primary"] = taken["port"] == new_port
        sample["larger_token"] = taken["token"] > tokens[holder.key]
        order(holder.taker, "write", table=holder.table, value="later holder")
        sample["later_wrote"] = holder.taker.expect("wrote")["rows"]
        order(holder.holder, "write", table=holder.table, value="superseded holder")
        wrote = holder.holder.expect("wrote")
        sample["superseded_wrote"] = wrote["rows"]
        sample["write_error"] = wrote["error"]
        order(holder.taker, "release")
        sample["taker_released"] = holder.taker.expect("released")["error"]
        order(holder.holder, "release")
        sample["holder_released"] = holder.holder.expect("released")["error"]
    return operation, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=int, default=20)
    parser.add_argument("--beat", type=float, default=1.0, help="the holders' heartbeat (s)")
    parser.add_argument("--holders", type=int, default=2, help="holders per route")
    parser.add_argument("--fleet-route", choices=ROUTES, default="multihost")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if (message := missing()) is not None:
        sys.exit(message)
    kinds = ["switchover", "failover"] * math.ceil(args.operations / 2)
    random.Random(args.seed).shuffle(kinds)
    kinds = kinds[: args.operations]
    revision = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"revision {revision}, Python {platform.python_version()}, {args}", flush=True)

    started = time.monotonic()
    with (
        patroni_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="advisory-lock-bench-failover-") as jobs,
    ):
        migrate(cluster)
        print(f"cluster up and migrated in {time.monotonic() - started:.1f}s", flush=True)
        holders = [
            Holder(cluster, route, number) for route in ROUTES for number in range(args.holders)
        ]
        fleet = Schedulers(cluster, Path(jobs))
        try:
            for holder in holders:
                holder.ready()
            for _ in range(3):
                fleet.start(args.fleet_route, SCHEDULE, "--stop-grace", "10")
            fleet.wait(
                lambda: any(run["job"] == "tick" for run in runs(Path(jobs))),
                "the fleet's first tick",
            )
            # HAProxy says each server's change of state on stderr: the moments it had both
            # servers up (the old primary still routable beside the new one) are counted from
            # the first operation on.
            haproxy_log = cluster.folder / "haproxy.log"
            before = len(haproxy_log.read_text(errors="replace").splitlines())
            report = run_operations(cluster, fleet, holders, kinds, args, Path(jobs))
            states = haproxy_log.read_text(errors="replace").splitlines()[before:]
            report["both_up"] = sum(" is UP" in line and " 2 active " in line for line in states)
        finally:
            for holder in holders:
                holder.kill()
            exits = fleet.exited()
            statuses = fleet.stop() if not exits else []
            fleet.kill_all()
    report["exits"] = len(exits)
    report["stop_statuses"] = statuses
    print_report(report, args, time.monotonic() - started)


def run_operations(
    cluster: Cluster,
    fleet: Schedulers,
    holders: list[Holder],
    kinds: list[str],
    args: argparse.Namespace,
    jobs: Path,
) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    operations: list[Operation] = []
    windows: list[tuple[int, int]] = []
    phases = random.Random(args.seed)
    back = 0.0
    for number, kind in enumerate(kinds, 1):
        before = server_time(cluster)
        if back:
            windows.append((math.ceil(back), math.floor(before) - 2))
        phase = phases.uniform(0, args.beat)
        operation, found = one_operation(cluster, kind, holders, args.beat, phase)
        back = server_time(cluster)
        operations.append(operation)
        samples.extend(found)
        notices = ", ".join(f"{sample['notice']:.2f}" for sample in found)
        print(
            f"{number:2d}. {kind:10s} {operation.old} -> {operation.new}: new primary up "
            f"{operation.primary_up['multihost'] - operation.started:.2f}s (multihost), "
            f"{operation.primary_up['haproxy'] - operation.started:.2f}s (haproxy), whole "
            f"again {operation.healthy - operation.started:.2f}s; notices {notices}s",
            flush=True,
        )
        settled = slot_of_second(math.ceil(back) + SETTLE)
        fleet.wait(
            lambda settled=settled: any(
                run["job"] == "tick" and run["slot"] >= settled for run in runs(jobs)
            ),
            f"the tick slot {settled}",
        )
    windows.append((math.ceil(back), math.ceil(back) + SETTLE - 1))
    ledger = cluster.sql("SELECT job_name, period, status, attempt FROM job_runs")
    return {
        "samples": samples,
        "operations": operations,
        "windows": windows,
        "ledger": ledger,
        "runs": runs(jobs),
    }


def print_report(report: dict[str, Any], args: argparse.Namespace, took: float) -> None:
    samples, ledger = report["samples"], report["ledger"]
    print()
    print("| operations | holder notices | p50 | p99 | max | met 2 x beat + reconnect |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    groups = [
        (f"{kind}s, {route}", kind, route)
        for kind in ("switchover", "failover")
        for route in ROUTES
    ]
    groups.append(("all", None, None))
    for label, kind, route in groups:
        chosen = [
            sample
            for sample in samples
            if kind in (None, sample["kind"]) and route in (None, sample["route"])
        ]
        if not chosen:
            continue
        notices = [sample["notice"] for sample in chosen]
        met = sum(sample["notice"] <= 2 * args.beat + sample["reconnect"] for sample in chosen)
        print(
            f"| {label} | {len(chosen)} | "
            f"{statistics.median(notices):.2f} s | {percentile(notices, 0.99):.2f} s | "
            f"{max(notices):.2f} s | {met} of {len(chosen)} |"
        )
    operations = report["operations"]
    print()
    for kind in ("switchover", "failover"):
        chosen = [operation for operation in operations if operation.kind == kind]
        if not chosen:
            continue
        for route in ROUTES:
            ups = [operation.primary_up[route] - operation.started for operation in chosen]
            print(
                f"{len(chosen)} {kind}s: new primary answering through {route} "
                f"p50 {statistics.median(ups):.2f} s, max {max(ups):.2f} s"
            )
        wholes = [operation.healthy - operation.started for operation in chosen]
        print(f"  whole again p50 {statistics.median(wholes):.2f} s, max {max(wholes):.2f} s")

    overlaps = sum(bool(sample["superseded_wrote"]) for sample in samples)
    errors = [sample["write_error"] for sample in samples if sample["write_error"]]
    print()
    print("| fencing | count |")
    print("| --- | ---: |")
    taken = sum(sample["taken_on_new_primary"] for sample in samples)
    row(
        "supersessions (a lock lost, its key taken on the new primary)",
        f"{taken} of {len(samples)}",
    )
    row("the later holder's token larger", sum(sample["larger_token"] for sample in samples))
    row(
        "the later holder's fenced write changed its row",
        sum(sample["later_wrote"] == 1 for sample in samples),
    )
    row("overlapping fenced effects (a superseded holder's write that changed a row)", overlaps)
    row("superseded holders' writes that failed", len(errors))
    row(
        "superseded blocks that ended with LockLost",
        sum("was lost during the block" in sample["holder_released"] for sample in samples),
    )
    if errors:
        print(f"write errors: {errors[:3]}")

    successes = Counter((job, slot) for job, slot, status, _ in ledger if status == "succeeded")
    bodies = Counter((run["job"], run["slot"]) for run in report["runs"])
    due = [
        slot_of_second(second)
        for first, last in report["windows"]
        for second in range(first, last + 1)
    ]
    once = [slot for slot in due if successes[("tick", slot)] == 1 and bodies[("tick", slot)] == 1]
    cut = [
        (slot, attempt)
        for job, slot, status, attempt in ledger
        if job == "work" and status in ("failed", "abandoned")
    ]
    retried = [
        slot
        for slot, attempt in cut
        if any(
            job == "work" and period == slot and status == "succeeded" and later > attempt
            for job, period, status, later in ledger
        )
    ]
    print()
    print(f"| fleet of 3 `run_jobs` ({args.fleet_route}) | count |")
    print("| --- | ---: |")
    row("slots with two successes", sum(count > 1 for count in successes.values()))
    row("slots whose body ran twice", sum(count > 1 for count in bodies.values()))
    row("scheduler exits", report["exits"])
    row("tick slots due after a new primary was up that ran once", f"{len(once)} of {len(due)}")
    row(
        "tick runs cut by an operation (failed or abandoned)",
        sum(1 for job, _, status, _ in ledger if job == "tick" and status != "succeeded"),
    )
    row("work runs cut by an operation, recorded failed or abandoned", len(cut))
    row("... retried, and the retry succeeded (only while the slot is the latest)", len(retried))
    row(
        "slots that succeeded (tick, work)",
        f"{sum(job == 'tick' for job, _ in successes)}, "
        f"{sum(job == 'work' for job, _ in successes)}",
    )
    print(
        f"\nHAProxy had both servers up {report['both_up']} times in "
        f"{len(report['operations'])} operations"
    )
    print(f"SIGTERM at the end: exit statuses {report['stop_statuses']}; took {took:.0f}s")
    missing_slots = sorted(set(due) - set(once))
    if missing_slots:
        print(f"slots not run once: {missing_slots[:20]}")


if __name__ == "__main__":
    main()
