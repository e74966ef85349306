"""The admin's saves and deletes while another process writes to the same SQLite file (a
scheduler's claims, say): Django's admin reads before it writes in one transaction, and on
SQLite a transaction that has read can't wait for the write lock ("database is locked" at
once, a 500). The app's admin views that write take the lock first, and wait for it.

The other writer is a process of its own (tests/sqlite_writer.py, plain ``sqlite3``). An
execute wrapper on the view's connection orders the two with events: just before the view's
first write statement, the other process takes the write lock, writes, says so, and commits.
Without the fix the view has read by then: its write fails at once, and the other's commit
waits for the view's transaction to end. With it, the view's first write is the first
statement of its transaction: it waits for the other's commit, then goes on.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from advisory_lock import JobRun
from advisory_lock.scheduling.stored import StoredEntry
from tests.schedulers import JOBS
from tests.test_stored_entries import EDITOR
from tests.test_stored_entries import browser
from tests.test_stored_entries import save_in_admin
from tests.test_stored_entries import stored  # noqa: F401 (a fixture)
from tests.test_stored_entries import token

NOW = datetime.datetime(2026, 12, 6, 3, 0, tzinfo=datetime.timezone.utc)
WRITES = ("INSERT", "UPDATE", "DELETE")
RUNS = ("view_jobrun", "delete_jobrun")


def add_entry(using: str) -> Callable[[], object]:
    client = browser(*EDITOR)
    options = {"callable": f"{JOBS}.tick", "every": 60}
    return lambda: save_in_admin(client, "added", options)


def change_entry(using: str) -> Callable[[], object]:
    row = StoredEntry.objects.using(using).create(
        name="changed", callable=f"{JOBS}.tick", every=60
    )
    client = browser(*EDITOR)
    options = {"callable": f"{JOBS}.tick", "every": 120}
    return lambda: save_in_admin(client, "changed", options, row)


def delete_entry(using: str) -> Callable[[], object]:
    row = StoredEntry.objects.using(using).create(
        name="deleted", callable=f"{JOBS}.tick", every=60
    )
    return _delete(browser(*EDITOR), "admin:advisory_lock_storedentry_delete", row.pk)


def delete_run(using: str) -> Callable[[], object]:
    run = JobRun.objects.using(using).create(
        job_name="report", period="2026-12-06", status="failed", started_at=NOW
    )
    return _delete(browser(*RUNS), "admin:advisory_lock_jobrun_delete", run.pk)


def _delete(client: Client, view: str, pk: int) -> Callable[[], object]:
    url = reverse(view, args=[pk])
    csrf = token(client, url)  # a GET: before the POST
    return lambda: client.post(url, {"post": "yes", "csrfmiddlewaretoken": csrf})


#: Each admin view of the app that writes a row, and what must be true after its POST.
CASES = {
    "add a stored entry": (add_entry, lambda using: StoredEntry.objects.using(using).filter(
        name="added", every=60).exists()),
    "change a stored entry": (change_entry, lambda using: StoredEntry.objects.using(using).filter(
        name="changed", every=120).exists()),
    "delete a stored entry": (delete_entry, lambda using: not StoredEntry.objects.using(
        using).filter(name="deleted").exists()),
    "delete a job run": (delete_run, lambda using: not JobRun.objects.using(using).exists()),
}  # fmt: skip


@pytest.fixture
def runs(using):
    yield
    JobRun.objects.using(using).all().delete()


class OtherWriterFirst:
    """An execute wrapper: just before the first write statement it sees, the other process
    takes the write lock and writes (and then commits, when it can)."""

    def __init__(self, writer: subprocess.Popen[str]) -> None:
        self.writer = writer
        self.cued = False

    def __call__(self, execute, sql, params, many, context):
        if not self.cued and sql.lstrip().upper().startswith(WRITES):
            self.cued = True
            assert self.writer.stdin and self.writer.stdout
            self.writer.stdin.write("go\n")
            self.writer.stdin.flush()
            assert self.writer.stdout.readline() == "holding\n"
        return execute(sql, params, many, context)


@pytest.mark.parametrize("using", ["default"], ids=["sqlite"], indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_a_save_or_delete_waits_for_another_process_writing_to_the_sqlite_file(
    using,
    stored,  # noqa: F811 (the fixture)
    runs,
    case,
):
    prepare, done = CASES[case]
    post = prepare(using)
    path = Path(connections[using].settings_dict["NAME"])
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.sqlite_writer", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout and writer.stdout.readline() == "ready\n"
        cue = OtherWriterFirst(writer)
        with connections[using].execute_wrapper(cue):
            response = post()
        assert cue.cued  # the view wrote, and the other process wrote just before
        assert response.status_code == 302, response
        assert done(using)
        assert writer.stdout.readline() == "committed\n"  # its write is there too
        assert writer.wait(timeout=120) == 0
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("case", list(CASES))
def test_on_sqlite_the_first_statement_of_the_posts_transaction_writes(
    using,
    stored,  # noqa: F811 (the fixture)
    runs,
    case,
):
    prepare, done = CASES[case]
    post = prepare(using)
    with CaptureQueriesContext(connections[using]) as statements:
        response = post()
    assert response.status_code == 302, response
    assert done(using)
    sql = [statement["sql"] for statement in statements]
    table = (JobRun if case == "delete a job run" else StoredEntry)._meta.db_table
    first_writes = [s for s in sql if s.endswith(" WHERE 0")]
    if using == "default":
        begin = sql.index("BEGIN")
        assert sql[begin + 1] == f'DELETE FROM "{table}" WHERE 0'
        assert len(first_writes) == 1
    else:  # nothing added where a write waits for rows whatever the transaction did before
        assert first_writes == []
