"""No import cycle among the modules of ``advisory_lock/``, and every import points down the
layers (``LAYERS``): a cycle means two modules are one concept cut in the wrong place, and an
import that runs back up a lower module reaching up for a type or a callback.

Every module of the package (migrations excepted) is parsed with ``ast`` (nothing is
imported), and every import of one of its modules is an edge: at module level, inside a
function, or under ``if TYPE_CHECKING:`` alike, since moving an import there hides a cycle
without breaking it. Relative imports are resolved. ``from package import name`` imports the
submodule ``package.name`` when there is one, else the package itself (its ``__init__``). A
package importing its own submodules (``__init__`` re-exporting them) is no cycle by itself:
those edges are dropped. The strongly connected components of the graph with more than one
module are the cycles, each listed with the imports that make it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import advisory_lock

#: {module: {module it imports: the lines of those imports}}
Graph = dict[str, dict[str, list[int]]]

#: The package's layers, bottom to top (docs/development.md, "The package's layout"): a
#: module imports only modules of its own layer or of those below. Each layer lists its
#: modules, a package standing for all of its submodules; every module is in exactly one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "locks",
        (
            "keys",
            "conf",
            "exceptions",
            "tables",
            "validation",
            "signals",
            "metrics",
            "datetimes",
            "backends",
            "holds",
            "server_waits",
            "watchdog",
            "dedicated",
            "heartbeat",
            "own_connection",
            "fencing",
            "directory",
            "lock_names",
            "async_locks",
            "locks",
        ),
    ),
    ("declarations", ("periods", "queues", "schedule", "expectations")),
    (
        "ledger",
        ("server_clock", "row_writes", "row_reads", "ledger", "migrate_pages", "admin_writes"),
    ),
    ("guarded runs", ("single_instance", "once", "tasks")),
    ("scheduling", ("scheduling",)),
    (
        "Django's face",
        (
            "",  # the package itself: __init__ re-exports the public names
            "models",
            "admin",
            "checks",
            "management",
            "inspection",
            "middleware",
            "testing",
            "pytest_plugin",
            "apps",
        ),
    ),
]


def package_modules(root: Path) -> dict[str, Path]:
    """{dotted name: path} for every module of the package in ``root``, migrations excepted.
    A package is named by its directory (``advisory_lock.single_instance``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if "migrations" in parts:
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def deepest_module(dotted: str, modules: dict[str, Path]) -> str | None:
    """The module that importing ``dotted`` runs last: ``dotted`` itself, or for a name
    defined in a module (``advisory_lock.locks.advisory_lock``), that module. None if
    ``dotted`` is not in the package."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, list[int]]:
    """{module of the package that ``module`` imports: the lines that import it}."""
    is_package = path.name == "__init__.py"
    # What a relative import of level 1 is relative to: the package the module is in.
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [deepest_module(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in modules else deepest_module(base, modules)
                targets.append(target)
        for target in targets:
            if target is None or target == module:
                continue
            if is_package and target.startswith(module + "."):
                continue  # a package importing its own submodules
            found.setdefault(target, []).append(node.lineno)
    return {target: sorted(set(lines)) for target, lines in found.items()}


def import_graph(root: Path) -> Graph:
    """The imports between the modules of the package in ``root``."""
    modules = package_modules(root)
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def strongly_connected_components(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm: the graph's strongly connected components, each sorted. (Recursive:
    its depth is at most the number of modules.)"""
    index: dict[str, int] = {}  # the order in which the search reached each module
    lowlink: dict[str, int] = {}  # the lowest index reachable from it, within its component
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.get(module, {})):
            if imported not in index:
                visit(imported)
                lowlink[module] = min(lowlink[module], lowlink[imported])
            elif imported in stack:
                lowlink[module] = min(lowlink[module], index[imported])
        if lowlink[module] == index[module]:  # the root of a component: pop it whole
            start = stack.index(module)
            components.append(sorted(stack[start:]))
            del stack[start:]

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def import_cycles(root: Path) -> list[str]:
    """One report per cycle in the package in ``root``: its modules, then each import
    between them as ``module:line -> imported``."""
    graph = import_graph(root)
    reports = []
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        edges = [
            f"    {module}:{line} -> {imported}"
            for module in component
            for imported, lines in sorted(graph[module].items())
            if imported in members
            for line in lines
        ]
        reports.append("cycle: " + " <-> ".join(component) + "\n" + "\n".join(edges))
    return sorted(reports)


