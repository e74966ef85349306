"""Who holds what, for every lock: a plain lock's name and its holder's host and pid, on the
Locks page and in ``manage.py advisory_locks``, each holder a real process of its own.

The name is a run-time key (in no ``NAMES``, never used by the test's process), plain or long
enough to be hashed into the database's key. PostgreSQL shows the key as a 64-bit number and
a backend pid, MariaDB (without performance_schema here) only locks whose name it is asked
about, SQLite a lock file: the name, host and pid come from the lock directory
(``advisory_lock.directory``) or the lock file's record.
"""

from __future__ import annotations

import json
import os
import threading
import uuid

import pytest
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connections
from django.test.utils import CaptureQueriesContext

from advisory_lock import advisory_lock
from advisory_lock import directory
from advisory_lock.inspection import held_locks
from advisory_lock.lock_names import LockClient
from tests.processes import Worker
from tests.processes import Workers

LOCKS = "/admin/advisory_lock/jobrun/locks/"


def run_time_key(kind: str) -> str:
    """A key that only the holder's process knows: plain, or hashed (long, with spaces and
    capitals) into the database's key."""
    tenant = uuid.uuid4().hex[:12]
    if kind == "plain":
        return f"import:tenant-{tenant}"
    return f"Import for Tenant {tenant}: " + "the monthly ledger close " * 5


@pytest.fixture
def holder(using):
    """Starts ``tests.holder_child`` processes holding a key on ``using``."""
    workers = Workers()

    def start(key: str, *options: str) -> tuple[Worker, dict]:
        worker = Worker([using, key, *options], workers.env, module="tests.holder_child")
        workers.started.append(worker)
        return worker, worker.expect("holding")

    try:
        yield start
    finally:
        workers.kill_all()


def the_lock(using: str, key: str):
    (lock,) = [lock for lock in held_locks(using) if lock.name == key]
    return lock


@pytest.mark.parametrize("kind", ["plain", "hashed"])
def test_a_plain_locks_name_and_its_holders_host_and_pid_are_shown(using, holder, kind):
    key = run_time_key(kind)
    _, holding = holder(key)
    lock = the_lock(using, key)
    assert lock.granted
    assert (lock.process_id, lock.process_host) == (holding["pid"], holding["host"])
    assert lock.process == f"{holding['pid']} on {holding['host']}"


def test_advisory_locks_prints_the_name_host_and_pid(using, holder, capsys):
    key = run_time_key("plain")
    _, holding = holder(key)
    call_command("advisory_locks", "--using", using)
    table = capsys.readouterr().out
    call_command("advisory_locks", "--using", using, "--json")
    document = json.loads(capsys.readouterr().out)
    (row,) = [line for line in table.splitlines() if key in line]
    assert f"{holding['pid']} on {holding['host']}" in row and "held" in row
    (lock,) = [lock for lock in document["locks"] if lock["name"] == key]
    assert lock["holder"]["process_id"] == holding["pid"]
    assert lock["holder"]["process_host"] == holding["host"]


