"""A lock holder on the Patroni cluster: ``python -m tests.failover_child --using ALIAS``.

For tests/test_failover.py and bench/failover.py, started with tests/patroni_settings.py
(``Cluster.environment``). It reads one command per line on stdin, a JSON object, and writes
one JSON object per line on stdout; ``at`` is ``time.monotonic()``, one clock for every process
on Linux, so that the test can time a notice against the moment it failed the primary over.

* ``{"do": "hold", "key": K, "beat": S, "fencing": F, "wait": W}``: ``with advisory_lock(K,
  using=ALIAS, heartbeat=S, fencing=F, wait=W, on_lost=...) as lock`` (no heartbeat when S is
  0): say ``holding`` (the token, the port of the server the lock is on, ``at``), or ``busy``
  when ``wait`` is false and another holds it. ``on_lost`` says ``lost`` (the key, the handle's
  ``lost``, ``at``) from the heartbeat's thread, while the block goes on. Inside the block:

  * ``{"do": "check"}``: ``lock.check()``; say ``checked`` with its error ('' if none);
  * ``{"do": "write", "table": T, "value": V}``: the fenced write of docs/semantics.md
    ("Fencing your own writes") on a new connection of the alias (the block's own may have
    died with its server): ``UPDATE T SET value = V, fence = token WHERE id = 1 AND fence <=
    token``; say ``wrote`` with the rows it changed and the server's port;
  * ``{"do": "release"}`` (or EOF): leave the block; say ``released`` with the error the
    block ended with ('' if none): ``LockLost`` once its session died with its server.

EOF outside a block ends the process.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import django

_output = threading.Lock()


def say(event: str, **fields: object) -> None:
    """One line, whole: the heartbeat's thread says ``lost`` while the main thread talks."""
    line = json.dumps({"event": event, **fields}) + "\n"
    with _output:
        sys.stdout.write(line)
        sys.stdout.flush()


def command() -> dict[str, Any] | None:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def server_port(connection: Any) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT inet_server_port()")
        return int(cursor.fetchone()[0])


def fenced_write(using: str, token: int, table: str, value: str) -> None:
    from django.db import DatabaseError
    from django.db import connections

    writer = connections.create_connection(using)
    try:
        with writer.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET value = %s, fence = %s WHERE id = 1 AND fence <= %s",
                [value, token, token],
            )
            rows = cursor.rowcount
        say("wrote", rows=rows, port=server_port(writer), error="")
    except DatabaseError as error:
        say("wrote", rows=None, port=None, error=f"{type(error).__name__}: {error}")
    finally:
        writer.close()


def hold(using: str, order: dict[str, Any]) -> bool:
    """One hold; False once stdin is closed."""
    from django.db import DatabaseError
    from django.db import close_old_connections
    from django.db import connections

    from advisory_lock import AdvisoryLockError
    from advisory_lock import LockLost
    from advisory_lock import advisory_lock

    # Each hold is a unit of work, as a request or a task is, and starts as Django starts
    # those: close_old_connections(), which with CONN_MAX_AGE 0 closes the connection the last
    # hold left open (after a failover, one to the old primary). Without it the next
    # statement on that connection fails, as any ORM call would in a long-running process.
    close_old_connections()
    key = order["key"]
    beat = order.get("beat") or None
    options: dict[str, Any] = {}
    if beat:
        options["heartbeat"] = beat
        options["on_lost"] = lambda lock: say("lost", key=key, flag=lock.lost, at=time.monotonic())
    more = True
    try:
        with advisory_lock(
            key,
            using=using,
            fencing=bool(order.get("fencing")),
            wait=order.get("wait", True),
            **options,
        ) as lock:
            if not lock:
                say("busy", key=key)
                return True
            say(
                "holding",
                key=key,
                token=lock.token,
                port=server_port(connections[using]),
                at=time.monotonic(),
            )
            while (step := command()) is not None and step["do"] != "release":
                if step["do"] == "check":
                    try:
                        lock.check()
                    except LockLost as error:
                        say("checked", error=str(error))
                    else:
                        say("checked", error="")
                elif step["do"] == "write":
                    fenced_write(using, lock.token, step["table"], step["value"])
                else:
                    raise ValueError(f"not a command inside a block: {step!r}")
            more = step is not None
    except (AdvisoryLockError, DatabaseError) as error:
        say("released", key=key, error=f"{type(error).__name__}: {error}")
    else:
        say("released", key=key, error="")
    return more


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.failover_child")
    parser.add_argument("--using", required=True, help="the database alias")
    args = parser.parse_args()
    django.setup()
    say("ready")
    while (order := command()) is not None:
        if order["do"] != "hold":
            raise ValueError(f"not a command outside a block: {order!r}")
        if not hold(args.using, order):
            break


if __name__ == "__main__":
    main()
