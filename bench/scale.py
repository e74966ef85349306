"""A fleet of ``run_jobs`` schedulers at scale: what it costs the database, for two versions
of the library side by side.

    .venv/bin/python bench/scale.py [--code old=589e470,new=.] [--entries 500]
                                    [--idle-schedulers 1,4,8,16] [--idle-seconds 60]
                                    [--busy-schedulers 1,4,8,16] [--old-busy-schedulers N,...]
                                    [--busy-minutes 1] [--workers N]
                                    [--poll-interval SECONDS] [--fleets 64,1000]
                                    [--only postgresql,mysql] [--verbose] [--keep]

``--code LABEL=REV,...``: the versions measured, each fleet run from its own tree: ``.`` is
this checkout's working tree as it is; any other revision is extracted (``git archive``) into
the run's temporary folder, which is removed at the end, and its schedulers run its own
``manage.py`` with ``PYTHONPATH`` pointing there (checked: each version imports
``advisory_lock`` from its tree). The default compares the scheduler before issue 30's claims
and workers (``589e470``: a process forked per due slot, a connection per entry per sweep)
with the working tree. The versions share the servers and the machine; for each number of
schedulers their phases run one after the other, in alternating order.

Each database server is a private one, started for the run in a temporary folder on a free
127.0.0.1 port and removed at the end: PostgreSQL with ``pg_stat_statements`` loaded, MariaDB
with the performance schema on (the machine's servers have neither, and turning them on takes
a restart), every other setting at its default (``max_connections`` 100 and 151 too, unless
``--max-connections`` sets it). The server counts what the fleet costs it, in the fleet's
database only (``bench_scale``; the script's own look-ups go to another database, or happen
outside the windows):

- statements: ``pg_stat_statements.calls``, ``COUNT_STAR`` of
  ``performance_schema.events_statements_summary_by_digest``; every statement a client sends,
  those of Django's cursors and the library's driver-level lock calls alike, grouped by kind;
- connections opened: ``pg_stat_database.sessions``, the ``Connections`` status; the most
  open at once, sampled every 0.1 s;
- CPU seconds of the server's processes and of the fleet's (schedulers and job processes),
  from ``/proc``: these depend on the machine and its load (printed), the counts do not.
  Busy, also those of the boundary's burst, from the window's start to ``BURST`` s after the
  boundary, apart: the schedulers' own, their workers' (job processes'), the server's.

Two phases per server, version and number of schedulers, each on an emptied ledger, with real
``manage.py run_jobs`` processes:

- idle: ``--idle-schedulers`` schedulers on ``--entries`` entries that don't fall due
  (``cron: "0 0 1 1 *"``, ``catch_up: "none"``: no slot to look up, as for entries whose
  latest slot is done), for ``--idle-seconds`` from the moment every scheduler has finished
  its first sweep and the fleet has opened no connection for 3 s (PostgreSQL's listening
  connections are opened after the first pass); a sweep a minute: a 60 s window holds about
  one per scheduler (counted);
- busy: ``--busy-schedulers`` schedulers (``--old-busy-schedulers`` for the version labelled
  ``old``) on ``--entries`` entries due every minute (``cron: "* * * * *"``, a job that only
  writes down when its body started), for ``--busy-minutes`` whole minutes from 2 s before a
  minute boundary, once the runs of the start-up are over (no run started for 3 s, or 60 s
  after every entry has run once: a fleet that can't keep up is never quiet). Per slot: the
  window's statements and connections (the whole fleet's, the idle share included) over the
  slots run in it (their first attempt claimed in it): the slots due in it, for a fleet that
  keeps up; a fleet that falls behind runs earlier ones in it (counted apart). Due -> claim
  is a slot's first attempt's ``started_at`` (its row in the ledger, by the database's clock)
  less the slot's time; due -> body is the time the job's body wrote down (the same host's
  clock) less the slot's time, a slot's row and its body paired in order per entry. "runs
  started" are the scheduler's "started" lines for the window's slots (one per job process
  forked, before issue 30; one per run given to a worker after); "forked" counts the
  schedulers' child processes that were not there when the window began (the old code's job
  processes, the new one's replaced workers).

A phase whose schedulers say on stderr that they can't do their work (the database
unreachable, as a server out of connections makes it, a run that failed before it started, a
traceback) is reported as failed, with their lines, and the run goes on with the next phase.

The 1,000-scheduler plan (``--fleets``) is computed, not measured: idle, N times the highest
per-scheduler rate measured idle (a version whose passes each read the server's clock, as the
old one does, also at its full rhythm: a pass every 0.2 s, a heartbeat every second, a look
for run-now requests every poll interval, a sweep every minute, the most it sends whatever its
host's CPU); busy, the line through the measured fleets that kept up (statements/s against
schedulers), or N times the per-scheduler rate of one such fleet.
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
import time


def __getattr__(name: str) -> object:
    """The schedule's jobs, ``job_<entry>``: each appends its entry's name and the time its
    body started to $BENCH_SCALE_BODIES, in one write shorter than PIPE_BUF to a file opened
    with O_APPEND (the lines of concurrent jobs never mix)."""
    if not name.startswith("job_"):
        raise AttributeError(name)
    entry = name[len("job_") :]

    def job() -> None:
        line = f"{entry} {time.time():.6f}\\n".encode()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        fd = os.open(os.environ["BENCH_SCALE_BODIES"], flags, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    return job
'''
)
#: The versions compared when ``--code`` does not say: the scheduler before issue 30's claims
#: and workers, and the working tree.
CODE = "old=589e470,new=."
#: Seconds a start-up (Django, the first sweep, the first runs) may take before giving up.
STARTUP_TIMEOUT = 900
#: An idle window starts once the fleet has opened no connection for this many seconds.
QUIET = 3.0
#: The measured window starts this long before a minute boundary (busy phase).
BEFORE_BOUNDARY = 2.0
#: The CPU of the boundary's burst is counted up to this many seconds after it (busy).
BURST = 4.0
#: The old scheduler's documented rhythm: a look at the clock for due slots every 0.2 s while
#: idle, a heartbeat every second, a look for run-now requests every poll interval
#: (``--poll-interval``), a sweep for abandoned runs every minute.
LOOP, BEAT, SWEEP = 0.2, 1.0, 60.0
TICK = os.sysconf("SC_CLK_TCK")
#: Asked of each version, in its own tree: the files of the library's and the test
#: project's modules that its ``run_jobs`` imports (all must be the tree's: the checkout's
#: editable install would lend a module the tree lacks), and for how long a scheduler counts
#: as alive after its heartbeat (3 s before issue 30, 3 heartbeats after).
ASK = """
import sys
from pathlib import Path

