"""Every supported Python x Django pair: install the wheel, migrate, run the quickstart and a
fast subset of the tests (`make matrix`; CI runs it, the full suite runs on two of the pairs).

The pairs come from pyproject.toml's classifiers ("Programming Language :: Python :: 3.X",
"Framework :: Django :: X.Y"), less those Django itself does not support (MIN_PYTHON), so
the classifiers, ``requires-python`` and what is tested can't drift apart: a classifier
without an interpreter on this machine fails the run instead of being skipped.

For each pair, in a virtualenv of its own (``.venv-matrix/py3.X-django5.2``):

1. ``pip install`` the wheel built from this checkout, with the postgres, mysql and schedule
   extras, and the newest Django of that series;
2. in a new ``django-admin startproject`` outside the checkout, with ``advisory_lock`` in
   ``INSTALLED_APPS``: ``migrate`` and ``check`` on SQLite, PostgreSQL and MariaDB, then the
   README's once-per-day command three times: the first holds the lock until the second has
   skipped ("another instance holds"), the third finds the slot done, and ``job_runs`` lists
   the one run;
3. SMOKE_TESTS from this checkout's test suite on that interpreter and Django.

    python scripts/matrix.py [--only 3.10/5.2 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: The oldest Python each Django series supports (Django's own release notes).
MIN_PYTHON = {"5.2": (3, 10), "6.0": (3, 12)}
#: Fast test files that touch every backend, the ledger and the commands.
SMOKE_TESTS = ["tests/test_ledger.py", "tests/test_inspect.py", "tests/test_timeouts.py"]
SMOKE_REQUIREMENTS = ["pytest>=8", "pytest-django>=4.9", "hypothesis>=6"]
POSTGRES = {"HOST": "127.0.0.1", "PORT": "5432", "USER": "postgres"}
MYSQL = {"HOST": "127.0.0.1", "PORT": "3306", "USER": "root"}

COMMAND = '''\
import sys
from pathlib import Path

from django.core.management.base import BaseCommand

from advisory_lock import single_instance


@single_instance(ledger="daily")
class Command(BaseCommand):
    """The README's once-per-day job; it holds its lock until the file named by its
    argument exists, so that another instance can be started while it runs."""

    def add_arguments(self, parser):
        parser.add_argument("hold_until")

    def handle(self, *args, hold_until, **options):
        print("working", flush=True)
        # Read by the matrix script: the lock is held from here until the file appears.
        sys.stdin.readline()
        Path(hold_until).write_text("done")
        print("done")
'''


def pairs() -> list[tuple[str, str]]:
    """(python, django) pairs from the classifiers, checked against requires-python."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    classifiers = project["classifiers"]
    pythons = [
        c.rsplit(" ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    djangos = [
        c.rsplit(" ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Framework :: Django :: \d+\.\d+", c)
    ]
    oldest = min(pythons, key=version_tuple)
    if project["requires-python"] != f">={oldest}":
        sys.exit(
            f"requires-python {project['requires-python']!r} but the oldest classifier is {oldest}"
        )
    unknown = set(djangos) - set(MIN_PYTHON)
    if unknown:
        sys.exit(
            f"scripts/matrix.py: add the oldest Python of Django {sorted(unknown)} to MIN_PYTHON"
        )
    return [
        (python, django)
        for django in djangos
        for python in pythons
        if version_tuple(python) >= MIN_PYTHON[django]
    ]


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def interpreter(version: str) -> str:
    """This machine's python<version>: pyenv's build if there is one, else one on the PATH."""
    if shutil.which("pyenv"):
        root = run(["pyenv", "root"], capture=True).strip()
        for name in sorted(
            run(["pyenv", "versions", "--bare"], capture=True).split(), reverse=True
        ):
            candidate = Path(root, "versions", name, "bin", f"python{version}")
            if name.startswith(f"{version}.") and candidate.exists():
                return str(candidate)
    found = shutil.which(f"python{version}")
    if found is None:
        sys.exit(f"matrix: Python {version} not found (classifier in pyproject.toml); install it")
    return found


def run(argv: list[str], capture: bool = False, **kwargs) -> str:
    result = subprocess.run(argv, check=True, text=True, capture_output=capture, **kwargs)
    return result.stdout if capture else ""


def build_wheel(into: Path) -> Path:
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(into), str(ROOT)], capture=True)
    (wheel,) = into.glob("django_advisory_lock-*.whl")
    return wheel


def database_settings(vendor: str, name: str, folder: Path) -> str:
    if vendor == "sqlite":
        settings = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(folder / "db.sqlite3")}
    elif vendor == "postgresql":
        settings = {"ENGINE": "django.db.backends.postgresql", "NAME": name, **POSTGRES}
    else:
        settings = {"ENGINE": "django.db.backends.mysql", "NAME": name, **MYSQL}
    return f"DATABASES = {{'default': {settings!r}}}\n"


