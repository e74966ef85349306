"""SQLite's locks are files: one ``flock``-ed file per key, in a folder of the library's own.

These tests pin what that must never do: keep a lock that nothing references (after a
request, a failed write, an interrupted wait), pile up files, let two holders in while files
come and go, use a folder or a file that someone else could have prepared, or block an event
loop. Other processes are real ones (tests/worker.py, tests/sqlite_child.py); the folder is
the run's (``<test database>.locks``), or ``ADVISORY_LOCK["LOCK_DIR"]`` in ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.exceptions import SynchronousOnlyOperation
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections
from django.db import connections
from django.test import override_settings

from advisory_lock import AdvisoryLockError
from advisory_lock import advisory_lock
from tests.probes import is_free
from tests.processes import ROOT
from tests.processes import Worker
from tests.processes import Workers

#: What a library refusing a lock folder may raise.
REFUSED = (ImproperlyConfigured, AdvisoryLockError, PermissionError)
#: A uid that is not ours (``nobody``).
OTHER_UID = 65534


@pytest.fixture
def sqlite(django_db_setup, django_db_blocker):
    """The SQLite alias, on the run's test database (the one worker processes use)."""
    with django_db_blocker.unblock():
        yield "default"
        connections["default"].close()


@pytest.fixture
def workers():
    started = Workers()
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
def key():
    """A key of this test's own: its lock file can't be left over from another test."""
    return f"lock-files-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def lock_dir(tmp_path):
    """``ADVISORY_LOCK["LOCK_DIR"]`` set to a folder that does not exist yet."""
    folder = tmp_path / "locks"
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "tests", "LOCK_DIR": str(folder)}):
        yield folder


def default_lock_dir() -> Path:
    """The folder of the test database's lock files, beside it (the workers' folder too)."""
    return Path(settings.DATABASES["default"]["NAME"] + ".locks")


def listing(folder: Path) -> set[str]:
    return set(os.listdir(folder)) if folder.exists() else set()


def as_root_or_fail():
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("this test gives a folder to another user: run it as root")
        pytest.skip("this test gives a folder to another user, which needs root")


class Child(Worker):
    """A ``python -m tests.sqlite_child`` process, spoken to as a tests/worker.py one."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sqlite_child", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )


def start_child(workers: Workers, *args: str, **extra_env: str) -> Child:
    """Start a child process that ``workers.kill_all()`` ends with the test's workers."""
    child = Child(list(args), {**workers.env, **extra_env})
    workers.started.append(child)
    return child


# A lock a view left held, at the end of a request served as a WSGI server serves it.


def test_a_lock_a_view_never_released_is_freed_after_django_closed_the_connection(
    sqlite, key, caplog
):
    """Django connects close_old_connections to request_finished when django.db is imported,
    so under a WSGI server it runs first and closes the SQLite connection (CONN_MAX_AGE=0)
    before the library's end-of-request release runs. The file lock is not on that
    connection: it must be released all the same. (The test client reconnects
    close_old_connections after each request, last: here it is called as a server's first
    receiver would.)"""
    environ = {}
    setup_testing_defaults(environ)
    environ.update(
        PATH_INFO=f"/leak-after-a-query/{sqlite}/{key}/",
        HTTP_HOST="testserver",
        SERVER_NAME="testserver",
    )
    with override_settings(ROOT_URLCONF="tests.leaky_views"):
        response = WSGIHandler()(environ, lambda status, headers: None)
        try:
            body = b"".join(response)
        finally:
            close_old_connections()  # request_finished's first receiver, under a server
            response.close()  # the server is done with the response: request_finished
    assert body == b"leaked"
    assert is_free(key, sqlite)
    assert any(
        key in record.getMessage()
        for record in caplog.records
        if record.name.split(".")[0] == "advisory_lock" and record.levelno == logging.ERROR
    ), "an error names the key the view left held"


# A lock whose holder record can't be written.


def test_a_lock_whose_holder_record_cannot_be_written_is_refused_and_left_free(
    sqlite, workers, key
):
    child = start_child(workers, "write-fails", key)
    said = child.message()
    assert said["event"] == "refused", f"the child could write nothing, yet said {said}"
    # The child is alive (waiting on its stdin) and holds whatever its attempt left open.
    assert child.proc.poll() is None
    assert is_free(key, sqlite)
    child.finish()


# Waits interrupted by a signal.


class Interrupted(Exception):
    """Raised by the SIGALRM handler below."""


def interrupt(signum, frame):
    raise Interrupted


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["blocking", "bounded"])
def test_waits_interrupted_by_a_signal_leave_no_file_descriptor_open(
    sqlite, workers, key, timeout
):
    holder = workers.start("--using", sqlite, "hold", key)
    holder.expect("acquired")
    with advisory_lock(f"{key}-warm-up", using=sqlite):
        pass  # whatever a first lock sets up stays out of the count
    before = len(os.listdir("/proc/self/fd"))
    interrupted = 0
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for _ in range(50):
            signal.setitimer(signal.ITIMER_REAL, 0.02)
            try:
                with advisory_lock(key, using=sqlite, timeout=timeout):
                    pytest.fail("the worker holds the lock")
            except Interrupted:
                interrupted += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert interrupted == 50
    assert len(os.listdir("/proc/self/fd")) == before
    holder.send("release")
    holder.expect("releasing")


# Lock files and their folder.


