"""Settings of the processes that tests/test_use_tz_false.py starts: the scheduler tests'
settings (``tests.schedule_settings``: the test settings, ADVISORY_LOCK_TEST_WORKER=1 and
ADVISORY_LOCK_TEST_DEFAULT=<alias> to run on that alias's test database, and
ADVISORY_LOCK_TEST_SCHEDULE as the schedule) with ``USE_TZ = False``.

Django then stores and reads datetimes naive, in ``TIME_ZONE``; the ledger names its slots in
``LEDGER_TIME_ZONE``. The two zones are 25 hours apart and have no DST, so a date or a time
taken in the wrong one never passes for the right one: a slot of the ledger's day is never
the stored zone's day, and a time stored in UTC or in the ledger's zone is 14 or 25 hours off.
"""

from tests.schedule_settings import *  # noqa: F403
from tests.schedule_settings import ADVISORY_LOCK

USE_TZ = False
TIME_ZONE = "Pacific/Kiritimati"  # UTC+14
LEDGER_TIME_ZONE = "Pacific/Pago_Pago"  # UTC-11
ADVISORY_LOCK = {**ADVISORY_LOCK, "LEDGER_TIME_ZONE": LEDGER_TIME_ZONE}
