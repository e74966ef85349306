"""Settings for the test suite: SQLite ("default"), PostgreSQL and MariaDB/MySQL side by side.

Servers are read from TEST_POSTGRES_URL and TEST_MYSQL_URL (defaults: this machine's local
servers). Worker processes started by the tests set ADVISORY_LOCK_TEST_WORKER=1 and use the
test databases that pytest created.
"""

import json
import os
import socket
import tempfile
import warnings
from importlib.util import find_spec
from pathlib import Path

import django
from django.core.exceptions import ImproperlyConfigured

from testproject.database_url import parse
from testproject.settings import INSTALLED_APPS
from testproject.settings import MIDDLEWARE  # noqa: F401
from testproject.settings import ROOT_URLCONF  # noqa: F401
from testproject.settings import TEMPLATES  # noqa: F401

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

# One folder per test run, shared with the worker processes through the environment; the
# run that made it removes it at its end (tests/conftest.py).
if "ADVISORY_LOCK_TEST_DIR" not in os.environ:
    os.environ["ADVISORY_LOCK_TEST_DIR"] = tempfile.mkdtemp(prefix="advisory-lock-tests-")
    os.environ["ADVISORY_LOCK_TEST_DIR_OWNER"] = str(os.getpid())
RUN_DIR = Path(os.environ["ADVISORY_LOCK_TEST_DIR"])
# Test database names are per run too, so that two runs on one machine don't collide.
TEST_DATABASE = "test_advisory_lock_" + RUN_DIR.name.rsplit("-", 1)[-1].lower()
# pytest-xdist (`make test`) runs the suite in several processes at once. Each one, and every
# process its tests start (they inherit PYTEST_XDIST_WORKER), has a folder and databases of its
# own, so that no two see each other's rows or locks: PostgreSQL's advisory locks belong to a
# database, MySQL's lock names start with the database's name, SQLite's lock files sit beside
# their database file.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if XDIST_WORKER:
    RUN_DIR = RUN_DIR / XDIST_WORKER
    RUN_DIR.mkdir(exist_ok=True)
    TEST_DATABASE = f"{TEST_DATABASE}_{XDIST_WORKER}"
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
MYSQL_URL = os.environ.get("TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(RUN_DIR / "main.sqlite3"),
        "TEST": {"NAME": str(RUN_DIR / "test.sqlite3")},
    },
    "postgresql": {**parse(POSTGRES_URL, RUN_DIR), "TEST": {"NAME": TEST_DATABASE}},
    "mysql": {
        **parse(MYSQL_URL, RUN_DIR),
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"NAME": TEST_DATABASE, "CHARSET": "utf8mb4"},
    },
}


def _reachable(settings_dict: dict) -> bool:
    try:
        socket.create_connection((settings_dict["HOST"], int(settings_dict["PORT"])), 2).close()
    except OSError:
        return False
    return True


if "ADVISORY_LOCK_TEST_MISSING" not in os.environ:
    missing = [alias for alias in ("postgresql", "mysql") if not _reachable(DATABASES[alias])]
    if missing and os.environ.get("CI") == "true":
        raise ImproperlyConfigured(
            f"CI=true but no server answers for {missing}: start PostgreSQL and MariaDB "
            f"(.ci/run does), or set TEST_POSTGRES_URL / TEST_MYSQL_URL."
        )
    for alias in missing:
        warnings.warn(
            f"\n\n*** No server for the {alias!r} test database: its tests are SKIPPED. ***\n",
            stacklevel=1,
        )
    os.environ["ADVISORY_LOCK_TEST_MISSING"] = ",".join(missing)
for alias in os.environ["ADVISORY_LOCK_TEST_MISSING"].split(","):
    DATABASES.pop(alias, None)
INSTALLED_APPS = [*INSTALLED_APPS, "tests.lockapp"]
if os.environ.get("ADVISORY_LOCK_TEST_WORKER"):
    for settings_dict in DATABASES.values():
        settings_dict["NAME"] = settings_dict["TEST"]["NAME"]
    # A worker may connect as another user, or to another database, of an alias's server:
    # {alias: {setting: value}} (tests/test_lock_directory.py).
    for alias, overrides in json.loads(
        os.environ.get("ADVISORY_LOCK_TEST_DB_OVERRIDES", "{}")
    ).items():
        DATABASES[alias] = {**DATABASES[alias], **overrides}
    # Workers may run on a server database as their "default" alias.
    DATABASES["default"] = DATABASES[os.environ.get("ADVISORY_LOCK_TEST_DEFAULT", "default")]

# A heartbeat a second (5 by default): the tests see a scheduler beat, poll and die quickly;
# the counting tests (tests/test_scheduler_costs.py) run theirs at the default.
ADVISORY_LOCK = {"NAMESPACE": "tests", "SCHEDULER_HEARTBEAT": 1}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"advisory_lock": {"handlers": ["console"], "level": "WARNING"}},
}

# Django Tasks (built into Django 6.0; the django-tasks backport on 5.2) with the
# django-tasks-db backend, whose db_worker processes tests/test_task_queues.py starts. Only
# when the packages are installed (the "test" extra), so that the rest of the suite runs
# without them; QUEUES = [] accepts any queue (each test uses its own).
if find_spec("django_tasks_db") and (django.VERSION >= (6, 0) or find_spec("django_tasks")):
    INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
    if django.VERSION < (6, 0):
        INSTALLED_APPS.append("django_tasks")
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": []}}

# The testing kit's example app: what a project writes, tested with advisory_lock.testing
# (tests/kitapp/tests.py with TestCase, tests/test_testing_kit.py with pytest-django).
if "tests.kitapp" not in INSTALLED_APPS:
    INSTALLED_APPS = [*INSTALLED_APPS, "tests.kitapp"]
