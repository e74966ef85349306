"""A fleet of one ``@single_instance`` command started together: exactly one runs.

    .venv/bin/python bench/fleet.py [--instances 64] [--rounds 3] [--only sqlite,postgresql,mysql]
    .venv/bin/python bench/fleet.py --pin 0      # the fleet and the servers on CPU 0

``--instances`` processes of ``manage.py fleet_job`` (a ``@single_instance(busy_exit_code=3)``
command in a throw-away project) are started with ``subprocess.Popen`` in a tight loop, on
each database. The one that gets the lock prints ``running`` and keeps the lock until every
other instance has exited; the others print the busy line and exit with status 3. Every run
asserts exactly that: one ran, ``instances - 1`` skipped with the busy line.

Two ways to start, both measured:

- ``go``: each process imports Python and Django, then blocks reading a pipe; the parent
  closes the pipe's write end (the "go") once all are spawned, and every process then runs
  ``django.setup()`` and the command at the same moment. Times count from the go.
- ``spawn``: no gate; times count from each process's own ``Popen`` call (interpreter start,
  imports and all).

Reported per database and start (medians over the rounds): the skippers' time to skip (start
to exit, p50 / p95 / max), when the runner had the lock, the runner's wall time (it holds the
lock until the last skipper has exited), the CPU time of one skipper (user + sys, from
``wait4``), and the server connections the fleet had open at the peak (PostgreSQL:
``pg_stat_activity``, MariaDB: ``Threads_connected``, both minus the count before the
fleet, sampled every 10 ms). The ``plain`` row is the same command without
``@single_instance`` (it exits at once): Django's own start-up at this scale, for comparison.
Process exits are seen through pidfds, at the moment they happen.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUSY = 3
PG_PARAMS = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
MY_PARAMS = {"host": "127.0.0.1", "port": 3306, "user": "root", "database": "test"}
URLS = {
    "sqlite": "sqlite:///{dir}/fleet.sqlite3",
    "postgresql": "postgres://postgres@127.0.0.1:5432/test",
    "mysql": "mysql://root@127.0.0.1:3306/test",
}
LABEL = "fleetapp.fleet_job"
BUSY_LINE = f"{LABEL}: skipped, another instance holds lock 'command:{LABEL}'"

COMMAND = """
import os
import time
from pathlib import Path

from django.core.management.base import BaseCommand
{imports}


{decorator}
class Command(BaseCommand):
    help = "Holds its lock until the file --until exists (at most 120 s)."

    def add_arguments(self, parser):
        parser.add_argument("--until")

    def handle(self, *args, until, **options):
        print(f"running {{os.getpid()}} {{time.monotonic():.6f}}", flush=True)
        deadline = time.monotonic() + 120
        while until and not Path(until).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
"""
SETTINGS = """
import os
from testproject.database_url import parse
SECRET_KEY = "bench"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes", "django.contrib.auth", "advisory_lock", "fleetapp"
]
DATABASES = {"default": parse(os.environ["DATABASE_URL"], None)}
"""
# The process each instance runs: with a gate (a pipe's read end), Python and Django are
# imported first, then it blocks until the parent closes the pipe's write end.
CHILD = """
import os
import sys

gate = int(os.environ.pop("FLEET_GATE_FD", "-1"))
ready = int(os.environ.pop("FLEET_READY_FD", "-1"))
from django.core.management import execute_from_command_line

if gate >= 0:
    os.write(ready, b".")
    os.close(ready)
    os.read(gate, 1)  # b"" (end of file) when the parent lets go
    os.close(gate)
execute_from_command_line(["manage.py", *sys.argv[1:]])
"""


def make_project(folder: Path) -> None:
    commands = folder / "fleetapp" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (folder / "fleetapp", commands.parent, commands):
        (package / "__init__.py").write_text("")
    locked = COMMAND.format(
        imports="from advisory_lock import single_instance",
        decorator="@single_instance(busy_exit_code=3)",
    )
    (commands / "fleet_job.py").write_text(locked)
    (commands / "plain_job.py").write_text(COMMAND.format(imports="", decorator=""))
    (folder / "fleet_settings.py").write_text(SETTINGS)
    (folder / "fleet_child.py").write_text(CHILD)


# The machine: wait until it is quiet, pin.


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _own_family() -> set[int]:
    """This process, its ancestors and its descendants: never "others"."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    parents = {pid: _parent(pid) for pid in pids}
    descendants = {os.getpid()}
    grew = True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in descendants} - descendants
        descendants |= new
        grew = bool(new)
    ancestors, pid = set(), os.getpid()
    while pid > 1:
        ancestors.add(pid)
        pid = _parent(pid)
    return ancestors | descendants


