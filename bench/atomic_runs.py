"""What ``atomic=True`` costs: a ledger run whose one write commits with its success, against
a plain run with the same write.

    .venv/bin/python bench/atomic_runs.py [--runs 100] [--rounds 7]
        [--only postgresql|mysql|sqlite]

Each run is ``run_once(job, period=<a new slot each time>, using=alias)`` around one UPDATE of
a counter on the ledger's database. The plain run's UPDATE commits at once (autocommit) and the
ledger records the success afterwards; the atomic run's UPDATE and the fenced success commit in
one transaction (``lock_running_row`` first, then the body, then ``succeed_in_transaction``).
Each round measures both, in a random order; the table gives the medians over the rounds of
the median run, their spread ((slowest round - fastest round) / median) and the ratio
atomic / plain. The databases are the test servers' ``test`` database and a temporary SQLite
file.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

from bench.servers import MY  # noqa: E402
from bench.servers import PG  # noqa: E402
from bench.servers import databases  # noqa: E402

SQLITE = Path(tempfile.gettempdir()) / "advisory-lock-bench-atomic.sqlite3"
DATABASES = databases({"ENGINE": "django.db.backends.sqlite3", "NAME": str(SQLITE)})
settings.configure(
    USE_TZ=True,
    SECRET_KEY="bench",
    INSTALLED_APPS=[
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "advisory_lock",
        "testproject.example",
    ],
    DATABASES=DATABASES,
)
django.setup()

from django.core.management import call_command  # noqa: E402
from django.db.models import F  # noqa: E402

from advisory_lock import run_once  # noqa: E402
from advisory_lock.models import JobRun  # noqa: E402
from testproject.example.models import Counter  # noqa: E402

ALIASES = {"postgresql": PG, "mysql": MY, "sqlite": "default"}
slots = itertools.count()


def one_run(alias: str, atomic: bool) -> float:
    """Seconds for one run of a new slot, with its write."""
    slot = f"bench-{next(slots)}"
    started = time.perf_counter()
    with run_once("bench.atomic", period=lambda _now: slot, using=alias, atomic=atomic) as run:
        assert run is not None
        Counter.objects.using(alias).filter(name="bench").update(value=F("value") + 1)
    return time.perf_counter() - started


def measure(name: str, runs: int, rounds: int) -> dict[str, list[float]]:
    alias = ALIASES[name]
    call_command("migrate", database=alias, verbosity=0)
    Counter.objects.using(alias).get_or_create(name="bench")
    JobRun.objects.using(alias).filter(job_name="bench.atomic").delete()
    for atomic in (False, True):  # warm-up: connections, prepared statements
        for _ in range(5):
            one_run(alias, atomic)
    medians: dict[str, list[float]] = {"plain": [], "atomic": []}
    for _ in range(rounds):
        order = [False, True]
        random.shuffle(order)
        for atomic in order:
            times = [one_run(alias, atomic) for _ in range(runs)]
            medians["atomic" if atomic else "plain"].append(statistics.median(times) * 1000)
    JobRun.objects.using(alias).filter(job_name="bench.atomic").delete()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=list(ALIASES))
    args = parser.parse_args()
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"revision {revision}: {args.runs} runs x {args.rounds} rounds, medians (ms)")
    print("| database | plain run | spread | atomic=True | spread | atomic / plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in [args.only] if args.only else list(ALIASES):
        medians = measure(name, args.runs, args.rounds)
        plain, atomic = (statistics.median(medians[kind]) for kind in ("plain", "atomic"))

        def spread(values: list[float]) -> str:
            return f"{(max(values) - min(values)) / statistics.median(values):.0%}"

        print(
            f"| {name} | {plain:.2f} | {spread(medians['plain'])} | {atomic:.2f} | "
            f"{spread(medians['atomic'])} | {atomic / plain:.2f} |"
        )
    SQLITE.unlink(missing_ok=True)
    shutil.rmtree(f"{SQLITE}.locks", ignore_errors=True)  # the SQLite backend's lock files


if __name__ == "__main__":
    main()
