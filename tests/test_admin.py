"""The read-only JobRun admin, through Django's test client."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext

from advisory_lock import JobRun

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/advisory_lock/jobrun/"
NOW = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)


@pytest.fixture
def runs():
    succeeded = JobRun.objects.create(
        job_name="nightly_report", period="2026-11-29", status="succeeded", started_at=NOW,
        finished_at=NOW + datetime.timedelta(seconds=42), duration=datetime.timedelta(seconds=42),
        host="web-1", pid=4242,
    )  # fmt: skip
    failed = JobRun.objects.create(
        job_name="import_prices", period="2026-11-29T03", status="failed", started_at=NOW,
        host="web-2", pid=77, error="Traceback (most recent call last):\nValueError: <bad>",
    )  # fmt: skip
    return succeeded, failed


def staff(username, *permissions):
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in permissions:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def test_anonymous_users_are_sent_to_the_login_page(client, runs):
    response = client.get(CHANGELIST)
    assert response.status_code == 302
    assert response.url.startswith("/admin/login/")


def test_staff_without_the_view_permission_get_403(client, runs):
    client.force_login(staff("nobody"))
    assert client.get(CHANGELIST).status_code == 403
    assert client.get(f"{CHANGELIST}{runs[0].pk}/change/").status_code == 403


def test_staff_with_the_view_permission_see_the_runs_read_only(client, runs):
    client.force_login(staff("viewer", "view_jobrun"))
    page = client.get(CHANGELIST).content.decode()
    assert "nightly_report" in page and "import_prices" in page and "web-1" in page
    assert "background:#c62828" in page  # the failed badge
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    detail = client.get(f"{CHANGELIST}{runs[1].pk}/change/").content.decode()
    assert "ValueError: &lt;bad&gt;" in detail  # the traceback, escaped
    assert 'name="_save"' not in detail
    response = client.post(f"{CHANGELIST}{runs[1].pk}/delete/", {"post": "yes"})
    assert response.status_code == 403
    assert JobRun.objects.count() == 2


def test_delete_needs_the_delete_permission(client, runs):
    client.force_login(staff("janitor", "view_jobrun", "delete_jobrun"))
    response = client.post(f"{CHANGELIST}{runs[1].pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert JobRun.objects.count() == 1


def test_filters_and_search(client, runs):
    client.force_login(staff("viewer", "view_jobrun"))
    page = client.get(CHANGELIST, {"status__exact": "failed"}).content.decode()
    assert "import_prices" in page and "web-1" not in page
    page = client.get(CHANGELIST, {"q": "nightly"}).content.decode()
    assert "web-1" in page and "web-2" not in page


def test_the_changelist_runs_a_fixed_number_of_queries_however_many_runs(client, runs):
    client.force_login(staff("viewer", "view_jobrun"))
    params = {"status__exact": "succeeded", "job_name": "nightly_report"}
    with CaptureQueriesContext(connection) as few:
        assert client.get(CHANGELIST, params).status_code == 200
    JobRun.objects.bulk_create(
        JobRun(job_name="nightly_report", period=f"p{i}", status="succeeded", started_at=NOW)
        for i in range(300)
    )
    with CaptureQueriesContext(connection) as many:
        assert client.get(CHANGELIST, params).status_code == 200
    assert len(many) == len(few)
    # Inside a transaction (this test's, or ATOMIC_REQUESTS) the page reads the ledger in
    # savepoints (advisory_lock.admin.ledger_checked): two, of two statements each.
    reads = [query for query in few if "SAVEPOINT" not in query["sql"]]
    assert len(few) - len(reads) <= 4
    assert len(reads) <= 10


# The "Advisory locks" page.

LOCKS = "/admin/advisory_lock/jobrun/locks/"


def test_the_changelist_links_to_the_locks_page(client, runs):
    client.force_login(staff("viewer", "view_jobrun"))
    assert LOCKS in client.get(CHANGELIST).content.decode()


def test_the_locks_page_needs_login_and_the_view_permission(client):
    assert client.get(LOCKS).status_code == 302
    client.force_login(staff("nobody"))
    assert client.get(LOCKS).status_code == 403


@pytest.mark.django_db(databases=["default", "postgresql"])
@pytest.mark.parametrize("alias", ["default", "postgresql"])
def test_the_locks_page_shows_the_holder_and_the_latest_run(client, alias):
    from tests.test_locks import held_elsewhere

    JobRun.objects.using(alias).create(
        job_name="nightly_report",
        period="2026-11-29",
        started_at=NOW,
        lock_key="tests:job:nightly_report",  # the identity of the key "job:nightly_report"
    )
    client.force_login(staff("viewer", "view_jobrun"))
    with held_elsewhere("job:nightly_report", alias):
        page = client.get(LOCKS, {"using": alias}).content.decode()
    assert "job:nightly_report" in page and "held" in page
    assert "nightly_report [2026-11-29] running" in page  # the latest JobRun under that lock
    # Whose id the holder's is: SQLite's is a process (of this host: this one), PostgreSQL's
    # the server's backend (held on a plain connection, which names no process).
    if alias == "default":
        assert f"<td>pid {os.getpid()}</td>" in page
        assert f"<td>{os.getpid()} on {socket.gethostname()}</td>" in page
    else:
        assert "<td>backend pid " in page
    assert "Terminate holder" not in page and "<th>Query</th>" not in page


@pytest.mark.django_db(databases=["default", "postgresql"])
def test_superusers_see_the_query_and_can_terminate_the_holder_after_confirming(client):
    import threading

    from tests.probes import freed
    from tests.probes import in_other_connection
    from tests.probes import is_free
    from tests.servers import backend_id

    hang = 300.0  # a guard against a hang, not a timing

    admin = User.objects.create_superuser("root", password="pw")
    client.force_login(admin)
    held, stop, pid = threading.Event(), threading.Event(), {}

    def holder():
        from advisory_lock import advisory_lock

        try:
            with advisory_lock("stuck-job", using="postgresql"):
                pid["value"] = backend_id("postgresql")
                held.set()
                stop.wait(hang)
        except Exception as exc:
            pid["error"] = exc  # LockLost once terminated

    thread = threading.Thread(target=lambda: in_other_connection(holder))
    thread.start()
    try:
        assert held.wait(hang)
        page = client.get(LOCKS, {"using": "postgresql"}).content.decode()
        assert "<th>Query</th>" in page and "Terminate holder" in page
        terminate = f"{LOCKS}terminate/{pid['value']}/"
        confirm = client.get(terminate, {"using": "postgresql"}).content.decode()
        assert "Yes, terminate it" in confirm
        assert not is_free("stuck-job", "postgresql")  # a GET changes nothing
        response = client.post(terminate, {"using": "postgresql"})
        assert response.status_code == 302
        # pg_terminate_backend() only signals the holder's backend and returns: the lock is
        # free once that session has ended in the server.
        assert freed("stuck-job", "postgresql")
    finally:
        stop.set()
        thread.join(hang)


def test_staff_who_are_not_superusers_cannot_terminate(client):
    client.force_login(staff("viewer", "view_jobrun"))
    assert client.post(f"{LOCKS}terminate/1/", {"using": "default"}).status_code == 403
    assert client.get(f"{LOCKS}terminate/1/").status_code == 403


def test_an_unknown_alias_is_refused(client):
    client.force_login(staff("viewer", "view_jobrun"))
    assert client.get(LOCKS, {"using": "nope"}).status_code == 403