import django

django.setup()
from django.core.management import load_command_class

load_command_class("advisory_lock", "run_jobs")
import advisory_lock

if (Path(advisory_lock.__file__).parent / "scheduling" / "liveness.py").exists():
    from advisory_lock.scheduling.liveness import live_within

    LIVE_WITHIN = live_within()
else:
    from advisory_lock.liveness import LIVE_WITHIN
print(LIVE_WITHIN.total_seconds())
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if name.split(".")[0] in ("advisory_lock", "testproject") and path:
        print(path)
"""

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
STARTED = re.compile(r"^run_jobs: (\S+) \[([^\]]+)\] started \(pid (\d+)\)", re.M)


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

    def __init__(self, folder: Path, max_connections: int | None = None) -> None:
        self.folder = folder
        #: The server's connection limit (None: its default, 100 and 151).
        self.max_connections = max_connections
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

    def sample(self, connection: Any, live_within: float) -> tuple[int, int]:
        """The fleet's connections open now, and its schedulers alive (seen in the last
        ``live_within`` seconds, as the code's ``run_jobs --check`` counts them)."""
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
        if self.max_connections is not None:
            settings["max_connections"] = self.max_connections
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

    def sample(self, connection: Any, live_within: float) -> tuple[int, int]:
        row = connection.execute(
            "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            " AND pid <> pg_backend_pid()), (SELECT count(*) FROM job_schedulers"
            " WHERE last_seen >= statement_timestamp() - make_interval(secs => %s::float8))"
            f" AS {MARK}",
            [DATABASE, live_within],
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
                 "--skip-name-resolve", "--performance-schema=ON",
                 *([] if self.max_connections is None
                   else [f"--max-connections={self.max_connections}"])],
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

    def sample(self, connection: Any, live_within: float) -> tuple[int, int]:
        rows = self._rows(
            connection,
            "SELECT (SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = %s), "
            f"(SELECT COUNT(*) FROM {DATABASE}.job_schedulers "
            "WHERE last_seen >= UTC_TIMESTAMP(6) - INTERVAL %s MICROSECOND)",
            (DATABASE, round(live_within * 1e6)),
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


# The versions.


@dataclass
class Code:
    """A version of the library that fleets run: its label, tree and revision."""

    label: str
    tree: Path
    revision: str
    #: Does its ``run_jobs`` take ``--workers``?
    workers_option: bool = False
    #: Seconds since its last heartbeat during which a scheduler counts as alive (its rule).
    live_within: float = 3.0


def git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


def codes_of(spec: str, folder: Path) -> list[Code]:
    """The versions of ``--code``: ``.`` the working tree, any other revision extracted with
    ``git archive`` into ``folder`` (read-only on the repository: no worktree, no index)."""
    codes = []
    for part in spec.split(","):
        label, _, revision = part.partition("=")
        if not label or not revision:
            raise SystemExit(f"--code: {part!r} is not LABEL=REVISION")
        if revision == ".":
            tree, described = ROOT, f"the working tree, {library_revision()}"
        else:
            commit = git("rev-parse", "--verify", f"{revision}^{{commit}}")
            tree = folder / f"code-{label}"
            tree.mkdir()
            archive = subprocess.Popen(
                ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                stdout=subprocess.PIPE,
            )
            subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
            assert archive.stdout is not None
            archive.stdout.close()
            if archive.wait():
                raise SystemExit(f"git archive {commit} failed")
            described = f"commit {commit[:7]} ({git('log', '-1', '--format=%s', commit)[:60]})"
        command = tree / "advisory_lock" / "management" / "commands" / "run_jobs.py"
        codes.append(
            Code(label, tree, described, workers_option="--workers" in command.read_text())
        )
    return codes


# The fleet.


class Fleet:
    """``run_jobs`` processes of one version on the private server, each in a session of its
    own."""

    def __init__(
        self, server: Server, code: Code, settings: Path, folder: Path, schedule: dict[str, Any]
    ) -> None:
        self.code = code
        self.folder = folder
        self.folder.mkdir()
        self.bodies = folder / "bodies"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench_scale_settings",
            "PYTHONPATH": f"{settings}{os.pathsep}{code.tree}",
            "DATABASE_URL": server.url(),
            "SCHEDULE": json.dumps(schedule),
            "PYTHONUNBUFFERED": "1",
            "BENCH_SCALE_BODIES": str(self.bodies),
        }

    def manage(self, *argv: str) -> None:
        subprocess.run(
            [sys.executable, str(self.code.tree / "manage.py"), *argv],
            cwd=self.code.tree,
            env=self.env,
            check=True,
        )

    def ask(self) -> None:
        """Check that the version imports its ``run_jobs`` from its own tree, and learn its
        liveness window."""
        answer = subprocess.run(
            [sys.executable, "-c", ASK],
            cwd=self.code.tree,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if answer.returncode:
            raise SystemExit(f"{self.code.label}: {answer.stderr}")
        lines = answer.stdout.split()
        self.code.live_within = float(lines[0])
        tree = self.code.tree.resolve()
        strays = [path for path in lines[1:] if not Path(path).resolve().is_relative_to(tree)]
        if strays:
            raise SystemExit(f"{self.code.label}: modules imported from outside {tree}: {strays}")

    def start(self, count: int, poll_interval: float | None, workers: int | None) -> None:
        options = [] if poll_interval is None else ["--poll-interval", f"{poll_interval:g}"]
        if workers is not None and self.code.workers_option:
            options += ["--workers", str(workers)]
        for number in range(count):
            with (
                open(self.folder / f"run_jobs.{number}.out", "wb") as out,
                open(self.folder / f"run_jobs.{number}.err", "wb") as err,
            ):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, str(self.code.tree / "manage.py"), "run_jobs", *options],
                        cwd=self.code.tree,
                        env=self.env,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def children(self) -> set[int]:
        """The schedulers' live child processes (job processes, workers)."""
        parents = {str(pid) for pid in self.pids()}
        found = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = _stat(int(name))
                if fields and fields[1] in parents:
                    found.add(int(name))
        return found

    def check_running(self) -> None:
        for number, process in enumerate(self.processes):
            if process.poll() is not None:
                raise SystemExit(
                    f"run_jobs {number} ({self.code.label}) exited with status "
                    f"{process.returncode}:\n{tail(self.folder / f'run_jobs.{number}.err')}"
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

    def errors(self) -> list[str]:
        """The schedulers' lines on stderr (warnings, errors, tracebacks)."""
        return [
            f"run_jobs {number}: {line}"
            for number in range(len(self.processes))
            for line in (self.folder / f"run_jobs.{number}.err")
            .read_text(errors="replace")
            .splitlines()
            if line.strip()
        ]

    def body_starts(self) -> dict[str, list[float]]:
        """Per entry, the times its job's bodies started (this host's clock), in order."""
        starts: dict[str, list[float]] = collections.defaultdict(list)
        with contextlib.suppress(FileNotFoundError):
            for line in self.bodies.read_text().splitlines():
                name, at = line.split()
                starts[name].append(float(at))
        for times in starts.values():
            times.sort()
        return starts


def schedule(entries: int, busy: bool) -> dict[str, Any]:
    if busy:
        return {
            f"busy-{i:04d}": {
                "callable": f"bench_scale_settings.job_busy-{i:04d}",
                "cron": "* * * * *",
            }
            for i in range(entries)
        }
    return {
        f"idle-{i:04d}": {
            "callable": f"bench_scale_settings.job_idle-{i:04d}",
            "cron": "0 0 1 1 *",
            "catch_up": "none",
        }
        for i in range(entries)
    }


# Measuring.


class Observer:
    """The script's view of the server: its statistics (on a connection outside the fleet's
    database), and, sampled every 0.1 s, the fleet's connections open and its schedulers
    alive (by the version's own liveness window)."""

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
        live = self.fleet.code.live_within
        with contextlib.closing(self.server.sampler()) as connection:
            while not self._done.wait(0.1):
                if self._sampling.is_set():
                    self.samples.append(self.server.sample(connection, live))

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
    """One measured window of one phase of one version."""

    code: str
    phase: str
    schedulers: int
    entries: int
    seconds: float
    statements: dict[str, int]  # by kind
    total: int
    connections: int
    peak: int
    alive: list[int]  # schedulers alive at each sample
    live_within: float
    server_cpu: float
    fleet_cpu: float
    load: tuple[float, float]
    lost: int
    refused: int  # statements the server refused (an error): in ``total``
    children: set[int]  # the schedulers' children when the window began
    beats: int = 0
    poll_interval: float = 1.0
    sweeps: int = 0
    slots: int = 0  # slots run in the window (their first attempt claimed in it)
    latencies: list[float] = field(default_factory=list)  # due -> claim
    bodies: list[float] = field(default_factory=list)  # due -> body
    unpaired: int = 0  # entries whose rows and bodies did not pair up
    due: int = 0  # slots due in the window
    earlier: int = 0  # slots run in the window that fell due before it
    missed: int = 0  # slots due in the window never claimed before the fleet stopped
    late: int = 0  # slots due in the window first claimed after it
    duplicates: int = 0  # slots with more than one success
    statuses: dict[str, int] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)
    runs_started: int = 0
    forks: int = 0
    errors: list[str] = field(default_factory=list)
    texts: dict[str, int] = field(default_factory=dict)
    # CPU seconds from the window's start to BURST s after the boundary (busy): the
    # schedulers' own, their workers' (or job processes'), the server's.
    burst: tuple[float, float, float] | None = None

    @property
    def none_alive(self) -> float:
        """The share of the samples in which no scheduler was alive."""
        return sum(alive == 0 for alive in self.alive) / max(1, len(self.alive))

    def per_second(self, value: float, per_scheduler: bool = False) -> float:
        return value / self.seconds / (self.schedulers if per_scheduler else 1)


