"""Take the README's screenshots of the admin with headless Chromium (Debian's chromium).

The pages are rendered by Django's test client as a logged-in superuser, written to files
whose static URLs point at a local runserver, and photographed by Chromium.
    .venv/bin/python scripts/screenshot.py
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
WORK = Path(tempfile.mkdtemp(prefix="advisory-lock-screenshot-"))
os.environ["DATABASE_URL"] = f"sqlite:///{WORK / 'shots.sqlite3'}"
os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    rows[3].status, rows[3].error = "failed", "Traceback ...\nConnectionError: SMTP timed out"
    rows[6].status = "abandoned"
    rows.append(
        JobRun(job_name="import_prices", period=f"{now:%Y-%m-%dT%H}", status="running",
               started_at=now, host="web-2", pid=5210, lock_key="job:import_prices")
    )  # fmt: skip
    JobRun.objects.bulk_create(rows)


#: The schedule shown on the Schedule and timeline pages.
SCHEDULE = {
    "nightly-report": {"command": "check", "cron": "0 3 * * *", "grace": 7200},
    "import-prices": {"callable": "gc.collect", "every": 3600, "grace": 600},
    "send-invoices": {"callable": "gc.collect", "every": 900},
}


def seed_schedule() -> None:
    """Runs of the scheduled entries over the last day, a pause, and two live schedulers."""
    from advisory_lock.models import JobControl
    from advisory_lock.models import JobRun
    from advisory_lock.models import SchedulerHeartbeat

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
    for action, back in (("pause", 11.5), ("resume", 9.5), ("pause", 0.2)):
        JobControl.objects.create(
            job_name="import-prices" if back > 1 else "send-invoices", action=action,
            requested_at=now - back * hour, requested_by="admin user 'ops'",
        )  # fmt: skip
    for host, pid in (("web-1", 812), ("web-2", 790)):
        SchedulerHeartbeat.objects.create(
            host=host,
            pid=pid,
            started_at=now - 30 * hour,
            last_seen=now + datetime.timedelta(seconds=20),
            version="0.1.0",
        )


def hold_in_another_thread(key: str) -> None:
    """Take ``key`` in a thread that keeps it until the script ends (a request ending in
    this thread would release a session lock left held on its connection)."""
    import threading

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
    from django.test import Client
    from django.test import override_settings

    call_command("migrate", verbosity=0)
    seed()
    seed_schedule()
    admin = User.objects.create_superuser("admin", "admin@example.com", "admin")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "runserver", f"127.0.0.1:{port}", "--noreload"],
        env={**os.environ, "DJANGO_DEBUG": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        client = Client()
        client.force_login(admin)
        hold_in_another_thread("job:import_prices")  # shown on the held-locks page
        pages = (
            ("/admin/advisory_lock/jobrun/", "admin-job-runs.png"),
            ("/admin/advisory_lock/jobrun/locks/", "admin-held-locks.png"),
            ("/admin/advisory_lock/jobrun/schedule/", "admin-schedule.png"),
            (
                "/admin/advisory_lock/jobrun/schedule/timeline/?entry=import-prices&since="
                + (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=16))
                .isoformat()
                .replace("+", "%2B"),
                "admin-timeline.png",
            ),
        )
        for url, name in pages:
            with override_settings(ADVISORY_LOCK={"SCHEDULE": SCHEDULE}):
                html = client.get(url, HTTP_HOST="127.0.0.1").content.decode()
            page = WORK / "page.html"
            page.write_text(html.replace('"/static/', f'"http://127.0.0.1:{port}/static/'))
            subprocess.run(
                [
                    "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={WORK / 'chromium'}", "--hide-scrollbars",
                    "--window-size=1700,600", f"--screenshot={DOCS / name}", page.as_uri(),
                ],
                check=True,
                capture_output=True,
            )  # fmt: skip
            print(f"wrote docs/{name}")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
