"""Uncontended acquire + release throughput: this library against the raw drivers and peers.

    .venv/bin/python bench/locks.py [--pairs 3000] [--rounds 7] [--only postgresql|mysql]
                                    [--markdown] [--seed N]
    bench/run_pinned.sh [same options]      # client and servers pinned to CPU 0 (stable ratios)

Every variant runs ``--pairs`` acquire + release pairs per round. All variants (of both
databases) run interleaved, in a new random order each round, and the tables report medians
over the rounds (see shared/BENCHMARKING.md). "ratio" is the raw driver's time divided by
the variant's (raw = 1.00; 0.50 means half the raw throughput); "spread" is (slowest round -
fastest round) / median. The raw psycopg rows use psycopg's defaults (server-side binding,
statements prepared from their 5th run); Django's connections use client-side binding and
no prepared statements.

Two counts per pair, taken once outside the timed loops:
- "statements": what Django's ``CaptureQueriesContext`` sees (the library logs its
  driver-level statements there; Django logs BEGIN and COMMIT of ``atomic``); for the
  raw-driver rows, the executes the loop makes.
- "round trips": what goes over the wire, counted at the protocol level (PostgreSQL: libpq
  trace, one ``Query`` or ``Sync`` message per round trip; MariaDB: the session's
  ``Questions`` counter).
The library's statements are listed under each table as it logs them (with parameters
inlined; on PostgreSQL's fast path they are sent as ``$n`` parameters).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import library_revision  # noqa: E402
from servers import MY  # noqa: E402
from servers import MY_PARAMS  # noqa: E402
from servers import PG  # noqa: E402
from servers import PG_PARAMS  # noqa: E402
from servers import databases  # noqa: E402


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# Peers that are not installed are left out (and said so), not fatal.
HAS_PGLOCK = _installed("pglock")
HAS_DJANGO_MYSQL = _installed("django_mysql")

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES=databases(),
    INSTALLED_APPS=[
        "django.contrib.contenttypes",
        "advisory_lock",
        *(["pgactivity", "pglock"] if HAS_PGLOCK else []),
        *(["django_mysql"] if HAS_DJANGO_MYSQL else []),
    ],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from django.db import connections  # noqa: E402
from django.db import transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from advisory_lock import advisory_lock  # noqa: E402
from advisory_lock.holds import connection_locks  # noqa: E402


@dataclass
class Variant:
    label: str
    loop: Callable[[int], None]  # runs n acquire + release pairs
    raw_conn: Callable[[], Any]  # the driver connection whose round trips are counted
    own_statements: int | None = None  # raw-driver variants: the executes per pair
    show_sql: bool = False  # list the statements it logs under the table
    sql: list[str] = field(default_factory=list)
    statements: int | None = None
    round_trips: int | None = None
    times: list[float] = field(default_factory=list)  # µs per pair, one per round

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.median


# Keys: one per variant so that no variant can see another's hold.
K = 0x5EED_0000


def postgresql_variants() -> tuple[list[Variant], Any]:
    import psycopg

    raw = psycopg.connect(**PG_PARAMS, autocommit=True)  # server-side binding, prepares
    raw_cur = raw.cursor()
    conn = connections[PG]
    conn.ensure_connection()
    atomic = transaction.atomic

    def raw_try(n: int, k: int = K + 1) -> None:
        execute, fetchone = raw_cur.execute, raw_cur.fetchone
        for _ in range(n):
            execute("SELECT pg_try_advisory_lock(%s)", (k,))
            fetchone()
            execute("SELECT pg_advisory_unlock(%s)", (k,))
            fetchone()

    def raw_xact(n: int, k: int = K + 2) -> None:
        execute, fetchone = raw_cur.execute, raw_cur.fetchone
        for _ in range(n):
            execute("BEGIN")
            execute("SELECT pg_try_advisory_xact_lock(%s)", (k,))
            fetchone()
            execute("COMMIT")

    def raw_blocking(n: int, k: int = K + 13) -> None:
        execute, fetchone = raw_cur.execute, raw_cur.fetchone
        for _ in range(n):
            execute("SELECT pg_advisory_lock(%s)", (k,))
            fetchone()
            execute("SELECT pg_advisory_unlock(%s)", (k,))
            fetchone()

    # The C API loop: the library's own statements (guarded by the server pid and the client
    # mark it leaves on its session) through libpq, prepared once, on a connection of its
    # own; no library code.
    from advisory_lock.backends.postgresql import _prepared

    c_api = psycopg.connect(**PG_PARAMS, autocommit=True).pgconn
    pid = str(c_api.backend_pid).encode()
    client = b"bench-c-api"
    c_api.exec_(b"SELECT set_config('advisory_lock.client', 'bench-c-api', false)")
    try_name, try_sql, try_types = _prepared("pg_try_advisory_lock", False, True)
    unlock_name, unlock_sql, unlock_types = _prepared("pg_advisory_unlock", False, True)
    c_api.prepare(try_name, try_sql, try_types)
    c_api.prepare(unlock_name, unlock_sql, unlock_types)

    def c_api_try(n: int, k: int = K + 14) -> None:
        exec_prepared = c_api.exec_prepared
        values = [pid, client, str(k).encode()]
        for _ in range(n):
            exec_prepared(try_name, values).get_value(0, 0)
            exec_prepared(unlock_name, values).get_value(0, 0)

    def c_api_xact(n: int, k: int = K + 15) -> None:
        exec_ = c_api.exec_
        mine = "coalesce(current_setting('advisory_lock.client', true), 'bench-c-api')"
        begin_and_lock = (
            f"BEGIN; SELECT CASE WHEN {mine} = 'bench-c-api' "
            f"THEN pg_try_advisory_xact_lock({k}) END"
        ).encode()
        for _ in range(n):
            exec_(begin_and_lock).get_value(0, 0)
            exec_(b"COMMIT")

    # The layers between the C API loop and the library, on Django's connection: the same
    # prepared statements with Django's connection lookup ("bare"), then the library's
    # backend alone (its statements' logic, without the lock object and the hold).
    for _ in range(3):  # marks the session, learns its pid, prepares the statements
        with advisory_lock(K + 16, using=PG):
            pass
    backend = connection_locks(conn).backend
    bare_leading = [str(conn.connection.pgconn.backend_pid).encode(), backend._leading[-1]]

    def bare_lock(n: int, k: int = K + 16) -> None:
        values = [*bare_leading, str(k).encode()]
        for _ in range(n):
            pgconn = connections[PG].connection.pgconn
            if pgconn.exec_prepared(try_name, values).get_value(0, 0) != b"t":
                raise RuntimeError("the bare lock's try did not take the lock")
            pgconn.exec_prepared(unlock_name, values).get_value(0, 0)

    def backend_alone(n: int, k: int = K + 17) -> None:
        acquire, release = backend.acquire, backend.release
        for _ in range(n):
            acquire(k, shared=False, timeout=0, transaction=False)
            release(k, shared=False)

    def driver_cursor(n: int, k: int = K + 3) -> None:
        cursor = conn.connection.cursor()  # Django's psycopg connection: a ClientCursor
        execute, fetchone = cursor.execute, cursor.fetchone
        for _ in range(n):
            execute("SELECT pg_try_advisory_lock(%s::bigint)", (k,))
            fetchone()
            execute("SELECT pg_advisory_unlock(%s::bigint)", (k,))
            fetchone()

    def django_cursor(n: int, k: int = K + 4) -> None:
        for _ in range(n):
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_lock(%s)", (k,))
                cursor.fetchone()
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", (k,))
                cursor.fetchone()

    def library_try(n: int, k: int = K + 5) -> None:
        for _ in range(n):
            with advisory_lock(k, using=PG, wait=False):
                pass

    def library_blocking(n: int, k: int = K + 6) -> None:
        for _ in range(n):
            with advisory_lock(k, using=PG):
                pass

    def django_atomic_xact(n: int, k: int = K + 7) -> None:
        for _ in range(n):
            with atomic(using=PG), conn.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", (k,))
                cursor.fetchone()

    def library_atomic(n: int, k: int = K + 8) -> None:
        for _ in range(n):
            with atomic(using=PG), advisory_lock(k, using=PG):
                pass

    def django_conn() -> Any:
        conn.ensure_connection()
        return conn.connection

    variants = [
        Variant(
            "raw psycopg `pg_try_advisory_lock` + `pg_advisory_unlock` (autocommit)",
            raw_try,
            lambda: raw,
            own_statements=2,
        ),
        Variant(
            "raw psycopg: BEGIN, `pg_try_advisory_xact_lock`, COMMIT",
            raw_xact,
            lambda: raw,
            own_statements=3,
        ),
        Variant(
            "raw psycopg `pg_advisory_lock` + `pg_advisory_unlock` (blocking, autocommit)",
            raw_blocking,
            lambda: raw,
            own_statements=2,
        ),
        Variant(
            "C API loop: the library's two statements through libpq (`exec_prepared`)",
            c_api_try,
            lambda: SimpleNamespace(pgconn=c_api),
            own_statements=2,
        ),
        Variant(
            "C API loop: the library's `BEGIN; pg_try_advisory_xact_lock` + COMMIT (`exec_`)",
            c_api_xact,
            lambda: SimpleNamespace(pgconn=c_api),
            own_statements=2,
        ),
        Variant(
            "bare lock: the C API loop's statements on `connections[alias]`'s connection",
            bare_lock,
            django_conn,
            own_statements=2,
        ),
        Variant(
            "the library's backend alone: `backend.acquire()` + `backend.release()`",
            backend_alone,
            django_conn,
        ),
        Variant(
            "the same two on Django's driver connection, reused cursor (client-side binding)",
            driver_cursor,
            django_conn,
            own_statements=2,
        ),
        Variant("the same two statements through Django's cursor", django_cursor, django_conn),
        Variant(
            "advisory_lock(k, wait=False): session, try",
            library_try,
            django_conn,
            show_sql=True,
        ),
        Variant("advisory_lock(k): session, blocking", library_blocking, django_conn),
        Variant(
            "Django `atomic()` + `pg_advisory_xact_lock` via Django's cursor",
            django_atomic_xact,
            django_conn,
        ),
        Variant("`atomic()` + advisory_lock(k): xact lock", library_atomic, django_conn),
    ]
    if HAS_PGLOCK:
        import pglock

        def pglock_blocking(n: int, k: int = K + 9) -> None:
            for _ in range(n):
                with pglock.advisory(k, using=PG):
                    pass

        def pglock_try(n: int, k: int = K + 10) -> None:
            for _ in range(n):
                with pglock.advisory(k, using=PG, timeout=0):
                    pass

        variants += [
            Variant("django-pglock `advisory(k)`: blocking", pglock_blocking, django_conn),
            Variant("django-pglock `advisory(k, timeout=0)`: try", pglock_try, django_conn),
        ]
    return variants, raw


def mysql_variants() -> tuple[list[Variant], Any]:
    import MySQLdb

    raw = MySQLdb.connect(**MY_PARAMS, charset="utf8mb4", autocommit=True)
    raw_cur = raw.cursor()
    conn = connections[MY]
    conn.ensure_connection()
    prefix = f"{MY_PARAMS['database']}/bench-"

    def raw_try(n: int, name: str = prefix + "raw") -> None:
        execute, fetchone = raw_cur.execute, raw_cur.fetchone
        for _ in range(n):
            execute("SELECT GET_LOCK(%s, 0)", (name,))
            fetchone()
            execute("SELECT RELEASE_LOCK(%s)", (name,))
            fetchone()

    def raw_blocking(n: int, name: str = prefix + "raw-blocking") -> None:
        execute, fetchone = raw_cur.execute, raw_cur.fetchone
        for _ in range(n):
            execute("SELECT GET_LOCK(%s, 2147483647)", (name,))
            fetchone()
            execute("SELECT RELEASE_LOCK(%s)", (name,))
            fetchone()

    # The C API loop: the same statements through the documented query() / store_result().
    c_api = MySQLdb.connect(**MY_PARAMS, charset="utf8mb4", autocommit=True)

    def c_api_try(n: int, name: str = prefix + "c-api") -> None:
        query, store_result = c_api.query, c_api.store_result
        get_lock = f"SELECT GET_LOCK('{name}', 0)".encode()
        release_lock = f"SELECT RELEASE_LOCK('{name}')".encode()
        for _ in range(n):
            query(get_lock)
            store_result().fetch_row()
            query(release_lock)
            store_result().fetch_row()

    def bare_lock(n: int, name: str = prefix + "bare") -> None:
        get_lock = f"SELECT GET_LOCK('{name}', 0)".encode()
        release_lock = f"SELECT RELEASE_LOCK('{name}')".encode()
        for _ in range(n):
            driver = connections[MY].connection
            driver.query(get_lock)
            driver.store_result().fetch_row()
            driver.query(release_lock)
            driver.store_result().fetch_row()

    backend = connection_locks(conn).backend
    backend_key = f"{MY_PARAMS['database']}/bench-backend"

    def backend_alone(n: int, name: str = backend_key) -> None:
        acquire, release = backend.acquire, backend.release
        for _ in range(n):
            acquire(name, shared=False, timeout=0, transaction=False)
            release(name, shared=False)

    def django_cursor(n: int, name: str = prefix + "django") -> None:
        for _ in range(n):
            with conn.cursor() as cursor:
                cursor.execute("SELECT GET_LOCK(%s, 0)", (name,))
                cursor.fetchone()
            with conn.cursor() as cursor:
                cursor.execute("SELECT RELEASE_LOCK(%s)", (name,))
                cursor.fetchone()

    def library_try(n: int, k: int = K + 11) -> None:
        for _ in range(n):
            with advisory_lock(k, using=MY, wait=False):
                pass

    def library_blocking(n: int, k: int = K + 12) -> None:
        for _ in range(n):
            with advisory_lock(k, using=MY):
                pass

    def django_conn() -> Any:
        conn.ensure_connection()
        return conn.connection

    variants = [
        Variant(
            "raw MySQLdb `GET_LOCK(k, 0)` + `RELEASE_LOCK(k)`",
            raw_try,
            lambda: raw,
            own_statements=2,
        ),
        Variant(
            "raw MySQLdb `GET_LOCK(k, 2147483647)` + `RELEASE_LOCK(k)` (blocking)",
            raw_blocking,
            lambda: raw,
            own_statements=2,
        ),
        Variant(
            "C API loop: the same two through `query()` / `store_result()`",
            c_api_try,
            lambda: c_api,
            own_statements=2,
        ),
        Variant(
            "bare lock: the C API loop's statements on `connections[alias]`'s connection",
            bare_lock,
            django_conn,
            own_statements=2,
        ),
        Variant(
            "the library's backend alone: `backend.acquire()` + `backend.release()`",
            backend_alone,
            django_conn,
        ),
        Variant("the same through Django's cursor", django_cursor, django_conn),
        Variant(
            "advisory_lock(k, wait=False): session, try",
            library_try,
            django_conn,
            show_sql=True,
        ),
        Variant("advisory_lock(k): session, blocking", library_blocking, django_conn),
    ]
    if HAS_DJANGO_MYSQL:
        from django_mysql.locks import Lock

        def django_mysql_lock(n: int, name: str = "bench-django-mysql") -> None:
            for _ in range(n):
                with Lock(name, using=MY):
                    pass

        variants.append(
            Variant("django-mysql `Lock(k)` (acquire_timeout=10)", django_mysql_lock, django_conn)
        )
    return variants, raw


# Counting.


class PgWireCounter:
    """Counts round trips on a psycopg connection with libpq's protocol trace."""

    _MESSAGE = re.compile(r"^F\t\d+\t(Query|Sync)\b", re.MULTILINE)

    def __init__(self) -> None:
        handle, self.path = tempfile.mkstemp(prefix="bench-locks-", suffix=".trace")
        os.close(handle)
        # O_APPEND: libpq writes at the end whatever FILE* it opens on this descriptor.
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def count(self, conn: Any, run: Callable[[], None]) -> int | None:
        from psycopg import pq

        pgconn = conn.pgconn
        start = os.path.getsize(self.path)
        try:
            pgconn.trace(self.fd)
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        except Exception:  # a libpq or psycopg implementation without tracing
            return None
        try:
            run()
        finally:
            pgconn.untrace()
        with open(self.path, encoding="utf-8", errors="replace") as trace:
            trace.seek(start)
            return len(self._MESSAGE.findall(trace.read()))

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def mysql_wire_count(conn: Any, run: Callable[[], None]) -> int:
    """Round trips on a MySQLdb connection: the delta of the session's Questions counter."""

    def questions() -> int:
        cursor = conn.cursor()
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        value = int(cursor.fetchone()[1])
        cursor.close()
        return value

    calibration = -questions() + questions()  # what one SHOW STATUS itself adds
    before = questions()
    run()
    return questions() - before - calibration


