"""The package map of docs/architecture.md is the rule the code keeps.

The table lists every package and top-level module of ``fastcoll`` with the
packages it may import. This test reads the table and the code's imports
(module-level and inside functions, relative and absolute) and checks that:

* every package and module of ``fastcoll/`` has exactly one row;
* every import from one package into another is listed in the importer's row;
* every listed package stands above the row that lists it, so the imports
  form no cycle;
* no class is longer than 400 lines (issue 30's limit for the reducer's
  split, kept for every class).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastcoll"
MAX_CLASS_LINES = 400


def _unit(name: str) -> str:
    """A row's or an import's name as a unit: ``reducer/`` -> ``reducer``, ``dist.py`` -> ``dist``, ``fastcoll`` ->
    ``__init__``."""
    name = name.strip("`").rstrip("/")
    name = name[: -len(".py")] if name.endswith(".py") else name
    return "__init__" if name == "fastcoll" else name


def package_map(text: str) -> List[Tuple[str, Set[str]]]:
    """The rows of the table under "## The package map": (unit, the units it may import), in table order."""
    section = text.split("## The package map", 1)[1].split("\n## ", 1)[0]
    rows: List[Tuple[str, Set[str]]] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may = cells[2]
        if may.startswith("everything above"):
            allowed = {unit for unit, _ in rows}
        else:
            allowed = {_unit(n) for n in re.findall(r"`([^`]+)`", may)}
        rows.append((_unit(cells[0]), allowed))
    return rows


def imports_of(path: Path, root: Path = PACKAGE) -> Set[str]:
    """The units of the package at ``root`` that ``path`` imports (anywhere in it), its own excluded."""
    package = list(path.relative_to(root).parts[:-1])
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            found |= {target[0]} if target else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastcoll":
            found.add((node.module.split(".") + ["fastcoll"])[1])
        elif isinstance(node, ast.Import):
            found |= {(a.name.split(".") + ["fastcoll"])[1] for a in node.names if a.name.split(".")[0] == "fastcoll"}
    return {_unit(u) for u in found} - {_unit(path.relative_to(root).parts[0])}


def code_units() -> Dict[str, Set[str]]:
    """Every unit of ``fastcoll/`` (a package or a top-level module) and what its files import."""
    units: Dict[str, Set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        units.setdefault(_unit(path.relative_to(PACKAGE).parts[0]), set()).update(imports_of(path))
    return units


@pytest.fixture(scope="module")
def table() -> List[Tuple[str, Set[str]]]:
    return package_map((ROOT / "docs" / "architecture.md").read_text())


def test_every_unit_has_one_row(table):
    names = [unit for unit, _ in table]
    assert len(names) == len(set(names)), names
    assert set(names) == set(code_units()), (sorted(set(code_units()) - set(names)), sorted(set(names) - set(code_units())))


def test_imports_are_listed_and_point_up_the_table(table):
    above: Set[str] = set()
    wrong = []
    imports = code_units()
    for unit, allowed in table:
        if allowed - above:
            wrong.append(f"{unit} lists {sorted(allowed - above)}, not above it")
        if imports[unit] - allowed:
            wrong.append(f"{unit} imports {sorted(imports[unit] - allowed)}, not in its row")
        above.add(unit)
    assert not wrong, wrong


def test_the_checker_sees_an_import_the_row_does_not_list(table, tmp_path):
    """A control: the same reading finds a lazy relative import and an absolute one that the reducer's row forbids."""
    reducer = tmp_path / "fastcoll" / "reducer"
    reducer.mkdir(parents=True)
    src = "def f():\n    from ..optim import ShardedOptimizer\n    import fastcoll.integrations.lightning\n"
    (reducer / "core.py").write_text(src)
    found = imports_of(reducer / "core.py", root=tmp_path / "fastcoll")
    assert found == {"optim", "integrations"} and not found & dict(table)["reducer"], found


def test_no_class_is_longer_than_the_limit():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(ROOT)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
