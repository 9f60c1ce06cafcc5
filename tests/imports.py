"""Every import of a Python module, read from its source (``ast``), not by importing it.

Shared by the tests of the import rules (``tests/unit/test_import_graph.py``) and of
the rooms of ``workers/`` (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import found in a module's source."""

    module: str  # the importing module, e.g. workers.cli
    target: str  # what it imports, dotted: a module, or a module and a name from it
    line: int

    @property
    def where(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import of ``source``, the code of ``module``, wherever it stands."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package upwards
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Call) and _imports_by_name(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield Import(module, first.value, node.lineno)


def _imports_by_name(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"
