"""The randomized fault run: instances of three ledger jobs under chaos, then the invariants.

Used by tests/test_fault_run.py (seconds long, on the pytest run's test databases) and by
bench/fault_run.py (minutes long, with server restarts). Three parts:

* **The instance**, ``python -m tests.fault_run_worker --using ALIAS --dir DIR --seed N``, a
  real process that loops over three jobs run with ``run_once(..., heartbeat=...)``:
  ``fault-run-once`` (period ``"once"``), ``fault-run-daily`` (a callable period whose slot
  changes every ``--slot-seconds``) and ``fault-run-atomic`` (the same slots, ``atomic=True``).
  A run of the first two fails on purpose with some probability, before its critical
  section, so that its slot is retried. The atomic job's critical section writes an effect
  row (job, slot, run, pid) in the table ``fault_run_effects`` on the ledger's database, in
  the run's transaction, works a little, and fails on purpose with some probability after
  that write (which must then roll back); from the end of its body until its run's commit
  or rollback is over, ``DIR/ending/<pid>`` exists. Each critical section owns an O_EXCL
  marker per job (``DIR/markers/<job>``, made with ``link()`` so that it always holds its
  owner's pid, process start time and run; the atomic job's also holds the server's id of
  the connection it writes on): finding a live owner's marker there is an overlap, a dead
  owner's (SIGKILLed inside its body) is set aside. Every instance appends JSON lines with
  ``time.monotonic()`` stamps (one clock for every process on Linux) to
  ``DIR/log-<pid>.jsonl``: try, skipped, claimed, enter, effect, overlap, leave, and the
  run's end (succeeded, failed, lost with where the ``LockLost`` was raised, or error).
  Settings: ``DJANGO_SETTINGS_MODULE``, or a JSON dict for ``settings.configure()`` in
  ``FAULT_RUN_SETTINGS`` (the bench's databases).
* **``FaultRun``**: makes the effects' table (``CREATE TABLE IF NOT EXISTS``: no migration)
  and starts the instances, then for a bounded time its chaos thread, at seeded random
  intervals, SIGKILLs a random instance (40 % of the time one inside a body, 25 % one between
  its atomic body and the end of its commit) and starts a new one, terminates from the server
  side a random job lock's connection (PostgreSQL ``pg_terminate_backend``, MySQL/MariaDB
  ``KILL``; holders found with ``held_locks()``) or, a quarter of the time, the connection of
  an atomic body (its transaction's), and, with ``restart=``, restarts the server. Then it
  SIGKILLs every instance.
* **``FaultRun.check()``**: with every instance gone, the invariants (``Report.violations``)
  and the counts (``Report``). Invariants: no job lock held (each taken from this process
  with ``wait=False``); after ``job_runs --mark-abandoned``, no row running; at most one
  succeeded row per slot, and no attempt after it; a run that succeeded in its instance
  succeeded in the ledger; two critical sections of one job overlap only after a lock of
  the job was lost (a terminated connection, a restart), within ``heartbeat`` + 1 s of it,
  and one of the two runs raised ``LockLost`` (a database error, in a restart) or was
  killed; no exception but ``LockLost`` and database errors out of ``run_once``; no instance,
  and no thread of one, that died by itself. The overlaps come from the logs (every pair of
  intervals); each overlap the markers saw must be among them. For the atomic job
  (``check_effects``): in each slot as many committed effect rows as succeeded rows (one if
  the slot succeeded, none otherwise), each one the effect of the slot's succeeded run: no
  effect of a failed, abandoned (killed) or taken-over attempt survives.

The seed decides every choice the chaos and the instances make; the timing of processes does
not repeat, so a seed does not replay a run exactly.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ONCE = "fault-run-once"
DAILY = "fault-run-daily"
ATOMIC = "fault-run-atomic"
JOBS = (ONCE, DAILY, ATOMIC)
#: ``run_once`` holds the lock ``job:<job name>``.
LOCK_NAMES = {f"job:{job}": job for job in JOBS}
#: How much later than ``heartbeat`` a lost lock is noticed at the latest (docs/jobs.md: "A
#: lost lock is noticed within heartbeat + 1 s").
NOTICE_MARGIN = 1.0
#: How long the locks may stay held after every instance was SIGKILLed (documented: within a
#: second; tested 0.2-0.3 s).
FREE_TIMEOUT = 3.0
#: The atomic job's effects: one row per execution of its body, written on the ledger's
#: database (in the run's transaction), made by the harness (no migration).
EFFECTS = "fault_run_effects"
EFFECTS_DDL = (
    f"CREATE TABLE IF NOT EXISTS {EFFECTS} (job VARCHAR(100) NOT NULL, slot VARCHAR(64) NOT "
    f"NULL, run VARCHAR(40) NOT NULL, pid INTEGER NOT NULL)"
)


# The instance.


class BodyFailed(Exception):
    """The job failed on purpose, before its critical section, so that its slot is retried."""


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is gone or a
    zombie: with the pid it names one process, even when the pid is used again."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


class Instance:
    """One process running the three jobs in a loop until it is killed."""

    def __init__(self, args: argparse.Namespace) -> None:
        from advisory_lock.dedicated import direct_alias

        self.using = args.using
        self.rng = random.Random(args.seed)
        self.markers = Path(args.dir) / "markers"
        self.heartbeat = args.heartbeat
        self.slot_seconds = args.slot_seconds
        self.unlocked = args.unlocked
        self.failure = {ONCE: args.fail_once, DAILY: args.fail_daily, ATOMIC: args.fail_atomic}
        self.atomic = not args.not_atomic
        #: The atomic run's transaction is on this thread's connection to the ledger's
        #: database (DIRECT_ALIAS, if one is set): the effect is written there.
        self.effects_alias = direct_alias(self.using)
        self.pid = os.getpid()
        #: Present from the end of the atomic body until its run's end (commit or rollback)
        #: is over: the chaos kills there too.
        self.ending = Path(args.dir) / "ending" / str(self.pid)
        self.me = {"pid": self.pid, "start": process_start(self.pid)}
        path = Path(args.dir) / f"log-{self.pid}.jsonl"
        self.log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        #: The critical section in progress: job, run, when, the marker's content.
        self.inside: dict[str, Any] | None = None
        #: Where the current run is: claiming, claimed, body, ending.
        self.phase = "idle"
        self.serial = 0

    def record(self, event: str, **fields: Any) -> None:
        # One O_APPEND write per line: lines of different processes never interleave.
        line = json.dumps({"t": time.monotonic(), "pid": self.pid, "event": event, **fields})
        os.write(self.log, line.encode() + b"\n")

    def daily_slot(self, now: Any) -> str:
        return f"s{int(now.timestamp() / self.slot_seconds)}"

    def loop(self) -> None:
        from advisory_lock import run_once

        guards = {
            ONCE: run_once(ONCE, period="once", using=self.using, heartbeat=self.heartbeat),
            DAILY: run_once(
                DAILY, period=self.daily_slot, using=self.using, heartbeat=self.heartbeat
            ),
            ATOMIC: run_once(
                ATOMIC,
                period=self.daily_slot,
                using=self.using,
                heartbeat=self.heartbeat,
                atomic=self.atomic,
            ),
        }
        self.record("started", **self.me)
        while True:
            for job, guard in guards.items():
                if self.unlocked:
                    self.unguarded(job)
                else:
                    self.attempt(job, guard)
                time.sleep(self.rng.uniform(0.01, 0.05))

    def attempt(self, job: str, guard: Any) -> None:
        """One ``with run_once(...)``, its outcome recorded."""
        from django.db import DatabaseError
        from django.db import connections

        from advisory_lock import LockLost

        run_id = None
        self.phase = "claiming"
        self.record("try", job=job)
        try:
            with guard as run:
                if run is None:
                    self.record("skipped", job=job)
                    return
                run_id = run.fence
                self.phase = "claimed"
                self.record("claimed", job=job, run=run_id, slot=run.period, attempt=run.attempt)
                self.body(job, run_id, run)
                self.phase = "ending"
                if job == ATOMIC:
                    # Until the commit (or the rollback) is over: the chaos kills there too.
                    os.close(os.open(self.ending, os.O_WRONLY | os.O_CREAT, 0o644))
        except LockLost as lost:
            where = self.phase
            self.leave()
            self.record("end", job=job, run=run_id, outcome="lost", where=where, error=str(lost))
        except BodyFailed:
            self.record("end", job=job, run=run_id, outcome="failed")
        except Exception as error:  # a database error during a server restart, or a bug
            where = self.phase
            self.leave()
            self.record(
                "end",
                job=job,
                run=run_id,
                outcome="error",
                where=where,
                error=f"{type(error).__name__}: {error}",
                database=isinstance(error, DatabaseError),
                traceback=traceback.format_exc()[-3000:],
            )
            connections.close_all()
            time.sleep(0.2)
        else:
            if run_id is not None:
                self.record("end", job=job, run=run_id, outcome="succeeded")
        finally:
            self.phase = "idle"
            if job == ATOMIC:
                with contextlib.suppress(FileNotFoundError):
                    self.ending.unlink()

    def unguarded(self, job: str) -> None:
        """The same body without lock or ledger: to check that the detector sees overlaps."""
        self.serial += 1
        run_id = f"u{self.pid}.{self.serial}"
        self.record("try", job=job)
        self.record("claimed", job=job, run=run_id, slot="-", attempt=0)
        try:
            self.body(job, run_id, None)
        except BodyFailed:
            self.record("end", job=job, run=run_id, outcome="failed")
        else:
            self.record("end", job=job, run=run_id, outcome="succeeded")

    def body(self, job: str, run_id: Any, run: Any) -> None:
        """Prepare (and maybe fail), then 20-200 ms of work inside the critical section."""
        if job == ATOMIC:
            self.atomic_body(run_id, run)
            return
        time.sleep(self.rng.uniform(0, 0.02))
        if self.rng.random() < self.failure[job]:
            raise BodyFailed(f"{job}: run {run_id} failed on purpose")
        self.phase = "body"
        self.enter(job, run_id)
        time.sleep(self.rng.uniform(0.01, 0.1))
        if run is not None and self.rng.random() < 0.5:
            run.assert_current(self.using)  # LockLost if the run was taken over
        time.sleep(self.rng.uniform(0.01, 0.1))
        self.leave()

    def atomic_body(self, run_id: Any, run: Any) -> None:
        """The atomic job: inside its critical section, write the effect row (in the run's
        transaction; in autocommit without ``atomic``, or unguarded), 10-100 ms of work, then
        maybe leave it and fail (after the write, which must then roll back), else 10-50 ms
        more.

        The marker names the connection the effect is written on (its server-side id), so
        that the chaos can terminate it."""
        from django.db import connections
        from django.utils import timezone

        connection = connections[self.effects_alias]
        time.sleep(self.rng.uniform(0, 0.02))
        self.phase = "body"
        connection.ensure_connection()
        self.enter(ATOMIC, run_id, connection=connection_id(connection))
        slot = self.daily_slot(timezone.now()) if run is None else run.period
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {EFFECTS} (job, slot, run, pid) VALUES (%s, %s, %s, %s)",
                [ATOMIC, slot, str(run_id), self.pid],
            )
        self.record("effect", job=ATOMIC, run=run_id, slot=slot)
        time.sleep(self.rng.uniform(0.01, 0.1))
        if run is not None and self.rng.random() < 0.5:
            run.assert_current(self.using)  # LockLost if the run was taken over
        if self.rng.random() < self.failure[ATOMIC]:
            # Out of the critical section first: the run's end (the rollback, the failed
            # mark, the lock's release) comes after, and the next run may then start.
            self.leave()
            raise BodyFailed(f"{ATOMIC}: run {run_id} failed on purpose, after its write")
        time.sleep(self.rng.uniform(0.01, 0.05))
        self.leave()

    def enter(self, job: str, run_id: Any, **extra: Any) -> None:
        """Own the job's marker; an owner found alive there is recorded as an overlap."""
        content = json.dumps({**self.me, "run": run_id, **extra}).encode()
        self.inside = {"job": job, "run": run_id, "at": time.monotonic(), "content": content}
        marker = self.markers / job
        # link() makes the marker with its content in one step, and fails if it exists.
        spare = self.markers / f".{self.pid}.{run_id}"
        spare.write_bytes(content)
        owned, other = False, None
        try:
            while True:
                try:
                    os.link(spare, marker)
                except FileExistsError:
                    pass
                else:
                    owned = True
                    break
                try:
                    found = marker.read_bytes()
                except FileNotFoundError:
                    continue
                owner = json.loads(found)
                if process_start(owner["pid"]) == owner["start"]:
                    other = owner  # a live instance is inside its critical section
                    break
                # Its owner was killed inside: set the marker aside, unless it was replaced
                # between the read and the rename (then put the live one back).
                aside = self.markers / f".stale.{self.pid}"
                try:
                    os.rename(marker, aside)
                except FileNotFoundError:
                    continue
                moved = aside.read_bytes()
                if moved != found:
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, marker)
                    other = json.loads(moved)
                aside.unlink()
                if other is not None:
                    break
                self.record("stale_marker", job=job, owner=owner["pid"], owner_run=owner["run"])
        finally:
            spare.unlink()
        self.record("enter", job=job, run=run_id, at=self.inside["at"], owned=owned)
        if other is not None:
            self.record(
                "overlap", job=job, run=run_id, other_pid=other["pid"], other_run=other["run"]
            )

    def leave(self) -> None:
        """Give the marker back (if it is still ours) and record the end of the section.
        Also called after an interruption, which may come at any point of enter()."""
        inside = self.inside
        if inside is None:
            return
        marker = self.markers / inside["job"]
        with contextlib.suppress(FileNotFoundError):
            if marker.read_bytes() == inside["content"]:
                marker.unlink()
        self.record("leave", job=inside["job"], run=inside["run"], at=inside["at"])
        self.inside = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_run_worker")
    parser.add_argument("--using", required=True, help="the database alias")
    parser.add_argument("--dir", required=True, help="the run's folder (logs, markers)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--slot-seconds", type=float, default=0.5)
    parser.add_argument("--fail-once", type=float, default=0.5)
    parser.add_argument("--fail-daily", type=float, default=0.3)
    parser.add_argument("--fail-atomic", type=float, default=0.3)
    parser.add_argument("--unlocked", action="store_true", help="no lock, no ledger")
    parser.add_argument(
        "--not-atomic",
        action="store_true",
        help="the atomic job without atomic=True: its effect commits at once",
    )
    args = parser.parse_args(argv)
    import django

    if os.environ.get("FAULT_RUN_SETTINGS"):
        from django.conf import settings

        settings.configure(**json.loads(os.environ["FAULT_RUN_SETTINGS"]))
    django.setup()
    Instance(args).loop()


