"""What the tests of the operator's console share (tests/test_console_*.py): staff users of
"default" logged in through Django's test client, with the app's models routed to the
database under test, and ledger rows written as the scheduler writes them."""

from __future__ import annotations

import contextlib
import datetime
import io

from django.conf import settings
from django.contrib.auth.models import Permission
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.test import override_settings

from advisory_lock.models import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.first_seen import EntrySeen
from tests.databases import AppOn

UTC = datetime.timezone.utc
SECOND = datetime.timedelta(seconds=1)
MINUTE = datetime.timedelta(minutes=1)
CHANGELIST = "/admin/advisory_lock/jobrun/"
REQUESTS = "/admin/advisory_lock/jobcontrol/"


def client_of(username: str, *codenames: str, superuser: bool = False) -> Client:
    """A test client logged in as a staff user of "default" with these permissions."""
    if superuser:
        user = User.objects.create_superuser(username, password="pw")
    else:
        user = User.objects.create_user(username, password="pw", is_staff=True)
        user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


@contextlib.contextmanager
def console(using: str, schedule: dict, **lock_settings):
    """The app's models on ``using`` and ``schedule`` as ADVISORY_LOCK["SCHEDULE"]; the users,
    the requests and the first-seen times made meanwhile are deleted afterwards."""
    lock = {**settings.ADVISORY_LOCK, "SCHEDULE": schedule, **lock_settings}
    try:
        with override_settings(DATABASE_ROUTERS=[AppOn(using)], ADVISORY_LOCK=lock):
            yield
    finally:
        User.objects.all().delete()
        JobControl.objects.using(using).all().delete()
        EntrySeen.objects.using(using).all().delete()


def run(ledger, job_name: str, period: str, status: str, started: datetime.datetime, **fields):
    """A ledger row as a run leaves it (``QuerySet.update()`` for a status no version of the
    app writes)."""
    ended = status not in (JobRun.Status.RUNNING, JobRun.Status.ENQUEUED)
    row = ledger.create(
        job_name=job_name,
        period=period,
        started_at=started,
        finished_at=started + 2 * SECOND if ended else None,
        duration=2 * SECOND if ended else None,
        host=fields.pop("host", "web-1"),
        pid=fields.pop("pid", 4242),
        **fields,
    )
    ledger.filter(pk=row.pk).update(status=status)
    row.refresh_from_db()
    return row


def command(name: str, *argv: str) -> tuple[int, str, str]:
    """``call_command(name, *argv)`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command(name, *argv, stdout=out, stderr=err)
    except SystemExit as exit:
        return exit.code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()
