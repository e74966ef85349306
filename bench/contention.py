"""Contention on one key: N processes loop lock → work → unlock; and Redis, uncontended.

    .venv/bin/python bench/contention.py [--processes 1,2,4,8,16,32] [--seconds 3] [--rounds 3]
    .venv/bin/python bench/contention.py --pin 0       # processes and servers on CPU 0
    .venv/bin/python bench/contention.py --mode blocking   # each waits for the lock in turn
    .venv/bin/python bench/contention.py --json out.json [--overlay pinned.json]

``--mode try`` (the default) spins on tries; ``--mode blocking`` waits: raw
``pg_advisory_lock(k)`` / ``GET_LOCK(name, 2**31 - 1)``, the library's
``with advisory_lock(k, using=...)``, and redis-py's ``Lock(blocking=True)`` (which polls).
In blocking mode every attempt is an acquisition.

Contended: for each variant and each process count N, N worker processes (forked once, after
``django.setup()``, before any connection) loop for ``--seconds`` on ONE key: try the lock
without waiting; on success run the critical section (``--work-us`` of busy CPU) and unlock;
on failure try again at once. Counted: attempts (tries) per second, acquisitions (successful
tries) per second, and overlaps: the critical section creates a marker file with
``O_CREAT | O_EXCL`` and removes it before the unlock, so a holder that finds the marker there
ran at the same time as another holder (an overlap; must be 0). Every (variant, N) point of a
round runs in a new random order; the tables give medians over the rounds (overlaps and errors:
sums). Workers open their connections before the start (and warm them), close them after.

Variants: raw psycopg (``pg_try_advisory_lock`` / ``pg_advisory_unlock``, autocommit), the
library on PostgreSQL (``with advisory_lock(k, using=..., wait=False) as h: if h: work``),
raw MySQLdb (``GET_LOCK(name, 0)`` / ``RELEASE_LOCK``), the library on MariaDB, and redis-py's
``Lock(r, name, blocking=False)`` (``SET NX`` / a Lua release; no expiry).

Uncontended: one process, acquire + release pairs of the same variants (and raw redis-py
``SET NX`` + ``DEL`` as Redis's floor), interleaved in a new random order each round, medians.

The curve of acquisitions/s against N is drawn to ``--png`` (default: bench/contention.png).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import affinity_note  # noqa: E402
from fleet import library_revision  # noqa: E402
from fleet import pinned  # noqa: E402
from fleet import wait_until_quiet  # noqa: E402
from servers import MY  # noqa: E402
from servers import MY_PARAMS  # noqa: E402
from servers import PG  # noqa: E402
from servers import PG_PARAMS  # noqa: E402
from servers import databases  # noqa: E402

REDIS_PARAMS = {"host": "127.0.0.1", "port": 6379}

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES=databases(),
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from django.db import connections  # noqa: E402

from advisory_lock import AdvisoryLockError  # noqa: E402
from advisory_lock import advisory_lock  # noqa: E402

BLOCKING = False  # --mode blocking: set before the worker processes are forked
K = 0x0C0_7E57_0000  # int keys of this benchmark: K + variant number (+ 1000 to warm up)
MY_RAW_NAME = f"{MY_PARAMS['database']}/bench-contention-raw"
REDIS_NAME = "bench-contention"
RAW_PG, LIB_PG, RAW_MY, LIB_MY, REDIS, REDIS_RAW = (
    "raw psycopg",
    "advisory_lock, PostgreSQL",
    "raw MySQLdb",
    "advisory_lock, MariaDB",
    "redis-py Lock",
    "raw redis-py SET NX + DEL",
)
CONTENDED = [RAW_PG, LIB_PG, RAW_MY, LIB_MY, REDIS]
RATIOS = [(LIB_PG, RAW_PG, "PostgreSQL"), (LIB_MY, RAW_MY, "MariaDB")]


# The loops: each runs until ``end`` (time.monotonic) and returns its counts.


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def critical_section(marker: str, work: float) -> int:
    """The work under the lock; 1 if another holder was inside at the same time (else 0)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        spin(work)
        return 1
    os.close(fd)
    spin(work)
    os.unlink(marker)
    return 0