def measure(
    observer: Observer,
    code: Code,
    phase: str,
    schedulers: int,
    entries: int,
    until: Callable[[], None],
) -> Window:
    """Snapshot, wait (``until``), snapshot: the window's deltas."""
    children = observer.fleet.children()
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
        code=code.label,
        phase=phase,
        schedulers=schedulers,
        entries=entries,
        seconds=after.at - before.at,
        statements=dict(kinds),
        total=sum(kinds.values()),
        connections=after.connections - before.connections,
        peak=max((open_ for open_, _ in observer.samples), default=0),
        alive=[alive for _, alive in observer.samples],
        live_within=code.live_within,
        server_cpu=after.server_cpu - before.server_cpu,
        fleet_cpu=after.fleet_cpu - before.fleet_cpu,
        load=(before.load, after.load),
        lost=observer.server.lost(observer.connection) - lost_before,
        refused=refused,
        children=children,
        beats=sum(count for text, count in texts.items() if BEATS.match(text)),
        sweeps=sum(count for text, count in texts.items() if SWEEPS.match(text)),
        texts=texts,
    )


class PhaseFailed(Exception):
    """A fleet that could not do its work, in its schedulers' words: the phase is reported
    as failed, with them, and the run goes on with the next one."""

    def __init__(self, fleet: Fleet, lines: list[str]) -> None:
        super().__init__("; ".join(lines[:3]))
        self.code = fleet.code.label
        self.lines = lines


