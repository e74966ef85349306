"""Drive the admin in a real browser: Debian's ``chromium`` through Playwright, against the
test project served by Django's runserver in a process of its own, on one alias's test
database (the browser tests' fixtures are in tests/conftest.py; scripts/screenshot.py
photographs the same pages).

How one browser test runs:

1. ``admin_site`` (once per test module and database) starts ``manage.py runserver`` with
   tests/browser_settings.py on that alias's test database and the module's ``admin_schedule``
   (``serve_admin()``), and creates a superuser there;
2. ``admin_session`` logs in through the admin's login form once (``log_in()``), and each
   ``admin_page`` is a browser context of its own (1280x800) with those cookies;
3. the test clicks through the pages, with ``admin_schedulers`` for real ``run_jobs``
   processes on the same database and schedule (tests/schedulers.py);
4. at its end the schedulers are killed and the rows of the app's tables on the alias deleted.

Without chromium or Playwright the tests are skipped, loudly; with CI=true they fail instead
(``missing()``), as the failover tests do without etcd (tests/patroni.py). ``scripts/setup.sh
--servers`` (which ``make test`` runs) installs Debian's chromium; Playwright's own browser
download is not used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.http_servers import WebServer
from tests.http_servers import serving
from tests.schedulers import schedule_env

try:
    from playwright.sync_api import expect
except ImportError:  # the fixture ``chromium`` skips the tests (fails them with CI=true)
    expect = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from playwright.sync_api import Browser
    from playwright.sync_api import Locator
    from playwright.sync_api import Page

#: The size of the browser's window, and of the docs' screenshots.
VIEWPORT = {"width": 1280, "height": 800}
#: A guard against a hang, never a timing: how long a click, a page load or an ``expect()``
#: may wait (a loaded 2-core machine takes seconds to start a Django process).
HANG_MS = 120_000
if expect is not None:
    # The assertions' wait too (Playwright's default: 5 s), not only the actions'.
    expect.set_options(timeout=HANG_MS)
#: The admin's pages, under the server's root.
LOGIN = "/admin/login/"
SCHEDULE = "/admin/advisory_lock/jobrun/schedule/"
JOB_RUNS = "/admin/advisory_lock/jobrun/"
LOCKS = "/admin/advisory_lock/jobrun/locks/"


def find_chromium() -> str | None:
    """Debian's chromium (the package ``chromium``; ``chromium-browser`` elsewhere), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing(what: str) -> None:
    """Skip the test, loudly, because ``what`` is missing here; fail it with CI=true, where
    a browser test that does not run is a failure."""
    message = f"{what}: the browser tests can't run."
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(f"\n\n*** {message[:1].upper()}{message[1:]} They are SKIPPED. ***\n")


@contextlib.contextmanager
def launched(executable: str) -> Iterator[Browser]:
    """A headless Chromium (``executable``) under Playwright, closed when the block ends.

    Playwright's sync API leaves its asyncio event loop installed as the running loop of this
    thread while it is started, so Django's async-safety check would refuse every ORM call of
    the test ("You cannot call this from an async context"). The check guards a connection
    against coroutines sharing it; here the ORM calls are the test's own, in this thread,
    outside any coroutine: DJANGO_ALLOW_ASYNC_UNSAFE lets them through for the block only
    (the loop is gone once Playwright has stopped, and the check is back for the next tests).
    """
    from playwright.sync_api import sync_playwright

    with pytest.MonkeyPatch.context() as patch, sync_playwright() as playwright:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        # Chromium refuses to start as root with its sandbox; Playwright starts it without
        # (chromium_sandbox=False, said here because the tests run as root in CI).
        browser = playwright.chromium.launch(executable_path=executable, chromium_sandbox=False)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class AdminSite:
    """The admin served on one alias's test database, and the superuser who logs in."""

    using: str
    server: WebServer
    username: str
    password: str

    def url(self, path: str) -> str:
        return self.server.url(path)


@contextlib.contextmanager
def serve_admin(using: str, schedule: dict, folder: Path) -> Iterator[WebServer]:
    """``manage.py runserver`` on ``using``'s test database with ``schedule``, ready to
    answer; the environment is the schedulers' (tests/schedulers.py), so that the admin shows
    the schedule they run, and their jobs record their runs in ``folder``."""
    env = {
        **schedule_env(using, schedule, folder),
        "DJANGO_SETTINGS_MODULE": "tests.browser_settings",
    }
    with serving("runserver", env) as server:
        yield server


def log_in(page: Page, site: AdminSite) -> None:
    """Log in through the admin's login form as the site's superuser."""
    page.goto(site.url(LOGIN))
    page.get_by_label("Username").fill(site.username)
    page.get_by_label("Password").fill(site.password)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(site.url("/admin/"))


def schedule_row(page: Page, entry: str) -> Locator:
    """The Schedule page's row of ``entry``."""
    return page.locator("#schedule tbody tr").filter(
        has=page.get_by_role("cell", name=entry, exact=True)
    )


def pause(page: Page, entry: str, reason: str = "") -> None:
    """On the Schedule page, pause ``entry`` with its row's button, saying why."""
    row = schedule_row(page, entry)
    if reason:
        row.get_by_label(f"Why pause {entry}").fill(reason)
    row.get_by_role("button", name="Pause").click()


def run_now(page: Page, entry: str) -> None:
    """On the Schedule page, ask for a run of ``entry`` now with its row's button."""
    schedule_row(page, entry).get_by_role("button", name="Run now").click()


def messages(page: Page) -> Locator:
    """The admin's messages ("Paused the scheduled entry ...") shown after an action."""
    return page.locator("ul.messagelist")


def run_row(page: Page, period: str) -> Locator:
    """The job runs list's row of the run of slot ``period``."""
    return page.locator("#result_list tbody tr").filter(
        has=page.get_by_role("cell", name=period, exact=True)
    )
