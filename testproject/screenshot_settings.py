"""The demo project as scripts/screenshot.py serves it: its settings (DATABASE_URL names the
script's temporary SQLite database), and a schedule for the admin's Schedule page."""

from testproject.settings import *  # noqa: F403

#: The schedule shown on the Schedule and timeline pages (scripts/screenshot.py seeds its runs).
ADVISORY_LOCK = {
    "SCHEDULE": {
        "nightly-report": {"command": "check", "cron": "0 3 * * *", "grace": 7200},
        "import-prices": {"callable": "gc.collect", "every": 3600, "grace": 600},
        "send-invoices": {"callable": "gc.collect", "every": 900},
    }
}
