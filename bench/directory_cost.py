"""What the lock directory (each lock's name, its holder's host and pid) costs an uncontended
acquire + release: the code before it against the code with it, in one run.

    .venv/bin/python bench/directory_cost.py [--pairs 5000] [--rounds 7]
                                             [--only postgresql|mysql] [--baseline REV] [--seed N]
    taskset -c 0 .venv/bin/python bench/directory_cost.py ...   # the client on one CPU

``with advisory_lock("bench:directory-N", using=alias, wait=False): pass`` (a string key: the
case the directory names), ``--pairs`` times per round, in three variants per database, each
in a worker process of its own (set up and warmed up once):

- "before": the package at ``--baseline`` (default: the merge base with ``main``), extracted
  with ``git archive``;
- "after" and "after, again": this checkout, twice: the gap between the two is the noise of
  the run (an A/A comparison). The directory is on: the app is installed and its tables
  migrated, so the first pair of each worker notes the name and the session, which its thread
  writes, and the pairs measured find both noted.

The workers use a database of their own on each server (``bench_directory``), made and
migrated at the start and dropped at the end. Only one worker runs at a time; every round
runs all variants of both databases in a new random order, and the table gives medians over
the rounds, "spread" ((slowest round - fastest round) / median) and each variant's time
relative to "before"; and the fastest round of each (the one least disturbed by the rest of
a shared machine), its wall time and, apart, its least client CPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DATABASE = "bench_directory"


def settings_for(code: str) -> None:
    """Django set up with the package in ``code`` (first on the path) on ``DATABASE``."""
    sys.path.insert(0, str(BENCH_DIR))
    sys.path.insert(0, code)  # this version of advisory_lock, before the installed one

    import django
    from django.conf import settings
    from servers import databases

    configured = databases()
    for alias in ("postgresql", "mysql"):
        configured[alias]["NAME"] = DATABASE
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        DATABASES=configured,
        INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        ADVISORY_LOCK={"NAMESPACE": "bench"},
    )
    django.setup()


# The worker: one variant, driven over stdin/stdout (one JSON line per command).


def worker(code: str, alias: str, key: str) -> None:
    """Answer "N" with µs per pair of N pairs (wall and this process's CPU)."""
    settings_for(code)

    import advisory_lock
    from advisory_lock import advisory_lock as lock

    assert Path(advisory_lock.__file__).resolve().is_relative_to(Path(code).resolve()), (
        f"measuring {advisory_lock.__file__}, not the package in {code}"
    )

    def loop(n: int) -> None:
        for _ in range(n):
            with lock(key, using=alias, wait=False) as handle:
                if not handle:
                    raise SystemExit(f"{alias}: key {key} busy: is another benchmark running?")

    loop(500)  # the connection, prepared statements, caches
    with lock(key, using=alias):  # held while the directory writes its notes
        written = _directory_written()
    _answer({"ready": True, "file": advisory_lock.__file__, "directory": written})
    for line in sys.stdin:
        if line.startswith("note"):
            _answer({"cpu": _note_alone(alias, key, int(line.split()[1]))})
            continue
        pairs = int(line)
        gc.collect()
        gc.disable()
        try:
            start, cpu_start = time.perf_counter_ns(), time.process_time_ns()
            loop(pairs)
            elapsed, cpu = time.perf_counter_ns() - start, time.process_time_ns() - cpu_start
        finally:
            gc.enable()
        _answer({"wall": elapsed / 1000 / pairs, "cpu": cpu / 1000 / pairs})


def _note_alone(alias: str, key: str, calls: int) -> float | None:
    """CPU µs of what a pair adds for the directory (``directory.recorder.note()`` of a name
    and a session already noted, as ``AdvisoryLock._take`` calls it), without the lock; None
    for a package without the directory."""
    try:
        from advisory_lock import directory
    except ImportError:
        return None
    from django.db import connections

    from advisory_lock.holds import connection_locks
    from advisory_lock.keys import make_key

    recorder = directory.recorder
    assert recorder is not None
    locks = connection_locks(connections[alias])
    backend = locks.backend
    lock_key = make_key(key)
    db_key = backend.db_key(lock_key)
    start = time.process_time_ns()
    for _ in range(calls):
        if directory.recorder is not None:
            recorder.note(backend, alias, db_key, lock_key, locks.holds_now)
    return (time.process_time_ns() - start) / 1000 / calls


def _directory_written() -> bool | None:
    """Whether the directory wrote this worker's notes (None: the package has none)."""
    try:
        from advisory_lock import directory
    except ImportError:
        return None
    return directory.recorder is not None and directory.recorder.flush(60)


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def migrate(drop: bool) -> None:
    """Make (and migrate, with this checkout's migrations) or drop ``DATABASE`` on both
    servers."""
    import MySQLdb
    import psycopg

    sys.path.insert(0, str(BENCH_DIR))
    from servers import MY_PARAMS
    from servers import PG_PARAMS

    with psycopg.connect(**{**PG_PARAMS, "dbname": "postgres"}, autocommit=True) as pg:
        pg.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        if not drop:
            pg.execute(f"CREATE DATABASE {DATABASE}")
    params = {k: v for k, v in MY_PARAMS.items() if k != "database"}
    my = MySQLdb.connect(**params)
    try:
        my.query(f"DROP DATABASE IF EXISTS {DATABASE}")
        if not drop:
            my.query(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
    finally:
        my.close()
    if not drop:
        for alias in ("postgresql", "mysql"):
            subprocess.run(
                [sys.executable, __file__, "--migrate", alias],
                check=True,
                cwd=tempfile.gettempdir(),
            )


# The driver.


@dataclass
class Variant:
    database: str
    label: str
    code: str
    key: str
    process: subprocess.Popen[str] | None = None
    wall: list[float] = field(default_factory=list)  # µs per pair, one per round
    cpu: list[float] = field(default_factory=list)  # the worker's CPU µs per pair
    ready: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", self.code, self.database, self.key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),  # nothing from the checkout on the path by accident
        )
        self.ready = self.read()

    def read(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker for {self.database} / {self.label} stopped")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, pairs: int) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(f"{pairs}\n")
        self.process.stdin.flush()
        answer = self.read()
        self.wall.append(answer["wall"])
        self.cpu.append(answer["cpu"])

    def note_alone(self, calls: int) -> float | None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(f"note {calls}\n")
        self.process.stdin.flush()
        cpu: float | None = self.read()["cpu"]
        return cpu

    def stop(self) -> None:
        if self.process is not None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(30)


def median(times: list[float]) -> float:
    return statistics.median(times)


def spread(times: list[float]) -> float:
    return (max(times) - min(times)) / median(times)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def extract(revision: str, into: Path) -> str:
    """``advisory_lock/`` at ``revision``, in ``into``; return its short commit."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "advisory_lock"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return git("rev-parse", "--short", revision)


def table(database: str, variants: list[Variant], pairs: int, rounds: int, alone: float) -> str:
    wall0, cpu0 = median(variants[0].wall), median(variants[0].cpu)
    lines = [
        f"### {database}: medians of {rounds} rounds x {pairs} pairs",
        "",
        "| variant | µs per pair | / before | spread | client CPU µs per pair | / before "
        "| spread | fastest round, µs | / before | its client CPU µs | / before |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fastest0, fastest_cpu0 = min(variants[0].wall), min(variants[0].cpu)
    for variant in variants:
        wall, cpu = median(variant.wall), median(variant.cpu)
        fastest, fastest_cpu = min(variant.wall), min(variant.cpu)
        lines.append(
            f"| {variant.label} | {wall:.1f} | {wall / wall0:.3f} | {spread(variant.wall):.0%} "
            f"| {cpu:.1f} | {cpu / cpu0:.3f} | {spread(variant.cpu):.0%} "
            f"| {fastest:.1f} | {fastest / fastest0:.3f} | {fastest_cpu:.1f} "
            f"| {fastest_cpu / fastest_cpu0:.3f} |"
        )
    before, after, again = variants
    for what, name in (("wall", "time"), ("cpu", "client CPU")):
        before_m, after_m, again_m = (median(getattr(v, what)) for v in (before, after, again))
        both = (after_m + again_m) / 2
        lines.append(
            f"{'' if what == 'cpu' else chr(10)}- {name}: noise (after, again / after) "
            f"{again_m / after_m - 1:+.1%}; after / before {after_m / before_m - 1:+.1%}, "
            f"both afters / before {both / before_m - 1:+.1%}"
        )
    lines.append(
        f"- the directory's note() alone, a name and a session already noted (what each pair "
        f"adds): {alone:.2f} µs of CPU, {alone / median(before.cpu):.1%} of the pair's client "
        f"CPU before"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=["postgresql", "mysql"])
    parser.add_argument("--baseline", help="revision before the directory (default: main)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--worker", nargs=3, metavar=("CODE", "ALIAS", "KEY"), help=argparse.SUPPRESS
    )
    parser.add_argument("--migrate", metavar="ALIAS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.migrate:
        settings_for(str(ROOT))
        from django.core.management import call_command

        call_command("migrate", database=args.migrate, verbosity=0)
        return None

    baseline_dir = Path(tempfile.mkdtemp(prefix="bench-directory-before-"))
    variants: list[Variant] = []
    try:
        revision = args.baseline or git("merge-base", "HEAD", "main")
        before = extract(revision, baseline_dir)
        migrate(drop=False)
        databases = [args.only] if args.only else ["postgresql", "mysql"]
        for database in databases:
            for label, code in (
                (f"before (`{before}`)", str(baseline_dir)),
                ("after", str(ROOT)),
                ("after, again", str(ROOT)),
            ):
                key = f"directory-{len(variants)}"
                variants.append(Variant(database, label, code, key))
        print(f"  … starting {len(variants)} workers", file=sys.stderr, flush=True)
        for variant in variants:
            variant.start()
        rng = random.Random(args.seed)
        for number in range(args.rounds):
            order = list(variants)
            rng.shuffle(order)
            for variant in order:
                variant.run(args.pairs)
            print(f"  … round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        alone = {
            v.database: median([v.note_alone(args.pairs) or 0.0 for _ in range(args.rounds)])
            for v in variants
            if v.label == "after"
        }
    finally:
        for variant in variants:
            variant.stop()
        shutil.rmtree(baseline_dir, ignore_errors=True)
        migrate(drop=True)

    sys.path.insert(0, str(BENCH_DIR))
    from fleet import library_revision

    client = os.sched_getaffinity(0)
    print("# advisory_lock: the cost of the lock directory, uncontended")
    print()
    print(f"- {library_revision()}; before = `{revision[:7]}` = `{before}`")
    written = {f"{v.database} / {v.label}": v.ready.get("directory") for v in variants}
    print(f"- the directory wrote each worker's notes: {written}")
    print(
        f"- client {'pinned to CPU ' + str(min(client)) if len(client) == 1 else 'NOT pinned'}; "
        f"load average {os.getloadavg()[0]:.1f} at the end; seed {args.seed}"
    )
    print(f"- {time.strftime('%Y-%m-%d %H:%M %Z')}")
    for database in databases:
        print()
        own = [v for v in variants if v.database == database]
        print(table(database, own, args.pairs, args.rounds, alone[database]))


if __name__ == "__main__":
    main()
