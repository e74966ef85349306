"""Settings of the uvicorn server of ``tests/test_cancel_under_uvicorn.py``: those of
``tests/web_settings.py``, serving ``tests/cancel_views.py``."""

from tests.web_settings import *  # noqa: F403

ROOT_URLCONF = "tests.cancel_views"
