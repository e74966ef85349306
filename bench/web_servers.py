"""The counter view under real servers, with and without the lock; and what ``async with
advisory_lock(...)`` costs against the sync lock wrapped in ``sync_to_async`` by hand.

    .venv/bin/python bench/web_servers.py [--requests 1000] [--concurrency 16] [--rounds 5]
                                          [--workers 4] [--pairs 2000] [--only postgresql|mysql]
                                          [--seed N]

1. Throughput: the test project served by gunicorn (sync workers: ``increment_counter``) and
   by uvicorn (ASGI workers: its async twin ``aincrement_counter``, and the sync view too),
   ``--workers`` each, on the bench databases of PostgreSQL and MariaDB (``bench/servers.py``;
   each request opens its connection: Django's default CONN_MAX_AGE=0). Every round sends
   ``--requests`` POSTs from ``--concurrency`` client threads (a new connection each, as
   gunicorn's sync workers close them) to each variant, the variants in a new random order
   each round, after one round of warm-up. Requests/s are medians over the rounds; latency
   is from connecting to the answer's last byte, over every request of every round; "lost"
   is requests answered 200 minus the counter's final value (the lost updates), median.
2. The lock in async code, in one event loop, uncontended: ``async with advisory_lock(...)``
   against the sync lock's ``acquire()`` and ``release()`` each awaited through
   ``sync_to_async(thread_sensitive=True)`` (the same two hops, as an awaited body needs), the
   whole sync ``with`` block in one hop (a body that does not await), and the sync ``with``
   alone (all pairs in one hop). Microseconds per acquire + release, medians of the rounds;
   "ratio" is the variant's time divided by the hand-wrapped two hops'. The hand-wrapped
   hops are not a safe replacement: tasks sharing the connection would share its locks.

The client, the servers and the databases share this machine's CPUs: the figures compare the
variants with each other, they are not a server's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter as Tally
from collections.abc import Awaitable
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH_DIR))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import library_revision  # noqa: E402
from servers import MY  # noqa: E402
from servers import MY_PARAMS  # noqa: E402
from servers import PG  # noqa: E402
from servers import PG_PARAMS  # noqa: E402
from servers import databases  # noqa: E402

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES=databases(),
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock", "testproject.example"],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

from asgiref.sync import sync_to_async  # noqa: E402
from django.db import connections  # noqa: E402

from advisory_lock import advisory_lock  # noqa: E402
from testproject.example.models import Counter  # noqa: E402
from tests.http_servers import post_many  # noqa: E402
from tests.http_servers import serving  # noqa: E402

#: The servers' DATABASE_URL (testproject/settings.py) for each bench database.
URLS = {
    PG: "postgres://{user}@{host}:{port}/{dbname}".format(**PG_PARAMS),
    MY: "mysql://{user}@{host}:{port}/{database}".format(**MY_PARAMS),
}
NAMES = {PG: "PostgreSQL", MY: "MariaDB"}
#: (server, view, path): each server's view with the lock and without it, and the sync view
#: under uvicorn, which runs it in a thread of the request's own, so its lock waits in the
#: database as under gunicorn (the async view's waits are awaited tries).
VARIANTS = [
    ("gunicorn", "sync", "/counter/increment/"),
    ("gunicorn", "sync", "/counter/increment-unlocked/"),
    ("uvicorn", "async", "/counter/aincrement/"),
    ("uvicorn", "async", "/counter/aincrement-unlocked/"),
    ("uvicorn", "sync", "/counter/increment/"),
]


@dataclass
class Load:
    alias: str
    kind: str
    view: str
    path: str
    rates: list[float] = field(default_factory=list)  # requests/s, one per round
    lost: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # ms, every request of every round
    failed: Tally[int] = field(default_factory=Tally)  # answers other than 200, by status

    @property
    def locked(self) -> bool:
        return "unlocked" not in self.path

    @property
    def name(self) -> str:
        return f"bench-{self.kind}{self.path.replace('/', '-')}"


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def run_load(load: Load, url: str, requests: int, concurrency: int) -> None:
    Counter.objects.using(load.alias).update_or_create(name=load.name, defaults={"value": 0})
    started = time.perf_counter()
    answers = post_many(f"{url}?name={load.name}", requests, concurrency)
    elapsed = time.perf_counter() - started
    ok = sum(answer.status == 200 for answer in answers)
    final = Counter.objects.using(load.alias).get(name=load.name).value
    load.rates.append(requests / elapsed)
    load.lost.append(ok - final)
    load.latencies.extend(answer.seconds * 1000 for answer in answers)
    load.failed.update(answer.status for answer in answers if answer.status != 200)


def throughput(aliases: list[str], args: argparse.Namespace) -> str:
    loads = [Load(alias, *variant) for alias in aliases for variant in VARIANTS]
    shuffled = list(loads)
    with ExitStack() as stack:
        servers = {}
        for alias in aliases:
            env = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "testproject.settings",
                "DATABASE_URL": URLS[alias],
            }
            subprocess.run(
                [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
                cwd=ROOT,
                env=env,
                check=True,
            )
            for kind in ("gunicorn", "uvicorn"):
                servers[alias, kind] = stack.enter_context(serving(kind, env, args.workers))
        for round_number in range(args.rounds + 1):  # round 0 warms up
            random.shuffle(shuffled)
            for load in shuffled:
                url = servers[load.alias, load.kind].url(load.path)
                run_load(load, url, args.requests, args.concurrency)
            if round_number == 0:
                for load in loads:
                    load.rates.clear()
                    load.lost.clear()
                    load.latencies.clear()
                    load.failed.clear()
    for alias in aliases:
        connections[alias].close()

    rows = [
        "| database | server | view | lock | requests/s | spread | latency p50 / p99 / max (ms) "
        "| lost updates | not 200 |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for load in loads:
        rate = statistics.median(load.rates)
        centiles = statistics.quantiles(load.latencies, n=100)
        latency = f"{centiles[49]:.0f} / {centiles[98]:.0f} / {max(load.latencies):.0f}"
        failed = ", ".join(f"{count} x {status}" for status, count in sorted(load.failed.items()))
        rows.append(
            f"| {NAMES[load.alias]} | {load.kind} | {load.view} | "
            f"{'yes' if load.locked else 'no'} | {rate:,.0f} | {spread(load.rates):.0%} | "
            f"{latency} | {statistics.median(load.lost):,.0f} | {failed or 0} |"
        )
    ratios = [
        f"{NAMES[locked.alias]} {locked.kind} ({locked.view}) "
        f"{statistics.median(locked.rates) / statistics.median(unlocked.rates):.2f}"
        for locked, unlocked in itertools.pairwise(loads)
        if (locked.kind, locked.view, locked.locked, unlocked.locked)
        == (unlocked.kind, unlocked.view, True, False)
    ]
    return (
        "\n".join(rows)
        + "\n\nRequests/s with the lock divided by without: "
        + ", ".join(ratios)
        + "."
    )


# Part 2: the lock in async code.


def async_variants(alias: str) -> dict[str, Callable[[int], Awaitable[None]]]:
    lock = advisory_lock(f"bench:async:{alias}", using=alias)
    acquire = sync_to_async(lock.acquire, thread_sensitive=True)
    release = sync_to_async(lock.release, thread_sensitive=True)

    def block() -> None:
        with lock:
            pass

    in_one_hop = sync_to_async(block, thread_sensitive=True)

    async def async_with(n: int) -> None:
        for _ in range(n):
            async with lock:
                pass

    async def two_hops(n: int) -> None:
        for _ in range(n):
            handle = await acquire()
            await release(handle)

    async def one_hop(n: int) -> None:
        for _ in range(n):
            await in_one_hop()

    async def no_hop(n: int) -> None:
        def loop() -> None:
            for _ in range(n):
                with lock:
                    pass

        await sync_to_async(loop, thread_sensitive=True)()

    return {
        "`async with advisory_lock(...)`": async_with,
        "`acquire()` and `release()`, each awaited through `sync_to_async`": two_hops,
        "the sync `with` block in one `sync_to_async` hop": one_hop,
        "the sync `with` block alone (all pairs in one hop)": no_hop,
    }


def async_cost(aliases: list[str], args: argparse.Namespace) -> str:
    async def main() -> dict[tuple[str, str], list[float]]:
        variants = [
            (alias, label, run)
            for alias in aliases
            for label, run in async_variants(alias).items()
        ]
        times: dict[tuple[str, str], list[float]] = {(a, label): [] for a, label, _ in variants}
        for _alias, _label, run in variants:  # warm-up: connections opened, code paths hot
            await run(100)
        for _ in range(args.rounds):
            random.shuffle(variants)
            for alias, label, run in variants:
                started = time.perf_counter()
                await run(args.pairs)
                times[alias, label].append((time.perf_counter() - started) / args.pairs * 1e6)
        await sync_to_async(connections.close_all, thread_sensitive=True)()
        return times

    times = asyncio.run(main())
    rows = [
        "| database | variant | µs per acquire + release | ratio | spread |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    labels = list(async_variants(aliases[0]))
    for alias in aliases:
        reference = statistics.median(times[alias, labels[1]])
        for label in labels:
            median = statistics.median(times[alias, label])
            rows.append(
                f"| {NAMES[alias]} | {label} | {median:.0f} | {median / reference:.2f} | "
                f"{spread(times[alias, label]):.0%} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--only", choices=[PG, MY])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--part", choices=["async", "servers", "both"], default="both", help="what to measure"
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    random.seed(seed)
    aliases = [args.only] if args.only else [PG, MY]

    print(
        f"bench/web_servers.py, {library_revision()}; Django {django.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, unpinned; seed {seed}\n"
    )
    if args.part in ("async", "both"):
        print(
            f"## The lock in async code ({args.rounds} rounds x {args.pairs} pairs, "
            f"uncontended, one event loop)\n"
        )
        print(async_cost(aliases, args))
    if args.part == "async":
        return
    print(
        f"\n## The counter view under gunicorn and uvicorn ({args.workers} workers each; "
        f"{args.rounds} rounds x {args.requests} POSTs from {args.concurrency} client threads)\n"
    )
    print(throughput(aliases, args))


if __name__ == "__main__":
    main()
