"""The API reference (docs/api/*.md) covers every public name of fastcoll.

A public name is one listed in ``__all__`` of ``fastcoll`` or of a public
module under it: every package or module directly under ``fastcoll/`` whose
name does not start with ``_`` (a package without ``__all__`` contributes its
own modules instead, as ``fastcoll.integrations`` does), plus the modules in
``EXTRA_MODULES``. ``fastcoll.bench`` is the benchmark command line, not an
import API. ``__all__`` is read from the source with ``ast``, so neither the
frameworks of the integrations nor mkdocs are needed here.

A name counts as documented when a page has a mkdocstrings directive
``::: module.name``, or a ``::: module`` directive whose ``members:`` option
lists it. The checker is also run on pages with one entry removed, to show
that it notices.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterable, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastcoll"
API_DIR = ROOT / "docs" / "api"

# Not an import API: the benchmark command line (`python -m fastcoll.bench`), documented in docs/benchmarks.md.
# fastcoll.distributed is read as fastcoll.dist, its public import path (fastcoll/dist.py re-exports its __all__).
EXCLUDED = {"fastcoll.bench", "fastcoll.distributed", "fastcoll.dist"}
# Modules below the first level that the user guide sends readers to.
EXTRA_MODULES = {
    "fastcoll.optim.checkpoint": PACKAGE / "optim" / "checkpoint.py",
    "fastcoll.dist": PACKAGE / "distributed" / "__init__.py",
}

_DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$")
_MEMBER = re.compile(r"^\s+-\s+(\S+)\s*$")


def static_all(path: Path) -> List[str]:
    """The string literals of ``__all__`` in ``path`` (assigned, annotated or extended with ``+=``); [] without one."""
    names: List[str] = []
    found = False
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and value is not None:
            found = True
            names.extend(e.value for e in getattr(value, "elts", []) if isinstance(e, ast.Constant))
    return names if found else []


def _module_file(path: Path) -> Path:
    return path / "__init__.py" if path.is_dir() else path


def public_modules() -> Dict[str, Path]:
    """Dotted module name -> source file, for every public module (see the module docstring)."""
    found = {"fastcoll": PACKAGE / "__init__.py"}
    for child in sorted(PACKAGE.iterdir()):
        name = child.name[:-3] if child.suffix == ".py" else child.name
        is_module = child.suffix == ".py" or (child / "__init__.py").is_file()
        dotted = f"fastcoll.{name}"
        if name.startswith("_") or not is_module or dotted in EXCLUDED:
            continue
        found[dotted] = _module_file(child)
        if child.is_dir() and not static_all(_module_file(child)):
            for sub in sorted(child.glob("*.py")):
                if not sub.name.startswith("_"):
                    found[f"{dotted}.{sub.stem}"] = sub
    found.update(EXTRA_MODULES)
    return found


def public_names() -> Set[str]:
    """``module.name`` for every name in a public module's ``__all__``."""
    return {f"{module}.{name}" for module, path in public_modules().items() for name in static_all(path)}


def documented(pages: Iterable[str]) -> Set[str]:
    """Targets of ``:::`` directives and ``target.member`` for each entry of their ``members:`` lists."""
    out: Set[str] = set()
    for text in pages:
        target, in_members = None, False
        for line in text.splitlines():
            directive = _DIRECTIVE.match(line)
            if directive:
                target, in_members = directive.group(1), False
                out.add(target)
                continue
            if target is None:
                continue
            if not line.startswith(" "):  # the directive's indented options ended
                target, in_members = None, False
            elif line.strip() == "members:":
                in_members = True
            elif in_members and _MEMBER.match(line):
                out.add(f"{target}.{_MEMBER.match(line).group(1)}")
            elif in_members and line.strip().endswith(":"):  # the next option
                in_members = False
    return out


def missing(pages: Iterable[str]) -> List[str]:
    return sorted(public_names() - documented(pages))


def _api_pages() -> Dict[Path, str]:
    return {p: p.read_text() for p in sorted(API_DIR.glob("*.md"))}


def test_discovery_finds_the_public_packages():
    modules = set(public_modules())
    assert {"fastcoll", "fastcoll.ops", "fastcoll.dist", "fastcoll.optim", "fastcoll.integrations.mmengine"} <= modules
    assert "fastcoll.bench" not in modules and not any(m.split(".")[1].startswith("_") for m in modules if "." in m)
    names = public_names()
    assert {"fastcoll.DDP", "fastcoll.ShardedOptimizer", "fastcoll.ops.flatten_scale", "fastcoll.dist.init_dist"} <= names


def test_every_public_name_is_in_the_api_reference():
    pages = _api_pages()
    assert pages, f"no API pages in {API_DIR}"
    absent = missing(pages.values())
    where = API_DIR.relative_to(ROOT)
    assert not absent, f"public names missing from {where}/*.md (add a `::: module.name` or a members entry): {absent}"


def test_directive_targets_name_real_modules():
    """Every ``:::`` target starts with a public module (catches a renamed module before mkdocs does)."""
    modules = set(public_modules())
    for path, text in _api_pages().items():
        for line in text.splitlines():
            directive = _DIRECTIVE.match(line)
            if directive:
                target = directive.group(1)
                prefixes = {".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 2)}
                assert prefixes & modules, f"{path.name}: `::: {target}` names no public module"


@pytest.mark.parametrize("kind", ["member", "directive"])
def test_the_checker_notices_a_removed_name(kind):
    pages = _api_pages()
    text = "\n".join(pages.values())
    if kind == "member":
        victim, pattern = "fastcoll.ops.flatten_scale", r"(?m)^        - flatten_scale\n"
    else:
        victim, pattern = "fastcoll.DDP", r"(?m)^::: fastcoll\.DDP\n"
    assert victim not in missing([text])
    edited, count = re.subn(pattern, "", text, count=1)
    assert count == 1, f"the {kind} entry for {victim} was not found in the API pages"
    assert victim in missing([edited])


def test_readme_is_short_and_its_links_resolve():
    """README.md stays a five-minute read (<= 200 lines), and every relative link in it names a file in the repository."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines; move detail into docs/"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "README.md links nowhere"
    broken = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_every_docs_page_is_in_the_nav():
    """Each Markdown file under docs/ is reachable from mkdocs.yml's nav (mkdocs only notes omitted pages)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, flags=re.MULTILINE))
    assert pages - listed == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"
