"""The import rules of the library tree, checked on the AST of every ``tokenmill`` module.

(a) No module imports Dagster or the repo's Dagster/dev side (``assets``, ``pipelines``,
    ``tokenmill_dev``). (b) A leading-underscore module or name is imported only from inside its
own package. (c) What ``tokenmill.loader`` imports, transitively, is an allow-list: numpy, the
standard library, its own modules and the foundation they stand on; torch only in
``tokenmill.loader.torch``. (d) No import cycles. (e) Stages point one way: a module imports
only from its own stage or a lower one (LAYERS). Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenmill"

# stage -> rank; a module may import its own stage or a lower rank, never a higher or equal one
LAYERS = {
    "base": 0,  # tokenmill, tokenmill.errors, tokenmill.atomic, tokenmill.paths
    "formats": 1,  # on-disk formats: writer + reader per format
    "loader": 2,  # what training imports
    "ingest": 3,
    "storage": 3,
    "tokenize": 4,
    "indices": 4,
    "app": 5,  # recipe, verify, the DESIGN-contract re-exports (nanoset, blend)
    "commands": 6,
    "cli": 7,
}
BASE = {"tokenmill", "tokenmill.errors", "tokenmill.atomic", "tokenmill.paths"}
APP = {
    "tokenmill.recipe",
    "tokenmill.verify",
    "tokenmill.nanoset",
    "tokenmill.blend",
    "tokenmill.provenance",
    "tokenmill.lineage",
    "tokenmill.takedown",
}
FORBIDDEN_TOP = {"dagster", "assets", "pipelines", "tokenmill_dev"}
# the imports that point up, with their reasons: open_blend("s3://...") reuses pull's plan of a
# blend's files and the one S3 client factory (boto3), lazily, in tokenmill.loader._s3 only;
# importing the loader never reaches them (rule c checks it at run time)
UPWARD_EXCEPTIONS = {
    ("tokenmill.loader", "tokenmill.storage.pull"),
    ("tokenmill.loader", "tokenmill.storage.s3"),
}
LOADER_EXTERNAL = {"numpy"} | set(sys.stdlib_module_names)
LOADER_OPTIONAL = {"tokenmill.loader.torch": {"torch"}}


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from ``source``."""

    source: str
    target: str  # dotted module imported (a tokenmill module when internal)
    names: tuple[str, ...]  # names taken from it (``from target import names``)
    line: int

    def __str__(self) -> str:
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else self.target
        return f"{self.source} (line {self.line}): {what}"


def module_name(path: Path) -> str:
    """Dotted name of a file under the repo root."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    """True for a package (its ``__init__.py``)."""
    return MODULES[name].name == "__init__.py"


def package_of(name: str) -> str:
    """The package a module belongs to (a package belongs to itself)."""
    return name if is_package(name) else name.rsplit(".", 1)[0]


def imports_of(name: str) -> list[Import]:
    """Every import in a module, at any depth; ``from pkg import module`` targets the module."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(name).split(".")[
                    : len(package_of(name).split(".")) - node.level + 1
                ]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "__future__":
                continue
            plain = []
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.append(Import(name, f"{base}.{alias.name}", (), node.lineno))
                else:
                    plain.append(alias.name)
            if plain:
                out.append(Import(name, base, tuple(plain), node.lineno))
    return out


IMPORTS = {name: imports_of(name) for name in MODULES}


def internal(imp: Import) -> bool:
    """The import targets a tokenmill module."""
    return imp.target in MODULES


def stage_of(name: str) -> str:
    """The stage (LAYERS key) a tokenmill module belongs to."""
    if name in BASE:
        return "base"
    if name in APP:
        return "app"
    if name == "tokenmill.cli":
        return "cli"
    stage = name.split(".")[1]
    assert stage in LAYERS, f"{name}: not in any stage of LAYERS; add its folder there"
    return stage


def test_every_module_has_a_stage() -> None:
    unplaced = [name for name in MODULES if stage_of(name) not in LAYERS]
    assert not unplaced, f"modules outside LAYERS: {unplaced}"


def test_a_no_dagster_nor_repo_side_imports() -> None:
    bad = [
        str(imp)
        for imps in IMPORTS.values()
        for imp in imps
        if imp.target.split(".")[0] in FORBIDDEN_TOP or imp.target.startswith("dagster_")
    ]
    assert not bad, "the library imports the Dagster/dev side:\n  " + "\n  ".join(bad)