def count_statements(alias: str, variants: list[Variant], wire: Callable[..., int | None]) -> None:
    for variant in variants:
        # The first pairs on a connection differ: the server pid is learnt, and statements
        # are prepared (this library's from their third run, psycopg's from their fifth).
        variant.loop(10)
        if variant.own_statements is not None:
            variant.statements = variant.own_statements
        else:
            with CaptureQueriesContext(connections[alias]) as captured:
                variant.loop(1)
            variant.statements = len(captured.captured_queries)
            if variant.show_sql:
                variant.sql = [query["sql"] for query in captured.captured_queries]
        variant.round_trips = wire(variant.raw_conn(), lambda v=variant: v.loop(1))


# Timing.


def measure(variants: list[Variant], pairs: int, rounds: int, seed: int) -> None:
    """Time every variant (of both databases) once per round, in a new random order."""
    rng = random.Random(seed)
    warm = list(variants)
    rng.shuffle(warm)
    for variant in warm:  # connections, psycopg's prepared statements, caches
        variant.loop(min(pairs, 500))
    for number in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for variant in order:
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter_ns()
                variant.loop(pairs)
                elapsed = time.perf_counter_ns() - start
            finally:
                gc.enable()
            variant.times.append(elapsed / 1000 / pairs)
        progress(f"round {number + 1}/{rounds} done")


