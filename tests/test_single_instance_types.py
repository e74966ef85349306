"""``@single_instance``'s types, as a type checker sees them: mypy (strict, the project's
configuration) checks a module that uses it as the docs do. A decorated command stays its
class; a decorated function keeps its parameters and returns its result or None (skipped),
a coroutine of it when async; ``on_busy``, ``on_lost`` and ``ledger`` take their values only
(a typo is an error, not a ``str``). Each line marked ``# error`` must be reported, and no
other. (``on_busy`` on a command class is a TypeError when decorating, not a type error: a
class is a callable too, and no annotation excludes it from ``Callable``.)

Before, ``single_instance`` took and returned ``Any`` and ``on_busy`` any ``str``: every
marked line passed, and ``assert_type`` failed on the ``Any`` results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from advisory_lock.periods import PERIODS
from advisory_lock.single_instance import LedgerPeriod

ROOT = Path(__file__).resolve().parent.parent

USES = """
from collections.abc import Coroutine
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand
from typing_extensions import assert_type

from advisory_lock import single_instance


@single_instance
class Bare(BaseCommand):
    pass


@single_instance(ledger="daily", wait=30, on_lost="warn")
class Daily(BaseCommand):
    pass


assert_type(Bare, type[Bare])
assert_type(Daily, type[Daily])


@single_instance
def report(day: str, *, dry_run: bool = False) -> int:
    return len(day)


@single_instance(key=lambda tenant_id: f"import:{tenant_id}", on_busy="raise")
def import_tenant(tenant_id: int) -> str:
    return str(tenant_id)


@single_instance(ledger=lambda now: now.strftime("%Y-%m-%d"), on_lost=print)
def nightly() -> None:
    pass


@single_instance(on_busy="skip", key="refresh")
async def refresh(seconds: float) -> float:
    return seconds


assert_type(report("2026-11-29", dry_run=True), int | None)
assert_type(import_tenant(3), str | None)
assert_type(nightly(), None)
refreshing = assert_type(refresh(1.5), Coroutine[Any, Any, float | None])
refreshing.close()

report(3)  # error
import_tenant(3, 4)  # error
single_instance(on_busy="skp")  # error
single_instance(ledger="dayly")  # error
single_instance(on_lost="ignore")  # error
single_instance(ledger=datetime.now)  # error
"""


@pytest.mark.skipif(
    not (ROOT / "pyproject.toml").is_file(), reason="needs the project's mypy configuration"
)
def test_mypy_sees_single_instance_types(tmp_path: Path) -> None:
    module = tmp_path / "uses_single_instance.py"
    module.write_text(USES, encoding="utf-8")
    expected = {
        number for number, line in enumerate(USES.splitlines(), 1) if line.endswith("# error")
    }
    checked = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")),
            # The virtualenv's cache, as make test's mypy uses it: a warm one takes seconds.
            *("--cache-dir", str(Path(sys.prefix) / "mypy_cache"), "--no-error-summary"),
            str(module),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: a cold cache takes about a minute
        check=False,
    )
    # By the file's name: mypy's cache may give the errors of an identical module checked
    # before under another temporary folder.
    errors = re.findall(rf"^\S*{re.escape(module.name)}:(\d+): error: (.*)$", checked.stdout, re.M)
    reported = {int(line) for line, _ in errors}
    assert reported == expected, (
        f"mypy reported errors on lines {sorted(reported)}, expected {sorted(expected)}:\n"
        f"{checked.stdout}{checked.stderr}"
    )


def test_the_ledger_literal_names_every_period() -> None:
    """The type of ``ledger`` spells the period names out: the same as the ledger's."""
    names, _callable = get_args(LedgerPeriod)
    assert get_args(names) == PERIODS