@dataclass
class Counts:
    attempts: int = 0
    acquired: int = 0
    overlaps: int = 0
    errors: int = 0  # exceptions from the lock (the library's LockLost, redis's LockError)
    bad_unlocks: int = 0  # raw drivers: an unlock that said "not held"
    elapsed: float = 0.0


class Client:
    """One variant's connection in one process: ``loop`` for contention, ``pairs`` alone."""

    def __init__(self, variant: str, key_offset: int = 0) -> None:
        self.variant = variant
        self.k = K + CONTENDED.index(variant) + key_offset if variant in CONTENDED else K
        self.closers: list[Callable[[], None]] = []
        if variant == RAW_PG:
            import psycopg

            conn = psycopg.connect(**PG_PARAMS, autocommit=True)
            self.closers.append(conn.close)
            self.cursor = conn.cursor()
        elif variant == RAW_MY:
            import MySQLdb

            conn = MySQLdb.connect(**MY_PARAMS, charset="utf8mb4", autocommit=True)
            self.closers.append(conn.close)
            self.cursor = conn.cursor()
            self.name = MY_RAW_NAME + ("" if not key_offset else f"-{key_offset}")
        elif variant in (LIB_PG, LIB_MY):
            self.alias = PG if variant == LIB_PG else MY
            connections[self.alias].ensure_connection()
            self.closers.append(connections[self.alias].close)
        elif variant in (REDIS, REDIS_RAW):
            import redis

            self.redis = redis.Redis(**REDIS_PARAMS)
            self.redis.ping()
            self.closers.append(self.redis.close)
            self.name = f"{REDIS_NAME}-{variant == REDIS_RAW:d}-{key_offset}"

    def close(self) -> None:
        for close in self.closers:
            close()

    def loop(self, end: float, marker: str, work: float) -> Counts:
        c = Counts()
        monotonic = time.monotonic
        started = monotonic()
        if self.variant == RAW_PG:
            execute, fetchone, k = self.cursor.execute, self.cursor.fetchone, self.k
            take = (
                "SELECT pg_advisory_lock(%s), true"
                if BLOCKING
                else "SELECT pg_try_advisory_lock(%s)"
            )
            while monotonic() < end:
                execute(take, (k,))
                c.attempts += 1
                if fetchone()[-1]:
                    c.acquired += 1
                    c.overlaps += critical_section(marker, work)
                    execute("SELECT pg_advisory_unlock(%s)", (k,))
                    c.bad_unlocks += not fetchone()[0]
        elif self.variant == RAW_MY:
            execute, fetchone, name = self.cursor.execute, self.cursor.fetchone, self.name
            take = "SELECT GET_LOCK(%s, 2147483647)" if BLOCKING else "SELECT GET_LOCK(%s, 0)"
            while monotonic() < end:
                execute(take, (name,))
                c.attempts += 1
                if fetchone()[0] == 1:
                    c.acquired += 1
                    c.overlaps += critical_section(marker, work)
                    execute("SELECT RELEASE_LOCK(%s)", (name,))
                    c.bad_unlocks += fetchone()[0] != 1
        elif self.variant in (LIB_PG, LIB_MY):
            alias, k, wait = self.alias, self.k, BLOCKING
            while monotonic() < end:
                try:
                    with advisory_lock(k, using=alias, wait=wait) as handle:
                        c.attempts += 1
                        if handle:
                            c.acquired += 1
                            c.overlaps += critical_section(marker, work)
                except AdvisoryLockError:
                    c.errors += 1
        elif self.variant == REDIS:
            from redis.exceptions import LockError
            from redis.lock import Lock

            r, name = self.redis, self.name
            while monotonic() < end:
                lock = Lock(r, name, blocking=BLOCKING)
                c.attempts += 1
                if lock.acquire():
                    c.acquired += 1
                    c.overlaps += critical_section(marker, work)
                    try:
                        lock.release()
                    except LockError:
                        c.errors += 1
        c.elapsed = monotonic() - started
        return c

    def warm(self, index: int) -> None:
        """A few pairs on a key of this process's own (psycopg prepares after 5 uses)."""
        k, name = self.k, getattr(self, "name", None)
        self.k, self.name = K + 2000 + index, f"{name}-warm-{index}"
        try:
            self.pairs(10)
        finally:
            self.k, self.name = k, name

    def pairs(self, n: int) -> None:
        """``n`` uncontended acquire + release pairs."""
        if self.variant == RAW_PG:
            execute, fetchone, k = self.cursor.execute, self.cursor.fetchone, self.k
            for _ in range(n):
                execute("SELECT pg_try_advisory_lock(%s)", (k,))
                fetchone()
                execute("SELECT pg_advisory_unlock(%s)", (k,))
                fetchone()
        elif self.variant == RAW_MY:
            execute, fetchone, name = self.cursor.execute, self.cursor.fetchone, self.name
            for _ in range(n):
                execute("SELECT GET_LOCK(%s, 0)", (name,))
                fetchone()
                execute("SELECT RELEASE_LOCK(%s)", (name,))
                fetchone()
        elif self.variant in (LIB_PG, LIB_MY):
            alias, k = self.alias, self.k
            for _ in range(n):
                with advisory_lock(k, using=alias, wait=False) as handle:
                    assert handle
        elif self.variant == REDIS:
            from redis.lock import Lock

            r, name = self.redis, self.name
            for _ in range(n):
                lock = Lock(r, name, blocking=False)
                assert lock.acquire()
                lock.release()
        elif self.variant == REDIS_RAW:
            r, name = self.redis, self.name
            for _ in range(n):
                assert r.set(name, b"1", nx=True)
                r.delete(name)


