"""Another process writing to a SQLite file: ``python -m tests.sqlite_writer PATH``.

For tests/test_admin_writes.py. It makes a table of its own, says ``ready``, then at a line on
stdin it takes the file's write lock (``BEGIN IMMEDIATE``), writes a row, says ``holding``, and
commits, waiting for the commit as long as a reader or another writer delays it (busy timeout
120 s: only a hang reaches it); then it says ``committed``, drops its table and exits. Plain
``sqlite3``: no Django, nothing of the app.
"""

from __future__ import annotations

import sqlite3
import sys

TABLE = "another_writers_rows"


def main(path: str) -> None:
    database = sqlite3.connect(path, timeout=120, isolation_level=None)
    database.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY)")
    print("ready", flush=True)
    sys.stdin.readline()
    database.execute("BEGIN IMMEDIATE")
    database.execute(f"INSERT INTO {TABLE} DEFAULT VALUES")
    print("holding", flush=True)
    database.execute("COMMIT")
    print("committed", flush=True)
    database.execute(f"DROP TABLE {TABLE}")
    database.close()


if __name__ == "__main__":
    main(sys.argv[1])
