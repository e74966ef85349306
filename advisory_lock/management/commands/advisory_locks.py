"""``manage.py advisory_locks``: who holds which advisory lock, and who waits."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DEFAULT_DB_ALIAS

from advisory_lock.inspection import held_locks
from advisory_lock.tables import format_table
from advisory_lock.validation import database_option

HEADER = [
    "name",
    "key",
    "mode",
    "state",
    "holder",
    "process",
    "user",
    "application",
    "client",
    "held/waited",
]


class Command(BaseCommand):
    help = "Show the advisory locks held and awaited on a database, with their holders."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--using", default=DEFAULT_DB_ALIAS, help="Database alias.")
        parser.add_argument("--json", action="store_true", help="Print JSON for machines.")

    def handle(self, *args: Any, **options: Any) -> None:
        locks = held_locks(database_option("--using", options["using"]))
        if options["json"]:
            document = {
                "using": locks.using,
                "source": locks.source,
                "note": locks.note,
                "locks": [lock.as_dict() for lock in locks],
            }
            self.stdout.write(json.dumps(document, default=str, indent=2))
            return
        self.stdout.write(f"Advisory locks on database {locks.using!r} (from {locks.source}):")
        if locks.note:
            self.stdout.write(locks.note)
        rows = []
        for lock in locks:
            seconds = lock.held_for if lock.granted else lock.waited_for
            rows.append(
                [
                    lock.name,
                    lock.key_text,
                    lock.mode,
                    "held" if lock.granted else "waiting",
                    # "backend pid 4821", "connection id 17", "pid 1234": whose id it is.
                    None if lock.holder is None else f"{lock.holder.kind} {lock.holder_id}",
                    lock.process,
                    lock.user,
                    lock.application_name,
                    lock.client_addr or lock.host,
                    None if seconds is None else f"{seconds:.0f}s",
                ]
            )
        for line in format_table(HEADER, rows):
            self.stdout.write(line)
        if not locks:
            self.stdout.write("(none)")
