"""What the test commands do: announce, optionally misbehave, sleep, record that they ran."""

import os
import sys
import time
from pathlib import Path

from django.core.management.base import CommandError
from django.db import close_old_connections
from django.db import connection


def add_job_arguments(parser):
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--ran", help="File to append this process's pid to when it runs.")
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--close-connections", action="store_true")
    parser.add_argument("--until", help="Keep working until this file exists (at most 600 s).")
    parser.add_argument(
        "--query",
        type=float,
        default=0.0,
        help="After saying 'running', wait this long in a query on the default database.",
    )


def run_job(command, options):
    if options["close_connections"]:
        connection.ensure_connection()
        close_old_connections()
        connection.close()
    # After the connections are closed: a test that reads "running" can count on it.
    print(f"running {os.getpid()}", flush=True)
    if options["ran"]:
        with Path(options["ran"]).open("a") as ran:
            ran.write(f"{os.getpid()} {options['tenant']}\n")
    if options["query"]:
        sleep = "pg_sleep" if connection.vendor == "postgresql" else "SLEEP"
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {sleep}(%s)", [options["query"]])
    time.sleep(options["seconds"])
    # A guard against a test that never creates the file, not a timing: a holder that gives up
    # fails loudly instead of finishing as if it had been told to.
    deadline = time.monotonic() + 600
    while options["until"] and not Path(options["until"]).exists():
        if time.monotonic() > deadline:
            raise CommandError(f"--until: {options['until']} did not appear within 600 s")
        time.sleep(0.02)
    command.stdout.write("finished")
    sys.stdout.flush()
