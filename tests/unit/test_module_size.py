"""No module of the packages is longer than ``MAX_LINES``: a longer one holds several concerns.

Split such a module by concern (a stage, a port, a policy), not by line count;
docs/architecture.md says where each concern lives.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "common", "producers", "workers", "demo")
MAX_LINES = 400


def long_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, int]:
    """Modules over ``MAX_LINES`` lines, with their lengths, by path from ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_over_the_limit() -> None:
    assert long_modules(ROOT) == {}


def test_the_limit_is_found(tmp_path: Path) -> None:
    (tmp_path / "workers" / "tasks").mkdir(parents=True)
    (tmp_path / "workers" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "workers" / "tasks" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path, ("workers",)) == {"workers/tasks/long.py": MAX_LINES + 1}
