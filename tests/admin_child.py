"""The admin, served in a child process: ``python -m tests.admin_child [--name NAME ...]``.

For tests/test_admin_terminate.py. The terminate view sends real signals (SQLite: its holder
is a process) or kills real sessions, so the tests never run it in their own process: this
child serves the admin through Django's test client, as a logged-in superuser, in a process
group of its own (the test starts it with ``start_new_session=True``), and

* blocks SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (``pthread_sigmask``, before
  any thread starts), so that a signal sent to itself or its group can't stop it;
* replaces ``os.kill``, ``os.killpg`` and ``signal.pidfd_send_signal`` with a tripwire that
  records every call, and forwards it only to a pid above 1 that is neither this process,
  its group, nor its parent (the test): pid 0, pid 1 and process groups are never signalled.

``--name`` adds lock names to ``ADVISORY_LOCK["NAMES"]``, so that the pages can name them.
It reads one JSON request per line on stdin and answers one JSON object per line on stdout:

* ``{"op": "get" | "post", "path": P, "data": {...}}``: the request, following redirects;
  answers ``response`` with the status, the redirect chain, the page's text, the messages
  shown (level and text) and the signals sent so far.
* ``{"op": "hold", "key": K, "using": A}``: take lock K on alias A in a thread of this
  process and keep it; answers ``held`` with this process's pid.
* ``{"op": "signals"}``: answers ``signals`` with every call the tripwire recorded.

EOF on stdin ends it (the user it logged in as is deleted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading

GUARDED = {
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
}
#: Every signal the code in this process tried to send.
sent: list[dict[str, object]] = []


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def install_tripwire() -> None:
    """Record every signal sent from this process; forward only those that are safe."""
    real_kill = os.kill
    real_pidfd_send_signal = getattr(signal, "pidfd_send_signal", None)
    me, parent, group = os.getpid(), os.getppid(), os.getpgrp()

    def safe(pid: int) -> bool:
        return pid > 1 and pid not in (me, parent, group)

    def kill(pid: int, signum: int) -> None:
        forwarded = safe(pid)
        sent.append({"call": "kill", "pid": pid, "signal": int(signum), "forwarded": forwarded})
        if forwarded:
            real_kill(pid, signum)

    def killpg(pgid: int, signum: int) -> None:
        sent.append({"call": "killpg", "pid": pgid, "signal": int(signum), "forwarded": False})

    def pidfd_send_signal(pidfd: int, signum: int, *args: object) -> None:
        with open(f"/proc/self/fdinfo/{pidfd}") as info:
            match = re.search(r"^Pid:\s*(-?\d+)", info.read(), re.MULTILINE)
        pid = int(match.group(1)) if match else 0
        forwarded = safe(pid) and real_pidfd_send_signal is not None
        sent.append(
            {
                "call": "pidfd_send_signal",
                "pid": pid,
                "signal": int(signum),
                "forwarded": forwarded,
            }
        )
        if forwarded:
            real_pidfd_send_signal(pidfd, signum, *args)

    os.kill = kill
    os.killpg = killpg
    if real_pidfd_send_signal is not None:
        signal.pidfd_send_signal = pidfd_send_signal


def hold(key: str, using: str, stop: threading.Event) -> None:
    """Take ``key`` in a thread of this process and keep it until ``stop``."""
    from django.db import connections

    from advisory_lock import advisory_lock

    held = threading.Event()

    def target() -> None:
        try:
            with advisory_lock(key, using=using):
                held.set()
                stop.wait()
        finally:
            connections.close_all()

    threading.Thread(target=target, daemon=True).start()
    if not held.wait(20):
        raise RuntimeError(f"could not take {key!r} on {using!r}")


def main() -> None:
    # First, before Django or any thread starts: every thread inherits the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, GUARDED)
    install_tripwire()
    parser = argparse.ArgumentParser(prog="python -m tests.admin_child")
    parser.add_argument("--name", action="append", default=[], help="a lock name to show")
    args = parser.parse_args()

    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.contrib.messages import get_messages
    from django.test import Client
    from django.test import override_settings
    from django.test.utils import setup_test_environment

    setup_test_environment()  # the test client's host, "testserver", is allowed
    override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, "NAMES": args.name}).enable()
    user = User.objects.create_superuser(f"admin-child-{os.getpid()}", password="unused")
    client = Client()
    client.force_login(user)
    stop = threading.Event()
    say("ready", pid=os.getpid(), pgid=os.getpgrp())
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] in ("get", "post"):
                send = client.get if request["op"] == "get" else client.post
                response = send(request["path"], request.get("data", {}), follow=True)
                say(
                    "response",
                    status=response.status_code,
                    redirects=[url for url, _ in response.redirect_chain],
                    content=response.content.decode(errors="replace"),
                    messages=[
                        [message.level_tag, str(message)]
                        for message in get_messages(response.wsgi_request)
                    ],
                    signals=sent,
                )
            elif request["op"] == "hold":
                hold(request["key"], request["using"], stop)
                say("held", pid=os.getpid())
            elif request["op"] == "signals":
                say("signals", signals=sent)
    finally:
        stop.set()
        user.delete()


if __name__ == "__main__":
    main()
