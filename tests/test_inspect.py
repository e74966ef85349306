"""Seeing what is held: held_locks(), manage.py advisory_locks, names, signals and checks."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import connections
from django.db import transaction
from django.test import override_settings

from advisory_lock import advisory_lock
from advisory_lock import directory
from advisory_lock import signals
from advisory_lock.inspection import held_locks
from advisory_lock.inspection import known_keys
from tests.commands import HANG
from tests.probes import in_other_connection
from tests.test_locks import held_elsewhere


def find(locks, name):
    return [lock for lock in locks if lock.name == name]


def test_held_locks_names_the_lock_and_its_holder(using):
    with held_elsewhere("report:inspect", using):
        locks = held_locks(using)
    (lock,) = find(locks, "report:inspect")
    assert lock.granted and lock.mode == "exclusive"
    assert lock.holder_id is not None
    assert locks.source in ("pg_locks", "/proc/locks", "IS_USED_LOCK over known names")


@pytest.mark.parametrize("using", ["default", "postgresql"], indirect=True)  # shared locks
def test_held_locks_shows_shared_holders_and_waiters(using):
    import threading

    with held_elsewhere("report:waiters", using, shared=True):
        waiting = threading.Thread(
            target=lambda: in_other_connection(_wait_for, "report:waiters", using)
        )
        waiting.start()
        try:
            # Until the server shows the waiter: a guard against a hang, not a timing.
            deadline = time.monotonic() + HANG
            while True:
                locks = find(held_locks(using), "report:waiters")
                if any(not lock.granted for lock in locks):
                    break
                assert time.monotonic() < deadline, f"no waiter seen: {locks}"
                time.sleep(0.02)
            assert {(lock.mode, lock.granted) for lock in locks} == {
                ("shared", True),
                ("exclusive", False),
            }
        finally:
            waiting.join(0)
    waiting.join(HANG)


def _wait_for(key, using):
    # A blocking wait: SQLite's bounded waits poll, and a poller is not seen as a waiter.
    with advisory_lock(key, using=using):
        pass


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_mysql_waiters_come_from_the_processlist(using):
    import threading

    with held_elsewhere("report:mysql-waiter", using):
        waiting = threading.Thread(
            target=lambda: in_other_connection(_wait_for, "report:mysql-waiter", using)
        )
        waiting.start()
        # Until the server shows the waiter: a guard against a hang, not a timing.
        deadline = time.monotonic() + HANG
        while True:
            locks = find(held_locks(using), "report:mysql-waiter")
            if any(not lock.granted for lock in locks):
                break
            assert time.monotonic() < deadline, f"no waiter seen: {locks}"
            time.sleep(0.02)
        assert sorted(lock.granted for lock in locks) == [False, True]
    waiting.join(HANG)


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_mariadb_metadata_lock_info_plugin_is_used_when_loaded(using):
    with connections[using].cursor() as cursor:
        cursor.execute("INSTALL SONAME 'metadata_lock_info'")
    try:
        with held_elsewhere("report:plugin", using):
            locks = held_locks(using)
        assert locks.source == "information_schema.METADATA_LOCK_INFO"
        (lock,) = find(locks, "report:plugin")
        assert lock.granted and lock.connection_id
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute("UNINSTALL SONAME 'metadata_lock_info'")


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_without_a_lock_source_mysql_says_it_can_only_see_known_names(using):
    locks = held_locks(using)
    assert locks.source == "IS_USED_LOCK over known names"
    assert "only locks with a known name" in locks.note


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_int_and_pair_keys_are_shown_as_given(using):
    with held_elsewhere(-5, using), held_elsewhere((7, -8), using):
        keys = {lock.db_key for lock in held_locks(using)}
    assert {-5, (7, -8)} <= keys


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_names_come_from_settings_commands_and_this_process(using):
    with advisory_lock("used-here", using="default"):
        pass
    with override_settings(ADVISORY_LOCK={"NAMES": ["billing:close-month"]}):
        keys = known_keys()
    assert keys["billing:close-month"] == "billing:close-month"
    assert "command:lockapp.decorated_job" in keys  # a @single_instance command
    assert "command:example.nightly_report" in keys
    assert "used-here" in keys


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_registered_name_shows_an_int_key_by_its_name(using):
    with override_settings(ADVISORY_LOCK={"NAMES": {"legacy-import": 4242}}):
        with held_elsewhere(4242, using):
            (lock,) = [lock for lock in held_locks(using) if lock.db_key == 4242]
    assert lock.name == "legacy-import"


def test_advisory_locks_command_prints_a_table_and_json(using, capsys):
    with held_elsewhere("report:command", using):
        call_command("advisory_locks", "--using", using)
        table = capsys.readouterr().out
        call_command("advisory_locks", "--using", using, "--json")
        document = json.loads(capsys.readouterr().out)
    assert "report:command" in table and "held" in table
    assert document["using"] == using
    assert any(lock["name"] == "report:command" for lock in document["locks"])


def test_held_locks_and_advisory_locks_show_a_single_instance_holders_process(using, capsys):
    from advisory_lock.dedicated import DedicatedLock

    # A label longer than PostgreSQL keeps of an application_name (63 bytes): its end goes.
    label = "lockapp." + "inspected" * 8
    lock = DedicatedLock("command:lockapp.inspected", using=using, label=label)
    try:
        assert lock.acquire(0)
        # The lock directory's writes (MySQL's only way to the process) are done.
        assert directory.recorder is not None and directory.recorder.flush(timeout=HANG)
        (held,) = find(held_locks(using), "command:lockapp.inspected")
        call_command("advisory_locks", "--using", using)
        table = capsys.readouterr().out
    finally:
        lock.release()
    (row,) = [line for line in table.splitlines() if "command:lockapp.inspected" in line]
    this_process = f"{os.getpid()} on {socket.gethostname()}"
    assert held.process == this_process
    if using == "mysql":  # the lock directory's: the server knows no process of the holder's
        assert f"connection id {held.holder_id}" in row and this_process in row
        return
    assert (held.process_id, held.process_host) == (os.getpid(), socket.gethostname())
    kind = {"default": "pid", "postgresql": "backend pid"}[using]
    assert f"{kind} {held.holder_id}" in row and this_process in row
    if using == "postgresql":
        assert held.pid == held.holder_id != os.getpid()  # the server's process, not ours
        assert len(held.application_name) == 63
        assert held.application_name.startswith(f"pid={os.getpid()} host=")


# Signals


def test_signals_report_acquired_busy_released_with_timings(using):
    import threading

    events = []
    me = threading.get_ident()

    def receiver(signal, **kwargs):
        if threading.get_ident() == me:  # not the other connection's (held_elsewhere's) own
            events.append((signal, kwargs["key"], kwargs["scope"], kwargs["hold_time"]))

    names = ("lock_acquired", "lock_released", "lock_busy", "lock_lost")
    for name in names:
        getattr(signals, name).connect(receiver)
    try:
        with advisory_lock("metrics", using=using):
            pass
        with held_elsewhere("metrics", using), advisory_lock("metrics", using=using, wait=False):
            pass
        with transaction.atomic(using=using), advisory_lock("metrics-tx", using=using):
            pass
    finally:
        for name in names:
            getattr(signals, name).disconnect(receiver)
    assert [(signal is signals.lock_acquired, key, scope) for signal, key, scope, _ in events] == [
        (True, "metrics", "session"),
        (False, "metrics", "session"),
        (False, "metrics", "session"),
        (True, "metrics-tx", "transaction"),
        (False, "metrics-tx", "transaction"),
    ]
    kinds = [signal for signal, *_ in events]
    assert kinds[1] is signals.lock_released and kinds[2] is signals.lock_busy
    assert kinds[4] is signals.lock_released
    assert events[1][3] >= 0 and events[2][3] is None  # hold time: released yes, busy no


# System checks


def check_ids(**settings_overrides):
    with override_settings(**settings_overrides):
        return {message.id for message in run_checks(include_deployment_checks=True)}


def test_a_clean_configuration_has_only_the_sqlite_note():
    assert {i for i in check_ids() if i.startswith("advisory_lock")} == {"advisory_lock.I001"}


def test_two_names_for_one_key_are_an_error():
    assert "advisory_lock.E001" in check_ids(ADVISORY_LOCK={"NAMES": {"import": 42, "sync": 42}})
    assert "advisory_lock.E001" not in check_ids(ADVISORY_LOCK={"NAMES": {"a": 42, "b": 43}})


def test_an_invalid_registered_key_is_an_error():
    assert "advisory_lock.E008" in check_ids(ADVISORY_LOCK={"NAMES": {"bad": 1.5}})


def test_an_unsupported_engine_is_an_error_naming_the_alias():
    from django.conf import settings

    from advisory_lock.checks import check_settings

    legacy = connections.configure_settings(
        {
            "default": dict(connections.settings["default"]),
            "legacy": {"ENGINE": "django.db.backends.dummy"},
        }
    )
    connections.settings["legacy"] = legacy["legacy"]
    try:
        with override_settings(
            DATABASES={**settings.DATABASES, "legacy": legacy["legacy"]},
            ADVISORY_LOCK={"POOL_MODE": {"legacy": "session"}},
        ):
            errors = [m for m in check_settings() if m.id == "advisory_lock.E002"]
    finally:
        del connections.settings["legacy"]
        with contextlib.suppress(AttributeError):
            del connections["legacy"]
    assert len(errors) == 1 and "'legacy'" in errors[0].msg and "dummy" in errors[0].msg


def test_bad_pool_mode_direct_alias_namespace_and_time_zone_are_errors():
    ids = check_ids(
        ADVISORY_LOCK={
            "POOL_MODE": {"default": "statement"},
            "DIRECT_ALIAS": {"default": "missing"},
            "NAMESPACE": "has space",
            "LEDGER_TIME_ZONE": "Mars/Olympus",
        }
    )
    assert {"advisory_lock.E004", "advisory_lock.E005", "advisory_lock.E006"} <= ids
    assert "advisory_lock.E007" in ids


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_pool_without_the_reset_is_a_warning_and_with_it_is_not(using):
    from advisory_lock.backends.postgresql import reset_pooled_connection
    from advisory_lock.checks import check_settings

    settings_dict = connections[using].settings_dict
    with override_settings(ADVISORY_LOCK={"POOL_MODE": {using: "session"}}):
        settings_dict["OPTIONS"]["pool"] = True
        try:
            assert "advisory_lock.W001" in {m.id for m in check_settings()}
            settings_dict["OPTIONS"]["pool"] = {"reset": reset_pooled_connection}
            assert "advisory_lock.W001" not in {m.id for m in check_settings()}
        finally:
            del settings_dict["OPTIONS"]["pool"]
