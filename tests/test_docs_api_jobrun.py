"""docs/api.md's ``JobRun`` section names every field of the model and every ``JobRun.Status``,
as the code has them: the cases are generated from the model, so a field or a status added
later fails here until the reference says what it is (``ENQUEUED`` and ``task_id`` were left
out once). A name the tables give that the model no longer has fails too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from advisory_lock import JobRun

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
if not API.is_file():
    pytest.skip("no docs/ here (the sdist leaves it out)", allow_module_level=True)

# Django's Model _meta API (documented): the model's own columns, the primary key included.
FIELDS = [field.name for field in JobRun._meta.concrete_fields]
STATUSES = list(JobRun.Status)


def jobrun_section() -> str:
    text = API.read_text(encoding="utf-8")
    match = re.search(r"^## `JobRun`\n(.*?)^## ", text, re.M | re.S)
    assert match, "docs/api.md has no `JobRun` section"
    return match.group(1)


def table(header: str) -> list[list[str]]:
    """The rows (their cells) of the section's table whose header line is ``header``."""
    lines = jobrun_section().splitlines()
    assert header in lines, f"docs/api.md's JobRun section has no table {header!r}"
    start = lines.index(header)
    rows = []
    for line in lines[start + 2 :]:  # after the header and its --- line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows, f"the table {header!r} of docs/api.md's JobRun section is empty"
    return rows


def documented_fields() -> set[str]:
    """Each name in backquotes in the first cell of the fields table (``a``, ``b`` rows)."""
    rows = table("| field | |")
    return {name for row in rows for name in re.findall(r"`(\w+)`", row[0])}


def documented_statuses() -> dict[str, str]:
    """The status table: member name -> the value its second cell gives."""
    return {row[0].strip("`"): row[1] for row in table("| `JobRun.Status` | value | |")}


def test_cases_were_generated() -> None:
    assert "task_id" in FIELDS and JobRun.Status.ENQUEUED in STATUSES


@pytest.mark.parametrize("field", FIELDS)
def test_the_fields_table_names_the_field(field: str) -> None:
    assert field in documented_fields(), f"docs/api.md's JobRun fields table has no `{field}`"


def test_the_fields_table_names_no_field_the_model_lacks() -> None:
    assert documented_fields() <= set(FIELDS), documented_fields() - set(FIELDS)


@pytest.mark.parametrize("status", STATUSES, ids=lambda status: status.name)
def test_the_status_table_names_the_status_and_its_value(status: JobRun.Status) -> None:
    statuses = documented_statuses()
    assert status.name in statuses, f"docs/api.md's JobRun.Status table has no {status.name}"
    assert statuses[status.name] == f'`"{status.value}"`', statuses[status.name]


def test_the_status_table_names_no_status_the_model_lacks() -> None:
    assert set(documented_statuses()) <= {status.name for status in STATUSES}
