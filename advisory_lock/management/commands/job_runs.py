"""``manage.py job_runs``: list recent runs, mark abandoned ones, prune old ones."""

from __future__ import annotations

import datetime
from typing import Any

from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS

from advisory_lock.models import JobRun
from advisory_lock.tables import format_table
from advisory_lock.validation import whole_number_argument

MAX_LIMIT = 2**31 - 1
MAX_DAYS = 36_500  # a century: the cutoff stays a valid date


class Command(BaseCommand):
    help = "List recent job runs from the job_runs ledger; mark abandoned runs; prune old ones."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--job", help="Only this job name.")
        parser.add_argument(
            "--status", choices=JobRun.Status.values, help="Only runs with this status."
        )
        parser.add_argument(
            "--limit", type=whole_number_argument(MAX_LIMIT), default=20, help="Rows (default 20)."
        )
        parser.add_argument(
            "--mark-abandoned",
            action="store_true",
            help=(
                "Mark running rows whose lock is free as abandoned (with --job and --period: "
                "only that slot's)."
            ),
        )
        parser.add_argument("--period", help="With --mark-abandoned: only this slot.")
        parser.add_argument(
            "--force",
            action="store_true",
            help=(
                "With --mark-abandoned --job NAME --period SLOT: mark that slot's running row "
                "abandoned whatever its lock says (when you know its owner is gone)."
            ),
        )
        parser.add_argument(
            "--prune", action="store_true", help="Delete finished runs (needs --older-than)."
        )
        parser.add_argument(
            "--older-than",
            type=whole_number_argument(MAX_DAYS),
            metavar="DAYS",
            help="With --prune: age in days.",
        )
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        runs = JobRun.objects.using(options["database"])
        if options["older_than"] is not None and not options["prune"]:
            raise CommandError("--older-than goes with --prune.")
        if options["prune"]:
            if options["older_than"] is None:
                raise CommandError("--prune needs --older-than DAYS.")
            cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
                days=options["older_than"]
            )
            finished = runs.exclude(status=JobRun.Status.RUNNING).filter(started_at__lt=cutoff)
            deleted, _ = finished.delete()
            self.stdout.write(
                f"Pruned {deleted} finished run(s) older than {options['older_than']} days."
            )
            return
        if (options["force"] or options["period"]) and not options["mark_abandoned"]:
            raise CommandError("--force and --period go with --mark-abandoned.")
        if options["mark_abandoned"]:
            if options["force"] and not (options["job"] and options["period"]):
                raise CommandError("--force needs --job NAME and --period SLOT: one slot.")
            marked = runs.mark_abandoned(
                job_name=options["job"], period=options["period"], force=options["force"]
            )
            self.stdout.write(f"Marked {marked} run(s) abandoned.")
            return
        if options["job"]:
            runs = runs.filter(job_name=options["job"])
        if options["status"]:
            runs = runs.filter(status=options["status"])
        rows = [
            (
                run.job_name,
                run.period,
                run.status,
                f"{run.started_at:%Y-%m-%d %H:%M:%S}",
                _duration(run.duration),
                run.host,
                str(run.pid or ""),
                str(run.attempt),
            )
            for run in runs.order_by("-started_at")[: options["limit"]]
        ]
        header = ("job", "period", "status", "started (UTC)", "duration", "host", "pid", "try")
        for line in format_table(header, rows):
            self.stdout.write(line)
        if not rows:
            self.stdout.write("(no runs)")


def _duration(duration: datetime.timedelta | None) -> str:
    return "" if duration is None else f"{duration.total_seconds():.1f}s"
