"""The contended wait of ``async with advisory_lock`` against the sync lock, on one key.

    .venv/bin/python bench/async_waits.py [--processes 4] [--threads 4] [--hold-ms 1]
                                          [--seconds 5] [--rounds 3] [--only postgresql|mysql]
                                          [--seed N]

Two variants per database (PostgreSQL and MariaDB, the bench database ``test`` of each):

- "sync": ``--processes`` worker processes x ``--threads`` threads each; each thread loops
  ``with advisory_lock(KEY, using=alias): <hold>``, the hold a ``time.sleep(--hold-ms)``. Each
  thread has its own connection (Django's connections are per thread), so a waiter waits in
  the server.
- "async": ``--processes`` worker processes x ``--threads`` asyncio tasks each, in one event
  loop per process; each task loops ``async with advisory_lock(KEY, using=alias): <hold>``,
  the hold an ``await asyncio.sleep(--hold-ms)``. The tasks of one loop share Django's
  connection for the alias (the thread of the async ORM calls), as users run it.

The holder yields the CPU while it holds the lock, like a view doing I/O under it. Every
worker is forked (after ``django.setup()``, before any connection) for its run, opens and
warms its connections (a few uncontended blocks on a key of its own), and all start at the
same moment. Measured per acquisition: the wait, from just before entering the block to the
moment its body starts (``time.perf_counter``, in both variants). A thread or task starts no
new block after ``--seconds``; the blocks already waiting then still run, and are counted:
acquisitions/s is every acquisition divided by the time from the start until the last worker
ended. Mutual exclusion is checked: the body creates a marker file with
``O_CREAT | O_EXCL`` and removes it before the block ends, so a holder that finds the marker
there held the lock at the same time as another (an overlap; must be 0).

Each round runs every (database, variant) once, in a new random order (``--seed``). The
tables give acquisitions/s as the median over the rounds, with its spread ((highest -
lowest) / median); wait p50 / p99 / max over every acquisition of every round (pooled), and
each round's p99; overlaps and errors summed over the rounds. Below each table: the ratio
async p99 / sync p99 (pooled).

The script uses only ``from advisory_lock import advisory_lock`` and Django, and imports the
package from the checkout it sits in: copied into a worktree of an older commit, it measures
that commit's lock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

PG = "postgresql"
MY = "mysql"
NAMES = {PG: "PostgreSQL", MY: "MariaDB"}
# The bench databases of bench/servers.py, written out here so that the script runs unchanged
# in a checkout of any commit.
settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES={
        "default": {},
        PG: {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "test",
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        },
        MY: {
            "ENGINE": "django.db.backends.mysql",
            "NAME": "test",
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": "3306",
            "OPTIONS": {"charset": "utf8mb4"},
        },
    },
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from asgiref.sync import sync_to_async  # noqa: E402
from django.db import connections  # noqa: E402

import advisory_lock as advisory_lock_package  # noqa: E402
from advisory_lock import advisory_lock  # noqa: E402

KEY = 0x0A5_7A17_0000  # the contended key; KEY + 1 + n: worker thread/task n's warm-up key
VARIANTS = ("sync", "async")
WARM_BLOCKS = 6  # psycopg prepares a statement after 5 uses


@dataclass
class Outcome:
    """What one worker process sends back."""

    waits: array = field(default_factory=lambda: array("d"))  # seconds, one per acquisition
    overlaps: int = 0
    errors: int = 0
    first_error: str = ""
    finished: float = 0.0  # time.monotonic() when its last thread or task ended


def enter_body(marker: str) -> int:
    """Create the marker: 1 if another holder's marker was there (an overlap), else 0."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return 1
    os.close(fd)
    return 0


def leave_body(marker: str, overlapped: int) -> None:
    if not overlapped:
        os.unlink(marker)


# The sync variant: threads in a worker process.


def sync_worker(pipe: Connection, alias: str, threads: int, hold: float, marker: str) -> None:
    outcome = Outcome()
    mutex = threading.Lock()
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    schedule: dict[str, float] = {}

    def record_error(exc: BaseException) -> None:
        with mutex:
            outcome.errors += 1
            outcome.first_error = outcome.first_error or repr(exc)

    def thread_main(number: int) -> None:
        waits: list[float] = []
        overlaps = 0
        try:
            for _ in range(WARM_BLOCKS):
                with advisory_lock(KEY + 1 + number, using=alias):
                    pass
        except Exception as exc:
            record_error(exc)
        ready.wait()
        go.wait()
        time.sleep(max(0.0, schedule["start"] - time.monotonic()))
        end, clock = schedule["end"], time.perf_counter
        while time.monotonic() < end:
            try:
                started = clock()
                with advisory_lock(KEY, using=alias):
                    waits.append(clock() - started)
                    overlapped = enter_body(marker)
                    overlaps += overlapped
                    time.sleep(hold)
                    leave_body(marker, overlapped)
            except Exception as exc:
                record_error(exc)
        connections[alias].close()
        with mutex:
            outcome.waits.extend(waits)
            outcome.overlaps += overlaps

    workers = [
        threading.Thread(target=thread_main, args=(n,), daemon=True) for n in range(threads)
    ]
    for worker in workers:
        worker.start()
    ready.wait()
    pipe.send(("ready", None))
    _, start, seconds = pipe.recv()
    schedule.update(start=start, end=start + seconds)
    go.set()
    for worker in workers:
        worker.join()
    outcome.finished = time.monotonic()
    pipe.send(("done", outcome))