def progress(message: str) -> None:
    if not QUIET:
        print(f"  … {message}", file=sys.stderr, flush=True)


def table(title: str, variants: list[Variant], pairs: int, rounds: int, notes: bool) -> str:
    raw = variants[0].median
    lines = [
        f"### {title}: medians of {rounds} rounds x {pairs} pairs",
        "",
        "| variant | µs per pair | pairs/s | ratio to raw | statements | round trips | spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant in variants:
        median = variant.median
        trips = "?" if variant.round_trips is None else str(variant.round_trips)
        lines.append(
            f"| {variant.label} | {median:.1f} | {1e6 / median:,.0f} | {raw / median:.2f} "
            f"| {variant.statements} | {trips} | {variant.spread:.0%} |"
        )
    if notes:
        lines.append("")
        lines.extend(
            f"- {variant.label}, statement {number} as logged: `{sql}`"
            for variant in variants
            for number, sql in enumerate(variant.sql, 1)
        )
    return "\n".join(lines)


#: The issue's targets: (what, the library's variant, the baseline's, the least ratio).
TARGETS = {
    "PostgreSQL": [
        (
            "try + release vs the raw cursor",
            "advisory_lock(k, wait=False)",
            "raw psycopg `pg_try",
            1.0,
        ),
        (
            "blocking acquire + release vs the raw cursor",
            "advisory_lock(k): session",
            "raw psycopg `pg_advisory_lock`",
            1.0,
        ),
        (
            "xact lock in atomic vs the raw cursor's BEGIN/lock/COMMIT",
            "`atomic()` + advisory_lock",
            "raw psycopg: BEGIN",
            1.0,
        ),
        (
            "try + release vs the C API loop",
            "advisory_lock(k, wait=False)",
            "C API loop: the library's two",
            0.75,
        ),
        (
            "blocking acquire + release vs the C API loop",
            "advisory_lock(k): session",
            "C API loop: the library's two",
            0.75,
        ),
        (
            "xact lock in atomic vs the C API loop",
            "`atomic()` + advisory_lock",
            "C API loop: the library's `BEGIN",
            0.75,
        ),
    ],
    "MariaDB": [
        (
            "try + release vs the raw cursor",
            "advisory_lock(k, wait=False)",
            "raw MySQLdb `GET_LOCK(k, 0)`",
            1.0,
        ),
        (
            "blocking acquire + release vs the raw cursor",
            "advisory_lock(k): session",
            "raw MySQLdb `GET_LOCK(k, 2147483647)`",
            1.0,
        ),
        ("try + release vs the C API loop", "advisory_lock(k, wait=False)", "C API loop", 0.75),
        (
            "blocking acquire + release vs the C API loop",
            "advisory_lock(k): session",
            "C API loop",
            0.75,
        ),
    ],
}


def targets(title: str, variants: list[Variant]) -> str:
    """The ratios the targets name: the baseline's time over the library's (1.0 = as fast)."""

    def find(prefix: str) -> Variant:
        return next(variant for variant in variants if variant.label.startswith(prefix))

    lines = ["", f"Targets ({title}): ratio = baseline's µs / library's µs", ""]
    for what, library, baseline, least in TARGETS[title]:
        ratio = find(baseline).median / find(library).median
        verdict = "met" if ratio >= least else "MISSED"
        lines.append(f"- {what}: {ratio:.2f} (target >= {least:.2f}: {verdict})")
    c_api = find("C API loop").median
    lines += ["", "The layers, each against the C API loop (its µs / theirs; no target):", ""]
    for label, prefix in (
        ("bare lock on Django's connection", "bare lock"),
        ("the library's backend alone", "the library's backend alone"),
        ("the library, try + release", "advisory_lock(k, wait=False)"),
    ):
        lines.append(f"- {label}: {c_api / find(prefix).median:.2f}")
    return "\n".join(lines)


# Checks and the header.


def check_released_pg(raw: Any) -> None:
    row = raw.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND ((classid::bigint << 32) | objid::bigint) >= %s "
        "AND ((classid::bigint << 32) | objid::bigint) < %s",
        (K, K + 100),
    ).fetchone()
    if row[0]:
        sys.exit(f"PostgreSQL: {row[0]} advisory locks of the benchmark are still held.")