def private_owner(imp: Import) -> str | None:
    """The package that owns the private module or name an import reaches, if any."""
    parts = imp.target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    if any(n.startswith("_") and not n.startswith("__") for n in imp.names) and internal(imp):
        return package_of(imp.target)
    return None


def test_b_private_modules_and_names_stay_in_their_package() -> None:
    bad = []
    for imps in IMPORTS.values():
        for imp in imps:
            owner = private_owner(imp)
            if owner and internal(imp) and package_of(imp.source) != owner:
                bad.append(f"{imp}  (private to {owner})")
    assert not bad, "private imports across packages:\n  " + "\n  ".join(bad)


def loader_closure() -> dict[str, list[Import]]:
    """Every tokenmill module the loader package reaches, with its imports."""
    todo = [name for name in MODULES if stage_of(name) == "loader"]
    seen: dict[str, list[Import]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = IMPORTS[name]
        for imp in IMPORTS[name]:
            if internal(imp) and (package_of(name), imp.target) not in UPWARD_EXCEPTIONS:
                todo.append(imp.target)
    return seen


def test_c_loader_imports_only_numpy_stdlib_and_its_foundation() -> None:
    closure = loader_closure()
    bad = []
    for name, imps in closure.items():
        if stage_of(name) not in ("base", "formats", "loader"):
            bad.append(f"{name}: reached from tokenmill.loader")
        allowed = LOADER_EXTERNAL | LOADER_OPTIONAL.get(name, set())
        for imp in imps:
            if not internal(imp) and imp.target.split(".")[0] not in allowed:
                bad.append(str(imp))
    assert not bad, "tokenmill.loader's import closure leaves its allow-list:\n  " + "\n  ".join(
        bad
    )


def test_c_importing_the_loader_loads_only_the_allow_list() -> None:
    """The same rule at run time, in a fresh interpreter (the torch adapter aside)."""
    code = (
        "import sys; before = set(sys.modules); import tokenmill.loader\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = out.stdout.split()
    assert "tokenmill.loader" in loaded
    bad = [
        m
        for m in loaded
        if m.split(".")[0] not in LOADER_EXTERNAL
        and not (m in MODULES and stage_of(m) in ("base", "formats", "loader"))
        and not m.startswith("_")  # interpreter internals (e.g. _frozen_importlib_external)
    ]
    tops = sorted({m.split(".")[0] for m in bad})
    assert not bad, f"importing tokenmill.loader loaded {len(bad)} modules outside it, from {tops}"


def test_d_no_import_cycles() -> None:
    graph = {name: {i.target for i in imps if internal(i)} for name, imps in IMPORTS.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_e_stages_point_one_way() -> None:
    bad = []
    for name, imps in IMPORTS.items():
        mine = stage_of(name)
        for imp in imps:
            if not internal(imp) or (package_of(name), imp.target) in UPWARD_EXCEPTIONS:
                continue
            theirs = stage_of(imp.target)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{imp}  ({mine} may not import {theirs})")
    assert not bad, "imports that point up or sideways:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("contract", "home"),
    [
        ("tokenmill.nanoset.split_ranges", "tokenmill.indices.nanoset.split_ranges"),
        (
            "tokenmill.nanoset.build_nanoset_indices",
            "tokenmill.indices.nanoset.build_nanoset_indices",
        ),
        ("tokenmill.blend.build_blend_indices", "tokenmill.indices.blend.build_blend_indices"),
        ("tokenmill.blend.blend_sample_counts", "tokenmill.indices.blend.blend_sample_counts"),
    ],
)
def test_design_contract_paths_are_the_library_functions(contract: str, home: str) -> None:
    """The DESIGN API paths external tests call still resolve, to the one implementation."""
    import importlib

    def resolve(dotted: str) -> object:
        module, attr = dotted.rsplit(".", 1)
        return getattr(importlib.import_module(module), attr)

    assert resolve(contract) is resolve(home)


def test_the_wheel_holds_the_library_only() -> None:
    """tokenmill_dev (demo corpus, test tokenizers) and the Dagster side stay out of the wheel."""
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    found = find_packages(str(ROOT), include=include)
    assert "tokenmill.loader" in found and "tokenmill.indices" in found
    assert not [p for p in found if not (p == "tokenmill" or p.startswith("tokenmill."))], found
