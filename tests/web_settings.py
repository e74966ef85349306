"""Settings of the gunicorn and uvicorn servers that ``tests/test_web_servers.py`` starts.

The test settings (run them as a worker: ADVISORY_LOCK_TEST_WORKER=1, and
ADVISORY_LOCK_TEST_DEFAULT=<alias> to serve that alias's test database as "default"), plus
what serving over HTTP needs. ADVISORY_LOCK_TEST_BUSY_RESPONSE, a JSON object, replaces
``ADVISORY_LOCK["BUSY_RESPONSE"]`` (``{"status": 409, "retry_after": 7}``, say).
"""

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import ADVISORY_LOCK
from tests.settings import LOGGING

ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
# A 500's traceback goes to the server's output, which a failing test shows.
LOGGING = {
    **LOGGING,
    "loggers": {
        **LOGGING["loggers"],
        "django.request": {"handlers": ["console"], "level": "ERROR"},
    },
}

if busy_response := os.environ.get("ADVISORY_LOCK_TEST_BUSY_RESPONSE"):
    ADVISORY_LOCK = {**ADVISORY_LOCK, "BUSY_RESPONSE": json.loads(busy_response)}
