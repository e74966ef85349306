"""Single-instance commands: what a busy instance costs, and what the watchdog costs.

    .venv/bin/python bench/commands.py [--runs 15] [--only sqlite|postgresql|mysql]

Skip latency: the wall time from start to exit of ``manage.py job`` while another instance
holds its lock, against the same command without ``@single_instance`` (Django's start-up
dominates both). A busy instance exits before Django's system checks run, so the two are
also compared with ``--skip-checks``: that difference is what the lock adds (a connection
and two statements). Runs alternate, medians reported. Watchdog: the statements its heartbeat
sends per minute, counted on the lock's connection during a run with a short heartbeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URLS = {
    "sqlite": "sqlite:///{dir}/bench.sqlite3",
    "postgresql": "postgres://postgres@127.0.0.1:5432/test",
    "mysql": "mysql://root@127.0.0.1:3306/test",
}
COMMAND = """
import time
from django.core.management.base import BaseCommand
{imports}

{decorator}
class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=0)

    def handle(self, *args, seconds, **options):
        print("working", flush=True)
        time.sleep(seconds)
"""
SETTINGS = """
import os
from testproject.database_url import parse
SECRET_KEY = "bench"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes", "django.contrib.auth", "advisory_lock", "benchapp"
]
DATABASES = {"default": parse(os.environ["DATABASE_URL"], None)}
"""


def make_project(folder: Path) -> None:
    commands = folder / "benchapp" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (folder / "benchapp", commands.parent, commands):
        (package / "__init__.py").write_text("")
    locked = COMMAND.format(
        imports="from advisory_lock import single_instance", decorator="@single_instance"
    )
    (commands / "locked_job.py").write_text(locked)
    (commands / "plain_job.py").write_text(COMMAND.format(imports="", decorator=""))
    (folder / "bench_settings.py").write_text(SETTINGS)


def run(folder: Path, url: str, *argv: str, wait: bool = True):
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "bench_settings",
        "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "django", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if wait:
        process.communicate()
    return process


def skip_latency(folder: Path, url: str, runs: int) -> list[float]:
    """Median ms: busy, plain, busy with --skip-checks, plain with --skip-checks."""
    holder = run(folder, url, "locked_job", "--seconds", "600", wait=False)
    assert holder.stdout.readline().strip() == "working"
    variants = [
        ("locked_job",),
        ("plain_job",),
        ("locked_job", "--skip-checks"),
        ("plain_job", "--skip-checks"),
    ]
    times: list[list[float]] = [[] for _ in variants]
    try:
        for _ in range(runs):
            for argv, samples in zip(variants, times, strict=True):
                started = time.perf_counter()
                process = run(folder, url, *argv)
                samples.append(time.perf_counter() - started)
                assert process.returncode == 0
    finally:
        holder.kill()
        holder.communicate()
    return [statistics.median(samples) * 1000 for samples in times]


def watchdog_statements_per_minute(url: str, heartbeat: float, seconds: float) -> float:
    """Count the statements on a held lock's own connection while its watchdog runs."""
    from django.db import connections

    from advisory_lock.dedicated import DedicatedLock
    from testproject.database_url import parse

    # An alias per URL: Django keeps a thread's connection object per alias, so reusing one
    # alias for the next database would lock on the previous one's connection.
    alias = f"bench_{url.split(':', 1)[0]}"
    connections.settings[alias] = connections.configure_settings(
        {"default": parse(url, None), alias: parse(url, None)}
    )[alias]
    lock = DedicatedLock("bench:watchdog", using=alias, label="bench")
    assert lock.acquire(0)
    lock.connection.force_debug_cursor = True
    lock.watch(heartbeat, on_lost=lambda: None)
    time.sleep(seconds)
    count = len(lock.connection.queries_log)
    lock.release()
    del connections.settings[alias]
    return count * 60 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--only", choices=sorted(URLS))
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-bench-"))
    make_project(folder)
    sys.path[:0] = [str(folder), str(ROOT)]
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench_settings"
    os.environ["DATABASE_URL"] = URLS["sqlite"].format(dir=folder)
    import django

    django.setup()
    heartbeat, seconds = 0.5, 10.0
    print(f"Medians of {options.runs} runs; watchdog heartbeat {heartbeat}s over {seconds:g}s\n")
    print(
        "| database | busy instance, start to exit (ms) | same command, no lock (ms) "
        "| both with --skip-checks (ms) | lock's cost (ms) "
        "| watchdog statements / min at heartbeat 0.5 s | at the default 10 s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in [options.only] if options.only else ["sqlite", "postgresql", "mysql"]:
        url = URLS[name].format(dir=folder)
        run(folder, url, "migrate", "--verbosity", "0")
        busy, plain, busy_unchecked, plain_unchecked = skip_latency(folder, url, options.runs)
        per_minute = watchdog_statements_per_minute(url, heartbeat, seconds)
        print(
            f"| {name} | {busy:.0f} | {plain:.0f} | {busy_unchecked:.0f} / "
            f"{plain_unchecked:.0f} | {busy_unchecked - plain_unchecked:+.0f} | "
            f"{per_minute:.0f} | {per_minute * heartbeat / 10:.0f} |"
        )


if __name__ == "__main__":
    main()
