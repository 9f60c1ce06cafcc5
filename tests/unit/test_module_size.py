"""Module length as a review signal: a warning past ``REVIEW_LINES``, a failure past ``MAX_LINES``.

A module is split when it holds two concerns, not when it crosses a line count: a
long module that is one thing (a stage, a port, a policy) stays whole. Past
``REVIEW_LINES`` the test run warns, so that a reviewer looks; past ``MAX_LINES``
no single concern is that long, and the test fails. docs/architecture.md says
where each concern lives.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "common", "producers", "workers", "demo")
REVIEW_LINES = 400
MAX_LINES = 800


def long_modules(root: Path, limit: int, packages: tuple[str, ...] = PACKAGES) -> dict[str, int]:
    """Modules over ``limit`` lines, with their lengths, by path from ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found[path.relative_to(root).as_posix()] = lines
    return found


class LongModule(UserWarning):
    """A module past ``REVIEW_LINES``: worth a look for a second concern."""


@pytest.mark.filterwarnings("always::tests.unit.test_module_size.LongModule")
def test_long_modules_are_named_for_review() -> None:
    for path, lines in long_modules(ROOT, REVIEW_LINES).items():
        warnings.warn(
            f"{path} has {lines} lines: does it hold more than one concern?", LongModule, 1
        )


def test_no_module_is_past_the_hard_limit() -> None:
    assert long_modules(ROOT, MAX_LINES) == {}


def test_the_limit_is_found(tmp_path: Path) -> None:
    (tmp_path / "workers" / "tasks").mkdir(parents=True)
    (tmp_path / "workers" / "short.py").write_text("x = 1\n" * REVIEW_LINES)
    (tmp_path / "workers" / "tasks" / "long.py").write_text("x = 1\n" * (REVIEW_LINES + 1))
    assert long_modules(tmp_path, REVIEW_LINES, ("workers",)) == {
        "workers/tasks/long.py": REVIEW_LINES + 1
    }
