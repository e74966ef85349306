"""Where the library's time goes under contention on MariaDB: its layers added one at a time.

    .venv/bin/python bench/layers.py [--processes 8] [--seconds 3] [--rounds 5] [--pin 0]

N processes loop on one key as in bench/contention.py: try without waiting; on success run
``--work-us`` of busy CPU (the O_EXCL marker checks for overlaps) and release. Variants:

- raw MySQLdb: ``GET_LOCK(name, 0)`` / ``RELEASE_LOCK`` on a cursor;
- backend: the library's connection lookup (``connection_locks(connections[alias])``), then
  the backend's ``acquire`` and ``release``, called directly (no ``with``, no lock object,
  no handle);
- reused lock: one ``advisory_lock(k, using=..., wait=False)`` per process, ``with lock as h``
  each time;
- advisory_lock: ``with advisory_lock(k, using=..., wait=False) as h`` each time, as a view or
  bench/contention.py does.

Each round runs the variants in a new random order, in new processes; printed: medians of
acquisitions and tries per second over the rounds, and their ratio to raw MySQLdb.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from contention import K
from contention import critical_section
from django.db import connections
from fleet import affinity_note
from fleet import pinned
from servers import MY
from servers import MY_PARAMS

from advisory_lock import advisory_lock
from advisory_lock.holds import connection_locks

RAW, BACKEND, REUSED, LIBRARY = "raw MySQLdb", "backend", "reused lock", "advisory_lock"
VARIANTS = [RAW, BACKEND, REUSED, LIBRARY]
KEY = K + 500


def loop(variant: str, end: float, marker: str, work: float) -> tuple[int, int, int, float]:
    """Run ``variant`` until ``end``; return (acquisitions, tries, overlaps, seconds)."""
    backend = connection_locks(connections[MY]).backend
    lock_key = advisory_lock(KEY).lock_key
    name = backend.db_key(lock_key)
    acquired = tries = overlaps = 0
    started = time.monotonic()
    if variant == RAW:
        import MySQLdb

        cursor = MySQLdb.connect(**MY_PARAMS, charset="utf8mb4", autocommit=True).cursor()
        execute, fetchone = cursor.execute, cursor.fetchone
        while time.monotonic() < end:
            execute("SELECT GET_LOCK(%s, 0)", (name,))
            tries += 1
            if fetchone()[0] == 1:
                acquired += 1
                overlaps += critical_section(marker, work)
                execute("SELECT RELEASE_LOCK(%s)", (name,))
                fetchone()
    elif variant == BACKEND:
        while time.monotonic() < end:
            backend = connection_locks(connections[MY]).backend
            db_key = backend.db_key(lock_key)
            tries += 1
            if backend.acquire(db_key, shared=False, timeout=0, transaction=False):
                acquired += 1
                overlaps += critical_section(marker, work)
                backend.release(db_key, shared=False)
    else:
        lock = advisory_lock(KEY, using=MY, wait=False)
        while time.monotonic() < end:
            if variant == LIBRARY:
                lock = advisory_lock(KEY, using=MY, wait=False)
            with lock as handle:
                tries += 1
                if handle:
                    acquired += 1
                    overlaps += critical_section(marker, work)
    return acquired, tries, overlaps, time.monotonic() - started


def worker(variant: str, start: float, seconds: float, marker: str, work: float, out: Any) -> None:
    connections[MY].ensure_connection()
    time.sleep(max(0.0, start - time.monotonic()))
    out.put(loop(variant, start + seconds, marker, work))
    connections.close_all()


def run_point(variant: str, processes: int, seconds: float, work: float, folder: Path) -> tuple:
    out = multiprocessing.Queue()
    marker = str(folder / f"marker-{random.randrange(2**32)}")
    start = time.monotonic() + 1.0  # all connected, then all at once
    args = (variant, start, seconds, marker, work, out)
    workers = [multiprocessing.Process(target=worker, args=args) for _ in range(processes)]
    for process in workers:
        process.start()
    results = [out.get(timeout=seconds + 60) for _ in workers]
    for process in workers:
        process.join()
    return (
        sum(a / s for a, _, _, s in results),
        sum(t / s for _, t, _, s in results),
        sum(o for _, _, o, _ in results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-us", type=float, default=100)
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin workers and servers to CPU")
    args = parser.parse_args()
    multiprocessing.set_start_method("fork")
    folder = Path(tempfile.mkdtemp(prefix="layers-"))
    results: dict[str, list[tuple]] = {variant: [] for variant in VARIANTS}
    try:
        with pinned(args.pin):
            note = affinity_note()
            for _ in range(args.rounds):
                for variant in random.sample(VARIANTS, len(VARIANTS)):
                    point = run_point(
                        variant, args.processes, args.seconds, args.work_us / 1e6, folder
                    )
                    results[variant].append(point)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"# {args.processes} processes on one MariaDB key, try → {args.work_us:g} µs → release; "
        f"medians of {args.rounds} rounds x {args.seconds:g} s; {note}\n"
    )
    print("| variant | acquisitions/s | ratio to raw | tries/s | ratio to raw | overlaps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    raw_acquired = statistics.median(point[0] for point in results[RAW])
    raw_tries = statistics.median(point[1] for point in results[RAW])
    for variant, points in results.items():
        acquired = statistics.median(point[0] for point in points)
        tries = statistics.median(point[1] for point in points)
        overlaps = sum(point[2] for point in points)
        print(
            f"| {variant} | {acquired:,.0f} | {acquired / raw_acquired:.2f} | {tries:,.0f} | "
            f"{tries / raw_tries:.2f} | {overlaps} |"
        )


if __name__ == "__main__":
    main()
