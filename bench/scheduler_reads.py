"""A scheduler's reads at every batch of due slots and every look for requests, against the
same statements sent by the raw driver.

    .venv/bin/python bench/scheduler_reads.py [--calls 200] [--only postgresql|mysql]

In a database of its own per server (``bench_scheduler_reads``, on the machine's servers),
a ledger of 500 entries with 20 slots each (a failed first attempt for one slot in ten) and a
pause and resume for one entry in fifty. Each read is made ``--calls`` times by the library
(``advisory_lock.ledger.deciding_attempts``, ``advisory_lock.scheduling.control.pauses_of``
and ``pending_requests``), then the statement it sent (as the server received it) as many
times from the driver's own cursor, its rows fetched (as text: the driver has no parameter
to adapt). For each: client CPU per call (``time.process_time``), in ms, and the ratio
library / raw. The server's CPU is not in it.

Older code runs too: from a ``git worktree`` of it, with ``PYTHONPATH`` set to the worktree
(else the checkout's package is imported); its ``pending_requests`` is given the 500 names it
took then.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import time
from collections.abc import Callable
from typing import Any

from servers import MY
from servers import PG
from servers import create_database
from servers import databases

DATABASE = "bench_scheduler_reads"
ENTRIES = 500
SLOTS = 20


def configure(servers: list[str]) -> None:
    import django
    from django.conf import settings

    aliases = {alias: {**entry, "NAME": DATABASE} for alias, entry in databases().items()}
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        SECRET_KEY="bench",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
        DATABASES={"default": aliases[servers[0]], **{s: aliases[s] for s in servers}},
        ADVISORY_LOCK={"NAMESPACE": "bench"},
    )
    django.setup()


def fill(using: str, now: datetime.datetime) -> list[str]:
    """The ledger and the controls; the names of the entries."""
    from advisory_lock.models import JobControl
    from advisory_lock.models import JobRun

    names = [f"entry-{number:03d}" for number in range(ENTRIES)]
    runs = []
    for name in names:
        for slot in range(SLOTS):
            started = now - datetime.timedelta(minutes=SLOTS - slot)
            common = {"job_name": name, "period": f"slot-{slot}", "started_at": started}
            if slot % 10 == 3:
                runs.append(JobRun(**common, attempt=1, status=JobRun.Status.FAILED))
                common["attempt"] = 2
            runs.append(JobRun(**common, status=JobRun.Status.SUCCEEDED))
    JobRun.objects.using(using).bulk_create(runs, batch_size=1000)
    switches = []
    for name in names[::50]:
        for minutes, action in ((-30, JobControl.Action.PAUSE), (-10, JobControl.Action.RESUME)):
            at = now + datetime.timedelta(minutes=minutes)
            switches.append(JobControl(job_name=name, action=action, requested_at=at))
    JobControl.objects.using(using).bulk_create(switches)
    return names


def cpu_per_call(calls: int, read: Callable[[], Any]) -> float:
    read()
    start = time.process_time()
    for _ in range(calls):
        read()
    return (time.process_time() - start) / calls * 1000


def measure(using: str, calls: int) -> list[tuple[str, float, float]]:
    from django.core.management import call_command
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    from advisory_lock.ledger import deciding_attempts
    from advisory_lock.scheduling.control import pauses_of
    from advisory_lock.scheduling.control import pending_requests

    call_command("migrate", database=using, verbosity=0)
    now = datetime.datetime.now(datetime.timezone.utc)
    names = fill(using, now)
    since = now - datetime.timedelta(minutes=20)
    reads: dict[str, Callable[[], Any]] = {
        "deciding_attempts, 440 slots": lambda: deciding_attempts(
            using, {name: "slot-13" for name in names[:440]}
        ),
        "deciding_attempts, 32 slots": lambda: deciding_attempts(
            using, {name: "slot-13" for name in names[:32]}
        ),
        "pauses_of, 32 entries": lambda: pauses_of(using, names[:32], since),
        "pauses_of, 440 entries": lambda: pauses_of(using, names[:440], since),
        "pending_requests": lambda: pending_requests(using, now, since),
    }
    if "job_names" in inspect.signature(pending_requests).parameters:  # before 1c3e89d
        reads["pending_requests"] = lambda: pending_requests(using, names, now, since)
    connection = connections[using]
    rows = []
    for label, read in reads.items():
        with CaptureQueriesContext(connection) as sent:
            read()
        (statement,) = sent.captured_queries
        library = cpu_per_call(calls, read)
        driver = connection.connection  # the driver's own connection, under Django's

        def raw(sql: str = statement["sql"], driver: Any = driver) -> None:
            cursor = driver.cursor()
            cursor.execute(sql)
            cursor.fetchall()
            cursor.close()

        rows.append((label, library, cpu_per_call(calls, raw)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls of each read (200)")
    parser.add_argument("--only", default=f"{PG},{MY}", help="postgresql,mysql")
    args = parser.parse_args()
    servers = args.only.split(",")
    for server in servers:
        create_database(server, DATABASE)
    configure(servers)
    print("| database | read | library (ms CPU) | raw driver (ms CPU) | library / raw |")
    print("| --- | --- | ---: | ---: | ---: |")
    for server in servers:
        title = "PostgreSQL" if server == PG else "MariaDB"
        for label, library, raw in measure(server, args.calls):
            print(f"| {title} | {label} | {library:.2f} | {raw:.2f} | {library / raw:.1f} |")


if __name__ == "__main__":
    main()
