"""Where the microseconds of an uncontended acquire + release go, in the client's Python.

    .venv/bin/python bench/profile_pair.py [--only postgresql|mysql] [--batches 300]
    taskset -c 0 .venv/bin/python bench/profile_pair.py     # one CPU, as the other benches

The round trips are taken out: after a real first pair, the Django connection's driver
connection is wrapped so that the library's statements are answered from memory (the results
of real executions, kept), and only Python runs. Measured with the thread's CPU time (robust
to other processes on a shared machine), the minimum over ``--batches`` batches of 500 pairs:

- the whole pair (``with advisory_lock(k, using=..., wait=False): pass``), its bytecodes and
  Python calls per pair (``sys.settrace``), and the functions they run in;
- its parts: building the lock object, Django's connection lookup, the library's registry of
  connections, Django's ``queries_logged`` (read before each statement, so that
  ``CaptureQueriesContext`` and ``DEBUG`` see them), the backend's two statements alone, and
  the rest (the hold's bookkeeping, ``__enter__`` / ``__exit__``).

The wrappers cost a little themselves (a Python call per statement): the "bare" row, Django's
connection lookup and the two statements sent through the wrappers, shows their floor.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import library_revision  # noqa: E402
from servers import MY  # noqa: E402
from servers import PG  # noqa: E402
from servers import databases  # noqa: E402

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES=databases(),
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from django.db import connections  # noqa: E402

from advisory_lock import advisory_lock  # noqa: E402
from advisory_lock.holds import connection_locks  # noqa: E402
from advisory_lock.locks import AdvisoryLock  # noqa: E402

K = 0x5EED_0900


class Replayed:
    """A driver object whose statement calls are answered with the results of their first,
    real, execution; everything else goes to the real object."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._results: dict[Any, Any] = {}
        self._last: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    # psycopg's PGconn
    def exec_prepared(self, name: bytes, values: list[bytes]) -> Any:
        key = (name, *values)
        result = self._results.get(key)
        if result is None:
            result = self._results[key] = self._real.exec_prepared(name, values)
        return result

    # MySQLdb's Connection
    def query(self, sql: bytes) -> None:
        if sql not in self._results:
            self._real.query(sql)
            self._results[sql] = self._real.store_result().fetch_row()
        self._last = sql

    def store_result(self) -> Any:
        return _Rows(self._results[self._last])


class _Rows:
    __slots__ = ("rows",)

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def fetch_row(self) -> Any:
        return self.rows


class ReplayedPsycopg(Replayed):
    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.pgconn = Replayed(real.pgconn)


def best_of(batches: int, run: Any, n: int = 500) -> float:
    """Thread CPU µs per call of ``run`` (which makes ``n`` calls): the minimum of batches."""
    run(50)
    best = float("inf")
    for _ in range(batches):
        gc.disable()
        started = time.thread_time_ns()
        run(n)
        elapsed = time.thread_time_ns() - started
        gc.enable()
        best = min(best, elapsed / n / 1000)
    return best


def traced(alias: str, k: int, pairs: int = 50) -> tuple[float, float, collections.Counter[str]]:
    """Bytecodes and Python calls per pair, and the bytecodes of each function."""
    ops: collections.Counter[str] = collections.Counter()
    calls = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal calls
        if event == "call":
            frame.f_trace_opcodes = True
            calls += 1
        elif event == "opcode":
            code = frame.f_code
            ops[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(pairs):
            with advisory_lock(k, using=alias, wait=False):
                pass
    finally:
        sys.settrace(None)
    return sum(ops.values()) / pairs, calls / pairs, ops


def profile(alias: str, batches: int) -> list[str]:
    k = K + (alias == MY)
    connection = connections[alias]
    connection.ensure_connection()
    for _ in range(3):  # the pid learnt, the statements prepared
        with advisory_lock(k, using=alias, wait=False):
            pass
    real = connection.connection
    replayed = ReplayedPsycopg(real) if alias == PG else Replayed(real)
    connection.connection = replayed
    try:
        with advisory_lock(k, using=alias, wait=False):  # the results, kept
            pass
        locks = connection_locks(connection)
        backend = locks.backend
        lock = AdvisoryLock(k, using=alias, wait=False)
        db_key = backend.db_key(lock.lock_key)
        if alias == PG:
            pgconn = replayed.pgconn
            names = list(pgconn._results)

            def bare(n: int) -> None:
                for _ in range(n):
                    conn = connections[alias].connection.pgconn
                    for name, *values in names:
                        conn.exec_prepared(name, values).get_value(0, 0)
        else:
            statements = list(replayed._results)

            def bare(n: int) -> None:
                for _ in range(n):
                    conn = connections[alias].connection
                    for sql in statements:
                        conn.query(sql)
                        conn.store_result().fetch_row()

        def pair(n: int) -> None:
            for _ in range(n):
                with advisory_lock(k, using=alias, wait=False):
                    pass

        def build(n: int) -> None:
            for _ in range(n):
                advisory_lock(k, using=alias, wait=False)

        def lookup(n: int) -> None:
            for _ in range(n):
                connections[alias]

        def registry(n: int) -> None:
            for _ in range(n):
                connection_locks(connection)

        def logged(n: int) -> None:
            for _ in range(n):
                connection.queries_logged  # noqa: B018

        def statements_alone(n: int) -> None:
            acquire, release = backend.acquire, backend.release
            for _ in range(n):
                acquire(db_key, shared=False, timeout=0, transaction=False)
                release(db_key, shared=False)

        whole = best_of(batches, pair)
        parts = {
            "the lock object: `advisory_lock(k, using=..., wait=False)`": best_of(batches, build),
            "Django's connection lookup: `connections[alias]`": best_of(batches, lookup),
            "the library's registry: `connection_locks(connection)`": best_of(batches, registry),
            "Django's `queries_logged`, read before each of the 2 statements": 2
            * best_of(batches, logged),
            "the backend's two statements alone (`acquire()` + `release()`), less the 2 reads "
            "above": 0.0,
        }
        backend_alone = best_of(batches, statements_alone)
        key = list(parts)[-1]
        parts[key] = backend_alone - parts[list(parts)[3]]
        floor = best_of(batches, bare)
        bytecodes, calls, ops = traced(alias, k)
    finally:
        connection.connection = real
    title = "PostgreSQL" if alias == PG else "MariaDB"
    lines = [
        f"### {title}: pure Python per acquire + release (thread CPU, min of {batches} x 500)",
        "",
        f"- the whole pair: {whole:.2f} µs, {bytecodes:.0f} bytecodes, {calls:.0f} Python calls",
        f"- bare: Django's lookup and the two statements through the wrappers: {floor:.2f} µs",
        "",
        "| part | µs per pair |",
        "| --- | ---: |",
    ]
    lines += [f"| {what} | {us:.2f} |" for what, us in parts.items()]
    rest = whole - sum(parts.values())
    lines.append(f"| the rest: `__enter__` / `__exit__`, the hold's bookkeeping | {rest:.2f} |")
    lines += ["", "Bytecodes per pair, by function (the 12 busiest):", ""]
    lines += [f"- {name}: {count / 50:.0f}" for name, count in ops.most_common(12)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=(PG, MY))
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    import os

    print(f"- {library_revision()}; load average {os.getloadavg()[0]:.2f}\n")
    for alias in [args.only] if args.only else [PG, MY]:
        print("\n".join(profile(alias, args.batches)) + "\n")


if __name__ == "__main__":
    main()
