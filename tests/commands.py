"""Start management commands as real processes against the test databases."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How long a step may take before the test counts the command as hung: a guard, not a timing
#: (a loaded 2-core machine takes seconds to start a Django process).
HANG = 300.0


def command_env(alias: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": alias,
        "PYTHONUNBUFFERED": "1",
    }


def start(alias: str, *argv: str, program: list[str] | None = None) -> subprocess.Popen:
    """Start ``manage.py *argv`` (or ``program``) with ``alias`` as the default database."""
    program = program or [sys.executable, str(ROOT / "manage.py")]
    return subprocess.Popen(
        [*program, *argv],
        cwd=ROOT,
        env=command_env(alias),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, prefix: str, timeout: float = HANG) -> str:
    """Read the process's stdout until a line starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            line = process.stdout.readline()
            if line.startswith(prefix):
                return line
            if line == "" and process.poll() is not None:
                break
    raise AssertionError(f"no {prefix!r} line; stderr: {process.stderr.read()}")


def finish(process: subprocess.Popen, timeout: float = HANG) -> tuple[int, str, str]:
    """Wait for the process; return (exit status, stdout, stderr)."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err