@pytest.mark.django_db(databases=["default", "postgresql", "mysql"])
def test_the_locks_page_shows_the_name_host_and_pid(using, holder, client):
    key = run_time_key("plain")
    _, holding = holder(key)
    viewer = User.objects.create_user(f"viewer-{uuid.uuid4().hex[:8]}", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_jobrun"))
    client.force_login(viewer)
    page = client.get(LOCKS, {"using": using}).content.decode()
    assert f"<td>{key}<br><code" in page  # the name, the database's key under it
    assert f"<td>{holding['pid']} on {holding['host']}</td>" in page


@pytest.mark.parametrize("using", ["default", "postgresql"], indirect=True)  # shared locks
def test_each_shared_holder_is_shown_with_its_process(using, holder):
    key = run_time_key("plain")
    _, first = holder(key, "--shared")
    _, second = holder(key, "--shared")
    locks = [lock for lock in held_locks(using) if lock.name == key]
    assert {(lock.mode, lock.process_id) for lock in locks} == {
        ("shared", first["pid"]),
        ("shared", second["pid"]),
    }


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_row_of_an_earlier_session_with_the_same_id_is_not_believed(using, holder):
    key = run_time_key("plain")
    _, holding = holder(key)
    session = the_lock(using, key).holder_id
    # As if the row were of a session that had the id before (a reused pid, a restarted
    # server's connection counter): it began at another time than the holder's session.
    rows = LockClient.objects.using(using).filter(session=session)
    started = rows.get().started
    rows.update(started=started - 100)
    try:
        lock = the_lock(using, key)
        assert lock.process_id is None and lock.holder_id == session
    finally:
        rows.update(started=started)
    assert the_lock(using, key).process_id == holding["pid"]


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_mysql_without_a_lock_table_finds_run_time_names_through_the_directory(using, holder):
    # performance_schema is off on the test server, and no plugin is loaded: the server can
    # only be asked about names, and the holder's is in no NAMES and unknown to this process.
    key = run_time_key("hashed")
    holder(key)
    locks = held_locks(using)
    assert locks.source == "IS_USED_LOCK over known names"
    assert [lock.name for lock in locks if lock.name == key] == [key]


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_mysql_with_the_metadata_lock_info_plugin_shows_the_name_host_and_pid(using, holder):
    key = run_time_key("hashed")
    _, holding = holder(key)
    with connections[using].cursor() as cursor:
        cursor.execute("INSTALL SONAME 'metadata_lock_info'")
    try:
        locks = held_locks(using)
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute("UNINSTALL SONAME 'metadata_lock_info'")
    assert locks.source == "information_schema.METADATA_LOCK_INFO"
    (lock,) = [lock for lock in locks if lock.name == key]
    assert (lock.process_id, lock.process_host) == (holding["pid"], holding["host"])


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("first_use", [True, False], ids=["new name", "noted name"])
def test_the_directory_adds_no_statement_to_a_lock(using, first_use):
    key = run_time_key("plain")
    if not first_use:
        with advisory_lock(key, using=using):
            pass
    connections[using].ensure_connection()
    with CaptureQueriesContext(connections[using]) as statements:
        with advisory_lock(key, using=using):
            pass
    assert len(statements) == 2, [query["sql"] for query in statements]  # take, release
    assert directory.recorder is not None and directory.recorder.flush(timeout=300)


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_lock_held_at_the_write_is_recorded_and_one_let_go_of_is_not(using):
    from advisory_lock.lock_names import LockName

    held, brief = run_time_key("plain"), run_time_key("plain")
    assert directory.recorder is not None
    with advisory_lock(brief, using=using):
        pass
    with advisory_lock(held, using=using):
        assert directory.recorder.flush(timeout=300)
    names = LockName.objects.using(using)
    assert names.filter(name=held).exists()
    assert not names.filter(name=brief).exists()  # a try, a short job: over before the write


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_lock_held_for_a_moment_across_the_writers_wake_up_is_not_recorded(using, monkeypatch):
    """Each note is judged a second after its own moment, not at the moment the writer wakes
    (a second after the first note of a burst): a lock taken just before that and let go of
    just after is a short job's, and costs no write (a connection of its own). Before the
    fix, a worker running short jobs one after the other wrote whichever name it held when
    its writer woke, and opened a connection for it at every burst. The directory's clock
    is the test's, so that which note is how old does not depend on the machine's speed."""
    from advisory_lock.lock_names import LockName

    recorder = directory.recorder
    assert recorder is not None and recorder.settle(timeout=300)  # no writer, nothing queued
    held, brief = run_time_key("plain"), run_time_key("plain")
    start = directory.monotonic()
    now = [start]
    monkeypatch.setattr(directory, "monotonic", lambda: now[0])
    names = LockName.objects.using(using)
    with advisory_lock(held, using=using):  # noted at start: the writer wakes a second later
        now[0] = start + 0.9 * directory.WRITE_AFTER
        with advisory_lock(brief, using=using):
            now[0] = start + directory.WRITE_AFTER  # the first note is ripe, this one is not
            for _ in range(3000):  # the writer's write of the first, seen by the database
                if names.filter(name=held).exists():
                    break
                threading.Event().wait(0.1)
            assert names.filter(name=held).exists(), "the held lock's name was not written"
        assert recorder.flush(timeout=300)  # the brief lock's note: let go of, so dropped
    assert not names.filter(name=brief).exists()


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_writer_thread_that_dies_leaves_no_note_to_wait_for(using, monkeypatch):
    """A write interrupted by a ``BaseException`` (a ``SystemExit`` in the write, here) ends
    the writer thread; the notes it was still keeping for their second go with it, forgotten,
    so that a ``flush()`` does not wait for them (the next note starts another writer). The
    locks are real; the write and the directory's clock are the test's."""
    recorder = directory.recorder
    assert recorder is not None and recorder.settle(timeout=300)
    ended = threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.set())

    def interrupted(*args):
        raise SystemExit("the write was interrupted")

    monkeypatch.setattr(recorder, "_write", interrupted)
    start = directory.monotonic()
    now = [start]
    monkeypatch.setattr(directory, "monotonic", lambda: now[0])
    with advisory_lock(run_time_key("plain"), using=using):
        now[0] = start + 0.9 * directory.WRITE_AFTER
        with advisory_lock(run_time_key("plain"), using=using):
            now[0] = start + directory.WRITE_AFTER  # the first note's write ends the thread
            assert ended.wait(300), "the writer's write was never tried"
            assert recorder.flush(timeout=60), "flush() waits for notes no thread keeps"


