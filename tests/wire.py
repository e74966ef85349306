"""Count what goes over the wire: round trips on a connection, exactly.

PostgreSQL: libpq's protocol trace (psycopg's ``PGconn.trace()``), one ``Query`` or ``Sync``
message from the client per round trip. MySQL/MariaDB: the session's ``Questions`` counter.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from django.db import connections

_CLIENT_MESSAGE = re.compile(r"^F\t\d+\t(Query|Sync)\b", re.MULTILINE)


@dataclass
class Trips:
    count: int = -1


@contextlib.contextmanager
def round_trips(using: str) -> Iterator[Trips]:
    """Count the round trips this thread's connection for ``using`` makes in the block."""
    connection = connections[using]
    connection.ensure_connection()
    trips = Trips()
    if connection.vendor == "postgresql":
        from psycopg import pq

        pgconn = connection.connection.pgconn
        with tempfile.TemporaryFile("w+") as trace:
            pgconn.trace(trace.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                yield trips
            finally:
                pgconn.untrace()
            trace.seek(0)
            trips.count = len(_CLIENT_MESSAGE.findall(os.read(trace.fileno(), 1 << 24).decode()))
        return
    raw = connection.connection

    def questions() -> int:
        raw.query(b"SHOW SESSION STATUS LIKE 'Questions'")
        return int(raw.store_result().fetch_row()[0][1])

    itself = -questions() + questions()  # what one SHOW STATUS adds
    before = questions()
    yield trips
    trips.count = questions() - before - itself
