"""The admin's "terminate holder": only a session that holds or waits for a lock right now.

The view ends real sessions and, on SQLite, signals real processes: the admin runs in a child
process of its own (tests/admin_child.py) whose signals are blocked and whose ``os.kill`` is a
tripwire that never forwards a signal to pid 0, pid 1, its own group or the test. Each refusal
test checks that nothing was sent, that the would-be victim (an unrelated sleeping process, a
session holding no lock, a PostgreSQL session on another database) is alive, and that the page
says it was refused; the last test terminates a real holder after the confirmation.
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

import pytest
from django.db import connections
from django.urls import reverse

from advisory_lock import held_locks
from tests.probes import is_free
from tests.processes import ROOT
from tests.processes import Workers

LOCKS_PAGE = "admin:advisory_lock_jobrun_locks"
TERMINATE = "admin:advisory_lock_jobrun_terminate"
HOLDER_NAME = "admin:stuck-job"
CHILD_NAME = "admin:held-by-the-server"


class AdminServer:
    """The admin in a child process (tests/admin_child.py), in a process group of its own."""

    def __init__(self, names):
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "ADVISORY_LOCK_TEST_WORKER": "1",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("ADVISORY_LOCK_TEST_DEFAULT", None)  # its "default" is the SQLite database
        argv = [arg for name in names for arg in ("--name", name)]
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.admin_child", *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,  # its own process group: a signal to "its group" is its own
        )
        ready = self._answer()
        assert ready["event"] == "ready", ready
        self.pid = ready["pid"]
        assert ready["pgid"] == self.pid != os.getpgrp()

    def _answer(self, timeout=60.0):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait(30)
            self.stderr.seek(0)
            raise AssertionError(f"the admin child said nothing; stderr:\n{self.stderr.read()!r}")
        return json.loads(line)

    def ask(self, **request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def terminate(self, method, holder_id, using):
        """GET (the confirmation) or POST (the deed) terminate/<holder_id>/?using=<using>."""
        path = reverse(TERMINATE, args=[holder_id])
        if method == "get":
            return self.ask(op="get", path=f"{path}?using={using}")
        return self.ask(op="post", path=f"{path}?using={using}", data={"using": using})

    def signals(self):
        return self.ask(op="signals")["signals"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # by its pid: SIGKILL can't be blocked
                self.proc.wait(30)
        self.proc.stdout.close()
        self.stderr.close()


@pytest.fixture
def admin_server(using):
    server = AdminServer([HOLDER_NAME, CHILD_NAME])
    yield server
    server.stop()


def assert_refused(answer):
    """The view redirected with an error message, and sent no signal."""
    assert answer["status"] == 200 and answer["redirects"], answer["redirects"]
    levels = [level for level, _ in answer["messages"]]
    assert "error" in levels and "success" not in levels, answer["messages"]
    assert answer["signals"] == []


# Would-be victims: they hold no lock on the database the admin looks at.


class SleepingProcess:
    """An unrelated process, holding no lock."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.id = self.proc.pid

    def is_alive(self):
        return self.proc.poll() is None

    def close(self):
        self.proc.kill()
        self.proc.wait(30)


class IdleSession:
    """A session on ``database`` (default: the alias's own) holding no lock there, or holding
    advisory lock 4242 if ``holding``: its server id is what the admin would terminate."""

    def __init__(self, using, database=None, holding=False):
        settings_dict = connections[using].settings_dict
        database = database or settings_dict["NAME"]
        if connections[using].vendor == "postgresql":
            import psycopg

            self.connection = psycopg.connect(
                host=settings_dict["HOST"] or "127.0.0.1",
                port=settings_dict["PORT"] or "5432",
                user=settings_dict["USER"] or "postgres",
                password=settings_dict["PASSWORD"] or None,
                dbname=database,
                autocommit=True,
                connect_timeout=5,
            )
            self.id = self.connection.info.backend_pid
            if holding:
                self.connection.execute("SELECT pg_advisory_lock(4242)")
        else:
            import MySQLdb

            self.connection = MySQLdb.connect(
                host=settings_dict["HOST"] or "127.0.0.1",
                port=int(settings_dict["PORT"] or 3306),
                user=settings_dict["USER"] or "root",
                password=settings_dict["PASSWORD"] or "",
                database=database,
                connect_timeout=5,
            )
            self.id = self.connection.thread_id()

    def is_alive(self):
        try:
            cursor = self.connection.cursor()
            cursor.execute("SELECT 1")
            return cursor.fetchone()[0] == 1
        except Exception:
            return False

    def close(self):
        self.connection.close()