def check_released_mysql(raw: Any) -> None:
    cursor = raw.cursor()
    names = [
        f"{MY_PARAMS['database']}/bench-raw",
        f"{MY_PARAMS['database']}/bench-bare",
        f"{MY_PARAMS['database']}/bench-backend",
        f"{MY_PARAMS['database']}/bench-django",
        f"{MY_PARAMS['database']}.bench-django-mysql",
        f"{MY_PARAMS['database']}/#{K + 11}",
        f"{MY_PARAMS['database']}/#{K + 12}",
    ]
    held = []
    for name in names:
        cursor.execute("SELECT IS_USED_LOCK(%s)", (name,))
        if cursor.fetchone()[0] is not None:
            held.append(name)
    cursor.close()
    if held:
        sys.exit(f"MariaDB: locks of the benchmark are still held: {held}")


def affinity(pid: int) -> str:
    try:
        cpus = sorted(os.sched_getaffinity(pid))
    except OSError:
        return "?"
    return ",".join(map(str, cpus))


def server_affinities() -> str:
    found: dict[str, set[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm in ("postgres", "mariadbd", "mysqld"):
            found.setdefault(comm, set()).add(affinity(int(entry.name)))
    return "; ".join(f"{name} on CPUs {' | '.join(sorted(cpus))}" for name, cpus in found.items())


def package(name: str) -> str:
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "not installed"


def header(pg_raw: Any, my_raw: Any) -> str:
    import psycopg

    client = os.sched_getaffinity(0)
    pinned = "pinned" if len(client) == 1 else "NOT pinned"
    pg_version = pg_raw.execute("SHOW server_version").fetchone()[0] if pg_raw else "-"
    if my_raw is not None:
        cursor = my_raw.cursor()
        cursor.execute("SELECT VERSION()")
        my_version = cursor.fetchone()[0]
        cursor.close()
    else:
        my_version = "-"
    return "\n".join(
        [
            "# advisory_lock: uncontended acquire + release",
            "",
            f"- {library_revision()}",
            f"- PostgreSQL {pg_version}; MariaDB {my_version}",
            f"- Django {django.get_version()}; psycopg {psycopg.__version__} "
            f"({psycopg.pq.__impl__}, libpq {psycopg.pq.version()}); "
            f"mysqlclient {package('mysqlclient')}; Python {platform.python_version()}",
            f"- peers: django-pglock {package('django-pglock')}; "
            f"django-mysql {package('django-mysql')}",
            f"- client: CPUs {affinity(0)} ({pinned}); servers: {server_affinities()}",
            f"- {os.cpu_count()} CPUs; gc disabled inside each timed batch",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3000, help="pairs per variant per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (medians are reported)")
    parser.add_argument("--only", choices=(PG, MY), help="benchmark one database only")
    parser.add_argument("--markdown", action="store_true", help="print only the tables")
    parser.add_argument("--seed", type=int, default=None, help="seed of the shuffles")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.rounds < 1:
        parser.error("--pairs and --rounds must be at least 1")
    return args


QUIET = False


def main(argv: list[str] | None = None) -> None:
    global QUIET
    args = parse_args(argv)
    QUIET = args.markdown
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    databases = [args.only] if args.only else [PG, MY]
    pg_variants: list[Variant] = []
    my_variants: list[Variant] = []
    pg_raw = my_raw = None
    if PG in databases:
        pg_variants, pg_raw = postgresql_variants()
        counter = PgWireCounter()
        try:
            count_statements(PG, pg_variants, counter.count)
        finally:
            counter.close()
    if MY in databases:
        my_variants, my_raw = mysql_variants()
        count_statements(MY, my_variants, mysql_wire_count)
    if not args.markdown:
        print(header(pg_raw, my_raw))
        print(f"- seed {seed}; {args.rounds} rounds x {args.pairs} pairs per variant\n")
        if not HAS_PGLOCK or not HAS_DJANGO_MYSQL:
            print("(peers missing: `.venv/bin/pip install -e '.[bench]'`)\n")
    measure(pg_variants + my_variants, args.pairs, args.rounds, seed)
    out: list[str] = []
    notes = not args.markdown
    if pg_variants:
        check_released_pg(pg_raw)
        out.append(table("PostgreSQL", pg_variants, args.pairs, args.rounds, notes))
        out.append(targets("PostgreSQL", pg_variants))
    if my_variants:
        check_released_mysql(my_raw)
        out.append(table("MariaDB", my_variants, args.pairs, args.rounds, notes))
        out.append(targets("MariaDB", my_variants))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
