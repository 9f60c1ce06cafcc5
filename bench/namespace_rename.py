"""Move Conveyor's imports to the ``conveyor_serve`` namespace, once, then delete this file.

    .venv/bin/python bench/namespace_rename.py    # repository root, clean tree, ruff installed

docs/packaging.md explains the decision. The folders ``schemas/``, ``common/``,
``workers/``, ``producers/`` and ``demo/`` stay where they are; ``pyproject.toml``
maps them to ``conveyor_serve.schemas`` and friends with setuptools' ``package-dir``.
This script rewrites, in every file git tracks:

- ``from schemas... import`` and ``import schemas`` (and the same for the other
  packages) in Python code and in code shown in docs;
- module paths written as strings, in backticks or after ``python -m``
  (``"producers.cli"``, ``python -m demo.digits``, ``"workers.cli:configure"``),
  and a package named on its own in Markdown (the ``producers`` package);
- ``pyproject.toml`` (package mapping, mypy's packages, ruff's first-party
  package, the ban on top-level imports), the ``Makefile`` (the strict editable
  install that mypy and editors can follow), and docs/packaging.md's status;

then runs ``ruff check --fix`` and ``ruff format``, prints what is left for a
person (lines grown too long, ``import pkg.module`` statements whose uses need
the new name, tests that read package names off module names), and deletes
itself. Every edit of ``pyproject.toml``, the ``Makefile`` and docs/packaging.md
is checked before any file is written, so a layout this script no longer matches
stops it with the tree untouched. Reinstall afterwards: ``rm .venv/.installed &&
make install``, then ``make lint`` and ``make test``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "conveyor_serve"
PACKAGES = ("schemas", "common", "workers", "producers", "demo")
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
    # "producers.cli", 'demo.models.digits', `schemas.Limits`, "producers.cli:main";
    # not a file name such as `schemas.py`
    (re.compile(rf"([\"'`]){_PKG}([.:])(?=[A-Za-z_])(?!py\b)"), rf"\1{NAMESPACE}.\2\3"),
    # python -m demo.digits, --model demo.models.detector:DigitsDetector
    (re.compile(rf"(-m\s+|--model[ =]){_PKG}\."), rf"\1{NAMESPACE}.\2."),
    # import workers.cli as cli; print(cli.settings_reference()) in a one-line command
    (re.compile(rf"(['\"]import ){_PKG}\."), rf"\1{NAMESPACE}.\2."),
]

# In Markdown, a package named on its own: "the `producers` package". docs/packaging.md
# is left alone: it discusses the bare names themselves.
BARE_NAME = re.compile(rf"`{_PKG}`")
BARE_NAME_SKIPPED = {"docs/packaging.md"}

STATUS = re.compile(
    r"^\*\*Status\.\*\* The repository still installs the top-level packages;.*", re.S | re.M
)

# What must match exactly once, and what replaces it (a template, or made from the match).
Edit = tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]


_QUOTED_PACKAGE = re.compile(rf'"{_PKG}"')


def _pyproject_edits() -> list[Edit]:
    mapped = ", ".join(f'"{NAMESPACE}.{name}" = "{name}"' for name in PACKAGES)
    listed = ", ".join(f'"{name}"' for name in _packages_in_tree())
    banned = "".join(f'"{name}".msg = "import {NAMESPACE}.{name}"\n' for name in PACKAGES)
    return [
        (
            re.compile(r"^\[tool\.setuptools\.packages\.find\]\ninclude = \[[^\]\n]*\]\n", re.M),
            "[tool.setuptools]\n"
            "# One import namespace, mapped from the top-level folders (docs/packaging.md).\n"
            f"package-dir = {{{mapped}}}\n"
            f"packages = [{listed}]\n",
        ),
        # mypy's packages: the first `packages =` line after [tool.mypy]; other entries
        # (tests, bench) are kept as they are
        (
            re.compile(r"^\[tool\.mypy\]\n(?:[^\[\n].*\n|\n)*?packages = \[[^\]\n]*\]\n", re.M),
            lambda found: _QUOTED_PACKAGE.sub(rf'"{NAMESPACE}.\1"', found.group(0)),
        ),
        (
            re.compile(r"^extend-exclude = \[([^\]\n]*)\]\n", re.M),
            r'extend-exclude = [\g<1>, "build"]\n',
        ),
        (re.compile(r'^select = \["', re.M), 'select = ["TID", "'),
        (
            re.compile(r"^\[tool\.ruff\.lint\.mccabe\]\n", re.M),
            "[tool.ruff.lint.isort]\n"
            f'known-first-party = ["{NAMESPACE}"]\n\n'
            "# The same files under a second name would be a second copy of every class.\n"
            "[tool.ruff.lint.flake8-tidy-imports.banned-api]\n"
            f"{banned}\n"
            "[tool.ruff.lint.mccabe]\n",
        ),
    ]


def _makefile_edits() -> list[Edit]:
    modules = " ".join(f"{name}/*.py {name}/*/*.py" for name in PACKAGES)
    return [
        (
            re.compile(r"^\$\(STAMP\): pyproject\.toml\n", re.M),
            "# The strict editable install links each module into build/, where mypy and\n"
            "# editors find conveyor_serve.*; the links are redone when modules come or go.\n"
            f"MODULES := $(sort $(wildcard {modules}))\n"
            "$(shell mkdir -p $(VENV) && echo '$(MODULES)' | cmp -s - $(VENV)/.modules"
            " || echo '$(MODULES)' >$(VENV)/.modules)\n\n"
            "$(STAMP): pyproject.toml $(VENV)/.modules\n",
        ),
        (
            re.compile(r"(pip install --quiet -e '\.\[[^\]\n]*\]')\n"),
            r"\g<1> --config-settings editable_mode=strict\n",
        ),
    ]


def _status_edits() -> list[Edit]:
    *rest, last = [f"`{NAMESPACE}.{name}`" for name in PACKAGES]
    status = f"**Status.** Applied: the packages install as {', '.join(rest)} and {last}."
    return [(STATUS, textwrap.fill(status, width=80) + "\n")]


def main() -> int:
    if subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False).returncode:
        print("commit or stash your changes first: this rewrites many files", file=sys.stderr)
        return 1
    # Everything is worked out before anything is written: a failed edit leaves no trace.
    new = {path: _rewritten(path) for path in _tracked()}
    edits = {
        ROOT / "pyproject.toml": _pyproject_edits(),
        ROOT / "Makefile": _makefile_edits(),
        ROOT / "docs" / "packaging.md": _status_edits(),
    }
    for path, path_edits in edits.items():
        new[path] = _edited(path, new.get(path, path.read_text()), path_edits)
    changed = [path for path, text in new.items() if text != path.read_text()]
    for path in changed:
        path.write_text(new[path])
    ruff = [sys.executable, "-m", "ruff"]
    subprocess.run([*ruff, "check", "--fix-only", "--quiet", "."], cwd=ROOT, check=False)
    subprocess.run([*ruff, "format", "--quiet", "."], cwd=ROOT, check=False)
    print(
        f"rewrote {len(changed)} files, pyproject.toml, Makefile and docs/packaging.md among them"
    )
    left = subprocess.run([*ruff, "check", "."], cwd=ROOT, check=False, capture_output=True)
    if left.returncode:
        print("left for a person (ruff):\n" + left.stdout.decode(), file=sys.stderr)
    _report_dotted_imports()
    print(
        "by hand: tests/unit/test_import_graph.py and tests/unit/test_conveyor_command.py"
        f" take a module's package from its first name, now {NAMESPACE}: use the second",
        file=sys.stderr,
    )
    Path(__file__).unlink()
    print("next: rm -f .venv/.installed && make install && make lint && make test")
    return 0


def _git_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()


def _tracked() -> list[Path]:
    me = Path(__file__).resolve()
    return [
        ROOT / name
        for name in _git_files()
        if (ROOT / name).resolve() != me
        and ((ROOT / name).suffix in REWRITTEN_SUFFIXES or Path(name).name in REWRITTEN_NAMES)
    ]


def _packages_in_tree() -> list[str]:
    """Every package and subpackage under the namespace: with ``package-dir``,
    setuptools installs only the packages listed, not their subpackages."""
    folders = [Path(name).parent for name in _git_files() if Path(name).name == "__init__.py"]
    return sorted(
        f"{NAMESPACE}." + ".".join(folder.parts)
        for folder in folders
        if folder.parts and folder.parts[0] in PACKAGES
    )


def _rewritten(path: Path) -> str:
    text = path.read_text()
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    if path.suffix == ".md" and path.relative_to(ROOT).as_posix() not in BARE_NAME_SKIPPED:
        text = BARE_NAME.sub(rf"`{NAMESPACE}.\1`", text)
    return text


def _edited(path: Path, text: str, edits: list[Edit]) -> str:
    for pattern, replacement in edits:
        text, count = pattern.subn(replacement, text)
        if count != 1:
            raise SystemExit(
                f"{path.relative_to(ROOT)}: {pattern.pattern!r} matched {count} times, not once;"
                " nothing was written: update this script's edits for the file as it is now"
            )
    return text


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
