"""The Galera check (advisory_lock.E003) against a real one-node Galera cluster."""

from __future__ import annotations

import pytest
from django.core.checks import Tags
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.test import override_settings

from tests.galera import galera_node


@pytest.fixture
def galera_alias(django_db_blocker):
    """An alias "galera" on a fresh Galera node (its "mysql" database)."""
    with galera_node() as port, django_db_blocker.unblock():
        settings_dict = dict(connections.settings["mysql"], PORT=str(port), NAME="mysql")
        connections.settings["galera"] = settings_dict
        try:
            yield "galera"
        finally:
            connections["galera"].close()
            del connections["galera"]
            del connections.settings["galera"]


def test_a_galera_node_is_a_database_error(galera_alias):
    from django.conf import settings

    databases = {**settings.DATABASES, "galera": connections.settings["galera"]}
    lock_settings = {"POOL_MODE": {"galera": "session"}}  # makes it an alias locks use
    with override_settings(DATABASES=databases, ADVISORY_LOCK=lock_settings):
        messages = run_checks(tags=[Tags.database], databases=["galera"])
        assert [m.id for m in messages if m.id.startswith("advisory_lock")] == [
            "advisory_lock.E003"
        ]
        assert "wsrep_on" in messages[0].msg
        with pytest.raises(SystemCheckError, match=r"advisory_lock\.E003"):
            call_command("check", "--database", "galera")


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_a_plain_mariadb_passes_the_cluster_check(using):
    lock_settings = {"POOL_MODE": {using: "session"}}
    with override_settings(ADVISORY_LOCK=lock_settings):
        messages = run_checks(tags=[Tags.database], databases=[using])
    assert not [m for m in messages if m.id.startswith("advisory_lock")]
