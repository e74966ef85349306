"""New, empty databases on the test servers, for tests of what happens before ``migrate``, and a
router that keeps the app's models on one of them."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connections


@contextlib.contextmanager
def new_database(using: str, directory: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """A new database on the server of ``using`` (SQLite: a new file in ``directory``),
    dropped at the end: its settings (for an alias of this process) and its URL (for the demo
    project's processes, whose settings read DATABASE_URL)."""
    connection = connections[using]
    settings_dict = copy.deepcopy(connections.settings[using])  # configured: complete
    if connection.vendor == "sqlite":
        settings_dict["NAME"] = str(directory / "new.sqlite3")
        yield settings_dict, f"sqlite:///{settings_dict['NAME']}"  # absolute: four slashes
        return
    # Per test run (and per xdist worker), as the test database's own name is.
    name = settings_dict["NAME"] = f"{connection.settings_dict['NAME']}_new"
    server = {"postgresql": settings.POSTGRES_URL, "mysql": settings.MYSQL_URL}[using]
    _run_on(using, "CREATE DATABASE {}", name)
    try:
        yield settings_dict, urlsplit(server)._replace(path=f"/{name}").geturl()
    finally:
        # PostgreSQL's FORCE: a closed session's backend may still be on its way out.
        force = " WITH (FORCE)" if connection.vendor == "postgresql" else ""
        _run_on(using, "DROP DATABASE IF EXISTS {}" + force, name)


def _run_on(using: str, sql: str, name: str) -> None:
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.format(connection.ops.quote_name(name)))


class AppOn:
    """A database router that keeps the app's models (the ledger, the control room) on one
    alias."""

    def __init__(self, alias):
        self.alias = alias

    def db_for_read(self, model, **hints):
        return self.alias if model._meta.app_label == "advisory_lock" else None

    db_for_write = db_for_read
