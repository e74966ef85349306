"""The docs' code blocks are checked: every ```python block of the README, docs/ and
bench/README.md compiles as written; every ```sh block is valid shell whose `make` targets,
`manage.py` commands and `pip install` extras exist. docs/testing.md's `TestCase` example runs,
as written, and passes. The API reference (docs/api.md) documents every public name from the
code (autodoc), so that no name is left out of the docs site."""

from __future__ import annotations

import re
import subprocess
import sys
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.test import TestCase

import advisory_lock

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "docs" / "api.md").is_file():
    pytest.skip("no docs/ here (the sdist leaves it out)", allow_module_level=True)
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")


@dataclass
class Block:
    path: Path
    line: int  # of the block's first line of code, 1-based
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file (fences at the start of a line)."""
    found = []
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, language, start, code = match.group(1), match.group(2), number + 1, []
        elif match and match.group(1).startswith(fence) and not match.group(2):
            found.append(Block(path, start, language, "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    assert fence is None, f"{path.relative_to(ROOT)}: a code block is not closed"
    return found


ALL_BLOCKS = [block for path in PAGES for block in blocks(path)]
PYTHON = [block for block in ALL_BLOCKS if block.language == "python"]
SHELL = [block for block in ALL_BLOCKS if block.language == "sh"]


def test_the_pages_have_blocks() -> None:
    assert len(PYTHON) > 20 and SHELL, "the pages or the fences were not found"


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block_compiles(block: Block) -> None:
    try:
        compile(block.code, str(block), "exec", dont_inherit=True)
        error = None
    except SyntaxError as raised:
        error = raised
    if error is not None:
        offset = (error.lineno or 1) - 1
        text = block.code.splitlines()[offset] if offset < block.code.count("\n") else ""
        line = f"{block.path.relative_to(ROOT)}:{block.line + offset}"
        pytest.fail(f"{line}: {error.msg}\n    {text.strip()}", pytrace=False)


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_shell_block(block: Block) -> None:
    checked = subprocess.run(
        ["bash", "-n"], input=block.code, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, f"{block}: {checked.stderr}"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    commands = ROOT / "advisory_lock" / "management" / "commands"
    extras = re.search(
        r"^\[project\.optional-dependencies\]\n(.*?)^\[",
        (ROOT / "pyproject.toml").read_text(encoding="utf-8"),
        re.M | re.S,
    )
    assert extras
    for line in block.code.splitlines():
        words = line.split("#")[0].split()
        if words[:1] == ["make"]:
            for target in words[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{block}: {line}"
        elif words[:1] == ["manage.py"]:
            assert (commands / f"{words[1]}.py").is_file(), f"{block}: {line}"
        elif words[:2] == ["pip", "install"]:
            for extra in re.findall(r"django-advisory-lock\[([^]]+)\]", line):
                for name in extra.split(","):
                    assert re.search(rf"^{name} = ", extras.group(1), re.M), f"{block}: {line}"


TESTING = ROOT / "docs" / "testing.md"
#: A block that shows a file of the reader's project starts with a comment naming it.
FILE_BLOCK = re.compile(r"# ([\w/]+)\.py\n")


@pytest.mark.usefixtures("django_db_setup")
def test_testing_md_testcase_example_runs(tmp_path: Path, django_db_blocker: Any) -> None:
    """docs/testing.md's ``TestCase`` example, with only its own imports, runs and passes:
    on the default database, with the demo's ``nightly_report`` command (the README's
    once-a-day command) and the page's ``myapp/search.py``, written out as a module."""
    python = [block for block in PYTHON if block.path == TESTING]
    [example] = [block for block in python if "(TestCase):" in block.code]
    packages = set()
    for block in python:
        match = FILE_BLOCK.match(block.code)
        if match:
            module = tmp_path / f"{match.group(1)}.py"
            module.parent.mkdir(parents=True, exist_ok=True)
            module.write_text(block.code, encoding="utf-8")
            for folder in module.relative_to(tmp_path).parents[:-1]:
                (tmp_path / folder / "__init__.py").touch()
                packages.add(folder.parts[0])
    assert packages, "docs/testing.md shows no module of the reader's project"
    sys.path.insert(0, str(tmp_path))
    try:
        namespace: dict[str, Any] = {"__name__": "testing_md_example"}
        exec(compile(example.code, str(example), "exec"), namespace)
        cases = [
            value
            for value in namespace.values()
            if isinstance(value, type) and issubclass(value, TestCase) and value is not TestCase
        ]
        suite = unittest.TestSuite(map(unittest.defaultTestLoader.loadTestsFromTestCase, cases))
        result = unittest.TestResult()
        with django_db_blocker.unblock():
            suite.run(result)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.split(".")[0] in packages]:
            del sys.modules[name]
    problems = "\n".join(trace for _, trace in result.errors + result.failures)
    assert not problems, f"{example}: {problems}"
    assert result.testsRun == example.code.count("    def test_") > 0, result.testsRun


def test_api_reference_documents_every_public_name() -> None:
    """docs/api.md has an autodoc directive for each name of ``advisory_lock.__all__``
    (imported from ``advisory_lock`` or from the module that defines it) and for
    ``advisory_lock.testing``."""
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", api, re.M))
    missing = [
        name
        for name in advisory_lock.__all__
        if f"advisory_lock.{name}" not in documented
        and not any(path.endswith(f".{name}") for path in documented)
    ]
    assert not missing, f"docs/api.md has no autodoc directive for {missing}"
    assert "advisory_lock.testing" in documented