#: What makes a holder's directory write fail, and whether its warning then says to migrate.
WRITE_FAILURES = {"its connection refused": False, "its tables missing": True}


@pytest.fixture
def refusing(using):
    """``refusing(cause)``: the settings, for a holder of ``using``, under which the lock
    works and the directory's write fails: a user that may open one connection only (the
    lock's; the writer's is refused by the server), or a database without the app's tables
    (created empty for the test)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"al_directory_{worker}"
    cursor = connections[using].cursor()
    made: list[str] = []

    # PostgreSQL refuses to drop a database that a session is still connected to (the
    # holder's, a moment after it was killed) unless told to end those sessions first.
    drop = f"DROP DATABASE IF EXISTS {name}"
    if connections[using].vendor == "postgresql":
        drop += " WITH (FORCE)"

    def settings_for(cause: str) -> dict[str, str]:
        if cause == "its tables missing":
            cursor.execute(drop)
            cursor.execute(f"CREATE DATABASE {name}")
            made.append(drop)
            return {"NAME": name}
        if connections[using].vendor == "postgresql":
            cursor.execute(
                f"DO $$ BEGIN CREATE ROLE {name} LOGIN; "
                f"EXCEPTION WHEN duplicate_object THEN NULL; END $$"
            )
            cursor.execute(f"ALTER ROLE {name} CONNECTION LIMIT 1")
        else:
            database = connections[using].settings_dict["NAME"]
            for host in ("127.0.0.1", "localhost", "%"):
                account = f"'{name}'@'{host}'"
                cursor.execute(f"CREATE USER IF NOT EXISTS {account}")
                cursor.execute(f"ALTER USER {account} WITH MAX_USER_CONNECTIONS 1")
                cursor.execute(f"GRANT ALL ON `{database}`.* TO {account}")
        return {"USER": name, "PASSWORD": ""}

    try:
        yield settings_for
    finally:
        for statement in made:
            cursor.execute(statement)
        cursor.close()


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("cause", list(WRITE_FAILURES))
def test_a_failed_directory_write_says_why_and_to_migrate_only_when_tables_are_missing(
    using, cause, refusing
):
    # Before the fix, both said "Run manage.py migrate to create its tables".
    overrides = refusing(cause)
    workers = Workers({"ADVISORY_LOCK_TEST_DB_OVERRIDES": json.dumps({using: overrides})})
    worker = Worker([using, run_time_key("plain")], workers.env, module="tests.holder_child")
    workers.started.append(worker)
    try:
        worker.expect("holding")  # the lock was taken, and the directory's write tried
        said = worker.stderr()
    finally:
        workers.kill_all()
    assert "The lock directory could not be written" in said, said
    assert ("manage.py migrate" in said) is WRITE_FAILURES[cause], said
    if not WRITE_FAILURES[cause]:
        assert "The database said:" in said and "connection" in said.lower(), said
