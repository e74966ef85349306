"""``manage.py job_runs``: list recent runs, a scheduled entry's slot timeline, mark abandoned
runs, prune old ones, report overdue jobs."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS

from advisory_lock import signals
from advisory_lock.datetimes import from_field
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.ledger import first_line
from advisory_lock.models import JobRun
from advisory_lock.own_connection import table_checked
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.periods import MAX_PERIOD_LENGTH
from advisory_lock.scheduling.alerts import alert_no_scheduler_alive
from advisory_lock.scheduling.overdue import overdue_jobs
from advisory_lock.scheduling.pruning import prune
from advisory_lock.scheduling.stored import TABLE
from advisory_lock.scheduling.stored import all_entries
from advisory_lock.scheduling.timeline import MAX_SLOTS
from advisory_lock.scheduling.timeline import parse_since
from advisory_lock.scheduling.timeline import timeline
from advisory_lock.tables import format_table
from advisory_lock.validation import database_option
from advisory_lock.validation import text_option
from advisory_lock.validation import whole_number_argument

MAX_LIMIT = 2**31 - 1
MAX_DAYS = 36_500  # a century: the cutoff stays a valid date
#: The characters of an error's first line that the table shows (--json shows it all).
ERROR_WIDTH = 60


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
            "--prune",
            action="store_true",
            help=(
                "Delete old finished runs (needs --older-than), except those the ledger still "
                "needs: the first and latest attempts of slots that can still be claimed, each "
                "job's latest success, the successes the overdue report checks."
            ),
        )
        parser.add_argument(
            "--older-than",
            type=whole_number_argument(MAX_DAYS),
            metavar="DAYS",
            help="With --prune: age in days, by the database server's clock.",
        )
        parser.add_argument(
            "--overdue",
            action="store_true",
            help=(
                "List the declared jobs whose latest ended slot has no successful run (after "
                "its grace), and the scheduled entries whose last alert_after slots that ran "
                "all failed; exit status 1 if any, 0 if none."
            ),
        )
        parser.add_argument(
            "--timeline",
            metavar="ENTRY",
            help=(
                "Every slot of this ADVISORY_LOCK['SCHEDULE'] entry since --since, newest first, "
                "with its outcome, attempts, host, start and duration (at most "
                f"{MAX_SLOTS}, the latest). A slot that fell due before a scheduler first "
                "loaded the entry is left out unless it ran."
            ),
        )
        parser.add_argument(
            "--since",
            metavar="ISO",
            help=(
                "With --timeline: from this date or time, ISO 8601 (without an offset: in the "
                "ledger's time zone). Default: 7 days ago."
            ),
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="Print JSON: the runs listed, the overdue jobs, or the timeline's slots.",
        )
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        options["database"] = database_option("--database", options["database"])
        try:
            with table_checked(options["database"]):
                self.ledger(options)
        except LedgerNotMigrated as error:
            raise CommandError(str(error)) from error

    def ledger(self, options: dict[str, Any]) -> None:
        """What the options ask of the ledger."""
        text_option("--job", options["job"], max_length=MAX_JOB_NAME_LENGTH)
        text_option("--period", options["period"], max_length=MAX_PERIOD_LENGTH)
        runs = JobRun.objects.using(options["database"])
        if options["json"] and (options["prune"] or options["mark_abandoned"]):
            raise CommandError("--json goes with the list of runs, --overdue or --timeline.")
        if options["older_than"] is not None and not options["prune"]:
            raise CommandError("--older-than goes with --prune.")
        if options["prune"]:
            if options["older_than"] is None:
                raise CommandError("--prune needs --older-than DAYS.")
            days = options["older_than"]
            pruned = prune(options["database"], datetime.timedelta(days=days))
            self.stdout.write(pruned.describe(days))
            return
        if options["since"] is not None and not options["timeline"]:
            raise CommandError("--since goes with --timeline.")
        if options["timeline"] is not None:
            return self.timeline(options)
        if options["overdue"]:
            return self.overdue(options["database"], as_json=options["json"])
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
        listed = list(runs.order_by("-started_at", "-pk")[: options["limit"]])
        if options["json"]:
            self.stdout.write(json.dumps([_as_dict(run) for run in listed], indent=2))
            return
        rows = [
            (
                run.job_name,
                run.period,
                run.status,
                f"{from_field(run.started_at):%Y-%m-%d %H:%M:%S}",
                _duration(run.duration),
                run.host,
                str(run.pid or ""),
                str(run.attempt),
                _truncated(first_line(run.error), ERROR_WIDTH),
            )
            for run in listed
        ]
        header = (
            "job", "period", "status", "started (UTC)", "duration", "host", "pid", "try", "error"
        )  # fmt: skip
        for line in format_table(header, rows):
            self.stdout.write(line)
        if not rows:
            self.stdout.write("(no runs)")

    def timeline(self, options: dict[str, Any]) -> None:
        """Each slot of a scheduled entry since --since, and how it went."""
        name = options["timeline"]
        text_option("--timeline", name, max_length=MAX_JOB_NAME_LENGTH)
        try:
            entry = all_entries(options["database"]).get(name)
        except ValueError as error:
            raise CommandError(f"{error} (manage.py check lists every problem).") from error
        if entry is None:
            raise CommandError(
                f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}, nor has {TABLE}."
            )
        since = None
        if options["since"] is not None:
            try:
                since = parse_since(options["since"])
            except ValueError as error:
                raise CommandError(f"--since: {error}") from error
        slots = timeline(entry, options["database"], since)[::-1]  # newest first
        if options["json"]:
            self.stdout.write(json.dumps([slot.as_dict() for slot in slots], indent=2))
            return
        header = ("slot", "outcome", "attempts", "started (UTC)", "duration", "host")
        rows = [
            (
                slot.slot,
                slot.outcome,
                str(slot.attempts),
                f"{slot.started:%Y-%m-%d %H:%M:%S}" if slot.started else "",
                "" if slot.duration is None else f"{slot.duration:.1f}s",
                slot.host,
            )
            for slot in slots
        ]
        for line in format_table(header, rows):
            self.stdout.write(line)
        if not rows:
            self.stdout.write("(no slot in that span)")

    def overdue(self, using: str, *, as_json: bool) -> None:
        """Report the overdue jobs; exit with status 1 when there is any (for monitors)."""
        overdue = overdue_jobs(using)
        for reason in sorted({job.reason for job in overdue if job.reason}):
            alert_no_scheduler_alive(using, reason)  # the only reason the report gives
        for job in overdue:
            signals.job_overdue.send_robust(
                sender=type(self),
                job_name=job.job_name,
                period=job.period,
                missing_slot=job.missing_slot,
                slot_ended_at=job.slot_ended_at,
                last_success=job.last_success,
            )
        if as_json:
            self.stdout.write(json.dumps([job.as_dict() for job in overdue], indent=2))
        elif not overdue:
            self.stdout.write("No declared job is overdue.")
        else:
            header = ("job", "period", "missing slot", "ended (UTC)", "last success")
            rows = [
                (
                    job.job_name,
                    job.period,
                    job.missing_slot,
                    f"{job.slot_ended_at:%Y-%m-%d %H:%M}",
                    "never"
                    if job.last_success is None
                    else f"{job.last_success.period} on {job.last_success.host}",
                )
                for job in overdue
            ]
            for line in format_table(header, rows):
                self.stdout.write(line)
            for reason in sorted(
                {job.reason for job in overdue if job.reason and not job.failing}
            ):
                self.stdout.write(f"Why: {reason}.")
            for job in overdue:
                if job.failing:
                    self.stdout.write(f"Failing: {job.job_name}: {job.reason}.")
        if overdue:
            sys.exit(1)


def _duration(duration: datetime.timedelta | None) -> str:
    return "" if duration is None else f"{duration.total_seconds():.1f}s"


def _truncated(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _as_dict(run: JobRun) -> dict[str, Any]:
    """A run as ``--json`` prints it: every column but the lock's, times in ISO 8601 (UTC)."""
    return {
        "id": run.pk,
        "job": run.job_name,
        "period": run.period,
        "status": run.status,
        "attempt": run.attempt,
        "started_at": from_field(run.started_at).isoformat(),
        "finished_at": from_field(run.finished_at).isoformat() if run.finished_at else None,
        "duration": run.duration.total_seconds() if run.duration is not None else None,
        "host": run.host,
        "pid": run.pid,
        "error": run.error,
        "task_id": run.task_id or None,
    }