#: A line of a scheduler's stderr that says it can't do its work: the database out of reach
#: (as the server refusing connections makes it), a run that failed, a traceback.
TROUBLE = re.compile(r"unreachable|Traceback|too many|failed before it started|\] failed")


def check_trouble(fleet: Fleet) -> None:
    fleet.check_running()
    trouble = [line for line in fleet.errors() if TROUBLE.search(line)]
    if trouble:
        raise PhaseFailed(fleet, trouble)


def wait_for(what: str, condition: Callable[[], bool], fleet: Fleet) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not condition():
        check_trouble(fleet)
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {STARTUP_TIMEOUT} s")
        time.sleep(0.5)


@dataclass
class Phase:
    """What a phase needs: the server, the version, where its files go, and the options."""

    server: Server
    code: Code
    folder: Path
    entries: int
    poll_interval: float | None
    workers: int | None

    def fleet(self, name: str, busy: bool) -> Fleet:
        folder = self.folder / f"{self.server.vendor}-{self.code.label}-{name}"
        return Fleet(self.server, self.code, self.folder, folder, schedule(self.entries, busy))


def idle_phase(phase: Phase, schedulers: int, seconds: float) -> Window:
    server, code = phase.server, phase.code
    fleet = phase.fleet(f"idle-{schedulers}", busy=False)
    observer = Observer(server, fleet)
    try:
        swept = observer.sweeps()
        fleet.start(schedulers, phase.poll_interval, phase.workers)
        # Every scheduler has polled once and finished its first sweep (it ends by deleting
        # the heartbeats of schedulers gone for a week: one DELETE a sweep).
        wait_for("the first sweeps", lambda: observer.sweeps() >= swept + schedulers, fleet)
        # Then the connections a scheduler opens after its first pass (PostgreSQL's listening
        # one, at its first wait): none opened for QUIET seconds.
        opened = [server.connections_opened(observer.connection), time.monotonic()]

        def settled() -> bool:
            count = server.connections_opened(observer.connection)
            if count != opened[0]:
                opened[:] = [count, time.monotonic()]
            return time.monotonic() - opened[1] >= QUIET

        wait_for("the connections of the start-up", settled, fleet)
        say(f"  measuring {seconds:g} s")
        window = measure(
            observer, code, "idle", schedulers, phase.entries, lambda: time.sleep(seconds)
        )
        window.poll_interval = phase.poll_interval or 1.0
        check_trouble(fleet)
    finally:
        observer.close()
        fleet.stop()
    window.errors = fleet.errors()
    return window


#: How long the start-up of a busy phase may go on running slots before the window starts
#: all the same (a fleet that can't keep up is never quiet): seconds after every entry has
#: run once.
QUIET_WITHIN = 60.0


