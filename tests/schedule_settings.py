"""Settings of the ``run_jobs`` processes that ``tests/schedulers.py`` starts.

The test settings (run them as a worker: ADVISORY_LOCK_TEST_WORKER=1, and
ADVISORY_LOCK_TEST_DEFAULT=<alias> to run on that alias's test database as "default"), plus:

* ADVISORY_LOCK_TEST_SCHEDULE, a JSON object: ``ADVISORY_LOCK["SCHEDULE"]``;
* ADVISORY_LOCK_TEST_HEARTBEAT, seconds: ``ADVISORY_LOCK["SCHEDULER_HEARTBEAT"]`` (the
  tests' 1 s otherwise);
* ADVISORY_LOCK_TEST_DB_USER: the user the "default" alias connects as (no password);
* ADVISORY_LOCK_TEST_SERVER_CLOCK, a Unix time (MySQL/MariaDB only): every connection starts
  with ``SET TIMESTAMP = <it>``, which moves the server's clock (NOW(), UTC_TIMESTAMP()) for
  that session, so that the scheduler's clock is the server's and not this host's.
"""

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import ADVISORY_LOCK
from tests.settings import DATABASES

ADVISORY_LOCK = {
    **ADVISORY_LOCK,
    "SCHEDULE": json.loads(os.environ.get("ADVISORY_LOCK_TEST_SCHEDULE", "{}")),
}
if heartbeat := os.environ.get("ADVISORY_LOCK_TEST_HEARTBEAT"):
    ADVISORY_LOCK["SCHEDULER_HEARTBEAT"] = float(heartbeat)
if user := os.environ.get("ADVISORY_LOCK_TEST_DB_USER"):
    DATABASES["default"] = {**DATABASES["default"], "USER": user, "PASSWORD": ""}

if server_clock := os.environ.get("ADVISORY_LOCK_TEST_SERVER_CLOCK"):
    for settings_dict in DATABASES.values():
        if settings_dict["ENGINE"] == "django.db.backends.mysql":
            options = settings_dict.setdefault("OPTIONS", {})
            options["init_command"] = f"SET TIMESTAMP = {int(server_clock)}"
