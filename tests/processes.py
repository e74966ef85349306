"""Start ``python -m tests.worker`` processes (and ``tests.scheduler_child``, the same way) and
talk to them, line by line, with time bounds.

A worker writes one JSON object per line on stdout (``{"event": ..., ...}``) and reads
commands, one per line, on stdin. Every read here has a deadline, so a stuck worker fails the
test instead of hanging it, and ``Workers.kill_all`` makes sure none outlives its test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: How long any single exchange with a worker may take before the test counts it as hung: a
#: guard, not a timing (a loaded 2-core machine takes seconds to start a Django process).
DEFAULT_TIMEOUT = 300.0


class WorkerError(AssertionError):
    """A worker said something unexpected, said nothing in time, or exited."""


class Worker:
    """One ``python -m tests.worker`` process."""

    def __init__(self, args: list[str], env: dict[str, str], module: str = "tests.worker") -> None:
        self.args = args
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    def __repr__(self) -> str:
        return f"<worker pid={self.proc.pid} {' '.join(self.args)}>"

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _fail(self, message: str) -> WorkerError:
        return WorkerError(f"{self!r}: {message}\n--- its stderr ---\n{self.stderr()}")

    def message(self, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """The next message; fail if none comes within ``timeout`` seconds."""
        found = self._next_line(timeout)
        if found is None:
            raise self._fail(f"said nothing within {timeout:g}s")
        return found

    def poll(self) -> dict[str, Any] | None:
        """The next message if one is already there, else None (never waits)."""
        return self._next_line(0)

    def _next_line(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                rc = self.proc.wait(DEFAULT_TIMEOUT)
                raise self._fail(f"exited with status {rc} before saying anything more")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise self._fail(f"wrote a line that is not JSON: {line!r}") from None

    def expect(self, event: str, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """The next message, which must be ``event``."""
        found = self.message(timeout)
        if found.get("event") != event:
            raise self._fail(f"expected {event!r}, got {found!r}")
        return found

    def send(self, line: str) -> None:
        """Write one command line to the worker's stdin."""
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Close stdin and wait for a clean exit (status 0)."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self._fail(f"still running {timeout:g}s after its stdin was closed") from None
        if rc != 0:
            raise self._fail(f"exited with status {rc}")

    def kill(self) -> None:
        """SIGKILL the worker (if still running) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(DEFAULT_TIMEOUT)
        for stream in (self.proc.stdin, self.proc.stdout):
            if not stream.closed:
                stream.close()
        self._stderr.close()


class SchedulerChild(Worker):
    """One ``python -m tests.scheduler_child`` process: a scheduler driven step by step."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(args, env, module="tests.scheduler_child")

    def command(self, verb: str, slot: str, name: str, options: dict[str, Any]) -> None:
        self.send(f"{verb} {slot} {json.dumps({'name': name, **options})}")


class Workers:
    """Starts workers for one test; ``kill_all`` (in a finally) ends every one of them."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "ADVISORY_LOCK_TEST_WORKER": "1",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        # Workers use the alias they are told to, not a server database as "default".
        self.env.pop("ADVISORY_LOCK_TEST_DEFAULT", None)
        self.started: list[Worker] = []

    def start(self, *args: str) -> Worker:
        worker = Worker([str(arg) for arg in args], self.env)
        self.started.append(worker)
        return worker

    def kill_all(self) -> None:
        for worker in self.started:
            worker.kill()


def start_run_jobs(
    folder: Path, number: int, argv: tuple[str, ...], env: dict
) -> subprocess.Popen:
    """``manage.py run_jobs *argv`` in a session of its own, with ``env``; its stdout and
    stderr in ``folder``'s ``run_jobs.<number>.out`` and ``.err``: files, not pipes, which its
    job processes inherit and nobody has to drain."""
    with (
        open(folder / f"run_jobs.{number}.out", "w") as out,
        open(folder / f"run_jobs.{number}.err", "w") as err,
    ):
        return subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "run_jobs", *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
