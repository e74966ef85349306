"""The admin in a real browser: Debian's chromium, driven by Playwright, against the admin
served by a real HTTP server in a process of its own, on each database (tests/browser.py says
how; the fixtures are in tests/conftest.py). What an operator does: log in, pause an entry,
run one now and see a live ``run_jobs`` run it, open a failed run from the job runs list; and
what the browser shows of every run status (its badge's colour, as computed).

The rows these clicks write are read back from the database the server uses (the job_controls
row that names the user, the ledger's runs), and a run is waited for on its row.
"""

from __future__ import annotations

import datetime
import re
from typing import TYPE_CHECKING

import pytest

from advisory_lock.admin import STATUS_COLOURS
from advisory_lock.admin import STATUS_LABELS
from advisory_lock.admin import UNKNOWN_COLOUR
from advisory_lock.models import JobRun
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.browser import JOB_RUNS
from tests.browser import SCHEDULE
from tests.browser import AdminSite
from tests.browser import expect
from tests.browser import messages
from tests.browser import pause
from tests.browser import run_now
from tests.browser import run_row
from tests.browser import schedule_row
from tests.schedulers import HANG
from tests.schedulers import JOBS
from tests.schedulers import wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

#: An hourly entry that succeeds, and one that fails. A scheduler's first pass runs each
#: entry's current slot (its first run), so a test that starts one sees those runs too.
REPORT = {"callable": f"{JOBS}.tick", "every": 3600}
BROKEN = {"callable": f"{JOBS}.fail", "every": 3600}
#: Every status a run can have, and one that no version of the app writes (markup in it).
STATUSES = [*JobRun.Status, "<i>later</i>"]


def rgb(colour: str) -> str:
    """``#rrggbb`` as a browser's computed style gives it."""
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({red}, {green}, {blue})"


@pytest.fixture(scope="module")
def admin_schedule():
    return {"report": REPORT, "broken": BROKEN}


def test_the_superuser_logs_in_and_finds_the_job_runs(browser_page: Page, admin_site):
    page = browser_page
    page.goto(admin_site.url(JOB_RUNS))
    expect(page).to_have_title("Log in | Django site admin")  # anonymous: sent to log in
    page.get_by_label("Username").fill(admin_site.username)
    page.get_by_label("Password").fill("not-the-password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator(".errornote")).to_contain_text("Please enter the correct username")
    page.get_by_label("Password").fill(admin_site.password)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(admin_site.url(JOB_RUNS))  # back where the login started
    expect(page.get_by_role("heading", name="Select job run to view")).to_be_visible()
    page.get_by_role("link", name="Schedule", exact=True).click()
    expect(page).to_have_url(admin_site.url(SCHEDULE))


def test_an_entry_paused_from_the_schedule_page_shows_paused_and_names_the_user(
    admin_page: Page, admin_site: AdminSite
):
    page = admin_page
    page.goto(admin_site.url(SCHEDULE))
    expect(schedule_row(page, "report")).to_contain_text("active")
    pause(page, "report", reason="the upstream API is down")
    expect(messages(page)).to_contain_text("Paused the scheduled entry 'report'.")
    expect(schedule_row(page, "report").locator(".paused")).to_have_text("paused")
    # Who paused it, and why, on the row.
    details = schedule_row(page, "report").locator(".pause-details")
    expect(details).to_contain_text("by admin user 'admin'")
    expect(details.locator(".pause-reason")).to_have_text("the upstream API is down")
    expect(schedule_row(page, "report").get_by_role("button", name="Resume")).to_be_visible()
    expect(schedule_row(page, "broken")).to_contain_text("active")  # the other one is not
    [row] = JobControl.objects.using(admin_site.using).all()
    assert (row.job_name, row.action, row.requested_by, row.reason) == (
        "report",
        JobControl.Action.PAUSE,
        "admin user 'admin'",
        "the upstream API is down",
    )
    # Listed in the requests' admin too, read-only, with who asked.
    page.goto(admin_site.url("/admin/advisory_lock/jobcontrol/"))
    listed = page.locator("#result_list tbody tr").filter(has_text="report")
    expect(listed).to_contain_text("admin user 'admin'")
    expect(listed).to_contain_text("the upstream API is down")


def test_run_now_is_run_by_a_live_scheduler_and_listed_with_the_job_runs(
    admin_page: Page, admin_site: AdminSite, admin_schedulers
):
    using = admin_site.using
    page = admin_page
    page.goto(admin_site.url(SCHEDULE))
    # Without a live scheduler nobody would run it: the button says so.
    expect(schedule_row(page, "report").get_by_role("button", name="Run now")).to_be_disabled()
    scheduler = admin_schedulers.start({"report": REPORT})
    # Live once its heartbeat row is there, and idle once its first pass ran the entry's
    # current slot (a new entry's first run): the run asked for below is then the only one.
    wait_for(
        lambda: (
            SchedulerHeartbeat.objects.using(using).exists()
            and JobRun.objects.using(using).filter(status=JobRun.Status.SUCCEEDED).exists()
        ),
        "the scheduler's heartbeat and its first pass's run",
    )
    page.reload()
    expect(page.locator("#schedulers")).to_contain_text(f"pid {scheduler.pid}")
    run_now(page, "report")
    expect(messages(page)).to_contain_text("Requested a run of the scheduled entry 'report' now")
    [request] = JobControl.objects.using(using).filter(action=JobControl.Action.RUN_NOW)
    assert request.requested_by == "admin user 'admin'" and request.slot.startswith("manual:")
    wait_for(
        lambda: (
            JobRun.objects.using(using)
            .filter(job_name="report", period=request.slot, status=JobRun.Status.SUCCEEDED)
            .exists()
        ),
        f"the requested run {request.slot} succeeded",
        timeout=HANG,
    )
    breadcrumbs = page.get_by_role("navigation", name="Breadcrumbs")
    breadcrumbs.get_by_role("link", name="Job runs").click()
    expect(run_row(page, request.slot).locator(".jobrun-status")).to_have_text("succeeded")


def test_a_failed_run_opens_from_the_job_runs_list_with_its_traceback(
    admin_page: Page, admin_site: AdminSite, admin_schedulers
):
    status, _out, err = admin_schedulers.once({"broken": BROKEN})
    [failed] = JobRun.objects.using(admin_site.using).filter(job_name="broken")
    assert failed.status == JobRun.Status.FAILED, (status, err)
    page = admin_page
    page.goto(admin_site.url(JOB_RUNS))
    page.locator("#changelist-filter").get_by_role("link", name="failed").click()
    row = run_row(page, failed.period)
    expect(row.locator(".jobrun-status")).to_have_text("failed")
    row.get_by_role("link", name="broken").click()
    # The run's page, which keeps the list's filter for the way back.
    change = admin_site.url(f"{JOB_RUNS}{failed.pk}/change/")
    expect(page).to_have_url(re.compile(rf"^{re.escape(change)}\?_changelist_filters="))
    expect(page.locator(".field-status_badge .jobrun-status")).to_have_text("failed")
    expect(page.locator(".field-traceback pre")).to_contain_text(
        "RuntimeError: the scheduled job failed on purpose"
    )


def test_every_run_status_shows_as_a_badge_of_its_colour(admin_page: Page, admin_site: AdminSite):
    started = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)
    for number, status in enumerate(STATUSES):
        JobRun.objects.using(admin_site.using).create(
            job_name=f"job-{number}", period="2026-11-29", status=status, started_at=started
        )
    page = admin_page
    page.goto(admin_site.url(JOB_RUNS))
    for status in STATUSES:
        badge = page.locator(f'#result_list .jobrun-status[data-status="{status}"]')
        expect(badge).to_have_text(STATUS_LABELS.get(status, status))  # the unknown one as stored
        expect(badge).to_have_css(
            "background-color", rgb(STATUS_COLOURS.get(status, UNKNOWN_COLOUR))
        )


