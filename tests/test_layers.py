"""Nothing imports upward and no module imports itself round a cycle (docs/architecture.md, "The packages,
bottom to top"): the import graph of edgefl's packages, read from the source with ``ast``.

An edge is an import that runs: at a module's top (in a class body, an ``if`` or a ``try`` too) or inside a
function. Imports under ``if TYPE_CHECKING:`` never run and are left out. ``from X import Y`` depends on ``X``
(its ``__init__`` runs and is read) and also on ``X.Y`` when that is a module; ``import X.Y`` on ``X.Y``."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

from tests.conftest import REPO

PACKAGES = ("contract", "strategies", "ml", "netem", "edge", "fl_client", "fl_server", "edgefl", "bench")
BELOW = "everything below"

# docs/architecture.md's package table, bottom to top: a module belongs to the row of its longest prefix, and
# imports only from its own row, from rows below it, and across packages only what the "imports" column names.
LAYERS: tuple[tuple[str, tuple[str, ...] | str], ...] = (
    ("contract.errors", ()),
    ("strategies", ("contract.errors",)),
    ("ml", ("strategies", "contract.errors")),
    ("contract", ("strategies", "ml.catalog")),
    ("netem", ("contract",)),
    ("edge", ("contract", "ml", "strategies")),
    ("fl_client", ("contract", "edge", "ml")),
    ("fl_server", ("contract", "ml", "strategies", "netem")),
    ("edgefl", BELOW),
    ("bench", BELOW),
)
ROWS = [name for name, _ in LAYERS]


class Import(NamedTuple):
    source: str
    target: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (in a function)" if self.in_function else ""
        return f"{self.source}:{self.line} imports {self.target}{where}"


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of edgefl's packages under ``root``, by dotted name (a package by its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` loads: itself, or its longest prefix that is one (a name inside a module)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The project modules ``name`` imports, TYPE_CHECKING blocks left out."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[Import] = []

    def add(target: str | None, node: ast.stmt, in_function: bool) -> None:
        if target is not None and target != name:
            found.append(Import(name, target, node.lineno, in_function))

    def visit(nodes: list, in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, in_function)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(_resolve(alias.name, modules), node, in_function)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                origin = ".".join([*base, *([node.module] if node.module else [])])
                add(_resolve(origin, modules), node, in_function)
                for alias in node.names:
                    if f"{origin}.{alias.name}" in modules:
                        add(f"{origin}.{alias.name}", node, in_function)
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # nested blocks, except handlers, cases
                visit(getattr(node, field, []), inner)

    visit(ast.parse(path.read_text(), str(path)).body, False)
    return found


def import_graph(root: Path) -> list[Import]:
    modules = find_modules(root)
    return [edge for name, path in modules.items() for edge in module_imports(name, path, modules)]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def row_of(module: str) -> int:
    """The row of ``LAYERS`` that ``module`` belongs to: its longest prefix among the rows' names."""
    matches = [i for i, row in enumerate(ROWS) if module == row or module.startswith(row + ".")]
    assert matches, f"{module} is in no row of LAYERS"
    return max(matches, key=lambda i: len(ROWS[i]))


def allowed(row: int) -> tuple[str, ...]:
    imports = LAYERS[row][1]
    return tuple(ROWS[:row]) if imports == BELOW else imports


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def upward(edges: list[Import]) -> list[str]:
    """Every import of a module in a row above the importer's."""
    return [f"{edge} ({ROWS[row_of(edge.target)]} is above {ROWS[row_of(edge.source)]})"
            for edge in edges if row_of(edge.target) > row_of(edge.source)]  # fmt: skip


def unlisted(edges: list[Import]) -> list[str]:
    """Every import across packages that the importer's row's "imports" column does not name."""
    return [
        f"{edge} (not in {ROWS[row_of(edge.source)]}'s imports: {', '.join(allowed(row_of(edge.source)))})"
        for edge in edges
        if edge.source.split(".")[0] != edge.target.split(".")[0]
        and not any(_under(edge.target, prefix) for prefix in allowed(row_of(edge.source)))
    ]


def test_no_import_cycles() -> None:
    found = cycles(import_graph(REPO))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(component) for component in found)


def test_nothing_imports_upward() -> None:
    found = upward(import_graph(REPO))
    assert not found, "upward imports:\n" + "\n".join(found)


def test_each_package_imports_only_what_its_row_names() -> None:
    found = unlisted(import_graph(REPO))
    assert not found, "imports docs/architecture.md does not list:\n" + "\n".join(found)


def test_the_table_is_each_rows_own_and_lower_rows() -> None:
    for row, (name, imports) in enumerate(LAYERS):
        if imports != BELOW:
            assert all(row_of(prefix) < row for prefix in imports), name


def test_the_table_is_docs_architecture() -> None:
    """LAYERS is docs/architecture.md's package table: its rows, and each row's "imports" column."""
    documented = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            name = cells[0].strip("`").removesuffix("/").removesuffix(".py").replace("/", ".")
            column = cells[-1]
            documented[name] = BELOW if column == BELOW else tuple(sorted(re.findall(r"`([\w.]+)`", column)))
    assert documented == {name: imports if imports == BELOW else tuple(sorted(imports)) for name, imports in LAYERS}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "edge/__init__.py": "",
            "edge/devices.py": "from contract.devices import DeviceProfile\n",
            "contract/__init__.py": "",
            "contract/devices.py": "",
            "netem/__init__.py": "",
            "netem/clock.py": "import math\n\nimport edge.devices\n",
            "netem/fleet.py": "def f():\n    from edge.devices import device_profile\n",
        },
    )
    found = upward(import_graph(root))
    assert len(found) == 2, found
    assert found[0].startswith("netem.clock:3 imports edge.devices")
    assert found[1].startswith("netem.fleet:2 imports edge.devices (in a function)")


def test_the_check_sees_a_cycle_through_a_package_and_not_one_under_type_checking(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "strategies/__init__.py": "",
            "strategies/codecs/__init__.py": "from strategies.codecs.registry import CODECS\n",
            "strategies/codecs/registry.py": "from strategies.codecs import dense\nCODECS = {}\n",
            "strategies/codecs/dense.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import registry\n",
            "ml/__init__.py": "",
            "ml/data.py": "def split():\n    from ml.partition import split\n",
            "ml/partition.py": "from ml.data import Dataset\n",
        },
    )
    assert cycles(import_graph(root)) == [
        ["ml.data", "ml.partition"],
        ["strategies.codecs", "strategies.codecs.registry"],
    ]
