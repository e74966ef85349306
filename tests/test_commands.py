"""@single_instance and SingleInstanceMixin, with real processes on every backend."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from advisory_lock import single_instance
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.keys import make_key
from tests.commands import HANG
from tests.commands import finish
from tests.commands import start
from tests.commands import wait_for_line
from tests.probes import in_other_connection
from tests.probes import is_free

BUSY = 3  # busy_exit_code of the test commands
KEY = "command:lockapp.decorated_job"


def holder_of(key, using):
    """Who holds ``key`` on ``using``, as the database tells."""
    connection = connections[using]
    return inspector_for(connection).holder(backend_for(connection).db_key(make_key(key)))


def test_eight_instances_started_together_run_exactly_once(using, tmp_path):
    ran, done = tmp_path / "ran", tmp_path / "done"
    processes = [
        start(using, "mixin_job", "--ran", str(ran), "--until", str(done)) for _ in range(8)
    ]
    try:
        # The instance that runs keeps the lock (--until) until the other seven have exited,
        # so none of them can find it free. A guard against a hang, not a timing: 7 Django
        # start-ups on a loaded machine take minutes.
        deadline = time.monotonic() + HANG
        while sum(p.poll() is not None for p in processes) < 7:
            assert time.monotonic() < deadline, "the other seven instances did not exit"
            time.sleep(0.05)
    finally:
        done.touch()  # the runner lets go
    results = [finish(process) for process in processes]
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [0] + [BUSY] * 7, results
    assert len(ran.read_text().splitlines()) == 1
    busy_lines = [err for status, _, err in results if status == BUSY]
    for err in busy_lines:
        assert "lockapp.mixin_job: skipped, another instance holds lock" in err
        assert "'command:lockapp.mixin_job'" in err
    # The holder is named: its process (PostgreSQL, SQLite) or connection id (MySQL/MariaDB).
    assert all(" by process " in err or " by MySQL connection id " in err for err in busy_lines)


def test_the_busy_line_names_the_holders_os_process_and_host_apart_from_the_servers_ids(
    using, tmp_path
):
    done = tmp_path / "done"
    holder = start(using, "decorated_job", "--until", str(done))
    try:
        pid = int(wait_for_line(holder, "running").split()[1])
        status, _, err = finish(start(using, "decorated_job"))
        session = holder_of(KEY, using)  # the server's view of the holder's lock connection
    finally:
        done.touch()
    assert finish(holder)[0] == 0
    assert status == BUSY, err
    assert pid == holder.pid  # the holder's own OS process, not a parent or a wrapper
    host = socket.gethostname()
    expected = {
        # SQLite: the flock's holder is a process of this host.
        "default": f" by process {pid} on this host ({host}), since ",
        # PostgreSQL: the process and host the lock's connection wrote in its
        # application_name, then the server's own pid for the session.
        "postgresql": f" by process {pid} on host {host} (PostgreSQL backend pid {session.id}, ",
        # MySQL/MariaDB, performance_schema off: no process id to be had, and the line says
        # that the number is the server's.
        "mysql": (
            f" by MySQL connection id {session.id} (the server's, not a process id), "
            f"from {session.host}."
        ),
    }[using]
    assert expected in err, err


def test_default_busy_exit_status_is_zero(using, tmp_path):
    holder = start(using, "default_job", "--until", str(tmp_path / "never"))
    try:
        wait_for_line(holder, "running")
        status, out, err = finish(start(using, "default_job"))
        assert status == 0
        assert "running" not in out
        assert "skipped" in err
    finally:
        holder.kill()
        finish(holder)


def someone_waits_for(key, using):
    """True once the database shows a session waiting for ``key`` (PostgreSQL, MySQL)."""
    connection = connections[using]
    db_key = backend_for(connection).db_key(make_key(key))
    listing = in_other_connection(lambda: inspector_for(connections[using]).list_locks({}))
    return any(row.db_key == db_key and not row.granted for row in listing.rows)


def test_lock_wait_runs_after_the_holder_finishes_and_a_short_wait_skips(using, tmp_path):
    # The holder works until the test says so: the short wait runs out while it holds, and
    # the patient one is seen waiting (in the database's own view) before it lets go.
    done = tmp_path / "done"
    holder = start(using, "decorated_job", "--until", str(done))
    try:
        wait_for_line(holder, "running")
        assert finish(start(using, "decorated_job", "--lock-wait", "0.2"))[0] == BUSY
        patient = start(using, "decorated_job", "--lock-wait", "600")
        if using != "default":  # SQLite's bounded wait polls: no waiter to see
            deadline = time.monotonic() + HANG  # a guard against a patient that never waits
            while not someone_waits_for(KEY, using):
                if time.monotonic() > deadline:
                    pytest.fail("the patient instance never showed up waiting")
                time.sleep(0.01)
        assert patient.poll() is None
    finally:
        done.touch()
    assert finish(holder)[0] == 0
    status, out, _ = finish(patient)
    assert status == 0 and "finished" in out


def test_lock_wait_rejects_bad_values(using):
    for bad in ("-1", "soon", "inf", "nan"):
        status, _, err = finish(start(using, "decorated_job", "--lock-wait", bad))
        assert status == 2, err  # argparse's usage error
        assert "--lock-wait" in err


def test_django_admin_behaves_like_manage_py(using, tmp_path):
    django_admin = [str(Path(sys.executable).parent / "django-admin")]
    holder = start(using, "decorated_job", "--until", str(tmp_path / "never"))
    try:
        wait_for_line(holder, "running")
        second = start(using, "decorated_job", "--pythonpath", ".", program=django_admin)
        status, _, err = finish(second)
        assert status == BUSY and "skipped" in err
    finally:
        holder.kill()
        finish(holder)


@pytest.fixture
def lock_on(using, monkeypatch):
    """Make the test commands lock on ``using`` when run in this process by call_command."""
    from tests.lockapp.management.commands import decorated_job
    from tests.lockapp.management.commands import mixin_job

    for module in (decorated_job, mixin_job):
        monkeypatch.setattr(module.Command, "lock_using", using)
    return using


def test_call_command_raises_command_error_with_the_busy_status(lock_on, tmp_path):
    holder = start(lock_on, "decorated_job", "--until", str(tmp_path / "never"))
    try:
        wait_for_line(holder, "running")
        with pytest.raises(CommandError, match="skipped") as excinfo:
            call_command("decorated_job")
        assert excinfo.value.returncode == BUSY
    finally:
        holder.kill()
        finish(holder)


def test_call_command_runs_when_free_and_releases(lock_on, capsys):
    call_command("mixin_job", lock_wait=1)
    assert "finished" in capsys.readouterr().out
    assert is_free("command:lockapp.mixin_job", lock_on)


def test_decorator_and_mixin_add_the_same_option_and_settings():
    from tests.lockapp.management.commands import decorated_job
    from tests.lockapp.management.commands import mixin_job

    decorated, mixin = decorated_job.Command(), mixin_job.Command()
    for command in (decorated, mixin):
        parser = command.create_parser("manage.py", "job")
        assert "--lock-wait" in parser.format_help()
        assert command.lock_busy_exit_code == BUSY
        assert command.lock_heartbeat == 0.5
    assert decorated_job.Command.__name__ == "Command"
    assert decorated_job.Command.__module__ == decorated_job.__name__


def test_two_tenants_run_in_parallel_and_one_tenant_does_not(using, tmp_path):
    ran, done = tmp_path / "ran", tmp_path / "done"
    args = ("--until", str(done), "--ran", str(ran))
    acme = start(using, "tenant_job", "--tenant", "acme", *args)
    wait_for_line(acme, "running")
    # Both tenants run at once: globex works while acme still holds its lock (until "done").
    globex = start(using, "tenant_job", "--tenant", "globex", *args)
    wait_for_line(globex, "running")
    acme_again = start(using, "tenant_job", "--tenant", "acme", *args)
    assert finish(acme_again)[0] == BUSY
    done.touch()
    assert finish(globex)[0] == 0
    assert finish(acme)[0] == 0
    assert sorted(line.split()[1] for line in ran.read_text().splitlines()) == ["acme", "globex"]


def test_sigkill_of_the_holder_frees_the_lock_within_a_second(using, tmp_path):
    holder = start(using, "decorated_job", "--until", str(tmp_path / "never"))
    wait_for_line(holder, "running")
    holder.kill()
    killed_at = time.monotonic()
    holder.wait()
    while not is_free(KEY, using):
        # Generous for a loaded machine: the server frees it as the connection drops.
        assert time.monotonic() - killed_at < 10, "the lock outlived its holder by 10 s"
        time.sleep(0.02)
    status, out, _ = finish(start(using, "decorated_job"))
    assert status == 0 and "finished" in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_sigterm_and_sigint_release_the_lock_and_exit_interrupted(using, signum, tmp_path):
    holder = start(using, "decorated_job", "--until", str(tmp_path / "never"))
    wait_for_line(holder, "running")
    holder.send_signal(signum)
    status, _, err = finish(holder)
    assert status == {signal.SIGTERM: 143, signal.SIGINT: -signal.SIGINT}[signum], err
    assert "interrupted by signal" in err
    assert is_free(KEY, using)


def test_closing_django_connections_mid_run_keeps_the_lock(using, tmp_path):
    done = tmp_path / "done"
    holder = start(using, "decorated_job", "--until", str(done), "--close-connections")
    try:
        # The job says "running" once it has closed its Django connections.
        wait_for_line(holder, "running")
        status, _, err = finish(start(using, "decorated_job"))
        assert status == BUSY and "skipped" in err
    finally:
        done.touch()
    assert finish(holder)[0] == 0


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_killed_holder_connection_raises_lock_lost_within_heartbeat(using, tmp_path):
    holder = start(using, "decorated_job", "--until", str(tmp_path / "never"))
    wait_for_line(holder, "running")
    target = holder_of(KEY, using).id

    from tests.servers import kill_connection_of

    kill_connection_of(using, target)
    killed_at = time.monotonic()
    status, _, err = finish(holder)
    noticed_after = time.monotonic() - killed_at
    assert status == 1, err
    assert "was lost" in err
    assert noticed_after < 15  # heartbeat (0.5 s) + 1 s when idle; generous for a loaded machine


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_on_lost_callable_is_called_in_place_of_raising(using):
    calls = []
    from django.core.management.base import BaseCommand

    @single_instance(heartbeat=0.2, on_lost=calls.append, using=using)
    class Command(BaseCommand):
        def handle(self, *args, **options):
            from tests.servers import kill_connection_of

            holder = holder_of("command:tests.test_commands", using)
            in_other_connection(kill_connection_of, using, holder.id)
            # The run goes on until the watchdog has noticed the killed connection and called
            # on_lost (at its next check): ended before, the loss would be found by the
            # release instead. A guard against a hang, not a timing.
            deadline = time.monotonic() + HANG
            while not calls:
                assert time.monotonic() < deadline, "on_lost was not called"
                time.sleep(0.05)

    Command.__module__ = "tests.test_commands"
    Command().execute(stdout=None, stderr=None, skip_checks=True, no_color=True, force_color=False)
    assert len(calls) == 1 and "was lost" in calls[0]


def test_a_busy_instance_costs_one_connection_and_at_most_two_statements(using):
    from advisory_lock.dedicated import DedicatedLock
    from tests.test_locks import held_elsewhere

    with held_elsewhere("command:lockapp.costly", using):
        lock = DedicatedLock("command:lockapp.costly", using=using, label="lockapp.costly")
        lock.connection.force_debug_cursor = True
        assert not lock.acquire(0)
        message = lock.busy_message()
    # Ours: the try, then who holds it (SQLite: neither is SQL; the holder is in the lock
    # file). Django's own set-up of a new MySQL connection (server version, isolation level)
    # is not counted.
    statements = [q["sql"] for q in lock.connection.queries_log if "LOCK" in q["sql"].upper()]
    assert len(statements) == {"default": 0, "postgresql": 2, "mysql": 2}[using], statements
    assert len(lock.connection.queries_log) - len(statements) <= 2
    # held_elsewhere() holds it on a plain connection: on PostgreSQL no process to be had.
    holder = {
        "default": "process",
        "postgresql": "PostgreSQL backend pid",
        "mysql": "MySQL connection id",
    }
    assert f" by {holder[using]} " in message


def test_the_watchdog_check_is_one_statement(using):
    from advisory_lock.dedicated import DedicatedLock

    lock = DedicatedLock("command:lockapp.watched", using=using, label="lockapp.watched")
    try:
        assert lock.acquire(0)
        lock.connection.force_debug_cursor = True
        assert lock.backend.is_held(lock.db_key) is True
        assert (
            len(lock.connection.queries_log) == {"default": 0, "postgresql": 1, "mysql": 1}[using]
        )
    finally:
        lock.release()
    assert is_free("command:lockapp.watched", using)
