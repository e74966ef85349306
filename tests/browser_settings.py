"""Settings of the admin's server that the browser tests drive (tests/browser.py).

The settings of the ``run_jobs`` processes (tests/schedule_settings.py: a worker on
ADVISORY_LOCK_TEST_DEFAULT's test database, ADVISORY_LOCK_TEST_SCHEDULE's schedule), so that
the admin shows the schedule that the test's schedulers run, plus what serving over HTTP
needs (tests/web_settings.py): the loopback host names, a 500's traceback in the output.
"""

from tests.schedule_settings import *  # noqa: F403
from tests.web_settings import ALLOWED_HOSTS  # noqa: F401
from tests.web_settings import LOGGING  # noqa: F401