def busy_phase(phase: Phase, schedulers: int, minutes: int) -> Window:
    server, code, entries = phase.server, phase.code, phase.entries
    fleet = phase.fleet(f"busy-{schedulers}", busy=True)
    observer = Observer(server, fleet)
    all_ran: list[float] = []  # time.monotonic() when every entry had run once
    try:
        swept = observer.sweeps()
        fleet.start(schedulers, phase.poll_interval, phase.workers)

        def started_up() -> bool:
            # The first sweeps are over, every entry has run once, and no run has started
            # for 3 s (or QUIET_WITHIN has passed since every entry ran once).
            if observer.sweeps() < swept + schedulers:
                return False
            try:
                done, running, latest = server.ledger(
                    "SELECT COUNT(DISTINCT CASE WHEN status = 'succeeded' THEN job_name END),"
                    " COUNT(CASE WHEN status = 'running' THEN 1 END), MAX(started_at)"
                    " FROM job_runs",
                )[0]
            except Exception:  # the server refused a connection: the fleet's stderr says why
                return False
            if done < entries:
                return False
            if not all_ran:
                all_ran.append(time.monotonic())
            if time.monotonic() - all_ran[0] > QUIET_WITHIN:
                return True
            return bool(running == 0 and (observer.now() - aware(latest)).total_seconds() > 3)

        wait_for("the runs of the start-up", started_up, fleet)
        now = observer.now()
        first = now.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
        if (first - now).total_seconds() < BEFORE_BOUNDARY + 1:
            first += datetime.timedelta(minutes=1)
        start = first - datetime.timedelta(seconds=BEFORE_BOUNDARY)
        end = start + datetime.timedelta(minutes=minutes)

        def sleep_until(moment: datetime.datetime) -> None:
            time.sleep(max(0.0, (moment - observer.now()).total_seconds()))

        def burst_cpu() -> tuple[float, float, float]:
            pids, parents = server.server_pids()
            own = fleet.pids()
            return cpu_seconds(own), cpu_seconds([], own), cpu_seconds(pids, parents)

        burst: list[float] = []

        def until_end() -> None:
            before = burst_cpu()
            sleep_until(first + datetime.timedelta(seconds=BURST))
            burst.extend(after - then for after, then in zip(burst_cpu(), before, strict=True))
            sleep_until(end)

        say(f"  measuring from {start:%H:%M:%S} to {end:%H:%M:%S} (UTC)")
        sleep_until(start)
        window = measure(observer, code, "busy", schedulers, entries, until_end)
        window.burst = (burst[0], burst[1], burst[2])
        window.poll_interval = phase.poll_interval or 1.0
        ended = fleet.children()
        check_trouble(fleet)
    finally:
        observer.close()
        fleet.stop()
    # How the slots went (after the fleet stopped: outside the window). The window's slots
    # are those whose first attempt was claimed in it: the slots due in it, for a fleet that
    # keeps up; for one that lags, earlier ones (counted apart) and not all of its own.
    due = {f"{first + datetime.timedelta(minutes=m):%Y-%m-%dT%H:%M}" for m in range(minutes)}
    rows = server.ledger("SELECT job_name, period, attempt, status, started_at FROM job_runs")
    statuses: dict[str, int] = collections.Counter()
    successes: dict[tuple[str, str], int] = collections.Counter()
    claims: dict[str, list[tuple[datetime.datetime, str]]] = collections.defaultdict(list)
    firsts: dict[tuple[str, str], datetime.datetime] = {}
    for job, period, attempt, status, started in rows:
        started = aware(started)
        claims[job].append((started, period))
        successes[job, period] += status == "succeeded"
        if attempt == 1:
            firsts[job, period] = started
    ran = {slot for slot, started in firsts.items() if start <= started <= end}
    for job, period, _, status, _ in rows:
        if (job, period) in ran:
            statuses[status] += 1
    window.latencies = sorted((firsts[slot] - slot_time(slot[1])).total_seconds() for slot in ran)
    # Each row of the ledger is one run of a job's body, which wrote down when it started:
    # per entry, the n-th row by its claim's time is the n-th body by its start.
    bodies = fleet.body_starts()
    for job, claimed in claims.items():
        times = bodies.get(job, [])
        if len(times) != len(claimed):
            window.unpaired += 1
            continue
        for (_, period), at in zip(sorted(claimed), times, strict=True):
            if (job, period) in ran:
                window.bodies.append(at - slot_time(period).timestamp())
    window.bodies.sort()
    window.slots = len(ran)
    window.due = entries * minutes
    window.earlier = sum(period not in due for _, period in ran)
    window.late = sum(period in due and started > end for (_, period), started in firsts.items())
    window.missed = window.due - sum(period in due for _, period in firsts)
    window.duplicates = sum(count > 1 for slot, count in successes.items() if slot in ran)
    window.statuses = dict(statuses)
    output = fleet.output()
    window.processes = dict(
        collections.Counter(
            what for job, slot, what in OUTPUT.findall(output) if (job, slot) in ran
        )
    )
    pids = {int(pid) for job, slot, pid in STARTED.findall(output) if (job, slot) in ran}
    window.runs_started = window.processes.get("started", 0)
    window.forks = len((pids | ended) - window.children)
    window.errors = fleet.errors()
    return window


