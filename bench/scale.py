"""A fleet of ``run_jobs`` schedulers at scale: what it costs the database.

    .venv/bin/python bench/scale.py [--entries 500] [--idle-schedulers 8] [--idle-seconds 90]
                                    [--busy-schedulers 4] [--busy-minutes 2]
                                    [--poll-interval SECONDS] [--fleets 64,1000]
                                    [--only postgresql,mysql] [--verbose] [--keep]

Each database server is a private one, started for the run in a temporary folder on a free
127.0.0.1 port and removed at the end: PostgreSQL with ``pg_stat_statements`` loaded, MariaDB
with the performance schema on (the machine's servers have neither, and turning them on takes
a restart), every other setting at its default (``max_connections`` 100 and 151 too). The
server counts what the fleet costs it, in the fleet's database only (``bench_scale``; the
script's own look-ups go to another database, or happen outside the windows):

- statements: ``pg_stat_statements.calls``, ``COUNT_STAR`` of
  ``performance_schema.events_statements_summary_by_digest``; every statement a client sends,
  those of Django's cursors and the library's driver-level lock calls alike, grouped by kind;
- connections opened: ``pg_stat_database.sessions``, the ``Connections`` status; the most
  open at once, sampled every 0.1 s;
- CPU seconds of the server's processes and of the fleet's (schedulers and job processes),
  from ``/proc``: these depend on the machine and its load (printed), the counts do not.

Two phases per server, each on a fresh ledger, with real ``manage.py run_jobs`` processes:

- idle: ``--idle-schedulers`` schedulers on ``--entries`` entries that don't fall due
  (``cron: "0 0 1 1 *"``, ``catch_up: "none"``: no slot to look up, as for entries whose
  latest slot is done), for ``--idle-seconds`` from the moment every scheduler has finished
  its first sweep;
- busy: ``--busy-schedulers`` schedulers on ``--entries`` entries due every minute
  (``cron: "* * * * *"``, a job that does nothing), for ``--busy-minutes`` whole minutes from
  2 s before a minute boundary, once the runs of the start-up are over. Due -> start is a
  slot's first attempt's ``started_at`` (its claim, by the database's clock) less the slot's
  time; "job processes" are those the schedulers started for the window's slots (their
  output), one of which runs each slot and the others skip.

The rows for larger fleets (``--fleets``) are computed, not measured: idle, N times what a
scheduler sends at its full rhythm (a pass every 0.2 s, a heartbeat every second, a look for
run-now requests every poll interval, a sweep every minute: the most it sends, whatever its
host's CPU), from the measured cost of each; busy, the line through the measured fleets
(``--busy-schedulers 1,4``: statements/s against schedulers), or N times the per-scheduler
rate of one fleet.
SQLite is left out: its locks and ledger are a file on one host, so a fleet of instances
can't share it, and it has no server to count statements.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from fleet import library_revision
from servers import SCHEDULER_SETTINGS

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "bench_scale"
SETTINGS = (
    SCHEDULER_SETTINGS
    + '''

def noop() -> None:
    """The busy schedule's job: nothing."""