def wait_until_quiet(limit: float, max_load: float = 0.5) -> str:
    """Wait (at most ``limit`` s) until no one else's pytest/bench runs and the load is low."""
    pattern = re.compile(r"pytest|bench/")
    started = time.monotonic()
    while True:
        family = _own_family()
        others = [
            f"{pid}: {cmd[:80]}"
            for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
            if pid not in family and pattern.search(cmd := _cmdline(pid))
        ]
        load = os.getloadavg()[0]
        waited = time.monotonic() - started
        if not others and load < max_load:
            return f"machine quiet after {waited:.0f} s of waiting (load {load:.2f})"
        if waited >= limit:
            return (
                f"machine NOT quiet after {waited:.0f} s; measured anyway (load {load:.2f}, "
                f"{len(others)} other pytest/bench processes: {'; '.join(others[:3])})"
            )
        time.sleep(5)


SERVERS = ("postgres", "mariadbd", "mysqld", "redis-server")


def server_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() in SERVERS:
                    pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def pinned(cpu: int | None):
    """Pin this process (so its children) and the servers to ``cpu``; restore afterwards."""
    if cpu is None:
        yield
        return
    everything = f"0-{os.cpu_count() - 1}"
    pids = server_pids()
    for pid in pids:
        subprocess.run(["taskset", "-acp", str(cpu), str(pid)], capture_output=True)
    os.sched_setaffinity(0, {cpu})
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for pid in pids:
            subprocess.run(["taskset", "-acp", everything, str(pid)], capture_output=True)
        os.sched_setaffinity(0, range(os.cpu_count()))


def library_revision() -> str:
    """The checkout's commit, and whether advisory_lock/ has uncommitted changes."""
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        diff = subprocess.run(
            [*git, "diff", "HEAD", "--", "advisory_lock"], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "advisory_lock at an unknown revision"
    if not diff:
        return f"advisory_lock at commit {commit}"
    digest = hashlib.sha1(diff).hexdigest()[:10]
    return f"advisory_lock at commit {commit} + uncommitted changes (diff sha1 {digest})"


def affinity_note() -> str:
    client = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    servers = sorted(
        {",".join(map(str, sorted(os.sched_getaffinity(pid)))) for pid in server_pids()}
    )
    return f"client on CPUs {client}; servers on CPUs {' | '.join(servers)}"


# Counting server connections while the fleet runs.


class ConnectionSampler:
    """Polls the server's connection count every ``interval`` s in a thread; keeps the peak."""

    def __init__(self, database: str, interval: float = 0.01) -> None:
        self.database, self.interval = database, interval
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._count = None
        if database == "postgresql":
            import psycopg

            conn = psycopg.connect(**PG_PARAMS, autocommit=True)
            sql = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            self._count = lambda: conn.execute(sql).fetchone()[0]
            self._close = conn.close
        elif database == "mysql":
            import MySQLdb

            conn = MySQLdb.connect(**MY_PARAMS, autocommit=True)
            cursor = conn.cursor()

            def count() -> int:
                cursor.execute("SHOW GLOBAL STATUS LIKE 'Threads_connected'")
                return int(cursor.fetchone()[1])

            self._count, self._close = count, conn.close

    def start(self) -> None:
        if self._count is None:
            return
        self.baseline = self.peak = self._count()

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.peak = max(self.peak, self._count())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> int | None:
        if self._count is None:
            return None
        self._stop.set()
        self._thread.join()
        self._close()
        return self.peak - self.baseline


# One fleet.


@dataclass
class Outcome:
    database: str
    start: str
    skips: list[float] = field(default_factory=list)  # ms, start to exit, the skippers
    runner_acquired: float = 0.0  # ms from start to the runner's "running"
    runner_wall: float = 0.0  # ms from start to the runner's exit
    cpu: list[float] = field(default_factory=list)  # ms of user + sys, the skippers
    connections: int | None = None
    spawn_loop: float = 0.0  # ms to Popen every instance


def run_fleet(
    folder: Path, database: str, start: str, instances: int, plain: bool = False
) -> Outcome:
    url = URLS["sqlite" if plain else database].format(dir=folder)
    until = folder / f"until-{time.monotonic_ns()}"
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=folder))
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "fleet_settings",
        "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
    }
    command = "plain_job" if plain else "fleet_job"
    argv = [sys.executable, str(folder / "fleet_child.py"), command, "--until", str(until)]
    if plain:
        argv = argv[:3]
    gate_read = gate_write = ready_read = ready_write = -1
    if start == "go":
        gate_read, gate_write = os.pipe()
        ready_read, ready_write = os.pipe()
        env["FLEET_GATE_FD"], env["FLEET_READY_FD"] = str(gate_read), str(ready_write)
    sampler = ConnectionSampler("none" if plain else database)
    sampler.start()
    processes: list[tuple[subprocess.Popen, float, Any, Any]] = []
    loop_started = time.monotonic()
    try:
        for number in range(instances):
            out = open(logs / f"{number}.out", "w+")  # noqa: SIM115 (closed below)
            err = open(logs / f"{number}.err", "w+")  # noqa: SIM115 (closed below)
            spawned = time.monotonic()
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(gate_read, ready_write) if gate_read >= 0 else (),
            )
            processes.append((process, spawned, out, err))
        spawn_loop = time.monotonic() - loop_started
        if start == "go":
            wait_ready(ready_read, ready_write, instances)
            went = time.monotonic()
            os.close(gate_write)
            os.close(gate_read)
        exits, statuses, cpu = wait_all(processes, instances, until)
    finally:
        for process, *_ in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        connections = sampler.stop()
    outcome = Outcome(database="plain" if plain else database, start=start)
    outcome.connections = connections
    outcome.spawn_loop = spawn_loop * 1000
    runners, skippers, problems = [], [], []
    for number, (process, spawned, out, err) in enumerate(processes):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        zero = went if start == "go" else spawned
        elapsed = (exits[process.pid] - zero) * 1000
        if plain and statuses[process.pid] == 0:
            skippers.append(number)
            outcome.skips.append(elapsed)
            outcome.cpu.append(cpu[process.pid])
        elif stdout.startswith("running"):
            runners.append(number)
            outcome.runner_wall = elapsed
            outcome.runner_acquired = (float(stdout.split()[2]) - zero) * 1000
            if statuses[process.pid] != 0:
                problems.append(f"runner {number} exited {statuses[process.pid]}: {stderr}")
        elif statuses[process.pid] == BUSY and BUSY_LINE in stderr:
            skippers.append(number)
            outcome.skips.append(elapsed)
            outcome.cpu.append(cpu[process.pid])
        else:
            problems.append(f"instance {number} exited {statuses[process.pid]}: {stderr[-500:]}")
    shutil.rmtree(logs, ignore_errors=True)
    until.unlink(missing_ok=True)
    if plain:
        assert not problems and len(skippers) == instances, problems
    else:
        assert len(runners) == 1 and len(skippers) == instances - 1 and not problems, (
            f"{database}/{start}: {len(runners)} ran, {len(skippers)} skipped with the busy "
            f"line, {len(problems)} other: {problems[:3]}"
        )
    return outcome