def aware(moment: datetime.datetime) -> datetime.datetime:
    """A time from the ledger, in UTC (MariaDB's come naive, in UTC)."""
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def slot_time(period: str) -> datetime.datetime:
    """When a cron slot of the busy schedule fell due, from its name."""
    return datetime.datetime.strptime(period, "%Y-%m-%dT%H:%M").replace(
        tzinfo=datetime.timezone.utc
    )


# Reporting.


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted ``values``."""
    if not values:
        return float("nan")
    rank = max(1, -(-len(values) * fraction // 1))
    return values[int(rank) - 1]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 0.5):.2f} / {percentile(values, 0.99):.2f} / {values[-1]:.2f}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}" if value < 10 else f"{value:,.1f}"


@dataclass
class Rhythm:
    """An idle window of a version that reads the server's clock at each pass (the old
    scheduler), per scheduler: what a pass, a heartbeat, a look for requests and a sweep
    cost, and the rate at the scheduler's full rhythm (the most it sends idle, whatever the
    host's CPU)."""

    passes: float  # per second, measured
    beats: float  # per second, measured
    requests: float  # looks for run-now requests per second, measured
    sweeps: float  # sweeps' worth of work in the window: its sweep SELECTs / entries
    sweep_statements: float
    sweep_connections: float
    poll_interval: float

    @classmethod
    def of(cls, w: Window) -> Rhythm | None:
        """None for a version that doesn't read the clock at each pass, or a window with no
        sweep."""
        per = w.schedulers * w.seconds
        # The clock is read once a pass, a heartbeat, a look for requests (idle: their
        # SELECT is the only statement on job_controls) and a sweep (before it deletes the
        # heartbeats of the schedulers gone for a week).
        requests = w.statements.get("controls", 0)
        passes = w.statements.get("clock", 0) - w.beats - requests - w.sweeps
        sweeps = w.statements.get("ledger reads", 0) / w.entries  # one SELECT an entry
        if passes / per < 1 or sweeps < 0.5:
            return None
        swept = w.total - passes - 2 * w.beats - 2 * requests  # none of the above
        return cls(
            passes=passes / per,
            beats=w.beats / per,
            requests=requests / per,
            sweeps=sweeps,
            sweep_statements=swept / sweeps,
            sweep_connections=w.connections / sweeps,
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


def show(
    server: Server,
    codes: list[Code],
    windows: list[Window],
    failed: list[tuple[str, str, int, list[str]]],
    fleets: list[int],
) -> None:
    print(f"\n{server.version} (private server, port {server.port})\n")
    print(
        "| code | schedulers | phase | window (s) | statements/s, fleet | per scheduler | "
        "connections opened/s, fleet | most open at once | statements / due slot | "
        "connections / due slot | due -> claim p50 / p99 / max (s) | "
        "due -> body p50 / p99 / max (s) | runs started / slot | forked | none alive | "
        "server CPU (s/s) | fleet CPU (s/s) | burst CPU: schedulers / workers / server (s) | "
        "load |"
    )
    print(f"| --- | ---: | --- |{' ---: |' * 15} --- |")
    for w in windows:
        busy = w.phase == "busy" and w.slots > 0
        per_slot = (
            [number(w.total / w.slots), f"{w.connections / w.slots:.2f}"] if busy else ["-", "-"]
        )
        print(
            f"| {w.code} | {w.schedulers} | {w.phase} | {w.seconds:.0f} | "
            f"{number(w.per_second(w.total))} | {number(w.per_second(w.total, True))} | "
            f"{number(w.per_second(w.connections))} | {w.peak} | {' | '.join(per_slot)} | "
            f"{spread(w.latencies)} | {spread(w.bodies)} | "
            f"{f'{w.runs_started / w.slots:.2f}' if busy else '-'} | "
            f"{w.forks if busy else '-'} | {w.none_alive:.0%} | "
            f"{w.per_second(w.server_cpu):.2f} | {w.per_second(w.fleet_cpu):.2f} | "
            f"{' / '.join(f'{c:.2f}' for c in w.burst) if w.burst else '-'} | "
            f"{w.load[0]:.1f}-{w.load[1]:.1f} |"
        )
    for code, what, schedulers, lines in failed:
        print(f"| {code} | {schedulers} | {what} | failed: {lines[0][:200]} |")
    kinds = [name for name, _ in KINDS] + [REFUSED]
    print("\nBy kind: idle, per scheduler and second; busy, per due slot (whole fleet).\n")
    print(f"| code | phase, schedulers | {' | '.join(kinds)} | total | connections opened |")
    print(f"| --- | --- |{' ---: |' * (len(kinds) + 2)}")
    for w in windows:
        if w.phase == "idle":
            cells = [w.per_second(w.statements.get(k, 0), True) for k in kinds]
            cells += [w.per_second(w.total, True), w.per_second(w.connections, True)]
        elif w.slots:
            cells = [w.statements.get(k, 0) / w.slots for k in kinds]
            cells += [w.total / w.slots, w.connections / w.slots]
        else:
            continue
        print(
            f"| {w.code} | {w.phase}, {w.schedulers} | {' | '.join(f'{c:.2f}' for c in cells)} |"
        )
    print()
    for w in windows:
        below = sum(alive < w.schedulers for alive in w.alive) / max(1, len(w.alive))
        name = f"{w.code}, {w.phase}, {plural(w.schedulers, 'scheduler')}"
        print(
            f"- {name}: alive (seen in the last {w.live_within:g} s, as its run_jobs --check "
            f"counts them), sampled every 0.1 s: at least {min(w.alive, default=0)}; fewer "
            f"than {w.schedulers} in {below:.0%} of the samples, none in {w.none_alive:.0%}."
        )
        if w.phase == "idle":
            minute = w.sweeps / w.schedulers / w.seconds * 60
            print(
                f"  {w.sweeps} sweeps in the window ({minute:.2f} per scheduler and minute), "
                f"{w.beats} heartbeats."
            )
            rhythm = Rhythm.of(w)
            if rhythm:
                print(
                    f"  Per scheduler: {rhythm.passes:.2f} passes/s (at most {1 / LOOP:g}), "
                    f"{rhythm.beats:.2f} heartbeats/s, {rhythm.requests:.2f} looks for "
                    f"requests/s (2 statements each); a sweep {rhythm.sweep_statements:,.0f} "
                    f"statements and {rhythm.sweep_connections:,.0f} connections. At the full "
                    f"rhythm (a pass every {LOOP:g} s, a heartbeat every {BEAT:g} s, requests "
                    f"every {rhythm.poll_interval:g} s, a sweep every {SWEEP:g} s): "
                    f"{rhythm.full:.1f} statements/s and {rhythm.full_connections:.1f} "
                    f"connections opened/s per scheduler."
                )
        else:
            print(
                f"  {w.due} slots due in the window, {w.slots} run in it (first attempt "
                f"claimed in it), {w.earlier} of them due before it; of the window's own: "
                f"claimed after it {w.late}, never claimed {w.missed}. Of those run: rows by "
                f"status {w.statuses}, slots with more than one success {w.duplicates}, the "
                f"schedulers' lines {w.processes}; bodies paired with their rows for "
                f"{len(w.bodies)} ({w.unpaired} entries did not pair). Forked in the window: "
                f"{w.forks}; statements the server refused (an error): {w.refused}."
            )
        if w.errors:
            print(f"  stderr: {len(w.errors)} lines, the first: {w.errors[:3]}")
        if w.lost:
            print(f"  WARNING: the server's statistics lost {w.lost} statements in this window")
    for code, what, schedulers, lines in failed:
        print(
            f"- {code}, {what}, {plural(schedulers, 'scheduler')}: FAILED; the schedulers' "
            f"stderr, {len(lines)} such lines, the first: {lines[:3]}"
        )
    plan(codes, windows, fleets)


def plan(codes: list[Code], windows: list[Window], fleets: list[int]) -> None:
    """N schedulers, computed from the measured ones."""
    print(
        "\n| code | schedulers | phase | computed from | statements/s, fleet | per scheduler | "
        "connections opened/s, fleet | open at once | statements / due slot | "
        "connections / due slot |"
    )
    print(f"| --- | ---: | --- | --- |{' ---: |' * 6}")
    for code in codes:
        idle = [w for w in windows if w.code == code.label and w.phase == "idle"]
        # A fleet that fell behind (slots of its window run after it, or earlier ones in it)
        # sent what its CPU allowed, not what its slots cost: left out.
        busy = [
            w
            for w in windows
            if w.code == code.label
            and w.phase == "busy"
            and w.slots
            and not (w.earlier or w.late or w.missed)
        ]
        for n in fleets:
            if idle:
                w = max(idle, key=lambda w: w.per_second(w.total, True))
                rate = w.per_second(w.total, True)
                opened = max(x.per_second(x.connections, True) for x in idle)
                held = max(x.peak / x.schedulers for x in idle)
                print(
                    f"| {code.label} | {n:,} | idle | highest rate measured "
                    f"({plural(w.schedulers, 'scheduler')}) | {number(n * rate)} | "
                    f"{number(rate)} | {number(n * opened)} | {n * held:,.0f} | - | - |"
                )
                rhythms = [r for r in map(Rhythm.of, idle) if r]
                if rhythms:
                    r = max(rhythms, key=lambda r: r.full)
                    print(
                        f"| {code.label} | {n:,} | idle | full rhythm | {number(n * r.full)} | "
                        f"{number(r.full)} | {number(n * r.full_connections)} | - | - | - |"
                    )
            if not busy:
                continue
            slots = busy[0].due / busy[0].seconds  # due slots a second
            sizes = sorted({w.schedulers for w in busy})
            held = max(w.peak / w.schedulers for w in busy)
            if len(sizes) > 1:
                statements = fit([(w.schedulers, w.per_second(w.total)) for w in busy])(n)
                connections = fit([(w.schedulers, w.per_second(w.connections)) for w in busy])(n)
                source = f"line through {', '.join(map(str, sizes))}"
            else:
                w = busy[0]
                statements = n * w.per_second(w.total, True)
                connections = n * w.per_second(w.connections, True)
                source = f"N x the per-scheduler rate of {plural(w.schedulers, 'scheduler')}"
            print(
                f"| {code.label} | {n:,} | busy | {source} | {number(statements)} | "
                f"{number(statements / n)} | {number(connections)} | {n * held:,.0f} | "
                f"{number(statements / slots)} | {number(connections / slots)} |"
            )


def verbose(windows: list[Window]) -> None:
    for w in windows:
        print(f"\n{w.code}, {w.phase}, {w.schedulers}: statements by normalized text")
        for text, count in sorted(w.texts.items(), key=lambda item: -item[1]):
            print(f"  {count:8d}  {kind_of(text):18s} {' '.join(text.split())[:150]}")


def say(message: str) -> None:
    """Progress, on stderr (the figures go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def order(codes: list[Code], turn: int) -> list[Code]:
    """The versions in alternating order from one number of schedulers to the next."""
    return codes if turn % 2 == 0 else codes[::-1]


def clear(server: Server) -> None:
    """An empty ledger for the next phase (outside any window)."""
    for table in ("job_runs", "job_schedulers", "job_controls"):
        server.ledger(f"DELETE FROM {table}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--code", default=CODE, help=f"LABEL=REVISION,... ('.': the working tree) ({CODE})"
    )
    parser.add_argument("--entries", type=int, default=500, help="schedule entries (500)")
    parser.add_argument("--idle-schedulers", default="1,4,8,16", help="idle phase (1,4,8,16)")
    parser.add_argument("--idle-seconds", type=float, default=60, help="idle window (60)")
    parser.add_argument("--busy-schedulers", default="1,4,8,16", help="busy phase (1,4,8,16)")
    parser.add_argument(
        "--old-busy-schedulers", help="busy phase of the code labelled old (--busy-schedulers)"
    )
    parser.add_argument("--busy-minutes", type=int, default=1, help="busy window (1)")
    parser.add_argument(
        "--workers", type=int, help="run_jobs --workers, where it exists (its default: 4)"
    )
    parser.add_argument(
        "--poll-interval", type=float, help="run_jobs --poll-interval (its default: 1)"
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        help="the private servers' max_connections (their defaults: 100, 151)",
    )
    parser.add_argument("--fleets", default="64,1000", help="computed rows (64,1000)")
    parser.add_argument("--only", default="postgresql,mysql", help="postgresql,mysql")
    parser.add_argument("--verbose", action="store_true", help="each statement's count")
    parser.add_argument("--keep", action="store_true", help="keep the servers' folders and logs")
    args = parser.parse_args()
    fleets = counts(args.fleets)
    idle, busy = counts(args.idle_schedulers), counts(args.busy_schedulers)
    old_busy = busy if args.old_busy_schedulers is None else counts(args.old_busy_schedulers)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-bench-scale-"))
    folder.chmod(0o711)  # the servers' own users go through it to their folders
    (folder / "bench_scale_settings.py").write_text(SETTINGS)
    began = time.monotonic()
    try:
        codes = codes_of(args.code, folder)
        print(
            f"bench/scale.py, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the start; "
            + "; ".join(f"{code.label}: {code.revision}" for code in codes)
        )
        for vendor in args.only.split(","):
            server = SERVERS[vendor](folder / f"{vendor}-server", args.max_connections)
            server.folder.mkdir()
            windows: list[Window] = []
            failed: list[tuple[str, str, int, list[str]]] = []
            try:
                say(f"{vendor}: starting a private server")
                server.start()
                phases = {
                    code.label: Phase(
                        server, code, folder, args.entries, args.poll_interval, args.workers
                    )
                    for code in codes
                }
                for code in codes:
                    fleet = phases[code.label].fleet("migrate", busy=False)
                    if code is codes[0]:
                        fleet.manage("migrate", "-v0")
                    fleet.ask()
                runs: list[tuple[str, int, Code]] = []
                for turn, schedulers in enumerate(idle):
                    runs += [("idle", schedulers, code) for code in order(codes, turn)]
                for turn, schedulers in enumerate(busy):
                    runs += [
                        ("busy", schedulers, code)
                        for code in order(codes, turn)
                        if code.label != "old" or schedulers in old_busy
                    ]
                for what, schedulers, code in runs:
                    clear(server)
                    say(f"{vendor}: {code.label}, {what}, {plural(schedulers, 'scheduler')}")
                    try:
                        if what == "idle":
                            window = idle_phase(phases[code.label], schedulers, args.idle_seconds)
                        else:
                            window = busy_phase(phases[code.label], schedulers, args.busy_minutes)
                    except PhaseFailed as failure:
                        say(f"  failed: {failure}")
                        failed.append((code.label, what, schedulers, failure.lines))
                        continue
                    windows.append(window)
            finally:
                server.stop()
                show(server, codes, windows, failed, fleets)
                if args.verbose:
                    verbose(windows)
                sys.stdout.flush()
    finally:
        print(f"\nthe run took {(time.monotonic() - began) / 60:.1f} min")
        if args.keep:
            print(f"\nthe servers' folders, the versions' trees and the fleets' output: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
