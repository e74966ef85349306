"""The app uses other packages through their public APIs only (docs/STYLE: "a Django maintainer
should find nothing that the next Django, asgiref or driver release could break").

Every module of ``advisory_lock/`` is parsed with ``ast`` (nothing is imported) and each
offence is listed as ``module:line: what``. Forbidden: a name starting with one underscore
from Django, asgiref, psycopg, psycopg_pool, MySQLdb or asyncio (imported, or read as an
attribute of a name imported from them, or by name through getattr/vars), Django's
``settings.__dict__``, ``django.db.models.sql`` and ``OnConflict``, psycopg's
``error_from_result`` and a connection's ``lock``, ``ctypes``, and ``__del__``. Allowed, as
documented public APIs: psycopg's ``Connection.pgconn`` (its libpq wrapper, ``psycopg.pq``)
and ``weakref.finalize`` on an object that reference counting frees at a documented moment
(Django discarding a rollback's ``on_commit`` callbacks; tests/test_transaction_end.py proves
the release with the garbage collector disabled). Which object an attribute
is read on can't be known without running the code, so attribute names that are private in
those packages are refused on any object, unless the app defines that name itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import advisory_lock

PACKAGES = {"django", "asgiref", "psycopg", "psycopg_pool", "MySQLdb", "asyncio"}
#: Attribute names that are private in those packages, refused on any object.
PRIVATE_ATTRIBUTES = {
    "_connections": "Django's ConnectionHandler storage",
    "_storage": "asgiref Local's storage",
    "_get_running_loop": "asyncio's private loop lookup",
    "_mysql": "mysqlclient's C module",
    "_wrapped": "Django's LazyObject internals",
    "_called_from_command_line": "Django's BaseCommand internals (run_from_argv is public)",
    "error_from_result": "psycopg's private error factory",
}
#: Dotted names (and everything under them) that are internal to their package.
FORBIDDEN = {
    "ctypes": "ctypes reaches into the interpreter",
    "django.db.models.sql": "Django's internal SQL layer (InsertQuery and co.)",
    "django.db.models.constants.OnConflict": "Django's internal OnConflict",
}
#: Functions that read an attribute given by name.
BY_NAME = {"getattr", "hasattr", "setattr", "delattr", "__getattribute__", "attrgetter"}
#: Variables that hold a driver connection, whose ``lock`` is the driver's own.
RAW_CONNECTIONS = {"raw", "conn"}


def forbidden(dotted: str) -> str | None:
    """Why ``dotted`` is forbidden (it is, or is under, a FORBIDDEN name), else None."""
    for name, why in FORBIDDEN.items():
        if dotted == name or dotted.startswith(name + "."):
            return why
    return None


def is_private(name: str) -> bool:
    """One leading underscore (a dunder such as ``__name__`` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def app_sources() -> dict[str, str]:
    """{dotted module name: source} for every module of the app."""
    root = Path(advisory_lock.__file__).resolve().parent
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return sources


def own_names(trees: list[ast.Module]) -> set[str]:
    """Names the app defines: functions, classes, assigned names and attributes, slots."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            names.add(part.id)
                        elif isinstance(part, ast.Attribute):
                            names.add(part.attr)
                slots = any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets)
                if slots and node.value is not None:
                    names.update(
                        part.value
                        for part in ast.walk(node.value)
                        if isinstance(part, ast.Constant) and isinstance(part.value, str)
                    )
    return names


class Checker(ast.NodeVisitor):
    """Collects the offences of one module."""

    def __init__(self, own: set[str]) -> None:
        self.own = own
        self.imported: dict[str, str] = {}  # local name -> the dotted name it was bound to
        self.offences: dict[tuple[int, str], None] = {}  # ordered, without repeats

    def offence(self, node: ast.AST, what: str) -> None:
        self.offences[node.lineno, what] = None

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted name an expression stands for, if it starts from an imported name."""
        if isinstance(node, ast.Name):
            return self.imported.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def check_import(self, node: ast.AST, dotted: str) -> None:
        if why := forbidden(dotted):
            self.offence(node, f"imports {dotted}: {why}")
        parts = dotted.split(".")
        if parts[0] in PACKAGES and any(is_private(part) for part in parts[1:]):
            self.offence(node, f"imports {dotted}: private to {parts[0]}")

    def check_read(self, node: ast.Attribute, dotted: str) -> bool:
        """``dotted`` is read; True if that is an offence. A forbidden name is reported
        where the chain first reaches it, not again for each attribute read on it."""
        base_reported = isinstance(node.value, ast.Attribute) and forbidden(
            dotted.rsplit(".", 1)[0]
        )
        if (why := forbidden(dotted)) and not base_reported:
            self.offence(node, f"reads {dotted}: {why}")
        root = dotted.split(".")[0]
        if root in PACKAGES and self.private_not_ours(node.attr):
            self.offence(node, f"reads {dotted}: private to {root}")
            return True
        return False

    def ours(self, name: str) -> bool:
        """A private name the app defines itself (a public one such as ``pgconn`` is not)."""
        return is_private(name) and name in self.own

    def private_not_ours(self, name: str) -> bool:
        """A private name that the app does not define itself."""
        return is_private(name) and name not in self.own

    # Imports.

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.imported[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.imported[top] = top
            self.check_import(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return  # the app's own modules
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            self.imported[alias.asname or alias.name] = dotted
            self.check_import(node, dotted)

    # Reads.

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        dotted = self.resolve(node)
        reported = dotted is not None and self.check_read(node, dotted)
        if name in PRIVATE_ATTRIBUTES and not reported and not self.ours(name):
            self.offence(node, f"reads {dotted or '.' + name}: {PRIVATE_ATTRIBUTES[name]}")
        if name == "__dict__" and self.is_settings(node.value):
            self.offence(node, "reads settings.__dict__: Django's LazySettings internals")
        if name == "lock" and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "connection")
            or (isinstance(node.value, ast.Name) and node.value.id in RAW_CONNECTIONS)
        ):
            self.offence(node, "reads a driver connection's .lock: psycopg's internal lock")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        called = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
        strings = [
            arg.value
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        ]
        others = [arg for arg in node.args if not isinstance(arg, ast.Constant)]
        for text in strings:
            if text in PRIVATE_ATTRIBUTES and not self.ours(text):
                self.offence(node, f"reads {text!r} by name: {PRIVATE_ATTRIBUTES[text]}")
            elif text == "__dict__" and any(self.is_settings(arg) for arg in others):
                self.offence(node, "reads settings.__dict__ by name: LazySettings internals")
            elif (
                called in BY_NAME
                and self.private_not_ours(text)
                and any((self.resolve(arg) or "").split(".")[0] in PACKAGES for arg in others)
            ):
                self.offence(node, f"reads {text!r} by name on {ast.unparse(others[0])}")
        if called == "vars" and any(self.is_settings(arg) for arg in node.args):
            self.offence(node, "reads vars(settings): Django's LazySettings internals")
        self.generic_visit(node)

    def is_settings(self, node: ast.AST) -> bool:
        return self.resolve(node) == "django.conf.settings"

    # Releases left to the garbage collector.

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name == "__del__":
            self.offence(node, "defines __del__: a release that waits for the garbage collector")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


def offences_in(sources: dict[str, str]) -> list[str]:
    """``module:line: what`` for each offence in ``{module: source}``."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    own = own_names(list(trees.values()))
    found = []
    for module, tree in trees.items():
        checker = Checker(own)
        checker.visit(tree)
        found.extend(f"{module}:{line}: {what}" for line, what in checker.offences)
    return found


def test_the_app_uses_only_public_apis_of_django_asgiref_the_drivers_and_asyncio():
    offences = offences_in(app_sources())
    assert not offences, "private APIs of other packages:\n" + "\n".join(offences)


#: One offence per line, as the check must report them (the line's comment says how).
OFFENDING = """\
import ctypes  # imports ctypes
from asyncio import _get_running_loop  # imports asyncio._get_running_loop
from MySQLdb import _mysql  # imports MySQLdb._mysql
from django.db.models.sql import InsertQuery  # imports django.db.models.sql.InsertQuery
from django.db.models.constants import OnConflict  # django.db.models.constants.OnConflict
from django.conf import settings
from django.db import connections
from psycopg import errors
import weakref
local = connections._connections  # reads django.db.connections._connections
storage = vars(local).get("_storage")  # reads '_storage' by name
wrapped = settings._wrapped  # reads django.conf.settings._wrapped
seen = settings.__dict__  # reads settings.__dict__
seen = object.__getattribute__(settings, "__dict__")  # reads settings.__dict__ by name
seen = vars(settings)  # reads vars(settings)
error = errors.error_from_result  # reads psycopg.errors.error_from_result
lock = self.connection.connection.lock  # reads a driver connection's .lock
lock = conn.lock  # reads a driver connection's .lock
class Release:
    def __del__(self):  # defines __del__
        pass
"""
#: What the app may do: its own private names, on its own objects or on others'.
CLEAN = """\
from django.db import connections
from django.db import transaction
import weakref
class Backend:
    __slots__ = ("_holds",)
    def __init__(self, connection):
        self._holds = {}
        connection._advisory_lock_backend = self
def _helper():
    transaction.on_commit(print, using="default", robust=True)
    return connections["default"]._advisory_lock_backend, weakref.ref(_helper)
def _documented(raw):
    return raw.pgconn.exec_(b"SELECT 1"), weakref.finalize(_helper, print)
"""


def test_the_check_reports_each_kind_of_offence_and_nothing_else():
    found = offences_in({"sample": OFFENDING, "ours": CLEAN})
    lines = OFFENDING.splitlines()
    expected = {
        number: line.split("# ", 1)[1]
        for number, line in enumerate(lines, start=1)
        if "# " in line
    }
    reported = {}
    for offence in found:
        module, line, what = offence.split(":", 2)
        assert module == "sample", f"clean code reported: {offence}"
        reported.setdefault(int(line), []).append(what.strip())
    assert sorted(reported) == sorted(expected), found
    for number, fragment in expected.items():
        assert any(fragment in what for what in reported[number]), (lines[number - 1], found)
