"""``manage.py run_jobs``: the scheduler of ADVISORY_LOCK["SCHEDULE"], safe on every instance."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS

from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.ledger import table_checked
from advisory_lock.schedule import entries
from advisory_lock.scheduler import Scheduler
from advisory_lock.scheduler import is_outage
from advisory_lock.tables import format_table
from advisory_lock.validation import database_option
from advisory_lock.validation import seconds_argument


class Command(BaseCommand):
    help = (
        "Run the jobs of ADVISORY_LOCK['SCHEDULE'] when they fall due. Run it on every "
        "instance: the ledger runs each slot at most once fleet-wide."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="Run what is due now, wait for it, and exit (status 1 if a run failed).",
        )
        parser.add_argument(
            "--list", action="store_true", help="Show each entry's next run and last run."
        )
        parser.add_argument("--json", action="store_true", help="With --list: print JSON.")
        parser.add_argument(
            "--stop-grace",
            type=seconds_argument,
            default=30,
            metavar="SECONDS",
            help="On SIGTERM, let running jobs finish for this long, then stop them (30).",
        )
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="The ledger's alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        options["database"] = database_option("--database", options["database"])
        if options["json"] and not options["list"]:
            raise CommandError("--json goes with --list.")
        try:
            schedule = entries()
        except ValueError as error:
            raise CommandError(f"{error} (manage.py check lists every problem).") from error
        scheduler = Scheduler(
            schedule,
            using=options["database"],
            stop_grace=options["stop_grace"],
            say=self.stdout.write,
        )
        try:
            with table_checked(options["database"]):
                self.run(scheduler, options)
        except LedgerNotMigrated as error:
            raise CommandError(str(error)) from error

    def run(self, scheduler: Scheduler, options: dict[str, Any]) -> None:
        """Run the scheduler as the options ask: for ever, once, or list."""
        if not (options["list"] or options["once"]):
            if not scheduler.entries:
                self.stderr.write("run_jobs: ADVISORY_LOCK['SCHEDULE'] is empty: nothing to run.")
            scheduler.run_forever()  # rides out database outages
            return
        # --list and --once end with the database out of reach: an error, no traceback (the
        # next --once, from cron or a CronJob, is the retry).
        try:
            if options["list"]:
                self.list(scheduler, as_json=options["json"])
            elif scheduler.run_once():
                raise CommandError("a scheduled run failed", returncode=1)
        except Exception as error:
            if not is_outage(error):
                raise
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise CommandError(
                f"the database {options['database']!r} is unreachable "
                f"({type(error).__name__}: {first_line})"
            ) from error

    def list(self, scheduler: Scheduler, *, as_json: bool) -> None:
        rows = scheduler.listing()
        if as_json:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        header = ("entry", "schedule", "next run", "last slot", "last status", "last started")
        table = [
            (
                row["name"],
                row["schedule"],
                row["next_run"],
                row["last_slot"],
                row["last_status"],
                row["last_started"],
            )
            for row in rows
        ]
        for line in format_table(header, table):
            self.stdout.write(line)