def connection_id(connection: Any) -> int | None:
    """The server's id of a Django connection (PostgreSQL: its backend's pid; MySQL: its
    thread id), which ``pg_terminate_backend`` and ``KILL`` take; None on SQLite."""
    raw = connection.connection
    if connection.vendor == "postgresql":
        info = getattr(raw, "info", None)  # psycopg 3, else psycopg2
        return int(info.backend_pid if info is not None else raw.get_backend_pid())
    if connection.vendor == "mysql":
        return int(raw.thread_id())
    return None


# The harness.


@dataclasses.dataclass
class Overlap:
    """Two runs of one job inside their critical sections at once."""

    job: str
    first: str  # the run inside first, described
    second: str
    seconds: float
    ending: str  # "lost", "killed", "error" (a side ended so), or "none"
    #: Seconds from the last lost lock (a terminated connection or a restart) before the
    #: second run entered, to the end of the overlap; None: no lock was lost before it.
    after_loss: float | None


@dataclasses.dataclass
class Report:
    """What a fault run did, and the invariants it broke (``violations``)."""

    backend: str
    seed: int
    seconds: float
    instances: int
    started: int = 0
    kills: int = 0
    kills_inside: int = 0
    #: Kills of an instance between its atomic body and the end of its commit (or rollback).
    kills_ending: int = 0
    terminations: int = 0
    #: Connections of atomic bodies (their transaction's) terminated by the server.
    body_terminations: int = 0
    restarts: int = 0
    tries: int = 0
    claim_errors: int = 0
    runs: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lost_where: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    rows: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    marked_at_end: int = 0
    once_attempts: int = 0
    once_succeeded: int = 0
    daily_slots: int = 0
    daily_slots_succeeded: int = 0
    atomic_slots: int = 0
    atomic_slots_succeeded: int = 0
    #: The atomic job's effect rows: written by a body (its instance logged it), committed.
    effects_written: int = 0
    effect_rows: int = 0
    #: Where the atomic runs that were SIGKILLed were (from their logs and rows).
    atomic_killed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #: Database errors out of run_once, by job and message (their first line).
    database_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    max_succeeded_per_slot: int = 0
    overlaps: list[Overlap] = dataclasses.field(default_factory=list)
    marker_overlaps: int = 0
    stale_markers: int = 0
    locks_free_after: float | None = None
    violations: list[str] = dataclasses.field(default_factory=list)

    HEADER = (
        "| backend | seed | chaos (s) | instances (started) | runs | rows succeeded / failed / "
        "abandoned | kills (in body / at atomic end) | terminations: locks / atomic bodies "
        "| restarts | LockLost (in body / at end) | errors (claiming) | overlaps: LockLost / "
        "killed / error / unnoticed | longest overlap | `once` attempts | daily slots "
        "(succeeded) | atomic slots (succeeded) | effect rows written / committed | most "
        "successes in a slot | violations |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )

    def row(self) -> str:
        endings = collections.Counter(overlap.ending for overlap in self.overlaps)
        longest = max((overlap.seconds for overlap in self.overlaps), default=0.0)
        lost = self.outcomes["lost"]
        in_body = self.lost_where["body"] + self.lost_where["claimed"]
        rows = self.rows
        return (
            f"| {self.backend} | {self.seed} | {self.seconds:g} | {self.instances} "
            f"({self.started}) | {self.runs} | {rows['succeeded']} / {rows['failed']} / "
            f"{rows['abandoned']} | {self.kills} ({self.kills_inside} / {self.kills_ending}) "
            f"| {self.terminations} / {self.body_terminations} "
            f"| {self.restarts} | {lost} ({in_body} / {lost - in_body}) "
            f"| {self.outcomes['error']} ({self.claim_errors}) | {endings['lost']} / "
            f"{endings['killed']} / {endings['error']} / {endings['none']} "
            f"| {longest * 1000:.0f} ms "
            f"| {self.once_attempts} | {self.daily_slots} ({self.daily_slots_succeeded}) "
            f"| {self.atomic_slots} ({self.atomic_slots_succeeded}) "
            f"| {self.effects_written} / {self.effect_rows} "
            f"| {self.max_succeeded_per_slot} | {len(self.violations)} |"
        )

    def details(self) -> str:
        free = "-" if self.locks_free_after is None else f"{self.locks_free_after:.2f}s"
        return (
            f"{self.tries} tries; runs ended {dict(self.outcomes)}; LockLost raised in "
            f"{dict(self.lost_where)}; overlaps seen by the marker {self.marker_overlaps}, "
            f"stale markers set aside {self.stale_markers}; rows marked abandoned at the end "
            f"{self.marked_at_end}; locks free {free} after the last kill; atomic runs killed "
            f"{dict(self.atomic_killed)}; database errors {dict(self.database_errors)}"
        )

    def summary(self) -> str:
        lines = [self.HEADER, self.row(), self.details()]
        lines += [f"VIOLATION: {violation}" for violation in self.violations]
        return "\n".join(lines)


class FaultRun:
    """Instances of the three jobs on ``using`` under chaos for ``seconds``; then ``check()``.

    ``env``: the instances' environment (their settings). The chaos acts every ``pause``
    seconds (a random range); ``kill_share`` of its actions are kills, the others terminate
    a lock's connection, or (a quarter of them) an atomic body's (not on SQLite; the first
    action is always a kill). ``restart``: a callable that restarts the server, called about
    every ``restart_every`` seconds. ``unlocked``: the instances run their bodies without
    lock or ledger (the checks must then see overlaps, and effects without a success).
    ``atomic=False``: the atomic job runs without ``atomic=True``, its effect committed at
    once (the checks must then see effects of failed and killed attempts).
    """

    def __init__(
        self,
        using: str,
        *,
        seed: int,
        directory: Path,
        env: dict[str, str],
        instances: int = 4,
        seconds: float = 3.0,
        settle: float = 30.0,
        heartbeat: float = 0.2,
        slot_seconds: float = 0.5,
        fail_once: float = 0.5,
        fail_daily: float = 0.3,
        fail_atomic: float = 0.3,
        terminate: bool = True,
        restart: Callable[[], None] | None = None,
        restart_every: float = 30.0,
        unlocked: bool = False,
        atomic: bool = True,
        kill_share: float = 1 / 3,
        pause: tuple[float, float] = (0.05, 0.3),
    ) -> None:
        from django.db import connections

        self.using = using
        self.vendor = connections[using].vendor
        self.seed = seed
        self.directory = Path(directory)
        self.env = env
        self.instances = instances
        self.seconds = seconds
        self.settle = settle
        self.heartbeat = heartbeat
        self.options = [
            f"--heartbeat={heartbeat}",
            f"--slot-seconds={slot_seconds}",
            f"--fail-once={fail_once}",
            f"--fail-daily={fail_daily}",
            f"--fail-atomic={fail_atomic}",
            *(["--unlocked"] if unlocked else []),
            *([] if atomic else ["--not-atomic"]),
        ]
        # SQLite has no server: its locks can only be lost with their process.
        self.terminate = terminate and self.vendor != "sqlite"
        self.restart = restart
        self.restart_every = restart_every
        self.kill_share = kill_share
        self.pause = pause
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._chaos_failure: BaseException | None = None
        self.processes: dict[int, subprocess.Popen] = {}
        self.started = 0
        #: What the chaos did, with monotonic times: kill, final_kill, terminate,
        #: terminate_body (an atomic body's connection), restart, exited (an instance that
        #: stopped by itself), chaos_error.
        self.events: list[dict[str, Any]] = []

    # Instances.

    def start_instance(self) -> None:
        self.started += 1
        output = open(self.directory / f"output-{self.started}.txt", "wb")  # noqa: SIM115
        with output:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.fault_run_worker",
                    f"--using={self.using}",
                    f"--dir={self.directory}",
                    f"--seed={self.seed * 10_000 + self.started}",
                    *self.options,
                ],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        self.processes[process.pid] = process

    def kill(self, pid: int, event: str) -> None:
        """SIGKILL the instance ``pid`` and reap it (its marker, if any, is left behind)."""
        inside = {pid: job for job, pid in self._inside().items()}
        ending = self._ending()
        process = self.processes.pop(pid)
        if process.poll() is not None:
            rc = process.returncode
            self.events.append({"t": time.monotonic(), "event": "exited", "pid": pid, "rc": rc})
            return
        process.send_signal(signal.SIGKILL)
        process.wait()
        # Once reaped: its critical section surely ended by then (until then another
        # instance's marker check still finds it alive), so the logs' overlaps and the
        # markers' agree. The time of the signal would end its section too early.
        at = time.monotonic()
        with contextlib.suppress(FileNotFoundError):  # its pid may be used again
            (self.directory / "ending" / str(pid)).unlink()
        self.events.append(
            {
                "t": at,
                "event": event,
                "pid": pid,
                "inside": pid in inside,
                "job": inside.get(pid),
                "ending": pid in ending,
            }
        )

    def _markers(self) -> dict[str, dict[str, Any]]:
        """{job: marker} of the live instances in a job's critical section: the marker's
        content (pid, start, run; the atomic job's: connection too)."""
        markers = {}
        for job in JOBS:
            with contextlib.suppress(FileNotFoundError, ValueError):
                marker = json.loads((self.directory / "markers" / job).read_bytes())
                if marker["pid"] in self.processes:
                    markers[job] = marker
        return markers

    def _inside(self) -> dict[str, int]:
        """{job: pid} of the live instances in a job's critical section (from the markers)."""
        return {job: marker["pid"] for job, marker in self._markers().items()}

    def _ending(self) -> set[int]:
        """The live instances between their atomic body and the end of its run's commit."""
        return {
            int(path.name)
            for path in (self.directory / "ending").iterdir()
            if int(path.name) in self.processes
        }

    def _reap_exited(self) -> None:
        """An instance never stops by itself: record the ones that did, start others."""
        for pid, process in list(self.processes.items()):
            if process.poll() is not None:
                del self.processes[pid]
                rc = process.returncode
                self.events.append(
                    {"t": time.monotonic(), "event": "exited", "pid": pid, "rc": rc}
                )
                self.start_instance()

    # Chaos.

    def run(self) -> Report:
        """Start, shake, stop; then check."""
        (self.directory / "markers").mkdir(parents=True, exist_ok=True)
        (self.directory / "ending").mkdir(exist_ok=True)
        self._create_effects_table()
        self._delete_rows()
        chaos = threading.Thread(target=self._chaos, name="fault-run-chaos")
        try:
            for _ in range(self.instances):
                self.start_instance()
            self._wait_started()
            chaos.start()
            while chaos.is_alive():
                chaos.join(0.5)
            self._until_every_job_succeeded()
        finally:
            self._stop.set()  # on Ctrl-C: the chaos ends its action (a restart: completes it)
            if chaos.is_alive():
                chaos.join()
            for pid in list(self.processes):
                self.kill(pid, "final_kill")
            with open(self.directory / "chaos.jsonl", "w") as log:
                log.writelines(json.dumps(event) + "\n" for event in self.events)
        if self._chaos_failure is not None:
            raise self._chaos_failure
        return self.check()

    def _until_every_job_succeeded(self) -> None:
        """After the chaos, let the instances run on (no more chaos) until each job has a
        succeeded run, for at most ``settle`` seconds: on a loaded machine a few seconds of
        chaos may leave no time for one, and a run that proves nothing proves nothing."""
        from django.db import DatabaseError
        from django.db import connections

        from advisory_lock import JobRun

        deadline = time.monotonic() + self.settle
        while time.monotonic() < deadline:
            try:
                succeeded = set(
                    self._rows()
                    .filter(status=JobRun.Status.SUCCEEDED)
                    .values_list("job_name", flat=True)
                )
            except DatabaseError:
                # A restart by the chaos broke this connection: ask again on a new one.
                connections[self.using].close()
                time.sleep(0.2)
                continue
            if succeeded >= set(JOBS):
                return
            self._reap_exited()
            time.sleep(0.2)

    def _wait_started(self, timeout: float = 60) -> None:
        """Until every instance has said "started" (Django is set up in each)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            started = {event["pid"] for event in self._read_logs() if event["event"] == "started"}
            if set(self.processes) <= started:
                return
            self._reap_exited()
            time.sleep(0.05)
        raise AssertionError(f"instances not started within {timeout}s: {self._outputs()}")

    def _chaos(self) -> None:
        from django.db import DatabaseError
        from django.db import connections

        rng = self.rng
        start = time.monotonic()
        deadline = start + self.seconds
        next_restart = start + self.restart_every * rng.uniform(0.5, 1.0)
        try:
            while time.monotonic() < deadline:
                if self._stop.wait(rng.uniform(*self.pause)):
                    break
                self._reap_exited()
                try:
                    if self.restart is not None and time.monotonic() >= next_restart:
                        self.events.append({"t": time.monotonic(), "event": "restart"})
                        self.restart()
                        connections.close_all()
                        next_restart = (
                            time.monotonic() + rng.uniform(0.7, 1.3) * self.restart_every
                        )
                    elif not self._killed_one() or rng.random() < self.kill_share:
                        self._kill_an_instance(rng)  # the first action kills, then at random
                    elif not self.terminate:  # SQLite: kills only, at the same rate
                        pass
                    elif rng.random() < 0.25:
                        self._terminate_a_body(rng)
                    else:
                        self._terminate_a_lock(rng)
                except DatabaseError as error:  # our own connection, during a restart
                    self.events.append(
                        {"t": time.monotonic(), "event": "chaos_error", "error": str(error)}
                    )
                    connections.close_all()
        except BaseException as error:  # a failed restart: raised again by run()
            self._chaos_failure = error
        finally:
            connections.close_all()

    def _killed_one(self) -> bool:
        return any(event["event"] == "kill" for event in self.events)

    def _kill_an_instance(self, rng: random.Random) -> None:
        """SIGKILL an instance: 40 % of the time one inside a body (if any), 25 % one between
        its atomic body and the end of its commit (waiting at most 0.3 s for one), else any.
        """
        # Only instances that run (Django is set up): killing one that starts tests nothing.
        ready = {pid for pid in self.processes if (self.directory / f"log-{pid}.jsonl").exists()}
        inside = sorted(set(self._inside().values()) & ready)
        where = rng.random()
        ending: list[int] = []
        if where >= 0.4 and where < 0.65:
            deadline = time.monotonic() + 0.3
            while not ending and time.monotonic() < deadline and not self._stop.is_set():
                ending = sorted(self._ending() & ready)
                time.sleep(0 if ending else 0.002)
        if inside and where < 0.4:
            victim = rng.choice(inside)
        elif ending:
            victim = rng.choice(ending)
        elif ready:
            victim = rng.choice(sorted(ready))
        else:
            return
        self.kill(victim, "kill")
        self.start_instance()

    def _terminate_a_body(self, rng: random.Random) -> None:
        """Terminate the connection an atomic body writes on (its transaction's), server
        side, waiting at most 0.5 s for one."""
        from django.db import DatabaseError
        from django.db import connections

        deadline = time.monotonic() + 0.5
        marker = self._markers().get(ATOMIC)
        while marker is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.005)
            marker = self._markers().get(ATOMIC)
        if marker is None or marker.get("connection") is None:
            return
        at = time.monotonic()
        with connections[self.using].cursor() as cursor:
            try:
                if self.vendor == "postgresql":
                    cursor.execute("SELECT pg_terminate_backend(%s)", [marker["connection"]])
                else:
                    cursor.execute(f"KILL {int(marker['connection'])}")
            except DatabaseError:  # it ended meanwhile ("Unknown thread id")
                return
        self.events.append(
            {"t": at, "event": "terminate_body", "pid": marker["pid"], "run": marker["run"]}
        )

    def _terminate_a_lock(self, rng: random.Random) -> None:
        """Terminate the connection of a random holder of a job lock, server side."""
        from django.db import DatabaseError
        from django.db import connections

        from advisory_lock import held_locks

        # Most holders hold the lock for a moment, to find the slot done: most of the time,
        # wait (at most 0.5 s) for a run in its body, and terminate its lock.
        in_body = rng.random() < 0.8
        deadline = time.monotonic() + 0.5
        while in_body and not self._inside() and time.monotonic() < deadline:
            time.sleep(0.01)
        inside = self._inside()
        holders = sorted(
            (lock.name, lock.holder_id)
            for lock in held_locks(self.using)
            if lock.granted and lock.name in LOCK_NAMES and lock.holder_id is not None
        )
        busy = [(name, holder) for name, holder in holders if LOCK_NAMES[name] in inside]
        if in_body and busy:
            holders = busy
        if not holders:
            return
        name, holder = rng.choice(holders)
        at = time.monotonic()  # the lock may be gone from here on
        with connections[self.using].cursor() as cursor:
            try:
                if self.vendor == "postgresql":
                    cursor.execute("SELECT pg_terminate_backend(%s)", [holder])
                else:
                    cursor.execute(f"KILL {int(holder)}")
            except DatabaseError:  # it ended meanwhile ("Unknown thread id")
                return
        self.events.append({"t": at, "event": "terminate", "job": LOCK_NAMES[name]})

    # Checks.

    def _read_logs(self) -> list[dict[str, Any]]:
        events = []
        for path in sorted(self.directory.glob("log-*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                    events.append(json.loads(line))
        return events

    def _outputs(self, tail: int = 2000) -> str:
        texts = []
        for path in sorted(self.directory.glob("output-*.txt")):
            text = path.read_text(errors="replace")
            if text.strip():
                texts.append(f"--- {path.name} ---\n{text[-tail:]}")
        return "\n".join(texts)

    def _rows(self) -> Any:
        from advisory_lock import JobRun

        return JobRun.objects.using(self.using).filter(job_name__in=JOBS)

    def _create_effects_table(self) -> None:
        from django.db import connections

        with connections[self.using].cursor() as cursor:
            cursor.execute(EFFECTS_DDL)

    def _effects(self) -> list[tuple[str, str, str, int]]:
        """The atomic job's committed effect rows: (job, slot, run, pid)."""
        from django.db import connections

        with connections[self.using].cursor() as cursor:
            cursor.execute(f"SELECT job, slot, run, pid FROM {EFFECTS}")
            return [tuple(row) for row in cursor.fetchall()]

    def _delete_rows(self) -> None:
        from django.db import connections

        self._rows().delete()
        with connections[self.using].cursor() as cursor:
            cursor.execute(f"DELETE FROM {EFFECTS}")

    def clean_up(self) -> None:
        """Delete the run's rows and drop the effects' table."""
        from django.db import connections

        self._rows().delete()
        with connections[self.using].cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {EFFECTS}")

    def _wait_locks_free(self) -> tuple[float | None, list[str]]:
        """Seconds until every job lock could be taken (tried from this process)."""
        from advisory_lock import advisory_lock

        started = time.monotonic()
        held = list(LOCK_NAMES)
        while True:
            still = []
            for name in held:
                with advisory_lock(name, using=self.using, wait=False) as handle:
                    if not handle.acquired:
                        still.append(name)
            held = still
            if not held:
                return time.monotonic() - started, []
            if time.monotonic() - started > FREE_TIMEOUT:
                return None, held
            time.sleep(0.05)

    def check(self) -> Report:
        """The invariants, with every instance gone (see the module's docstring); and the
        counts."""
        from django.core.management import call_command
        from django.db import connections
        from django.db.models import Count

        connections[self.using].close()  # it may have been broken by a restart
        report = Report(self.vendor, self.seed, self.seconds, self.instances, self.started)
        violations = report.violations
        kinds = collections.Counter(event["event"] for event in self.events)
        report.kills, report.terminations = kinds["kill"], kinds["terminate"]
        report.restarts = kinds["restart"]
        report.kills_inside = sum(
            1 for event in self.events if event["event"] == "kill" and event["inside"]
        )
        report.kills_ending = sum(
            1 for event in self.events if event["event"] == "kill" and event["ending"]
        )
        report.body_terminations = kinds["terminate_body"]
        for event in self.events:
            if event["event"] == "exited":
                violations.append(f"instance {event['pid']} exited by itself ({event['rc']})")
        if kinds["exited"]:
            violations.append(f"instances' output:\n{self._outputs()}")
        # A thread of an instance died (the watchdog?): Python printed its traceback.
        for path in sorted(self.directory.glob("output-*.txt")):
            text = path.read_text(errors="replace")
            if "Exception in thread" in text:
                start = text.index("Exception in thread")
                violations.append(f"{path.name}: {text[start : start + 1500]}")

        # No lock is held once every instance is gone.
        report.locks_free_after, held = self._wait_locks_free()
        for name in held:
            violations.append(f"lock {name} still held {FREE_TIMEOUT:g}s after every kill")

        # After --mark-abandoned, no row is running.
        output = io.StringIO()
        call_command("job_runs", "--mark-abandoned", "--database", self.using, stdout=output)
        report.marked_at_end = int(output.getvalue().split()[1])  # "Marked N run(s) abandoned."
        rows = self._rows()
        report.rows.update(dict(rows.order_by().values_list("status").annotate(n=Count("id"))))
        for run in rows.filter(status="running"):
            violations.append(f"row {run.pk} ({run}) still running after --mark-abandoned")

        # At most one succeeded row per slot, and no attempt after it.
        statuses: dict[tuple[str, str], list[tuple[int, str]]] = collections.defaultdict(list)
        for job, slot, attempt, status in rows.values_list(
            "job_name", "period", "attempt", "status"
        ):
            statuses[job, slot].append((attempt, status))
        for (job, slot), attempts in sorted(statuses.items()):
            succeeded = [attempt for attempt, status in attempts if status == "succeeded"]
            report.max_succeeded_per_slot = max(report.max_succeeded_per_slot, len(succeeded))
            if len(succeeded) > 1:
                violations.append(f"{job} slot {slot}: {len(succeeded)} succeeded rows")
            later = [attempt for attempt, _ in attempts if succeeded and attempt > succeeded[0]]
            if later:
                violations.append(f"{job} slot {slot}: attempts {later} after the success")
            if job == ONCE:
                report.once_attempts, report.once_succeeded = len(attempts), len(succeeded)
            elif job == DAILY:
                report.daily_slots += 1
                report.daily_slots_succeeded += bool(succeeded)

        # The atomic job's effects: committed once per succeeded slot, by its success.
        effects = check_effects(
            rows.filter(job_name=ATOMIC).values_list("pk", "period", "status"), self._effects()
        )
        report.atomic_slots, report.atomic_slots_succeeded = effects.slots, effects.succeeded
        report.effect_rows = effects.rows
        violations += effects.violations

        self._check_logs(report, dict(rows.values_list("pk", "status")))
        return report

    def _check_logs(self, report: Report, row_status: dict[int, str]) -> None:
        """Overlaps from the instances' logs (every pair of critical sections of one job that
        intersect), and what each run says against what the ledger says."""
        violations = report.violations
        killed_at = {
            event["pid"]: event["t"]
            for event in self.events
            if event["event"] in ("kill", "final_kill")
        }
        losses = [event for event in self.events if event["event"] in ("terminate", "restart")]
        runs: dict[tuple[str, Any], dict[str, Any]] = {}
        last_try: dict[tuple[int, str], float] = {}
        for event in sorted(self._read_logs(), key=lambda event: event["t"]):
            kind, pid = event["event"], event["pid"]
            if kind == "try":
                report.tries += 1
                last_try[pid, event["job"]] = event["t"]
                continue
            if kind == "overlap":
                report.marker_overlaps += 1
            if kind == "stale_marker":
                report.stale_markers += 1
            if kind == "end" and event["outcome"] == "error" and not event["database"]:
                violations.append(
                    f"{event['job']} run {event['run']} (pid {pid}) raised {event['error']} "
                    f"(where: {event['where']}):\n{event['traceback']}"
                )
            if kind == "end" and event["outcome"] == "error" and event["database"]:
                first_line = event["error"].splitlines()[0][:120] if event["error"] else ""
                report.database_errors[f"{event['job']}: {first_line}"] += 1
            if kind == "end" and event["outcome"] == "error" and event["run"] is None:
                report.claim_errors += 1  # taking the lock or claiming failed: a restart
            if "run" not in event or event["run"] is None:
                continue
            run = runs.setdefault(
                (event["job"], event["run"]), {"pid": pid, "job": event["job"], "id": event["run"]}
            )
            if kind == "claimed":
                report.runs += 1
                run["try"] = last_try.get((pid, event["job"]), event["t"])
                run["slot"], run["attempt"] = event["slot"], event["attempt"]
            elif kind == "enter":
                run.setdefault("enter", event["at"])
            elif kind == "leave":
                run.setdefault("leave", event["t"])
                run.setdefault("enter", event["at"])
            elif kind == "end":
                run["outcome"] = event["outcome"]
                if event["outcome"] == "lost":
                    report.lost_where[event["where"]] += 1
                if event["outcome"] == "succeeded" and row_status.get(event["run"], "") not in (
                    "",
                    "succeeded",
                ):
                    violations.append(
                        f"{event['job']} run {event['run']} succeeded in its instance but its "
                        f"row is {row_status[event['run']]}"
                    )
            elif kind == "overlap":
                run.setdefault("marker_overlaps", []).append(event["other_run"])
            elif kind == "effect":
                run["effect"] = True
                report.effects_written += 1
        for run in runs.values():
            if "outcome" not in run:
                run["outcome"] = "killed" if run["pid"] in killed_at else "vanished"
                if run["job"] == ATOMIC and run["outcome"] == "killed" and "slot" in run:
                    report.atomic_killed[_killed_where(run, row_status.get(run["id"]))] += 1
            report.outcomes[run["outcome"]] += 1
            if "enter" in run and "leave" not in run:
                run["leave"] = killed_at.get(run["pid"], float("inf"))

        window = self.heartbeat + NOTICE_MARGIN
        for job in JOBS:
            sections = sorted(
                (run for run in runs.values() if run["job"] == job and "enter" in run),
                key=lambda run: run["enter"],
            )
            seen = set()
            for i, first in enumerate(sections):
                for second in sections[i + 1 :]:
                    if second["enter"] >= first["leave"]:
                        break  # sorted by entry: no later section overlaps ``first`` either
                    report.overlaps.append(self._overlap(job, first, second, losses, window))
                    seen.add((first["id"], second["id"]))
            for run in sections:
                for other in run.get("marker_overlaps", []):
                    if (other, run["id"]) not in seen:
                        violations.append(
                            f"{job}: the marker saw run {run['id']} inside with run {other}, "
                            f"the logs don't show it"
                        )
        for overlap in report.overlaps:
            both = (
                f"{overlap.job}: {overlap.first} and {overlap.second} were inside at once for "
                f"{overlap.seconds * 1000:.0f} ms"
            )
            if overlap.after_loss is None:
                violations.append(f"{both}, with no lost lock before")
            elif overlap.ending == "none":
                violations.append(
                    f"{both}, until {overlap.after_loss:.3f}s after a lock of the job was lost, "
                    f"and neither raised LockLost nor was killed"
                )
            elif overlap.after_loss > window:
                violations.append(
                    f"{both}, until {overlap.after_loss:.2f}s after a lost lock (documented: "
                    f"noticed within {window:g}s)"
                )

    @staticmethod
    def _overlap(
        job: str,
        first: dict[str, Any],
        second: dict[str, Any],
        losses: list[dict[str, Any]],
        window: float,
    ) -> Overlap:
        end = min(first["leave"], second["leave"])
        # One of the two runs lost its lock (the first one while inside, or the second one
        # before it entered), and must say so: LockLost (a database error in a restart), or
        # be killed before it could.
        outcomes = {first["outcome"], second["outcome"]}
        ending = next((kind for kind in ("lost", "killed", "error") if kind in outcomes), "none")
        # Lost after either run tried to take the lock, before the second one entered: a
        # connection terminated (the same job's lock), or a restart.
        begun = min(run.get("try", run["enter"]) for run in (first, second))
        before = [
            loss["t"]
            for loss in losses
            if begun <= loss["t"] <= second["enter"] and loss.get("job", job) == job
        ]
        after_loss = end - max(before) if before else None
        return Overlap(
            job,
            _describe(first),
            _describe(second),
            end - second["enter"],
            ending,
            after_loss,
        )


@dataclasses.dataclass
class Effects:
    """The atomic job's slots and committed effect rows, checked (``check_effects``)."""

    slots: int = 0
    succeeded: int = 0
    rows: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)