def test_a_failed_slot_opens_from_the_schedule_pages_health_strip(
    admin_page: Page, admin_site: AdminSite, admin_schedulers
):
    status, _out, err = admin_schedulers.once({"broken": BROKEN})
    [failed] = JobRun.objects.using(admin_site.using).filter(job_name="broken")
    assert failed.status == JobRun.Status.FAILED, (status, err)
    page = admin_page
    page.goto(admin_site.url(SCHEDULE))
    cell = schedule_row(page, "broken").locator('.slot-cell[data-outcome="failed"]')
    expect(cell).to_have_count(1)
    cell.click()
    expect(page).to_have_url(admin_site.url(f"{JOB_RUNS}{failed.pk}/change/"))
    expect(page.locator(".field-traceback pre")).to_contain_text(
        "RuntimeError: the scheduled job failed on purpose"
    )


def test_an_entry_added_in_the_admin_is_run_by_a_live_scheduler(
    admin_page: Page, admin_site: AdminSite, admin_schedulers
):
    using = admin_site.using
    admin_schedulers.start({})  # nothing in the settings' schedule: it runs what is stored
    wait_for(lambda: SchedulerHeartbeat.objects.using(using).exists(), "the scheduler's heartbeat")
    page = admin_page
    page.goto(admin_site.url("/admin/advisory_lock/storedentry/add/"))
    page.locator("#id_name").fill("added")
    page.locator("#id_callable").fill(f"{JOBS}.tick")
    page.locator("#id_every").fill("3600")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(messages(page)).to_contain_text("was added successfully")
    # The live scheduler takes the new entry up and runs its current slot (its first run).
    run = wait_for(
        lambda: (
            JobRun.objects.using(using)
            .filter(job_name="added", status=JobRun.Status.SUCCEEDED)
            .first()
        ),
        "the added entry's first run succeeded",
        timeout=HANG,
    )
    page.goto(admin_site.url(JOB_RUNS))
    expect(run_row(page, run.period).locator(".jobrun-status")).to_have_text("succeeded")
    expect(run_row(page, run.period)).to_contain_text("added")


@pytest.mark.parametrize(
    "path",
    [JOB_RUNS, SCHEDULE, "/admin/advisory_lock/jobrun/locks/"],
    ids=["runs", "schedule", "locks"],
)
def test_the_consoles_pages_fit_1280_pixels_with_the_sidebar_open(
    admin_page: Page, admin_site: AdminSite, path: str
):
    # Runs of every status, one with a long error and a long host name: the widest cells.
    started = datetime.datetime(2026, 11, 29, 3, 0, tzinfo=datetime.timezone.utc)
    for number, status in enumerate(JobRun.Status):
        JobRun.objects.using(admin_site.using).create(
            job_name=f"a-rather-long-job-name-{number}", period="2026-11-29T03:00",
            status=status, started_at=started, host="worker-with-a-long-host-name-17",
            pid=123456, attempt=2, error="Traceback\n  File x\nValueError: " + "why " * 60,
        )  # fmt: skip
    page = admin_page
    page.add_init_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'true')")
    page.goto(admin_site.url(path))
    expect(page.locator("#nav-sidebar")).to_be_visible()
    # No part of the page is out of the window: no scrolling sideways to see a column.
    widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], widths
