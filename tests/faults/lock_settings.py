"""Worker settings: tests.settings, with ``ADVISORY_LOCK`` updated from the environment.

``ADVISORY_LOCK_TEST_SETTINGS`` is a JSON object merged into ``ADVISORY_LOCK`` (e.g.
``{"SCHEDULE": {...}, "JOBS": {...}}``), so that a test can start a real ``manage.py`` on a
configuration the system checks should refuse (see tests.faults.test_bad_input).
"""

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import ADVISORY_LOCK

ADVISORY_LOCK = {
    **ADVISORY_LOCK,
    **json.loads(os.environ.get("ADVISORY_LOCK_TEST_SETTINGS", "{}")),
}
