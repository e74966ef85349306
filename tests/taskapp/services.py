"""The servers and worker processes of tests/test_task_queues.py.

Brokers: Redis and RabbitMQ on this machine, started by the test if they are not running;
one that can't be had fails the test under CI=true and skips it (loudly) otherwise.
Workers: real processes (``db_worker``, ``celery worker``) in a process group of their own,
their output in files, stopped (and killed if need be) when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: How long a task may take to come back, and a worker to start (on a loaded machine a
#: Celery worker, Django and two forked children, has taken over 30 s), before the test fails.
TIMEOUT = 30.0
START_TIMEOUT = 60.0

T = TypeVar("T")


def missing(what: str) -> None:
    """Fail under CI=true, else skip with a warning that can't be missed."""
    message = f"{what}: its tests can't run."
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}")
    warnings.warn(f"\n\n*** {message} SKIPPED. ***\n", stacklevel=2)
    pytest.skip(message)


def wait_until(condition: Callable[[], T], timeout: float = TIMEOUT, what: str = "") -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what or condition}")
        time.sleep(0.02)


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 1).close()
    except OSError:
        return False
    return True


def ensure_redis() -> str:
    """The Redis URL, after starting ``redis-server`` if nothing answers there."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)

    def ping() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    if not ping():
        host = client.connection_pool.connection_kwargs["host"]
        port = client.connection_pool.connection_kwargs["port"]
        if host in ("127.0.0.1", "localhost") and shutil.which("redis-server"):
            # Nothing kept on disk: the tests' keys are gone when the server stops.
            options = f"--daemonize yes --bind 127.0.0.1 --port {port} --appendonly no"
            command = ["redis-server", *options.split(), "--save", ""]
            subprocess.run(command, check=False, capture_output=True, timeout=30)
            deadline = time.monotonic() + 10
            while not ping() and time.monotonic() < deadline:
                time.sleep(0.1)
        if not ping():
            missing(f"no Redis answers at {REDIS_URL} and redis-server could not start one")
    return REDIS_URL


def ensure_rabbitmq() -> str:
    """The RabbitMQ URL, after starting ``rabbitmq-server`` if nothing answers there."""
    from kombu import Connection

    def connects() -> bool:
        try:
            with Connection(RABBITMQ_URL, connect_timeout=2) as connection:
                connection.ensure_connection(max_retries=1)
        except Exception:
            return False
        return True

    if not connects():
        if RABBITMQ_URL.startswith("amqp://guest:guest@127.0.0.1:") and shutil.which(
            "rabbitmq-server"
        ):
            subprocess.run(
                ["rabbitmq-server", "-detached"], check=False, capture_output=True, timeout=60
            )
            deadline = time.monotonic() + 60  # the Erlang VM and its plugins take a while
            while not _answers("127.0.0.1", 5672) and time.monotonic() < deadline:
                time.sleep(0.5)
        if not connects():
            missing(f"no RabbitMQ answers at {RABBITMQ_URL} and rabbitmq-server did not start")
    return RABBITMQ_URL


def forget_redis_keys(prefix: str) -> None:
    """Delete every key of this run (queue, unacked messages, results) from Redis."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def worker_env(using: str, **extra: str) -> dict[str, str]:
    """The environment of a worker on the pytest run's test database of ``using``.

    Its temporary files go to the run's folder, which the run removes at its end: Celery's
    prefork pool makes a pymp-* folder in the temporary directory that only a clean exit
    removes, and the tests stop their workers with SIGKILL."""
    temporary = Path(os.environ["ADVISORY_LOCK_TEST_DIR"], "tmp")
    temporary.mkdir(exist_ok=True)
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": using,
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(temporary),
        **extra,
    }


class WorkerProcess:
    """One worker process (and its children, in its process group), its output in a file."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        folder: Path,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        self.name = name
        self.stop_signal = stop_signal
        self.log = folder / f"{name}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches the children
            )

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.proc.pid}>"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until the worker has written ``text``; fail if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self!r} exited with status {self.proc.returncode} before saying "
                    f"{text!r}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self!r} did not say {text!r} within {timeout:g}s:\n{self.output()}"
                )
            time.sleep(0.02)

    def stop(self, grace: float = 5.0) -> None:
        """Its stop signal, then SIGKILL to its group if it is still there after ``grace``."""
        group = self.proc.pid
        if self.proc.poll() is None and self.stop_signal != signal.SIGKILL:
            self.proc.send_signal(self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # children left behind, if any
        self.proc.wait(TIMEOUT)


def start_db_worker(name: str, using: str, queue: str, folder: Path) -> WorkerProcess:
    """django-tasks-db's ``db_worker`` on ``queue``, as ``manage.py db_worker`` would run."""
    options = f"--queue-name {queue} --worker-id {name} --interval 0.05 --no-startup-delay"
    args = [sys.executable, "-m", "django", "db_worker", *options.split(), "--no-reload"]
    return WorkerProcess(name, args, worker_env(using), folder)


def start_celery_worker(
    name: str, using: str, broker: str, queue: str, folder: Path, concurrency: int = 2
) -> WorkerProcess:
    """A Celery worker with ``concurrency`` prefork children, consuming ``queue`` only."""
    options = (
        f"--queues {queue} --hostname {name}@%h --pool prefork --concurrency {concurrency} "
        "-O fair --loglevel INFO --without-gossip --without-mingle --without-heartbeat"
    )
    args = [sys.executable, "-m", "celery", "-A", "tests.taskapp.celery_worker", "worker"]
    env = worker_env(using, ADVISORY_LOCK_TEST_BROKER=broker, ADVISORY_LOCK_TEST_QUEUE=queue)
    # Stopped with SIGKILL to its group: its tasks are over by then, and Celery's shutdown,
    # warm or cold, takes 2 s or more.
    return WorkerProcess(name, [*args, *options.split()], env, folder, signal.SIGKILL)