def check_effects(
    runs: Iterable[tuple[int, str, str]], effects: Iterable[tuple[str, str, str, int]]
) -> Effects:
    """Check the atomic job's committed effects against its ledger rows: in each slot, as
    many effect rows as succeeded rows (so one if the slot succeeded, none otherwise), each
    one written by the slot's succeeded run; no effect of a failed, abandoned or running
    attempt, or of a run the ledger doesn't know.

    ``runs``: the job's rows, (id, slot, status); ``effects``: (job, slot, run id, pid).
    """
    runs, effects = list(runs), list(effects)
    row = {str(pk): (slot, status) for pk, slot, status in runs}
    succeeded = collections.Counter(slot for _, slot, status in runs if status == "succeeded")
    committed = collections.Counter(slot for _, slot, _, _ in effects)
    slots = {slot for _, slot, _ in runs} | set(committed)
    result = Effects(len(slots), len(succeeded), len(effects))
    for slot in sorted(slots):
        if committed[slot] != succeeded[slot]:
            result.violations.append(
                f"{ATOMIC} slot {slot}: {committed[slot]} effect row(s) committed, "
                f"{succeeded[slot]} succeeded row(s)"
            )
    for job, slot, run, pid in sorted(effects):
        where = f"{job} slot {slot}: the effect row of run {run} (pid {pid})"
        if run not in row:
            result.violations.append(f"{where} is committed, but the run has no ledger row")
        elif row[run][1] != "succeeded":
            result.violations.append(f"{where} is committed, but the run is {row[run][1]}")
        elif row[run][0] != slot:
            result.violations.append(f"{where} is committed, but the run's slot is {row[run][0]}")
    return result


def _killed_where(run: dict[str, Any], status: str | None) -> str:
    """Where a SIGKILLed atomic run was, from its log (read before the kill's time is put in
    as its end) and its row."""
    if "enter" not in run:
        return "before the body"
    if "leave" not in run:
        return "in the body, after its write" if run.get("effect") else "in the body"
    if status == "succeeded":
        return "after the commit"
    return "between the body and the commit"


def _describe(run: dict[str, Any]) -> str:
    return (
        f"run {run['id']} (pid {run['pid']}, slot {run.get('slot', '?')}, attempt "
        f"{run.get('attempt', '?')}, {run['outcome']})"
    )


if __name__ == "__main__":
    main()