# Worker processes.


def worker_main(pipe: Any, index: int) -> None:
    client: Client | None = None
    while True:
        message = pipe.recv()
        if message[0] == "quit":
            return
        if message[0] == "prepare":
            _, variant = message
            try:
                client = Client(variant)
                client.warm(index)
                pipe.send(("ready", None))
            except Exception as exc:
                pipe.send(("error", repr(exc)))
        elif message[0] == "go":
            _, start_at, seconds, marker, work = message
            time.sleep(max(0.0, start_at - time.monotonic()))
            try:
                counts = client.loop(start_at + seconds, marker, work)
                pipe.send(("done", asdict(counts)))
            except Exception as exc:
                pipe.send(("error", repr(exc)))
            finally:
                client.close()
                client = None


class Pool:
    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context("fork")
        self.pipes, self.processes = [], []
        for index in range(size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker_main, args=(child_end, index), daemon=True)
            process.start()
            self.pipes.append(parent_end)
            self.processes.append(process)

    def ask(self, n: int, message: tuple, timeout: float) -> list[Any]:
        for pipe in self.pipes[:n]:
            pipe.send(message)
        answers = []
        for number, pipe in enumerate(self.pipes[:n]):
            if not pipe.poll(timeout):
                raise RuntimeError(f"worker {number} did not answer {message[0]!r}")
            kind, value = pipe.recv()
            if kind == "error":
                raise RuntimeError(f"worker {number}: {value}")
            answers.append(value)
        return answers

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(("quit",))
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()


@dataclass
class Point:
    variant: str
    processes: int
    attempts: list[float] = field(default_factory=list)  # per second, one per round
    acquired: list[float] = field(default_factory=list)
    busiest_share: list[float] = field(default_factory=list)
    overlaps: int = 0
    errors: int = 0
    bad_unlocks: int = 0


def run_point(pool: Pool, point: Point, seconds: float, work: float, markers: Path) -> None:
    n = point.processes
    pool.ask(n, ("prepare", point.variant), timeout=60)
    marker = str(markers / f"{CONTENDED.index(point.variant)}-{n}")
    start_at = time.monotonic() + 0.05
    results = [
        Counts(**value)
        for value in pool.ask(n, ("go", start_at, seconds, marker, work), 60 + seconds)
    ]
    elapsed = max(c.elapsed for c in results)
    acquired = sum(c.acquired for c in results)
    point.attempts.append(sum(c.attempts for c in results) / elapsed)
    point.acquired.append(acquired / elapsed)
    point.busiest_share.append(max(c.acquired for c in results) / max(1, acquired))
    point.overlaps += sum(c.overlaps for c in results)
    point.errors += sum(c.errors for c in results)
    point.bad_unlocks += sum(c.bad_unlocks for c in results)
    check_released(point.variant)


