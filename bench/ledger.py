"""The ledger at scale: claim and the admin changelist with 1,000,000 rows in job_runs.

    .venv/bin/python bench/ledger.py [--rows 1000000] [--only postgresql|mysql|sqlite]
    .venv/bin/python bench/ledger.py --unique-index [--rows 1000000] [--rounds 7]
        [--claims 200] [--only postgresql|mysql]

Fills job_runs in a database of its own per server (``bench_ledger``; a temp file for SQLite),
then reports, as medians: a claim (a lock and a connection of its own, the clock read, one
INSERT), the claim's statements alone (the database clock's read and the INSERT; SQLite's
clock is this host's, read without a statement) and their count, and the admin changelist
filtered by status and job (page time and query count), with the plan of its list query.

``--unique-index``: what the one-success-per-slot index (``job_runs_one_success_per_slot``)
costs, on PostgreSQL and MariaDB. A second database per server (``bench_ledger_no_index``)
gets the same rows and the same migrations, then loses that index (its generated column
stays, so both run the same statements). Each round measures both, interleaved in a random
order: the claim's statements (median of ``--claims`` claims of new slots: the clock read
and the INSERT, whose NULL key the index stores too) and a bare claim with its finish (a
tenth as many: the lock's connection, the INSERT, the success UPDATE, which the index
checks). The table gives the medians over the rounds, their spread ((slowest round -
fastest round) / median), and the ratio with the index / without it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import django
from django.conf import settings

SQLITE = Path(tempfile.gettempdir()) / "advisory-lock-bench-ledger.sqlite3"
DATABASES = {
    "default": {},
    "postgresql": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "bench_ledger",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    },
    "mysql": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": "bench_ledger",
        "USER": "root",
        "HOST": "127.0.0.1",
        "PORT": "3306",
        "OPTIONS": {"charset": "utf8mb4"},
    },
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(SQLITE)},
}
# --unique-index: the same servers, a database without the index.
for _server in ("postgresql", "mysql"):
    DATABASES[f"{_server}_no_index"] = {**DATABASES[_server], "NAME": "bench_ledger_no_index"}
settings.configure(
    DEBUG=False,
    USE_TZ=True,
    SECRET_KEY="bench",
    ALLOWED_HOSTS=["testserver"],
    ROOT_URLCONF="testproject.urls",
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "advisory_lock",
        "testproject.example",
    ],
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    TEMPLATES=[
        {
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "APP_DIRS": True,
            "OPTIONS": {
                "context_processors": [
                    "django.template.context_processors.request",
                    "django.contrib.auth.context_processors.auth",
                    "django.contrib.messages.context_processors.messages",
                ]
            },
        }
    ],
    DATABASES=DATABASES,
)
django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from advisory_lock.keys import make_key  # noqa: E402
from advisory_lock.ledger import _claim  # noqa: E402
from advisory_lock.models import JobRun  # noqa: E402

# How each server fills job_runs fast: 50 jobs, 4 hosts, mostly succeeded runs a second apart.
COLUMNS = (
    "job_name, period, status, started_at, finished_at, duration, host, pid, attempt, error, "
    "lock_key"
)
FILL = {
    "postgresql": (
        f"INSERT INTO job_runs ({COLUMNS}) SELECT 'job-' || (i %% 50), 'p' || (i / 50), "
        "(ARRAY['succeeded','succeeded','succeeded','failed','abandoned'])[1 + i %% 5], "
        "now() - i * interval '1 second', now() - i * interval '1 second' + interval '3 s', "
        "interval '3 s', 'web-' || (i %% 4), i %% 30000, 1, '', '' "
        "FROM generate_series(1, %s) AS i"
    ),
    "mysql": (
        f"INSERT INTO job_runs ({COLUMNS}) SELECT CONCAT('job-', seq % 50), "
        "CONCAT('p', seq DIV 50), ELT(1 + seq % 5, 'succeeded', 'succeeded', 'succeeded', "
        "'failed', 'abandoned'), UTC_TIMESTAMP(6) - INTERVAL seq SECOND, "
        "UTC_TIMESTAMP(6) - INTERVAL seq SECOND + INTERVAL 3 SECOND, 3000000, "
        "CONCAT('web-', seq % 4), seq % 30000, 1, '', '' FROM seq_1_to_{rows}"
    ),
    "sqlite": (
        f"WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < %s) "
        f"INSERT INTO job_runs ({COLUMNS}) SELECT 'job-' || (i %% 50), 'p' || (i / 50), "
        "CASE i %% 5 WHEN 3 THEN 'failed' WHEN 4 THEN 'abandoned' ELSE 'succeeded' END, "
        "datetime('now', '-' || i || ' seconds'), datetime('now', '-' || i || ' seconds'), "
        "3000000, 'web-' || (i %% 4), i %% 30000, 1, '', '' FROM s"
    ),
}


def create_database(alias: str) -> None:
    if alias == "sqlite":
        return
    import MySQLdb
    import psycopg

    name = DATABASES[alias]["NAME"]  # a name of ours: no quoting needed
    if DATABASES[alias]["ENGINE"].endswith("postgresql"):
        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                c.execute(f"CREATE DATABASE {name}")
    else:
        c = MySQLdb.connect(host="127.0.0.1", user="root")
        cursor = c.cursor()
        cursor.execute(f"CREATE DATABASE IF NOT EXISTS {name} CHARACTER SET utf8mb4")
        c.close()


def has_time_zone_tables(alias: str) -> bool:
    """Django's date functions with USE_TZ (the admin's date hierarchy) need MySQL's time
    zone tables: ``mariadb-tzinfo-to-sql /usr/share/zoneinfo | mariadb -uroot mysql``."""
    if alias != "mysql":
        return True
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM mysql.time_zone_name")
        return cursor.fetchone()[0] > 0


def fill(alias: str, rows: int) -> None:
    have = JobRun.objects.using(alias).count()
    if have == rows:
        return
    JobRun.objects.using(alias).all().delete()
    started = time.monotonic()
    vendor = connections[alias].vendor
    with connections[alias].cursor() as cursor:
        if vendor == "mysql":
            cursor.execute(FILL[vendor].replace("{rows}", str(int(rows))))
            cursor.execute("ANALYZE TABLE job_runs")
        else:
            cursor.execute(FILL[vendor], [rows])
            cursor.execute("ANALYZE" if vendor == "sqlite" else "ANALYZE job_runs")
    print(f"  filled {rows:,} rows in {time.monotonic() - started:.1f}s")


def median_ms(func, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def measure(alias: str, rows: int) -> dict:
    create_database(alias)
    call_command("migrate", database=alias, verbosity=0)
    fill(alias, rows)
    runs = JobRun.objects.using(alias)
    runs.filter(job_name__startswith="bench-claim").delete()
    counter = iter(range(10**9))

    def claim_and_finish() -> None:
        run = runs.claim(f"bench-claim-{next(counter)}", period="once")
        runs.finish(run)

    claim_ms = median_ms(claim_and_finish, 21)
    # The claim's own statements, in this thread: the first is an INSERT; a taken slot's
    # INSERT conflicts (and the latest attempt is read).
    held = make_key("bench-insert")
    with CaptureQueriesContext(connections[alias]) as queries:
        _claim(alias, "bench-insert", "once", False, held)
    insert_ms = median_ms(lambda: _claim(alias, "bench-insert", "once", False, held), 21)
    runs.filter(job_name__startswith="bench-").delete()

    result = {"claim_ms": claim_ms, "insert_ms": insert_ms, "insert_statements": len(queries)}
    if not has_time_zone_tables(alias):
        print(f"  {alias}: no time zone tables on the server, so no admin page (see README)")
        return {**result, "page_ms": None, "plain_page_ms": None, "page_queries": None, "plan": ""}
    # The admin reads the "default" alias: point it at this database for the page.
    connections.settings["default"] = connections.settings[alias]
    connections["default"].close()
    del connections["default"]
    User.objects.filter(username="bench").delete()
    user = User.objects.create_superuser("bench", password="bench")
    client = Client()
    client.force_login(user)
    url = "/admin/advisory_lock/jobrun/"
    params = {"status": "failed", "job_name": "job-3"}
    client.get(url, params)  # warm up
    # Counted with an execute wrapper: a request resets Django's query log when it starts.
    page_queries: list[str] = []

    def count(execute, sql, params, many, context):
        page_queries.append(sql)
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(count):
        assert client.get(url, params).status_code == 200
    page_ms = median_ms(lambda: client.get(url, params), 11)
    plain_ms = median_ms(lambda: client.get(url), 11)
    listing = [sql for sql in page_queries if "LIMIT" in sql and "job_runs" in sql]
    plan = ""
    if listing and alias == "postgresql":
        with connections["default"].cursor() as cursor:
            cursor.execute("EXPLAIN " + listing[-1], ["failed", "job-3"])
            plan = " / ".join(row[0].strip() for row in cursor.fetchall()[:3])
    return {
        **result,
        "page_ms": page_ms,
        "plain_page_ms": plain_ms,
        "page_queries": len(page_queries),
        "plan": plan,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


# --unique-index

UNIQUE_INDEX = "job_runs_one_success_per_slot"


def without_the_index(alias: str) -> None:
    """Drop the one-success-per-slot index of ``alias``'s job_runs, if it has it."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        present = UNIQUE_INDEX in connection.introspection.get_constraints(cursor, "job_runs")
    if present:
        (constraint,) = [c for c in JobRun._meta.constraints if c.name == UNIQUE_INDEX]
        with connection.schema_editor() as editor:
            editor.remove_constraint(JobRun, constraint)


