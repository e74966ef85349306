"""A project without ``advisory_lock`` in INSTALLED_APPS: locks and ``@single_instance``
without a ledger work as with the app; each ledger feature says to add the app and migrate.

Real processes, with the test settings less the app (``tests/appless_settings.py``), on the
test database of each backend: management commands through ``manage.py``, the Python API
through ``tests/appless_child.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.appless_child import LEDGER_FEATURES
from tests.appless_child import STEPS
from tests.commands import HANG
from tests.commands import ROOT
from tests.commands import command_env
from tests.commands import finish
from tests.commands import wait_for_line

SETTINGS = "tests.appless_settings"
BUSY = 3  # busy_exit_code of the test commands
#: What every ledger feature says without the app.
ADD_THE_APP = 'add "advisory_lock" to INSTALLED_APPS'
#: Modules whose import defines a model, which needs the app: never imported on the lock path.
MODEL_MODULES = {
    "advisory_lock.ledger",
    "advisory_lock.models",
    "advisory_lock.scheduling.control",
    "advisory_lock.scheduling.liveness",
    "advisory_lock.tasks",
}

#: What each step of the lock path sees (besides the lock free after it), as with the app.
SEEN = {
    "lock": {"held": True, "free_inside": False, "tried": True},
    "function": {"value": 42, "free_inside": False},
    "request": {"status": 200},  # and the lock the view left held was released at its end
}


def env(using: str) -> dict[str, str]:
    return {**command_env(using), "DJANGO_SETTINGS_MODULE": SETTINGS}


def manage(using: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *argv],
        cwd=ROOT,
        env=env(using),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child(using: str, step: str) -> dict:
    """Run one step of ``tests/appless_child.py``: what it saw."""
    process = subprocess.run(
        [sys.executable, "-m", "tests.appless_child", step],
        cwd=ROOT,
        env=env(using),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert process.returncode == 0, process.stderr
    return json.loads(process.stdout.splitlines()[-1])


def test_the_settings_lack_the_app():
    from tests import appless_settings

    assert "advisory_lock" not in appless_settings.INSTALLED_APPS
    assert "tests.lockapp" in appless_settings.INSTALLED_APPS


def test_a_single_instance_command_without_a_ledger_runs_and_excludes_a_second(using, tmp_path):
    done = tmp_path / "done"
    holder = manage(using, "decorated_job", "--until", str(done))
    try:
        wait_for_line(holder, "running")
        status, out, err = finish(manage(using, "decorated_job"))
    finally:
        done.touch()
    assert status == BUSY, (out, err)
    assert "lockapp.decorated_job: skipped, another instance holds lock" in err
    status, out, err = finish(holder)
    assert status == 0 and "finished" in out, (out, err)
    assert "Traceback" not in err, err


def test_a_ledger_command_without_the_app_says_to_add_it_and_runs_nothing(using):
    status, out, err = finish(manage(using, "ledger_job"))
    assert status == 1, (out, err)
    assert f"CommandError: The ledger needs the app: {ADD_THE_APP}" in err, err
    assert "manage.py migrate" in err, err
    assert "Traceback" not in err and "running" not in out, (out, err)


@pytest.mark.parametrize("step", list(STEPS))
def test_the_lock_path_works_without_the_app(using, step):
    seen = child(using, step)
    assert seen.pop("free_after") is True, seen
    assert not MODEL_MODULES & set(seen.pop("modules")), "a model's module was imported"
    assert seen == SEEN[step]


@pytest.mark.parametrize("using", ["default"], indirect=True)  # no database is reached
@pytest.mark.parametrize("feature", list(LEDGER_FEATURES))
def test_each_ledger_feature_without_the_app_raises_improperly_configured(using, feature):
    seen = child(using, feature)
    assert seen["improperly_configured"], seen
    assert seen["message"].startswith(f"The ledger needs the app: {ADD_THE_APP}"), seen
    assert "manage.py migrate" in seen["message"], seen
    assert seen["free_after"], seen  # a ledger function took nothing
