"""The admin's pages on a database where the app's migrations did not run: each says to run
``manage.py migrate``, never a 500.

Each test gets a new, empty database on the server of its backend (SQLite: a new file,
tests/databases.py), as the alias "unmigrated", and the app's models are routed there; the
staff user and the session stay on "default". Through Django's test client, which returns a
500 as a response here instead of raising the view's exception.
"""

from __future__ import annotations

import contextlib

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.test import override_settings
from django.urls import reverse
from django.utils.html import escape

from tests.databases import AppOn
from tests.databases import new_database
from tests.schedulers import JOBS
from tests.schedulers import settings_with

ALIAS = "unmigrated"
ENTRY = "report"
MIGRATE = f"Run 'manage.py migrate --database {ALIAS}', then try again."
CHANGELIST = "/admin/advisory_lock/jobrun/"
CONTROL = "admin:advisory_lock_jobrun_schedule_control"
#: Every page of the app's admin that reads or writes its tables: (method, path, data).
PAGES = {
    "runs list": ("get", CHANGELIST, {}),
    "runs list, filtered": ("get", CHANGELIST, {"status__exact": "failed", "q": "report"}),
    "change page": ("get", f"{CHANGELIST}1/change/", {}),
    "delete page": ("get", f"{CHANGELIST}1/delete/", {}),
    "history": ("get", f"{CHANGELIST}1/history/", {}),
    "schedule": ("get", "admin:advisory_lock_jobrun_schedule", {}),
    "timeline": ("get", "admin:advisory_lock_jobrun_timeline", {"entry": ENTRY}),
    "pause": ("post", CONTROL, {"entry": ENTRY, "action": "pause"}),
    "run now": ("post", CONTROL, {"entry": ENTRY, "action": "run_now"}),
    "pause with a reason": ("post", CONTROL, {"entry": ENTRY, "action": "pause", "reason": "db"}),
    "requests list": ("get", "/admin/advisory_lock/jobcontrol/", {}),
    "requests list, searched": ("get", "/admin/advisory_lock/jobcontrol/", {"q": "alice"}),
    "request page": ("get", "/admin/advisory_lock/jobcontrol/1/change/", {}),
    "stored entries": ("get", "/admin/advisory_lock/storedentry/", {}),
    "stored entry, added": (
        "post", "/admin/advisory_lock/storedentry/add/",
        {"name": "added", "callable": "gc.collect", "every": "60", "catch_up": "latest",
         "retries": "1", "alert_after": "3"},
    ),
    "stored entry page": ("get", "/admin/advisory_lock/storedentry/1/change/", {}),
    "stored entry's history": ("get", "/admin/advisory_lock/storedentry/1/history/", {}),
}  # fmt: skip
#: How far the app's migrations went on the new database, and whether each request runs in a
#: transaction there (ATOMIC_REQUESTS: PostgreSQL then refuses every statement after the
#: failed one until the transaction or a savepoint is rolled back).
STATES = {
    "never migrated": (None, False),
    "never migrated, ATOMIC_REQUESTS": (None, True),
    "migrated up to 0004 (no control room)": ("0004", False),
}
#: The pages that read or write what migration 0008 adds (the entries' first-seen times, the
#: requests' reasons); the others work on a database migrated up to 0007.
NEEDS_0008 = [
    "schedule", "timeline", "pause", "pause with a reason", "requests list",
    "requests list, searched", "request page",
]  # fmt: skip


@pytest.fixture
def unmigrated(using, tmp_path):
    """Yields a function that makes a new database the alias "unmigrated" (migrated up to a
    migration, or not at all), with the app's models routed there."""
    with contextlib.ExitStack() as stack:

        def make(migration, atomic_requests):
            settings_dict, _ = stack.enter_context(new_database(using, tmp_path))
            connections.settings[ALIAS] = {**settings_dict, "ATOMIC_REQUESTS": atomic_requests}
            stack.callback(forget_alias)
            if migration:
                call_command("migrate", "advisory_lock", migration, database=ALIAS, verbosity=0)

        stack.enter_context(override_settings(DATABASE_ROUTERS=[AppOn(ALIAS)]))
        yield make


def forget_alias():
    connections[ALIAS].close()
    del connections[ALIAS]
    del connections.settings[ALIAS]


@pytest.fixture
def superuser():
    """The test client logged in as a superuser (every permission), a user of "default"."""
    user = User.objects.create_superuser("unmigrated-admin", password="pw")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    schedule = {ENTRY: {"callable": f"{JOBS}.tick", "every": 60}}
    try:
        with settings_with(schedule):
            yield client
    finally:
        user.delete()


def app_tables():
    connection = connections[ALIAS]
    with connection.cursor() as cursor:
        names = connection.introspection.table_names(cursor)
    return sorted(name for name in names if not name.startswith("django_"))


@pytest.mark.parametrize("state", list(STATES))
def test_every_admin_page_before_migrate_says_to_run_it(using, unmigrated, superuser, state):
    migration, atomic_requests = STATES[state]
    unmigrated(migration, atomic_requests)
    tables_before = app_tables()
    answers = {}
    for page, (method, where, data) in PAGES.items():
        url = where if where.startswith("/") else reverse(where)
        response = getattr(superuser, method)(url, data)
        text = response.content.decode()
        answers[page] = (response.status_code, escape(MIGRATE) in text)
    # The locks are the server's, not the app's tables: that page lists them, and says why it
    # can't show the runs made under them.
    locks = superuser.get(reverse("admin:advisory_lock_jobrun_locks"), {"using": ALIAS})
    text = locks.content.decode()
    answers["locks"] = (locks.status_code, escape(MIGRATE) in text and 'id="held-locks"' in text)
    assert answers == {**dict.fromkeys(PAGES, (503, True)), "locks": (200, True)}
    assert app_tables() == tables_before  # the admin made no table


def test_the_pages_that_need_the_latest_migration_say_to_run_it(using, unmigrated, superuser):
    unmigrated("0007", False)
    answers = {}
    for page, (method, where, data) in PAGES.items():
        url = where if where.startswith("/") else reverse(where)
        response = getattr(superuser, method)(url, data)
        answers[page] = (response.status_code, escape(MIGRATE) in response.content.decode())
    expected = {page: (503, True) for page in NEEDS_0008}
    assert {page: answers[page] for page in NEEDS_0008} == expected
    # The runs list's overdue box reads the whole schedule, the stored entries (0010) too.
    assert answers["runs list"] == (503, True)
