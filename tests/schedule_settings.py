"""Settings of the ``run_jobs`` processes that ``tests/schedulers.py`` starts.

The test settings (run them as a worker: ADVISORY_LOCK_TEST_WORKER=1, and
ADVISORY_LOCK_TEST_DEFAULT=<alias> to run on that alias's test database as "default"), plus:

* ADVISORY_LOCK_TEST_SCHEDULE, a JSON object: ``ADVISORY_LOCK["SCHEDULE"]``;
* ADVISORY_LOCK_TEST_HEARTBEAT, seconds: ``ADVISORY_LOCK["SCHEDULER_HEARTBEAT"]`` (the
  tests' 1 s otherwise);
* ADVISORY_LOCK_TEST_DB_USER: the user the "default" alias connects as (no password);
* ADVISORY_LOCK_TEST_POOL_MODE: ``ADVISORY_LOCK["POOL_MODE"]`` of "default" (a pooler
  declared in front of it, and no ``DIRECT_ALIAS``);
* ADVISORY_LOCK_TEST_DB_PORT and ADVISORY_LOCK_TEST_DB_NAME: the server port and database of
  "default" (a server of the test's own, as root);
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

if pool_mode := os.environ.get("ADVISORY_LOCK_TEST_POOL_MODE"):
    ADVISORY_LOCK["POOL_MODE"] = {"default": pool_mode}
if port := os.environ.get("ADVISORY_LOCK_TEST_DB_PORT"):
    DATABASES["default"] = {
        **DATABASES["default"],
        "PORT": port,
        "NAME": os.environ["ADVISORY_LOCK_TEST_DB_NAME"],
        "USER": "root",
        "PASSWORD": "",
    }

if server_clock := os.environ.get("ADVISORY_LOCK_TEST_SERVER_CLOCK"):
    for settings_dict in DATABASES.values():
        if settings_dict["ENGINE"] == "django.db.backends.mysql":
            options = settings_dict.setdefault("OPTIONS", {})
            options["init_command"] = f"SET TIMESTAMP = {int(server_clock)}"

# tests/test_alerts.py: the alerts of these processes written down (tests/alertapp).
if os.environ.get("ADVISORY_LOCK_TEST_ALERTS"):
    INSTALLED_APPS = [*INSTALLED_APPS, "tests.alertapp"]  # noqa: F405