_checker: dict[str, Any] = {}


def check_released(variant: str) -> None:
    """After a point every worker has closed its connection: nobody may hold the key."""
    if variant in (RAW_PG, LIB_PG):
        if PG not in _checker:
            import psycopg

            _checker[PG] = psycopg.connect(**PG_PARAMS, autocommit=True)
        k = K + CONTENDED.index(variant)
        held = _checker[PG].execute("SELECT NOT pg_try_advisory_lock(%s)", (k,)).fetchone()[0]
        if not held:
            _checker[PG].execute("SELECT pg_advisory_unlock(%s)", (k,))
    elif variant in (RAW_MY, LIB_MY):
        if MY not in _checker:
            import MySQLdb

            _checker[MY] = MySQLdb.connect(**MY_PARAMS, autocommit=True)
        cursor = _checker[MY].cursor()
        name = MY_RAW_NAME if variant == RAW_MY else f"{MY_PARAMS['database']}/#{K + 3}"
        cursor.execute("SELECT IS_USED_LOCK(%s)", (name,))
        held = cursor.fetchone()[0] is not None
    else:
        import redis

        held = bool(redis.Redis(**REDIS_PARAMS).exists(f"{REDIS_NAME}-0-0"))
    if held:
        sys.exit(f"{variant}: the benchmark's lock is still held after the point.")


# Uncontended pairs, in this process.


