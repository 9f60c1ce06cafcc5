"""Dependencies point one way: schemas ← common ← producers, workers; demo above them all.

Every module of the five packages is parsed (``ast``), not imported, so every
import counts: at the top of a module, inside a function, under
``TYPE_CHECKING``, relative ones, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name. The rules:

- ``schemas`` is the wire contract and does no I/O: it imports only itself, the
  pure standard-library modules of ``SCHEMAS_MAY_IMPORT`` and pydantic and orjson
  (no sockets, files, subprocesses, event loops, Kafka, Redis or S3 clients);
- ``common`` (what the client and the worker share) imports none of ``producers``,
  ``workers`` and ``demo``;
- ``producers`` (the SDK and its commands) and ``workers`` (the server) import
  neither each other nor ``demo``; ``conveyor worker`` reaches the worker through an
  entry point (``producers/cli.py``), and the demo models through the worker's
  user-class path (``workers/model/loader.py``);
- ``demo`` is a client of a worker and may import anything.

The checker is tried on synthetic trees too, so that a rule that stopped
matching would fail here rather than pass in silence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.imports import Import, imports_in, module_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "common", "producers", "workers", "demo")

FORBIDDEN: dict[str, frozenset[str]] = {
    "common": frozenset({"producers", "workers", "demo"}),
    "producers": frozenset({"workers", "demo"}),
    "workers": frozenset({"producers", "demo"}),
}
"""Packages each package must not import (by top-level name)."""

SCHEMAS_MAY_IMPORT = frozenset(
    {
        # The standard library's pure modules: data, text, numbers, types.
        "__future__",
        "array",
        "base64",
        "binascii",
        "collections",
        "copy",
        "dataclasses",
        "datetime",
        "decimal",
        "enum",
        "fractions",
        "functools",
        "hashlib",
        "itertools",
        "json",
        "math",
        "operator",
        "re",
        "secrets",
        "string",
        "struct",
        "tomllib",  # parses a str: a feature schema's text (schemas.features)
        "sys",  # sys.byteorder; nothing here reads or writes its streams
        "types",
        "typing",
        "urllib.parse",
        "uuid",
        # Validation and JSON encoding, both pure.
        "pydantic",
        "orjson",
        # The package itself.
        "schemas",
    }
)
"""Everything ``schemas`` may import: a module here, or a submodule of one."""


def broken_rules(imports: Iterator[Import] | list[Import]) -> list[str]:
    """The imports that break a rule of the module doc, each said in one line."""
    broken = []
    for found in imports:
        package = found.module.partition(".")[0]
        root = found.target.partition(".")[0]
        if package == "schemas" and not _allowed_in_schemas(found.target):
            broken.append(f"{found.where}: schemas does no I/O (see SCHEMAS_MAY_IMPORT)")
        elif root in FORBIDDEN.get(package, ()):
            broken.append(f"{found.where}: {package} must not depend on {root}")
    return broken


def _allowed_in_schemas(target: str) -> bool:
    parts = target.split(".")
    return any(".".join(parts[:n]) in SCHEMAS_MAY_IMPORT for n in range(1, len(parts) + 1))


def tree_imports(root: Path) -> Iterator[Import]:
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            yield from imports_in(
                path.read_text(), module_name(path, root), path.name == "__init__.py"
            )


def test_the_packages_depend_on_each_other_one_way_only() -> None:
    found = list(tree_imports(ROOT))
    assert len(found) > 500, "the parser found too few imports to be reading the packages"
    assert broken_rules(found) == []


def test_the_rules_see_the_imports_the_code_has() -> None:
    """The real tree has the edges the rules allow: seen, and let through."""
    targets = {(i.module.partition(".")[0], i.target.partition(".")[0]) for i in tree_imports(ROOT)}
    assert {("workers", "common"), ("producers", "common"), ("demo", "workers")} <= targets
    assert {("demo", "producers"), ("producers", "schemas"), ("schemas", "pydantic")} <= targets


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("workers/a.py", "from producers import Client\n", "workers must not depend on producers"),
        ("workers/a.py", "def f():\n    import producers.client\n", "on producers"),
        ("producers/b.py", "import workers.cli as cli\n", "producers must not depend on workers"),
        (
            "producers/b.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers import app\n",
            "on workers",
        ),
        ("producers/b.py", "from demo.models import digits\n", "producers must not depend on demo"),
        (
            "workers/c.py",
            'import importlib\nimportlib.import_module("demo.models.digits")\n',
            "demo",
        ),
        ("workers/sub/d.py", "from ...producers import cli\n", "on producers"),
        ("common/e.py", "from workers.config.worker import WorkerSettings\n", "common must not"),
        ("common/e.py", "from producers.errors import ClientError\n", "common must not"),
        ("schemas/f.py", "import socket\n", "schemas does no I/O"),
        ("schemas/f.py", "import asyncio\n", "schemas does no I/O"),
        ("schemas/f.py", "from asyncio import streams\n", "schemas does no I/O"),
        ("schemas/f.py", "import subprocess\n", "schemas does no I/O"),
        ("schemas/f.py", "from urllib import request\n", "schemas does no I/O"),
        ("schemas/f.py", "def f():\n    import aiokafka\n", "schemas does no I/O"),
        ("schemas/f.py", "import redis.asyncio as aioredis\n", "schemas does no I/O"),
        ("schemas/f.py", "import httpx\n", "schemas does no I/O"),
        ("schemas/f.py", "from aiobotocore.session import get_session\n", "schemas does no I/O"),
        ("schemas/f.py", "from common.security import kafka_options\n", "schemas does no I/O"),
        ("schemas/f.py", "__import__('os')\n", "schemas does no I/O"),
    ],
)
def test_a_forbidden_import_is_found(tmp_path: Path, name: str, code: str, words: str) -> None:
    root = _write(tmp_path, {name: code})
    [broken] = broken_rules(tree_imports(root))
    assert broken.startswith(f"{module_name(root / name, root)}:")
    assert words in broken


def test_allowed_imports_pass(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "schemas/ok.py": "from collections.abc import Sequence\n"
            "from urllib.parse import quote\nimport orjson\nfrom pydantic import BaseModel\n"
            "from . import naming\n",
            "common/ok.py": "from schemas import Limits\nimport aiokafka\n",
            "producers/ok.py": "from common.security import kafka_options\nimport schemas\n",
            "workers/ok.py": "from common import security\nimport torch\n",
            "demo/ok.py": "from producers import AsyncClient\n"
            "from workers.handlers import Handler\n",
        },
    )
    found = list(tree_imports(root))
    assert {i.target for i in found} >= {
        "schemas.naming",
        "common.security",
        "workers.handlers.Handler",
    }
    assert broken_rules(found) == []
