"""What gets published: the wheel holds the app and none of the repository's tooling, the sdist
is complete enough to run the test suite, and the metadata is what the package index shows.

`make test` builds both from this checkout into a temporary folder (``python -m build
--no-isolation``: offline, with the build backend of the ``dist`` dependency group). `make dist`
runs this file as a script on what it built, the files the release workflow publishes:

    python tests/test_packaging.py dist/*
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

import pytest

import advisory_lock

ROOT = Path(__file__).resolve().parent.parent
VERSION = advisory_lock.__version__
WHEEL = f"django_advisory_lock-{VERSION}-py3-none-any.whl"
SDIST = f"django_advisory_lock-{VERSION}.tar.gz"
DIST_INFO = f"django_advisory_lock-{VERSION}.dist-info"

#: What users install; the development-only groups (test, bench, dist) must not be among them.
USER_EXTRAS = {
    "postgres",
    "mysql",
    "opentelemetry",
    "schedule",
    "celery",
    "tasks",
    "tasks-backport",
}
CLASSIFIERS = {
    "Development Status :: 4 - Beta",
    "Framework :: Django",
    "Framework :: Django :: 5.2",
    "Framework :: Django :: 6.0",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
    "Typing :: Typed",
}
PROJECT_URLS = {"Documentation", "Changelog", "Source", "Issues"}
#: Files the tests need besides tests/ and testproject/ (the set-up `make test` runs).
SDIST_NEEDS = {
    "PKG-INFO",
    "pyproject.toml",
    "LICENSE",
    "README.md",
    "CHANGELOG.md",
    "Makefile",
    "manage.py",
    "scripts/setup.sh",
    "tests/conftest.py",
    "tests/settings.py",
    "testproject/settings.py",
}
#: Repository folders that are in neither artefact.
NOT_SHIPPED = ("docs/", "bench/", ".github/", ".ci/", ".venv")

pytestmark = pytest.mark.packaging


def is_junk(name: str) -> bool:
    return "__pycache__" in name.split("/") or name.endswith((".pyc", ".pyo", ".sqlite3"))


def source_files(folder: str) -> set[str]:
    """The files under ``folder`` of this checkout, relative to it, without caches."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and not is_junk(path.relative_to(ROOT).as_posix())
    }


