"""The package's folders form floors: no import (at the top or inside a function) runs from a
lower folder to a higher one, so no cycle joins two folders."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

from tests.repo_paths import ROOT

REPO = Path(ROOT)

PACKAGE = REPO / "torchsupervisor"


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "torchsupervisor":
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else None


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    package = parts[-1] == "__init__"
    if package:
        parts = parts[:-1]
    return ".".join(parts), package


def _imported(node: ast.AST, module: str, package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base if package else base[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def folder_imports() -> dict[str, dict[str, set[str]]]:
    """{folder: {imported folder: the files of folder that import it}}."""
    arrows: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        module, package = _module_name(path)
        here = _folder_of(module)
        if here is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, package):
                there = _folder_of(target)
                if there is not None and there != here:
                    arrows[here][there].add(str(path.relative_to(REPO)))
    return arrows


def _cycle(arrows: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(folder: str) -> list[str] | None:
        state[folder] = 1
        path.append(folder)
        for there in sorted(arrows.get(folder, {})):
            if state.get(there) == 1:
                return [*path[path.index(there) :], there]
            if there not in state and (found := visit(there)):
                return found
        path.pop()
        state[folder] = 2
        return None

    for folder in sorted(arrows):
        if folder not in state and (found := visit(folder)):
            return found
    return None


def test_no_import_cycle_joins_two_folders():
    arrows = folder_imports()
    cycle = _cycle(arrows)
    if cycle is not None:
        steps = [
            f"{a} -> {b} ({', '.join(sorted(arrows[a][b]))})" for a, b in itertools.pairwise(cycle)
        ]
        raise AssertionError("Folders import each other:\n" + "\n".join(steps))


def test_the_core_floor_imports_no_other_folder():
    assert dict(folder_imports().get("core", {})) == {}


def test_the_cycle_finder_finds_a_cycle():
    arrows = {"a": {"b": {"a/x.py"}}, "b": {"c": {"b/y.py"}}, "c": {"a": {"c/z.py"}}}
    assert _cycle(arrows) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": {"a/x.py"}}}) is None
