"""The test settings without ``advisory_lock`` in INSTALLED_APPS: a project that takes locks
and runs ``@single_instance`` commands and functions, and has no ledger (the processes of
``tests/test_without_the_app.py``).

Run as a worker (ADVISORY_LOCK_TEST_WORKER=1, ADVISORY_LOCK_TEST_DEFAULT=<alias>), on the test
databases of the pytest run that starts it. The test app's commands (``tests.lockapp``) stay;
the testing kit's example app goes, as it keeps its runs in the ledger. Requests are served
by the views that leave a lock held (``tests.leaky_views``).
"""

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [app for app in INSTALLED_APPS if app not in ("advisory_lock", "tests.kitapp")]
ROOT_URLCONF = "tests.leaky_views"
ALLOWED_HOSTS = ["testserver"]  # django.test.Client's host