def has_the_index(alias: str) -> bool:
    connection = connections[alias]
    with connection.cursor() as cursor:
        return UNIQUE_INDEX in connection.introspection.get_constraints(cursor, "job_runs")


def spread(times: list[float]) -> float:
    return (max(times) - min(times)) / statistics.median(times)


def measure_unique_index(server: str, rows: int, rounds: int, claims: int) -> dict:
    """Round medians of the claim's statements and of a bare claim + finish, with the index
    (alias ``server``) and without it (``<server>_no_index``), interleaved."""
    variants = {"with": server, "without": f"{server}_no_index"}
    for alias in variants.values():
        create_database(alias)
        call_command("migrate", database=alias, verbosity=0)
        fill(alias, rows)
        JobRun.objects.using(alias).filter(job_name__startswith="bench-").delete()
    without_the_index(variants["without"])
    assert has_the_index(variants["with"]) and not has_the_index(variants["without"])
    counter = iter(range(10**9))
    held = make_key("bench-unique")
    statements: dict[str, list[float]] = {name: [] for name in variants}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    rng = random.Random(1)
    for number in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            alias = variants[name]
            ledger = JobRun.objects.using(alias)

            def claim_statements(alias: str = alias) -> None:
                _claim(alias, f"bench-unique-{next(counter)}", "once", False, held)

            def claim_and_finish(ledger: Any = ledger) -> None:
                ledger.finish(ledger.claim(f"bench-unique-{next(counter)}", period="once"))

            statements[name].append(median_ms(claim_statements, claims))
            runs[name].append(median_ms(claim_and_finish, max(claims // 10, 1)))
        print(f"  … {server}: round {number + 1}/{rounds}", file=sys.stderr, flush=True)
    for alias in variants.values():
        JobRun.objects.using(alias).filter(job_name__startswith="bench-").delete()
    return {"statements": statements, "runs": runs}


def main_unique_index(options: argparse.Namespace) -> None:
    servers = [options.only] if options.only else ["postgresql", "mysql"]
    if "sqlite" in servers:
        raise SystemExit("--unique-index measures PostgreSQL and MariaDB: --only postgresql|mysql")
    print(
        f"job_runs with {options.rows:,} rows, with and without the one-success-per-slot "
        f"index; medians of {options.rounds} rounds (spread)\n"
    )
    print(
        "| database | claim's statements, index (ms) | without (ms) | ratio "
        "| claim + finish, index (ms) | without (ms) | ratio |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for server in servers:
        result = measure_unique_index(server, options.rows, options.rounds, options.claims)
        cells = []
        for kind in ("statements", "runs"):
            with_index = statistics.median(result[kind]["with"])
            without = statistics.median(result[kind]["without"])
            cells += [
                f"{with_index:.2f} ({spread(result[kind]['with']):.0%})",
                f"{without:.2f} ({spread(result[kind]['without']):.0%})",
                f"{with_index / without:.3f}",
            ]
        print(f"| {server} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--only", choices=["postgresql", "mysql", "sqlite"])
    parser.add_argument(
        "--unique-index",
        action="store_true",
        help="the claim with the one-success-per-slot index against without it",
    )
    parser.add_argument("--rounds", type=int, default=7, help="--unique-index: rounds")
    parser.add_argument(
        "--claims", type=int, default=200, help="--unique-index: claims per round and variant"
    )
    options = parser.parse_args()
    if options.unique_index:
        main_unique_index(options)
        return
    aliases = [options.only] if options.only else ["postgresql", "mysql", "sqlite"]
    print(f"job_runs with {options.rows:,} rows; medians\n")
    print(
        "| database | claim (ms) | its statements (ms) | statements (clock + INSERT) "
        "| changelist, status + job filter (ms) | queries | changelist, unfiltered (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    plans = []
    for alias in aliases:
        result = measure(alias, options.rows)
        print(
            f"| {alias} | {result['claim_ms']:.1f} | {result['insert_ms']:.2f} | "
            f"{result['insert_statements']} | {_ms(result['page_ms'])} | "
            f"{result['page_queries'] or '-'} | {_ms(result['plain_page_ms'])} |"
        )
        if result["plan"]:
            plans.append(f"{alias}: {result['plan']}")
    for plan in plans:
        print(f"\nplan of the filtered list query, {plan}")


if __name__ == "__main__":
    main()
