"""Worker settings: tests.settings, with the lock's connection going through a test's proxy.

Set by the test in the worker's environment (see tests.faults.helpers.start_through_proxy):

* ``ADVISORY_LOCK_TEST_PROXY_PORT``: the port of the test's proxy on 127.0.0.1, which
  forwards to the real server of ``ADVISORY_LOCK_TEST_DEFAULT``.
* ``ADVISORY_LOCK_TEST_PROXY_LAYOUT``: ``default`` (the "default" alias goes through the
  proxy), or ``lock_alias``: "default" connects directly, and a "locks" alias, the same
  database through the proxy, is ``ADVISORY_LOCK["DIRECT_ALIAS"]`` for "default", so only the
  command's lock (and its ledger rows) use it. That is the layout to recommend: the idle
  timeout below then applies to the lock's connections only.
* ``ADVISORY_LOCK_TEST_IDLE_TIMEOUT``: seconds; the server closes a session of the proxied
  alias that stays idle longer (PostgreSQL ``idle_session_timeout``, MySQL/MariaDB
  ``wait_timeout``), set per session through the connection's OPTIONS.
* ``ADVISORY_LOCK_TEST_KEEPALIVE``: "1" to turn on aggressive TCP keepalive on both ends of
  PostgreSQL sessions (1 s idle, 1 s interval, 2 probes), to show that it does not help.
"""

import copy
import os

from tests.settings import *  # noqa: F403
from tests.settings import ADVISORY_LOCK
from tests.settings import DATABASES

_proxied = copy.deepcopy(DATABASES["default"])
_proxied["HOST"] = "127.0.0.1"
_proxied["PORT"] = os.environ["ADVISORY_LOCK_TEST_PROXY_PORT"]
_options = _proxied.setdefault("OPTIONS", {})
_postgresql = _proxied["ENGINE"].endswith("postgresql")
_idle = os.environ.get("ADVISORY_LOCK_TEST_IDLE_TIMEOUT")
_server_settings = []
if _idle and _postgresql:
    _server_settings.append(f"-c idle_session_timeout={round(float(_idle) * 1000)}")
elif _idle:
    _options["init_command"] = f"SET SESSION wait_timeout={int(float(_idle))}"
if os.environ.get("ADVISORY_LOCK_TEST_KEEPALIVE") == "1" and _postgresql:
    # The server's probes (and libpq's) are answered by the proxy's kernel: no effect.
    _server_settings += [
        "-c tcp_keepalives_idle=1",
        "-c tcp_keepalives_interval=1",
        "-c tcp_keepalives_count=2",
    ]
    _options.update(keepalives=1, keepalives_idle=1, keepalives_interval=1, keepalives_count=2)
if _server_settings:
    _options["options"] = " ".join(_server_settings)

if os.environ.get("ADVISORY_LOCK_TEST_PROXY_LAYOUT", "default") == "lock_alias":
    DATABASES["locks"] = _proxied
    ADVISORY_LOCK = {**ADVISORY_LOCK, "DIRECT_ALIAS": {"default": "locks"}}
else:
    DATABASES["default"] = _proxied