def layer_of(module: str, package: str, layers: list[tuple[str, tuple[str, ...]]]) -> int:
    """The index in ``layers`` of the layer ``module`` (a dotted name in ``package``) is in;
    ValueError if it is in none."""
    relative = module.removeprefix(package).removeprefix(".")
    for index, (_, members) in enumerate(layers):
        for member in members:
            if relative == member or (member and relative.startswith(member + ".")):
                return index
    raise ValueError(f"{module} is in no layer: add it to LAYERS (tests/test_import_graph.py)")


def imports_running_up(
    graph: Graph, package: str, layers: list[tuple[str, tuple[str, ...]]]
) -> list[str]:
    """Each import of ``graph`` from a module to one of a higher layer, as
    ``module:line (layer) -> imported (layer)``."""
    found = []
    for module, imported_lines in sorted(graph.items()):
        below = layer_of(module, package, layers)
        for imported, lines in sorted(imported_lines.items()):
            above = layer_of(imported, package, layers)
            if above > below:
                found += [
                    f"{module}:{line} ({layers[below][0]}) -> {imported} ({layers[above][0]})"
                    for line in lines
                ]
    return found


def test_every_module_of_the_app_is_in_one_layer():
    root = Path(advisory_lock.__file__).resolve().parent
    for module in import_graph(root):
        relative = module.removeprefix("advisory_lock").removeprefix(".")
        homes = [
            name
            for name, members in LAYERS
            for member in members
            if relative == member or (member and relative.startswith(member + "."))
        ]
        assert len(homes) == 1, f"{module} is in the layers {homes}, not in exactly one"


def test_every_import_of_the_app_points_down_the_layers():
    root = Path(advisory_lock.__file__).resolve().parent
    upward = imports_running_up(import_graph(root), "advisory_lock", LAYERS)
    assert not upward, f"{len(upward)} import(s) run back up the layers:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_import_running_up(tmp_path: Path):
    package = tmp_path / "pkg"
    (package / "top").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text("def f():\n    from pkg.top import views\n")
    (package / "top" / "__init__.py").write_text("")
    (package / "top" / "views.py").write_text("from pkg import base\n")
    layers = [("ground", ("base",)), ("top", ("", "top"))]

    assert imports_running_up(import_graph(package), "pkg", layers) == [
        "pkg.base:2 (ground) -> pkg.top.views (top)"
    ]


def test_no_module_of_the_app_is_in_an_import_cycle():
    root = Path(advisory_lock.__file__).resolve().parent
    cycles = import_cycles(root)
    assert not cycles, f"{len(cycles)} import cycle(s) in advisory_lock/:\n" + "\n".join(cycles)


def test_the_check_finds_a_cycle_however_the_imports_are_written(tmp_path: Path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\nfrom pkg import sub\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.b import B\n"
        "class A: ...\n"
    )
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "sub" / "__init__.py").write_text("from .c import C\n")
    (package / "sub" / "c.py").write_text("from .. import a\nfrom pkg import A\nclass C: ...\n")
    (package / "migrations").mkdir()
    (package / "migrations" / "m.py").write_text("from pkg import b\n")

    assert import_graph(package) == {
        "pkg": {},  # a package importing its own submodules: no edge
        "pkg.a": {"pkg.b": [3]},  # under TYPE_CHECKING
        "pkg.b": {"pkg.a": [2]},  # in a function, relative
        "pkg.sub": {},
        "pkg.sub.c": {"pkg.a": [1], "pkg": [2]},  # a submodule; a name of the package
    }
    assert import_cycles(package) == [
        "cycle: pkg.a <-> pkg.b\n    pkg.a:3 -> pkg.b\n    pkg.b:2 -> pkg.a"
    ]
