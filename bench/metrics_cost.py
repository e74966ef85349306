"""What the OpenTelemetry metrics cost an uncontended acquire + release, off and on.

    .venv/bin/python bench/metrics_cost.py [--pairs 5000] [--rounds 7] [--only postgresql|mysql]
                                           [--baseline REV] [--seed N]
    taskset -c 0 .venv/bin/python bench/metrics_cost.py ...   # the client on one CPU

``with advisory_lock(k, using=alias, wait=False): pass``, ``--pairs`` times per round, in
four variants per database, each in a worker process of its own (set up and warmed up once):

- "before": the package as it was before the metrics were added (``--baseline``, default the
  parent of the commit that added ``advisory_lock/metrics.py``, extracted with
  ``git archive``); on the uncontended path it differs from this checkout only by the
  metrics hooks;
- "off" and "off, again": this checkout with ``METRICS`` off, twice: the gap between the two
  is the noise of the run (an A/A comparison);
- "on": this checkout with ``METRICS = "opentelemetry"`` and an SDK ``MeterProvider`` whose
  reader (in memory, as a pull exporter such as Prometheus's) is never collected during the
  loop: the cost of recording, not of exporting.

Only one worker runs at a time; every round runs all variants of both databases in a new
random order, and the table gives medians over the rounds, "spread" ((slowest round -
fastest round) / median) and each variant's time relative to "before".
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
KEY = 0x5EED_1000  # + the variant's number: no variant sees another's hold


# The worker: one variant, driven over stdin/stdout (one JSON line per command).


def worker(code: str, alias: str, metrics_on: bool, key: int) -> None:
    """Set up Django with the package in ``code``, then answer "run N" with µs per pair."""
    sys.path.insert(0, str(BENCH_DIR))
    sys.path.insert(0, code)  # this version of advisory_lock, before the installed one

    import django
    from django.conf import settings
    from servers import databases

    if metrics_on:
        # As a project would: the provider first, then Django (the app reads METRICS).
        from opentelemetry import metrics as otel
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        otel.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        DATABASES=databases(),
        INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        ADVISORY_LOCK={"METRICS": "opentelemetry"} if metrics_on else {},
    )
    django.setup()

    import advisory_lock
    from advisory_lock import advisory_lock as lock

    assert Path(advisory_lock.__file__).resolve().is_relative_to(Path(code).resolve()), (
        f"measuring {advisory_lock.__file__}, not the package in {code}"
    )
    recording = _recording()
    assert recording == metrics_on, f"metrics {'on' if recording else 'off'}, wanted the other"

    def loop(n: int) -> None:
        for _ in range(n):
            with lock(key, using=alias, wait=False) as handle:
                if not handle:
                    raise SystemExit(f"{alias}: key {key} busy: is another benchmark running?")

    loop(500)  # the connection, prepared statements, caches
    _answer({"ready": True, "file": advisory_lock.__file__})
    for line in sys.stdin:
        if line.startswith("record"):
            _answer({"cpu": _recording_alone(alias, int(line.split()[1]))})
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


def _recording_alone(alias: str, pairs: int) -> float:
    """CPU µs per pair of what the recorder does for an acquire + release, without the lock."""
    from django.db import connections

    from advisory_lock import metrics

    recorder, vendor = metrics.recorder, connections[alias].vendor
    assert recorder is not None
    start = time.process_time_ns()
    for _ in range(pairs):
        recorder.acquisition("acquired", vendor, alias, 0.00005)
        recorder.held(0.00001, vendor, alias)
    return (time.process_time_ns() - start) / 1000 / pairs


def _recording() -> bool:
    try:
        from advisory_lock import metrics
    except ImportError:  # the package from before the metrics
        return False
    return metrics.recorder is not None


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# The driver.


@dataclass
class Variant:
    database: str
    label: str
    code: str
    metrics_on: bool
    key: int
    process: subprocess.Popen[str] | None = None
    wall: list[float] = field(default_factory=list)  # µs per pair, one per round
    cpu: list[float] = field(default_factory=list)  # the worker's CPU µs per pair

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", self.code, self.database, str(self.key)]
            + (["--metrics"] if self.metrics_on else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tempfile.gettempdir(),  # nothing from the checkout on the path by accident
        )
        self.read()

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

    def recording_alone(self, pairs: int) -> float:
        """CPU µs per pair of the recorder's calls alone (a worker with the metrics on)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(f"record {pairs}\n")
        self.process.stdin.flush()
        cpu: float = self.read()["cpu"]
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


def default_baseline() -> str:
    added = git("log", "--diff-filter=A", "--format=%H", "--", "advisory_lock/metrics.py")
    if not added:
        raise SystemExit("advisory_lock/metrics.py is not committed: pass --baseline REV.")
    return f"{added.splitlines()[-1][:7]}^"


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
        "| spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant in variants:
        wall, cpu = median(variant.wall), median(variant.cpu)
        lines.append(
            f"| {variant.label} | {wall:.1f} | {wall / wall0:.3f} | {spread(variant.wall):.0%} "
            f"| {cpu:.1f} | {cpu / cpu0:.3f} | {spread(variant.cpu):.0%} |"
        )
    by_label = {variant.label: variant for variant in variants}
    off, again, on = by_label["off"], by_label["off, again"], by_label["on"]
    for what, name in (("wall", "time"), ("cpu", "client CPU")):
        before_m = median(getattr(variants[0], what))
        off_m, again_m, on_m = (median(getattr(v, what)) for v in (off, again, on))
        lines.append(
            f"{'' if what == 'cpu' else chr(10)}- {name}: noise (off, again / off) "
            f"{again_m / off_m - 1:+.1%}; off / before {off_m / before_m - 1:+.1%}; "
            f"on / off {on_m / off_m - 1:+.1%} ({on_m - off_m:+.1f} µs per pair)"
        )
    lines.append(
        f"- the recorder's calls alone for one pair (an acquisition and a hold, no lock): "
        f"{alone:.1f} µs of CPU"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=["postgresql", "mysql"])
    parser.add_argument("--baseline", help="revision before the metrics (default: found)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--worker", nargs=3, metavar=("CODE", "ALIAS", "KEY"), help=argparse.SUPPRESS
    )
    parser.add_argument("--metrics", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code, alias, key = args.worker
        return worker(code, alias, args.metrics, int(key))

    baseline_dir = Path(tempfile.mkdtemp(prefix="bench-metrics-before-"))
    try:
        revision = args.baseline or default_baseline()
        before = extract(revision, baseline_dir)
        databases = [args.only] if args.only else ["postgresql", "mysql"]
        variants: list[Variant] = []
        for database in databases:
            for label, code, on in (
                (f"before (`{before}`, no metrics)", str(baseline_dir), False),
                ("off", str(ROOT), False),
                ("off, again", str(ROOT), False),
                ("on", str(ROOT), True),
            ):
                variants.append(Variant(database, label, code, on, KEY + len(variants)))
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
            v.database: median([v.recording_alone(args.pairs) for _ in range(args.rounds)])
            for v in variants
            if v.metrics_on
        }
        for variant in variants:
            variant.stop()
    finally:
        shutil.rmtree(baseline_dir, ignore_errors=True)

    sys.path.insert(0, str(BENCH_DIR))
    from fleet import library_revision

    client = os.sched_getaffinity(0)
    print("# advisory_lock: the cost of the OpenTelemetry metrics, uncontended")
    print()
    print(f"- {library_revision()}; before = `{revision}` = `{before}`")
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
