"""Regenerate the docs' screenshots of the admin: headless Debian chromium, driven by
Playwright, photographs the pages that the browser tests drive, served the same way.

The demo project (testproject/screenshot_settings.py: its schedule) is migrated into a
temporary SQLite database and seeded with runs, pauses and live schedulers; Django's
runserver serves it in a process of its own (tests/http_servers.py), a superuser logs in
through the login form (tests/browser.py), and each page is saved at 1280x800 into docs/:
    .venv/bin/python scripts/screenshot.py
Needs Debian's chromium (scripts/setup.sh --servers installs it) and Playwright (the test
dependency group).
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
WORK = Path(tempfile.mkdtemp(prefix="advisory-lock-screenshot-"))
os.environ["DATABASE_URL"] = f"sqlite:///{WORK / 'shots.sqlite3'}"
os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.screenshot_settings"
sys.path.insert(0, str(ROOT))

#: The traceback of the seeded failed run (the run's page shows it).
FAILED_TRACEBACK = """Traceback (most recent call last):
  File "/srv/app/reports/management/commands/nightly_report.py", line 41, in handle
    send_report(build_report(day), to=settings.REPORT_RECIPIENTS)
  File "/srv/app/reports/mail.py", line 17, in send_report
    connection.send_messages([message])
ConnectionError: SMTP server mail.internal:587 timed out after 30 s"""


def seed() -> None:
    from advisory_lock.models import JobRun

    now = datetime.datetime(2026, 11, 29, 14, 0, tzinfo=datetime.timezone.utc)
    rows = []
    for day in range(6):
        start = now - datetime.timedelta(days=day, hours=11)
        for job, seconds, host in (
            ("nightly_report", 42.7, "web-1"),
            ("send_invoices", 8.1, "web-3"),
        ):
            rows.append(
                JobRun(
                    job_name=job, period=f"{start:%Y-%m-%d}", status="succeeded",
                    started_at=start, finished_at=start + datetime.timedelta(seconds=seconds),
                    duration=datetime.timedelta(seconds=seconds), host=host, pid=4100 + day,
                )
            )  # fmt: skip
    rows[2].status, rows[2].error = "failed", FAILED_TRACEBACK
    rows[6].status = "abandoned"
    rows.append(
        JobRun(job_name="import_prices", period=f"{now:%Y-%m-%dT%H}", status="running",
               started_at=now, host="web-2", pid=5210, lock_key="job:import_prices")
    )  # fmt: skip
    JobRun.objects.bulk_create(rows)


def seed_schedule() -> None:
    """Runs of the scheduled entries over the last day, a pause, and two live schedulers."""
    from advisory_lock.models import JobControl
    from advisory_lock.models import JobRun
    from advisory_lock.models import SchedulerHeartbeat
    from advisory_lock.models import StoredEntry

    utc = datetime.timezone.utc
    hour = datetime.timedelta(hours=1)
    now = datetime.datetime.now(utc)
    top = now.replace(minute=0, second=0, microsecond=0)
    rows = []
    for back in range(1, 30):
        slot = top - back * hour
        if back in (9, 10, 11):
            continue  # paused (below), or missed: no run
        status = "failed" if back == 5 else "succeeded"
        seconds = 31.0 + back % 7
        rows.append(
            JobRun(
                job_name="import-prices", period=f"{slot:%Y-%m-%dT%H:%M}", status=status,
                started_at=slot + datetime.timedelta(seconds=2),
                finished_at=slot + datetime.timedelta(seconds=2 + seconds),
                duration=datetime.timedelta(seconds=seconds), host=f"web-{1 + back % 3}",
                pid=4000 + back, attempt=2 if back == 4 else 1,
            )
        )  # fmt: skip
    rows.append(
        JobRun(
            job_name="import-prices", period=f"{top - 4 * hour:%Y-%m-%dT%H:%M}",
            status="failed", started_at=top - 4 * hour, duration=datetime.timedelta(seconds=3),
            host="web-2", pid=3990, attempt=1,
        )
    )  # fmt: skip
    JobRun.objects.bulk_create(rows)
    JobRun.objects.create(
        job_name="send-invoices", period=f"{now:%Y-%m-%dT%H}:00", status="succeeded",
        started_at=now, duration=datetime.timedelta(seconds=8.1), host="web-3", pid=5120,
    )  # fmt: skip
    for action, back, reason in (
        ("pause", 11.5, "the price feed is down"),
        ("resume", 9.5, ""),
        ("pause", 0.2, "invoices on hold for the month's close"),
    ):
        JobControl.objects.create(
            job_name="import-prices" if back > 1 else "send-invoices", action=action,
            requested_at=now - back * hour, requested_by="admin user 'ops'", reason=reason,
        )  # fmt: skip
    # An entry added in the admin at run time (the Stored schedule entries page).
    StoredEntry.objects.create(
        name="refresh-search-index", callable="gc.collect", every=900, alert_after=5
    )
    for host, pid in (("web-1", 812), ("web-2", 790)):
        SchedulerHeartbeat.objects.create(
            host=host,
            pid=pid,
            started_at=now - 30 * hour,
            last_seen=now + datetime.timedelta(seconds=20),
            version="0.1.0",
        )


def hold_in_another_thread(key: str) -> None:
    """Take ``key`` in a thread that keeps it until the script ends: the Locks page shows it
    (SQLite's lock is a file lock, which the server's process sees in /proc/locks)."""
    from advisory_lock import advisory_lock

    held = threading.Event()

    def hold() -> None:
        with advisory_lock(key):
            held.set()
            threading.Event().wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait(10)


def main() -> None:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command

    from advisory_lock.models import JobRun
    from tests.browser import VIEWPORT
    from tests.browser import AdminSite
    from tests.browser import find_chromium
    from tests.browser import launched
    from tests.browser import log_in
    from tests.http_servers import serving

    executable = find_chromium()
    if executable is None:
        sys.exit("No chromium program: install Debian's chromium (scripts/setup.sh --servers).")
    call_command("migrate", verbosity=0)
    seed()
    seed_schedule()
    User.objects.create_superuser("admin", "admin@example.com", "admin")
    failed = JobRun.objects.filter(job_name="nightly_report", status="failed").get()
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=16)
    pages = (
        ("/admin/advisory_lock/jobrun/schedule/", "admin-schedule.png"),
        ("/admin/advisory_lock/jobrun/", "admin-job-runs.png"),
        (f"/admin/advisory_lock/jobrun/{failed.pk}/change/", "admin-job-run.png"),
        ("/admin/advisory_lock/jobrun/locks/", "admin-held-locks.png"),
        ("/admin/advisory_lock/storedentry/", "admin-stored-entries.png"),
        ("/admin/advisory_lock/jobcontrol/", "admin-job-controls.png"),
        (
            "/admin/advisory_lock/jobrun/schedule/timeline/?entry=import-prices&since="
            + since.isoformat().replace("+", "%2B"),
            "admin-timeline.png",
        ),
    )
    hold_in_another_thread("job:import_prices")  # shown on the Locks page
    try:
        with serving("runserver", dict(os.environ)) as server, launched(executable) as browser:
            site = AdminSite("default", server, "admin", "admin")
            page = browser.new_context(viewport=VIEWPORT).new_page()
            # The admin's navigation sidebar closed (Django keeps its state in localStorage):
            # the pages' tables get the width.
            page.add_init_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
            log_in(page, site)
            for url, name in pages:
                page.goto(site.url(url))
                page.screenshot(path=DOCS / name)
                print(f"wrote docs/{name}")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