# The async variant: tasks in one event loop per worker process.


def async_worker(pipe: Connection, alias: str, tasks: int, hold: float, marker: str) -> None:
    asyncio.run(async_main(pipe, alias, tasks, hold, marker))


async def async_main(pipe: Connection, alias: str, tasks: int, hold: float, marker: str) -> None:
    outcome = Outcome()

    def record_error(exc: BaseException) -> None:
        outcome.errors += 1
        outcome.first_error = outcome.first_error or repr(exc)

    async def warm(number: int) -> None:
        try:
            for _ in range(WARM_BLOCKS):
                async with advisory_lock(KEY + 1 + number, using=alias):
                    pass
        except Exception as exc:
            record_error(exc)

    async def task_main(end: float) -> None:
        clock = time.perf_counter
        while time.monotonic() < end:
            try:
                started = clock()
                async with advisory_lock(KEY, using=alias):
                    outcome.waits.append(clock() - started)
                    overlapped = enter_body(marker)
                    outcome.overlaps += overlapped
                    await asyncio.sleep(hold)
                    leave_body(marker, overlapped)
            except Exception as exc:
                record_error(exc)

    await asyncio.gather(*(warm(n) for n in range(tasks)))
    # Nothing else runs in this loop yet: the handshake may block it.
    pipe.send(("ready", None))
    _, start, seconds = pipe.recv()
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    await asyncio.gather(*(task_main(start + seconds) for _ in range(tasks)))
    outcome.finished = time.monotonic()
    # The connection of the async ORM thread is closed in that thread.
    await sync_to_async(lambda: connections[alias].close())()
    pipe.send(("done", outcome))


WORKERS: dict[str, Callable[[Connection, str, int, float, str], None]] = {
    "sync": sync_worker,
    "async": async_worker,
}


# The parent: one run is one (database, variant) of one round.


@dataclass
class Result:
    alias: str
    variant: str
    rates: list[float] = field(default_factory=list)  # acquisitions/s, one per round
    waits: list[array] = field(default_factory=list)  # seconds, one array per round
    overlaps: int = 0
    errors: int = 0
    first_error: str = ""


def receive(pipe: Connection, timeout: float, what: str) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"a worker did not answer ({what}) within {timeout:g} s")
    kind, value = pipe.recv()
    if kind != what:
        raise RuntimeError(f"a worker answered {kind!r} instead of {what!r}")
    return value


