"""The layout the design describes (docs/design.md §2): a package per job, no prefix families,
imports that point one way between the core's packages."""

from __future__ import annotations

import ast
import collections
import graphlib
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = [ROOT / "dedupe", *sorted((ROOT / "consumers").glob("dedupe_*"))]


def modules() -> list[Path]:
    return [path for root in PACKAGES for path in sorted(root.rglob("*.py"))]


def module_name(path: Path) -> str:
    base = ROOT / "consumers" if path.is_relative_to(ROOT / "consumers") else ROOT
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(name: str) -> str:
    """The unit the layering is about: a subpackage of the core, a top module, a transport."""
    parts = name.split(".")
    if parts[0] != "dedupe":
        return parts[0]
    return ".".join(parts[:2])


def imported(path: Path) -> set[str]:
    """The dedupe* modules a file imports at run time (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0].startswith("dedupe")}


def test_every_package_has_an_init_that_says_its_job() -> None:
    """A folder of modules is a package whose docstring says what it is for."""
    missing = []
    for root in PACKAGES:
        for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            if not any(folder.glob("*.py")):
                continue  # data only (dedupe/sql/migrations)
            init = folder / "__init__.py"
            if not init.exists() or not ast.get_docstring(ast.parse(init.read_text())):
                missing.append(str(folder.relative_to(ROOT)))
    assert missing == []


def test_no_folder_holds_a_family_of_modules_told_apart_by_a_prefix() -> None:
    """`asgi_run.py`, `asgi_keys.py`, ... belong in a package `asgi/`."""
    families = []
    for root in [*PACKAGES, ROOT / "consumers"]:
        for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            prefixes = collections.Counter(
                p.stem.split("_")[0] for p in folder.glob("*.py") if "_" in p.stem.strip("_")
            )
            families += [f"{folder.relative_to(ROOT)}/{k}_*" for k, n in prefixes.items() if n > 2]
    assert families == []


def test_the_core_and_the_transports_import_each_other_in_no_circle() -> None:
    """Between the core's packages (and its top modules, and each transport) imports run one
    way: the graph of rooms has an order."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in modules():
        here = room(module_name(path))
        graph[here] |= {room(name) for name in imported(path)} - {here, "dedupe"}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"an import circle between packages: {exc.args[1]}")


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("dedupe.claims", {"dedupe.errors", "dedupe.message", "dedupe.sql"}),
        ("dedupe.sql", set()),
        ("dedupe.webhooks", {"dedupe.errors", "dedupe.message", "dedupe.claims"}),
    ],
)
def test_the_low_packages_import_nothing_above_them(package: str, allowed: set[str]) -> None:
    """The claim protocol knows no pipeline, transport, handler or HTTP."""
    above = {
        f"{module_name(path)} -> {name}"
        for path in modules()
        if room(module_name(path)) == package
        for name in imported(path)
        if room(name) not in {package, *allowed}
    }
    assert above == set()


def test_only_a_package_face_hands_on_names_it_does_not_define() -> None:
    """No re-export shims: outside `__init__.py`, `__all__` lists what the module defines and
    no import is written `X as X` to be handed on."""
    shims = []
    for path in modules():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        } | {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                shims += [
                    f"{module_name(path)}: {a.name} as {a.asname}"
                    for a in node.names
                    if a.asname == a.name
                ]
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = {e.value for e in getattr(node.value, "elts", [])}
                shims += [f"{module_name(path)}: __all__ {n}" for n in sorted(listed - defined)]
    assert shims == []