def server_database(vendor: str, name: str, create: bool) -> None:
    """Create (or drop) the database ``name`` on the local server of ``vendor``."""
    if vendor == "postgresql":
        argv = ["psql", "-qAt", "-h", POSTGRES["HOST"], "-U", POSTGRES["USER"], "-d", "postgres"]
        sql = f"DROP DATABASE IF EXISTS {name}" + (f"; CREATE DATABASE {name}" if create else "")
        for statement in sql.split("; "):
            run([*argv, "-c", statement], capture=True)
    elif vendor == "mysql":
        sql = f"DROP DATABASE IF EXISTS {name}" + (f"; CREATE DATABASE {name}" if create else "")
        run(["mariadb", "-h", MYSQL["HOST"], "-u", MYSQL["USER"], "-e", sql], capture=True)


def smoke_project(python: Path, folder: Path, tag: str) -> None:
    """startproject, migrate and the quickstart's command on each database."""
    admin = str(python.parent / "django-admin")
    run([admin, "startproject", "smoke", str(folder)], capture=True)
    commands = folder / "reports" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (folder / "reports", folder / "reports" / "management", commands):
        (package / "__init__.py").write_text("")
    (commands / "nightly_report.py").write_text(COMMAND)
    settings = folder / "smoke" / "settings.py"
    settings.write_text(
        settings.read_text() + '\nINSTALLED_APPS += ["advisory_lock", "reports"]\n'
    )
    for vendor in ("sqlite", "postgresql", "mysql"):
        name = f"matrix_{tag}"
        server_database(vendor, name, create=True)
        try:
            module = f"settings_{vendor}"
            (folder / "smoke" / f"{module}.py").write_text(
                "from smoke.settings import *  # noqa\n" + database_settings(vendor, name, folder)
            )
            env = {**os.environ, "DJANGO_SETTINGS_MODULE": f"smoke.{module}"}
            manage = [str(python), "manage.py"]
            run([*manage, "migrate", "-v", "0"], cwd=folder, env=env)
            run([*manage, "check"], cwd=folder, env=env, capture=True)
            once_per_day(manage, folder, env, vendor)
        finally:
            server_database(vendor, name, create=False)
        print(f"matrix {tag}: {vendor}: migrate, check, the once-per-day command: ok", flush=True)


def once_per_day(manage: list[str], folder: Path, env: dict[str, str], vendor: str) -> None:
    marker = folder / f"done-{vendor}"
    first = subprocess.Popen(
        [*manage, "nightly_report", str(marker)],
        cwd=folder,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdin is not None
        # The first instance holds the lock once it has printed "working".
        assert first.stdout.readline().strip() == "working"
        second = command(manage, folder, env, "nightly_report", str(marker))
        expect(second.returncode == 0 and "another instance holds" in second.stderr, second)
        first.stdin.write("go\n")
        first.stdin.close()
        rest = first.stdout.read()
        expect(first.wait() == 0 and "done" in rest and marker.exists(), first)
    finally:
        first.kill()
        first.wait()
    third = command(manage, folder, env, "nightly_report", str(marker))
    expect(third.returncode == 0 and "already done" in third.stderr, third)
    listing = command(manage, folder, env, "job_runs")
    expect(listing.returncode == 0 and listing.stdout.count("succeeded") == 1, listing)


def command(
    manage: list[str], folder: Path, env: dict[str, str], *argv: str
) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py *argv`` to its end, with no input."""
    return subprocess.run(
        [*manage, *argv],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def expect(condition: bool, process: object) -> None:
    if not condition:
        details = {
            k: getattr(process, k, None) for k in ("args", "returncode", "stdout", "stderr")
        }
        raise SystemExit(f"matrix: unexpected result: {details}")


def check_pair(python_version: str, django: str, wheel: Path, venvs: Path) -> None:
    tag = f"py{python_version.replace('.', '')}_django{django.replace('.', '')}"
    venv = venvs / f"py{python_version}-django{django}"
    python = venv / "bin" / "python"
    if not python.exists():
        run([interpreter(python_version), "-m", "venv", str(venv)])
    major, minor = django.split(".")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(
        [
            *pip,
            f"{wheel}[postgres,mysql,schedule]",
            f"Django>={django},<{major}.{int(minor) + 1}",
            *SMOKE_REQUIREMENTS,
        ]
    )
    # The same version number as the last run's wheel: pip would keep the old files.
    run([*pip, "--no-deps", "--force-reinstall", str(wheel)])
    versions = run(
        [
            str(python),
            "-c",
            "import sys, django; print(sys.version.split()[0], django.__version__)",
        ],
        capture=True,
    ).split()
    print(f"matrix {tag}: Python {versions[0]}, Django {versions[1]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="advisory-lock-matrix-") as folder:
        smoke_project(python, Path(folder), tag)
    # The checkout's tests and code on this interpreter and Django (the wheel was tested
    # above): PYTHONPATH puts the checkout first for pytest and for the processes it starts.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SMOKE_TESTS],
        cwd=ROOT,
        env=env,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="PYTHON/DJANGO", default=[])
    args = parser.parse_args()
    selected = [
        (python, django)
        for python, django in pairs()
        if not args.only or f"{python}/{django}" in args.only
    ]
    venvs = ROOT / ".venv-matrix"
    with tempfile.TemporaryDirectory(prefix="advisory-lock-wheel-") as folder:
        wheel = build_wheel(Path(folder))
        for python, django in selected:
            check_pair(python, django, wheel, venvs)
    print(f"matrix: {len(selected)} pairs ok: " + ", ".join(f"{p}/{d}" for p, d in selected))


if __name__ == "__main__":
    main()
