"""Server-side helpers for tests: act on a connection from another connection."""

from __future__ import annotations

from django.db import connections

from tests.probes import in_other_connection


def backend_id(using: str) -> int:
    """The server's id of this thread's connection for ``using`` (pid or connection id)."""
    function = {"postgresql": "pg_backend_pid()", "mysql": "CONNECTION_ID()"}[
        connections[using].vendor
    ]
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {function}")
        return cursor.fetchone()[0]


def kill_connection_of(using: str, target: int | None = None) -> None:
    """Terminate this thread's connection for ``using`` (or ``target``) from another one."""
    target = backend_id(using) if target is None else target

    def kill():
        with connections[using].cursor() as cursor:
            if connections[using].vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [target])
            else:
                cursor.execute(f"KILL {int(target)}")

    in_other_connection(kill)


def prepare_statement_sql(function: str, pair: bool, guarded: bool) -> str:
    """The SQL ``PREPARE`` of one of the PostgreSQL backend's prepared lock statements, as
    another client of this library would have left it on a server connection."""
    from advisory_lock.backends.postgresql import _prepared

    name, statement, types = _prepared(function, pair, guarded)
    declared = ", ".join("integer" if oid == 23 else "bigint" for oid in types)
    return f"PREPARE {name.decode()} ({declared}) AS {statement.decode()}"
