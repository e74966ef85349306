"""``manage.py advisory_locks``: who holds which advisory lock, and who waits."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DEFAULT_DB_ALIAS

from advisory_lock.inspect import held_locks

COLUMNS = [
    ("name", "name"),
    ("key", "key_text"),
    ("mode", "mode"),
    ("state", "granted"),
    ("holder", "holder_id"),
    ("user", "user"),
    ("application", "application_name"),
    ("client", "client_addr"),
    ("held/waited", "duration"),
]


class Command(BaseCommand):
    help = "Show the advisory locks held and awaited on a database, with their holders."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--using", default=DEFAULT_DB_ALIAS, help="Database alias.")
        parser.add_argument("--json", action="store_true", help="Print JSON for machines.")

    def handle(self, *args: Any, **options: Any) -> None:
        locks = held_locks(options["using"])
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
        rows = [[heading for heading, _ in COLUMNS]]
        for lock in locks:
            seconds = lock.held_for if lock.granted else lock.waited_for
            values = {
                "granted": "held" if lock.granted else "waiting",
                "holder_id": lock.holder_id,
                "duration": "" if seconds is None else f"{seconds:.0f}s",
            }
            rows.append(
                [str(values.get(attr, getattr(lock, attr, "")) or "") for _, attr in COLUMNS]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        for row in rows:
            cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            self.stdout.write("  ".join(cells).rstrip())
        if not locks:
            self.stdout.write("(none)")