def run(result: Result, args: argparse.Namespace, markers: Path) -> None:
    context = multiprocessing.get_context("fork")
    marker = str(markers / f"{result.alias}-{result.variant}")
    target = WORKERS[result.variant]
    pipes: list[Connection] = []
    processes: list[multiprocessing.process.BaseProcess] = []
    try:
        for _ in range(args.processes):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=target,
                args=(child_end, result.alias, args.threads, args.hold_ms / 1000, marker),
                daemon=True,
            )
            process.start()
            child_end.close()
            pipes.append(parent_end)
            processes.append(process)
        for pipe in pipes:
            receive(pipe, 120, "ready")
        start = time.monotonic() + 0.1
        for pipe in pipes:
            pipe.send(("go", start, args.seconds))
        outcomes: list[Outcome] = [receive(pipe, args.seconds + 120, "done") for pipe in pipes]
        for process in processes:
            process.join(30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in pipes:
            pipe.close()
    waits = array("d")
    for outcome in outcomes:
        waits.extend(outcome.waits)
        result.overlaps += outcome.overlaps
        result.errors += outcome.errors
        result.first_error = result.first_error or outcome.first_error
    elapsed = max(outcome.finished for outcome in outcomes) - start
    result.rates.append(len(waits) / elapsed)
    result.waits.append(waits)


def key_is_free(alias: str) -> bool:
    """After every worker has ended (so in the parent, which forks no more)."""
    try:
        with advisory_lock(KEY, using=alias, wait=False) as handle:
            return bool(handle)
    finally:
        connections[alias].close()


# Reporting.


def percentiles(samples: array | list[float]) -> tuple[float, float, float]:
    """p50, p99 and max, in ms."""
    values = sorted(samples)
    if not values:
        return (float("nan"),) * 3

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    return at(0.50), at(0.99), values[-1] * 1000


def pooled(result: Result) -> array:
    waits = array("d")
    for samples in result.waits:
        waits.extend(samples)
    return waits


def table(alias: str, results: dict[tuple[str, str], Result], args: argparse.Namespace) -> str:
    labels = {
        "sync": f"sync: {args.processes} processes x {args.threads} threads, `with`",
        "async": f"async: {args.processes} processes x {args.threads} tasks, `async with`",
    }
    lines = [
        f"### {NAMES[alias]}",
        "",
        "| variant | acquisitions/s | spread | wait p50 / p99 / max (ms) | p99 per round (ms) "
        "| acquisitions | overlaps | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    p99 = {}
    p50 = {}
    for variant in VARIANTS:
        result = results[alias, variant]
        rate = statistics.median(result.rates)
        spread = (max(result.rates) - min(result.rates)) / rate if rate else float("nan")
        waits = pooled(result)
        p50[variant], p99[variant], longest = percentiles(waits)
        rounds = ", ".join(f"{percentiles(w)[1]:.1f}" for w in result.waits)
        lines.append(
            f"| {labels[variant]} | {rate:,.0f} | {spread:.0%} | {p50[variant]:.2f} / "
            f"{p99[variant]:.1f} / {longest:.1f} | {rounds} | {len(waits):,} | "
            f"{result.overlaps} | {result.errors} |"
        )
    target = " (target elsewhere: <= 1.3)" if alias == PG else ""
    lines += [
        "",
        f"async p99 / sync p99 (pooled): **{p99['async'] / p99['sync']:.2f}**{target}; "
        f"async p50 / sync p50: {p50['async'] / p50['sync']:.2f}.",
    ]
    errors = [results[alias, v].first_error for v in VARIANTS if results[alias, v].errors]
    if errors:
        lines.append(f"First errors: {'; '.join(errors)}")
    return "\n".join(lines)


def revision() -> str:
    """The checkout's commit, and whether advisory_lock/ has uncommitted changes."""
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "advisory_lock"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "advisory_lock at an unknown revision"
    changes = " + uncommitted changes in advisory_lock/" if dirty else ""
    return f"advisory_lock at commit {commit}{changes}"


def versions() -> str:
    found = []
    for name in ("Django", "psycopg", "mysqlclient", "asgiref"):
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{name} {dist_version(name)}")
    return "; ".join([*found, f"Python {sys.version.split()[0]}"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4, help="worker processes (4)")
    parser.add_argument(
        "--threads", type=int, default=4, help="threads (sync) or tasks (async) per process (4)"
    )
    parser.add_argument(
        "--hold-ms", type=float, default=1.0, help="ms slept (awaited) under the lock (1)"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per variant and round (5)")
    parser.add_argument("--rounds", type=int, default=3, help="(3)")
    parser.add_argument("--only", choices=[PG, MY], help="one database only (default: both)")
    parser.add_argument("--seed", type=int, help="of the random order (default: random)")
    args = parser.parse_args(argv)
    if min(args.processes, args.threads, args.rounds) < 1 or args.seconds <= 0:
        parser.error("--processes, --threads, --rounds and --seconds must be positive")
    if Path(advisory_lock_package.__file__).resolve().parent != ROOT / "advisory_lock":
        sys.exit(f"advisory_lock imported from {advisory_lock_package.__file__}, not {ROOT}")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    aliases = [args.only] if args.only else [PG, MY]
    measured = revision()  # read when the code is imported (now), not at the end
    load_before = os.getloadavg()[0]
    results = {(a, v): Result(a, v) for a in aliases for v in VARIANTS}
    markers = Path(
        tempfile.mkdtemp(
            prefix="async-waits-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    try:
        for number in range(args.rounds):
            order = list(results)
            rng.shuffle(order)
            for key in order:
                run(results[key], args, markers)
            print(f"  … round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        left = sorted(path.name for path in markers.iterdir())
    finally:
        shutil.rmtree(markers, ignore_errors=True)
    still_held = [NAMES[alias] for alias in aliases if not key_is_free(alias)]
    print(
        "\n".join(
            [
                "# The contended wait of `async with advisory_lock` against the sync lock, "
                "one key",
                "",
                f"- {measured}; {versions()}; {os.cpu_count()} CPUs; load average "
                f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
                f"- {args.processes} processes x {args.threads} threads (sync) or tasks in "
                f"one event loop (async); hold {args.hold_ms:g} ms (`time.sleep` / "
                f"`await asyncio.sleep`); {args.rounds} round{'s' * (args.rounds > 1)} x "
                f"{args.seconds:g} s per variant, in a new random order each round "
                f"(seed {seed})",
                "- acquisitions/s: median over the rounds, spread (highest - lowest) / median; "
                "waits: pooled over every acquisition of every round; overlaps, errors: sums",
            ]
        )
    )
    for alias in aliases:
        print()
        print(table(alias, results, args))
    if left:
        print(f"\nMarker files left by an overlap: {', '.join(left)} (removed)")
    if still_held:
        sys.exit(f"the key is still held after the runs on {', '.join(still_held)}")


if __name__ == "__main__":
    main()
