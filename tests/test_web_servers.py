"""The counter views under real servers: gunicorn's sync workers and uvicorn's ASGI workers, four
worker processes each, on every database, loaded by concurrent HTTP clients.

The servers serve the test database of the run (see ``tests/web_settings.py``); this process
reads the counters and looks at the locks from its own connections.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections import Counter as Tally
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections

from testproject.example.models import Counter
from tests.http_servers import WebServer
from tests.http_servers import post
from tests.http_servers import post_many
from tests.probes import is_free

REQUESTS = 300
#: Client connections at once. Each request in flight under uvicorn has a database connection
#: of its own (Django runs a request's ORM calls in a thread of its own), so this stays well
#: below PostgreSQL's default max_connections of 100.
CONCURRENCY = 16
#: The locked view of each server: the sync view under gunicorn, its async twin under uvicorn.
LOCKED = {"gunicorn": "/counter/increment/", "uvicorn": "/counter/aincrement/"}
UNLOCKED = {"gunicorn": "/counter/increment-unlocked/", "uvicorn": "/counter/aincrement-unlocked/"}
SERVERS = pytest.mark.parametrize("kind", ["gunicorn", "uvicorn"])


def require(module: str) -> None:
    """Skip (fail with CI=true) when the server ``module`` is not installed."""
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed (pip install -e '.[test]')"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}.", pytrace=False)
    pytest.skip(f"\n\n*** {message}: the web server tests are SKIPPED. ***\n")


@pytest.fixture(scope="module")
def web_server():
    """``web_server(kind, alias, busy_response=None)``: a server of the test project on that
    alias's test database, started on first use and kept for the module."""
    started = {}

    def get(kind, alias, busy_response=None):
        key = (kind, alias, json.dumps(busy_response))
        if key not in started:
            require(kind)
            env = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "tests.web_settings",
                "ADVISORY_LOCK_TEST_WORKER": "1",
                "ADVISORY_LOCK_TEST_DEFAULT": alias,
            }
            if busy_response is not None:
                env["ADVISORY_LOCK_TEST_BUSY_RESPONSE"] = json.dumps(busy_response)
            started[key] = WebServer(kind, env)
            started[key].wait_ready()
        return started[key]

    try:
        yield get
    finally:
        for server in started.values():
            server.terminate()  # all of them first: they stop side by side
        for server in started.values():
            server.stop()


def counter_value(name, using):
    return Counter.objects.using(using).get(name=name).value


def statuses(answers):
    return dict(Tally(answer.status for answer in answers))


def assert_all_200(answers, server):
    failed = [answer for answer in answers if answer.status != 200]
    assert not failed, (
        f"{statuses(answers)}; the first of those not 200: {failed[0]}\n"
        f"--- {server!r} said ---\n{server.output()[-5000:]}"
    )


def wait_until_held(key, using, timeout=10.0):
    """Return once another process holds ``key``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while is_free(key, using):
        if time.monotonic() > deadline:
            pytest.fail(f"nobody took the lock {key!r} within {timeout:g}s")
        time.sleep(0.01)


@SERVERS
def test_locked_counter_loses_no_update_under_concurrent_posts(using, web_server, kind):
    server = web_server(kind, using)
    name = f"locked-{kind}"

    answers = post_many(server.url(f"{LOCKED[kind]}?name={name}"), REQUESTS, CONCURRENCY)

    assert_all_200(answers, server)
    # Each request read the value the one before it wrote: the answers are 1, 2, ... N.
    assert sorted(answer.json()["value"] for answer in answers) == list(range(1, REQUESTS + 1))
    assert counter_value(name, using) == REQUESTS


@SERVERS
def test_without_the_lock_the_same_load_loses_updates(using, web_server, kind):
    """The control: the same load on the same view without its lock goes wrong, so the test
    above can fail.

    PostgreSQL and MariaDB (READ COMMITTED) answer every request and lose updates silently:
    two requests read the same value and both write it plus one. So does the async view on
    SQLite, whose statements each commit on their own. SQLite loses none in the sync view's
    transaction, but fails requests instead: both read in a deferred transaction (a shared
    lock), then the first to write takes the write lock and the other gets "database is
    locked" at once (a 500), since waiting (the busy timeout) would deadlock. The lock
    matters on SQLite too: it is what orders the read-modify-writes, not SQLite's own locks.
    """
    server = web_server(kind, using)
    name = f"unlocked-{kind}"

    answers = post_many(server.url(f"{UNLOCKED[kind]}?name={name}"), REQUESTS, CONCURRENCY)

    answered = statuses(answers).get(200, 0)
    if connections[using].vendor == "sqlite" and kind == "gunicorn":
        assert counter_value(name, using) == answered < REQUESTS
    else:
        assert counter_value(name, using) < answered == REQUESTS


@SERVERS
def test_try_once_view_answers_503_with_retry_after_while_another_request_holds_the_lock(
    using, web_server, kind
):
    server = web_server(kind, using)
    name = f"busy-{kind}"
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, server.url(f"{LOCKED[kind]}?name={name}&hold=1"))
        wait_until_held(f"counter:{name}", using)
        busy = post(server.url(f"/counter/try-increment/?name={name}"))
        held = holder.result()

    assert (busy.status, busy.headers.get("Retry-After")) == (503, "1")
    assert held.status == 200
    free = post(server.url(f"/counter/try-increment/?name={name}"))
    assert (free.status, free.json()["value"]) == (200, 2)


# The answer is the middleware's, whatever the database found busy (the test above covers each).
@pytest.mark.parametrize("using", ["default"], ids=["sqlite"], indirect=True)
def test_busy_response_setting_makes_the_try_once_view_answer_409(using, web_server):
    server = web_server("gunicorn", using, {"status": 409, "retry_after": 7})
    name = "busy-409"
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, server.url(f"/counter/increment/?name={name}&hold=1"))
        wait_until_held(f"counter:{name}", using)
        busy = post(server.url(f"/counter/try-increment/?name={name}"))
        assert holder.result().status == 200

    assert (busy.status, busy.headers.get("Retry-After")) == (409, "7")
    assert counter_value(name, using) == 1
