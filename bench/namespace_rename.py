"""Move Conveyor's imports to the ``conveyor_serve`` namespace, once, then delete this file.

    .venv/bin/python bench/namespace_rename.py    # repository root, clean tree, ruff installed

docs/packaging.md explains the decision. The folders ``schemas/``, ``workers/``
and ``producers/`` stay where they are; ``pyproject.toml`` maps them to
``conveyor_serve.schemas`` and friends with setuptools' ``package-dir``. This
script rewrites, in every file git tracks:

- ``from schemas... import`` and ``import schemas`` (and the same for
  ``workers`` and ``producers``) in Python code and in code shown in docs;
- module paths written as strings, in backticks or after ``python -m``
  (``"producers.cli"``, ``python -m workers.demo``, ``"workers.cli:main"``),
  and a package named on its own in Markdown (the ``producers`` package);
- ``pyproject.toml`` (package mapping, mypy's packages, ruff's first-party
  package, the ban on top-level imports), the ``Makefile`` (the strict editable
  install that mypy and editors can follow), and docs/packaging.md's status;

then runs ``ruff check --fix`` and ``ruff format``, prints what is left for a
person (lines grown too long, ``import pkg.module`` statements whose uses need
the new name), and deletes itself. Reinstall afterwards: ``rm .venv/.installed
&& make install``, then ``make lint`` and ``make test``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "conveyor_serve"
PACKAGES = ("schemas", "workers", "producers")
_PKG = "(" + "|".join(PACKAGES) + ")"
REWRITTEN_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".txt", ".cfg"}
REWRITTEN_NAMES = {"Makefile", "Dockerfile.worker"}

RULES: list[tuple[re.Pattern[str], str]] = [
    # from schemas import X / from workers.cli import run
    (re.compile(rf"^(\s*)from {_PKG}(?=[.\s])", re.M), rf"\1from {NAMESPACE}.\2"),
    # import schemas  ->  from conveyor_serve import schemas (the bound name is unchanged)
    (re.compile(rf"^(\s*)import {_PKG}(\s*(?:#.*)?)$", re.M), rf"\1from {NAMESPACE} import \2\3"),
    # import workers.cli as cli  ->  import conveyor_serve.workers.cli as cli
    (re.compile(rf"^(\s*)import {_PKG}\.", re.M), rf"\1import {NAMESPACE}.\2."),
    # "producers.cli", 'demo.models.digits', `schemas.Limits`, "producers.cli:main"
    (re.compile(rf"([\"'`]){_PKG}([.:])(?=[A-Za-z_])"), rf"\1{NAMESPACE}.\2\3"),
    # python -m workers.demo
    (re.compile(rf"(-m\s+){_PKG}\."), rf"\1{NAMESPACE}.\2."),
    # import workers.cli as cli; print(cli.settings_reference()) in a one-line command
    (re.compile(rf"(['\"]import ){_PKG}\."), rf"\1{NAMESPACE}.\2."),
]

PYPROJECT_EDITS = [
    (
        '[tool.setuptools.packages.find]\ninclude = ["schemas*", "workers*", "producers*"]\n',
        "[tool.setuptools]\n"
        "# One import namespace, mapped from the top-level folders (docs/packaging.md).\n"
        'package-dir = {"conveyor_serve.schemas" = "schemas", '
        '"conveyor_serve.workers" = "workers", "conveyor_serve.producers" = "producers"}\n'
        'packages = ["conveyor_serve.schemas", "conveyor_serve.workers", '
        '"conveyor_serve.producers"]\n',
    ),
    (
        'packages = ["schemas", "workers", "producers"]\n',
        'packages = ["conveyor_serve.schemas", "conveyor_serve.workers", '
        '"conveyor_serve.producers"]\n',
    ),
    ('extend-exclude = [".cache", ".run"]\n', 'extend-exclude = [".cache", ".run", "build"]\n'),
    ('select = ["E", "F", "W", "I",', 'select = ["E", "F", "W", "I", "TID",'),
    (
        "[tool.ruff.lint.mccabe]\n",
        "[tool.ruff.lint.isort]\n"
        'known-first-party = ["conveyor_serve"]\n\n'
        "# The same files under a second name would be a second copy of every class.\n"
        "[tool.ruff.lint.flake8-tidy-imports.banned-api]\n"
        '"schemas".msg = "import conveyor_serve.schemas"\n'
        '"workers".msg = "import conveyor_serve.workers"\n'
        '"producers".msg = "import conveyor_serve.producers"\n\n'
        "[tool.ruff.lint.mccabe]\n",
    ),
]

MAKEFILE_EDITS = [
    (
        "$(STAMP): pyproject.toml\n",
        "# The strict editable install links each module into build/, where mypy and\n"
        "# editors find conveyor_serve.*; the links are redone when modules come or go.\n"
        "MODULES := $(sort $(wildcard schemas/*.py workers/*.py producers/*.py))\n"
        "$(shell mkdir -p $(VENV) && echo '$(MODULES)' | cmp -s - $(VENV)/.modules"
        " || echo '$(MODULES)' >$(VENV)/.modules)\n\n"
        "$(STAMP): pyproject.toml $(VENV)/.modules\n",
    ),
    (
        "\t$(PY) -m pip install --quiet -e '.[worker,video,dev]'\n",
        "\t$(PY) -m pip install --quiet -e '.[worker,video,dev]' "
        "--config-settings editable_mode=strict\n",
    ),
]

# In Markdown, a package named on its own: "the `producers` package". docs/packaging.md
# is left alone: it discusses the bare names themselves.
BARE_NAME = re.compile(rf"`{_PKG}`")
BARE_NAME_SKIPPED = {"docs/packaging.md"}

STATUS_BEFORE = "**Status.** The repository still installs the top-level packages;"
STATUS_AFTER = (
    "**Status.** Applied: the packages install as `conveyor_serve.schemas`,\n"
    "`conveyor_serve.workers` and `conveyor_serve.producers`.\n"
)


def main() -> int:
    if subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False).returncode:
        print("commit or stash your changes first: this rewrites many files", file=sys.stderr)
        return 1
    changed = [path for path in _tracked() if _rewrite(path)]
    _edit(ROOT / "pyproject.toml", PYPROJECT_EDITS)
    _edit(ROOT / "Makefile", MAKEFILE_EDITS)
    _replace_status(ROOT / "docs" / "packaging.md")
    ruff = [sys.executable, "-m", "ruff"]
    subprocess.run([*ruff, "check", "--fix", "--quiet", "."], cwd=ROOT, check=False)
    subprocess.run([*ruff, "format", "--quiet", "."], cwd=ROOT, check=False)
    print(f"rewrote {len(changed)} files, pyproject.toml, Makefile and docs/packaging.md")
    left = subprocess.run([*ruff, "check", "."], cwd=ROOT, check=False, capture_output=True)
    if left.returncode:
        print("left for a person (ruff):\n" + left.stdout.decode(), file=sys.stderr)
    _report_dotted_imports()
    Path(__file__).unlink()
    print("next: rm -f .venv/.installed && make install && make lint && make test")
    return 0


def _tracked() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    me = Path(__file__).resolve()
    return [
        ROOT / name
        for name in names
        if (ROOT / name).resolve() != me
        and ((ROOT / name).suffix in REWRITTEN_SUFFIXES or Path(name).name in REWRITTEN_NAMES)
    ]


def _rewrite(path: Path) -> bool:
    text = path.read_text()
    new = text
    for pattern, replacement in RULES:
        new = pattern.sub(replacement, new)
    if path.suffix == ".md" and path.relative_to(ROOT).as_posix() not in BARE_NAME_SKIPPED:
        new = BARE_NAME.sub(rf"`{NAMESPACE}.\1`", new)
    if new != text:
        path.write_text(new)
    return new != text


def _edit(path: Path, edits: list[tuple[str, str]]) -> None:
    text = path.read_text()
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"{path.name}: expected text not found, edit by hand: {old!r}")
        text = text.replace(old, new, 1)
    path.write_text(text)


def _replace_status(path: Path) -> None:
    text = path.read_text()
    start = text.index(STATUS_BEFORE)
    path.write_text(text[:start] + STATUS_AFTER)


def _report_dotted_imports() -> None:
    dotted = re.compile(rf"^\s*import {NAMESPACE}\.\w+(\.\w+)*\s*$", re.M)
    # Code inside a string (run with python -c): the rules above do not rewrite it.
    in_string = re.compile(rf"^\s*(?!from |import )\S.*\bimport {_PKG}\b", re.M)
    for path in _tracked():
        if path.suffix != ".py":
            continue
        text = path.read_text()
        if dotted.search(text):
            print(f"check the uses of a plain `import {NAMESPACE}....` in {path}", file=sys.stderr)
        for match in in_string.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            print(f"rewrite the import inside a string: {path}:{line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
