"""``manage.py run_jobs``: the scheduler of ADVISORY_LOCK["SCHEDULE"], safe on every instance;
and the operators' controls: pause, resume, run now, the live schedulers, a liveness check."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS

from advisory_lock.datetimes import from_field
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.own_connection import table_checked
from advisory_lock.schedule import entries
from advisory_lock.scheduling.alerts import alert_no_scheduler_alive
from advisory_lock.scheduling.alerts import reaches_stderr
from advisory_lock.scheduling.control import MAX_REASON_LENGTH
from advisory_lock.scheduling.control import NoSchedulerAlive
from advisory_lock.scheduling.control import command_line_user
from advisory_lock.scheduling.control import latest_pauses
from advisory_lock.scheduling.control import request_run
from advisory_lock.scheduling.control import run_going_on
from advisory_lock.scheduling.control import set_paused
from advisory_lock.scheduling.liveness import POLL_INTERVAL
from advisory_lock.scheduling.liveness import heartbeat_interval
from advisory_lock.scheduling.liveness import live_schedulers
from advisory_lock.scheduling.liveness import no_scheduler_alive
from advisory_lock.scheduling.outages import is_outage
from advisory_lock.scheduling.scheduler import Scheduler
from advisory_lock.scheduling.stored import TABLE
from advisory_lock.scheduling.stored import all_entries
from advisory_lock.scheduling.workers import DEFAULT_WORKERS
from advisory_lock.tables import format_table
from advisory_lock.validation import database_option
from advisory_lock.validation import seconds_argument
from advisory_lock.validation import text_option
from advisory_lock.validation import whole_number_argument


class Command(BaseCommand):
    help = (
        "Run the jobs of ADVISORY_LOCK['SCHEDULE'] and the stored schedule entries when they "
        "fall due. Run it on every instance: the ledger runs each slot at most once fleet-wide."
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
        parser.add_argument(
            "--pause",
            metavar="ENTRY",
            help="Pause an entry fleet-wide: no scheduler starts a slot of it until --resume.",
        )
        parser.add_argument(
            "--resume",
            metavar="ENTRY",
            help="Resume a paused entry (the slots that fell due while paused don't run).",
        )
        parser.add_argument(
            "--run-now",
            metavar="ENTRY",
            help=(
                "Ask the live schedulers to run an entry once now, in a slot of its own "
                "(manual:<time>); exit status 1 if no scheduler is alive."
            ),
        )
        parser.add_argument(
            "--reason",
            metavar="TEXT",
            help=(
                "With --pause, --resume or --run-now: why (kept with the request, shown by "
                f"--list and the admin; at most {MAX_REASON_LENGTH} characters)."
            ),
        )
        parser.add_argument(
            "--status", action="store_true", help="List the live schedulers (host, pid)."
        )
        parser.add_argument(
            "--check",
            action="store_true",
            help=(
                "Exit 0 if a scheduler was seen in the last 3 heartbeat intervals (3 x "
                "ADVISORY_LOCK['SCHEDULER_HEARTBEAT'], 15 s by default), else 1 saying since "
                "when none is alive."
            ),
        )
        parser.add_argument(
            "--json", action="store_true", help="With --list or --status: print JSON."
        )
        parser.add_argument(
            "--stop-grace",
            type=seconds_argument,
            default=30,
            metavar="SECONDS",
            help="On SIGTERM, let running jobs finish for this long, then stop them (30).",
        )
        parser.add_argument(
            "--workers",
            type=whole_number_argument(256),
            default=DEFAULT_WORKERS,
            metavar="N",
            help=(
                f"How many job processes to keep ready (default {DEFAULT_WORKERS}, at most one "
                "per entry): forked once, each runs one slot at a time."
            ),
        )
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="The ledger's alias.")
        parser.add_argument(
            "--poll-interval",
            type=seconds_argument,
            default=POLL_INTERVAL,
            metavar="SECONDS",
            help=(
                "How often to look for operators' requests and for the ends of enqueued "
                f"tasks (default {POLL_INTERVAL:g}; task ends at most once a heartbeat "
                "interval). On PostgreSQL requests are heard at once (LISTEN/NOTIFY), and "
                "polled for at most once a heartbeat interval; where they can't be heard (a "
                "transaction pooler), they are looked for every second."
            ),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        options["database"] = database_option("--database", options["database"])
        controls = [
            f"--{name.replace('_', '-')}"
            for name in ("pause", "resume", "run_now", "status", "check", "list", "once")
            if options[name] not in (None, False)
        ]
        if len(controls) > 1:
            raise CommandError(f"{' and '.join(controls)} don't go together: pick one.")
        if options["json"] and not (options["list"] or options["status"]):
            raise CommandError("--json goes with --list or --status.")
        if options["reason"] is not None:
            if not (options["pause"] or options["resume"] or options["run_now"]):
                raise CommandError("--reason goes with --pause, --resume or --run-now.")
            text_option("--reason", options["reason"], max_length=MAX_REASON_LENGTH)
        try:
            schedule = entries()
            heartbeat_interval()
        except ValueError as error:
            raise CommandError(f"{error} (manage.py check lists every problem).") from error
        if controls and controls[0] not in ("--list", "--once"):
            try:
                with table_checked(options["database"]):
                    self.control(schedule, options)
            except LedgerNotMigrated as error:
                raise CommandError(str(error)) from error
            return
        scheduler = Scheduler(
            schedule,
            using=options["database"],
            stop_grace=options["stop_grace"],
            poll_interval=options["poll_interval"],
            workers=options["workers"],
            say=self.stdout.write,
        )
        try:
            with table_checked(options["database"]):
                self.run(scheduler, options)
        except LedgerNotMigrated as error:
            raise CommandError(str(error)) from error

    def control(self, schedule: dict[str, Any], options: dict[str, Any]) -> None:
        """--pause, --resume, --run-now, --status or --check."""
        using = options["database"]
        if options["status"]:
            live = live_schedulers(using)
            if options["json"]:
                self.stdout.write(json.dumps([row.as_dict() for row in live], indent=2))
                return
            header = ("host", "pid", "started", "last seen", "version")
            rows = [
                (row.host, str(row.pid), from_field(row.started_at).isoformat(),
                 from_field(row.last_seen).isoformat(), row.version)
                for row in live
            ]  # fmt: skip
            for line in format_table(header, rows):
                self.stdout.write(line)
            if not live:
                self.stdout.write(f"run_jobs: {no_scheduler_alive(using)}.")
            return
        if options["check"]:
            live = live_schedulers(using)
            if not live:
                why = no_scheduler_alive(using)
                alert_no_scheduler_alive(using, why)
                if not reaches_stderr():  # else the alert's record said it there
                    self.stderr.write(f"run_jobs: {why}.")
                sys.exit(1)
            self.stdout.write(f"run_jobs: {len(live)} scheduler(s) alive.")
            return
        name = options["pause"] or options["resume"] or options["run_now"]
        if name not in schedule and name not in all_entries(using):
            raise CommandError(
                f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}, nor has {TABLE} "
                f"(the stored entries)."
            )
        if options["run_now"]:
            try:
                request = request_run(using, name, command_line_user(), options["reason"] or "")
            except NoSchedulerAlive as error:
                raise CommandError(str(error), returncode=1) from error
            line = f"run_jobs: {name} requested as slot {request.slot}; a live scheduler starts it"
            if (going_on := run_going_on(using, name)) is None:
                self.stdout.write(f"{line} within 2s.")
            else:
                self.stdout.write(
                    f"{line} when the run of {name} going on now ends (slot {going_on.period}, "
                    f"pid {going_on.pid} on {going_on.host}): one run of an entry at a time."
                )
            return
        pausing = bool(options["pause"])
        changed = set_paused(using, name, pausing, command_line_user(), options["reason"] or "")
        state = "paused" if pausing else "resumed"
        if changed is None:
            self.stdout.write(f"run_jobs: {name} was already {state}: nothing changed.")
        else:
            self.stdout.write(f"run_jobs: {name} {state} (fleet-wide).")

    def run(self, scheduler: Scheduler, options: dict[str, Any]) -> None:
        """Run the scheduler as the options ask: for ever, once, or list."""
        if not (options["list"] or options["once"]):
            if not scheduler.entries:
                self.stderr.write(
                    f"run_jobs: ADVISORY_LOCK['SCHEDULE'] is empty: only the stored entries "
                    f"({TABLE}, the admin's) run."
                )
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
        paused = latest_pauses(scheduler.using, [row["name"] for row in rows])
        for row in rows:
            pause = paused.get(row["name"]) if row["paused"] else None
            row["paused_by"] = pause.requested_by if pause else None
            row["paused_at"] = from_field(pause.requested_at).isoformat() if pause else None
            row["pause_reason"] = pause.reason if pause else None
        if as_json:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        header = (
            "entry", "state", "schedule", "next run", "last slot", "last status", "last started"
        )  # fmt: skip
        table = [
            (
                row["name"],
                "paused" if row["paused"] else "active",
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
        for row in rows:
            if row["paused"]:
                self.stdout.write(_paused_line(row))


def _paused_line(row: dict[str, Any]) -> str:
    """Who paused a paused entry of ``--list``, when (UTC) and why."""
    if row["paused_by"] is None:
        return f"{row['name']}: paused."
    line = f"{row['name']}: paused by {row['paused_by']} at {row['paused_at']}"
    return (
        f"{line}: {row['pause_reason']}" if row["pause_reason"] else f"{line} (no reason given)."
    )