def wait_ready(ready_read: int, ready_write: int, instances: int) -> None:
    """Block until every process has imported Django and reached the gate."""
    os.close(ready_write)
    seen = 0
    while seen < instances:
        chunk = os.read(ready_read, instances)
        if not chunk:
            raise AssertionError(f"only {seen} of {instances} processes reached the gate")
        seen += len(chunk)
    os.close(ready_read)


def wait_all(
    processes: list[tuple[subprocess.Popen, float, Any, Any]], instances: int, until: Path
) -> tuple[dict[int, float], dict[int, int], dict[int, float]]:
    """Reap every process as it exits (pidfds); create ``until`` once all but one have."""
    selector = selectors.DefaultSelector()
    by_fd = {}
    for process, *_ in processes:
        fd = os.pidfd_open(process.pid)
        by_fd[fd] = process
        selector.register(fd, selectors.EVENT_READ)
    exits: dict[int, float] = {}
    statuses: dict[int, int] = {}
    cpu: dict[int, float] = {}
    deadline = time.monotonic() + 120 + instances
    try:
        while by_fd and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                now = time.monotonic()
                process = by_fd.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status, usage = os.wait4(process.pid, 0)
                process.returncode = os.waitstatus_to_exitcode(status)
                exits[process.pid] = now
                statuses[process.pid] = process.returncode
                cpu[process.pid] = (usage.ru_utime + usage.ru_stime) * 1000
            if len(exits) >= instances - 1:
                until.touch()
            if time.monotonic() > deadline - 120 and not until.exists():
                until.touch()  # something is wrong: let a stuck runner go, then fail
    finally:
        until.touch()
        for fd in by_fd:
            selector.unregister(fd)
            os.close(fd)
        selector.close()
    return exits, statuses, cpu