@pytest.fixture
def victim(using):
    """An id that holds no lock on ``using``: a sleeping process (SQLite) or an idle session."""
    victim = SleepingProcess() if using == "default" else IdleSession(using)
    yield victim
    victim.close()


@pytest.mark.parametrize("method", ["get", "post"])
def test_terminate_refuses_an_id_that_holds_no_lock(admin_server, victim, using, method):
    assert victim.is_alive()

    answer = admin_server.terminate(method, victim.id, using)

    assert_refused(answer)
    assert victim.is_alive()
    assert admin_server.signals() == []


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
@pytest.mark.parametrize("holding", [False, True], ids=["idle", "holding-a-lock-there"])
def test_terminate_refuses_a_postgresql_session_on_another_database(admin_server, using, holding):
    other = IdleSession(using, database="postgres", holding=holding)
    try:
        answer = admin_server.terminate("post", other.id, using)
        assert_refused(answer)
        assert other.is_alive()
    finally:
        other.close()


# Not on MariaDB: there 0 and 1 are connection ids, and 1 may be another client's.
@pytest.mark.parametrize(
    "using", ["default", "postgresql"], indirect=True, ids=["sqlite", "postgresql"]
)
@pytest.mark.parametrize("holder_id", [0, 1])
def test_terminate_refuses_pid_0_and_pid_1(admin_server, using, holder_id):
    for method in ("get", "post"):
        assert_refused(admin_server.terminate(method, holder_id, using))
    assert admin_server.proc.poll() is None
    assert admin_server.signals() == []


@pytest.mark.parametrize("using", ["default"], indirect=True, ids=["sqlite"])
def test_terminate_refuses_the_servers_own_pid_on_sqlite_even_while_it_holds_a_lock(
    admin_server, using
):
    pid = admin_server.ask(op="hold", key=CHILD_NAME, using=using)["pid"]
    listed = admin_server.ask(op="get", path=f"{reverse(LOCKS_PAGE)}?using={using}")
    assert CHILD_NAME in listed["content"]  # its own pid is in the live lock list

    for method in ("get", "post"):
        assert_refused(admin_server.terminate(method, pid, using))
    assert admin_server.proc.poll() is None
    assert admin_server.signals() == []


# A real holder is terminated, after a confirmation that names its lock.


def holder_of(name, using):
    from django.conf import settings
    from django.test import override_settings

    with override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, "NAMES": [name]}):
        ids = [lock.holder_id for lock in held_locks(using) if lock.name == name and lock.granted]
    assert ids, f"nobody holds lock {name!r} on {using!r}"
    return ids[0]


def test_terminate_ends_a_real_holder_after_a_confirmation_that_names_its_lock(
    admin_server, using
):
    workers = Workers()
    try:
        worker = workers.start("--using", using, "hold", HOLDER_NAME)
        worker.expect("acquired")
        holder_id = holder_of(HOLDER_NAME, using)
        if using == "default":
            assert holder_id == worker.proc.pid
        listed = admin_server.ask(op="get", path=f"{reverse(LOCKS_PAGE)}?using={using}")
        assert HOLDER_NAME in listed["content"]
        assert reverse(TERMINATE, args=[holder_id]) in listed["content"]  # its button

        confirmation = admin_server.terminate("get", holder_id, using)
        assert confirmation["status"] == 200 and not confirmation["redirects"]
        assert HOLDER_NAME in confirmation["content"]
        assert 'method="post"' in confirmation["content"]
        assert not is_free(HOLDER_NAME, using)  # a GET changes nothing
        assert admin_server.signals() == []

        done = admin_server.terminate("post", holder_id, using)
        assert done["redirects"]
        assert "error" not in [level for level, _ in done["messages"]], done["messages"]
        deadline = time.monotonic() + 15
        while not is_free(HOLDER_NAME, using):
            assert time.monotonic() < deadline, "the holder still holds its lock"
            time.sleep(0.05)
        if using == "default":
            # SQLite: the holder is a process, ended by SIGTERM (and only it).
            assert [(s["pid"], s["signal"], s["forwarded"]) for s in done["signals"]] == [
                (worker.proc.pid, signal.SIGTERM, True)
            ]
            assert worker.proc.wait(15) == -signal.SIGTERM
        else:
            assert done["signals"] == []
    finally:
        workers.kill_all()
