"""Serve the test project with gunicorn, uvicorn or Django's runserver, and send it many POSTs
at once.

Used by ``tests/test_web_servers.py``, ``bench/web_servers.py``, and for a browser by
``tests/browser.py`` and ``scripts/screenshot.py``. A server runs in a process
group of its own, so that stopping it ends its workers too, even when its master is stuck.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
#: The server command line for each kind: gunicorn's sync workers run the WSGI app (without
#: gunicorn's control socket, whose one path per user two servers would share), uvicorn's
#: workers the ASGI app (Django's ASGI handler has no lifespan support: off).
COMMANDS = {
    "gunicorn": lambda port, workers: [
        *("-m", "gunicorn", "--worker-class", "sync", "--workers", str(workers)),
        *("--bind", f"{HOST}:{port}", "--no-control-socket", "testproject.wsgi:application"),
    ],
    "uvicorn": lambda port, workers: [
        *("-m", "uvicorn", "--workers", str(workers), "--host", HOST, "--port", str(port)),
        *("--lifespan", "off", "--no-access-log", "testproject.asgi:application"),
    ],
    # Django's development server, for a browser (tests/browser.py, scripts/screenshot.py):
    # one process, a thread per request (``workers`` does not apply), and the admin's static
    # files served by staticfiles' runserver even with DEBUG off (--insecure).
    "runserver": lambda port, workers: [
        *(str(ROOT / "manage.py"), "runserver", "--noreload", "--insecure", f"{HOST}:{port}"),
    ],
}
#: A path that answers any request once Django is loaded (405: the view wants a POST).
READY_PATH = "/counter/increment/"


def free_port() -> int:
    """A TCP port of the loopback interface that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class Answer:
    """One HTTP response, and the seconds from connecting to its last byte."""

    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)


def post(url: str, *, timeout: float = 30.0) -> Answer:
    """POST an empty body to ``url`` (``http://host:port/path?query``) on a new connection."""
    rest = url.removeprefix("http://")
    address, _, path = rest.partition("/")
    host, _, port = address.partition(":")
    started = time.perf_counter()
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", "/" + path, headers={"Connection": "close"})
        response = connection.getresponse()
        body = response.read()
        seconds = time.perf_counter() - started
        return Answer(response.status, dict(response.getheaders()), body, seconds)
    finally:
        connection.close()


def post_many(url: str, count: int, concurrency: int) -> list[Answer]:
    """POST ``count`` times to ``url`` from ``concurrency`` client threads at once."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: post(url), range(count)))


class WebServer:
    """A gunicorn, uvicorn or runserver server of the test project, with ``workers`` worker
    processes (runserver: threads)."""

    def __init__(self, kind: str, env: dict[str, str], workers: int = 4) -> None:
        self.kind = kind
        self.port = free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, *COMMANDS[kind](self.port, workers)],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own: see stop()
        )

    def __repr__(self) -> str:
        return f"<{self.kind} pid={self.proc.pid} port={self.port}>"

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def output(self) -> str:
        """What the server and its workers wrote so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once Django answers; fail if the server exits or ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self!r} exited with status {self.proc.returncode} before answering:\n"
                    f"{self.output()}"
                )
            with contextlib.suppress(OSError):
                connection = http.client.HTTPConnection(HOST, self.port, timeout=5)
                try:
                    connection.request("GET", READY_PATH)
                    if connection.getresponse().status == 405:
                        return
                finally:
                    connection.close()
            time.sleep(0.1)
        raise RuntimeError(f"{self!r} did not answer within {timeout:g}s:\n{self.output()}")

    def terminate(self) -> None:
        """Ask the server and its workers to stop (SIGTERM to its process group); see stop()."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        """End the server and its workers: SIGTERM, then SIGKILL to what is left of them."""
        try:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            # Workers that outlive their master, or a master that ignored SIGTERM.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        finally:
            self._log.close()


@contextlib.contextmanager
def serving(kind: str, env: dict[str, str], workers: int = 4) -> Iterator[WebServer]:
    """A started server, ready to answer; stopped when the block ends, whatever happens."""
    server = WebServer(kind, env, workers)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
