"""Under uvicorn, a client that hangs up cancels its request's task (Django's ASGI handler
does that on ``http.disconnect``): the async ``@single_instance`` function the view was
running leaves nothing held, and later requests run the job (issue 19, item 1).

Clients send a request and close their socket after a few milliseconds (a third of them
after up to 300 ms; some with a reset), eight at a time, while the job's body takes longer
than any of them waits: every call is cancelled, while its lock is taken, its slot claimed or
its body runs. Then, once the server has handled the hang-ups: the worker has no run thread
and no lock connection left (its ``/cancel/held/`` view says), the lock is free from this
process, no row is left running (each cancelled run says "cancelled"), no lock session is
left on PostgreSQL, and a request that waits for its answer runs the job.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from advisory_lock import JobRun
from tests.http_servers import HOST
from tests.http_servers import serving
from tests.leftovers import lock_sessions
from tests.probes import is_free
from tests.test_web_servers import require

CLIENTS = 60
CONCURRENCY = 8
#: How long clients wait before they hang up: most a few milliseconds (while the lock is
#: taken and the slot claimed), some longer (in the body, even on a loaded machine).
PATIENCE = [(0, 0.03), (0, 0.03), (0.03, 0.3)]
#: The job's body: longer than any client waits, so that every call is cancelled.
HOLD = 2.0
LEDGER_JOB = "tests.cancel_views.with_ledger"


def get(port, path, timeout=30.0):
    """GET ``path`` and wait for the answer (JSON)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, (response.status, body[:2000])
        return json.loads(body)
    finally:
        connection.close()


def hang_up(port, path, patience, reset):
    """Send a request, wait ``patience`` seconds, close the connection without reading."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        time.sleep(patience)  # the client's patience: where its request gets cancelled
        if reset:  # an abortive close (RST) rather than a FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def what_is_left(server, using, key, job_name):
    """Everything the job's calls left behind, from the worker, this process and the server."""
    left = {k: v for k, v in get(server.port, "/cancel/held/").items() if v}
    if not is_free(key, using):
        left["lock"] = key
    if job_name is not None:
        rows = JobRun.objects.using(using).filter(job_name=job_name)
        if running := list(rows.filter(status="running").values_list("pk", flat=True)):
            left["running rows"] = running
    sessions = lock_sessions(using)
    if sessions and using == "postgresql":
        left["lock sessions"] = sessions
    return left


def wait_until_nothing_is_left(server, using, key, job_name, timeout=15.0):
    """Return once the server has handled the hang-ups and nothing is left; fail (saying
    what is left) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while left := what_is_left(server, using, key, job_name):
        if time.monotonic() > deadline:
            pytest.fail(
                f"{timeout:g}s after the clients hung up, still left: {left}\n"
                f"--- the server said ---\n{server.output()[-5000:]}"
            )
        time.sleep(0.05)


@pytest.fixture
def ledger(using):
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def test_clients_that_hang_up_leave_no_lock_held(using, ledger):
    require("uvicorn")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.cancel_web_settings",
        "ADVISORY_LOCK_TEST_WORKER": "1",
        "ADVISORY_LOCK_TEST_DEFAULT": using,
    }
    rng = random.Random()
    with serving("uvicorn", env, workers=1) as server:
        for job, key, job_name in [
            ("lock", "web-cancel:storm", None),
            ("ledger", "web-cancel-ledger:storm", LEDGER_JOB),
        ]:
            path = f"/cancel/{job}/storm/?hold={HOLD}"
            clients = [
                (rng.uniform(*rng.choice(PATIENCE)), rng.random() < 0.3) for _ in range(CLIENTS)
            ]
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                calls = [pool.submit(hang_up, server.port, path, *client) for client in clients]
                for call in calls:
                    call.result()

            wait_until_nothing_is_left(server, using, key, job_name)
            if job_name is not None:
                rows = ledger.filter(job_name=job_name)
                assert rows.exists(), "no call got as far as claiming the slot"
                assert set(rows.values_list("status", flat=True)) == {"failed"}
                assert all("cancelled" in error for error in rows.values_list("error", flat=True))
            # A client that waits for its answer runs the job.
            assert get(server.port, f"/cancel/{job}/storm/?hold=0") == {"ran": True}
            assert what_is_left(server, using, key, job_name) == {}
            if job_name is not None:
                latest = ledger.filter(job_name=job_name).order_by("-attempt").first()
                assert latest.status == "succeeded"
