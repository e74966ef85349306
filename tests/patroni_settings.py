"""Settings of the processes that run on the Patroni cluster of tests/patroni.py: the children
of tests/test_failover.py (tests/failover_child.py), its ``run_jobs`` schedulers and
``migrate``, and those of bench/failover.py.

No local server: every alias is on the cluster, as ``Cluster.environment(route)`` gives it:

* ADVISORY_LOCK_TEST_PATRONI, a JSON object: the aliases ``multihost`` (libpq's multi-host
  string with ``target_session_attrs=read-write``) and ``haproxy`` (HAProxy in front of the
  nodes), Django's settings of each;
* ADVISORY_LOCK_TEST_PATRONI_DEFAULT: which of them is also "default" (where ``run_jobs``, the
  ledger and the scheduled jobs' ORM calls go);
* ADVISORY_LOCK_TEST_SCHEDULE, a JSON object: ``ADVISORY_LOCK["SCHEDULE"]``;
* ADVISORY_LOCK_TEST_JOBS_DIR: where tests/schedule_jobs.py's runs write down what they did.

Each line of the ``advisory_lock`` logger (INFO and up) is "LEVEL PID LOGGER: message", so
that a scheduler's lines can be told from those of its job processes.
"""

import json
import os

from testproject.settings import INSTALLED_APPS  # noqa: F401
from testproject.settings import MIDDLEWARE  # noqa: F401
from testproject.settings import ROOT_URLCONF  # noqa: F401
from testproject.settings import TEMPLATES  # noqa: F401

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

DATABASES = json.loads(os.environ["ADVISORY_LOCK_TEST_PATRONI"])
DATABASES["default"] = DATABASES[os.environ.get("ADVISORY_LOCK_TEST_PATRONI_DEFAULT", "multihost")]

# A scheduler heartbeat a second, as in tests/settings.py: a dead scheduler is seen quickly.
ADVISORY_LOCK = {
    "NAMESPACE": "tests",
    "SCHEDULER_HEARTBEAT": 1,
    "SCHEDULE": json.loads(os.environ.get("ADVISORY_LOCK_TEST_SCHEDULE", "{}")),
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"tagged": {"format": "%(levelname)s %(process)d %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "tagged"}},
    "loggers": {"advisory_lock": {"handlers": ["console"], "level": "INFO"}},
}