# Reporting.


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


def summarise(outcomes: list[Outcome]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    connections = [o.connections for o in outcomes if o.connections is not None]
    return {
        "p50": med([percentile(o.skips, 0.50) for o in outcomes]),
        "p95": med([percentile(o.skips, 0.95) for o in outcomes]),
        "max": med([max(o.skips) for o in outcomes]),
        "acquired": med([o.runner_acquired for o in outcomes]),
        "runner": med([o.runner_wall for o in outcomes]),
        "cpu": med([statistics.median(o.cpu) for o in outcomes]),
        "cpu_total": med([sum(o.cpu) for o in outcomes]),
        "connections": max(connections) if connections else None,
        "connections_min": min(connections) if connections else None,
        "spawn_loop": med([o.spawn_loop for o in outcomes]),
        "skippers": len(outcomes[0].skips),
        "rounds": len(outcomes),
    }


def table(results: dict[tuple[str, str], list[Outcome]], instances: int) -> str:
    lines = [
        f"| database | start | ran / skipped (busy line) | skip p50 (ms) | p95 (ms) | max (ms) "
        f"| runner had the lock at (ms) | runner wall (ms) | CPU per skipper (ms) "
        f"| CPU, all {instances} (s) | peak server connections (fleet) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (database, start), outcomes in results.items():
        s = summarise(outcomes)
        plain = database == "plain"
        if s["connections"] is None:
            connections = "-"
        elif s["connections"] == s["connections_min"]:
            connections = str(s["connections"])
        else:
            connections = f"{s['connections_min']}-{s['connections']}"
        ran = f"- / {instances} exited 0" if plain else f"1 / {s['skippers']} (all rounds)"
        lines.append(
            f"| {'plain command, no lock' if plain else database} | {start} | {ran} "
            f"| {s['p50']:,.0f} | {s['p95']:,.0f} | {s['max']:,.0f} "
            f"| {'-' if plain else format(s['acquired'], ',.0f')} "
            f"| {'-' if plain else format(s['runner'], ',.0f')} | {s['cpu']:,.0f} "
            f"| {s['cpu_total'] / 1000:.1f} | {connections} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    parser.add_argument(
        "--only", default="sqlite,postgresql,mysql", help="comma-separated databases"
    )
    parser.add_argument("--starts", default="go,spawn", help="go, spawn, or both")
    parser.add_argument("--no-plain", action="store_true", help="skip the no-lock baseline")
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin fleet and servers to CPU")
    parser.add_argument("--quiet-wait", type=float, default=600, help="max s to wait for quiet")
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    databases = [name for name in args.only.split(",") if name]
    starts = [name for name in args.starts.split(",") if name]
    if unknown := set(databases) - set(URLS) or set(starts) - {"go", "spawn"}:
        parser.error(f"unknown: {unknown}")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    quiet = wait_until_quiet(args.quiet_wait)
    revision = library_revision()
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-fleet-"))
    make_project(folder)
    variants = [(database, start) for database in databases for start in starts]
    if not args.no_plain:
        variants += [("plain", start) for start in starts]
    results: dict[tuple[str, str], list[Outcome]] = {variant: [] for variant in variants}
    try:
        with pinned(args.pin):
            note = affinity_note()
            for number in range(args.rounds):
                order = list(variants)
                rng.shuffle(order)
                for database, start in order:
                    outcome = run_fleet(
                        folder, database, start, args.instances, plain=database == "plain"
                    )
                    results[database, start].append(outcome)
                    print(
                        f"  … round {number + 1}: {database}/{start}: "
                        f"p50 {percentile(outcome.skips, 0.5):.0f} ms, "
                        f"max {max(outcome.skips):.0f} ms, connections {outcome.connections}",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    import django

    print(f"# A fleet of {args.instances} instances of one @single_instance command\n")
    print(f"- {revision}; {quiet}")
    pinning = "pinned" if args.pin is not None else "NOT pinned"
    print(f"- {note} ({pinning}); {os.cpu_count()} CPUs")
    print(
        f"- Django {django.get_version()}; Python {sys.version.split()[0]}; "
        f"{args.rounds} rounds, variants shuffled each round (seed {seed}); medians over rounds"
    )
    print(
        f"- spawn loop (Popen x {args.instances}): "
        f"{statistics.median(o.spawn_loop for v in results.values() for o in v):.0f} ms; "
        f"go: times from the gate opening; spawn: from each process's Popen\n"
    )
    print(table(results, args.instances))


if __name__ == "__main__":
    main()