'''
)
JOB = "bench_scale_settings.noop"
#: Seconds a start-up (Django, the first sweep, the first runs) may take before giving up.
STARTUP_TIMEOUT = 600
#: The measured window starts this long before a minute boundary (busy phase).
BEFORE_BOUNDARY = 2.0
#: The scheduler's documented rhythm (docs/scheduler.md): a look at the clock for due slots
#: every 0.2 s while idle, a heartbeat every second, a look for run-now requests every poll
#: interval (``--poll-interval``), a sweep for abandoned runs every minute.
LOOP, BEAT, SWEEP = 0.2, 1.0, 60.0
TICK = os.sysconf("SC_CLK_TCK")

#: Statement kinds, by the server's normalized text; the first match wins.
KINDS = (
    ("locks", r"advisory|GET_LOCK|RELEASE_LOCK|IS_USED_LOCK|IS_FREE_LOCK|pg_locks"),
    ("clock", r"^SELECT\s+(statement_timestamp|UTC_TIMESTAMP)"),
    ("heartbeats", r"\bjob_schedulers\b"),
    ("controls", r"\bjob_controls\b"),
    ("ledger writes", r"^(INSERT|UPDATE|DELETE)\b.*\bjob_runs\b"),
    ("ledger reads", r"\bjob_runs\b"),
    ("connection set-up", r"^(SET|SHOW)\b|@@|set_config|pg_is_in_recovery"),
    ("transactions", r"^(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|START)\b"),
    ("other", r""),
)
#: In the sampler's statement on the fleet's database (PostgreSQL): not counted.
MARK = "bench_scale_observer"
#: The kind of the statements that PostgreSQL refused (pg_stat_statements has no row for
#: them); MariaDB counts them among the others.
REFUSED = "refused, not above"
BEATS = re.compile(r"^UPDATE\b.*\bjob_schedulers\b", re.IGNORECASE | re.DOTALL)
SWEEPS = re.compile(r"^DELETE\b.*\bjob_schedulers\b", re.IGNORECASE | re.DOTALL)
OUTPUT = re.compile(r"^run_jobs: (\S+) \[([^\]]+)\] (started|succeeded|skipped|failed)", re.M)


def kind_of(text: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, text.strip(), re.IGNORECASE | re.DOTALL):
            return name
    return "other"


# Processes and their CPU time.


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command's name (state is [0], ppid [1])."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def cpu_seconds(pids: list[int], children_of: list[int] | None = None) -> float:
    """CPU time of ``pids`` and of the children they reaped, plus that of the live children
    of ``children_of`` (from /proc, in seconds)."""
    ticks = 0
    for pid in pids:
        fields = _stat(pid)
        if fields:
            ticks += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    if children_of:
        parents = {str(pid) for pid in children_of}
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = _stat(int(name))
                if fields and fields[1] in parents:
                    ticks += sum(int(value) for value in fields[11:15])
    return ticks / TICK


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_as(user: str) -> dict[str, Any]:
    """subprocess arguments that run a server program as ``user`` when we are root (servers
    refuse to run as root), and as ourselves otherwise."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(user)
    env = {**os.environ, "HOME": entry.pw_dir, "USER": user, "LOGNAME": user}
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "env": env}


def own(path: Path, user: str) -> None:
    """Give ``path`` and what it holds to ``user`` when we are root (not what links lead to)."""
    if os.geteuid() == 0:
        for folder, _, files in os.walk(path):
            shutil.chown(folder, user, user)
            for name in files:
                if not (Path(folder) / name).is_symlink():
                    shutil.chown(Path(folder) / name, user, user)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# The servers.


@dataclass
class Snapshot:
    """What the server has counted for the fleet's database so far, and the clocks."""

    statements: dict[str, int]
    connections: int
    server_cpu: float
    fleet_cpu: float
    at: float = field(default_factory=time.monotonic)
    load: float = field(default_factory=lambda: os.getloadavg()[0])


class Server:
    """A private database server, started and removed by the script."""

    name = ""
    vendor = ""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.version = ""

    # Each server: how to start and stop it, and what its statistics say.

    def start(self) -> None:
        raise NotImplementedError

    def url(self) -> str:
        raise NotImplementedError

    def connect(self, database: str | None) -> Any:
        """A driver connection (autocommit): to ``database``, or outside any."""
        raise NotImplementedError

    def statements(self, observer: Any) -> dict[str, int]:
        raise NotImplementedError

    def connections_opened(self, observer: Any) -> int:
        raise NotImplementedError

    def sampler(self) -> Any:
        """The connection of ``sample()``."""
        raise NotImplementedError

    def sample(self, connection: Any) -> tuple[int, int]:
        """The fleet's connections open now, and its schedulers alive (seen in the last
        3 s, as ``run_jobs --check`` counts them)."""
        raise NotImplementedError

    def lost(self, observer: Any) -> int:
        """Statements the statistics could not record (their table was full): must be 0."""
        raise NotImplementedError

    #: Are the statements the server refused (an error) among ``statements()``?
    refusals_counted = True

    def refused(self, observer: Any) -> int:
        """Statements the server refused (an error) so far."""
        raise NotImplementedError

    def now(self, observer: Any) -> datetime.datetime:
        raise NotImplementedError

    def server_pids(self) -> tuple[list[int], list[int]]:
        """The server's processes: (pids, parents of the other processes)."""
        assert self.process is not None
        return [self.process.pid], []

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT if self.vendor == "postgresql" else signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise SystemExit(
                    f"{self.name} exited at start-up:\n{tail(self.folder / 'server.log')}"
                )
            try:
                with contextlib.closing(self.connect(None)):
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # Shared.

    def ledger(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """The rows of one statement on the fleet's database, on a connection of its own
        (outside the measured windows only: the server would count it)."""
        with contextlib.closing(self.connect(DATABASE)) as connection:
            cursor = connection.cursor()
            cursor.execute(sql, params)
            rows = list(cursor.fetchall()) if cursor.description else []
            cursor.close()
            return rows


class PostgreSQL(Server):
    name = "PostgreSQL"
    vendor = "postgresql"

    def start(self) -> None:
        import psycopg

        bindir = Path(
            subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True
            ).stdout.strip()
        )
        if not (bindir / "initdb").exists():
            candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
            if not candidates:
                raise SystemExit("no PostgreSQL server programs (initdb, postgres) here")
            bindir = candidates[-1].parent
        own(self.folder, "postgres")
        initdb = subprocess.run(
            [bindir / "initdb", "-D", self.folder / "data", "-U", "postgres", "--auth=trust",
             "--no-sync", "-E", "UTF8", "--locale=C"],
            capture_output=True, text=True, cwd=self.folder, **run_as("postgres"),
        )  # fmt: skip
        if initdb.returncode:
            raise SystemExit(f"initdb failed:\n{initdb.stdout}{initdb.stderr}")
        settings = {
            "port": self.port,
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.folder),
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.max": 10000,
            "pg_stat_statements.track_utility": "on",
        }
        options = [part for key, value in settings.items() for part in ("-c", f"{key}={value}")]
        with (self.folder / "server.log").open("wb") as log:
            self.process = subprocess.Popen(
                [bindir / "postgres", "-D", self.folder / "data", *options],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                cwd=self.folder, **run_as("postgres"),
            )  # fmt: skip
        self.wait_ready()
        with psycopg.connect(**self._params("postgres"), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {DATABASE}")
            connection.execute("CREATE EXTENSION pg_stat_statements")
            row = connection.execute("SHOW server_version").fetchone()
            self.version = f"PostgreSQL {row[0].split()[0]}" if row else "PostgreSQL"
            row = connection.execute(
                "SELECT oid FROM pg_database WHERE datname = %s", [DATABASE]
            ).fetchone()
            assert row is not None
            self.oid = row[0]

    def _params(self, database: str | None) -> dict[str, Any]:
        return {
            "host": "127.0.0.1",
            "port": self.port,
            "user": "postgres",
            "dbname": database or "postgres",
            "connect_timeout": 5,
        }

    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def connect(self, database: str | None) -> Any:
        import psycopg

        return psycopg.connect(**self._params(database), autocommit=True)

    def statements(self, observer: Any) -> dict[str, int]:
        rows = observer.execute(
            "SELECT query, calls FROM pg_stat_statements WHERE dbid = %s", [self.oid]
        ).fetchall()
        counts: dict[str, int] = collections.Counter()
        for text, calls in rows:
            if MARK not in text:  # the sampler's, on the fleet's database
                counts[text] += calls
        return dict(counts)

    def connections_opened(self, observer: Any) -> int:
        row = observer.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = %s", [DATABASE]
        ).fetchone()
        return int(row[0])

    def sampler(self) -> Any:
        return self.connect(DATABASE)  # opened before the window: not among its connections

    def sample(self, connection: Any) -> tuple[int, int]:
        row = connection.execute(
            "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            " AND pid <> pg_backend_pid()), (SELECT count(*) FROM job_schedulers"
            f" WHERE last_seen >= statement_timestamp() - interval '3 seconds') AS {MARK}",
            [DATABASE],
        ).fetchone()
        return int(row[0]), int(row[1])

    def lost(self, observer: Any) -> int:
        return int(observer.execute("SELECT dealloc FROM pg_stat_statements_info").fetchone()[0])

    # pg_stat_statements counts the statements that complete; one that fails (a claim's
    # INSERT of a taken attempt) rolls back its autocommit transaction: counted there.
    refusals_counted = False

    def refused(self, observer: Any) -> int:
        row = observer.execute(
            "SELECT xact_rollback FROM pg_stat_database WHERE datname = %s", [DATABASE]
        ).fetchone()
        return int(row[0])

    def now(self, observer: Any) -> datetime.datetime:
        now: datetime.datetime = observer.execute("SELECT statement_timestamp()").fetchone()[0]
        return now.astimezone(datetime.timezone.utc)

    def server_pids(self) -> tuple[list[int], list[int]]:
        assert self.process is not None
        return [self.process.pid], [self.process.pid]  # the postmaster, and its backends


class MariaDB(Server):
    name = "MariaDB"
    vendor = "mysql"

    def start(self) -> None:
        programs = {
            name: shutil.which(name) or f"/usr/sbin/{name}"
            for name in ("mariadbd", "mariadb-install-db")
        }
        if not all(os.access(path, os.X_OK) for path in programs.values()):
            raise SystemExit("no MariaDB server programs (mariadbd, mariadb-install-db) here")
        # A copy of the server program, in an installation tree of its own (the rest linked
        # to the system's): the machine's tools that look for the machine's MariaDB by its
        # executable (start-stop-daemon --exec, the restart tests) must not take it for it.
        base = self.folder / "base"
        (base / "sbin").mkdir(parents=True)
        for name in ("bin", "share", "lib"):
            (base / name).symlink_to(Path("/usr") / name)
        server = base / "sbin" / "mariadbd"
        shutil.copy2(Path(programs["mariadbd"]).resolve(), server)
        own(self.folder, "mysql")
        user = ["--user=mysql"] if os.geteuid() == 0 else []
        data = self.folder / "data"
        install = subprocess.run(
            [programs["mariadb-install-db"], "--no-defaults", f"--basedir={base}",
             f"--datadir={data}", *user, "--auth-root-authentication-method=normal",
             "--skip-test-db", "--skip-name-resolve"],
            capture_output=True, text=True,
        )  # fmt: skip
        if install.returncode:
            raise SystemExit(f"mariadb-install-db failed:\n{install.stdout}{install.stderr}")
        with (self.folder / "server.log").open("wb") as log:
            self.process = subprocess.Popen(
                [server, "--no-defaults", f"--basedir={base}", f"--datadir={data}", *user,
                 f"--socket={self.folder / 'sock'}", f"--port={self.port}",
                 "--bind-address=127.0.0.1", f"--pid-file={self.folder / 'pid'}",
                 "--skip-name-resolve", "--performance-schema=ON"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        self.wait_ready()
        with contextlib.closing(self.connect(None)) as connection:
            cursor = connection.cursor()
            cursor.execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
            cursor.execute("SELECT VERSION()")
            self.version = f"MariaDB {cursor.fetchone()[0].split('-')[0]}"

    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{DATABASE}"

    def connect(self, database: str | None) -> Any:
        import MySQLdb

        params: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": "root",
            "connect_timeout": 5,
        }
        if database:
            params["database"] = database
        connection = MySQLdb.connect(**params)
        connection.autocommit(True)
        return connection

    def _rows(self, observer: Any, sql: str, params: tuple[Any, ...] = ()) -> list:
        cursor = observer.cursor()
        cursor.execute(sql, params)
        rows = list(cursor.fetchall())
        cursor.close()
        return rows

    def statements(self, observer: Any) -> dict[str, int]:
        rows = self._rows(
            observer,
            "SELECT DIGEST_TEXT, COUNT_STAR FROM "
            "performance_schema.events_statements_summary_by_digest WHERE SCHEMA_NAME = %s",
            (DATABASE,),
        )
        counts: dict[str, int] = collections.Counter()
        for text, calls in rows:
            counts[text or "(no digest)"] += int(calls)
        return dict(counts)

    def _status(self, observer: Any, name: str) -> int:
        rows = self._rows(observer, "SHOW GLOBAL STATUS LIKE %s", (name,))
        return int(rows[0][1])

    def connections_opened(self, observer: Any) -> int:
        return self._status(observer, "Connections")

    def sampler(self) -> Any:
        return self.connect(None)  # outside the fleet's database: not counted

    def sample(self, connection: Any) -> tuple[int, int]:
        rows = self._rows(
            connection,
            "SELECT (SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = %s), "
            f"(SELECT COUNT(*) FROM {DATABASE}.job_schedulers "
            "WHERE last_seen >= UTC_TIMESTAMP(6) - INTERVAL 3 SECOND)",
            (DATABASE,),
        )
        return int(rows[0][0]), int(rows[0][1])

    def lost(self, observer: Any) -> int:
        return self._status(observer, "Performance_schema_digest_lost")

    def refused(self, observer: Any) -> int:
        rows = self._rows(
            observer,
            "SELECT COALESCE(SUM(SUM_ERRORS), 0) FROM "
            "performance_schema.events_statements_summary_by_digest WHERE SCHEMA_NAME = %s",
            (DATABASE,),
        )
        return int(rows[0][0])

    def now(self, observer: Any) -> datetime.datetime:
        rows = self._rows(observer, "SELECT UTC_TIMESTAMP(6)")
        now: datetime.datetime = rows[0][0]
        return now.replace(tzinfo=datetime.timezone.utc)


SERVERS: dict[str, type[Server]] = {"postgresql": PostgreSQL, "mysql": MariaDB}


# The fleet.


class Fleet:
    """``run_jobs`` processes on the private server, each in a session of its own."""

    def __init__(self, server: Server, folder: Path, schedule: dict[str, Any]) -> None:
        self.folder = folder
        self.folder.mkdir()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench_scale_settings",
            "PYTHONPATH": f"{folder.parent}{os.pathsep}{ROOT}",
            "DATABASE_URL": server.url(),
            "SCHEDULE": json.dumps(schedule),
            "PYTHONUNBUFFERED": "1",
        }

    def manage(self, *argv: str) -> None:
        subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), *argv], cwd=ROOT, env=self.env, check=True
        )

    def start(self, count: int, poll_interval: float | None) -> None:
        options = [] if poll_interval is None else ["--poll-interval", f"{poll_interval:g}"]
        for number in range(count):
            with (
                open(self.folder / f"run_jobs.{number}.out", "wb") as out,
                open(self.folder / f"run_jobs.{number}.err", "wb") as err,
            ):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, str(ROOT / "manage.py"), "run_jobs", *options],
                        cwd=ROOT,
                        env=self.env,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def check_running(self) -> None:
        for number, process in enumerate(self.processes):
            if process.poll() is not None:
                raise SystemExit(
                    f"run_jobs {number} exited with status {process.returncode}:\n"
                    f"{tail(self.folder / f'run_jobs.{number}.err')}"
                )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(90)
        for process in self.processes:  # whatever is left of a session: its job processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.wait(10)

    def output(self) -> str:
        return "".join(
            (self.folder / f"run_jobs.{number}.out").read_text(errors="replace")
            for number in range(len(self.processes))
        )


def schedule(entries: int, busy: bool) -> dict[str, Any]:
    if busy:
        return {f"busy-{i:04d}": {"callable": JOB, "cron": "* * * * *"} for i in range(entries)}
    return {
        f"idle-{i:04d}": {"callable": JOB, "cron": "0 0 1 1 *", "catch_up": "none"}
        for i in range(entries)
    }


# Measuring.


class Observer:
    """The script's view of the server: its statistics (on a connection outside the fleet's
    database), and, sampled every 0.1 s, the fleet's connections open and its schedulers
    alive."""

    def __init__(self, server: Server, fleet: Fleet) -> None:
        self.server = server
        self.fleet = fleet
        self.connection = server.connect(None)
        self.samples: list[tuple[int, int]] = []
        self._sampling = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with contextlib.closing(self.server.sampler()) as connection:
            while not self._done.wait(0.1):
                if self._sampling.is_set():
                    self.samples.append(self.server.sample(connection))

    def snapshot(self) -> Snapshot:
        pids, parents = self.server.server_pids()
        return Snapshot(
            statements=self.server.statements(self.connection),
            connections=self.server.connections_opened(self.connection),
            server_cpu=cpu_seconds(pids, parents),
            fleet_cpu=cpu_seconds(self.fleet.pids(), self.fleet.pids()),
        )

    def sample(self, on: bool) -> None:
        if on:
            self.samples = []
            self._sampling.set()
        else:
            self._sampling.clear()

    def now(self) -> datetime.datetime:
        return self.server.now(self.connection)

    def sweeps(self) -> int:
        return sum(
            n for text, n in self.server.statements(self.connection).items() if SWEEPS.match(text)
        )

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self.connection.close()


@dataclass
class Window:
    """One measured window of one phase."""

    phase: str
    schedulers: int
    entries: int
    seconds: float
    statements: dict[str, int]  # by kind
    total: int
    connections: int
    peak: int
    alive: list[int]  # schedulers alive at each sample
    server_cpu: float
    fleet_cpu: float
    load: tuple[float, float]
    lost: int
    refused: int  # statements the server refused (an error): in ``total``
    beats: int = 0
    poll_interval: float = 1.0
    sweeps: int = 0
    slots: int = 0
    latencies: list[float] = field(default_factory=list)
    missed: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)
    texts: dict[str, int] = field(default_factory=dict)

    @property
    def none_alive(self) -> float:
        """The share of the samples in which no scheduler was alive."""
        return sum(alive == 0 for alive in self.alive) / max(1, len(self.alive))

    def per_second(self, value: float, per_scheduler: bool = False) -> float:
        return value / self.seconds / (self.schedulers if per_scheduler else 1)


def measure(
    observer: Observer, phase: str, schedulers: int, entries: int, until: Callable[[], None]
) -> Window:
    """Snapshot, wait (``until``), snapshot: the window's deltas."""
    observer.sample(True)
    before = observer.snapshot()
    lost_before = observer.server.lost(observer.connection)
    refused_before = observer.server.refused(observer.connection)
    until()
    after = observer.snapshot()
    observer.sample(False)
    observer.fleet.check_running()
    texts = {
        text: count - before.statements.get(text, 0)
        for text, count in after.statements.items()
        if count != before.statements.get(text, 0)
    }
    kinds: dict[str, int] = collections.Counter()
    for text, count in texts.items():
        kinds[kind_of(text)] += count
    refused = observer.server.refused(observer.connection) - refused_before
    if not observer.server.refusals_counted:
        kinds[REFUSED] = refused
    return Window(
        phase=phase,
        schedulers=schedulers,
        entries=entries,
        seconds=after.at - before.at,
        statements=dict(kinds),
        total=sum(kinds.values()),
        connections=after.connections - before.connections,
        peak=max((open_ for open_, _ in observer.samples), default=0),
        alive=[alive for _, alive in observer.samples],
        server_cpu=after.server_cpu - before.server_cpu,
        fleet_cpu=after.fleet_cpu - before.fleet_cpu,
        load=(before.load, after.load),
        lost=observer.server.lost(observer.connection) - lost_before,
        refused=refused,
        beats=sum(count for text, count in texts.items() if BEATS.match(text)),
        sweeps=sum(count for text, count in texts.items() if SWEEPS.match(text)),
        texts=texts,
    )


def wait_for(what: str, condition: Callable[[], bool], fleet: Fleet) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not condition():
        fleet.check_running()
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {STARTUP_TIMEOUT} s")
        time.sleep(0.5)


def idle_phase(
    server: Server,
    folder: Path,
    schedulers: int,
    entries: int,
    seconds: float,
    poll_interval: float | None,
) -> Window:
    fleet = Fleet(server, folder / f"{server.vendor}-idle", schedule(entries, busy=False))
    observer = Observer(server, fleet)
    try:
        swept = observer.sweeps()
        fleet.start(schedulers, poll_interval)
        # Every scheduler has polled once and finished its first sweep (it ends by deleting
        # the heartbeats of schedulers gone for a week: one DELETE a sweep).
        wait_for("the first sweeps", lambda: observer.sweeps() >= swept + schedulers, fleet)
        say(f"  measuring {seconds:g} s")
        window = measure(observer, "idle", schedulers, entries, lambda: time.sleep(seconds))
        window.poll_interval = poll_interval or 1.0
        return window
    finally:
        observer.close()
        fleet.stop()


def busy_phase(
    server: Server,
    folder: Path,
    schedulers: int,
    entries: int,
    minutes: int,
    poll_interval: float | None,
) -> Window:
    fleet = Fleet(
        server, folder / f"{server.vendor}-busy-{schedulers}", schedule(entries, busy=True)
    )
    observer = Observer(server, fleet)
    try:
        swept = observer.sweeps()
        fleet.start(schedulers, poll_interval)

        def started_up() -> bool:
            # The first sweeps are over, every entry has run once, and nothing is running.
            if observer.sweeps() < swept + schedulers:
                return False
            done, running = server.ledger(
                "SELECT COUNT(DISTINCT CASE WHEN status = 'succeeded' THEN job_name END), "
                "COUNT(CASE WHEN status = 'running' THEN 1 END) FROM job_runs",
            )[0]
            return bool(done == entries and running == 0)

        wait_for("the runs of the start-up", started_up, fleet)
        now = observer.now()
        first = now.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
        if (first - now).total_seconds() < BEFORE_BOUNDARY + 1:
            first += datetime.timedelta(minutes=1)
        start = first - datetime.timedelta(seconds=BEFORE_BOUNDARY)
        end = start + datetime.timedelta(minutes=minutes)

        def sleep_until(moment: datetime.datetime) -> None:
            time.sleep(max(0.0, (moment - observer.now()).total_seconds()))

        say(f"  measuring from {start:%H:%M:%S} to {end:%H:%M:%S} (UTC)")
        sleep_until(start)
        window = measure(observer, "busy", schedulers, entries, lambda: sleep_until(end))
        window.poll_interval = poll_interval or 1.0
    finally:
        observer.close()
        fleet.stop()
    # The window's slots, and how they went (after the fleet stopped: outside the window).
    slots = [first + datetime.timedelta(minutes=m) for m in range(minutes)]
    names = [f"{slot:%Y-%m-%dT%H:%M}" for slot in slots]
    rows = server.ledger(
        f"SELECT job_name, period, attempt, status, started_at FROM job_runs "
        f"WHERE period IN ({', '.join('%s' for _ in names)})",
        tuple(names),
    )
    firsts: dict[tuple[str, str], tuple[int, datetime.datetime]] = {}
    statuses: dict[str, int] = collections.Counter()
    for job, period, attempt, status, started in rows:
        statuses[status] += 1
        if started.tzinfo is None:
            started = started.replace(tzinfo=datetime.timezone.utc)
        if (job, period) not in firsts or attempt < firsts[job, period][0]:
            firsts[job, period] = (attempt, started)
    due = dict(zip(names, slots, strict=True))
    window.latencies = sorted(
        (started - due[period]).total_seconds() for (_, period), (_, started) in firsts.items()
    )
    window.slots = entries * minutes
    window.missed = window.slots - len(firsts)
    window.statuses = dict(statuses)
    window.processes = dict(
        collections.Counter(
            what for _, slot, what in OUTPUT.findall(fleet.output()) if slot in due
        )
    )
    return window


# Reporting.


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted ``values``."""
    if not values:
        return float("nan")
    rank = max(1, -(-len(values) * fraction // 1))
    return values[int(rank) - 1]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


@dataclass
class Rhythm:
    """An idle window, per scheduler: what a pass, a heartbeat, a look for requests and a
    sweep cost, and the rate at the scheduler's full rhythm (the most it sends idle,
    whatever the host's CPU)."""

    passes: float  # per second, measured
    beats: float  # per second, measured
    requests: float  # looks for run-now requests per second, measured
    sweeps: float  # sweeps' worth of work in the window: its sweep SELECTs / entries
    sweep_statements: float
    sweep_connections: float
    poll_interval: float

    @classmethod
    def of(cls, w: Window) -> Rhythm:
        per = w.schedulers * w.seconds
        # The clock is read once a pass, a heartbeat, a look for requests (idle: their
        # SELECT is the only statement on job_controls) and a sweep (before it deletes the
        # heartbeats of the schedulers gone for a week).
        requests = w.statements.get("controls", 0)
        passes = w.statements.get("clock", 0) - w.beats - requests - w.sweeps
        sweeps = w.statements.get("ledger reads", 0) / w.entries  # one SELECT an entry
        swept = w.total - passes - 2 * w.beats - 2 * requests  # none of the above
        nan = float("nan")
        return cls(
            passes=passes / per,
            beats=w.beats / per,
            requests=requests / per,
            sweeps=sweeps,
            sweep_statements=swept / sweeps if sweeps else nan,
            sweep_connections=w.connections / sweeps if sweeps else nan,
            poll_interval=w.poll_interval,
        )

    @property
    def full(self) -> float:
        return 1 / LOOP + 2 / BEAT + 2 / self.poll_interval + self.sweep_statements / SWEEP

    @property
    def full_connections(self) -> float:
        return self.sweep_connections / SWEEP


def fit(points: list[tuple[float, float]]) -> Callable[[float], float]:
    """The least-squares line through ``points`` (x, y)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return lambda x: my + slope * (x - mx)


def row(n: int, entries: int, label: str, statements: float, connections: float) -> None:
    """A computed row of the figures table."""
    print(
        f"| {n:,} | {entries} | {label} | - | {number(statements)} | {number(statements / n)} "
        f"| {number(connections)} | - | - | - | - | - | - |"
    )


def show(server: Server, windows: list[Window], fleets: list[int]) -> None:
    print(f"\n{server.version} (private server, port {server.port})\n")
    print(
        "| schedulers | entries | phase | window (s) | statements/s, fleet | per scheduler | "
        "connections opened/s, fleet | most open at once | due -> start p50 / p99 / max (s) "
        "| none alive | server CPU (s/s) | fleet CPU (s/s) | load |"
    )
    print(
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- |"
    )
    for w in windows:
        latency = "-"
        if w.latencies:
            p50, p99 = percentile(w.latencies, 0.5), percentile(w.latencies, 0.99)
            latency = f"{p50:.1f} / {p99:.1f} / {w.latencies[-1]:.1f}"
        print(
            f"| {w.schedulers} | {w.entries} | {w.phase} | {w.seconds:.0f} | "
            f"{number(w.per_second(w.total))} | {number(w.per_second(w.total, True))} | "
            f"{number(w.per_second(w.connections))} | {w.peak} | {latency} | "
            f"{w.none_alive:.0%} | {w.per_second(w.server_cpu):.2f} | "
            f"{w.per_second(w.fleet_cpu):.2f} | {w.load[0]:.1f}-{w.load[1]:.1f} |"
        )
    # Computed: idle, N times the full rhythm; busy, the line through the measured fleets
    # (statements/s against schedulers), or N times the per-scheduler rate of one.
    idle = [w for w in windows if w.phase == "idle" and Rhythm.of(w).sweeps]
    busy = [w for w in windows if w.phase == "busy"]
    sizes = sorted({w.schedulers for w in busy})
    for n in fleets:
        for w in idle:
            rhythm = Rhythm.of(w)
            row(n, w.entries, "idle, computed", n * rhythm.full, n * rhythm.full_connections)
        if len(sizes) > 1:
            statements = fit([(w.schedulers, w.per_second(w.total)) for w in busy])
            connections = fit([(w.schedulers, w.per_second(w.connections)) for w in busy])
            label = f"busy, computed (line through {', '.join(map(str, sizes))})"
            row(n, busy[0].entries, label, statements(n), connections(n))
        elif busy:
            w = busy[0]
            label = f"busy, computed ({w.schedulers} schedulers' rate each)"
            row(
                n,
                w.entries,
                label,
                n * w.per_second(w.total, True),
                n * w.per_second(w.connections, True),
            )
    kinds = [name for name, _ in KINDS] + [REFUSED]
    print("\nBy kind: idle, per scheduler and second; busy, per due slot (whole fleet).\n")
    print(f"| phase, schedulers | {' | '.join(kinds)} | total | connections opened |")
    print(f"| --- |{' ---: |' * (len(kinds) + 2)}")
    for w in windows:
        if w.phase == "idle":
            cells = [w.per_second(w.statements.get(k, 0), True) for k in kinds]
            cells += [w.per_second(w.total, True), w.per_second(w.connections, True)]
        else:
            cells = [w.statements.get(k, 0) / w.slots for k in kinds]
            cells += [w.total / w.slots, w.connections / w.slots]
        print(f"| {w.phase}, {w.schedulers} | {' | '.join(f'{c:.2f}' for c in cells)} |")
    for w in windows:
        below = sum(alive < w.schedulers for alive in w.alive) / max(1, len(w.alive))
        print(
            f"\n{w.phase}, {plural(w.schedulers, 'scheduler')}: alive (seen in the last 3 s, as "
            f"run_jobs --check counts them), sampled every 0.1 s: at least "
            f"{min(w.alive, default=0)}; fewer than {w.schedulers} in {below:.0%} of the "
            f"samples, none in {w.none_alive:.0%}."
        )
        if w.phase == "idle" and not Rhythm.of(w).sweeps:
            print("idle: no sweep in the window (make it longer): no full-rhythm figures.")
        elif w.phase == "idle":
            r = Rhythm.of(w)
            print(
                f"idle, per scheduler: {r.passes:.2f} passes/s (at most {1 / LOOP:g}), "
                f"{r.beats:.2f} heartbeats/s, {r.requests:.2f} looks for requests/s (2 "
                f"statements each); {r.sweeps:.1f} sweeps' worth in the window (the fleet's), "
                f"a sweep {r.sweep_statements:,.0f} statements and {r.sweep_connections:,.0f} "
                f"connections. At the full rhythm (a pass every {LOOP:g} s, a heartbeat every "
                f"{BEAT:g} s, requests every {r.poll_interval:g} s, a sweep every {SWEEP:g} "
                f"s): {r.full:.1f} statements/s and {r.full_connections:.1f} connections "
                f"opened/s per scheduler."
            )
        else:
            started = w.processes.get("started", 0)
            ended = {k: v for k, v in w.processes.items() if k != "started"}
            print(
                f"busy: {w.slots} slots due in the window; runs {len(w.latencies)}, missed "
                f"{w.missed}, rows by status {w.statuses}; job processes started "
                f"{started} ({started / w.slots:.2f} a slot), ended {ended}; statements the "
                f"server refused (an error): {w.refused} ({w.refused / w.slots:.2f} a slot)."
            )
        if w.lost:
            print(f"WARNING: the server's statistics lost {w.lost} statements in this window")


def verbose(windows: list[Window]) -> None:
    for w in windows:
        print(f"\n{w.phase}: statements by normalized text")
        for text, count in sorted(w.texts.items(), key=lambda item: -item[1]):
            print(f"  {count:8d}  {kind_of(text):18s} {' '.join(text.split())[:150]}")


def say(message: str) -> None:
    """Progress, on stderr (the figures go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=500, help="schedule entries (500)")
    parser.add_argument("--idle-schedulers", type=int, default=8, help="idle phase (8)")
    parser.add_argument("--idle-seconds", type=float, default=90, help="idle window (90)")
    parser.add_argument(
        "--busy-schedulers", default="4", help="busy phase: comma-separated, one run each (4)"
    )
    parser.add_argument("--busy-minutes", type=int, default=2, help="busy window (2)")
    parser.add_argument(
        "--poll-interval", type=float, help="run_jobs --poll-interval (its default: 1)"
    )
    parser.add_argument("--fleets", default="64,1000", help="computed rows (64,1000)")
    parser.add_argument("--only", default="postgresql,mysql", help="postgresql,mysql")
    parser.add_argument("--verbose", action="store_true", help="each statement's count")
    parser.add_argument("--keep", action="store_true", help="keep the servers' folders and logs")
    args = parser.parse_args()
    fleets = [int(n) for n in args.fleets.split(",") if n]
    busy = [int(n) for n in args.busy_schedulers.split(",") if n]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-bench-scale-"))
    folder.chmod(0o711)  # the servers' own users go through it to their folders
    (folder / "bench_scale_settings.py").write_text(SETTINGS)
    print(
        f"bench/scale.py, {library_revision()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f} at the start"
    )
    try:
        for vendor in args.only.split(","):
            server = SERVERS[vendor](folder / f"{vendor}-server")
            server.folder.mkdir()
            try:
                say(f"{vendor}: starting a private server")
                server.start()
                Fleet(server, folder / f"{vendor}-migrate", {}).manage("migrate", "-v0")
                say(f"{vendor}: idle, {args.idle_schedulers} schedulers")
                windows = [
                    idle_phase(
                        server,
                        folder,
                        args.idle_schedulers,
                        args.entries,
                        args.idle_seconds,
                        args.poll_interval,
                    )
                ]
                for schedulers in busy:
                    server.ledger("DELETE FROM job_runs")
                    server.ledger("DELETE FROM job_schedulers")
                    say(f"{vendor}: busy, {plural(schedulers, 'scheduler')}")
                    windows.append(
                        busy_phase(
                            server,
                            folder,
                            schedulers,
                            args.entries,
                            args.busy_minutes,
                            args.poll_interval,
                        )
                    )
            finally:
                server.stop()
            show(server, windows, fleets)
            if args.verbose:
                verbose(windows)
    finally:
        if args.keep:
            print(f"\nthe servers' folders and the fleets' output: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