def uncontended(pairs: int, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    variants = [RAW_PG, LIB_PG, RAW_MY, LIB_MY, REDIS_RAW, REDIS]
    clients = {variant: Client(variant, key_offset=500) for variant in variants}
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    try:
        for client in clients.values():
            client.pairs(min(pairs, 500))
        for _ in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            for variant in order:
                gc.collect()
                gc.disable()
                try:
                    started = time.perf_counter_ns()
                    clients[variant].pairs(pairs)
                    elapsed = time.perf_counter_ns() - started
                finally:
                    gc.enable()
                times[variant].append(elapsed / 1000 / pairs)
    finally:
        for client in clients.values():
            client.close()
    return times


# Reporting.


def uncontended_table(times: dict[str, list[float]], pairs: int, rounds: int) -> str:
    raw_of = {LIB_PG: RAW_PG, LIB_MY: RAW_MY, REDIS: REDIS_RAW}
    labels = {
        RAW_PG: "raw psycopg `pg_try_advisory_lock` + `pg_advisory_unlock` (autocommit)",
        LIB_PG: '`advisory_lock(k, using="postgresql", wait=False)`',
        RAW_MY: "raw MySQLdb `GET_LOCK(k, 0)` + `RELEASE_LOCK(k)`",
        LIB_MY: '`advisory_lock(k, using="mysql", wait=False)`',
        REDIS_RAW: "raw redis-py `SET k 1 NX` + `DEL k`",
        REDIS: "redis-py `Lock(r, k, blocking=False)`: acquire + release",
    }
    trips = {RAW_PG: 2, LIB_PG: 2, RAW_MY: 2, LIB_MY: 2, REDIS_RAW: 2, REDIS: 2}
    lines = [
        f"### Uncontended acquire + release, one process: medians of {rounds} rounds x "
        f"{pairs} pairs",
        "",
        "| variant | µs per pair | pairs/s | ratio to its raw | round trips | spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant, samples in times.items():
        median = statistics.median(samples)
        raw = statistics.median(times[raw_of.get(variant, variant)])
        spread = (max(samples) - min(samples)) / median
        lines.append(
            f"| {labels[variant]} | {median:.1f} | {1e6 / median:,.0f} | {raw / median:.2f} "
            f"| {trips[variant]} | {spread:.0%} |"
        )
    return "\n".join(lines)


def contention_tables(points: dict[tuple[str, int], Point], counts: list[int]) -> str:
    def med(variant: str, n: int, what: str) -> float:
        return statistics.median(getattr(points[variant, n], what))

    head = "| processes | " + " | ".join(CONTENDED)
    rule = "| ---: | " + " | ".join("---:" for _ in CONTENDED)
    out = ["### Acquisitions per second (successful tries), median over rounds", ""]
    out.append(head + " | library / raw, PostgreSQL | library / raw, MariaDB |")
    out.append(rule + " | ---: | ---: |")
    for n in counts:
        cells = [f"{med(v, n, 'acquired'):,.0f}" for v in CONTENDED]
        ratios = []
        for library, raw, _ in RATIOS:
            ratio = med(library, n, "acquired") / med(raw, n, "acquired")
            ratios.append(f"{ratio:.2f}" + ("" if ratio >= 0.95 else " (< 0.95)"))
        out.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    out += ["", "### Attempts (tries) per second, median over rounds", ""]
    out.append(head + " | library / raw, PostgreSQL | library / raw, MariaDB |")
    out.append(rule + " | ---: | ---: |")
    for n in counts:
        cells = [f"{med(v, n, 'attempts'):,.0f}" for v in CONTENDED]
        ratios = [
            f"{med(library, n, 'attempts') / med(raw, n, 'attempts'):.2f}"
            for library, raw, _ in RATIOS
        ]
        out.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    out += [
        "",
        "### Overlaps (two holders at once), errors and failed unlocks: sums over all rounds",
        "",
    ]
    out.append(head + " |")
    out.append(rule + " |")
    for n in counts:
        cells = []
        for v in CONTENDED:
            p = points[v, n]
            cells.append(f"{p.overlaps} / {p.errors} / {p.bad_unlocks}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if BLOCKING:
        out += ["", "### The target: library / raw >= 0.95 at every process count, 0 overlaps", ""]
        for library, raw, title in RATIOS:
            ratios = [med(library, n, "acquired") / med(raw, n, "acquired") for n in counts]
            overlaps = sum(points[library, n].overlaps for n in counts)
            verdict = "met" if min(ratios) >= 0.95 and overlaps == 0 else "MISSED"
            out.append(
                f"- {title}: library / raw {min(ratios):.2f} to {max(ratios):.2f} at "
                f"{counts[0]} to {counts[-1]} processes, {overlaps} overlaps ({verdict})"
            )
    out += ["", "### Share of the acquisitions taken by the busiest process, median", ""]
    out.append(head + " |")
    out.append(rule + " |")
    for n in counts:
        cells = [f"{med(v, n, 'busiest_share'):.0%}" for v in CONTENDED]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


STYLE = {
    RAW_PG: ("tab:blue", "--", "o"),
    LIB_PG: ("tab:blue", "-", "o"),
    RAW_MY: ("tab:orange", "--", "s"),
    LIB_MY: ("tab:orange", "-", "s"),
    REDIS: ("tab:red", "-", "^"),
}


def plot(runs: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> None:
    """Acquisitions/s (left) and attempts/s (right) against processes, log2 x axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 2, figsize=(13, 5.2))
    for (label, data), alpha in zip(runs, (1.0, 0.45), strict=False):
        counts = data["counts"]
        for variant in CONTENDED:
            colour, line, marker = STYLE[variant]
            for axis, what in zip(axes, ("acquired", "attempts"), strict=True):
                values = [
                    statistics.median(data["points"][f"{variant}|{n}"][what]) for n in counts
                ]
                axis.plot(
                    counts,
                    values,
                    color=colour,
                    linestyle=line,
                    marker=marker,
                    alpha=alpha,
                    label=f"{variant}{label}",
                )
    for axis, what in zip(axes, ("acquisitions per second", "attempts per second"), strict=True):
        axis.set_xscale("log", base=2)
        axis.set_xticks(runs[0][1]["counts"])
        axis.set_xticklabels([str(n) for n in runs[0][1]["counts"]])
        axis.set_xlabel("processes trying the same key")
        axis.set_ylabel(what)
        axis.set_ylim(bottom=0)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_title("Successful tries per second")
    axes[1].set_title("Tries per second")
    axes[1].legend(fontsize=7.5, loc="best")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2,4,8,16,32")
    parser.add_argument("--seconds", type=float, default=3.0, help="per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-us", type=float, default=100, help="busy µs under the lock")
    parser.add_argument("--pairs", type=int, default=3000, help="uncontended pairs per round")
    parser.add_argument("--pair-rounds", type=int, default=7)
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin workers and servers to CPU")
    parser.add_argument("--png", default=str(BENCH_DIR / "contention.png"))
    parser.add_argument("--json", help="save the results here")
    parser.add_argument("--overlay", help="a --json file of another run, drawn faded")
    parser.add_argument("--replot", help="measure nothing: draw this --json file (and --overlay)")
    parser.add_argument("--overlay-label", default=" (other run)")
    parser.add_argument("--quiet-wait", type=float, default=600, help="max s to wait for quiet")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--mode", choices=["try", "blocking"], default="try")
    args = parser.parse_args(argv)
    global BLOCKING
    BLOCKING = args.mode == "blocking"
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        runs = [(" (pinned)" if data["pinned"] else "", data)]
        if args.overlay:
            runs.append((args.overlay_label, json.loads(Path(args.overlay).read_text())))
        plot(runs, Path(args.png), data.get("title", ""))
        return
    counts = [int(n) for n in args.processes.split(",")]
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    quiet = wait_until_quiet(args.quiet_wait)
    revision = library_revision()  # read when the code is imported (now), not at the end
    work = args.work_us / 1e6
    markers = Path(
        tempfile.mkdtemp(
            prefix="contention-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    points = {(v, n): Point(v, n) for v in CONTENDED for n in counts}
    with pinned(args.pin):
        note = affinity_note()
        pool = Pool(max(counts))
        try:
            for number in range(args.rounds):
                order = list(points)
                rng.shuffle(order)
                for key in order:
                    run_point(pool, points[key], args.seconds, work, markers)
                print(
                    f"  … contention round {number + 1}/{args.rounds} done",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            pool.close()
            shutil.rmtree(markers, ignore_errors=True)
        times = uncontended(args.pairs, args.pair_rounds, rng)
    pinning = "pinned" if args.pin is not None else "NOT pinned"
    header = [
        "# advisory_lock under contention on one key, and Redis",
        "",
        f"- {revision}; {quiet}",
        f"- {note} ({pinning}); {os.cpu_count()} CPUs",
        f"- Django {django.get_version()}; psycopg {dist_version('psycopg')}; mysqlclient "
        f"{dist_version('mysqlclient')}; redis-py {dist_version('redis')}; "
        f"Python {sys.version.split()[0]}",
        f"- mode: {args.mode}; contention: {args.rounds} rounds x {args.seconds:g} s per "
        f"point, critical section "
        f"{args.work_us:g} µs of busy CPU, points in a new random order each round (seed {seed})",
    ]
    print("\n".join(header) + "\n")
    print(uncontended_table(times, args.pairs, args.pair_rounds) + "\n")
    print(contention_tables(points, counts))
    verb = "lock (waiting)" if BLOCKING else "try"
    title = (
        f"One key, N processes looping {verb} → {args.work_us:g} µs busy → unlock; "
        f"{os.cpu_count()} CPUs, {pinning}; medians of {args.rounds} x {args.seconds:g} s"
    )
    data = {
        "title": title,
        "revision": revision,
        "counts": counts,
        "pinned": args.pin is not None,
        "mode": args.mode,
        "points": {f"{v}|{n}": asdict(p) for (v, n), p in points.items()},
        "uncontended": times,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    runs = [(" (pinned)" if args.pin is not None else "", data)]
    if args.overlay:
        runs.append((args.overlay_label, json.loads(Path(args.overlay).read_text())))
    try:
        plot(runs, Path(args.png), title)
    except ImportError:  # the tables are the measurement; the curve needs matplotlib
        print("\n(no curve drawn: matplotlib is not installed; `make bench` installs it)")
    else:
        print(f"\n(curve: {args.png})")


if __name__ == "__main__":
    main()