def tracked_files(*folders: str) -> set[str]:
    """Files git tracks under ``folders`` that exist on disk (empty outside a git checkout)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return set()
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return {name for name in listed if name and (ROOT / name).is_file()}


def parse_metadata(text: str) -> Message:
    return HeaderParser().parsestr(text)


def versions(classifiers: set[str], prefix: str) -> list[tuple[int, int]]:
    """The X.Y versions of the classifiers that start with ``prefix``, oldest first."""
    found = [c[len(prefix) :] for c in classifiers if c.startswith(prefix)]
    return sorted(tuple(map(int, v.split("."))) for v in found if re.fullmatch(r"\d+\.\d+", v))


def check_metadata(metadata: Message) -> None:
    assert metadata["Name"] == "django-advisory-lock"
    assert metadata["Version"] == VERSION
    assert tuple(map(int, metadata["Metadata-Version"].split("."))) >= (2, 4)
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Requires-Python"] == ">=3.10"
    classifiers = set(metadata.get_all("Classifier", []))
    assert classifiers >= CLASSIFIERS, CLASSIFIERS - classifiers
    # PEP 639: the license expression replaces the classifier (setuptools refuses both).
    assert not [c for c in classifiers if c.startswith("License ::")]
    # requires-python, the dependency on Django and the classifiers say the same (and
    # scripts/matrix.py tests each classified pair).
    pythons = versions(classifiers, "Programming Language :: Python :: ")
    djangos = versions(classifiers, "Framework :: Django :: ")
    assert metadata["Requires-Python"] == ">={}.{}".format(*pythons[0])
    assert "Django>={}.{}".format(*djangos[0]) in metadata.get_all("Requires-Dist", [])

    urls = dict(line.split(", ", 1) for line in metadata.get_all("Project-URL", []))
    assert set(urls) >= PROJECT_URLS, PROJECT_URLS - set(urls)
    assert all(url.startswith("https://") for url in urls.values()), urls

    assert set(metadata.get_all("Provides-Extra", [])) == USER_EXTRAS
    requires = metadata.get_all("Requires-Dist", [])
    # Unconditional requirements: Django only. Development tools are dependency groups.
    assert [r for r in requires if "extra ==" not in r] == ["Django>=5.2"]
    assert not [r for r in requires if re.match(r"(pytest|ruff|mypy|hypothesis|build|twine)", r)]
    # The tasks extra is for Django 6.0's django.tasks: the django-tasks backport (for Django
    # 5.2) comes with tasks-backport only, never installed beside Django 6 by the tasks extra.
    extras = {
        name: [r.split(";")[0] for r in requires if r.endswith(f'extra == "{name}"')]
        for name in ("tasks", "tasks-backport")
    }
    backport = re.compile(r"django-tasks($|[<>=!~ ])")
    assert extras["tasks"] and not [r for r in extras["tasks"] if backport.match(r)], extras
    assert [r for r in extras["tasks-backport"] if backport.match(r)], extras

    # The long description is the README, as the package index shows it: every link absolute.
    assert metadata["Description-Content-Type"] == "text/markdown"
    description = metadata.get_payload()
    assert description.startswith("# django-advisory-lock")
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    links += re.findall(r"^\[[^\]]+\]:\s*(\S+)", description, flags=re.MULTILINE)
    assert links
    relative = [link for link in links if not link.startswith(("https://", "http://", "#"))]
    assert not relative, f"relative links break on the package index: {relative}"


def check_wheel(path: Path) -> None:
    assert path.name == WHEEL
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        metadata = parse_metadata(wheel.read(f"{DIST_INFO}/METADATA").decode())
        entry_points = wheel.read(f"{DIST_INFO}/entry_points.txt").decode()

    package = {name for name in names if name.startswith("advisory_lock/")}
    assert names - package == {
        f"{DIST_INFO}/{name}"
        for name in (
            "METADATA",
            "WHEEL",
            "RECORD",
            "entry_points.txt",
            "top_level.txt",
            "licenses/LICENSE",
        )
    }
    # The whole app, and only it: code, migrations, templates, py.typed.
    assert package == source_files("advisory_lock"), package ^ source_files("advisory_lock")
    assert {
        "advisory_lock/py.typed",
        "advisory_lock/migrations/__init__.py",
        "advisory_lock/migrations/0001_initial.py",
        "advisory_lock/templates/admin/advisory_lock/locks.html",
        "advisory_lock/templates/admin/advisory_lock/jobrun/change_list.html",
    } <= package
    assert any(name.startswith("advisory_lock/migrations/0") for name in package)
    assert [name for name in package if name.endswith(".html")]
    assert not [name for name in names if is_junk(name)]
    assert not [name for name in names if name.startswith(("tests/", "testproject/", "bench/"))]

    assert "advisory_lock = advisory_lock.pytest_plugin" in entry_points
    check_metadata(metadata)


def check_sdist(path: Path) -> None:
    assert path.name == SDIST
    top = f"django_advisory_lock-{VERSION}/"
    with tarfile.open(path) as sdist:
        members = [member for member in sdist.getmembers() if member.isfile()]
        assert all(member.name.startswith(top) for member in members)
        names = {member.name[len(top) :] for member in members}
        pkg_info = sdist.extractfile(top + "PKG-INFO")
        assert pkg_info is not None
        metadata = parse_metadata(pkg_info.read().decode())

    # Complete enough to run the tests: the package, the tests, the demo project they import,
    # and the set-up `make test` runs.
    assert names >= SDIST_NEEDS, SDIST_NEEDS - names
    shipped = tracked_files("advisory_lock", "tests", "testproject")
    assert shipped <= names, shipped - names
    assert source_files("advisory_lock") <= names
    assert not [name for name in names if name.startswith(NOT_SHIPPED)]
    assert not [name for name in names if is_junk(name)]
    check_metadata(metadata)


def check(paths: list[Path]) -> None:
    wheels = [path for path in paths if path.suffix == ".whl"]
    sdists = [path for path in paths if path.name.endswith(".tar.gz")]
    assert len(wheels) == 1 and len(sdists) == 1 and len(paths) == 2, paths
    check_wheel(wheels[0])
    check_sdist(sdists[0])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from it, as `make dist` builds them (but offline)."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_wheel(built: Path) -> None:
    check_wheel(built / WHEEL)


def test_sdist(built: Path) -> None:
    check_sdist(built / SDIST)


def test_only_the_two(built: Path) -> None:
    check(sorted(built.iterdir()))


def test_twine_check(built: Path) -> None:
    """What PyPI checks on upload, README rendering included (`make dist` runs it too)."""
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, built.iterdir())],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


if __name__ == "__main__":
    check([Path(arg) for arg in sys.argv[1:]])
    print(f"packaging: {', '.join(sys.argv[1:])} checked")