def test_released_keys_leave_no_lock_files_behind(sqlite, lock_dir):
    with advisory_lock("lock-files:first", using=sqlite):
        assert listing(lock_dir), "the lock's file is in LOCK_DIR while it is held"
    for number in range(1000):
        with advisory_lock(f"lock-files:{number}", using=sqlite):
            pass
    assert len(listing(lock_dir)) <= 10, sorted(listing(lock_dir))[:20]


def test_processes_hammering_one_key_never_overlap_and_leave_its_file_removed(
    sqlite, workers, key, tmp_path
):
    """Removing a released key's file must not let a process that opened it before the
    removal hold it while another holds a new file at the same path."""
    folder = default_lock_dir()
    with advisory_lock(f"{key}-warm-up", using=sqlite):
        pass  # the folder, and whatever it keeps for every key, exist before the count
    before = listing(folder)
    processes, iterations = 6, 150
    log, marker = tmp_path / "intervals.log", tmp_path / "inside"
    options = ("--iterations", iterations, "--log", log, "--marker", marker, "--hold-ms", 0.3)
    contenders = [
        workers.start("--using", sqlite, "contend", key, "--id", number, *options)
        for number in range(processes)
    ]
    for contender in contenders:
        contender.expect("ready")
    for contender in contenders:
        contender.send("go")
    results = [contender.expect("done", timeout=120) for contender in contenders]
    for contender in contenders:
        contender.finish()
    assert [result["iterations"] for result in results] == [iterations] * processes
    assert [result["overlaps"] for result in results] == [0] * processes
    assert listing(folder) - before == set(), "the key's file is left behind"


def test_the_lock_folder_the_library_creates_is_private(sqlite, lock_dir):
    with advisory_lock("lock-files:private", using=sqlite):
        pass
    assert stat.S_IMODE(os.stat(lock_dir).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757], ids=oct)
def test_a_lock_folder_others_can_write_to_is_refused(sqlite, lock_dir, mode):
    lock_dir.mkdir()
    os.chmod(lock_dir, mode)
    with pytest.raises(REFUSED, match=re.escape(str(lock_dir))):
        with advisory_lock("lock-files:shared-folder", using=sqlite):
            pytest.fail("the body must not run")
    assert listing(lock_dir) == set(), "nothing is created in a refused folder"
    os.chmod(lock_dir, 0o700)
    assert is_free("lock-files:shared-folder", sqlite)


def test_a_lock_folder_owned_by_another_user_is_refused(sqlite, lock_dir):
    as_root_or_fail()
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(REFUSED, match=re.escape(str(lock_dir))):
        with advisory_lock("lock-files:foreign-folder", using=sqlite):
            pytest.fail("the body must not run")
    assert listing(lock_dir) == set(), "nothing is created in a refused folder"
    os.chown(lock_dir, os.getuid(), os.getgid())
    assert is_free("lock-files:foreign-folder", sqlite)


def test_a_symlink_planted_at_a_lock_files_path_is_never_written_through(
    sqlite, lock_dir, tmp_path
):
    key = "lock-files:planted"
    with advisory_lock(key, using=sqlite):
        names = listing(lock_dir)  # the key's file: its name is the library's business
    assert names
    target = tmp_path / "precious.txt"
    target.write_bytes(b"precious data\n")
    for name in names:
        path = lock_dir / name
        if os.path.lexists(path):
            os.unlink(path)  # the library kept it: plant the link in its place
        os.symlink(target, path)
    with contextlib.suppress(OSError, *REFUSED):
        with advisory_lock(key, using=sqlite):
            pass
    assert target.read_bytes() == b"precious data\n"


@contextlib.contextmanager
def restored(path: Path):
    """Give ``path`` its mode and owner back afterwards, whatever the test did to it."""
    status = os.stat(path)
    try:
        yield
    finally:
        os.chown(path, status.st_uid, status.st_gid)
        os.chmod(path, stat.S_IMODE(status.st_mode))


@pytest.mark.parametrize("spoiled", ["world-writable", "owned-by-another-user"])
def test_an_in_memory_databases_lock_folder_is_refused_when_not_private(
    sqlite, workers, tmp_path, spoiled
):
    """An in-memory database has no file to put the folder beside: it goes to a shared place
    (the temporary folder), where another user could have made it first. Each attempt is a
    fresh process, which finds the folder as it is."""
    if spoiled == "owned-by-another-user":
        as_root_or_fail()
    key = "lock-files:in-memory"
    temporary = {"TMPDIR": str(tmp_path)}  # where tempfile.gettempdir() points
    first = start_child(workers, "in-memory", key, **temporary)
    said = first.expect("acquired")
    first.finish()
    assert said["files"], "the lock is a file the process has open"
    (folder,) = {Path(path).parent for path in said["files"]}
    with restored(folder):
        if spoiled == "world-writable":
            os.chmod(folder, 0o777)
        else:
            os.chown(folder, OTHER_UID, OTHER_UID)
        second = start_child(workers, "in-memory", key, **temporary)
        said = second.message()
        second.finish()
    assert said["event"] == "refused", said
    assert str(folder) in said["error"], "the error names the folder"


# A sync lock inside a running event loop.


def test_a_lock_taken_synchronously_in_a_running_event_loop_is_refused_at_once(using):
    """Blocking the loop to wait for a lock would stall every task, and hang for good when the
    holder is another task of that loop: every backend refuses, as Django does for queries."""
    key = "lock-files:in-an-event-loop"

    async def lock_in_async_code():
        with advisory_lock(key, using=using):
            return "acquired"

    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(lock_in_async_code())
    assert is_free(key, using)
